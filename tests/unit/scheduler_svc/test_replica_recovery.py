"""Moving sequences off a failed replica's core scheduler and recomputing them on another (no model)."""

from __future__ import annotations

from tests.helpers.scheduler_driver import answer, make, params


def test_sequences_move_to_another_core_and_resume_from_their_tokens() -> None:
    failed, survivor = make(num_blocks=32), make(num_blocks=32)
    for i in range(3):
        failed.add_request(f"r{i}", [10 + i] * 6, params(max_tokens=5))
    for token in (7, 8):  # two tokens each, then the worker dies
        failed.process_result(answer(failed.schedule(), token))
    assert failed.kv_cache.pool.num_used > 0
    moved = failed.take_all_for_recompute()
    assert [s.request_id for s in moved] == ["r0", "r1", "r2"]
    assert failed.kv_cache.pool.num_used == 0 and not failed.has_pending_work()
    survivor.add_request("other", [1, 2, 3], params(max_tokens=5))
    for seq in moved:
        survivor.adopt(seq)
    plan = survivor.schedule()
    resent = {n.seq_id: n for n in plan.new_sequences}
    for seq in moved:  # prompt plus the generated tokens, recomputed in one prefill
        assert list(resent[seq.seq_id].token_ids) == seq.token_ids[:6] + [7, 8]
        assert resent[seq.seq_id].num_generated == 2
    outputs = survivor.process_result(answer(plan, 9))
    finished = {}
    while survivor.has_pending_work():
        for out in survivor.process_result(answer(survivor.schedule(), 9)):
            if out.finish_reason:
                finished[out.request_id] = out.finish_reason
    assert {o.request_id for o in outputs} == {"other", "r0", "r1", "r2"}
    assert all(s.num_generated == 5 for s in moved)  # max_tokens counts the tokens made before the move
    assert survivor.kv_cache.pool.num_used == 0 and set(finished) == {"other", "r0", "r1", "r2"}


def test_deadline_is_kept_across_the_move() -> None:
    failed, survivor = make(), make()
    failed.add_request("r", [5, 6, 7], params(), deadline=123.0)
    (moved,) = failed.take_all_for_recompute()
    survivor.adopt(moved)
    assert survivor.requests["r"].deadline == 123.0
