"""Does a replica's failover change any stream? `serve` with its defaults (the default model and dtype)
and two data-parallel replicas: every stream runs once undisturbed, then again while one replica is
SIGKILLed mid-stream (after 12 tokens a stream on average); its sequences move to the other replica,
which recomputes their prompt and generated tokens. Prints, per sampling mode, how many streams came
out token for token as the undisturbed run, and how many sequences moved (issue 38, config
`deterministic`).

    python benchmarks/failover_identity.py [--streams 24] [--tokens 48] [SERVE FLAGS ...]
    python benchmarks/failover_identity.py --deterministic false     # AMX CPUs: their faster prompt paths
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

import grpc

if not __package__:  # run as a file (`python benchmarks/NAME.py`): the repository root on the path, as -m has it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hetero.v1 import common_pb2, inference_pb2, worker_pb2, worker_pb2_grpc  # noqa: E402
from hetero_infer.bench.harness import Stack, free_port, make_prompts, run_stack, service_stats  # noqa: E402


def streams(count: int, tokens: int, seeded: bool) -> list[inference_pb2.GenerateRequest]:
    prompts = [p for seed in range(8) for p in make_prompts(seed=seed)][:count]
    params = [common_pb2.SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=1.0 if seeded else 0.0,
                                        **({"seed": 1000 + i} if seeded else {})) for i in range(count)]
    return [inference_pb2.GenerateRequest(request_id=f"r{i}", prompt_token_ids=inference_pb2.TokenIds(ids=p),
                                          params=params[i]) for i, p in enumerate(prompts)]


def run(stack: Stack, requests: list[inference_pb2.GenerateRequest], kill_after: int = 0,
        victim: int = 0) -> dict[int, tuple[list[int], str]]:
    """Every request as a stream on its own thread: {i: (token ids, status)}; SIGKILL `victim` once
    `kill_after` tokens arrived in all (0: never)."""
    results: dict[int, tuple[list[int], str]] = {}
    received, lock, killed = [0], threading.Lock(), threading.Event()

    def stream(i: int, request: inference_pb2.GenerateRequest) -> None:
        tokens: list[int] = []
        try:
            for message in stack.inference.Generate(request, timeout=300):
                tokens.extend(message.token_ids)
                with lock:
                    received[0] += len(message.token_ids)
                    due = kill_after and received[0] >= kill_after and not killed.is_set()
                    if due:
                        killed.set()
                if due:
                    os.kill(victim, signal.SIGKILL)
            results[i] = (tokens, "OK")
        except grpc.RpcError as exc:
            results[i] = (tokens, exc.code().name)

    threads = [threading.Thread(target=stream, args=(i, r)) for i, r in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=48)
    args, serve_flags = parser.parse_known_args()
    for seeded in (False, True):
        addresses = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
        flags = ["--log-level", "error", "--data-parallel-size", "2", "--worker-addresses", ",".join(addresses),
                 "--restart-workers", "false", "--dtype", "auto", *serve_flags]
        requests = streams(args.streams, args.tokens, seeded)
        with run_stack(None, *flags) as stack:
            reference = run(stack, requests)
            with grpc.insecure_channel(addresses[1]) as channel:
                victim = worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=10).pid
            disturbed = run(stack, requests, kill_after=args.streams * 12, victim=victim)
            same = sum(disturbed[i] == reference[i] for i in reference)
            moved = service_stats(stack).num_recovered_sequences
        mode = "seeded, temperature 1.0" if seeded else "greedy"
        print(f"{mode}: {same}/{len(requests)} streams identical to the undisturbed run; {moved} sequences moved; "
              f"serve flags: {' '.join(serve_flags) or '(defaults)'}", flush=True)


if __name__ == "__main__":
    main()
