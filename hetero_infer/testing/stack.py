"""A real `hetero-infer serve` (three processes on loopback ports) for tests and benchmarks:
start it, reach its gateway, find its service processes, stop it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import grpc
import psutil

from hetero.v1 import inference_pb2_grpc
from hetero_infer.supervisor import wait_healthy

REPO_ROOT = Path(__file__).resolve().parents[2]


_ISSUED_PORTS: set[int] = set()


def free_port() -> int:
    """A loopback port free right now and never handed out before by this process: the kernel
    may give the same just-closed port to two bind(0) calls in a row, and two services of one
    test (a gateway's gRPC and HTTP ports) then collided (seen once in CI)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _ISSUED_PORTS:
            _ISSUED_PORTS.add(port)
            return port


@dataclass
class Stack:
    """A running `hetero-infer serve` (three processes) and a channel to its gateway."""

    process: subprocess.Popen[bytes]
    address: str
    channel: grpc.Channel
    http_port: int = 0  # the OpenAI-style HTTP API of the gateway
    host: str = "127.0.0.1"  # where every service of the stack listens

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def inference(self) -> inference_pb2_grpc.InferenceStub:
        return inference_pb2_grpc.InferenceStub(self.channel)

    def service_process(self, name: str, tp_rank: int = 0) -> psutil.Process:
        """The child of `serve` running `hetero-infer <name>` (gateway, scheduler, worker; a worker's
        tensor-parallel rank by `tp_rank`)."""
        for child in psutil.Process(self.process.pid).children():
            cmdline = child.cmdline()
            if "hetero_infer.cli" not in cmdline or cmdline[cmdline.index("hetero_infer.cli") + 1] != name:
                continue
            rank = int(cmdline[cmdline.index("--tp-rank") + 1]) if "--tp-rank" in cmdline else 0
            if rank == tp_rank:
                return child
        raise AssertionError(f"no {name} process (rank {tp_rank}) under serve")


@contextmanager
def run_stack(model: Path | None, *flags: str, timeout_s: float = 240.0, host: str = "127.0.0.1",
              wrap: Sequence[str] = ()) -> Iterator[Stack]:
    """`host`: the address every service listens on and is reached at (flags may still name
    others); `wrap`: a command line that runs `serve` (e.g. in its own mount namespace)."""
    gateway_port, http_port = free_port(), free_port()
    cmd = [*wrap, sys.executable, "-m", "hetero_infer.cli", "serve", "--serving-host", host,
           "--serving-port", str(gateway_port), "--serving-http-port", str(http_port),
           "--scheduler-address", f"{host}:{free_port()}", "--worker-address", f"{host}:{free_port()}",
           "--log-format", "json", *flags]
    if "--dtype" not in flags:  # the exact mode: `auto` may pick bfloat16 on this CPU, and tests compare tokens
        cmd += ["--dtype", "float32"]
    if model is not None:
        cmd += ["--model", str(model)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETERO_")}
    process = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env)
    address = f"{host}:{gateway_port}"
    try:
        wait_healthy(address, timeout_s, process)
        with grpc.insecure_channel(address) as channel:
            yield Stack(process, address, channel, http_port, host)
    finally:
        stop_process(process)


def stop_process(process: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM (the stack drains and stops its children), then SIGKILL after the grace period."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
