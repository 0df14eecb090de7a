"""The worker process: `hetero.v1.Worker` over gRPC around one ModelRunner.

A synchronous gRPC server whose handler threads only hand step plans to the main thread,
which runs every forward pass: measured on the 2-core CPU path, the same decode step is
~40% slower when torch runs it from a secondary thread. One model thread also serializes
the steps, so no lock is needed around the runner.
"""

from __future__ import annotations

import queue
import signal
from concurrent import futures
from typing import Any, Callable

import grpc
import structlog

from gpu_worker.runner import ModelRunner
from hetero.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from hetero_infer.config import Config
from hetero_infer.grpc_server import CHANNEL_OPTIONS, add_health_and_reflection, error_status, set_serving

log = structlog.get_logger("gpu_worker.service")
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.steps: queue.Queue[tuple[str, Callable[[], Any], futures.Future[Any]] | None] = queue.Queue()

    def run_model_loop(self) -> None:
        """Run on the main thread until `None` arrives: run each queued call (steps, suspend, resume) in order."""
        while (item := self.steps.get()) is not None:
            what, call, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call())
                except Exception as exc:  # reported to the scheduler, which resets this worker's state
                    log.exception("call failed", call=what)
                    future.set_exception(exc)

    def _on_model_thread(self, what: str, call: Callable[[], Any], context: grpc.ServicerContext) -> Any:
        future: futures.Future[Any] = futures.Future()
        self.steps.put((what, call, future))
        try:
            return future.result()
        except Exception as exc:
            context.abort(*error_status(exc))
            raise  # unreachable: abort raises

    def Describe(self, request: worker_pb2.DescribeRequest, context: grpc.ServicerContext) -> worker_pb2.WorkerInfo:
        return self.runner.describe()

    def ExecuteStep(self, plan: worker_pb2.StepPlan, context: grpc.ServicerContext) -> worker_pb2.StepResult:
        return self._on_model_thread(f"step {plan.step_id}", lambda: self.runner.execute(plan), context)

    def SuspendKVCache(self, request: worker_pb2.SuspendKVCacheRequest,
                       context: grpc.ServicerContext) -> worker_pb2.SuspendKVCacheResponse:
        mode = common_pb2.KVCacheManagementMode.Name(request.mode or common_pb2.KV_CACHE_MANAGEMENT_MODE_PERSIST)
        name = mode.removeprefix("KV_CACHE_MANAGEMENT_MODE_").lower()
        released = self._on_model_thread("suspend", lambda: self.runner.suspend_kv_cache(name), context)
        return worker_pb2.SuspendKVCacheResponse(released_bytes=released)

    def ResumeKVCache(self, request: worker_pb2.ResumeKVCacheRequest,
                      context: grpc.ServicerContext) -> worker_pb2.ResumeKVCacheResponse:
        self._on_model_thread("resume", self.runner.resume_kv_cache, context)
        return worker_pb2.ResumeKVCacheResponse()

    def Health(self, request: worker_pb2.HealthRequest, context: grpc.ServicerContext) -> worker_pb2.HealthResponse:
        return worker_pb2.HealthResponse(ready=True, steps=self.runner.steps, num_sequences=len(self.runner.sequences))


def serve_worker(config: Config) -> None:
    runner = ModelRunner(config)
    servicer = WorkerServicer(runner)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=CHANNEL_OPTIONS)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health = add_health_and_reflection(server, [SERVICE_NAME], aio=False)
    if server.add_insecure_port(config.worker_address) == 0:
        raise SystemExit(f"worker: cannot bind {config.worker_address}; is another process using it?")
    server.start()
    set_serving(health, [SERVICE_NAME])
    log.info("worker serving", address=config.worker_address)

    def stop(*_: object) -> None:
        servicer.steps.put(None)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    servicer.run_model_loop()
    set_serving(health, [SERVICE_NAME], serving=False)
    server.stop(grace=2).wait()
    log.info("worker stopped")
