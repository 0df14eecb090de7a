"""Worker replicas found by DNS (`worker_dns`), with real worker processes: the replica set
alone, and the whole stack.

The name is resolved by the scheduler's own getaddrinfo from /etc/hosts (glibc's "files"
source, read again on every lookup): `serve` runs in a mount namespace of its own where a
temporary hosts file is bind-mounted over /etc/hosts, so the test adds and removes a
replica's record without touching the host's file. Each worker listens on its own loopback
address (127.0.0.0/8), all on one port, as the pods behind a headless Service do.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hetero.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from hetero_common.config import Config
from hetero_infer.supervisor import wait_healthy
from hetero_infer.bench.harness import REPO_ROOT, free_port, run_stack, service_stats, stop_process, wait_for_idle
from tests.helpers.stack_requests import ids_request
from scheduler_svc.replicas.replica_set import ReplicaSet
from tests.helpers.certs import make_pki
from tests.helpers.oracle import NEW_TOKENS, hf_greedy, make_prompts
from tests.stack.test_resilience import NUM_STREAMS, run_streams

pytestmark = pytest.mark.slow
NAME = "hetero-workers.test"
MODEL_FLAGS = ["--block-size", "5", "--max-model-len", "512", "--dtype", "float32"]


def can_mount_namespace() -> str | None:
    """Why a private /etc/hosts cannot be made here, or None."""
    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    return None if probe.returncode == 0 else f"cannot create a mount namespace: {probe.stderr.decode().strip()}"


class Hosts:
    """A hosts file that `serve` sees as /etc/hosts. Rewritten in place: the bind mount holds
    the file's inode, so a new file renamed over it would not be seen."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.addresses: list[str] = []
        self.write([])

    def write(self, addresses: list[str]) -> None:
        self.addresses = list(addresses)
        with open(self.path, "w") as f:
            f.write("127.0.0.1 localhost\n" + "".join(f"{ip} {NAME}\n" for ip in addresses))

    def wrap(self) -> list[str]:
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                'mount --bind "$0" /etc/hosts && exec "$@"', str(self.path)]


@contextmanager
def workers(model: Path, ips: list[str], port: int, *flags: str,
            credentials: grpc.ChannelCredentials | None = None) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """One real worker process per ip, all on `port` (started together, stopped at the end)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETERO_")}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for ip in ips:
            procs[ip] = subprocess.Popen([sys.executable, "-m", "hetero_infer.cli", "worker", "--worker-address",
                                          f"{ip}:{port}", "--model", str(model), "--num-threads", "1",
                                          "--log-level", "warning", "--log-format", "json", *MODEL_FLAGS, *flags],
                                         cwd=REPO_ROOT, env=env)
        for ip, proc in procs.items():
            if credentials is None:
                wait_healthy(f"{ip}:{port}", 120, proc)
            else:  # dialled by IP, checked under the DNS name (as the scheduler does)
                wait_serving_tls(f"{ip}:{port}", credentials, proc)
        yield procs
    finally:
        for proc in procs.values():
            stop_process(proc, grace_s=10)


def wait_serving_tls(address: str, credentials: grpc.ChannelCredentials, proc: subprocess.Popen[bytes]) -> None:
    with grpc.secure_channel(address, credentials, options=[("grpc.ssl_target_name_override", NAME)]) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, f"worker at {address} not ready"
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.2)


def replicas(scheduler: str) -> dict[str, scheduler_pb2.ReplicaStatus]:
    with grpc.insecure_channel(scheduler) as channel:
        stats = scheduler_pb2_grpc.SchedulerStub(channel).GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)
    return {r.address: r for r in stats.replicas}


def wait_until(condition, timeout_s: float, what: str) -> float:
    """Poll until `condition()`; return the seconds it took."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)
    return time.monotonic() - started


def test_replicas_behind_a_dns_name_join_leave_and_rejoin(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Two workers behind the name serve; one's record is removed mid-stream (its streams are
    recomputed on the other, unchanged, no block leaks); a third record joins and takes
    requests; the removed one's record comes back and it rejoins with its old replica index."""
    if (reason := can_mount_namespace()) is not None:
        pytest.skip(reason)
    port, scheduler = free_port(), f"127.0.0.1:{free_port()}"
    hosts = Hosts(tmp_path / "hosts")
    a, b, c = "127.0.0.12", "127.0.0.13", "127.0.0.14"
    hosts.write([a, b])
    flags = [*MODEL_FLAGS, "--log-level", "warning", "--worker-dns", f"{NAME}:{port}", "--worker-dns-refresh-s", "0.2",
             "--scheduler-address", scheduler]
    with workers(tiny_llama_dir, [a, b, c], port), run_stack(tiny_llama_dir, *flags, wrap=hosts.wrap()) as stack:
        wait_until(lambda: service_stats(stack).num_workers_up == 2, 30, "both replicas behind the name up")
        index = {address: r.index for address, r in replicas(scheduler).items()}
        assert set(index) == {f"{a}:{port}", f"{b}:{port}"}  # no static replica: the name alone
        reference = run_streams(stack)
        assert all(code is None for _, code in reference.values())
        assert all(r.pool.steps > 0 for r in replicas(scheduler).values())  # both served

        removed = threading.Event()

        def remove_b(total: int) -> None:
            if total >= NUM_STREAMS * 5 and not removed.is_set():
                removed.set()
                hosts.write([a])
        assert run_streams(stack, remove_b) == reference  # every stream complete, token-identical
        assert removed.is_set()
        s = service_stats(stack)
        assert (s.num_workers, s.num_workers_up) == (1, 1) and s.num_recovered_sequences > 0
        assert wait_for_idle(stack).used_blocks == 0  # no block leaked on either pool

        hosts.write([a, c])
        wait_until(lambda: service_stats(stack).num_workers_up == 2, 30, "the new replica joined")
        assert run_streams(stack) == reference
        now = replicas(scheduler)
        assert now[f"{c}:{port}"].pool.steps > 0  # the new replica took requests
        assert now[f"{c}:{port}"].index not in index.values()  # a new index, the others unchanged
        assert now[f"{a}:{port}"].index == index[f"{a}:{port}"]

        hosts.write([a, b, c])
        wait_until(lambda: service_stats(stack).num_workers_up == 3, 30, "the removed replica rejoined")
        assert replicas(scheduler)[f"{b}:{port}"].index == index[f"{b}:{port}"]
        assert run_streams(stack) == reference
        p, s = wait_for_idle(stack), service_stats(stack)
        assert (p.used_blocks, s.num_workers, s.num_workers_up) == (0, 3, 3)


