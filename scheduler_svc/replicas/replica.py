"""One worker replica as the scheduler service sees it: its own core `Scheduler` (block pool,
queues), its engine loop (the shared step of engine_loop.py, executed by the worker over gRPC), and a
health watch that notices when the worker dies or comes back.
The core is private: the replica set submits, adopts, aborts, finds and counts requests
through the methods below, so what a core is and how it is rebuilt stays in this module.

A step that fails with a transient error (UNAVAILABLE: the worker died, the connection reset) is never re-sent as
is: the worker may have applied part of it. Instead the replica probes the worker (retried with backoff); if it
answers, its state is reset and every sequence is recomputed from the tokens already produced; if not, the replica
is marked down and its sequences go to the replica set to be recomputed elsewhere.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import grpc
import structlog

from hetero.v1 import common_pb2, scheduler_pb2, worker_pb2, worker_pb2_grpc
from hetero_common.config import Config
from hetero_common.device_defaults import fitted_to_worker
from hetero_common.expert_load import ExpertLoad
from hetero_common.grpc_server import internal_channel
from hetero_common.retry import is_transient, link_silent, retrying
from scheduler_svc.core.scheduler import Scheduler, StepOutputs, TokenOutput
from scheduler_svc.lora.lora_registry import LoraRegistry
from scheduler_svc.lora.replica_loras import WorkerLoras
from scheduler_svc.replicas.engine_loop import EngineLoop, SentStep
from scheduler_svc.sequence import Sequence

log = structlog.get_logger("scheduler_svc.replicas.replica")


class Replica:
    """`dispatch` takes the token events of its steps; `lost` its sequences when it goes down
    (to be recomputed elsewhere); `joined` is told when a worker (new or restarted) answers.
    It is its engine loop's `StepExecutor` (the `*_step` methods): a step's call is an ExecuteStep RPC."""

    def __init__(self, index: int, address: str, config: Config, loras: LoraRegistry,
                 dispatch: Callable[[StepOutputs], None], lost: Callable[[Replica, list[Sequence]], None],
                 joined: Callable[[Replica], None], tls_server_name: str | None = None) -> None:
        self.index = index
        self._loras = loras  # the service's adapters; this worker's slots follow them (replica_loras.py)
        self._worker_loras = WorkerLoras()
        self.address = address
        self.config = config
        self._dispatch = dispatch
        self._lost = lost
        self._joined = joined
        self.channel = internal_channel(config, address, tls_server_name)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self._core: Scheduler | None = None  # from the first Describe on; a fresh one per new worker process
        self.info: worker_pb2.WorkerInfo | None = None
        self.expert_load = ExpertLoad()  # what its steps routed to a mixture of experts' experts
        self.up = False
        self._wake = asyncio.Event()
        self._up_event = asyncio.Event()
        self._lock = asyncio.Lock()  # one lifecycle change or step at a time
        self._reset_worker = False
        self._loop = EngineLoop(self, config.async_scheduling)  # its `ahead`: a step sent before (overlap.py)
        self._last_ok = 0.0
        self.num_deadline_exceeded = 0
        self.tasks: list[asyncio.Task[None]] = []
        self.from_dns = False  # found through worker_dns (it leaves when its address does)
        self.retired = False  # its address left worker_dns: no tasks, no requests, not counted

    # ------------------------------------------------------------------ requests

    @property
    def has_joined(self) -> bool:
        """A worker answered at least once, so the replica has a core to validate requests with."""
        return self._core is not None

    def submit(self, request: scheduler_pb2.SubmitRequest, deadline: float | None,
               block_hashes: list[bytes] | None = None) -> Sequence:
        """Validate a new request and queue its samples here; raises the core's HeteroError.
        `block_hashes`: the prompt's prefix-cache hashes, when the router computed them already."""
        seq = self._validated(request, deadline, block_hashes)
        self._wake.set()
        return seq

    def detached_sequence(self, request: scheduler_pb2.SubmitRequest, deadline: float | None) -> Sequence:
        """Validate a new request with this replica's core but keep nothing: the sequence is parked
        (every replica is down) until a replica adopts it."""
        seq = self._validated(request, deadline)
        self._require_core().take_all_for_recompute()  # a down replica's core is empty but for this one sequence
        return seq

    def _validated(self, request: scheduler_pb2.SubmitRequest, deadline: float | None,
                   block_hashes: list[bytes] | None = None) -> Sequence:
        slot, cache_salt = self._loras.place(request.lora_adapter, request.cache_salt)
        return self._require_core().add_request(request.request_id, list(request.prompt_token_ids), request.params,
                                                cache_salt, request.priority, slot, request.pooling, deadline,
                                                block_hashes)

    def adopt(self, seqs: list[Sequence]) -> None:
        """Queue sequences from elsewhere (a lost replica, the parked ones) to be recomputed here."""
        core = self._require_core()
        for seq in seqs:
            core.adopt(seq)
        self._wake.set()

    def abort(self, request_id: str, reason: int, index: int | None = None) -> None:
        """End a request (or one of its samples) here; its blocks are freed at once."""
        if self._core is not None:
            self._core.abort(request_id, reason, index)

    def has_request(self, request_id: str) -> bool:
        return self._core is not None and request_id in self._core.requests

    def lora_slots_in_use(self) -> list[int]:
        """The LoRA slot of each request here (0: the base model)."""
        return [seq.lora_slot for seq in self._core.requests.values()] if self._core is not None else []

    def _require_core(self) -> Scheduler:
        if self._core is None:
            raise RuntimeError(f"replica {self.index} ({self.address}): no worker has answered yet")
        return self._core

    # ------------------------------------------------------------------ figures

    @property
    def load(self) -> int:
        """Sequences running or waiting here: what the router balances."""
        return len(self._core.running) + len(self._core.waiting) if self._core is not None else 0

    @property
    def num_waiting(self) -> int:
        return len(self._core.waiting) if self._core is not None else 0

    @property
    def num_blocks(self) -> int:
        return self._core.num_blocks if self._core is not None else 0

    @property
    def max_model_len(self) -> int | None:
        return self._core.max_model_len if self._core is not None else None

    def status(self) -> scheduler_pb2.ReplicaStatus:
        pool = self._core.pool_stats() if self._core is not None else common_pb2.PoolStats()
        self.expert_load.fill(pool)
        return scheduler_pb2.ReplicaStatus(index=self.index, address=self.address, up=self.up,
                                           pid=self.info.pid if self.info else 0, pool=pool)

    # ------------------------------------------------------------------ lifecycle

    async def connect(self, timeout_s: float) -> None:
        """Wait for the worker at start-up; raise if it does not answer within timeout_s."""
        info = await self.stub.Describe(worker_pb2.DescribeRequest(), timeout=timeout_s, wait_for_ready=True)
        self._join(info)

    def start_tasks(self) -> None:
        """The engine loop and the health watch (which Describes a replica not up yet until it joins)."""
        self.retired = False
        self.tasks = [asyncio.create_task(self._engine_loop()), asyncio.create_task(self._watch())]

    async def retire(self) -> None:
        """Its address left worker_dns: after the step in flight, go down as a dead worker does
        (its sequences are recomputed elsewhere, its blocks freed) and stop probing it."""
        async with self._lock:
            await self._settle()
            self.retired = True
            for task in self.tasks:
                task.cancel()
            self.tasks = []
            if self.up:
                self._go_down("its address left worker_dns")

    def _join(self, info: worker_pb2.WorkerInfo) -> None:
        """A worker (new or restarted) answered Describe: a fresh pool sized from what it reports."""
        self.info = info
        config = fitted_to_worker(self.config, info.max_batch_size, info.num_blocks)  # unset keys: the worker's
        self._core = Scheduler(config, min(config.max_num_blocks, info.num_blocks), tuple(info.eos_token_ids),
                               min(config.max_model_len, info.max_position_embeddings))
        self._worker_loras.joined(list(info.lora_adapters))
        self._loras.learn(list(info.lora_adapters))
        self._reset_worker = True  # a worker that was merely unreachable may still hold old sequences
        self.up = True
        self._last_ok = time.monotonic()
        self._up_event.set()
        self._wake.set()
        log.info("replica up", replica=self.index, address=self.address, pid=info.pid,
                 num_blocks=self._core.kv_cache.num_blocks, max_batch_size=config.max_batch_size)
        self._joined(self)

    def _go_down(self, reason: str) -> None:
        assert self._core is not None
        self._loop.drop_ahead()
        self.up = False
        self._up_event.clear()
        seqs = self._core.take_all_for_recompute()
        log.error("replica down", replica=self.index, address=self.address, reason=reason, moved_sequences=len(seqs))
        self._lost(self, seqs)

    async def _probe(self) -> worker_pb2.WorkerInfo | None:
        """Is the worker alive? Describe, retried on transient failures; None when it stays unreachable."""
        try:
            async for attempt in retrying(self.config):
                with attempt:
                    return await self.stub.Describe(worker_pb2.DescribeRequest(), timeout=2.0)
        except grpc.aio.AioRpcError:
            return None
        return None

    def _recover(self, info: worker_pb2.WorkerInfo | None, reason: str) -> None:
        """After a lost step or a failed health check: recompute here, start afresh, or go down."""
        assert self._core is not None
        if info is None:
            self._go_down(reason)
            return
        self._loop.drop_ahead()
        seqs = self._core.take_all_for_recompute()
        if self.info is None or info.pid != self.info.pid:
            # A new worker process answered (restarted): its KV cache is empty; a fresh pool.
            self._join(info)
        self._reset_worker = True  # the worker's state is unknown: reset it and recompute here
        self.adopt(seqs)
        log.info("worker answered again; sequences recomputed", replica=self.index, sequences=len(seqs), pid=info.pid)

    async def _watch(self) -> None:
        """Probe an idle replica that is up; re-Describe one that is down until it rejoins."""
        interval = self.config.health_check_interval_s
        while True:
            await asyncio.sleep(interval)
            if self.up:
                if time.monotonic() - self._last_ok < interval:
                    continue  # steps are succeeding; a failing step reports itself
                async with self._lock:
                    await self._settle()
                    if not self.up:
                        continue
                    info = await self._probe()
                    if info is None or self.info is None or info.pid != self.info.pid:
                        self._recover(info, "health check failed")
                    else:
                        self._last_ok = time.monotonic()
            else:
                try:
                    info = await self.stub.Describe(worker_pb2.DescribeRequest(), timeout=2.0)
                except grpc.aio.AioRpcError:
                    continue
                async with self._lock:
                    if not self.up:
                        self._join(info)

    # ------------------------------------------------------------------ suspend / resume

    async def suspend(self, mode: int) -> int:
        """After the step in flight: stop planning, and have the worker keep, offload or drop its KV
        cache (`mode`, a KVCacheManagementMode). Returns the bytes of device memory released."""
        name = common_pb2.KVCacheManagementMode.Name(mode).removeprefix("KV_CACHE_MANAGEMENT_MODE_").lower()
        async with self._lock:
            await self._settle()
            if self._core is None or self._core.suspended:
                return 0
            self._core.suspend(name)
            try:
                answer = await self.stub.SuspendKVCache(worker_pb2.SuspendKVCacheRequest(mode=mode), timeout=self.config.worker_step_timeout_s)
            except grpc.aio.AioRpcError:
                self._core.resume()
                self._wake.set()
                raise
        return answer.released_bytes

    async def resume(self) -> None:
        async with self._lock:
            if self._core is not None and self._core.suspended:
                await self.stub.ResumeKVCache(worker_pb2.ResumeKVCacheRequest(), timeout=self.config.worker_step_timeout_s)
                self._core.resume()
        self._wake.set()

    async def fill_lora_slot(self, request: worker_pb2.LoadLoraRequest) -> common_pb2.LoraAdapter:
        """Load an adapter into a slot on this worker, between two steps; raises the worker's error."""
        async with self._lock:
            await self._settle()
            return await self._worker_loras.fill(self.stub, request, self.config.worker_step_timeout_s)

    async def empty_lora_slot(self, slot: int) -> None:  # between two steps
        async with self._lock:
            await self._settle()
            await self._worker_loras.empty(self.stub, slot, self.config.worker_step_timeout_s)

    async def _bring_loras_in_line(self) -> None:
        """Before a step: the worker's slots as the registry has them; a worker that cannot load one goes down."""
        try:
            await self._worker_loras.bring_in_line(self.stub, self._loras, self.config.worker_step_timeout_s)
        except grpc.aio.AioRpcError as exc:
            self._go_down(f"could not bring its LoRA slots in line: {exc.details()}")

    # ------------------------------------------------------------------ engine loop

    def _expire_deadlines(self) -> None:
        assert self._core is not None
        now = time.monotonic()
        expired = [s.request_id for s in self._core.requests.values() if s.deadline is not None and s.deadline <= now]
        outputs = []
        for request_id in expired:
            for index in self._core.abort(request_id, common_pb2.FINISH_REASON_DEADLINE):
                outputs.append(TokenOutput(request_id, finish_reason=common_pb2.FINISH_REASON_DEADLINE,
                                           error="the request's deadline passed", index=index))
            self.num_deadline_exceeded += 1
        if expired:
            log.info("deadline passed; requests dropped", replica=self.index, count=len(expired))
            self._dispatch(StepOutputs.of(outputs))

    async def _engine_loop(self) -> None:
        while True:
            if not self.up:
                await self._up_event.wait()
                continue
            assert self._core is not None
            self._expire_deadlines()
            if self._loop.ahead is None and not self._core.has_pending_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self._lock:
                if self.up and not self._worker_loras.in_line(self._loras):
                    await self._bring_loras_in_line()
                if not self.up:
                    continue
                scheduled = await self._loop.step(self._core)
            # Nothing fits right now (e.g. waiting requests blocked on memory): yield a moment.
            await asyncio.sleep(0 if scheduled else 0.005)

    async def _settle(self) -> None:
        """Wait for a step sent ahead and apply its result, so that a lifecycle change (suspend, retire,
        a probe) finds no step in flight. Called with the lock held."""
        if self._loop.ahead is not None and self._core is not None and self.up:
            await self._loop.step(self._core, plan_ahead=False)  # takes the step ahead, plans nothing new
        self._loop.ahead = None

    # The engine loop's StepExecutor (engine_loop.py); the loop calls them with the lock held.

    def send_step(self, plan: worker_pb2.StepPlan) -> grpc.aio.UnaryUnaryCall:
        if self._reset_worker:
            plan.reset = True
            self._reset_worker = False
        return self.stub.ExecuteStep(plan, timeout=self.config.worker_step_timeout_s)

    async def receive_step(self, sent: SentStep) -> worker_pb2.StepResult | None:
        """The worker's result; None when the call failed (`_step_failed` dealt with it)."""
        try:
            result = await sent.call
        except grpc.aio.AioRpcError as exc:
            await self._step_failed(sent.plan, exc)
            return None
        self._last_ok = time.monotonic()
        return result

    def cancel_step(self, sent: SentStep) -> None:
        sent.call.cancel()

    def dispatch_step(self, outputs: StepOutputs, sent: SentStep, result: worker_pb2.StepResult) -> None:
        self._dispatch(outputs)
        self.expert_load.observe(result.expert_tokens)
        log.debug("step", replica=self.index, step_id=sent.plan.step_id, sequences=len(sent.plan.scheduled),
                  ahead=self._loop.ahead is not None, forward_s=round(result.forward_seconds, 4),
                  step_s=round(time.perf_counter() - sent.started, 4))

    async def _step_failed(self, plan: worker_pb2.StepPlan, exc: grpc.aio.AioRpcError) -> None:
        """A step's call failed: go down, recover, or fail its requests, as the module docstring says."""
        core = self._require_core()
        self._loop.drop_ahead()  # planned assuming this step: the worker refuses it (StepOrderError) or is gone
        if is_transient(exc) and link_silent(exc):
            # Nothing came back for internal_keepalive_s (ping or TCP acknowledgement): a cut
            # link or a frozen host. Probing would only wait for connect timeouts; the health
            # watch re-Describes it and it rejoins once it answers.
            self._go_down(f"the link went silent (internal_keepalive_s "
                          f"{self.config.internal_keepalive_s:g} s): {exc.details()}")
        elif is_transient(exc):
            await self._step_lost(exc.details() or "UNAVAILABLE")
        elif exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            # Alive but hung: its sequences move on (another replica, or this one once it
            # answers Describe again, which waits behind the stuck step).
            self._go_down(f"no answer to step {plan.step_id} within worker_step_timeout_s "
                          f"({self.config.worker_step_timeout_s} s): worker hung")
        else:  # the worker could not run the step: fail its requests, reset its state
            log.error("step failed", replica=self.index, step_id=plan.step_id, error=exc.details())
            self._dispatch(core.fail_all(f"worker step failed: {exc.details()}"))
            self._reset_worker = True

    async def _step_lost(self, error: str) -> None:
        log.warning("step lost; probing the worker", replica=self.index, error=error)
        info = await self._probe()
        self._recover(info, f"worker unreachable after {self.config.max_retry_attempts} retries: {error}")
