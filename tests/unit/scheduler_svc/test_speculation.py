"""The scheduler's side of speculative decoding (scheduler_svc/speculation/speculation.py): who may carry drafts,
how many, and how a sequence's proposals adapt to what its drafts kept."""

from __future__ import annotations

import itertools

from hetero.v1 import common_pb2
from hetero_common.config import Config
from hetero_common.sampling import resolve
from scheduler_svc.kv.kv_cache_manager import KVCacheManager
from scheduler_svc.sequence import Sequence, SequenceStatus
from scheduler_svc.speculation.draft_state import MAX_BACK_OFF, DraftState
from scheduler_svc.speculation.ngram_proposer import NgramIndex
from scheduler_svc.speculation.speculation import Speculator
from scheduler_svc.speculation.step_cost import StepCostModel

REPEATING = [5, 6, 7, 8] * 6  # every suffix has occurred before


def speculator(**overrides) -> Speculator:
    settings = {"speculative_method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, **overrides}
    config = Config(**settings).validate()
    return Speculator(config, max_model_len=64)


SEQ_IDS = itertools.count()


def sequence(tokens: list[int], speculative: bool = True, **params) -> Sequence:
    """A decoding sequence of its own seq id (the speculator keeps each one's drafting state by it)."""
    p = common_pb2.SamplingParams(**{"max_tokens": 32, "temperature": 0.0, **params})
    return Sequence.new(next(SEQ_IDS), "r", list(tokens), len(tokens), resolve(p), p, status=SequenceStatus.DECODE,
                        num_computed=len(tokens) - 1, speculative=speculative)


def test_drafts_stay_within_the_budget_max_tokens_and_the_free_blocks() -> None:
    spec, kv = speculator(), KVCacheManager(64, 4, False, cache_freed_blocks=False)
    assert spec.drafts(sequence(REPEATING), 10, kv)[0] == [5, 6, 7, 8]
    assert spec.drafts(sequence(REPEATING), 2, kv)[0] == [5, 6]  # the step's token budget
    assert spec.drafts(sequence(REPEATING, max_tokens=3), 10, kv)[0] == [5, 6]  # 2 drafts + its own token: 3 tokens
    assert spec.drafts(sequence(REPEATING, max_tokens=1), 10, kv)[0] == []
    assert spec.drafts(sequence(REPEATING), 10, KVCacheManager(1, 4, False, cache_freed_blocks=False)) == ([], 0)
    assert spec.num_proposed == 4 + 2 + 2 and spec.num_drafted_rows == 3


def test_a_draft_model_is_asked_for_as_many_drafts_under_the_same_bounds() -> None:
    spec = speculator(speculative_method="draft", speculative_model="unused", speculative_adaptive=False)
    kv = KVCacheManager(64, 4, False, cache_freed_blocks=False)
    no_repeats = list(range(30))  # nothing to look up: the draft model proposes anyway
    assert spec.drafts(sequence(no_repeats), 10, kv) == ([], 4)
    assert spec.drafts(sequence(no_repeats), 2, kv) == ([], 2)
    assert spec.drafts(sequence(no_repeats, max_tokens=3), 10, kv) == ([], 2)
    assert spec.drafts(sequence(no_repeats, max_tokens=1), 10, kv) == ([], 0)
    assert spec.drafts(sequence(no_repeats), 10, KVCacheManager(1, 4, False, cache_freed_blocks=False)) == ([], 0)
    assert spec.num_proposed == 4 + 2 + 2 and spec.wants_drafts([sequence(no_repeats)])


def test_a_draft_model_probes_with_one_sequence_a_step_until_its_cost_is_measured() -> None:
    spec = speculator(speculative_method="draft", speculative_model="unused")
    kv = KVCacheManager(64, 4, False, cache_freed_blocks=False)
    assert spec.drafts(sequence(list(range(30))), 10, kv) == ([], 4)
    assert spec.drafts(sequence(list(range(30))), 10, kv) == ([], 0)  # the same step
    spec.planned(1, 10, num_running=2)
    assert spec.drafts(sequence(list(range(30))), 10, kv) == ([], 4)  # the next one


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
    assert spec.drafts(seq, 10, kv)[0]
    assert spec.state_of(seq) is not None
    spec.state_of(seq).kept(0, len(seq.token_ids), 4)
    assert spec.drafts(seq, 10, kv)[0] == []
    seq.token_ids += [5, 6]  # two decodes later (2 = the first back-off)
    seq.num_computed = len(seq.token_ids) - 1
    assert spec.drafts(seq, 10, kv)[0] == [7]


def test_the_step_cost_fit_and_the_acceptance_a_batch_needs() -> None:
    cost = StepCostModel()
    assert cost.threshold() == 0.0  # not fitted: drafts are tried
    for step, tokens in enumerate([1, 4, 8, 16, 32, 64, 3, 40]):  # t = 10 ms + 1 ms per token
        cost.planned(step, tokens, num_running=1)
        cost.observe(step, 0.010 + 0.001 * tokens)
    assert abs(cost.a - 0.010) < 1e-9 and abs(cost.b - 0.001) < 1e-9
    assert abs(cost.threshold() - 1 / 11) < 1e-9  # batch 1: a draft pays when over 9% of them are kept
    cost.planned(99, 64, num_running=90)
    assert abs(cost.threshold() - 0.9) < 1e-9  # batch 90: only when over 90% are
    cost.observe(12345, 1.0)  # a step never planned here: ignored
    assert abs(cost.b - 0.001) < 1e-9


def test_a_draft_models_time_raises_the_acceptance_drafts_need() -> None:
    """Its seconds are left out of the fit, and those of proposing (not catching up) counted per draft token:
    (b + d) * B / (a + b * B)."""
    cost = StepCostModel()
    for step, tokens in enumerate([1, 4, 8, 16, 32, 64, 3, 40]):  # each step also drafted 4 tokens in 2 ms
        cost.planned(step, tokens, num_running=1)
        cost.observe(step, 0.010 + 0.001 * tokens + 0.003, draft_seconds=0.003, proposal_seconds=0.002, model_drafts=4)
    assert abs(cost.a - 0.010) < 1e-9 and abs(cost.b - 0.001) < 1e-9
    assert abs(cost.draft_per_token - 0.0005) < 1e-5
    assert abs(cost.threshold() - 0.0015 / 0.011) < 1e-4  # more than the 1 / 11 a free proposer needs


def test_a_sequence_below_the_steps_threshold_proposes_nothing() -> None:
    spec, kv = speculator(), KVCacheManager(64, 4, False, cache_freed_blocks=False)
    seq = sequence(REPEATING)
    assert spec.drafts(seq, 10, kv)[0]
    assert spec.state_of(seq) is not None
    spec.state_of(seq).kept(1, len(seq.token_ids), 4)  # 1 of 4 kept: acceptance (1 + 0.25) / 2
    assert abs(spec.state_of(seq).acceptance - 0.625) < 1e-9
    for step, tokens in enumerate([1, 8, 64, 16]):
        spec.planned(step, tokens, num_running=60)
        spec.cost.observe(step, 0.010 + 0.001 * tokens)  # batch 60: 60 / 70 of a step grows with its tokens
    assert spec.drafts(seq, 10, kv)[0] == []


def test_a_step_is_not_planned_ahead_of_while_a_running_decode_has_a_lookup_match() -> None:
    spec = speculator()
    repeating, fresh = sequence(REPEATING), sequence([1, 2, 3, 4, 5, 6])
    assert spec.wants_drafts([fresh, repeating]) and not spec.wants_drafts([fresh])
    repeating.awaiting_token = True  # planned ahead already: its last token is a placeholder
    assert not spec.wants_drafts([repeating])
    plain = sequence(REPEATING, speculative=False)
    assert not spec.wants_drafts([plain])


def test_a_sequence_whose_drafted_step_was_lost_gets_its_recomputed_token() -> None:
    """Its draft state still says "drafted at this length" when its recompute samples at that length, in a
    step where another decode carries drafts: the token is read as a plain row's, not dropped."""
    from tests.helpers.scheduler_driver import answer, make, params

    settings = dict(speculative_method="draft", speculative_model="unused", speculative_adaptive=False,
                    num_speculative_tokens=3, async_scheduling=False)
    lost, survivor = make(**settings), make(**settings)
    lost.add_request("s", [1, 2, 3], params(max_tokens=10))
    lost.process_result(answer(lost.schedule()))
    assert lost.schedule().scheduled[0].num_draft_model_tokens == 3  # in flight when its worker dies
    (moved,) = lost.take_all_for_recompute()
    survivor.add_request("t", [4, 5, 6], params(max_tokens=10))
    survivor.process_result(answer(survivor.schedule()))
    survivor.adopt(moved)
    plan = survivor.schedule()
    asked = {s.seq_id: s.num_draft_model_tokens for s in plan.scheduled}
    assert asked[moved.seq_id] == 0 and max(asked.values()) == 3
    result = answer(plan)
    result.num_accepted_drafts.extend(0 for _ in result.seq_ids)
    outputs = {o.request_id: list(o.token_ids) for o in survivor.process_result(result)}
    assert outputs["s"] == [7] and moved.token_ids == [1, 2, 3, 7, 7]


def test_with_a_draft_model_new_sequences_start_from_what_recent_drafts_kept() -> None:
    from hetero.v1 import worker_pb2
    from scheduler_svc.speculation.speculation import EXPLORE

    spec = speculator(speculative_method="draft", speculative_model="unused")
    kv = KVCacheManager(64, 4, False, cache_freed_blocks=False)
    first = sequence(list(range(30)))
    assert spec.drafts(first, 10, kv) == ([], 4)  # the first one explores
    kv.add(first)  # the KV manager knows every sequence it is asked about (a scheduler adds each)
    spec.settle([first], 0, kv, worker_pb2.StepResult())  # and keeps none of them
    assert spec.acceptance == 0.8
    starts = []
    for _ in range(EXPLORE):
        seq = sequence(list(range(30)))
        spec.drafts(seq, 10, kv)
        starts.append(spec.state_of(seq).acceptance)
    assert starts.count(1.0) == 1 and all(a == 0.8 for a in starts if a != 1.0)
