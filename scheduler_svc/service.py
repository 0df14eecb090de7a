"""The scheduler process: `hetero.v1.Scheduler` over gRPC, driving the worker step by step.

One asyncio loop owns everything: Submit handlers add requests and wait on their event
queues; the engine loop plans a step, awaits the worker's result, and dispatches token
events. No locks are needed because the core `Scheduler` only runs on this loop.
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import structlog
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, stop_after_delay, wait_exponential_jitter

from hetero.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from hetero_infer.config import Config
from hetero_infer.errors import HeteroError, UnavailableError
from hetero_infer.grpc_server import CHANNEL_OPTIONS, add_health_and_reflection, error_status, set_serving_aio
from scheduler_svc.scheduler import Scheduler, TokenOutput

log = structlog.get_logger("scheduler_svc.service")
SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, config: Config) -> None:
        self.config = config
        self.channel = grpc.aio.insecure_channel(config.worker_address, options=CHANNEL_OPTIONS)
        self.worker = worker_pb2_grpc.WorkerStub(self.channel)
        self.core: Scheduler | None = None
        self.worker_info: worker_pb2.WorkerInfo | None = None
        self.streams: dict[str, asyncio.Queue[scheduler_pb2.TokenEvent]] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._reset_worker = False
        self._step_lock = asyncio.Lock()  # Suspend waits for the step in flight to end

    async def start(self) -> None:
        """Wait for the worker, size the block pool from what it reports, start the engine loop."""
        async for attempt in AsyncRetrying(stop=stop_after_delay(self.config.startup_timeout_s),
                                           wait=wait_exponential_jitter(0.2, 2.0), retry=retry_if_exception(_transient),
                                           reraise=True):
            with attempt:
                info = await self.worker.Describe(worker_pb2.DescribeRequest(), timeout=10)
        self.worker_info = info
        num_blocks = min(self.config.max_num_blocks, info.num_blocks)
        max_model_len = min(self.config.max_model_len, info.max_position_embeddings)
        self.core = Scheduler(self.config, num_blocks, tuple(info.eos_token_ids), max_model_len)
        self._loop_task = asyncio.create_task(self._engine_loop())
        log.info("scheduler ready", worker=self.config.worker_address, num_blocks=num_blocks,
                 max_model_len=max_model_len, device=info.device)

    # ------------------------------------------------------------------ RPCs

    async def Submit(self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext):
        assert self.core is not None
        rid = request.request_id
        with structlog.contextvars.bound_contextvars(request_id=rid):
            try:
                seq = self.core.add_request(rid, list(request.prompt_token_ids), request.params, request.cache_salt)
            except HeteroError as exc:
                await context.abort(*error_status(exc))
            queue: asyncio.Queue[scheduler_pb2.TokenEvent] = asyncio.Queue()
            self.streams[rid] = queue
            self._wake.set()
            log.debug("submitted", prompt_tokens=seq.prompt_len)
            finished = False
            open_samples = set(range(seq.sampling.n))  # the stream ends when every sample has finished
            try:
                while not finished:
                    event = await queue.get()
                    if event.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                        if event.index not in open_samples:
                            continue  # already ended (e.g. aborted while its last step ran)
                        open_samples.discard(event.index)
                    finished = not open_samples
                    yield event
            finally:
                self.streams.pop(rid, None)
                if not finished:  # the caller went away: free the request's blocks now
                    self.core.abort(rid)
                    log.info("aborted by caller")

    async def Abort(self, request: scheduler_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> scheduler_pb2.AbortResponse:
        assert self.core is not None
        reason = request.reason or common_pb2.FINISH_REASON_ABORT
        ended = self.core.abort(request.request_id, reason, request.index if request.HasField("index") else None)
        queue = self.streams.get(request.request_id)
        for index in ended if queue is not None else []:
            queue.put_nowait(scheduler_pb2.TokenEvent(request_id=request.request_id, finish_reason=reason, index=index))
        return scheduler_pb2.AbortResponse(found=bool(ended))

    async def Suspend(self, request: scheduler_pb2.SuspendRequest, context: grpc.aio.ServicerContext) -> scheduler_pb2.SuspendResponse:
        """Pause after the step in flight; the worker keeps, offloads or drops its KV cache."""
        assert self.core is not None
        mode = request.mode or common_pb2.KVCacheManagementMode.Value(
            "KV_CACHE_MANAGEMENT_MODE_" + self.config.kv_cache_management_mode.upper())
        name = common_pb2.KVCacheManagementMode.Name(mode).removeprefix("KV_CACHE_MANAGEMENT_MODE_").lower()
        async with self._step_lock:
            if self.core.suspended:
                return scheduler_pb2.SuspendResponse(mode=mode)
            self.core.suspend(name)
            try:
                answer = await self.worker.SuspendKVCache(worker_pb2.SuspendKVCacheRequest(mode=mode), timeout=300)
            except grpc.aio.AioRpcError as exc:
                self.core.resume()
                self._wake.set()
                await context.abort(exc.code(), f"worker could not suspend its KV cache: {exc.details()}")
        log.info("engine suspended", mode=name, released_bytes=answer.released_bytes)
        return scheduler_pb2.SuspendResponse(mode=mode, released_bytes=answer.released_bytes)

    async def Resume(self, request: scheduler_pb2.ResumeRequest, context: grpc.aio.ServicerContext) -> scheduler_pb2.ResumeResponse:
        assert self.core is not None
        async with self._step_lock:
            if self.core.suspended:
                try:
                    await self.worker.ResumeKVCache(worker_pb2.ResumeKVCacheRequest(), timeout=300)
                except grpc.aio.AioRpcError as exc:
                    await context.abort(exc.code(), f"worker could not resume its KV cache: {exc.details()}")
                self.core.resume()
        self._wake.set()
        log.info("engine resumed")
        return scheduler_pb2.ResumeResponse()

    async def GetStats(self, request: scheduler_pb2.GetStatsRequest, context: grpc.aio.ServicerContext) -> scheduler_pb2.SchedulerStats:
        assert self.core is not None and self.worker_info is not None
        pool = self.core.pool_stats()
        pool.num_workers = 1
        pool.num_workers_up = 1
        return scheduler_pb2.SchedulerStats(pool=pool, model=self.worker_info.model_name,
                                            max_model_len=self.core.max_model_len,
                                            attention_backend=self.worker_info.attention_backend,
                                            device=self.worker_info.device)

    # ------------------------------------------------------------------ engine loop

    async def _engine_loop(self) -> None:
        assert self.core is not None
        core = self.core
        while True:
            if not core.has_pending_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self._step_lock:
                ran = await self._step(core)
            # Nothing fits right now (e.g. all waiting requests blocked on memory): yield a moment.
            await asyncio.sleep(0 if ran else 0.005)  # let Submit/Abort/Suspend handlers run between steps

    async def _step(self, core: Scheduler) -> bool:
        """Plan, execute and apply one step; False when nothing could be scheduled."""
        if not core.has_pending_work():
            return False
        plan = core.schedule()
        if self._reset_worker:
            plan.reset = True
            self._reset_worker = False
        if not plan.scheduled:
            return False
        started = time.perf_counter()
        try:
            result = await self._execute(plan)
        except Exception as exc:  # the step is lost: fail its requests, reset the worker
            message = str(exc.details()) if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            log.error("step failed", step_id=plan.step_id, error=message)
            self._dispatch(core.fail_all(f"worker step failed: {message}"))
            self._reset_worker = True
            return True
        self._dispatch(core.process_result(result))
        log.debug("step", step_id=plan.step_id, sequences=len(plan.scheduled), forward_s=round(result.forward_seconds, 4),
                  step_s=round(time.perf_counter() - started, 4))
        return True

    async def _execute(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepResult:
        async for attempt in AsyncRetrying(stop=stop_after_attempt(self.config.max_retry_attempts + 1),
                                           wait=wait_exponential_jitter(0.05, 1.0), retry=retry_if_exception(_transient),
                                           reraise=True):
            with attempt:
                return await self.worker.ExecuteStep(plan, timeout=300)
        raise UnavailableError("unreachable")

    def _dispatch(self, outputs: list[TokenOutput]) -> None:
        for out in outputs:
            queue = self.streams.get(out.request_id)
            if queue is None:
                continue
            queue.put_nowait(scheduler_pb2.TokenEvent(
                request_id=out.request_id, token_ids=out.token_ids, finish_reason=out.finish_reason, error=out.error,
                index=out.index, cached_prompt_tokens=out.cached_prompt_tokens,
                logprobs=out.logprobs, token_timestamps=[out.timestamp] * len(out.token_ids) if out.timestamp else []))


async def serve_scheduler(config: Config) -> None:
    servicer = SchedulerServicer(config)
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    health = add_health_and_reflection(server, [SERVICE_NAME], aio=True)
    if server.add_insecure_port(config.scheduler_address) == 0:
        raise SystemExit(f"scheduler: cannot bind {config.scheduler_address}; is another process using it?")
    await server.start()
    await servicer.start()
    await set_serving_aio(health, [SERVICE_NAME])
    log.info("scheduler serving", address=config.scheduler_address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await set_serving_aio(health, [SERVICE_NAME], serving=False)
    await server.stop(grace=2)
    log.info("scheduler stopped")
