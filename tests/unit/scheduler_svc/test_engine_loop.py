"""The engine loop's step (scheduler_svc/replicas/engine_loop.py) with a recording executor and no model:
the order of its calls with and without overlap, a failed step, and `step_now` for an executor that never
waits."""

from __future__ import annotations

import asyncio

import pytest

from hetero.v1 import worker_pb2
from scheduler_svc.core.scheduler import Scheduler, StepOutputs
from scheduler_svc.replicas.engine_loop import EngineLoop, SentStep
from tests.helpers.scheduler_driver import answer, make, params


class Recorder:
    """Answers every plan with token 7 (the worker's part of scheduler_driver) and notes each call."""

    def __init__(self, suspend: bool = False) -> None:
        self.calls: list[tuple[str, int]] = []
        self.outputs: list[tuple[str, list[int], int]] = []
        self.suspend = suspend
        self.fail = False
        self.loop: EngineLoop | None = None

    def send_step(self, plan: worker_pb2.StepPlan) -> int:
        self.calls.append(("send", plan.step_id))
        return plan.after_step_id

    async def receive_step(self, sent: SentStep) -> worker_pb2.StepResult | None:
        self.calls.append(("receive", sent.plan.step_id))
        if self.suspend:
            await asyncio.sleep(0)
        if self.fail:  # as a replica does: the step ahead was planned assuming this one
            assert self.loop is not None
            self.loop.drop_ahead()
            return None
        return answer(sent.plan)

    def cancel_step(self, sent: SentStep) -> None:
        self.calls.append(("cancel", sent.plan.step_id))

    def dispatch_step(self, outputs: StepOutputs, sent: SentStep, result: worker_pb2.StepResult) -> None:
        self.calls.append(("dispatch", sent.plan.step_id))
        self.outputs.extend((o.request_id, list(o.token_ids), o.finish_reason) for o in outputs)


def _run(overlap: bool) -> tuple[Recorder, Scheduler]:
    core, executor = make(), Recorder()
    loop = executor.loop = EngineLoop(executor, overlap)
    for i in range(2):
        core.add_request(f"r{i}", [10 + i] * 5, params(max_tokens=3))

    async def steps() -> None:
        while core.has_pending_work() or loop.ahead is not None:
            await loop.step(core)

    asyncio.run(steps())
    return executor, core


def test_overlap_sends_the_next_step_before_receiving_one_and_gives_the_same_outputs() -> None:
    alone, _ = _run(overlap=False)
    ahead, core = _run(overlap=True)
    assert alone.calls[:6] == [("send", 1), ("receive", 1), ("dispatch", 1), ("send", 2), ("receive", 2),
                               ("dispatch", 2)]
    assert ahead.calls[:6] == [("send", 1), ("send", 2), ("receive", 1), ("dispatch", 1), ("send", 3),
                               ("receive", 2)]
    assert ahead.outputs == alone.outputs
    assert core.num_planned_ahead > 0 and core.kv_cache.pool.num_used == 0


def test_a_failed_step_applies_nothing_and_cancels_the_step_sent_ahead() -> None:
    core, executor = make(), Recorder()
    loop = executor.loop = EngineLoop(executor, overlap=True)
    core.add_request("r", [5, 6, 7], params(max_tokens=4))
    asyncio.run(loop.step(core))
    executor.fail = True
    assert asyncio.run(loop.step(core)) is True
    assert executor.calls[-3:] == [("send", 3), ("receive", 2), ("cancel", 3)]
    assert loop.ahead is None and ("dispatch", 2) not in executor.calls


def test_step_now_runs_a_step_that_never_waits_and_refuses_one_that_does() -> None:
    core, executor = make(), Recorder()
    loop = EngineLoop(executor, overlap=False)
    assert loop.step_now(core) is False and executor.calls == []  # nothing for the worker
    core.add_request("r", [5, 6, 7], params(max_tokens=2))
    assert loop.step_now(core) is True
    assert executor.calls == [("send", 2), ("receive", 2), ("dispatch", 2)]  # step 1 was empty
    executor.suspend = True
    with pytest.raises(RuntimeError, match="never suspends"):
        loop.step_now(core)
