"""Overlap (async scheduling, scheduler_svc/core/overlap.py): step N+1 planned while step N is in flight.

The scheduler is the real one; the worker's part is the property tests' `PaperWorker`, which checks every
slot a sequence attends to against its tokens. Driven as the replica drives it: send N, plan N+1 ahead,
apply N's result, and so on, with requests submitted and aborted between steps. What must hold: every
request ends, the tokens each sample emits are exactly the ones the worker sampled for it (in order,
none lost or doubled, a placeholder never sent), no block leaks, and the outputs equal those of the
same requests scheduled one step at a time.
"""

from __future__ import annotations

import threading
from concurrent import futures
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_worker import service as worker_service
from gpu_worker.runner import ModelRunner
from gpu_worker.service import ModelCall, WorkerServicer
from hetero.v1 import common_pb2, worker_pb2
from hetero_common.config import Config
from hetero_common.errors import ExecutionError, StepOrderError
from scheduler_svc.core.overlap import PLACEHOLDER
from scheduler_svc.core.scheduler import Scheduler, plan_needs_worker
from tests.helpers.scheduler_driver import answer, make, params
from tests.unit.scheduler_svc.test_kv_cache_properties import (
    EOS,
    PREFIXES,
    PaperWorker,
    check_invariants,
    worker_kv_garbage,
)

BLOCK, NUM_BLOCKS = 4, 24
STOP = 5  # one of the tokens PaperWorker samples (3..7)


class RecordingWorker(PaperWorker):
    """A PaperWorker that also keeps, per sequence, the tokens it last knew (kept after release), and
    checks that plans come in step order and that one planned ahead names the step before it."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.known: dict[int, list[int]] = {}
        self.last_step = 0

    def execute(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepResult:
        assert plan.step_id > self.last_step
        assert plan.after_step_id in (0, self.last_step), (plan.after_step_id, self.last_step)
        for new in plan.new_sequences:
            assert PLACEHOLDER & 0xFFFFFFFF not in new.token_ids
        self.last_step = plan.step_id
        result = super().execute(plan)
        for s in plan.scheduled:
            self.known[s.seq_id] = list(self.seqs[s.seq_id]["tokens"])
        return result


class Driver:
    """Runs one scheduler as the replica does, pipelined (`ahead`) or one step at a time."""

    def __init__(self, config: Config, ahead: bool, num_blocks: int = NUM_BLOCKS) -> None:
        self.s = Scheduler(config, num_blocks, (EOS,), max_model_len=64)
        self.worker = RecordingWorker(num_blocks, BLOCK)
        self.ahead = ahead
        self.pending: worker_pb2.StepResult | None = None  # the result of the step in flight
        self.emitted: dict[tuple[str, int], list[int]] = {}
        self.finished: dict[tuple[str, int], int] = {}
        self.samples: dict[tuple[str, int], tuple[int, int]] = {}  # -> (seq_id, prompt_len)
        self.steps_ahead = 0

    def step(self) -> None:
        s = self.s
        if self.pending is None:
            plan = s.schedule()
            if not plan_needs_worker(plan):
                return
            self.pending = self.worker.execute(plan)  # "sent": the worker runs plans in order
        result, self.pending = self.pending, None
        if self.ahead and s.has_pending_work():
            plan = s.plan_ahead()
            if plan is not None and plan_needs_worker(plan):
                self.pending = self.worker.execute(plan)
                self.steps_ahead += 1
            self.after_planning_ahead()
        self._note_samples()
        self._collect(s.process_result(result))

    def after_planning_ahead(self) -> None:
        """A test's look at the scheduler while a step is in flight and the next one planned."""

    def settle(self) -> None:
        while self.pending is not None:
            result, self.pending = self.pending, None
            self._note_samples()
            self._collect(self.s.process_result(result))

    def _note_samples(self) -> None:
        for rid, seqs in self.s.samples.items():
            for seq in seqs:
                self.samples[(rid, seq.index)] = (seq.seq_id, seq.prompt_len)

    def _collect(self, outputs) -> None:
        for out in outputs:
            key = (out.request_id, out.index)
            assert key not in self.finished, f"{key}: an output after its last one"
            self.emitted.setdefault(key, []).extend(out.token_ids)
            if out.finish_reason:
                self.finished[key] = out.finish_reason

    def run_to_end(self) -> None:
        for _ in range(3000):
            if not self.s.has_pending_work() and self.pending is None:
                break
            self.step()
            check_invariants(self.s, self.worker)
        self.settle()

    def check_outputs(self) -> None:
        s = self.s
        assert not s.has_pending_work() and not s.requests and not s.samples
        assert s.kv_cache.pool.num_used == 0
        assert not any(seq.awaiting_token for seq in s.sequences.values())
        for key, tokens in self.emitted.items():
            if self.finished.get(key) != common_pb2.FINISH_REASON_ABORT:
                assert key in self.finished, f"{key} never finished"
            seq_id, prompt_len = self.samples[key]
            known = self.worker.known.get(seq_id, [])[prompt_len:]
            assert known[:len(tokens)] == tokens, f"{key}: emitted {tokens}, the worker sampled {known}"
            # At most the one token computed in vain by a step planned ahead of the one that ended it.
            assert len(known) - len(tokens) <= (1 if self.ahead else 0), (key, tokens, known)


