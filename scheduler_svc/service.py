"""The scheduler process: `hetero.v1.Scheduler` over gRPC, driving one or more worker replicas.

One asyncio loop owns everything: Submit handlers route a request to a replica (data
parallel: each replica has its own core `Scheduler` and block pool) and wait on its event
stream; each replica's engine loop plans a step, awaits its worker and publishes token
events. No locks are needed around the core schedulers because they only run on this loop.

Resilience: a request id names one generation. A Submit for an id already in flight
re-attaches to that generation (it replays the events so far, then follows) instead of
starting another, so the gateway can retry a Submit whose connection broke. When a replica's
worker dies, its sequences are recomputed on another replica from the tokens they already
produced (their streams go on without a gap or a repeat), or wait up to
`worker_recovery_timeout_s` for a replica to come back, then end with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass, field

import grpc
import structlog

from hetero.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from hetero_common.config import Config
from hetero_common.errors import DuplicateRequestError, HeteroError, OverloadedError, UnavailableError
from hetero_common.grpc_server import (CHANNEL_OPTIONS, add_health_and_reflection, bind, error_status,
                                      internal_listen_address, server_credentials, set_serving_aio)
from scheduler_svc.replica import Replica
from scheduler_svc.router import Router
from scheduler_svc.scheduler import TokenOutput
from scheduler_svc.sequence import Sequence

log = structlog.get_logger("scheduler_svc.service")
SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
FR = common_pb2
# Finish reasons that end the Submit call with a gRPC status instead of a last event.
DEADLINE_MARGIN_S = 0.1
STATUS_FOR_REASON = {FR.FINISH_REASON_DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED}


@dataclass
class RequestStream:
    """One generation's events so far and the Submit calls following it."""

    request_id: str
    fingerprint: bytes  # the SubmitRequest: a re-attaching Submit must be the same request
    history: list[scheduler_pb2.TokenEvent] = field(default_factory=list)
    listeners: list[asyncio.Queue[scheduler_pb2.TokenEvent]] = field(default_factory=list)
    open_samples: set[int] = field(default_factory=lambda: {0})  # n > 1: the stream ends when every sample has
    finished: bool = False
    status: grpc.StatusCode | None = None  # end the calls with this status instead of the last event

    def attach(self) -> asyncio.Queue[scheduler_pb2.TokenEvent]:
        queue: asyncio.Queue[scheduler_pb2.TokenEvent] = asyncio.Queue()
        for event in self.history:
            queue.put_nowait(event)
        self.listeners.append(queue)
        return queue

    def publish(self, event: scheduler_pb2.TokenEvent) -> None:
        self.history.append(event)
        for queue in self.listeners:
            queue.put_nowait(event)


