"""The worker replicas (data parallel: each with its own core scheduler and block pool) and
where requests run on them: placement by the routing policy, a bounded waiting queue, and
recovery when a replica is lost.

A lost replica's sequences are recomputed on another replica from the tokens they already
produced (their streams go on without a gap or a repeat). While every replica is down they
are parked as orphans and wait up to `worker_recovery_timeout_s` for one to come back, then
end with UNAVAILABLE.

Replicas are the static list (`worker_addresses`) plus those behind `worker_dns`
(discovery.py). A replica's index is its position in `replicas`, given once and never reused:
an address that appears gets the next index and joins after a `Describe`; one that leaves the
DNS answer is retired (handled as a dead worker, then kept, not counted); if it comes back it
takes its old index again. So indexes in logs, stats and the router stay stable while replicas
come and go.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import grpc
import structlog

from hetero.v1 import common_pb2, scheduler_pb2
from hetero_common.config import Config
from hetero_common.errors import OverloadedError, UnavailableError
from scheduler_svc.core.scheduler import StepOutputs
from scheduler_svc.core.stats import ServiceCounters, merge_pools
from scheduler_svc.lora.lora_manager import LoraManager
from scheduler_svc.lora.lora_registry import LoraRegistry
from scheduler_svc.replicas.discovery import resolve, split_host_port, watch_dns
from scheduler_svc.replicas.replica import Replica
from scheduler_svc.replicas.router import Router
from scheduler_svc.sequence import Sequence

log = structlog.get_logger("scheduler_svc.replicas.replica_set")
ORPHAN_WATCH_INTERVAL_S = 0.1

# Ends a request wherever it is and tells its listeners: (request_id, reason, error, status).
EndRequest = Callable[[str, int, str, grpc.StatusCode], None]


@dataclass
class Orphan:
    """A request's samples with no replica to run on (all down), waiting for one to come back."""

    seqs: list[Sequence]
    since: float