def config(**kw) -> Config:
    return Config(**{"dtype": "float32", "block_size": BLOCK, "max_total_tokens": 12, "max_batch_size": 6,
                     "memory_threshold": 1.0, **kw}).validate()


ops = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 2), st.lists(st.integers(2, 8), max_size=7), st.integers(1, 6),
              st.integers(1, 3), st.booleans()),
    st.tuples(st.just("step")),
    st.tuples(st.just("step")),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 50), st.integers(-1, 2)),
    st.tuples(st.just("evict"), st.integers(1, 6)),
    st.tuples(st.just("suspend"), st.sampled_from(["persist", "offload", "recompute"])),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations=st.lists(ops, max_size=50), policy=st.sampled_from(["lru", "ref_zero"]),
       mode=st.sampled_from(["recompute", "swap"]), caching=st.booleans(), chunk=st.sampled_from([0, 3]))
def test_planning_ahead_keeps_tokens_and_blocks_right(operations, policy, mode, caching, chunk) -> None:
    """Random interleavings, pipelined, in a tight pool: with a stop id the worker samples now and then,
    sequences end unforeseen under a step planned ahead, and preemption picks sequences awaiting a token."""
    d = Driver(config(enable_prefix_caching=caching, prefix_caching_eviction_policy=policy, preemption_mode=mode,
                      max_prefill_chunk_tokens=chunk), ahead=True)
    submitted = 0
    for op in operations:
        if op[0] == "submit":
            _, prefix, tail, max_tokens, n, stops = op
            prompt = (PREFIXES[prefix] if prefix < 2 else []) + tail or [3]
            d.s.add_request(f"r{submitted}", prompt, common_pb2.SamplingParams(
                max_tokens=max_tokens, temperature=0.0, n=n, stop_token_ids=[STOP] if stops else []))
            submitted += 1
        elif op[0] == "step":
            d.step()
        elif op[0] == "abort" and d.s.samples:
            rid = sorted(d.s.samples)[op[1] % len(d.s.samples)]
            for index in d.s.abort(rid, index=None if op[2] < 0 else op[2]):
                d.finished[(rid, index)] = common_pb2.FINISH_REASON_ABORT
        elif op[0] == "evict":
            taken = d.s.kv_cache.pool.allocate(min(op[1], d.s.kv_cache.pool.num_free))
            worker_kv_garbage(d.worker, taken)
            d.s.kv_cache.pool.release(taken)
        elif op[0] == "suspend":  # the replica settles the step in flight first
            d.settle()
            d.s.suspend(op[1])
            if op[1] == "recompute":
                d.worker.drop_cache()
            d.s.resume()
        check_invariants(d.s, d.worker)
    d.run_to_end()
    d.check_outputs()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(2, 8), max_size=7), st.integers(1, 8),
                                   st.integers(1, 2), st.booleans()), min_size=1, max_size=8),
       mode=st.sampled_from(["recompute", "swap"]), caching=st.booleans(), chunk=st.sampled_from([0, 3]))
