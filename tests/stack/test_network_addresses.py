"""Nothing assumes loopback, and a cut link is noticed: the real stack on addresses of a veth pair,
and a worker replica in a network namespace of its own whose link is cut.

Root makes the interfaces here (`ip link add ... type veth`, `ip netns add`); where that is
refused the tests skip and say why. Every interface and namespace made is removed again.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import psutil
import pytest

from hetero_infer.bench.harness import (
    REPO_ROOT,
    Stack,
    free_port,
    run_stack,
    service_stats,
    stop_process,
    wait_for_idle,
)
from hetero_infer.supervisor import wait_healthy
from tests.helpers.oracle import NEW_TOKENS, hf_greedy, make_prompts
from tests.helpers.stack_requests import generate_concurrently
from tests.stack.test_discovery import MODEL_FLAGS, NAME, Hosts, can_mount_namespace, replicas, wait_until
from tests.stack.test_resilience import NUM_STREAMS, requests

pytestmark = pytest.mark.slow
TAG = os.getpid() % 10000  # interface and namespace names unique to this run (two engineers, one box)
OCTET = 20 + os.getpid() % 200


def ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@contextmanager
def veth_pair(host_ip: str, peer_ip: str | None, netns: str | None = None) -> Iterator[str]:
    """A veth pair up, `host_ip`/24 on the end here and `peer_ip`/24 on the other (moved into
    `netns` when given); yields the name of the end here. Skips when it cannot be made."""
    here, there = f"hb{TAG}h", f"hb{TAG}p"
    made = ip("link", "add", here, "type", "veth", "peer", "name", there)
    if made.returncode != 0:
        pytest.skip(f"cannot create a veth pair (root and CAP_NET_ADMIN needed): {made.stderr.strip()}")
    try:
        inside = ["-n", netns] if netns else []
        if netns:
            assert ip("link", "set", there, "netns", netns).returncode == 0
        assert ip("addr", "add", f"{host_ip}/24", "dev", here).returncode == 0
        if peer_ip:
            assert ip(*inside, "addr", "add", f"{peer_ip}/24", "dev", there).returncode == 0
        assert ip("link", "set", here, "up").returncode == 0
        assert ip(*inside, "link", "set", there, "up").returncode == 0
        yield here
    finally:
        ip("link", "del", here)  # takes the peer with it, wherever it is


@contextmanager
def network_namespace() -> Iterator[str]:
    name = f"hb18d-{TAG}"
    made = ip("netns", "add", name)
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace: {made.stderr.strip()}")
    try:
        yield name
    finally:
        ip("netns", "del", name)


def loopback_sockets(root_pid: int) -> list[str]:
    """Every inet socket of `root_pid` and its descendants with a loopback end."""
    found = []
    root = psutil.Process(root_pid)
    for proc in [root, *root.children(recursive=True)]:
        for conn in proc.net_connections(kind="inet"):
            for end in (conn.laddr, conn.raddr):
                if end and ipaddress.ip_address(end.ip.split("%")[0]).is_loopback:
                    found.append(f"{proc.pid} {' '.join(proc.cmdline()[2:4])}: {conn.laddr} -> {conn.raddr} {conn.status}")
    return found


def test_every_service_on_non_loopback_addresses(tiny_llama_dir: Path) -> None:
    """Gateway (gRPC and HTTP), scheduler and two worker replicas on the two ends of a veth pair:
    output matches transformers, and no process of the stack holds a loopback socket."""
    first, second = f"10.213.{OCTET}.1", f"10.213.{OCTET}.2"
    with veth_pair(first, second):
        workers, scheduler = [f"{first}:{free_port()}", f"{second}:{free_port()}"], f"{second}:{free_port()}"
        flags = [*MODEL_FLAGS, "--log-level", "warning", "--data-parallel-size", "2",
                 "--worker-addresses", ",".join(workers), "--scheduler-address", scheduler,
                 "--allow-insecure-internal", "true",  # plaintext on the veth pair's addresses
                 "--serving-allow-unauthenticated", "true"]  # and the gateway without API keys
        with run_stack(tiny_llama_dir, *flags, host=first) as stack:
            prompts = make_prompts()
            assert generate_concurrently(stack, prompts, NEW_TOKENS, 60) == hf_greedy(tiny_llama_dir, prompts)
            assert httpx.get(f"{stack.http_url}/v1/models", timeout=10).status_code == 200
            assert service_stats(stack).num_workers_up == 2
            assert set(replicas(scheduler)) == set(workers)
            assert loopback_sockets(stack.process.pid) == []


def timed_streams(stack: Stack, on_progress) -> tuple[dict[int, list[int]], float]:
    """Every request of test_resilience as a stream; ({i: tokens}, the longest gap between two
    messages of one stream, in seconds)."""
    results: dict[int, list[int]] = {}
    gaps: list[float] = []
    received = [0]
    lock = threading.Lock()

    def run(i: int, request) -> None:
        tokens: list[int] = []
        last, longest = time.monotonic(), 0.0
        for msg in stack.inference.Generate(request, timeout=120):
            now = time.monotonic()
            if tokens:
                longest = max(longest, now - last)
            last = now
            tokens.extend(msg.token_ids)
            with lock:
                received[0] += len(msg.token_ids)
                total = received[0]
            on_progress(total)
        results[i] = tokens
        gaps.append(longest)

    threads = [threading.Thread(target=run, args=(i, r)) for i, r in enumerate(requests())]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert not any(t.is_alive() for t in threads), "a stream hangs"
    return results, max(gaps)


def test_cut_link_to_a_replica_is_noticed_and_it_rejoins(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Replica A is a worker of `serve` here; replica B a worker in its own network namespace
    behind a veth pair, found through worker_dns. B's link is cut mid-stream (no reset reaches
    either side, so only the keepalive, internal_keepalive_s 0.5, tells): the scheduler marks B
    down, its streams move to A and complete token-identical, no block leaks; the link comes back
    and B rejoins. How soon is printed, not asserted: on a shared machine it varies with the load."""
    if (reason := can_mount_namespace()) is not None:
        pytest.skip(reason)
    host_ip, worker_ip = f"10.214.{OCTET}.1", f"10.214.{OCTET}.2"
    port, scheduler = free_port(), f"127.0.0.1:{free_port()}"
    hosts = Hosts(tmp_path / "hosts")
    hosts.write([worker_ip])
    with network_namespace() as netns, veth_pair(host_ip, worker_ip, netns) as link:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HETERO_")}
        worker = subprocess.Popen(["ip", "netns", "exec", netns, sys.executable, "-m", "hetero_infer.cli", "worker",
                                   "--worker-address", f"{worker_ip}:{port}", "--allow-insecure-internal", "true",
                                   "--model", str(tiny_llama_dir),
                                   "--num-threads", "1", "--log-level", "warning", "--log-format", "json", *MODEL_FLAGS],
                                  cwd=REPO_ROOT, env=env)
        try:
            wait_healthy(f"{worker_ip}:{port}", 120, worker)
            flags = [*MODEL_FLAGS, "--log-level", "warning", "--worker-addresses", f"127.0.0.1:{free_port()}",
                     "--worker-dns", f"{NAME}:{port}", "--worker-dns-refresh-s", "0.5", "--scheduler-address", scheduler,
                     "--restart-workers", "false"]
            with run_stack(tiny_llama_dir, *flags, wrap=hosts.wrap()) as stack:
                wait_until(lambda: service_stats(stack).num_workers_up == 2, 30, "replica B joined")
                reference, _ = timed_streams(stack, lambda total: None)
                cut_at: list[float] = []
                noticed: list[float] = []

                def watch() -> None:  # how long after the cut the scheduler reports B down
                    wait_until(lambda: bool(cut_at), 120, "the cut")
                    wait_until(lambda: not replicas(scheduler)[f"{worker_ip}:{port}"].up, 120, "B marked down")
                    noticed.append(time.monotonic() - cut_at[0])

                cutting = threading.Lock()

                def cut(total: int) -> None:  # called from every stream's thread
                    with cutting:
                        if total >= NUM_STREAMS * 5 and not cut_at:
                            assert ip("link", "set", link, "down").returncode == 0
                            cut_at.append(time.monotonic())
                watcher = threading.Thread(target=watch)
                watcher.start()
                disturbed, longest_stall = timed_streams(stack, cut)
                watcher.join(120)
                assert noticed, "the scheduler never marked the cut replica down"
                print(f"\ncut link noticed after {noticed[0]:.2f} s; longest stall of a stream {longest_stall:.2f} s")
                assert disturbed == reference  # 0 streams lost, every one token-identical
                p, s = wait_for_idle(stack), service_stats(stack)
                assert (p.used_blocks, s.num_workers_up) == (0, 1) and s.num_recovered_sequences > 0

                assert ip("link", "set", link, "up").returncode == 0
                back = wait_until(lambda: service_stats(stack).num_workers_up == 2, 30, "replica B rejoined")
                print(f"replica rejoined {back:.2f} s after the link came back")
                again, _ = timed_streams(stack, lambda total: None)
                assert again == reference
                assert replicas(scheduler)[f"{worker_ip}:{port}"].pool.steps > 0
                assert wait_for_idle(stack).used_blocks == 0
        finally:
            stop_process(worker, grace_s=10)
