"""The engine loop's step, the one both engines run: schedule, send the plan, plan the next one ahead
(with async_scheduling, core/overlap.py), receive the result, apply it (`Scheduler.process_result`) and
dispatch its outputs.

Where a plan runs is the `StepExecutor`'s business: a replica (replica.py) sends it to its worker over gRPC
and awaits the call, handling a failed one itself (it answers no result); the in-process engine
(hetero_infer/engine.py) runs it on a local ModelRunner. The step is a coroutine; an executor that never
waits (the engine's) runs it without an event loop (`EngineLoop.step_now`), so sync and async callers
share the very same sequence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from hetero.v1 import worker_pb2
from scheduler_svc.core.scheduler import Scheduler, StepOutputs, plan_needs_worker


@dataclass
class SentStep:
    """A step plan on its way to be computed, and the executor's handle on it (a gRPC call, say)."""

    plan: worker_pb2.StepPlan
    call: Any
    started: float  # time.perf_counter() when it was sent


class StepExecutor(Protocol):
    """Runs the plans of an `EngineLoop`."""

    def send_step(self, plan: worker_pb2.StepPlan) -> Any:
        """Start computing `plan`; return a handle on it (`SentStep.call`)."""

    async def receive_step(self, sent: SentStep) -> worker_pb2.StepResult | None:
        """The step's result; None when it failed and the executor dealt with that (nothing is applied)."""

    def cancel_step(self, sent: SentStep) -> None:
        """A step sent ahead will not be received: the one before it failed or its sequences moved."""

    def dispatch_step(self, outputs: StepOutputs, sent: SentStep, result: worker_pb2.StepResult) -> None:
        """Publish the outputs of a step whose result was applied."""


class EngineLoop:
    """The steps of one core `Scheduler`, run by `executor`; `overlap` (async_scheduling): plan and send
    step N+1 before awaiting step N's result."""

    def __init__(self, executor: StepExecutor, overlap: bool) -> None:
        self._executor = executor
        self._overlap = overlap
        self.ahead: SentStep | None = None  # a step sent before the one in flight came back

    async def step(self, core: Scheduler, plan_ahead: bool = True) -> bool:
        """Receive one step (sending it first unless it went ahead in the last call), apply its result and
        dispatch its outputs; with overlap (and `plan_ahead`), plan and send the next step first. False when
        nothing needed the worker (nothing was sent)."""
        sent, self.ahead = self.ahead, None
        if sent is None:
            plan = core.schedule()
            if not plan_needs_worker(plan):
                return False
            sent = self._send(plan)
        if plan_ahead and self._overlap and core.has_pending_work():
            ahead = core.plan_ahead()
            if ahead is not None and plan_needs_worker(ahead):
                self.ahead = self._send(ahead)
        result = await self._executor.receive_step(sent)
        if result is not None:
            self._executor.dispatch_step(core.process_result(result), sent, result)
        return True

    def step_now(self, core: Scheduler) -> bool:
        """`step`, run to its end right here, for an executor whose `receive_step` never waits on anything:
        no event loop needed (the caller may even be inside one). Raises what the step raises."""
        coroutine = self.step(core)
        try:
            coroutine.send(None)
        except StopIteration as done:
            return bool(done.value)
        coroutine.close()
        raise RuntimeError("the step's executor waited on something: step_now needs one that never suspends")

    def drop_ahead(self) -> None:
        """The step in flight failed or its sequences moved: the one planned ahead of it is void."""
        if self.ahead is not None:
            self._executor.cancel_step(self.ahead)
            self.ahead = None

    def _send(self, plan: worker_pb2.StepPlan) -> SentStep:
        return SentStep(plan, self._executor.send_step(plan), time.perf_counter())
