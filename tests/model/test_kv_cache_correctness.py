"""KV cache depth against the oracle: greedy output equals `transformers` on the same weights
with the prefix cache (off, ref_zero, lru), prefill chunk caps, preemption by recompute and by
swap, n = 3 copy-on-write samples, and a suspend/resume in each mode in the middle of decoding.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hetero_common.config import Config
from hetero_infer.engine import GenerationParams, InferenceEngine
from tests.helpers.oracle import NEW_TOKENS, hf_greedy, make_prompts

GREEDY = GenerationParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def shared_prefix_prompts() -> list[list[int]]:
    """The standard eight prompts, plus four that share a 23-token prefix (several full blocks)."""
    prompts = make_prompts()
    prefix = make_prompts(seed=5)[-1][:23]
    return prompts + [prefix + tail[:k] for tail, k in zip(make_prompts(seed=6)[3:7], (1, 4, 9, 16))]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> list[list[int]]:
    return hf_greedy(tiny_llama_dir, shared_prefix_prompts())


def engine(model_dir: Path, **overrides) -> InferenceEngine:
    return InferenceEngine(Config(model=str(model_dir), **{"dtype": "float32", **overrides}).validate())


def run_all(eng: InferenceEngine, prompts: list[list[int]], params: GenerationParams = GREEDY) -> list[list[int]]:
    ids = [eng.submit_request(p, params) for p in prompts]
    done = {r.request_id: r for r in eng.run()}
    return [done[i].output_token_ids for i in ids]


@pytest.mark.parametrize("caching", ["off", "ref_zero", "lru"])
def test_prefix_caching_matches_transformers(tiny_llama_dir: Path, reference, caching: str) -> None:
    eng = engine(tiny_llama_dir, block_size=4, enable_prefix_caching=caching != "off",
                 prefix_caching_eviction_policy="lru" if caching == "off" else caching)
    prompts = shared_prefix_prompts()
    assert run_all(eng, prompts) == reference
    first_hits = eng.get_memory_stats().prefix_cache_hits
    if caching == "ref_zero":
        # Blocks leave the cache with their last user: a second pass hits only while the first still runs.
        ids = [eng.submit_request(p, GREEDY) for p in prompts]
        eng.step()
        ids2 = [eng.submit_request(p, GREEDY) for p in prompts]
        done = {r.request_id: r for r in eng.run()}
        assert [done[i].output_token_ids for i in ids] == reference
        assert [done[i].output_token_ids for i in ids2] == reference
    else:
        if caching == "lru":
            assert eng.get_memory_stats().cached_blocks > 0  # freed blocks stay cached
        assert run_all(eng, prompts) == reference
    stats = eng.get_memory_stats()
    assert stats.used_blocks == 0
    if caching == "off":
        assert stats.prefix_cache_hits == 0 and stats.cached_blocks == 0
    else:
        assert stats.prefix_cache_hits > first_hits  # the second pass hit the cache
        assert stats.prefix_cache_hits <= stats.prefix_cache_queries


def test_cached_prompt_tokens_reported_on_results(tiny_llama_dir: Path, reference) -> None:
    eng = engine(tiny_llama_dir, block_size=4)
    prompt = shared_prefix_prompts()[-1]
    eng.submit_request(prompt, GREEDY)
    (first,) = eng.run()
    eng.submit_request(prompt, GREEDY)
    (second,) = eng.run()
    assert first.cached_prompt_tokens == 0
    assert second.cached_prompt_tokens == (len(prompt) - 1) // 4 * 4  # the last token is always computed
    assert second.output_token_ids == first.output_token_ids == reference[-1]


@pytest.mark.parametrize("max_total_tokens", [1, 7, 64])
def test_chunk_budgets_with_prefix_cache_match(tiny_llama_dir: Path, reference, max_total_tokens: int) -> None:
    eng = engine(tiny_llama_dir, block_size=5, max_total_tokens=max_total_tokens, max_prefill_chunk_tokens=6)
    assert run_all(eng, shared_prefix_prompts()) == reference
    assert eng.get_memory_stats().used_blocks == 0


@pytest.mark.parametrize("mode", ["recompute", "swap", "offload"])
def test_small_pool_preempts_in_each_mode_and_matches(tiny_llama_dir: Path, reference, mode: str) -> None:
    eng = engine(tiny_llama_dir, block_size=4, max_num_blocks=24, memory_threshold=1.0, preemption_mode=mode)
    assert run_all(eng, shared_prefix_prompts()) == reference
    assert eng.scheduler.num_preemptions > 0
    if mode != "recompute":
        assert eng.scheduler.num_swap_outs > 0 and not eng.runner.swapped
    assert eng.get_memory_stats().used_blocks == 0


@pytest.mark.parametrize("block_size", [5, 16])
def test_n3_greedy_samples_are_identical_and_match(tiny_llama_dir: Path, reference, block_size: int) -> None:
    eng = engine(tiny_llama_dir, block_size=block_size)
    prompts = shared_prefix_prompts()
    params = GenerationParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, n=3)
    ids = [eng.submit_request(p, params) for p in prompts]
    samples: dict[str, dict[int, list[int]]] = {}
    for r in eng.run():
        samples.setdefault(r.request_id, {})[r.index] = r.output_token_ids
    for rid, ref in zip(ids, reference):
        assert samples[rid] == {0: ref, 1: ref, 2: ref}
    assert eng.get_memory_stats().used_blocks == 0


def test_n3_shares_prompt_blocks_and_copies_on_write(tiny_llama_dir: Path, reference) -> None:
    eng = engine(tiny_llama_dir, block_size=4, enable_prefix_caching=False)
    prompt = shared_prefix_prompts()[-1]  # 39 tokens: 9 full blocks and a partly filled one
    eng.submit_request(prompt, GenerationParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, n=3))
    eng.step()  # the prompt; sample 0 forks samples 1 and 2
    assert eng.get_memory_stats().used_blocks == 10  # shared by reference, nothing copied yet
    results = eng.step()
    # Each new sample copied the partly filled tail block before writing into it; the 9 full blocks stay shared.
    assert eng.get_memory_stats().used_blocks == 12
    tables = [eng.scheduler.kv_cache.table(s) for s in eng.scheduler.samples["engine-0"]]
    assert all(t[:9] == tables[0][:9] for t in tables) and len({t[9] for t in tables}) == 3
    assert all(eng.scheduler.kv_cache.pool.ref_counts[b] == 3 for b in tables[0][:9])
    results += eng.run()
    assert len(results) == 3 and all(r.output_token_ids == reference[-1] for r in results)


@pytest.mark.parametrize("mode", ["persist", "offload", "recompute"])
def test_suspend_resume_mid_decode_matches(tiny_llama_dir: Path, reference, mode: str) -> None:
    eng = engine(tiny_llama_dir, block_size=4)
    prompts = shared_prefix_prompts()
    ids = [eng.submit_request(p, GREEDY) for p in prompts]
    done = {}
    for _ in range(4):
        done.update({r.request_id: r for r in eng.step()})
    released = eng.suspend(mode)
    assert (released > 0) == (mode != "persist")
    assert not eng.has_pending_work() and eng.step() == []
    if mode == "recompute":
        assert eng.get_memory_stats().used_blocks == 0 and len(eng.scheduler.waiting) == len(prompts)
    eng.resume()
    done.update({r.request_id: r for r in eng.run()})
    assert [done[i].output_token_ids for i in ids] == reference
    assert eng.get_memory_stats().used_blocks == 0


def test_qwen2_everything_at_once_matches(tiny_qwen2_dir: Path) -> None:
    """Qwen2 (q/k/v biases): lru cache hits, a chunk cap, swap preemption and n = 2, together."""
    prompts = shared_prefix_prompts()
    ref = hf_greedy(tiny_qwen2_dir, prompts)
    eng = engine(tiny_qwen2_dir, block_size=4, max_num_blocks=40, memory_threshold=1.0, preemption_mode="swap",
                 max_prefill_chunk_tokens=8)
    params = GenerationParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, n=2)
    for _ in range(2):  # the second pass hits the cache left by the first
        ids = [eng.submit_request(p, params) for p in prompts]
        samples: dict[str, dict[int, list[int]]] = {}
        for r in eng.run():
            samples.setdefault(r.request_id, {})[r.index] = r.output_token_ids
        assert [samples[i] for i in ids] == [{0: r, 1: r} for r in ref]
    stats = eng.get_memory_stats()
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0 and stats.used_blocks == 0


def test_swap_in_alone_reaches_the_worker_and_the_pool_caps_the_length(tiny_llama_dir: Path) -> None:
    """A step whose only work is a swap-in must still be sent: the K/V and block table arrive with it.

    Three blocks of 4 tokens: both 4-token prompts fit; at the first decode the newer one needs a
    block that is not there and swaps itself out; the older one finishes; the next step has
    nothing to compute, only the swap-in. The survivor then stops at the pool's 12 tokens
    (finish reason length) instead of preempting itself forever."""
    prompts = [p[:4] for p in make_prompts()[2:4]]
    reference = hf_greedy(tiny_llama_dir, prompts, new_tokens=10)
    eng = engine(tiny_llama_dir, block_size=4, max_num_blocks=3, memory_threshold=1.0, preemption_mode="swap",
                 enable_prefix_caching=False)
    assert eng.scheduler.max_model_len == 12
    first = eng.submit_request(prompts[0], GenerationParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    second = eng.submit_request(prompts[1], GenerationParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    done = {r.request_id: r for r in eng.run()}
    assert eng.scheduler.num_swap_outs > 0
    assert done[first].output_token_ids == reference[0][:2]
    assert done[second].output_token_ids == reference[1][:8] and done[second].finish_reason == "length"
    assert eng.get_memory_stats().used_blocks == 0
