"""Greedy output equals Hugging Face `transformers` on the same weights (the oracle).

Eight prompts of 1 token to several blocks are submitted together, so every step mixes
prefills and decodes; block sizes 1, 16 and an odd 5 change every page table.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hetero_common.config import Config
from hetero_infer.engine import GenerationParams, InferenceEngine
from tests.helpers.oracle import NEW_TOKENS, engine_greedy, hf_greedy, make_prompts


@pytest.fixture(scope="module")
def llama_reference(tiny_llama_dir: Path) -> list[list[int]]:
    return hf_greedy(tiny_llama_dir, make_prompts())


@pytest.fixture(scope="module")
def qwen2_reference(tiny_qwen2_dir: Path) -> list[list[int]]:
    return hf_greedy(tiny_qwen2_dir, make_prompts())


@pytest.mark.parametrize("block_size", [1, 16, 5])
def test_llama_gqa_matches_transformers(tiny_llama_dir: Path, llama_reference, block_size: int) -> None:
    assert engine_greedy(tiny_llama_dir, make_prompts(), block_size=block_size) == llama_reference


@pytest.mark.parametrize("block_size", [1, 16, 5])
def test_qwen2_with_biases_matches_transformers(tiny_qwen2_dir: Path, qwen2_reference, block_size: int) -> None:
    assert engine_greedy(tiny_qwen2_dir, make_prompts(), block_size=block_size) == qwen2_reference


@pytest.mark.parametrize("max_total_tokens", [1, 7, 64])
def test_chunked_prefill_matches_transformers(tiny_llama_dir: Path, llama_reference, max_total_tokens: int) -> None:
    out = engine_greedy(tiny_llama_dir, make_prompts(), block_size=5, max_total_tokens=max_total_tokens)
    assert out == llama_reference


def test_small_pool_preempts_and_still_matches(tiny_llama_dir: Path, llama_reference) -> None:
    """12 blocks of 4 tokens cannot hold all eight sequences: recompute preemption kicks in."""
    config = Config(model=str(tiny_llama_dir), dtype="float32", block_size=4, max_num_blocks=20, memory_threshold=1.0).validate()
    engine = InferenceEngine(config)
    params = GenerationParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [engine.submit_request(p, params) for p in make_prompts()]
    done = {r.request_id: r for r in engine.run()}
    assert [done[i].output_token_ids for i in ids] == llama_reference
    assert engine.scheduler.num_preemptions > 0
    assert engine.get_memory_stats().used_blocks == 0
