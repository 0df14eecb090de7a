"""Speculative decoding with n-gram proposals (issue 40): greedy output equals `transformers`' on the same
weights, token for token, with drafts verified in the paged batch; a mixed batch (prefills, decodes with and
without drafts), odd block sizes, chunked prefill and preemption; no block left in use afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetero_common.config import Config
from hetero_infer.engine import GenerationParams, InferenceEngine
from tests.helpers.oracle import NEW_TOKENS, hf_greedy, make_prompts

NGRAM = {"speculative_method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def repetitive_prompts() -> list[list[int]]:
    """make_prompts' mix and two that repeat a span, so that lookups find long matches."""
    span = [11, 23, 5, 71, 42, 9, 88, 3]
    return make_prompts() + [span * 4, [7, 7, 7, 7, 7, 7]]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> list[list[int]]:
    return hf_greedy(tiny_llama_dir, repetitive_prompts())


def run(model_dir: Path, prompts: list[list[int]], **overrides) -> tuple[list[list[int]], InferenceEngine]:
    config = Config(model=str(model_dir), **{"dtype": "float32", **NGRAM, **overrides}).validate()
    engine = InferenceEngine(config)
    params = GenerationParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [engine.submit_request(p, params) for p in prompts]
    done = {r.request_id: r for r in engine.run()}
    assert engine.get_memory_stats().used_blocks == 0
    return [done[i].output_token_ids for i in ids], engine


@pytest.mark.parametrize("block_size", [16, 5, 1])
def test_ngram_speculation_matches_transformers(tiny_llama_dir: Path, reference, block_size: int) -> None:
    out, engine = run(tiny_llama_dir, repetitive_prompts(), block_size=block_size)
    assert out == reference
    speculator = engine.scheduler.speculator
    assert speculator is not None and speculator.num_proposed > 0 and speculator.num_accepted > 0


def test_with_chunked_prefill_and_a_small_token_budget(tiny_llama_dir: Path, reference) -> None:
    out, _ = run(tiny_llama_dir, repetitive_prompts(), block_size=5, max_total_tokens=7)
    assert out == reference


def test_with_preemption(tiny_llama_dir: Path, reference) -> None:
    out, engine = run(tiny_llama_dir, repetitive_prompts(), block_size=4, max_num_blocks=24, memory_threshold=1.0)
    assert out == reference
    assert engine.scheduler.num_preemptions > 0


def test_max_tokens_is_exact_when_drafts_could_overshoot(tiny_llama_dir: Path) -> None:
    config = Config(model=str(tiny_llama_dir), dtype="float32", **NGRAM).validate()
    engine = InferenceEngine(config)
    for max_tokens in (1, 2, 5):
        rid = engine.submit_request([7, 7, 7, 7, 7, 7], GenerationParams(max_tokens=max_tokens, temperature=0.0,
                                                                           ignore_eos=True))
        (done,) = [r for r in engine.run() if r.request_id == rid]
        assert len(done.output_token_ids) == max_tokens
    assert engine.get_memory_stats().used_blocks == 0


def sampled(model_dir: Path, prompts: list[list[int]], **overrides) -> tuple[list[list[int]], InferenceEngine]:
    """Seeded sampling with temperature, top-k and top-p, each prompt its own seed."""
    config = Config(model=str(model_dir), **{"dtype": "float32", **overrides}).validate()
    engine = InferenceEngine(config)
    ids = [engine.submit_request(p, GenerationParams(max_tokens=NEW_TOKENS, temperature=0.3, top_k=40, top_p=0.95,
                                                     seed=100 + i, ignore_eos=True)) for i, p in enumerate(prompts)]
    done = {r.request_id: r for r in engine.run()}
    assert engine.get_memory_stats().used_blocks == 0
    return [done[i].output_token_ids for i in ids], engine


def test_seeded_sampling_gives_the_same_tokens_with_drafts(tiny_llama_dir: Path) -> None:
    """Each row samples the token of its own output index with that index's seeded noise: a kept draft is the
    token sampling would have drawn, so a seeded request's output does not depend on the drafts."""
    plain, _ = sampled(tiny_llama_dir, repetitive_prompts(), block_size=5)
    drafted, engine = sampled(tiny_llama_dir, repetitive_prompts(), block_size=5, **NGRAM)
    assert drafted == plain
    speculator = engine.scheduler.speculator
    assert speculator is not None and speculator.num_accepted > 0


def test_logits_controls_see_each_positions_own_history(tiny_llama_dir: Path) -> None:
    """Penalties, logit_bias and min_tokens with drafts: row j of a drafted decode is controlled as if the
    drafts before it were generated, so outputs equal those without speculation. (Lookup drafts come from the
    sequence's own tokens, so a run of kept drafts rarely changes a penalty here; the rows' own histories are
    pinned by tests/unit/gpu_worker/test_draft_rows.py.)"""
    variants = [dict(frequency_penalty=0.3, presence_penalty=0.1), dict(repetition_penalty=1.1),
                dict(logit_bias={7: 2.0, 11: -5.0}), dict(min_tokens=8, stop_token_ids=[23, 5])]

    def outputs(**overrides) -> tuple[list[list[int]], InferenceEngine]:
        engine = InferenceEngine(Config(model=str(tiny_llama_dir), dtype="float32", block_size=5, **overrides).validate())
        ids = [engine.submit_request(p, GenerationParams(max_tokens=40, temperature=0.0, **variants[i % 4]))
               for i, p in enumerate(repetitive_prompts())]
        done = {r.request_id: r for r in engine.run()}
        assert engine.get_memory_stats().used_blocks == 0
        return [done[i].output_token_ids for i in ids], engine

    plain, _ = outputs()
    drafted, engine = outputs(**NGRAM)
    assert drafted == plain
    speculator = engine.scheduler.speculator
    assert speculator is not None and speculator.num_accepted > 0