def test_planning_ahead_gives_the_same_outputs_as_one_step_at_a_time(requests, mode, caching, chunk) -> None:
    outputs = []
    for ahead in (False, True):
        d = Driver(config(enable_prefix_caching=caching, preemption_mode=mode, max_prefill_chunk_tokens=chunk), ahead)
        for i, (prefix, tail, max_tokens, n, stops) in enumerate(requests):
            prompt = (PREFIXES[prefix] if prefix < 2 else []) + tail or [3]
            d.s.add_request(f"r{i}", prompt, common_pb2.SamplingParams(
                max_tokens=max_tokens, temperature=0.0, n=n, stop_token_ids=[STOP] if stops else []))
        d.run_to_end()
        d.check_outputs()
        outputs.append(({k: v for k, v in d.emitted.items() if k[1] == 0}, {k: v for k, v in d.finished.items() if k[1] == 0}))
    # Sample 0 of each request: its tokens depend on its prompt only (forks' seq ids may differ).
    assert outputs[0] == outputs[1]


def test_a_sequence_that_ends_by_length_is_not_planned_again() -> None:
    s = make()
    s.add_request("a", [5, 6, 7], params(max_tokens=2))
    first = s.schedule()
    ahead = s.plan_ahead()  # the prompt's step samples token 1 of 2: one decode planned ahead
    assert [e.seq_id for e in ahead.scheduled] == [0] and ahead.after_step_id == first.step_id
    s.process_result(answer(first))
    again = s.plan_ahead()  # the decode in flight samples the last token: nothing to plan
    assert again is not None and not plan_needs_worker(again)
    outs = list(s.process_result(answer(ahead)))
    assert outs[0].finish_reason == common_pb2.FINISH_REASON_LENGTH and s.kv_cache.pool.num_used == 0


def test_a_sequence_ended_by_eos_under_a_step_planned_ahead_has_its_extra_token_dropped() -> None:
    s = make()
    s.add_request("a", [5, 6, 7], params(max_tokens=10))
    first = s.schedule()
    ahead = s.plan_ahead()
    outs = list(s.process_result(answer(first, token=EOS)))  # ends at step 1; step 2 is already on its way
    assert [o.finish_reason for o in outs] == [common_pb2.FINISH_REASON_STOP] and outs[0].token_ids == [EOS]
    assert s.kv_cache.pool.num_used == 0 and not s.requests
    assert s.process_result(answer(ahead)) == []  # the token step 2 computed in vain is dropped
    s.add_request("b", [5], params(max_tokens=1))
    assert list(s.schedule().released_seq_ids) == [0]  # the worker forgets it with the next plan


def test_a_sequence_preempted_while_its_token_is_in_flight_keeps_it() -> None:
    # Two 1-token prompts in 3 blocks of 4: the pool runs out while both decode, and the step planned
    # ahead preempts the newer one, whose token from the step in flight is not back yet.
    d = Driver(config(max_batch_size=2), ahead=True, num_blocks=3)
    d.s.add_request("r0", [3], params(max_tokens=7))
    d.s.add_request("r1", [3], params(max_tokens=6))
    preempted_awaiting = []

    def look() -> None:
        r1 = d.s.requests.get("r1")
        if r1 is not None and r1.awaiting_token and r1 in d.s.waiting:  # not re-admitted with its placeholder
            assert r1.token_ids[-1] == PLACEHOLDER and r1.num_computed == 0 and not d.s.on_worker(r1)
            preempted_awaiting.append(len(r1.token_ids))

    d.after_planning_ahead = look
    d.run_to_end()
    d.check_outputs()
    assert preempted_awaiting
    assert len(d.emitted[("r0", 0)]) == 7 and len(d.emitted[("r1", 0)]) == 6


def test_no_plan_ahead_while_a_prompt_that_forks_is_in_flight() -> None:
    s = make()
    s.add_request("a", [5, 6, 7], params(max_tokens=4, n=3))
    plan = s.schedule()
    assert s.plan_ahead() is None  # its samples fork from its prompt's blocks once the result is in
    s.process_result(answer(plan))
    assert len(s.samples["a"]) == 3


def test_a_lost_step_planned_ahead_of_leaves_no_placeholder() -> None:
    s = make()
    s.add_request("a", [5, 6, 7], params(max_tokens=10))
    s.schedule()
    s.plan_ahead()
    (seq,) = s.take_all_for_recompute()
    assert seq.token_ids == [5, 6, 7] and not seq.awaiting_token and seq.num_computed == 0


