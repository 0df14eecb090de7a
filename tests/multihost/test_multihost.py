"""The stack across hosts, on one machine: the gateway, the scheduler and worker replicas each in
its own network namespace (tests/helpers/netns.py), talking over a bridge with their own addresses, as
they would on separate machines. Then the faults: a worker host's link cut mid-stream (every
stream completes unchanged, no KV block leaks, the cut is noticed (how soon is printed), the replica rejoins
when the link is back), a replica added behind the DNS name while the stack serves, and 1 ms of
delay on every link (netem where the kernel has it; else a delaying relay on each internal hop).
Last, tensor parallel 2 with its ranks on two hosts. Skipped only where namespaces cannot be made."""

from __future__ import annotations

import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from tests.helpers.multihost_stack import (GATEWAY_PORT, HTTP_PORT, SCHEDULER_PORT, WORKER_PORT, Front, has_config_key,
                                   run_streams, start_service, start_worker, stream_prompts, wait_ready)
from hetero.v1 import worker_pb2, worker_pb2_grpc
from tests.helpers.netns import Host, Network, netem_reason, network, network_or_skip  # noqa: F401  (a fixture)
from hetero_infer.bench.harness import REPO_ROOT
from tests.helpers.oracle import NEW_TOKENS, engine_greedy, make_prompts
from tests.helpers.stack_requests import ids_request

pytestmark = pytest.mark.slow
NUM_STREAMS = 16
MAX_TOKENS = 80
DNS_NAME = "workers.hetero.test"  # served from the scheduler host's /etc/hosts


class MultiHost:
    """`relayed`: every internal hop goes through a delay relay (tests/helpers/delay_relay.py) in the
    server's namespace, scheduler -> worker and gateway -> scheduler, for link latency without netem."""

    def __init__(self, net: Network, model: Path, relayed: bool = False) -> None:
        self.net, self.model, self.relayed = net, model, relayed
        self.relays: list = []
        self.gateway, self.scheduler = net.add_host("gateway"), net.add_host("scheduler")
        self.workers = [net.add_host(f"worker-{x}") for x in "ab"]
        self.added = net.add_host("worker-c")  # joins later, behind the DNS name
        self.front = Front(f"{self.gateway.address}:{GATEWAY_PORT}", f"{self.scheduler.address}:{SCHEDULER_PORT}")
        self.prompts = stream_prompts(NUM_STREAMS)
        self._reference: dict | None = None

    @property
    def reference(self) -> dict:
        """The streams' outputs on the undisturbed stack (every test compares with it)."""
        if self._reference is None:
            run = run_streams(self.front, self.prompts, MAX_TOKENS)
            assert not run.errors and all(len(t) == MAX_TOKENS for t in run.tokens.values())
            self._reference = run.outputs
            print(f"\nundisturbed: {NUM_STREAMS} streams x {MAX_TOKENS} tokens in {run.seconds:.2f} s, "
                  f"longest stall {run.longest_stall_s * 1000:.0f} ms")
        return self._reference

    def start(self) -> None:
        workers = [start_worker(h, self.model) for h in self.workers]
        for host, process in zip(self.workers, workers):
            wait_ready(f"{host.address}:{WORKER_PORT}", process)
        worker_targets = [f"{h.address}:{WORKER_PORT}" for h in self.workers]
        scheduler_target = self.front.scheduler
        if self.relayed:  # the services reach each other through the relays' ports
            worker_targets = [self.relay(h, WORKER_PORT) for h in self.workers]
            scheduler_target = self.relay(self.scheduler, SCHEDULER_PORT)
        # The static list names replicas a and b; the DNS name has no record yet (c is added to it later).
        self.scheduler.set_hosts({})
        discovery = ["--worker-dns", f"{DNS_NAME}:{WORKER_PORT}", "--worker-dns-refresh-s", "0.5"] \
            if has_config_key("worker_dns") else []  # before b18-discovery: the added replica's test fails
        scheduler = start_service(self.scheduler, "scheduler", self.model, "--scheduler-address", self.front.scheduler,
                                  "--data-parallel-size", "2",
                                  "--worker-addresses", ",".join(worker_targets), *discovery)
        wait_ready(self.front.scheduler, scheduler)
        gateway = start_service(self.gateway, "gateway", self.model, "--scheduler-address", scheduler_target,
                                "--serving-host", self.gateway.address, "--serving-port", str(GATEWAY_PORT),
                                "--serving-http-port", str(HTTP_PORT))
        wait_ready(self.front.gateway, gateway)

    def relay(self, host: Host, port: int) -> str:
        """A delay relay on `host` in front of its service at `port`; returns the relay's address."""
        listen, target = f"{host.address}:{port + 100}", f"{host.address}:{port}"
        relay = host.popen([sys.executable, "-m", "tests.helpers.delay_relay", listen, target, "1"], cwd=REPO_ROOT,
                           stdout=subprocess.PIPE)
        assert relay.stdout is not None and relay.stdout.readline() == b"relaying\n"
        self.relays.append(relay)
        return listen

    def set_delay(self, on: bool) -> None:
        for relay in self.relays:
            relay.send_signal(signal.SIGUSR1 if on else signal.SIGUSR2)

    def address(self, host: Host) -> str:
        """The worker's address as the scheduler knows it (through its relay when relayed)."""
        return f"{host.address}:{WORKER_PORT + (100 if self.relayed else 0)}"

    def steps(self, host: Host) -> int:
        replica = self.front.replica(self.address(host))
        return replica.pool.steps if replica is not None else 0

    def streams_only_on(self, host: Host, others: list[Host]) -> None:
        """Cut the other replicas' links, and check the streams complete unchanged on `host` alone."""
        for other in others:
            other.cut()
        try:
            for other in others:
                self.front.wait_replica(self.address(other), up=False, timeout_s=15)
            before = self.steps(host)
            assert run_streams(self.front, self.prompts, MAX_TOKENS).outputs == self.reference
            assert self.steps(host) > before
        finally:
            for other in others:
                other.restore()
        for other in others:
            self.front.wait_replica(self.address(other), up=True, timeout_s=15)