@dataclass
class Orphan:
    """A request's samples with no replica to run on (all down), waiting for one to come back."""

    seqs: list[Sequence]
    since: float


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, config: Config) -> None:
        self.config = config
        self.replicas = [Replica(i, address, config, self._dispatch, self._replica_lost, self._replica_joined)
                         for i, address in enumerate(config.replica_addresses())]
        self.router = Router(config.routing_policy, config.block_size, len(self.replicas))
        self.streams: dict[str, RequestStream] = {}
        self.orphans: dict[str, Orphan] = {}
        self.all_down_since: float | None = None
        self.num_rejected_queue_full = 0
        self.num_recovered_sequences = 0
        self.num_deadline_exceeded = 0  # orphans and callers gone past their deadline (replicas count their own)
        self._orphan_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Wait for the workers (at least one must answer), then start the engine loops and watches."""
        results = await asyncio.gather(*(r.connect(self.config.startup_timeout_s) for r in self.replicas),
                                       return_exceptions=True)
        for replica, result in zip(self.replicas, results):
            if isinstance(result, BaseException):
                log.error("worker replica not ready at start", replica=replica.index, address=replica.address, error=str(result))
        if not any(r.up for r in self.replicas):
            raise RuntimeError(f"no worker replica answered within startup_timeout_s ({self.config.startup_timeout_s:g} s)")
        for replica in self.replicas:
            replica.start_tasks()
        self._orphan_task = asyncio.create_task(self._orphan_watch())
        first = next(r for r in self.replicas if r.up)
        log.info("scheduler ready", replicas=len(self.replicas), replicas_up=sum(r.up for r in self.replicas),
                 routing=self.config.routing_policy, num_blocks=first.core.num_blocks if first.core else 0)

    # ------------------------------------------------------------------ routing and recovery

    def _up(self) -> list[Replica]:
        return [r for r in self.replicas if r.up]

    def _place(self, seqs: list[Sequence]) -> bool:
        """Queue a request's samples on one replica chosen by the routing policy; False when none is up."""
        up = self._up()
        if not up:
            return False
        decision = self.router.choose(seqs[0].token_ids, [r.index for r in up], {r.index: r.load for r in up})
        replica = self.replicas[decision.replica]
        assert replica.core is not None
        for seq in seqs:
            replica.core.adopt(seq)
        replica.wake.set()
        return True

    def _replica_lost(self, replica: Replica, seqs: list[Sequence]) -> None:
        self.router.forget(replica.index)
        if not self._up() and self.all_down_since is None:
            self.all_down_since = time.monotonic()
        now = time.monotonic()
        by_request: dict[str, list[Sequence]] = {}
        for seq in seqs:  # a request's samples stay together (aborts and stats find them on one replica)
            by_request.setdefault(seq.request_id, []).append(seq)
        for request_id, samples in by_request.items():
            self.num_recovered_sequences += len(samples)
            if not self._place(samples):
                self.orphans[request_id] = Orphan(samples, now)

    def _replica_joined(self, replica: Replica) -> None:
        self.router.forget(replica.index)
        if replica.core is not None:
            self.router.set_capacity(replica.index, replica.core.num_blocks)
        self.all_down_since = None
        for request_id in list(self.orphans):
            self._place(self.orphans.pop(request_id).seqs)

    def _waiting_count(self) -> int:
        return sum(len(r.core.waiting) for r in self.replicas if r.up and r.core is not None) + len(self.orphans)

    def _find(self, request_id: str) -> Replica | None:
        return next((r for r in self.replicas if r.core is not None and request_id in r.core.requests), None)

    def _end(self, request_id: str, reason: int, error: str = "", status: grpc.StatusCode | None = None,
             index: int | None = None) -> None:
        """End a request (or one of its samples) wherever it is, a replica or the orphans, and tell its listeners."""
        replica = self._find(request_id)
        if replica is not None and replica.core is not None:
            replica.core.abort(request_id, reason, index)
        orphan = self.orphans.get(request_id)
        if orphan is not None:
            orphan.seqs = [s for s in orphan.seqs if index is not None and s.index != index]
            if not orphan.seqs:
                del self.orphans[request_id]
        stream = self.streams.get(request_id)
        if stream is not None and not stream.finished:
            stream.status = status
            ended = sorted(stream.open_samples) if index is None else [index]
            self._dispatch([TokenOutput(request_id, finish_reason=reason, error=error, index=i) for i in ended])

    async def _orphan_watch(self) -> None:
        """Orphans past their deadline, or waiting longer than worker_recovery_timeout_s, end here."""
        while True:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            for request_id, orphan in list(self.orphans.items()):
                if orphan.seqs[0].deadline is not None and orphan.seqs[0].deadline <= now:
                    self.num_deadline_exceeded += 1
                    self._end(request_id, FR.FINISH_REASON_DEADLINE, "the request's deadline passed",
                              grpc.StatusCode.DEADLINE_EXCEEDED)
                elif now - orphan.since > self.config.worker_recovery_timeout_s:
                    self._end(request_id, FR.FINISH_REASON_ERROR,
                              f"no worker replica came back within worker_recovery_timeout_s "
                              f"({self.config.worker_recovery_timeout_s:g} s)", grpc.StatusCode.UNAVAILABLE)

    def _dispatch(self, outputs: list[TokenOutput]) -> None:
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue
            ends_sample = out.finish_reason != FR.FINISH_REASON_UNSPECIFIED
            if ends_sample:
                if out.index not in stream.open_samples:
                    continue  # that sample already ended (e.g. aborted while its last step ran)
                stream.open_samples.discard(out.index)
                if stream.status is None:
                    stream.status = STATUS_FOR_REASON.get(out.finish_reason)
            stream.publish(scheduler_pb2.TokenEvent(
                request_id=out.request_id, token_ids=out.token_ids, finish_reason=out.finish_reason, error=out.error,
                index=out.index, cached_prompt_tokens=out.cached_prompt_tokens, logprobs=out.logprobs,
                token_timestamps=[out.timestamp] * len(out.token_ids) if out.timestamp else [],
                top_logprobs=out.top_logprobs, queue_seconds=out.queue_seconds))
            if ends_sample and not stream.open_samples:
                stream.finished = True
                self.streams.pop(out.request_id, None)

    # ------------------------------------------------------------------ RPCs

    def _admit(self, request: scheduler_pb2.SubmitRequest, deadline: float | None) -> Sequence:
        """Validate, bound the queue, and queue the request on a replica (or park it while all are down)."""
        if self._waiting_count() >= self.config.max_queued_requests:
            self.num_rejected_queue_full += 1
            raise OverloadedError(f"the waiting queue is full ({self.config.max_queued_requests} requests, "
                                  "max_queued_requests); retry later")
        prompt = list(request.prompt_token_ids)
        up = self._up()
        if up:
            decision = self.router.choose(prompt, [r.index for r in up], {r.index: r.load for r in up})
            replica = self.replicas[decision.replica]
            assert replica.core is not None
            seq = replica.core.add_request(request.request_id, prompt, request.params, request.cache_salt)
            seq.deadline = deadline
            replica.wake.set()
            return seq
        if self.all_down_since is None or time.monotonic() - self.all_down_since > self.config.worker_recovery_timeout_s:
            raise UnavailableError("no worker replica is up (worker_recovery_timeout_s passed); check the worker processes")
        # Every replica is down but may come back: validate with a replica's core, then park the request.
        core = next(r.core for r in self.replicas if r.core is not None)
        seq = core.add_request(request.request_id, prompt, request.params, request.cache_salt)
        core.take_all_for_recompute()  # the down replica's core is empty but for this one sequence
        seq.deadline = deadline
        self.orphans[seq.request_id] = Orphan([seq], time.monotonic())
        return seq

    async def Submit(self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        with structlog.contextvars.bound_contextvars(request_id=rid):
            stream = self.streams.get(rid)
            remaining = context.time_remaining()
            # A little before gRPC's own deadline, so the request ends here (finish reason DEADLINE,
            # blocks freed) rather than by the caller's cancellation racing it.
            deadline = None if remaining is None else time.monotonic() + remaining - DEADLINE_MARGIN_S
            fingerprint = request.SerializeToString(deterministic=True)
            if stream is None:
                try:
                    seq = self._admit(request, deadline)
                except HeteroError as exc:
                    await context.abort(*error_status(exc))
                stream = self.streams[rid] = RequestStream(rid, fingerprint, open_samples=set(range(seq.sampling.n)))
                log.debug("submitted", prompt_tokens=len(request.prompt_token_ids))
            elif stream.fingerprint != fingerprint:
                await context.abort(*error_status(DuplicateRequestError(
                    f"request_id {rid!r} is in flight with a different prompt or parameters; use a unique id per request")))
            else:
                log.info("submit for a request in flight: re-attached to its stream")
            queue = stream.attach()
            open_samples = set(stream.open_samples) | {e.index for e in stream.history if e.finish_reason}
            done = False
            try:
                while not done:
                    event = await queue.get()
                    if event.finish_reason != FR.FINISH_REASON_UNSPECIFIED:
                        open_samples.discard(event.index)
                    done = not open_samples
                    if done and stream.status is not None:
                        await context.abort(stream.status, event.error or FR.FinishReason.Name(event.finish_reason))
                    yield event
            finally:
                stream.listeners.remove(queue)
                if not stream.finished and not stream.listeners:
                    # The last caller went away (cancelled, or its deadline passed): free the blocks now.
                    passed = deadline is not None and time.monotonic() >= deadline
                    if passed:
                        self.num_deadline_exceeded += 1
                    self._end(rid, FR.FINISH_REASON_DEADLINE if passed else FR.FINISH_REASON_ABORT)
                    self.streams.pop(rid, None)
                    log.info("deadline passed" if passed else "aborted by caller")

    async def Abort(self, request: scheduler_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> scheduler_pb2.AbortResponse:
        reason = request.reason or FR.FINISH_REASON_ABORT
        index = request.index if request.HasField("index") else None
        stream = self.streams.get(request.request_id)
        found = self._find(request.request_id) is not None or request.request_id in self.orphans
        if index is not None:
            found = found and stream is not None and index in stream.open_samples
        if found:
            self._end(request.request_id, reason, index=index)
        return scheduler_pb2.AbortResponse(found=found)

    async def Suspend(self, request: scheduler_pb2.SuspendRequest, context: grpc.aio.ServicerContext) -> scheduler_pb2.SuspendResponse:
        """Pause every replica after its step in flight; the workers keep, offload or drop their KV caches."""
        mode = request.mode or FR.KVCacheManagementMode.Value(
            "KV_CACHE_MANAGEMENT_MODE_" + self.config.kv_cache_management_mode.upper())
        released = 0
        try:
            for replica in self._up():
                released += await replica.suspend(mode)
        except grpc.aio.AioRpcError as exc:
            for replica in self._up():
                await replica.resume()
            await context.abort(exc.code(), f"a worker could not suspend its KV cache: {exc.details()}")
        log.info("engine suspended", mode=FR.KVCacheManagementMode.Name(mode), released_bytes=released)
        return scheduler_pb2.SuspendResponse(mode=mode, released_bytes=released)

    async def Resume(self, request: scheduler_pb2.ResumeRequest, context: grpc.aio.ServicerContext) -> scheduler_pb2.ResumeResponse:
        try:
            for replica in self._up():
                await replica.resume()
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), f"a worker could not resume its KV cache: {exc.details()}")
        log.info("engine resumed")
        return scheduler_pb2.ResumeResponse()

    async def GetStats(self, request: scheduler_pb2.GetStatsRequest, context: grpc.aio.ServicerContext) -> scheduler_pb2.SchedulerStats:
        total = common_pb2.PoolStats()
        replicas = []
        waste_weighted = 0.0  # internal waste of the replicas, weighted by their used blocks
        for r in self.replicas:
            pool = r.core.pool_stats() if r.core is not None else common_pb2.PoolStats()
            replicas.append(scheduler_pb2.ReplicaStatus(index=r.index, address=r.address, up=r.up,
                                                        pid=r.info.pid if r.info else 0, pool=pool))
            for name in ("total_blocks", "used_blocks", "free_blocks", "cached_blocks", "num_running", "num_waiting",
                         "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_swapped"):
                setattr(total, name, getattr(total, name) + getattr(pool, name))
            total.steps = max(total.steps, pool.steps)
            total.block_size = pool.block_size or total.block_size
            total.num_deadline_exceeded += r.num_deadline_exceeded
            total.suspended = total.suspended or (r.core is not None and r.core.suspended)
            waste_weighted += pool.internal_waste * pool.used_blocks
        total.usage = total.used_blocks / total.total_blocks if total.total_blocks else 0.0
        total.internal_waste = waste_weighted / total.used_blocks if total.used_blocks else 0.0
        total.num_waiting += sum(len(o.seqs) for o in self.orphans.values())
        total.num_workers = len(self.replicas)
        total.num_workers_up = len(self._up())
        total.num_deadline_exceeded += self.num_deadline_exceeded
        total.num_rejected_queue_full = self.num_rejected_queue_full
        total.num_recovered_sequences = self.num_recovered_sequences
        total.routing_prefix_blocks_queried = self.router.blocks_queried
        total.routing_prefix_blocks_hit = self.router.blocks_hit
        info = next((r.info for r in self.replicas if r.info is not None), None)
        max_model_len = next((r.core.max_model_len for r in self.replicas if r.core is not None), self.config.max_model_len)
        return scheduler_pb2.SchedulerStats(pool=total, model=info.model_name if info else "", max_model_len=max_model_len,
                                            attention_backend=info.attention_backend if info else "",
                                            device=info.device if info else "", replicas=replicas)


async def serve_scheduler(config: Config) -> None:
    servicer = SchedulerServicer(config)
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    health = add_health_and_reflection(server, [SERVICE_NAME], aio=True)
    listen = internal_listen_address(config, config.scheduler_address)
    if bind(server, listen, server_credentials(config.internal_tls, mutual=True)) == 0:
        raise SystemExit(f"scheduler: cannot bind {listen}; is another process using it?")
    await server.start()
    await servicer.start()
    await set_serving_aio(health, [SERVICE_NAME])
    log.info("scheduler serving", address=listen, mutual_tls=config.internal_tls.enabled)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # Drain: report NOT_SERVING, refuse new calls, let in-flight ones finish within drain_grace_s.
    await set_serving_aio(health, [SERVICE_NAME], serving=False)
    log.info("draining", grace_s=config.drain_grace_s, in_flight=len(servicer.streams))
    await server.stop(grace=config.drain_grace_s)
    log.info("scheduler stopped")
