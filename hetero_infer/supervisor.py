"""`hetero-infer serve`: the three services as child processes on loopback, started in order.

Workers first (they load the model): `data_parallel_size` replicas of `tensor_parallel_size`
processes each; then the scheduler (sizes each replica's pool from its worker), then the
gateway; each must answer its gRPC health check before the next starts. A worker process
that dies is restarted (with the rest of its tensor-parallel group) unless
`restart_workers` is false; the scheduler notices it rejoin. A scheduler or gateway that dies
is restarted unless `restart_services` is false (then the stack stops): a new scheduler
starts with empty queues (the streams it served end with UNAVAILABLE) and resets each
worker's state before its first step. Ctrl-C or SIGTERM stops the
services in reverse order, each draining within `drain_grace_s`; children also get SIGTERM
if this process dies (each child asks for PR_SET_PDEATHSIG itself: see parent_death.py), so no
orphans are left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hetero_common.config import Config
from hetero_common.errors import ConfigError
from hetero_common.grpc_server import channel_credentials
from hetero_common.host_cores import default_reserved_cpus, host_cores

log = structlog.get_logger("hetero_infer.supervisor")
STOP_MARGIN_S = 5.0  # beyond drain_grace_s, for a gateway or scheduler to stop once its calls are done


def stop_grace_s(config: Config) -> float:
    """How long a stopping service may take before it is killed: by `serve`, or by itself when
    `serve` is gone (parent_death.py)."""
    return config.drain_grace_s + STOP_MARGIN_S


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
    raise TimeoutError(f"service at {address} not ready after {timeout_s:.0f}s (startup_timeout_s; a CUDA worker's "
                       "first start compiles FlashInfer's kernels: `python scripts/flashinfer_jit.py build` "
                       "compiles them ahead)")


@dataclass
class Child:
    name: str
    address: str
    cmd: list[str]
    process: subprocess.Popen[bytes]
    started_at: float = field(default_factory=time.monotonic)


@dataclass
class WorkerGroup:
    """One data-parallel replica: its tensor-parallel ranks, rank 0 serving gRPC at `address`."""

    replica: int
    address: str
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    started_at: float = 0.0
    restarts: int = 0
    given_up: bool = False

    def exited(self) -> subprocess.Popen[bytes] | None:
        return next((p for p in self.processes if p.poll() is not None), None)


def worker_environment(env: dict[str, str], omp_wait_policy: str) -> dict[str, str]:
    """A worker's environment: `omp_wait_policy` (config) as OMP_WAIT_POLICY, when set.

    passive: torch's OpenMP threads sleep when a parallel region ends instead of spinning
    (libgomp's default spins ~300k iterations). It is not the default: measured on the 2-core
    box, it helps many streams of a tiny model, where the spinning threads take the cores the
    gateway and the scheduler need (benchmarks/step_cost.py, B=64: 4.1-5.7 ms/step against
    6.0), but every parallel region then pays a wake-up: SmolLM2 at batch 1 went from 22 to 32
    ms per output token, and the tiny model at B=16 from 2.9 to 3.4-4.4 ms/step."""
    if not omp_wait_policy:
        return dict(env)
    return {**env, "OMP_WAIT_POLICY": omp_wait_policy.upper()}


class Supervisor:
    def __init__(self, config: Config) -> None:
        if config.tp_init_method and config.data_parallel_size > 1:
            # Every replica would meet at the one address: the groups would mix.
            raise ConfigError(f"config key 'tp_init_method' = {config.tp_init_method!r} serves one tensor-parallel "
                              "group; with data_parallel_size > 1 leave it empty (serve gives each replica its own "
                              "rendezvous file) or start each replica's ranks with `hetero-infer worker`")
        processes = config.data_parallel_size * config.tensor_parallel_size
        if config.devices and len(config.devices) < processes:
            raise ConfigError(f"config key 'devices' = {config.devices!r} lists {len(config.devices)} devices for "
                              f"{processes} worker processes (data_parallel_size × tensor_parallel_size); list one each")
        if config.reserved_cpus < 0:  # auto: serve runs the gateway and the scheduler on the workers' host
            config = replace(config, reserved_cpus=default_reserved_cpus(host_cores()))
            log.info("cores reserved for the services", reserved_cpus=config.reserved_cpus, host_cores=host_cores(),
                     hint="config reserved_cpus; with num_threads 0 the workers share the rest")
        self.config = config
        self.children: list[Child] = []
        self.groups: list[WorkerGroup] = []
        self.stopping = False
        self.tp_dir = tempfile.mkdtemp(prefix="hetero-tp-")
        # Children read the resolved config from a file; HETERO_* variables are not passed on,
        # or they would override what the CLI flags already decided here.
        fd, self.config_path = tempfile.mkstemp(prefix="hetero-config-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(config.to_dict(), f)
        self.child_env = {k: v for k, v in os.environ.items() if not k.startswith("HETERO_")}
        self.worker_env = worker_environment(self.child_env, config.omp_wait_policy)

    def _start_group(self, group: WorkerGroup) -> None:
        tp = self.config.tensor_parallel_size
        init_file = os.path.join(self.tp_dir, f"replica{group.replica}-{group.restarts}")
        group.processes = []
        for rank in range(tp):
            cmd = [sys.executable, "-m", "hetero_infer.cli", "worker", "--config", self.config_path,
                   "--worker-address", group.address, "--supervisor-pid", str(os.getpid())]
            # Its place among this host's workers picks its GPU (gpu_worker/cuda/device_map.py).
            cmd += ["--local-rank", str(group.replica * tp + rank)]
            if tp > 1:  # a configured tp_init_method (read from the config file) replaces the file
                cmd += ["--tp-rank", str(rank)] + ([] if self.config.tp_init_method else ["--tp-init-file", init_file])
            process = subprocess.Popen(cmd, env=self.worker_env)
            group.processes.append(process)
            log.info("starting", service="worker", replica=group.replica, rank=rank, pid=process.pid, address=group.address)
        group.started_at = time.monotonic()

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stopping = True

    def start(self) -> None:
        # Handlers first: a SIGTERM during start-up must still stop the children in order
        # (the default action would kill this process and, through PDEATHSIG, all of them at once).
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        c = self.config
        internal = channel_credentials(c.internal_tls, mutual=True)
        self.groups = [WorkerGroup(i, address) for i, address in enumerate(c.replica_addresses())]
        for group in self.groups:
            self._start_group(group)
        for group in self.groups:
            wait_healthy(group.address, c.startup_timeout_s, group.processes[0], internal)
            log.info("ready", service="worker", replica=group.replica, address=group.address)
        for name, address, creds in (("scheduler", c.scheduler_address, internal),
                                     ("gateway", f"{c.serving.host}:{c.serving.port}",
                                      channel_credentials(c.serving.tls, mutual=False))):
            cmd = [sys.executable, "-m", "hetero_infer.cli", name, "--config", self.config_path,
                   "--supervisor-pid", str(os.getpid())]
            process = subprocess.Popen(cmd, env=self.child_env)
            self.children.append(Child(name, address, cmd, process))
            log.info("starting", service=name, pid=process.pid, address=address)
            wait_healthy(address, c.startup_timeout_s, process, creds)
            log.info("ready", service=name, address=address)
            if self.stopping:
                return

    def _check_workers(self) -> None:
        """Restart a replica whose worker process died (its other ranks are stopped first)."""
        for group in self.groups:
            if group.given_up or (dead := group.exited()) is None:
                continue
            if not self.config.restart_workers:
                log.error("worker exited; not restarting (restart_workers is false)", replica=group.replica,
                          pid=dead.pid, code=dead.returncode)
                group.given_up = True
                _stop_processes([p for p in group.processes if p.poll() is None], grace_s=2.0)
                continue
            if time.monotonic() - group.started_at < 1.0:
                continue  # at most one restart a second: a worker that cannot start must not spin
            log.error("worker exited; restarting it", replica=group.replica, pid=dead.pid, code=dead.returncode)
            _stop_processes([p for p in group.processes if p.poll() is None], grace_s=2.0)
            group.restarts += 1
            self._start_group(group)

    def _check_services(self) -> bool:
        """Restart a scheduler or gateway that died; False when one died and may not be restarted."""
        for child in self.children:
            if (code := child.process.poll()) is None:
                continue
            if not self.config.restart_services:
                log.error("service exited; stopping the stack (restart_services is false)", service=child.name, code=code)
                return False
            if time.monotonic() - child.started_at < 1.0:
                continue  # at most one restart a second: a service that cannot start must not spin
            log.error("service exited; restarting it", service=child.name, pid=child.process.pid, code=code)
            child.process = subprocess.Popen(child.cmd, env=self.child_env)
            child.started_at = time.monotonic()
        return True

    def wait(self) -> int:
        """Block until a signal, or until a service dies that may not be restarted; return
        the exit code for `serve`."""
        while not self.stopping:
            if not self._check_services():
                return 1
            self._check_workers()
            time.sleep(0.2)
        return 0

    def stop(self) -> None:
        # Gateway, then scheduler, each draining in-flight requests; then every worker at once.
        grace_s = stop_grace_s(self.config)
        for child in reversed(self.children):
            _stop_processes([child.process], grace_s)
        _stop_processes([p for g in self.groups for p in g.processes], grace_s=10.0)
        self.children.clear()
        self.groups.clear()
        shutil.rmtree(self.tp_dir, ignore_errors=True)
        try:
            os.unlink(self.config_path)
        except FileNotFoundError:
            pass
        log.info("stack stopped")


def _stop_processes(processes: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    """SIGTERM, wait up to grace_s, then SIGKILL what is left."""
    for p in processes:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in processes:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("killing a process that did not stop in time", pid=p.pid)
            p.kill()
            p.wait()


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
