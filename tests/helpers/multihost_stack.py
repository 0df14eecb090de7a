"""The services of the stack started one by one, each on its own "host" (a network namespace of
tests/helpers/netns.py), as an operator would on separate machines: `hetero-infer worker|scheduler|gateway`
with the hosts' addresses; and greedy streams through them, timed token by token."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import grpc

from hetero.v1 import inference_pb2, inference_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from hetero_common.config import Config
from hetero_infer.bench.harness import REPO_ROOT
from hetero_infer.supervisor import wait_healthy
from tests.helpers.netns import Host
from tests.helpers.oracle import make_prompts
from tests.helpers.stack_requests import ids_request

WORKER_PORT, SCHEDULER_PORT, GATEWAY_PORT, HTTP_PORT = 50053, 50052, 50051, 8000  # every host has its own ports
COMMON_FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--num-threads", "1",
                "--log-level", "warning", "--log-format", "json"]


def has_config_key(name: str) -> bool:
    return name in {f.name for f in dataclasses.fields(Config)}


def start_service(host: Host, service: str, model: Path, *flags: str,
                  insecure_internal: bool = True) -> subprocess.Popen[bytes]:
    """`hetero-infer <service>` inside `host`'s namespace; it dies with this process (PDEATHSIG).
    A scheduler or worker listens on the host's own (non-loopback) address, in plaintext only with
    `insecure_internal` (allow_insecure_internal: the test's bridge is the trusted network); pass
    False with the internal_tls flags. A gateway serves its host's address without API keys
    (serving.allow_unauthenticated: the tests' clients send none)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETERO_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    insecure = ["--allow-insecure-internal", "true"] if insecure_internal and service in ("scheduler", "worker") else []
    if service == "gateway":
        insecure = ["--serving-allow-unauthenticated", "true"]
    cmd = [sys.executable, "-m", "hetero_infer.cli", service, "--model", str(model), *COMMON_FLAGS, *insecure, *flags,
           "--supervisor-pid", str(os.getpid())]
    return host.popen(cmd, cwd=REPO_ROOT, env=env)


def start_worker(host: Host, model: Path, *flags: str, insecure_internal: bool = True) -> subprocess.Popen[bytes]:
    return start_service(host, "worker", model, "--worker-address", f"{host.address}:{WORKER_PORT}", *flags,
                         insecure_internal=insecure_internal)


def wait_ready(address: str, process: subprocess.Popen[bytes], timeout_s: float = 120.0,
               credentials: grpc.ChannelCredentials | None = None) -> None:
    wait_healthy(address, timeout_s, process, credentials)


@dataclasses.dataclass
class Front:
    """The gateway (for clients) and the scheduler (for its per-replica stats) of a running stack.
    `internal_credentials`: what the scheduler is called with when the internal links are mutual TLS."""

    gateway: str
    scheduler: str
    internal_credentials: grpc.ChannelCredentials | None = None

    def generate(self, request: inference_pb2.GenerateRequest, timeout_s: float = 120.0):
        with grpc.insecure_channel(self.gateway) as channel:
            yield from inference_pb2_grpc.InferenceStub(channel).Generate(request, timeout=timeout_s)

    def stats(self) -> scheduler_pb2.SchedulerStats:
        creds = self.internal_credentials
        with grpc.secure_channel(self.scheduler, creds) if creds else grpc.insecure_channel(self.scheduler) as channel:
            return scheduler_pb2_grpc.SchedulerStub(channel).GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)

    def replica(self, address: str) -> scheduler_pb2.ReplicaStatus | None:
        return next((r for r in self.stats().replicas if r.address == address), None)

    def wait_replica(self, address: str, up: bool, timeout_s: float) -> float:
        """Seconds until the scheduler sees the replica at `address` up (or down); raises at the timeout."""
        started = time.monotonic()
        while True:
            r = self.replica(address)
            if r is not None and r.up == up:
                return time.monotonic() - started
            if time.monotonic() - started > timeout_s:
                state = "missing" if r is None else ("up" if r.up else "down")
                raise AssertionError(f"replica {address} still {state} after {timeout_s:.0f} s; wanted {'up' if up else 'down'}")
            time.sleep(0.05)


def stream_prompts(count: int) -> list[list[int]]:
    return [p for seed in range(count // 8 + 1) for p in make_prompts(seed=seed)][:count]


@dataclasses.dataclass
class StreamRun:
    tokens: dict[int, list[int]]
    errors: dict[int, grpc.StatusCode]
    longest_stall_s: float  # the longest wait between two messages of one stream
    seconds: float

    @property
    def outputs(self) -> dict[int, tuple[list[int], grpc.StatusCode | None]]:
        return {i: (t, self.errors.get(i)) for i, t in self.tokens.items()}

    @property
    def tokens_per_s(self) -> float:
        return sum(len(t) for t in self.tokens.values()) / self.seconds


def run_streams(front: Front, prompts: list[list[int]], max_tokens: int,
                on_progress: Callable[[int], None] | None = None, timeout_s: float = 120.0) -> StreamRun:
    """Every prompt as a greedy stream in its own thread; `on_progress(total tokens so far)` after each message."""
    tokens: dict[int, list[int]] = {}
    errors: dict[int, grpc.StatusCode] = {}
    stalls: list[float] = []
    received = [0]
    lock = threading.Lock()

    def run(i: int) -> None:
        tokens[i] = []
        last = None
        try:
            for msg in front.generate(ids_request(prompts[i], max_tokens, request_id=f"s{i}-{time.monotonic_ns()}"),
                                      timeout_s):
                now = time.monotonic()
                if last is not None:
                    with lock:
                        stalls.append(now - last)
                last = now
                tokens[i].extend(msg.token_ids)
                with lock:
                    received[0] += len(msg.token_ids)
                    total = received[0]
                if on_progress is not None:
                    on_progress(total)
        except grpc.RpcError as exc:
            errors[i] = exc.code()

    started = time.monotonic()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    assert not any(t.is_alive() for t in threads), "a stream hangs"
    return StreamRun(tokens, errors, max(stalls, default=0.0), time.monotonic() - started)
