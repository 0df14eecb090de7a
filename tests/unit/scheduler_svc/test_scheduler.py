"""The block pool and the scheduler's planning, driven step by step without a model.

The worker's part is played by `answer()`, which samples token 7 for every sequence the
plan asks to sample; everything else is the real Scheduler.
"""

from __future__ import annotations

import pytest

from hetero.v1 import common_pb2, worker_pb2
from hetero_common.errors import DuplicateRequestError, ValidationError
from scheduler_svc.sequence import SequenceStatus
from scheduler_svc.kv.block_pool import BlockPool, OutOfBlocksError
from tests.helpers.scheduler_driver import EOS, answer, make, params


def test_block_pool_reference_counts() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free == 1 and pool.num_used == 3
    pool.share(a[0])
    pool.release(a)
    assert pool.num_free == 3 and pool.ref_counts[a[0]] == 1
    with pytest.raises(OutOfBlocksError):
        pool.allocate(4)
    pool.release([a[0]])
    assert pool.num_free == 4
    with pytest.raises(ValueError):
        pool.release([a[0]])


def test_new_request_joins_running_batch_next_step() -> None:
    s = make()
    s.add_request("a", [1] * 6, params(max_tokens=10))
    plan = s.schedule()
    assert [(x.num_tokens, x.sample) for x in plan.scheduled] == [(6, True)]
    assert len(plan.new_sequences) == 1 and tuple(plan.scheduled[0].new_block_ids) == s.kv_cache.table(s.requests["a"])
    s.process_result(answer(plan))
    s.add_request("b", [1] * 3, params(max_tokens=10))
    plan = s.schedule()
    # The decode of "a" and the prefill of "b" share one step; only "b" is sent whole.
    assert [(x.num_tokens, x.num_cached_tokens) for x in plan.scheduled] == [(1, 6), (3, 0)]
    assert [n.seq_id for n in plan.new_sequences] == [s.requests["b"].seq_id]


def test_finished_sequences_free_blocks_at_once_and_are_released() -> None:
    s = make()
    s.add_request("a", [1] * 5, params(max_tokens=2))
    s.process_result(answer(s.schedule()))
    outs = list(s.process_result(answer(s.schedule())))
    assert outs[0].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert s.kv_cache.pool.num_used == 0 and not s.has_pending_work()
    seq_id = 0
    s.add_request("b", [1], params())
    assert seq_id in s.schedule().released_seq_ids


def test_eos_and_stop_token_ids_finish_with_stop() -> None:
    s = make()
    s.add_request("a", [1, 1], params(max_tokens=10))
    s.add_request("b", [1, 1], params(max_tokens=10, stop_token_ids=[9]))
    s.add_request("c", [1, 1], params(max_tokens=3, ignore_eos=True))
    plan = s.schedule()
    a, b, c = plan.scheduled
    result = worker_pb2.StepResult(step_id=plan.step_id, seq_ids=[a.seq_id, b.seq_id, c.seq_id], token_ids=[EOS, 9, EOS])
    reasons = {o.request_id: o.finish_reason for o in s.process_result(result)}
    assert reasons == {"a": common_pb2.FINISH_REASON_STOP, "b": common_pb2.FINISH_REASON_STOP,
                       "c": common_pb2.FINISH_REASON_UNSPECIFIED}


def test_token_and_sequence_budgets() -> None:
    s = make(max_total_tokens=10, max_batch_size=2, enable_chunked_prefill=True)
    for name in "abc":
        s.add_request(name, [1] * 8, params())
    plan = s.schedule()
    # a's 8 tokens, then a 2-token chunk of b; c waits (sequence budget 2).
    assert [(x.num_tokens, x.sample) for x in plan.scheduled] == [(8, True), (2, False)]
    assert len(s.waiting) == 1


def test_without_chunking_a_prompt_waits_for_a_whole_step() -> None:
    s = make(max_total_tokens=10, max_model_len=10, enable_chunked_prefill=False)
    s.add_request("a", [1] * 6, params())
    s.add_request("b", [1] * 6, params())
    plan = s.schedule()
    assert [x.num_tokens for x in plan.scheduled] == [6]


def test_memory_threshold_holds_back_new_requests() -> None:
    s = make(num_blocks=10, memory_threshold=0.5)
    s.add_request("a", [1] * 16, params())  # 4 blocks
    s.add_request("b", [1] * 8, params())  # would take usage to 6/10 > 0.5
    plan = s.schedule()
    assert len(plan.scheduled) == 1 and len(s.waiting) == 1


def test_max_num_seqs_caps_admission() -> None:
    s = make(max_num_seqs=2)
    for name in "abc":
        s.add_request(name, [1], params())
    assert len(s.schedule().scheduled) == 2 and len(s.waiting) == 1


def test_preemption_requeues_newest_with_its_tokens() -> None:
    s = make(num_blocks=3, memory_threshold=1.0, enable_prefix_caching=False)  # the cache would share the prompts
    s.add_request("old", [1] * 4, params(max_tokens=8))
    s.add_request("new", [1] * 4, params(max_tokens=8))
    s.process_result(answer(s.schedule()))  # both prefilled: 1 + 1 blocks
    plan = s.schedule()  # "old" needs a 3rd block... none free: "new" is preempted
    assert [x.seq_id for x in plan.scheduled] == [s.requests["old"].seq_id]
    new = s.requests["new"]
    assert new.status is SequenceStatus.PENDING and new.token_ids == [1] * 4 + [7] and s.num_preemptions == 1
    s.process_result(answer(plan))
    while s.has_pending_work():
        plan = s.schedule()
        s.process_result(answer(plan))
    assert s.kv_cache.pool.num_used == 0


