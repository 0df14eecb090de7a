"""Well-behaved streaming clients against a running stack, in a process of their own (so that what
the test process does meanwhile, under its GIL, does not delay their reads): gRPC `Generate`
streams and HTTP SSE streams, each asking one long greedy generation after another. They record
the gap between successive token messages of a stream, tagged with the phase the test set when
the later one arrived, and how each generation ended.

    with SteadyStreams(stack, key) as streams:   # returns once every client has its first token
        streams.phase("baseline"); time.sleep(5)
        streams.phase("hostile"); ...
    streams.result  # {"gaps": {phase: [seconds]}, "long_gaps": [(began, seconds)], "ends": [...], "errors": [...]}

Run as `python -m tests.helpers.steady_streams ARGS_JSON`: reads `phase NAME` and `stop` lines
on stdin, prints `ready` once every client has streamed a token, and the result as one JSON line
at the end."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import defaultdict
from typing import Any

from hetero_infer.bench.harness import REPO_ROOT, Stack

PROMPT = "The quick brown fox"
LONG_GAP_S = 0.1  # gaps this long are also listed with when they began, to tell what held the streams


class _Clients:
    """The clients' shared state (in the client process)."""

    def __init__(self, count: int) -> None:
        self.phase = "warmup"
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.gaps: dict[str, list[float]] = defaultdict(list)
        self.long_gaps: list[tuple[float, float]] = []  # (wall-clock time the gap began, seconds), over LONG_GAP_S
        self.ends: list[str] = []
        self.errors: list[str] = []
        self.started = threading.Barrier(count + 1)

    def stream(self, arrivals, first: list[bool]) -> str:
        """Record the gaps between `arrivals` (an iterator of token-message arrivals ending in the
        finish reason); the finish reason."""
        last = None
        for finish in arrivals:
            now = time.perf_counter()
            if last is not None:
                with self.lock:
                    self.gaps[self.phase].append(now - last)
                    if now - last > LONG_GAP_S:
                        self.long_gaps.append((time.time() - (now - last), now - last))
            last = now
            if first[0]:
                first[0] = False
                self.started.wait()
            if finish:
                return finish
        return "no finish reason"


def _grpc_tokens(address: str, key: str, max_tokens: int):
    import grpc

    from hetero.v1 import common_pb2, inference_pb2, inference_pb2_grpc

    params = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with grpc.insecure_channel(address) as channel:
        for message in inference_pb2_grpc.InferenceStub(channel).Generate(
                inference_pb2.GenerateRequest(prompt=PROMPT, params=params),
                metadata=(("authorization", f"Bearer {key}"),), timeout=120):
            yield common_pb2.FinishReason.Name(message.finish_reason) if message.finish_reason else ""


def _http_tokens(url: str, key: str, max_tokens: int):
    import httpx

    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120, headers={"authorization": f"Bearer {key}"}) as client:
        with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.read()!r}")
            finish = ""
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    yield finish or "[DONE] without a finish reason"
                    return
                if line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(f"error event: {chunk}")
                    choices = chunk.get("choices") or [{}]  # the usage chunk has none
                    finish = choices[0].get("finish_reason") or finish
                    yield ""  # a token's chunk; the finish reason comes with [DONE]
            yield "stream closed before [DONE]"


def _client(clients: _Clients, kind: str, args: dict[str, Any]) -> None:
    first = [True]
    while not clients.stop.is_set():
        try:
            tokens = (_grpc_tokens(args["address"], args["key"], args["max_tokens"]) if kind == "grpc"
                      else _http_tokens(args["http_url"], args["key"], args["max_tokens"]))
            end = clients.stream(tokens, first)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on any
            end = f"{kind}: {type(exc).__name__}: {exc}"
            with clients.lock:
                clients.errors.append(end)
            if first[0]:
                first[0] = False
                clients.started.wait()
            time.sleep(0.1)
        with clients.lock:
            clients.ends.append(f"{kind}:{end}")


def main() -> None:
    args = json.loads(sys.argv[1])
    kinds = ["grpc"] * args["grpc"] + ["http"] * args["http"]
    clients = _Clients(len(kinds))
    threads = [threading.Thread(target=_client, args=(clients, kind, args), daemon=True) for kind in kinds]
    for t in threads:
        t.start()
    clients.started.wait()
    print("ready", flush=True)
    for line in sys.stdin:
        command, _, name = line.strip().partition(" ")
        if command == "phase":
            clients.phase = name
        elif command == "stop":
            break
    clients.stop.set()
    for t in threads:
        t.join(150)
    print(json.dumps({"gaps": clients.gaps, "long_gaps": clients.long_gaps, "ends": clients.ends, "errors": clients.errors,
                      "hung": sum(t.is_alive() for t in threads)}), flush=True)


class SteadyStreams:
    """The client process, as a context manager; `result` once it has exited."""

    def __init__(self, stack: Stack, key: str, grpc: int = 4, http: int = 4, max_tokens: int = 300) -> None:
        self.args = {"address": stack.address, "http_url": stack.http_url, "key": key, "grpc": grpc,
                     "http": http, "max_tokens": max_tokens}
        self.result: dict[str, Any] = {}

    def __enter__(self) -> "SteadyStreams":
        self.process = subprocess.Popen([sys.executable, "-m", "tests.helpers.steady_streams", json.dumps(self.args)],
                                        cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self.process.stdout.readline()  # type: ignore[union-attr]
        assert ready == "ready\n", f"the streaming clients did not start: {ready!r}"
        return self

    def phase(self, name: str) -> None:
        self.process.stdin.write(f"phase {name}\n")  # type: ignore[union-attr]
        self.process.stdin.flush()  # type: ignore[union-attr]

    def __exit__(self, *exc: object) -> None:
        try:
            out, _ = self.process.communicate("stop\n", timeout=180)
            self.result = json.loads(out.strip().splitlines()[-1])
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()


if __name__ == "__main__":
    main()