@pytest.fixture(scope="module")
def hosts(tiny_llama_dir: Path) -> Iterator[MultiHost]:
    with network_or_skip() as net:
        stack = MultiHost(net, tiny_llama_dir)
        stack.start()
        yield stack


def test_a_stream_crosses_every_host(hosts: MultiHost, tiny_llama_dir: Path) -> None:
    prompt = make_prompts()[6]
    expected = engine_greedy(tiny_llama_dir, [prompt])[0]  # in-process, the transformers-checked path
    assert [t for m in hosts.front.generate(ids_request(prompt, NEW_TOKENS)) for t in m.token_ids] == expected
    assert [r.up for r in hosts.front.stats().replicas] == [True, True]
    assert hosts.reference
    assert all(hosts.steps(h) > 0 for h in hosts.workers)  # both replicas served


def test_cut_link_streams_complete_unchanged_and_replica_rejoins(hosts: MultiHost) -> None:
    reference = hosts.reference
    victim, survivor = hosts.workers[1], hosts.workers[0]
    cut_at: list[float] = []
    noticed_at: list[float] = []

    def on_progress(total: int) -> None:
        if total >= NUM_STREAMS * 15 and not cut_at:
            cut_at.append(time.monotonic())
            victim.cut()

    def watch() -> None:  # when the scheduler marks the replica down
        while not noticed_at and time.monotonic() < deadline:
            if cut_at and not hosts.front.replica(hosts.address(victim)).up:
                noticed_at.append(time.monotonic())
            time.sleep(0.02)

    deadline = time.monotonic() + 120
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        disturbed = run_streams(hosts.front, hosts.prompts, MAX_TOKENS, on_progress)
    finally:
        deadline = 0.0
        watcher.join()
        # Down until the link is back: seen by the watcher, or now (its streams ended between two looks).
        marked_down = bool(noticed_at) or not hosts.front.replica(hosts.address(victim)).up
        victim.restore()
    assert cut_at, "the link was never cut"
    assert marked_down, "the scheduler never marked the cut replica down"
    detection = f"{noticed_at[0] - cut_at[0]:.2f} s" if noticed_at else "the streams' end"
    print(f"\nlink cut: noticed after {detection}; longest stall of a stream {disturbed.longest_stall_s:.2f} s; "
          f"streams failed {len(disturbed.errors)}")
    assert disturbed.outputs == reference  # same ids, no error, nothing lost or repeated
    stats = hosts.front.stats()
    assert stats.service.num_recovered_sequences > 0  # streams really moved off the cut replica
    assert stats.pool.used_blocks == 0 and all(r.pool.used_blocks == 0 for r in stats.replicas), \
        f"leaked KV blocks: {stats.pool.used_blocks} ({[r.pool.used_blocks for r in stats.replicas]} per replica)"
    rejoin = hosts.front.wait_replica(hosts.address(victim), up=True, timeout_s=15)
    print(f"link back: the replica rejoined after {rejoin:.2f} s")
    hosts.streams_only_on(victim, [survivor])  # and takes requests again: alone, it serves every stream


def test_replica_added_behind_the_dns_name_takes_requests(hosts: MultiHost) -> None:
    assert hosts.reference  # taken on the two replicas, before the third joins
    added = hosts.added
    process = start_worker(added, hosts.model)
    wait_ready(hosts.address(added), process)
    hosts.scheduler.set_hosts({DNS_NAME: [added.address]})  # a new address behind the name
    joined = hosts.front.wait_replica(hosts.address(added), up=True, timeout_s=20)
    print(f"\nadded replica joined {joined:.2f} s after its DNS record appeared")
    assert len(hosts.front.stats().replicas) == 3
    hosts.streams_only_on(added, hosts.workers)