def test_abort_frees_blocks_and_rejects_bad_requests() -> None:
    s = make()
    s.add_request("a", [1] * 9, params())
    s.schedule()
    assert s.kv_cache.pool.num_used == 3
    assert s.abort("a") and not s.abort("a")
    assert s.kv_cache.pool.num_used == 0
    s.add_request("b", [1], params())
    with pytest.raises(DuplicateRequestError):
        s.add_request("b", [1], params())
    with pytest.raises(ValidationError, match="max_model_len"):
        s.add_request("c", [1] * 4096, params())
    with pytest.raises(ValidationError, match="empty"):
        s.add_request("d", [], params())


def test_hand_written_decode_entries_equal_protobufs_own_encoding() -> None:
    """step_plan writes the common decode entry as wire bytes: they must parse to, and serialize
    as, the message built field by field, for one- to three-byte varints."""
    from hetero.v1 import worker_pb2
    from hetero_common.sampling import resolve
    from scheduler_svc.core.step_plan import WorkerOutbox, add_scheduled
    from scheduler_svc.kv.kv_cache_manager import KVCacheManager
    from scheduler_svc.sequence import Sequence

    plain = common_pb2.SamplingParams()
    for seq_id, computed in ((0, 1), (5, 127), (200, 128), (70_000, 20_000)):
        seq = Sequence.new(seq_id, "r", list(range(computed + 1)), 1, resolve(plain), plain, num_computed=computed)
        outbox, kv = WorkerOutbox(), KVCacheManager(8, 16, False, cache_freed_blocks=False)
        outbox.on_worker.add(seq_id)  # on the worker, which has every block of its table (none unsent)
        plan = worker_pb2.StepPlan()
        add_scheduled(plan, [(seq, 1)], kv, outbox, arm=False)
        expected = worker_pb2.StepPlan(scheduled=[worker_pb2.ScheduledSequence(
            seq_id=seq_id, num_tokens=1, sample=True, num_cached_tokens=computed)])
        assert plan == expected and plan.SerializeToString() == expected.SerializeToString()


def test_hand_written_prompt_and_new_block_entries_are_protobufs_own_bytes() -> None:
    """The other entries without table edits (prompt chunks, a decode into a new block) are written by hand
    too: byte for byte what protobuf writes for the message built field by field, empty fields left out."""
    import random

    from hetero.v1 import worker_pb2
    from hetero_common.sampling import resolve
    from scheduler_svc.core.step_plan import _entry_bytes
    from scheduler_svc.kv.kv_cache_manager import KVBlocks
    from scheduler_svc.sequence import Sequence

    plain = common_pb2.SamplingParams()
    rng = random.Random(0)
    for _ in range(300):
        seq_id = rng.choice([0, 1, 127, 128, 70_000, 2**40])
        table = [rng.choice([0, 5, 127, 128, 16_383, 16_384, 3_000_000]) for _ in range(rng.randint(0, 6))]
        sent = rng.randint(0, len(table))
        seq = Sequence.new(seq_id, "r", [1], 1, resolve(plain), plain, num_computed=rng.choice([0, 1, 127, 128, 20_000]))
        num_tokens, sample = rng.choice([0, 1, 300, 16_384]), rng.random() < 0.5
        expected = worker_pb2.ScheduledSequence(seq_id=seq_id, num_tokens=num_tokens, sample=sample,
                                                new_block_ids=table[sent:], num_cached_tokens=seq.num_computed)
        assert _entry_bytes(seq, num_tokens, sample, KVBlocks(table[sent:], [])) == expected.SerializeToString()


def test_hand_written_new_sequence_entries_are_protobufs_own_bytes() -> None:
    """A new sequence's entry (its ids packed as fixed32 in one struct.pack) is byte for byte protobuf's."""
    import random

    from hetero.v1 import worker_pb2
    from hetero_common.sampling import resolve
    from scheduler_svc.sequence import Sequence
    from scheduler_svc.core.step_plan import new_sequence_bytes

    rng = random.Random(1)
    for _ in range(100):
        params = rng.choice([common_pb2.SamplingParams(), params_for_test(rng)])
        tokens = [rng.choice([0, 1, 300, 2**31 + 5, 2**32 - 1]) for _ in range(rng.randint(1, 40))]
        prompt_len = rng.randint(1, len(tokens))
        seq = Sequence.new(rng.choice([0, 3, 300, 2**40]), "r", tokens, prompt_len, resolve(params), params)
        expected = worker_pb2.StepPlan(new_sequences=[worker_pb2.NewSequence(
            seq_id=seq.seq_id, token_ids=tokens, params=params, num_generated=len(tokens) - prompt_len)])
        assert b"".join(new_sequence_bytes(seq)) == expected.SerializeToString()


def params_for_test(rng) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=rng.randint(1, 500), temperature=rng.random(), seed=rng.randint(0, 9))
