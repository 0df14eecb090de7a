"""The scheduler's side of speculative decoding (scheduler_svc/speculation.py): who may carry drafts, how many,
and how a sequence's proposals adapt to what its drafts kept."""

from __future__ import annotations

from hetero.v1 import common_pb2
from hetero_common.config import Config
from hetero_common.sampling import resolve
from scheduler_svc.kv_cache_manager import KVCacheManager
from scheduler_svc.sequence import Sequence, SequenceStatus
from scheduler_svc.speculation import MAX_BACK_OFF, DraftState, Speculator, eligible
from scheduler_svc.ngram_proposer import NgramIndex

REPEATING = [5, 6, 7, 8] * 6  # every suffix has occurred before


def speculator(**overrides) -> Speculator:
    config = Config(speculative_method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, **overrides).validate()
    return Speculator(config, max_model_len=64)


def sequence(tokens: list[int], **params) -> Sequence:
    p = common_pb2.SamplingParams(**{"max_tokens": 32, "temperature": 0.0, **params})
    seq = Sequence(0, "r", list(tokens), len(tokens), resolve(p), p, speculative=True, status=SequenceStatus.DECODE)
    seq.num_computed = len(tokens) - 1
    return seq


def test_only_plain_greedy_samples_are_eligible() -> None:
    assert eligible(resolve(common_pb2.SamplingParams(temperature=0.0)))
    assert not eligible(resolve(common_pb2.SamplingParams(temperature=0.7)))
    assert not eligible(resolve(common_pb2.SamplingParams(temperature=0.0, logprobs=2)))
    assert not eligible(resolve(common_pb2.SamplingParams(temperature=0.0, presence_penalty=0.5)))


def test_drafts_stay_within_the_budget_max_tokens_and_the_free_blocks() -> None:
    spec, kv = speculator(), KVCacheManager(64, 4, False, cache_freed_blocks=False)
    assert spec.drafts(sequence(REPEATING), 10, kv) == [5, 6, 7, 8]
    assert spec.drafts(sequence(REPEATING), 2, kv) == [5, 6]  # the step's token budget
    assert spec.drafts(sequence(REPEATING, max_tokens=3), 10, kv) == [5, 6]  # 2 drafts + its own token: 3 tokens
    assert spec.drafts(sequence(REPEATING, max_tokens=1), 10, kv) == []
    assert spec.drafts(sequence(REPEATING), 10, KVCacheManager(1, 4, False, cache_freed_blocks=False)) == []
    assert spec.num_proposed == 4 + 2 + 2 and spec.num_drafted_rows == 3


def test_a_proposal_grows_back_one_per_success_and_failures_back_off() -> None:
    state = DraftState(NgramIndex(1, 2), max_drafts=4)
    state.kept(2, num_tokens=30, limit=4)
    assert state.max_drafts == 3 and state.resume_at == 0
    state.kept(3, num_tokens=34, limit=4)
    assert state.max_drafts == 4
    for misses in range(1, 9):
        state.kept(0, num_tokens=40, limit=4)
        assert state.max_drafts == 1 and state.resume_at == 40 + min(MAX_BACK_OFF, 2**misses)
    state.kept(1, num_tokens=200, limit=4)
    assert state.misses == 0 and state.max_drafts == 2


def test_a_backed_off_sequence_proposes_nothing_until_it_resumes() -> None:
    spec, kv = speculator(), KVCacheManager(64, 4, False, cache_freed_blocks=False)
    seq = sequence(REPEATING)
    assert spec.drafts(seq, 10, kv)
    assert seq.drafting is not None
    seq.drafting.kept(0, len(seq.token_ids), 4)
    assert spec.drafts(seq, 10, kv) == []
    seq.token_ids += [5, 6]  # two decodes later (2 = the first back-off)
    seq.num_computed = len(seq.token_ids) - 1
    assert spec.drafts(seq, 10, kv) == [7]
