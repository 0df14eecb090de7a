"""The internal services refuse to listen in plaintext off loopback: a scheduler and a worker asked
to bind 0.0.0.0 (internal_bind_host, as in a container) without internal_tls exit at once, before
any model loads, naming internal_tls and allow_insecure_internal; with allow_insecure_internal
they start (and warn). The multi-host stack with mutual TLS is tests/multihost/test_internal_tls.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetero_infer.bench.harness import REPO_ROOT, free_port, stop_process
from hetero_infer.supervisor import wait_healthy

pytestmark = pytest.mark.slow
FLAGS = ["--block-size", "5", "--max-model-len", "512", "--dtype", "float32", "--num-threads", "1",
         "--log-level", "warning", "--log-format", "json", "--internal-bind-host", "0.0.0.0"]


def start(service: str, model: Path, log: Path, *flags: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETERO_")}
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "hetero_infer.cli", service, "--model", str(model), *FLAGS, *flags],
                                cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


@pytest.mark.parametrize("service", ["scheduler", "worker"])
def test_plaintext_bind_off_loopback_is_refused(service: str, tmp_path: Path) -> None:
    """The model does not exist: the refusal comes before anything would load it."""
    port = free_port()
    log = tmp_path / f"{service}.log"
    started = time.monotonic()
    others = ["--worker-address", f"127.0.0.1:{free_port()}"] if service == "scheduler" else []
    process = start(service, tmp_path / "no-model", log, f"--{service}-address", f"127.0.0.1:{port}", *others)
    try:
        code = process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = log.read_text()
    print(f"\n{service} refused in {time.monotonic() - started:.1f} s: {output.strip()}")
    assert code != 0
    assert f"{service}: refusing to listen on 0.0.0.0:{port} in plaintext" in output
    assert "internal_tls.cert_file" in output and "allow_insecure_internal: true" in output


def test_allow_insecure_internal_lets_them_start(tiny_llama_dir: Path, tmp_path: Path) -> None:
    worker_port, scheduler_port = free_port(), free_port()
    allow = ["--allow-insecure-internal", "true", "--worker-address", f"127.0.0.1:{worker_port}"]
    worker = start("worker", tiny_llama_dir, tmp_path / "worker.log", *allow)
    try:
        wait_healthy(f"127.0.0.1:{worker_port}", 120, worker)  # bound on 0.0.0.0: loopback reaches it too
        scheduler = start("scheduler", tiny_llama_dir, tmp_path / "scheduler.log", *allow,
                          "--scheduler-address", f"127.0.0.1:{scheduler_port}")
        try:
            wait_healthy(f"127.0.0.1:{scheduler_port}", 120, scheduler)  # SERVING: it reached the worker
        finally:
            stop_process(scheduler, grace_s=10)
    finally:
        stop_process(worker, grace_s=10)
    for name in ("worker", "scheduler"):
        output = (tmp_path / f"{name}.log").read_text()
        assert "allow_insecure_internal" in output and "0.0.0.0:" in output, f"{name} did not warn: {output}"