class ReplicaSet:
    """`dispatch` takes every replica's token events; `end_request` ends an orphan that waited too long."""

    def __init__(self, config: Config, dispatch: Callable[[StepOutputs], None], end_request: EndRequest) -> None:
        self.config = config
        registry = LoraRegistry(config.max_loras, config.serving.model_name, config.lora_modules)
        self.loras = LoraManager(registry, self.up, self._lora_slots_in_use)
        self.replicas = [Replica(i, address, config, registry, dispatch, self._replica_lost, self._replica_joined)
                         for i, address in enumerate(config.replica_addresses())]
        self.router = Router(config.routing_policy, config.block_size, len(self.replicas))
        self._orphans: dict[str, Orphan] = {}
        self._all_down_since: float | None = None
        self.counters = ServiceCounters()
        self._end_request = end_request
        self._orphan_task: asyncio.Task[None] | None = None
        self._dns_task: asyncio.Task[None] | None = None
        self._dispatch = dispatch

    async def start(self) -> None:
        """Wait for the static workers and for at least one replica to answer, then start the
        engine loops, the watches and the DNS discovery."""
        static = list(self.replicas)
        if self.config.worker_dns:  # the replicas behind the name at start join through their watch
            await self.update_dns(await resolve(self.config.worker_dns) or [])
        results = await asyncio.gather(*(r.connect(self.config.startup_timeout_s) for r in static),
                                       return_exceptions=True)
        for replica, result in zip(static, results):
            if isinstance(result, BaseException):
                log.error("worker replica not ready at start", replica=replica.index, address=replica.address, error=str(result))
        for replica in static:
            replica.start_tasks()
        if self.config.worker_dns:
            self._dns_task = asyncio.create_task(watch_dns(self.config.worker_dns, self.config.worker_dns_refresh_s,
                                                           self.update_dns))
        deadline = time.monotonic() + self.config.startup_timeout_s
        while not self.up() and self.config.worker_dns and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # no static replica answered: wait for one behind worker_dns
        if not self.up():
            raise RuntimeError(f"no worker replica answered within startup_timeout_s ({self.config.startup_timeout_s:g} s)")
        self._orphan_task = asyncio.create_task(self._orphan_watch())
        first = next(r for r in self.replicas if r.up)
        log.info("scheduler ready", replicas=len(self.active()), replicas_up=len(self.up()),
                 routing=self.config.routing_policy, num_blocks=first.num_blocks)

    def up(self) -> list[Replica]:
        return [r for r in self.replicas if r.up]

    def active(self) -> list[Replica]:
        """Every replica but those whose address left worker_dns."""
        return [r for r in self.replicas if not r.retired]

    async def update_dns(self, addresses: list[str]) -> None:
        """The replicas behind worker_dns are now `addresses`: new ones are added (they join once
        they answer Describe); those missing are retired as dead workers."""
        wanted = set(addresses)
        for replica in self.replicas:
            if replica.from_dns and not replica.retired and replica.address not in wanted:
                log.warning("replica left worker_dns; retiring it", replica=replica.index, address=replica.address)
                await replica.retire()
        by_address = {r.address: r for r in self.replicas}
        for address in addresses:
            replica = by_address.get(address)
            if replica is None:
                # Dialled by its IP; with internal TLS its certificate names the DNS name.
                replica = Replica(len(self.replicas), address, self.config, self.loras.registry, self._dispatch,
                                  self._replica_lost, self._replica_joined,
                                  tls_server_name=split_host_port(self.config.worker_dns)[0])
                replica.from_dns = True
                self.replicas.append(replica)
                self.router.add_replica()
                log.info("replica found through worker_dns", replica=replica.index, address=address)
            elif not replica.retired:
                continue  # already here (a static replica, or found before)
            replica.start_tasks()

    # ------------------------------------------------------------------ requests

    def submit(self, request: scheduler_pb2.SubmitRequest, deadline: float | None) -> Sequence:
        """Validate, bound the queue, and queue the request on a replica (or park it while all are down)."""
        if self._num_waiting() >= self.config.max_queued_requests:
            self.counters.num_rejected_queue_full += 1
            raise OverloadedError(f"the waiting queue is full ({self.config.max_queued_requests} requests, "
                                  "max_queued_requests); retry later")
        # The salt the pool hashes the prompt with: a LoRA adapter's blocks are its own (lora_registry.py).
        cache_salt = self.loras.registry.place(request.lora_adapter, request.cache_salt)[1]
        chosen = self._choose(list(request.prompt_token_ids), cache_salt)
        if chosen is not None:
            replica, block_hashes = chosen
            return replica.submit(request, deadline, block_hashes)
        if self._all_down_since is None or time.monotonic() - self._all_down_since > self.config.worker_recovery_timeout_s:
            raise UnavailableError("no worker replica is up (worker_recovery_timeout_s passed); check the worker processes")
        # Every replica is down but may come back: validate with a replica's core, then park the request.
        seq = next(r for r in self.replicas if r.has_joined).detached_sequence(request, deadline)
        self._orphans[seq.request_id] = Orphan([seq], time.monotonic())
        return seq

    def has_request(self, request_id: str) -> bool:
        return any(r.has_request(request_id) for r in self.replicas) or request_id in self._orphans

    def drop(self, request_id: str, reason: int, index: int | None = None) -> None:
        """End a request (or one of its samples) wherever it is: on a replica or among the orphans."""
        replica = next((r for r in self.replicas if r.has_request(request_id)), None)
        if replica is not None:
            replica.abort(request_id, reason, index)
        orphan = self._orphans.get(request_id)
        if orphan is not None:
            orphan.seqs = [s for s in orphan.seqs if index is not None and s.index != index]
            if not orphan.seqs:
                del self._orphans[request_id]

    def _lora_slots_in_use(self) -> Counter[int]:
        """Requests per LoRA slot, on the replicas and parked (0: the base model's)."""
        slots = Counter(slot for r in self.replicas for slot in r.lora_slots_in_use())
        slots.update(orphan.seqs[0].lora_slot for orphan in self._orphans.values())
        return slots

    def _num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.up()) + len(self._orphans)

    # ------------------------------------------------------------------ placement and recovery

    def _choose(self, token_ids: list[int], cache_salt: str) -> tuple[Replica, list[bytes]] | None:
        """The replica the routing policy picks for these tokens among those up, and the prompt's
        block hashes it computed; None when none is up. The salt keeps the router's view of a
        replica's prefix cache the cache's own."""
        up = self.up()
        if not up:
            return None
        decision = self.router.choose(token_ids, [r.index for r in up], {r.index: r.load for r in up}, cache_salt)
        return self.replicas[decision.replica], decision.block_hashes

    def _place(self, seqs: list[Sequence]) -> bool:
        """Queue a request's samples (to be recomputed) on one replica; False when none is up."""
        chosen = self._choose(seqs[0].token_ids, seqs[0].cache_salt)
        if chosen is None:
            return False
        chosen[0].adopt(seqs)
        return True

    def _replica_lost(self, replica: Replica, seqs: list[Sequence]) -> None:
        self.router.forget(replica.index)
        if not self.up() and self._all_down_since is None:
            self._all_down_since = time.monotonic()
        now = time.monotonic()
        by_request: dict[str, list[Sequence]] = {}
        for seq in seqs:  # a request's samples stay together (aborts and stats find them on one replica)
            by_request.setdefault(seq.request_id, []).append(seq)
        for request_id, samples in by_request.items():
            self.counters.num_recovered_sequences += len(samples)
            if not self._place(samples):
                self._orphans[request_id] = Orphan(samples, now)

    def _replica_joined(self, replica: Replica) -> None:
        self.router.forget(replica.index)
        self.router.set_capacity(replica.index, replica.num_blocks)
        self._all_down_since = None
        for request_id in list(self._orphans):
            self._place(self._orphans.pop(request_id).seqs)

    async def _orphan_watch(self) -> None:
        """Orphans past their deadline, or waiting longer than worker_recovery_timeout_s, end here."""
        while True:
            await asyncio.sleep(ORPHAN_WATCH_INTERVAL_S)
            now = time.monotonic()
            for request_id, orphan in list(self._orphans.items()):
                if orphan.seqs[0].deadline is not None and orphan.seqs[0].deadline <= now:
                    self.counters.num_deadline_exceeded += 1
                    self._end_request(request_id, common_pb2.FINISH_REASON_DEADLINE, "the request's deadline passed",
                                      grpc.StatusCode.DEADLINE_EXCEEDED)
                elif now - orphan.since > self.config.worker_recovery_timeout_s:
                    self._end_request(request_id, common_pb2.FINISH_REASON_ERROR,
                                      f"no worker replica came back within worker_recovery_timeout_s "
                                      f"({self.config.worker_recovery_timeout_s:g} s)", grpc.StatusCode.UNAVAILABLE)

    # ------------------------------------------------------------------ suspend, resume, stats

    async def suspend(self, mode: int) -> int:
        """Suspend every replica up (see `Replica.suspend`); if one fails, resume them all and re-raise."""
        released = 0
        try:
            for replica in self.up():
                released += await replica.suspend(mode)
        except grpc.aio.AioRpcError:
            for replica in self.up():
                await replica.resume()
            raise
        return released

    async def resume(self) -> None:
        for replica in self.up():
            await replica.resume()

    def stats(self) -> scheduler_pb2.SchedulerStats:
        statuses = [r.status() for r in self.active()]
        pool = merge_pools(s.pool for s in statuses)
        pool.num_waiting += sum(len(o.seqs) for o in self._orphans.values())
        service = common_pb2.ServiceStats(
            num_workers=len(self.active()), num_workers_up=len(self.up()),
            num_deadline_exceeded=self.counters.num_deadline_exceeded + sum(r.num_deadline_exceeded for r in self.replicas),
            num_rejected_queue_full=self.counters.num_rejected_queue_full,
            num_recovered_sequences=self.counters.num_recovered_sequences,
            routing_prefix_blocks_queried=self.router.blocks_queried, routing_prefix_blocks_hit=self.router.blocks_hit,
            lora_adapters_loaded=len(self.loras.registry.adapters()), lora_slots_in_use=self.loras.registry.slots_in_use)
        info = next((r.info for r in self.replicas if r.info is not None), None)
        max_model_len = next((r.max_model_len for r in self.replicas if r.max_model_len is not None),
                             self.config.max_model_len)
        return scheduler_pb2.SchedulerStats(pool=pool, model=info.model_name if info else "", max_model_len=max_model_len,
                                            attention_backend=info.attention_backend if info else "",
                                            device=info.device if info else "", service=service, replicas=statuses,
                                            architecture=info.architecture if info else "",
                                            num_experts=info.num_experts if info else 0,
                                            num_experts_per_tok=info.num_experts_per_tok if info else 0)