def test_netem_delay_on_every_link(hosts: MultiHost) -> None:
    reason = netem_reason()
    if reason is not None:
        print(f"\nSKIP: {reason}")
        pytest.skip(reason)
    reference = hosts.reference
    plain = run_streams(hosts.front, hosts.prompts, MAX_TOKENS)
    links = [hosts.gateway, hosts.scheduler, *hosts.workers, hosts.added]
    for host in links:
        host.delay(1.0)
    try:
        delayed = run_streams(hosts.front, hosts.prompts, MAX_TOKENS)
    finally:
        for host in links:
            host.clear_delay()
    print(f"\nthroughput: {plain.tokens_per_s:.0f} tokens/s without delay, {delayed.tokens_per_s:.0f} tokens/s "
          f"with 1 ms netem delay on every link ({delayed.tokens_per_s / plain.tokens_per_s:.2f}x)")
    assert plain.outputs == reference and delayed.outputs == reference


def test_tensor_parallel_ranks_on_two_hosts_match_tp1(network: Network, tiny_llama_dir: Path) -> None:
    """Rank 0 and rank 1 of one replica in different namespaces, meeting through tp_init_method
    (a TCP store at rank 0's address); the scheduler knows rank 0 alone. Greedy output is
    token-identical to tensor parallel 1."""
    rank_hosts, front = [network.add_host("rank0"), network.add_host("rank1")], network.add_host("front")
    prompts = make_prompts()
    tp1 = engine_greedy(tiny_llama_dir, prompts, block_size=5)
    worker = f"{rank_hosts[0].address}:{WORKER_PORT}"
    tp_flags = ["--tensor-parallel-size", "2", "--tp-init-method", f"tcp://{rank_hosts[0].address}:29500"]
    ranks = [start_service(host, "worker", tiny_llama_dir, "--block-size", "5", "--worker-address", worker, *tp_flags,
                           "--tp-rank", str(rank)) for rank, host in enumerate(rank_hosts)]
    wait_ready(worker, ranks[0])
    assert ranks[1].poll() is None
    with pytest.raises(OSError):  # rank 1 serves no gRPC: only rank 0 is anyone's peer
        socket.create_connection((rank_hosts[1].address, WORKER_PORT), timeout=2).close()
    stack = Front(f"{front.address}:{GATEWAY_PORT}", f"{front.address}:{SCHEDULER_PORT}")
    scheduler = start_service(front, "scheduler", tiny_llama_dir, "--block-size", "5",
                              "--scheduler-address", stack.scheduler, "--worker-addresses", worker)
    wait_ready(stack.scheduler, scheduler)
    gateway = start_service(front, "gateway", tiny_llama_dir, "--scheduler-address", stack.scheduler,
                            "--serving-host", front.address, "--serving-port", str(GATEWAY_PORT),
                            "--serving-http-port", str(HTTP_PORT))
    wait_ready(stack.gateway, gateway)
    run = run_streams(stack, prompts, NEW_TOKENS)
    assert not run.errors and [run.tokens[i] for i in range(len(prompts))] == tp1
    with grpc.insecure_channel(worker) as channel:
        described = worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=10)
    assert described.tensor_parallel_size == 2
    replicas = stack.stats().replicas
    assert [r.address for r in replicas] == [worker] and replicas[0].pool.used_blocks == 0


def test_link_latency_of_1_ms_each_way_through_relays(tiny_llama_dir: Path) -> None:
    """Without netem (this kernel has none): every internal hop through a relay that delays each
    chunk 1 ms each way, on and off in turns; the streams stay identical, and the throughput is
    printed next to the same relays without delay (noisy on a shared 2-core box: medians of 3)."""
    with network_or_skip() as net:
        stack = MultiHost(net, tiny_llama_dir, relayed=True)
        stack.start()
        reference = stack.reference
        plain, delayed = [], []
        for _ in range(3):
            plain.append(run_streams(stack.front, stack.prompts, MAX_TOKENS))
            stack.set_delay(True)
            delayed.append(run_streams(stack.front, stack.prompts, MAX_TOKENS))
            stack.set_delay(False)
        assert all(r.outputs == reference for r in plain + delayed)
        fast, slow = (statistics.median(r.tokens_per_s for r in runs) for runs in (plain, delayed))
        print(f"\nthroughput through relays: {fast:.0f} tokens/s without delay, {slow:.0f} tokens/s with 1 ms each way "
              f"on every internal hop ({slow / fast:.2f}x; {NUM_STREAMS} streams x {MAX_TOKENS} tokens, 2 replicas)")