# ---------------------------------------------------------------- the worker's side: step order


def _call(servicer: WorkerServicer, plan: worker_pb2.StepPlan) -> ModelCall:
    return ModelCall(f"step {plan.step_id}", lambda: servicer._execute_step(plan), step_id=plan.step_id,
                     after_step_id=plan.after_step_id, resets=plan.reset)


def _run_calls(runner: ModelRunner, plans: list[worker_pb2.StepPlan]) -> list[worker_pb2.StepResult]:
    """Queue the plans' calls in this order on a worker's model loop, run it, return their results."""
    servicer = WorkerServicer(runner)
    calls = [_call(servicer, plan) for plan in plans]
    for c in [*calls, None]:
        servicer.steps.put(c)
    servicer.run_model_loop()
    return [c.future.result() for c in calls]


def test_the_worker_runs_a_plan_made_ahead_right_after_the_step_it_follows(tiny_llama_dir: Path) -> None:
    """The plan made ahead reaches the model thread first (each unary call has its own handler thread):
    it is held until its step has run, and the tokens are those of one step at a time."""
    cfg = Config(model=str(tiny_llama_dir), dtype="float32", block_size=4).validate()
    runner = ModelRunner(cfg)
    info = runner.describe()
    tokens = {}
    for ahead in (False, True):
        s = Scheduler(cfg, info.num_blocks, tuple(info.eos_token_ids), 256)
        s.add_request("a", [5, 6, 7, 8, 9], params(max_tokens=3, ignore_eos=True))
        first = s.schedule()
        first.reset = True  # one runner for both runs
        if ahead:
            second = s.plan_ahead()
            assert second.after_step_id == first.step_id
            results = _run_calls(runner, [second, first])[::-1]  # arrived in the wrong order
            out = [o for r in results for o in s.process_result(r)]
        else:
            out = list(s.process_result(_run_calls(runner, [first])[0]))
            out += s.process_result(_run_calls(runner, [s.schedule()])[0])
        tokens[ahead] = [t for o in out for t in o.token_ids]
    assert len(tokens[False]) == 2 and tokens[True] == tokens[False]


def test_a_plan_made_ahead_of_a_failed_step_fails_too(tiny_llama_dir: Path) -> None:
    runner = ModelRunner(Config(model=str(tiny_llama_dir), dtype="float32", block_size=4).validate())
    servicer = WorkerServicer(runner)
    bad = worker_pb2.StepPlan(step_id=10, scheduled=[worker_pb2.ScheduledSequence(seq_id=99, num_tokens=1, sample=True)])
    dependent = worker_pb2.StepPlan(step_id=11, after_step_id=10)
    stale = worker_pb2.StepPlan(step_id=21, after_step_id=20)  # held when a scheduler restarted:
    fresh = worker_pb2.StepPlan(step_id=1, reset=True)  # its plans start again from a reset
    orphan = worker_pb2.StepPlan(step_id=13, after_step_id=12)  # its step never comes
    calls = [_call(servicer, bad), _call(servicer, dependent), _call(servicer, stale), _call(servicer, fresh),
             _call(servicer, orphan)]
    for c in calls:
        servicer.steps.put(c)
    worker_service.HOLD_TIMEOUT_S, saved = 0.2, worker_service.HOLD_TIMEOUT_S

    def stop_after_the_orphan() -> None:  # once a sweep of the held plans (every second) has refused it
        futures.wait([calls[4].future], timeout=30)
        servicer.steps.put(None)

    stop = threading.Thread(target=stop_after_the_orphan, daemon=True)
    stop.start()
    try:
        servicer.run_model_loop()
    finally:
        worker_service.HOLD_TIMEOUT_S = saved
        stop.join()
    with pytest.raises(ExecutionError, match="unknown"):
        calls[0].future.result()
    with pytest.raises(StepOrderError, match="step 10, which failed"):
        calls[1].future.result()
    with pytest.raises(StepOrderError, match="a reset .step 1. came first"):
        calls[2].future.result()
    assert calls[3].future.result().step_id == 1
    with pytest.raises(StepOrderError, match="never reached"):
        calls[4].future.result()
