"""Priority in the scheduler (no model): admission in (priority, arrival) order, a preempted
sequence back at the front of its class, victims taken lowest priority (highest value) first,
and the waiting queue's own contract."""

from __future__ import annotations

import random

import pytest

from scheduler_svc.sequence import SequenceStatus
from scheduler_svc.core.waiting_queue import WaitingQueue
from tests.helpers.scheduler_driver import answer, make, params


def admitted(s) -> list[str]:
    """Request ids of the sequences the next plan schedules, in plan order."""
    by_id = {seq.seq_id: seq.request_id for seq in s.sequences.values()}
    plan = s.schedule()
    s.process_result(answer(plan))
    return [by_id[x.seq_id] for x in plan.scheduled]


def test_waiting_requests_are_admitted_in_priority_then_arrival_order() -> None:
    s = make(max_num_seqs=1)
    for rid, priority in [("a", 0), ("low1", 5), ("low2", 5), ("high", -3), ("mid", 0)]:
        s.add_request(rid, [1, 2, 3], params(max_tokens=1), priority=priority)
    order = []
    while s.has_pending_work():
        order += admitted(s)
    assert order == ["high", "a", "mid", "low1", "low2"]


def test_all_zero_priorities_are_plain_fifo() -> None:
    s = make(max_num_seqs=1)
    for rid in "abcde":
        s.add_request(rid, [1, 2], params(max_tokens=1))
    order = []
    while s.has_pending_work():
        order += admitted(s)
    assert order == list("abcde") and not s.waiting.any_priority


def test_preemption_takes_the_lowest_priority_victim_not_the_newest() -> None:
    s = make(num_blocks=4, memory_threshold=1.0, enable_prefix_caching=False)
    s.add_request("old_low", [1] * 4, params(max_tokens=8), priority=9)
    s.add_request("mid", [1] * 4, params(max_tokens=8), priority=0)
    s.add_request("new_high", [1] * 4, params(max_tokens=8), priority=-1)
    s.process_result(answer(s.schedule()))  # all three prefilled: 1 block each, 1 free
    s.process_result(answer(s.schedule()))  # the first to need a 2nd block takes the free one
    s.schedule()  # the next ones need blocks: only the lowest priority gives way, though it is the oldest
    assert s.requests["old_low"].status is SequenceStatus.PENDING
    assert s.requests["mid"].status is not SequenceStatus.PENDING
    assert s.requests["new_high"].status is not SequenceStatus.PENDING
    assert s.num_preemptions >= 1 and list(s.waiting)[0] is s.requests["old_low"]


def test_a_lower_priority_sequence_preempts_itself_rather_than_a_higher_one() -> None:
    s = make(num_blocks=2, memory_threshold=1.0, enable_prefix_caching=False)
    s.add_request("high", [1] * 4, params(max_tokens=8), priority=-5)
    s.add_request("low", [1] * 4, params(max_tokens=8), priority=5)
    s.process_result(answer(s.schedule()))  # 1 block each, none free
    s.running.reverse()  # "low" plans first and needs a block: "high" must not give way to it
    s.schedule()
    assert s.requests["low"].status is SequenceStatus.PENDING
    assert s.requests["high"].status is SequenceStatus.DECODE and s.num_preemptions == 1


def test_equal_priorities_still_preempt_the_newest() -> None:
    s = make(num_blocks=3, memory_threshold=1.0, enable_prefix_caching=False)
    s.add_request("old", [1] * 4, params(max_tokens=8), priority=3)
    s.add_request("new", [1] * 4, params(max_tokens=8), priority=3)
    s.process_result(answer(s.schedule()))
    s.schedule()
    assert s.requests["new"].status is SequenceStatus.PENDING and s.requests["old"].status is SequenceStatus.DECODE


def test_forked_samples_keep_their_requests_priority() -> None:
    s = make()
    s.add_request("r", [1, 2, 3], params(max_tokens=3, n=3, seed=1), priority=4)
    s.process_result(answer(s.schedule()))
    assert [seq.priority for seq in s.samples["r"]] == [4, 4, 4]


def test_waiting_queue_orders_requeues_and_removes() -> None:
    s = make()
    seqs = {rid: s.add_request(rid, [1], params(), priority=p) for rid, p in [("a", 1), ("b", 0), ("c", 1), ("d", 0)]}
    q = WaitingQueue()
    for rid in "abcd":
        q.append(seqs[rid])
    assert [x.request_id for x in q] == ["b", "d", "a", "c"] and len(q) == 4
    q.remove(seqs["d"])
    assert seqs["d"] not in q and len(q) == 3 and q.peek() is seqs["b"]
    assert q.popleft() is seqs["b"]
    q.appendleft(seqs["b"])  # back at the front of its class (0), ahead of nothing else there
    q.append(seqs["d"])
    assert [x.request_id for x in q] == ["b", "d", "a", "c"]
    q.popleft(), q.popleft()
    q.appendleft(seqs["d"])
    assert [q.popleft().request_id for _ in range(len(q))] == ["d", "a", "c"] and not q


@pytest.mark.parametrize("seed", range(20))
def test_random_priorities_admit_a_prefix_of_the_queue_and_free_every_block(seed: int) -> None:
    """Random submissions (priorities -2..2, n up to 2), steps, aborts, on a pool small enough to
    preempt: each step admits the head of the waiting queue in its order, and everything ends freed."""
    rng = random.Random(seed)
    s = make(num_blocks=rng.choice([8, 12, 24]), max_num_seqs=rng.choice([2, 4, 64]), memory_threshold=1.0,
             max_total_tokens=rng.choice([8, 32]), enable_prefix_caching=rng.random() < 0.5)
    submitted = 0
    for _ in range(200):
        op = rng.random()
        if op < 0.3:
            s.add_request(f"r{submitted}", [rng.randrange(3, 9) for _ in range(rng.randint(1, 12))],
                          params(max_tokens=rng.randint(1, 12), n=rng.choice([1, 1, 2]), ignore_eos=True),
                          priority=rng.randint(-2, 2))
            submitted += 1
        elif op < 0.9:
            queue = list(s.waiting)
            plan = s.schedule()
            admitted = [seq for seq in queue if seq not in s.waiting]
            assert admitted == queue[:len(admitted)]
            s.process_result(answer(plan))
        elif s.samples:
            s.abort(sorted(s.samples)[rng.randrange(len(s.samples))])
    while s.has_pending_work():
        s.process_result(answer(s.schedule()))
    assert not s.requests and s.kv_cache.pool.num_used == 0