def test_a_replica_found_by_dns_is_dialled_with_mutual_tls_under_the_name(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """With internal mutual TLS the scheduler dials a DNS replica by its IP but checks the
    certificate against the DNS name (one certificate for every pod behind a headless Service):
    this worker's certificate names hetero-workers.test, 127.0.0.1 and localhost, not 127.0.0.12."""
    if (reason := can_mount_namespace()) is not None:
        pytest.skip(reason)
    pki = make_pki(tmp_path / "pki", dns_names=(NAME,))
    tls = ["--internal-tls-cert-file", str(pki.cert_file), "--internal-tls-key-file", str(pki.key_file),
           "--internal-tls-ca-file", str(pki.ca_file)]
    port, ip = free_port(), "127.0.0.12"
    hosts = Hosts(tmp_path / "hosts")
    hosts.write([ip])
    credentials = grpc.ssl_channel_credentials(pki.ca_file.read_bytes(), pki.key_file.read_bytes(),
                                               pki.cert_file.read_bytes())
    flags = [*MODEL_FLAGS, *tls, "--log-level", "warning", "--worker-dns", f"{NAME}:{port}", "--startup-timeout-s", "60"]
    with workers(tiny_llama_dir, [ip], port, *tls, credentials=credentials), \
            run_stack(tiny_llama_dir, *flags, wrap=hosts.wrap()) as stack:
        assert service_stats(stack).num_workers_up == 1
        prompt = make_prompts()[4]
        tokens = [t for m in stack.inference.Generate(ids_request(prompt, NEW_TOKENS), timeout=60) for t in m.token_ids]
        assert tokens == hf_greedy(tiny_llama_dir, [prompt])[0]


def test_replica_set_identity_as_addresses_come_and_go(tiny_llama_dir: Path) -> None:
    """The replica set alone (no stack, no DNS) against two real workers: answers handed to
    `update_dns` add, retire and bring back replicas, each keeping its index; a request placed
    while one replica is retired runs on the other to the end."""
    port = free_port()
    a, b = f"127.0.0.21:{port}", f"127.0.0.22:{port}"
    config = Config(worker_dns=f"{NAME}:{port}", block_size=5, max_model_len=512, health_check_interval_s=0.1).validate()
    finished: dict[str, list[int]] = {}

    def dispatch(outputs) -> None:
        for out in outputs:
            finished.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finish_reason:
                finished[out.request_id].append(-1)  # marks the end

    async def until(condition, what: str) -> None:
        deadline = time.monotonic() + 30
        while not condition():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.05)

    async def scenario() -> None:
        replica_set = ReplicaSet(config, dispatch, lambda *args: None)
        assert replica_set.replicas == []  # worker_dns alone: no static replica
        await replica_set.update_dns([a])
        await until(lambda: len(replica_set.up()) == 1, "a joined")
        await replica_set.update_dns([a, b])
        await until(lambda: len(replica_set.up()) == 2, "b joined")
        assert [(r.index, r.address) for r in replica_set.replicas] == [(0, a), (1, b)]
        await replica_set.update_dns([b])  # a left the answer
        assert [r.address for r in replica_set.active()] == [b] and replica_set.stats().service.num_workers == 1
        request = scheduler_pb2.SubmitRequest(request_id="r", prompt_token_ids=make_prompts()[4],
                                              params=common_pb2.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
        replica_set.submit(request, None)
        await until(lambda: finished.get("r", [0])[-1] == -1, "the request ran on b")
        assert finished["r"][:-1] == hf_greedy(tiny_llama_dir, [make_prompts()[4]])[0]
        await replica_set.update_dns([a, b])  # a is back: its old index, a fresh pool
        await until(lambda: len(replica_set.up()) == 2, "a rejoined")
        assert [(r.index, r.address, r.retired) for r in replica_set.replicas] == [(0, a, False), (1, b, False)]
        assert replica_set.stats().pool.used_blocks == 0
        for replica in replica_set.replicas:
            await replica.retire()

    with workers(tiny_llama_dir, ["127.0.0.21", "127.0.0.22"], port):
        asyncio.run(scenario())
