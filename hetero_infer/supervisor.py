"""`hetero-infer serve`: the three services as child processes on loopback, started in order.

Worker first (loads the model), then the scheduler (sizes its pool from the worker), then
the gateway; each must answer its gRPC health check before the next starts. Ctrl-C or
SIGTERM stops them in reverse order; children also get SIGTERM if this process dies
(PR_SET_PDEATHSIG), so no orphans are left behind.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hetero_infer.config import Config
from hetero_infer.grpc_server import channel_credentials

log = structlog.get_logger("hetero_infer.supervisor")
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the supervisor's own signal handling still stops the children


def wait_healthy(address: str, timeout_s: float, process: subprocess.Popen[bytes] | None = None,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
    """Poll grpc.health.v1 until SERVING; fail early if the process exits."""
    deadline = time.monotonic() + timeout_s
    channel_cm = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel_cm as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"service at {address} exited with code {process.returncode} before becoming ready")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"service at {address} not ready after {timeout_s:.0f}s (startup_timeout_s)")


@dataclass
class Child:
    name: str
    address: str
    process: subprocess.Popen[bytes]


class Supervisor:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.children: list[Child] = []
        # Children read the resolved config from a file; HETERO_* variables are not passed on,
        # or they would override what the CLI flags already decided here.
        fd, self.config_path = tempfile.mkstemp(prefix="hetero-config-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(config.to_dict(), f)
        self.child_env = {k: v for k, v in os.environ.items() if not k.startswith("HETERO_")}

    def start(self) -> None:
        c = self.config
        internal = channel_credentials(c.internal_tls, mutual=True)
        for name, address, creds in (("worker", c.worker_address, internal), ("scheduler", c.scheduler_address, internal),
                                     ("gateway", f"{c.serving.host}:{c.serving.port}",
                                      channel_credentials(c.serving.tls, mutual=False))):
            process = subprocess.Popen([sys.executable, "-m", "hetero_infer.cli", name, "--config", self.config_path],
                                       env=self.child_env, preexec_fn=_die_with_parent)
            self.children.append(Child(name, address, process))
            log.info("starting", service=name, pid=process.pid, address=address)
            wait_healthy(address, c.startup_timeout_s, process, creds)
            log.info("ready", service=name, address=address)

    def wait(self) -> int:
        """Block until a signal or until a child exits; return the exit code for `serve`."""
        stopping = False

        def on_signal(signum: int, _frame: object) -> None:
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        while not stopping:
            for child in self.children:
                if child.process.poll() is not None:
                    log.error("service exited; stopping the stack", service=child.name, code=child.process.returncode)
                    return 1
            time.sleep(0.2)
        return 0

    def stop(self, grace_s: float = 10.0) -> None:
        for child in reversed(self.children):
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
                try:
                    child.process.wait(grace_s)
                except subprocess.TimeoutExpired:
                    log.warning("killing service that did not stop in time", service=child.name)
                    child.process.kill()
                    child.process.wait()
        self.children.clear()
        try:
            os.unlink(self.config_path)
        except FileNotFoundError:
            pass
        log.info("stack stopped")


def serve(config: Config) -> int:
    supervisor = Supervisor(config)
    try:
        supervisor.start()
        log.info("stack ready", grpc=f"{config.serving.host}:{config.serving.port}", model=config.serving.model_name)
        http = f", OpenAI HTTP on {config.serving.host}:{config.serving.http_port}" if config.serving.http_port else ""
        print(f"hetero-infer ready: gRPC hetero.v1.Inference on {config.serving.host}:{config.serving.port}{http}", flush=True)
        return supervisor.wait()
    except (RuntimeError, TimeoutError) as exc:
        log.error("stack failed to start", error=str(exc))
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        supervisor.stop()
