"""Speculative decoding with a draft model (`speculative_method: draft`, issue 40): greedy outputs equal
`transformers`' on the served weights, token for token, whatever the draft proposes: the served model as its
own draft (every draft kept: the draft's K/V, kept in the served model's blocks, follows every sequence), a
noisy copy (some kept, some not) and random weights (none kept); with chunked prefill, preemption by
recompute and by swap, seeded sampling; no block left in use afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetero_common.config import Config
from hetero_common.errors import ConfigError
from hetero_infer.engine import GenerationParams, InferenceEngine
from hetero_infer.bench.harness import make_tiny_llama
from tests.helpers.tiny_models import make_noisy_copy
from tests.helpers.oracle import NEW_TOKENS, hf_greedy
from tests.model.test_speculative_decoding import repetitive_prompts, sampled

# Always proposing: these tests are about outputs and the draft's K/V, whatever drafting costs on this machine.
DRAFT = {"speculative_method": "draft", "num_speculative_tokens": 3, "speculative_adaptive": False}
PREEMPTING = {"block_size": 4, "max_num_blocks": 24, "memory_threshold": 1.0}


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> list[list[int]]:
    return hf_greedy(tiny_llama_dir, repetitive_prompts())


@pytest.fixture(scope="module")
def noisy_draft(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_noisy_copy(tiny_llama_dir, tmp_path_factory.mktemp("noisy-draft"), noise=0.2)


def run(model_dir: Path, draft: Path, **overrides) -> tuple[list[list[int]], InferenceEngine]:
    config = Config(model=str(model_dir), **{"dtype": "float32", **DRAFT, "speculative_model": str(draft),
                                             **overrides}).validate()
    engine = InferenceEngine(config)
    params = GenerationParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [engine.submit_request(p, params) for p in repetitive_prompts()]
    done = {r.request_id: r for r in engine.run()}
    assert engine.get_memory_stats().used_blocks == 0
    return [done[i].output_token_ids for i in ids], engine


@pytest.mark.parametrize("overrides", [dict(block_size=16), dict(block_size=1), dict(block_size=5, max_total_tokens=7),
                                       dict(PREEMPTING, preemption_mode="swap")],
                         ids=["blocks-16", "blocks-1", "chunked-prefill", "swap"])
def test_the_served_model_as_its_own_draft_keeps_every_draft(tiny_llama_dir: Path, reference, overrides) -> None:
    """Its proposals are the served model's own greedy tokens only if its K/V is right at every position:
    after prompt chunks, kept drafts, and a swap (its K/V recomputed from the tokens)."""
    out, engine = run(tiny_llama_dir, tiny_llama_dir, **overrides)
    assert out == reference
    speculator = engine.scheduler.speculator
    assert speculator is not None and speculator.num_proposed > 40
    assert speculator.num_accepted == speculator.num_proposed
    if "preemption_mode" in overrides:
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_noisy_draft_gives_the_served_models_outputs_under_preemption(tiny_llama_dir: Path, reference,
                                                                         noisy_draft: Path, mode: str) -> None:
    out, engine = run(tiny_llama_dir, noisy_draft, preemption_mode=mode, **PREEMPTING)
    assert out == reference
    speculator = engine.scheduler.speculator
    assert speculator is not None and 0 < speculator.num_accepted < speculator.num_proposed
    assert engine.scheduler.num_preemptions > 0


def test_a_draft_with_random_weights_changes_nothing_and_stops_proposing(tiny_llama_dir: Path, reference,
                                                     tmp_path_factory: pytest.TempPathFactory) -> None:
    garbage = make_tiny_llama(tmp_path_factory.mktemp("garbage-draft"), seed=7)
    out, engine = run(tiny_llama_dir, garbage, block_size=5, speculative_adaptive=True)
    assert out == reference
    speculator = engine.scheduler.speculator
    assert speculator is not None and 0 < speculator.num_proposed < 40  # adaptive: misses back off


def test_seeded_sampling_gives_the_same_tokens_with_a_draft_model(tiny_llama_dir: Path, noisy_draft: Path) -> None:
    plain, _ = sampled(tiny_llama_dir, repetitive_prompts(), block_size=5)
    drafted, engine = sampled(tiny_llama_dir, repetitive_prompts(), block_size=5, **DRAFT,
                              speculative_model=str(noisy_draft))
    assert drafted == plain
    speculator = engine.scheduler.speculator
    assert speculator is not None and speculator.num_accepted > 0


def test_a_draft_model_that_is_missing_is_a_config_error(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="speculative_model"):
        Config(model=str(tiny_llama_dir), speculative_method="draft").validate()
    with pytest.raises(ConfigError, match="speculative_model"):
        Config(model=str(tiny_llama_dir), speculative_model=str(tiny_llama_dir)).validate()
    with pytest.raises(ConfigError, match="'speculative_model' = .*no such file"):
        InferenceEngine(Config(model=str(tiny_llama_dir), **DRAFT, speculative_model=str(tmp_path / "none")).validate())


@pytest.mark.parametrize("mode", ["persist", "offload", "recompute"])
def test_the_draft_keeps_every_draft_across_a_suspend(tiny_llama_dir: Path, reference, mode: str) -> None:
    """`offload` and `recompute` drop the draft's K/V: after the resume it is recomputed from the tokens, so
    the served model as its own draft still keeps every draft."""
    config = Config(model=str(tiny_llama_dir), dtype="float32", **DRAFT, speculative_model=str(tiny_llama_dir),
                    block_size=4).validate()
    engine = InferenceEngine(config)
    params = GenerationParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [engine.submit_request(p, params) for p in repetitive_prompts()]
    done = {}
    for _ in range(4):
        done.update({r.request_id: r for r in engine.step()})
    assert (engine.suspend(mode) > 0) == (mode != "persist")
    engine.resume()
    done.update({r.request_id: r for r in engine.run()})
    assert [done[i].output_token_ids for i in ids] == reference
    speculator = engine.scheduler.speculator
    assert speculator is not None and speculator.num_proposed > 40
    assert speculator.num_accepted == speculator.num_proposed
    assert engine.get_memory_stats().used_blocks == 0
