"""The worker process: `hetero.v1.Worker` over gRPC around one ModelRunner.

A synchronous gRPC server whose handler threads only hand step plans to the main thread,
which runs every forward pass: measured on the 2-core CPU path, the same decode step is
~40% slower when torch runs it from a secondary thread. One model thread also serializes
the steps, so no lock is needed around the runner.

Tensor parallel: rank 0 serves gRPC and broadcasts each plan, suspend, resume and LoRA load to the other
ranks before running it; the other ranks serve nothing and run every command they receive.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import grpc
import structlog
import torch

from gpu_worker.cuda.device_map import bind_worker_device, worker_device
from gpu_worker.lora.lora_adapter import LoraAdapter, LoraAdapterError
from gpu_worker.models.model_build import resolve_device
from gpu_worker.parallel.tensor_parallel import Command, TensorParallel
from gpu_worker.runner import ModelRunner
from hetero.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from hetero_common.config import Config
from hetero_common.errors import ExecutionError, HeteroError, StepOrderError, ValidationError
from hetero_common.gc_tuning import tune_gc
from hetero_common.grpc_server import (
    add_health_and_reflection,
    bind,
    check_internal_bind,
    error_status,
    internal_listen_address,
    internal_server_options,
    server_credentials,
    set_serving,
)

log = structlog.get_logger("gpu_worker.service")
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
HOLD_TIMEOUT_S = 10.0  # how long a plan waits for the step it follows (StepPlan.after_step_id)


@dataclass
class ModelCall:
    """A call for the model thread: a step, a Describe, a suspend or a resume."""

    what: str
    call: Callable[[], Any]
    future: futures.Future[Any] = field(default_factory=futures.Future)
    step_id: int = 0  # a step's id (0: not a step)
    after_step_id: int = 0  # StepPlan.after_step_id: run only right after that step
    resets: bool = False  # StepPlan.reset: a new start (a scheduler that restarted, a failed step)
    held_since: float = 0.0


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        # SimpleQueue: the SIGTERM handler puts on it, and a signal handler runs on the main
        # thread between any two bytecodes, also inside this loop's get(). queue.Queue's put then
        # waits for the lock its own get holds, forever (a worker that never stops); SimpleQueue's
        # put is reentrant.
        self.steps: queue.SimpleQueue[ModelCall | None] = queue.SimpleQueue()
        self.stopping = False
        # Held to read `stopping` and queue a call, and to set it: a call that saw the loop running
        # is queued before the loop drains the queue and cancels it, not after (its handler thread
        # would wait for it forever, and so would the interpreter's exit, which joins that thread).
        self._admit = threading.Lock()
        # Overlap: a plan sent while the step it follows was in flight may reach the model thread
        # first (each unary call has its own handler thread). It is held until that step has run.
        self._held: dict[int, ModelCall] = {}  # by the step id it follows
        self._last_step, self._last_step_ok = 0, True

    def run_model_loop(self) -> None:
        """Run on the main thread until `None` arrives: run each queued call (steps, suspend, resume) in order."""
        while (item := self._next_call()) is not None:
            if item.resets:  # plans held from before it (a scheduler that restarted) can never run
                self._fail_held(f"a reset (step {item.step_id}) came first", keep=item.step_id)
            if item.after_step_id and item.after_step_id != self._last_step:
                item.held_since = time.monotonic()  # arrived before the step it follows
                self._held[item.after_step_id] = item
                continue
            if item.future.set_running_or_notify_cancel():
                self._run(item)
        # Stopping: calls still queued are cancelled, not left blocking their handler threads.
        with self._admit:
            self.stopping = True
        for item in self._held.values():
            item.future.cancel()
        while not self.steps.empty():
            if (item := self.steps.get_nowait()) is not None:
                item.future.cancel()

    def _next_call(self) -> ModelCall | None:
        """The plan held for the step just run, else the next queued call; held plans whose step never
        came fail after HOLD_TIMEOUT_S (the scheduler lost that step and has moved on)."""
        if (held := self._held.pop(self._last_step, None)) is not None:
            return held
        while True:
            try:
                return self.steps.get(timeout=1.0 if self._held else None)
            except queue.Empty:
                self._fail_held(f"it never reached this worker within {HOLD_TIMEOUT_S:g} s", older_than_s=HOLD_TIMEOUT_S)

    def _fail_held(self, why: str, older_than_s: float = 0.0, keep: int = 0) -> None:
        """Refuse the held plans (but the one following step `keep`) held for `older_than_s` or more."""
        now = time.monotonic()
        for after, item in list(self._held.items()):
            if after != keep and now - item.held_since >= older_than_s:
                del self._held[after]
                item.future.set_exception(StepOrderError(f"{item.what} follows step {after}, but {why}"))

    def _run(self, item: ModelCall) -> None:
        try:
            if item.after_step_id and not self._last_step_ok:
                raise StepOrderError(f"{item.what} was planned assuming step {item.after_step_id}, which failed")
            item.future.set_result(item.call())
            ok = True
        except Exception as exc:  # reported to the scheduler, which resets this worker's state
            ok = False
            if isinstance(exc, ValidationError):  # e.g. a LoRA adapter refused: the caller's to fix
                log.warning("call refused", call=item.what, error=str(exc))
            elif not isinstance(exc, StepOrderError):
                log.exception("call failed", call=item.what)
            if self.runner.tp.enabled and not isinstance(exc, HeteroError):
                # A collective failed: another rank is gone and this group cannot compute any
                # more. Exit, so the scheduler sees the replica die (its requests are recomputed
                # elsewhere or after the restart) instead of failing them.
                log.error("tensor-parallel group broken; exiting", rank=0)
                os._exit(70)
            item.future.set_exception(exc)
        if item.step_id:
            self._last_step, self._last_step_ok = item.step_id, ok

    def _on_model_thread(self, what: str, call: Callable[[], Any], context: grpc.ServicerContext,
                         step_id: int = 0, after_step_id: int = 0, resets: bool = False) -> Any:
        item = ModelCall(what, call, step_id=step_id, after_step_id=after_step_id, resets=resets)
        with self._admit:
            if self.stopping:
                context.abort(grpc.StatusCode.UNAVAILABLE, "worker is stopping")
            self.steps.put(item)
        try:
            return item.future.result()
        except futures.CancelledError:
            context.abort(grpc.StatusCode.UNAVAILABLE, "worker is stopping")
            raise
        except Exception as exc:
            context.abort(*error_status(exc))
            raise  # unreachable: abort raises

    def Describe(self, request: worker_pb2.DescribeRequest, context: grpc.ServicerContext) -> worker_pb2.WorkerInfo:
        # On the model thread, behind any step: a worker whose model is stuck (a hung step) does
        # not answer, so the scheduler keeps its replica down instead of sending it more work.
        return self._on_model_thread("describe", self.runner.describe, context)

    def ExecuteStep(self, plan: worker_pb2.StepPlan, context: grpc.ServicerContext) -> worker_pb2.StepResult:
        return self._on_model_thread(f"step {plan.step_id}", lambda: self._execute_step(plan), context,
                                     plan.step_id, plan.after_step_id, plan.reset)

    def _execute_step(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepResult:
        if self.runner.tp.enabled:  # every rank runs the same plan on its shard of heads
            self.runner.tp.broadcast_command(("step", plan.SerializeToString()))
        return self.runner.execute(plan)

    def _on_every_rank(self, command: Command) -> int:
        """Run a KV-cache suspend or resume on every rank (each holds a shard of the cache) and
        return the bytes released by all of them, once all are done: a caller that suspends to
        hand the memory to someone else may do so when this returns."""
        tp = self.runner.tp
        if tp.enabled:
            tp.broadcast_command(command)
        released, error = 0, None
        try:
            released = run_cache_command(self.runner, command)
        except Exception as exc:  # the other ranks still wait in the collective below
            error = exc
        released = tp.sum_over_ranks(released, self.runner.device)
        if error is not None:
            raise error
        return released

    def SuspendKVCache(self, request: worker_pb2.SuspendKVCacheRequest,
                       context: grpc.ServicerContext) -> worker_pb2.SuspendKVCacheResponse:
        mode = common_pb2.KVCacheManagementMode.Name(request.mode or common_pb2.KV_CACHE_MANAGEMENT_MODE_PERSIST)
        name = mode.removeprefix("KV_CACHE_MANAGEMENT_MODE_").lower()
        released = self._on_model_thread("suspend", lambda: self._on_every_rank(("suspend", name)), context)
        return worker_pb2.SuspendKVCacheResponse(released_bytes=released)

    def ResumeKVCache(self, request: worker_pb2.ResumeKVCacheRequest,
                      context: grpc.ServicerContext) -> worker_pb2.ResumeKVCacheResponse:
        self._on_model_thread("resume", lambda: self._on_every_rank(("resume", "")), context)
        return worker_pb2.ResumeKVCacheResponse()

    def LoadLora(self, request: worker_pb2.LoadLoraRequest, context: grpc.ServicerContext) -> common_pb2.LoraAdapter:
        # The files are read and checked here, on this handler thread, while steps run on: a path outside
        # lora_root, a crafted header or a file of the wrong size is refused before the model thread is
        # involved, and that thread only packs checked tensors into the slot, between two steps (no step ever
        # sees a slot half filled). The other tensor-parallel ranks have no handler thread and may be on other
        # hosts, with their own files: each reads and checks the adapter itself, on its only thread, when rank 0
        # broadcasts the load (shipping the tensors through the collective instead would hold every rank's
        # steps for the transfer just the same); `load_lora_on_rank` keeps their slots in agreement.
        try:
            self.runner.loras.check_slot(request.slot)
            adapter = self.runner.loras.read(request.name, request.path, trusted=False)
        except Exception as exc:
            if isinstance(exc, HeteroError):
                log.warning("LoRA load refused", adapter=request.name, error=str(exc))
            else:
                log.exception("LoRA load failed", adapter=request.name)
            context.abort(*error_status(exc))
            raise  # unreachable: abort raises
        return self._on_model_thread(f"load LoRA {request.name!r}", lambda: self._load_lora(request, adapter),
                                     context)

    def _load_lora(self, request: worker_pb2.LoadLoraRequest, adapter: LoraAdapter) -> common_pb2.LoraAdapter:
        """On the model thread: `adapter` (read and checked by LoadLora) into its slot, on every rank."""
        if self.runner.tp.enabled:
            self.runner.tp.broadcast_command(("lora_load", request.SerializeToString()))
        return load_lora_on_rank(self.runner, request, adapter)

    def UnloadLora(self, request: worker_pb2.UnloadLoraRequest,
                   context: grpc.ServicerContext) -> worker_pb2.UnloadLoraResponse:
        self._on_model_thread(f"unload LoRA slot {request.slot}", lambda: self._on_every_rank(
            ("lora_unload", request.SerializeToString())), context)
        return worker_pb2.UnloadLoraResponse()


def load_lora_on_rank(runner: ModelRunner, request: worker_pb2.LoadLoraRequest,
                      adapter: LoraAdapter | None) -> common_pb2.LoraAdapter:
    """Fill `request.slot` on this rank with `adapter` (None: a follower rank, which reads it from its own
    host, under its own lora_root). With tensor parallelism every rank runs this at once: each stages its
    share, then all learn whether any rank could not, and a rank commits only when none failed, so that no
    rank serves a slot another lacks. A failure before the collective is always typed: the group is intact
    (every rank reaches the collective), so it must not end the worker as a broken collective does."""
    staged, error = None, None
    try:
        if adapter is None:
            adapter = runner.loras.read(request.name, request.path, trusted=False)
        staged = runner.loras.stage(request.slot, adapter, request.path)
    except HeteroError as exc:
        error = exc
    except Exception as exc:
        log.exception("LoRA load failed", adapter=request.name, rank=runner.tp.rank)
        error = ExecutionError(f"LoRA adapter {request.name!r}: loading it failed on tensor-parallel rank "
                               f"{runner.tp.rank} (that worker's log has the details)")
    failed = runner.tp.sum_over_ranks(int(error is not None), runner.device)
    if error is not None:
        raise error
    if failed or staged is None:
        raise LoraAdapterError(f"LoRA adapter {request.name!r}: {failed} other tensor-parallel rank(s) of this "
                               "worker could not load it, so none did; each rank reads the adapter on its own host "
                               "under its own lora_root: give every rank the same files (their logs say what was "
                               "wrong)", "lora")
    return runner.loras.commit(staged)


def run_cache_command(runner: ModelRunner, command: Command) -> int:
    """A command for every rank other than a step or a LoRA load (`load_lora_on_rank`): a suspend (returns the
    bytes released), a resume, or a LoRA slot emptied (return 0)."""
    kind, payload = command
    if kind == "suspend":
        return runner.suspend_kv_cache(str(payload))
    if kind == "lora_unload":
        runner.loras.unload(worker_pb2.UnloadLoraRequest.FromString(payload).slot)  # type: ignore[arg-type]
    else:
        runner.resume_kv_cache()
    return 0


def run_follower_rank(runner: ModelRunner) -> None:
    """A tensor-parallel rank other than 0: run every command rank 0 broadcasts, until it sends None."""
    log.info("tensor-parallel rank ready", rank=runner.tp.rank, size=runner.tp.size)
    while True:
        try:
            command = runner.tp.broadcast_command(None)
        except RuntimeError as exc:  # rank 0 is gone: nothing left to do here
            log.error("lost rank 0; exiting", error=str(exc))
            return
        if command is None:
            return
        kind, payload = command
        released = 0
        try:
            if kind == "step":
                runner.execute(worker_pb2.StepPlan.FromString(payload))  # type: ignore[arg-type]
            elif kind == "lora_load":  # runs its own collective: every rank fills the slot, or none does
                request = worker_pb2.LoadLoraRequest.FromString(payload)  # type: ignore[arg-type]
                load_lora_on_rank(runner, request, None)
            else:
                released = run_cache_command(runner, command)
        except ValidationError as exc:  # a refused adapter: rank 0 tells the caller
            log.warning("command refused", command=kind, rank=runner.tp.rank, error=str(exc))
        except Exception:  # rank 0 reports the same failure to the scheduler
            log.exception("command failed", command=kind, rank=runner.tp.rank)
        if kind not in ("step", "lora_load"):  # rank 0 waits for every rank's release (see _on_every_rank)
            try:
                runner.tp.sum_over_ranks(released, runner.device)
            except RuntimeError as exc:
                log.error("lost rank 0; exiting", error=str(exc))
                return


def on_own_device(config: Config, tp_rank: int, local_rank: int | None) -> Config:
    """`config` with `device` resolved to this process's own (gpu_worker/cuda/device_map.py), made current. `serve`
    passes `local_rank` and runs data_parallel_size × tensor_parallel_size workers on this host; a worker
    started alone runs as the only one, at its tensor-parallel rank's place."""
    processes = 1 if local_rank is None else config.data_parallel_size * config.tensor_parallel_size
    cuda_count = torch.cuda.device_count() if config.device != "cpu" else 0
    device = worker_device(config.device, config.devices, tp_rank if local_rank is None else local_rank, processes,
                           cuda_count)
    bind_worker_device(device)
    return replace(config, device=str(device))


