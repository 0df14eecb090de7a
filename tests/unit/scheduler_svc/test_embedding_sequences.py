"""Embedding requests in the scheduler (SubmitRequest.pooling): prefill only, in chunks beside generation, no
prefix-cache hit, the vector as the one output, blocks freed, nothing planned ahead for them (overlap)."""

from __future__ import annotations

import pytest

from hetero.v1 import common_pb2, worker_pb2
from hetero_common.errors import ValidationError
from tests.helpers.scheduler_driver import answer, make, params

MEAN = common_pb2.POOLING_MEAN


def pooled_result(plan: worker_pb2.StepPlan, vector: list[float], embedding_ids: set[int]) -> worker_pb2.StepResult:
    """The worker's answer: a token for each generation that samples, the vector for each embedding it completes
    (`embedding_ids`: the embedding sequences met so far, updated from the plan's new ones)."""
    embedding_ids.update(n.seq_id for n in plan.new_sequences if n.pooling)
    result = answer(plan)
    keep = [(s, t) for s, t in zip(result.seq_ids, result.token_ids) if s not in embedding_ids]
    del result.seq_ids[:], result.token_ids[:]
    result.seq_ids.extend(s for s, _ in keep)
    result.token_ids.extend(t for _, t in keep)
    for s in plan.scheduled:
        if s.sample and s.seq_id in embedding_ids:
            result.embeddings.add(seq_id=s.seq_id, values=vector)
    return result


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_embedding_is_chunked_beside_a_generation_and_ends_with_its_vector(async_scheduling: bool) -> None:
    sched = make(max_prefill_chunk_tokens=4, async_scheduling=async_scheduling)
    sched.add_request("gen", list(range(3, 9)), params(max_tokens=6))
    prompt = list(range(10, 21))  # 11 tokens: chunks of 4, 4, 3
    sched.add_request("emb", prompt, params(max_tokens=1), pooling=MEAN)
    first = sched.schedule()
    assert [n.pooling for n in first.new_sequences] == [0, MEAN]
    chunks, outputs, embedding_ids = [], [], set()
    embedding_seq = first.new_sequences[1].seq_id
    plan = first
    while plan is not None and plan.scheduled:
        chunks += [(s.num_tokens, s.sample) for s in plan.scheduled if s.seq_id == embedding_seq]
        outputs += [o for o in sched.process_result(pooled_result(plan, [0.5, -1.0], embedding_ids)) if o.request_id == "emb"]
        plan = sched.schedule() if sched.has_pending_work() else None
    assert chunks == [(4, False), (4, False), (3, True)]
    assert len(outputs) == 1 and list(outputs[0].embedding) == [0.5, -1.0] and not outputs[0].token_ids
    assert outputs[0].finish_reason == common_pb2.FINISH_REASON_STOP
    assert sched.pool_stats().used_blocks == 0


def test_overlap_plans_nothing_after_an_embeddings_last_chunk() -> None:
    sched = make(async_scheduling=True)
    sched.add_request("emb", list(range(10, 16)), params(max_tokens=1), pooling=MEAN)
    plan = sched.schedule()
    ahead = sched.plan_ahead()  # the last chunk is in flight: no placeholder, no decode
    assert ahead is None or not [s for s in ahead.scheduled if s.seq_id == plan.scheduled[0].seq_id]
    outputs = list(sched.process_result(pooled_result(plan, [1.0], set())))
    assert [o.request_id for o in outputs] == ["emb"] and list(outputs[0].embedding) == [1.0]
    assert sched.pool_stats().used_blocks == 0 and not sched.has_pending_work()


def test_an_embedding_never_takes_a_prefix_cache_hit() -> None:
    sched = make()
    prompt = list(range(10, 30))
    sched.add_request("warm", prompt, params(max_tokens=1))
    while sched.has_pending_work():
        sched.process_result(answer(sched.schedule()))
    sched.add_request("emb", prompt, params(max_tokens=1), pooling=MEAN)
    plan = sched.schedule()
    assert plan.scheduled[0].num_cached_tokens == 0 and plan.scheduled[0].num_tokens == len(prompt)


def test_an_embedding_may_fill_max_model_len_and_has_one_sample() -> None:
    sched = make(max_model_len=16)
    sched.add_request("full", list(range(3, 19)), params(max_tokens=1), pooling=MEAN)  # 16 tokens
    with pytest.raises(ValidationError, match="at least one token must be generated"):
        sched.add_request("gen", list(range(3, 19)), params(max_tokens=1))
    with pytest.raises(ValidationError, match="input has 17 tokens; max_model_len is 16"):
        sched.add_request("long", list(range(3, 20)), params(max_tokens=1), pooling=MEAN)
    with pytest.raises(ValidationError, match="one sample"):
        sched.add_request("n2", [3, 4], params(max_tokens=1, n=2), pooling=MEAN)
    with pytest.raises(ValidationError, match="pooling 9 is none of"):
        sched.add_request("odd", [3, 4], params(max_tokens=1), pooling=9)
