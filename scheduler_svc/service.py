"""The scheduler process: `hetero.v1.Scheduler` over gRPC, driving one or more worker replicas.

One asyncio loop owns everything: Submit handlers queue a request on the replica set and
follow its stream of token events; each replica's engine loop plans a step, awaits its worker
and publishes token events. No locks are needed around the core schedulers because they only
run on this loop. The handlers here only translate between gRPC and the replica set
(`replica_set.py`: placement, replica loss and recovery) and the streams (`request_streams.py`:
fan-out and re-attach).
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, TypeVar

import grpc
import structlog

from hetero.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from hetero_common.config import Config
from hetero_common.errors import DuplicateRequestError, HeteroError
from hetero_common.finish_reasons import finish_reason_name, is_finished
from hetero_common.gc_tuning import tune_gc
from hetero_common.grpc_server import (
    add_health_and_reflection,
    bind,
    check_internal_bind,
    end_call,
    internal_listen_address,
    internal_server_options,
    server_credentials,
    set_serving_aio,
    set_status,
    termination_signal,
)
from hetero_common.tenancy import client_id
from scheduler_svc.replicas.followers import Followers, Forwarder
from scheduler_svc.replicas.replica_set import ReplicaSet
from scheduler_svc.request_streams import Listener, RequestStream, RequestStreams

log = structlog.get_logger("scheduler_svc.service")
T = TypeVar("T")
SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
# A request's own deadline is this much before the caller's gRPC deadline.
DEADLINE_MARGIN_S = 0.1


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, config: Config) -> None:
        self.config = config
        self.streams = RequestStreams()
        self.followers = Followers()
        self.replica_set = ReplicaSet(config, self.streams.dispatch, self._end)

    async def start(self) -> None:
        await self.replica_set.start()

    def _end(self, request_id: str, reason: int, error: str = "", status: grpc.StatusCode | None = None,
             index: int | None = None) -> None:
        """End a request (or one of its samples) wherever it is, and tell its listeners."""
        self.replica_set.drop(request_id, reason, index)
        self.streams.end(request_id, reason, error, status, index)

    async def Submit(self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        with structlog.contextvars.bound_contextvars(request_id=rid):
            stream = self.streams.get(rid)
            remaining = context.time_remaining()
            # A little before gRPC's own deadline, so the request ends here (finish reason DEADLINE,
            # blocks freed) rather than by the caller's cancellation racing it.
            deadline = None if remaining is None else time.monotonic() + remaining - DEADLINE_MARGIN_S
            # Where the events go is no part of the request: a retry re-attaches on a new Follow stream.
            follower_id = request.follower_id
            request.ClearField("follower_id")
            fingerprint = request.SerializeToString(deterministic=True)
            if stream is None:
                try:
                    seq = self.replica_set.submit(request, deadline)
                except HeteroError as exc:  # the status set, not raised: nothing keeps the request (end_call)
                    end_call(context, exc)
                    return
                stream = self.streams.open(rid, fingerprint, seq.sampling.n)
                log.debug("submitted", prompt_tokens=len(request.prompt_token_ids))
            elif stream.fingerprint != fingerprint:
                end_call(context, DuplicateRequestError(
                    f"request_id {rid!r} is in flight with a different prompt or parameters; use a unique id per request"))
                return
            else:
                log.info("submit for a request in flight: re-attached to its stream")
            if follower_id:  # the events go out on that Follow stream; this call only ends with the request
                await self._forward(stream, follower_id, deadline, context)
                return
            queue = stream.attach()
            open_samples = stream.samples_to_follow()
            done = False
            try:
                while not done:
                    event = await queue.get()
                    if is_finished(event.finish_reason):
                        open_samples.discard(event.index)
                    done = not open_samples
                    if done and stream.status is not None:
                        set_status(context, stream.status, event.error or finish_reason_name(event.finish_reason))
                        return
                    yield event
            finally:
                self._detach(stream, queue, deadline)

    async def _forward(self, stream: RequestStream, follower_id: str, deadline: float | None,
                       context: grpc.aio.ServicerContext) -> None:
        follower = self.followers.get(follower_id)
        forwarder = Forwarder(stream, follower)
        follower.submits += 1
        stream.attach_listener(forwarder)
        try:
            await forwarder.done.wait()
            last = forwarder.last
            if stream.status is not None and last is not None:
                set_status(context, stream.status, last.error or finish_reason_name(last.finish_reason))
        finally:
            follower.submits -= 1
            self.followers.release(follower)
            self._detach(stream, forwarder, deadline)

    def _detach(self, stream: RequestStream, listener: Listener, deadline: float | None) -> None:
        stream.detach(listener)
        if not stream.finished and not stream.listeners:
            # The last caller went away (cancelled, or its deadline passed): free the blocks now.
            passed = deadline is not None and time.monotonic() >= deadline
            if passed:
                self.replica_set.counters.num_deadline_exceeded += 1
            self._end(stream.request_id, common_pb2.FINISH_REASON_DEADLINE if passed else common_pb2.FINISH_REASON_ABORT)
            self.streams.close(stream.request_id)
            log.info("deadline passed" if passed else "aborted by caller")

    async def Follow(self, request: scheduler_pb2.FollowRequest, context: grpc.aio.ServicerContext):
        """One gateway's token events, a message per step, until it cancels (or this server drains)."""
        follower = self.followers.get(request.follower_id)
        follower.followed = True
        try:
            while (batch := await follower.next_batch()) is not None:
                yield scheduler_pb2.TokenEventBatch(events=batch)
        finally:
            follower.followed = False
            self.followers.release(follower)

    async def close_follows_when_idle(self, stopping: asyncio.Future[None]) -> None:
        """Draining: Follow calls never end by themselves, so end them once no request is in
        flight (their last events sent), or when the server stops anyway."""
        while len(self.streams) and not stopping.done():
            await asyncio.sleep(0.05)
        self.followers.close_all()

    async def Abort(self, request: scheduler_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> scheduler_pb2.AbortResponse:
        """End a request (`any_tenant`: every tenant's request of that client id, an admin's abort)."""
        reason = request.reason or common_pb2.FINISH_REASON_ABORT
        index = request.index if request.HasField("index") else None
        ids = self.streams.ids_of_client(request.request_id, client_id) if request.any_tenant else [request.request_id]
        found = False
        for rid in ids:
            if not self.replica_set.has_request(rid) or (index is not None and not self.streams.has_open_sample(rid, index)):
                continue
            self._end(rid, reason, index=index)
            found = True
        return scheduler_pb2.AbortResponse(found=found)

    async def Suspend(self, request: scheduler_pb2.SuspendRequest, context: grpc.aio.ServicerContext) -> scheduler_pb2.SuspendResponse:
        """Pause every replica after its step in flight; the workers keep, offload or drop their KV caches."""
        mode = request.mode or common_pb2.KVCacheManagementMode.Value(
            "KV_CACHE_MANAGEMENT_MODE_" + self.config.kv_cache_management_mode.upper())
        try:
            released = await self.replica_set.suspend(mode)
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), f"a worker could not suspend its KV cache: {exc.details()}")
        log.info("engine suspended", mode=common_pb2.KVCacheManagementMode.Name(mode), released_bytes=released)
        return scheduler_pb2.SuspendResponse(mode=mode, released_bytes=released)

    async def Resume(self, request: scheduler_pb2.ResumeRequest, context: grpc.aio.ServicerContext) -> scheduler_pb2.ResumeResponse:
        try:
            await self.replica_set.resume()
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), f"a worker could not resume its KV cache: {exc.details()}")
        log.info("engine resumed")
        return scheduler_pb2.ResumeResponse()

    async def GetStats(self, request: scheduler_pb2.GetStatsRequest, context: grpc.aio.ServicerContext) -> scheduler_pb2.SchedulerStats:
        return self.replica_set.stats()

    async def LoadLoraAdapter(self, request: common_pb2.LoadLoraAdapterRequest,
                              context: grpc.aio.ServicerContext) -> common_pb2.LoraAdapter:
        return await _answer(context, self.replica_set.loras.load(request), common_pb2.LoraAdapter)

    async def UnloadLoraAdapter(self, request: common_pb2.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext) -> common_pb2.UnloadLoraAdapterResponse:
        return await _answer(context, self.replica_set.loras.unload(request), common_pb2.UnloadLoraAdapterResponse)

    async def ListLoraAdapters(self, request: common_pb2.ListLoraAdaptersRequest,
                               context: grpc.aio.ServicerContext) -> common_pb2.ListLoraAdaptersResponse:
        return self.replica_set.loras.list()