def serve_worker(config: Config, tp_rank: int = 0, tp_init_file: str | None = None,
                 local_rank: int | None = None) -> None:
    if tp_rank == 0:  # only rank 0 serves gRPC; refused before the model loads
        check_internal_bind(config, internal_listen_address(config, config.worker_address), "worker")
    config = on_own_device(config, tp_rank, local_rank)
    tp = TensorParallel.initialize(tp_rank, config.tensor_parallel_size, tp_init_file, resolve_device(config.device),
                                   config.tp_init_method)
    runner = ModelRunner(config, tp)
    if tp.rank > 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        run_follower_rank(runner)
        tp.shutdown()
        return
    servicer = WorkerServicer(runner)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=internal_server_options(config))
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health = add_health_and_reflection(server, [SERVICE_NAME], aio=False)
    listen = internal_listen_address(config, config.worker_address)
    if bind(server, listen, server_credentials(config.internal_tls, mutual=True)) == 0:
        raise SystemExit(f"worker: cannot bind {listen}; is another process using it?")
    server.start()
    set_serving(health, [SERVICE_NAME])
    tune_gc()
    log.info("worker serving", address=listen, mutual_tls=config.internal_tls.enabled)

    def stop(*_: object) -> None:
        servicer.steps.put(None)  # no lock here: a signal handler (see WorkerServicer.steps)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    servicer.run_model_loop()
    if tp.enabled:
        try:
            tp.broadcast_command(None)  # the other ranks stop too
            tp.shutdown()
        except RuntimeError:
            pass  # a rank already exited
    set_serving(health, [SERVICE_NAME], serving=False)
    server.stop(grace=2).wait()
    log.info("worker stopped")