async def _answer(context: grpc.aio.ServicerContext, call: Awaitable[T], empty: Callable[[], T]) -> T:
    """A LoRA management call's answer; our errors, and a worker's (which name what is wrong with an
    adapter), become the call's status."""
    try:
        return await call
    except HeteroError as exc:
        end_call(context, exc)
    except grpc.aio.AioRpcError as exc:
        set_status(context, exc.code(), exc.details() or exc.code().name)
    return empty()


async def serve_scheduler(config: Config) -> None:
    listen = internal_listen_address(config, config.scheduler_address)
    check_internal_bind(config, listen, "scheduler")  # before anything is loaded or dialled
    servicer = SchedulerServicer(config)
    server = grpc.aio.server(options=internal_server_options(config))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    health = add_health_and_reflection(server, [SERVICE_NAME], aio=True)
    # grpc's health servicer answers SERVING for "" from the start: not ready until a worker
    # replica answered (`serve` and a Kubernetes readiness probe ask before sending requests).
    await set_serving_aio(health, [SERVICE_NAME], serving=False)
    if bind(server, listen, server_credentials(config.internal_tls, mutual=True)) == 0:
        raise SystemExit(f"scheduler: cannot bind {listen}; is another process using it?")
    await server.start()
    await servicer.start()
    await set_serving_aio(health, [SERVICE_NAME])
    tune_gc()
    log.info("scheduler serving", address=listen, mutual_tls=config.internal_tls.enabled)
    await termination_signal()
    # Drain: report NOT_SERVING, refuse new calls, let in-flight ones finish within drain_grace_s.
    await set_serving_aio(health, [SERVICE_NAME], serving=False)
    log.info("draining", grace_s=config.drain_grace_s, in_flight=len(servicer.streams))
    stopping = asyncio.ensure_future(server.stop(grace=config.drain_grace_s))
    await servicer.close_follows_when_idle(stopping)
    await stopping
    log.info("scheduler stopped")
