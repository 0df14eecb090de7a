"""The default dtype's promise on CPUs with AVX512-BF16 (issue 38): in bfloat16 with `deterministic`
(the default), preemption by recompute and by swap, and chunk budgets that split prompts elsewhere,
give token for token the streams of an undisturbed run, greedy and seeded (temperature 1.0). A
recompute computes the generated tokens' K/V in a prompt chunk where the undisturbed run computed
them one decode row at a time; that chunk takes the attention kernel's 16-row tiles, whose arithmetic is the
per-row path's (kernels/native/attention_order.h).

Where the C kernels do not take every row (no AVX512-BF16), bfloat16 is not the default dtype and
nothing here applies: skipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_worker.cpu.worker_setup import row_invariance_unavailable
from hetero_common.config import Config
from hetero_infer.engine import GenerationParams, InferenceEngine
from hetero_infer.bench.harness import make_random_llama
from tests.helpers.oracle import make_prompts

pytestmark = pytest.mark.skipif(row_invariance_unavailable(64, 16) is not None,
                                reason=f"bfloat16 rows are not invariant here: {row_invariance_unavailable(64, 16)}")

NEW_TOKENS = 40
GREEDY = GenerationParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
SEEDED = GenerationParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=7, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Head size 64, the C attention kernel's; weights large enough (scale 0.3) that greedy choices are not ties."""
    return make_random_llama(tmp_path_factory.mktemp("llama-d64"), hidden=256, intermediate=512, layers=3, heads=4,
                             kv_heads=2, max_position_embeddings=1024, scale=0.3, seed=5)


def prompts() -> list[list[int]]:
    return [p for seed in (0, 1) for p in make_prompts(seed=seed)]


def engine(model_dir: Path, **overrides) -> InferenceEngine:
    return InferenceEngine(Config(model=str(model_dir), **{"dtype": "bfloat16", "block_size": 16, **overrides}).validate())


def run_all(eng: InferenceEngine, params: GenerationParams) -> list[list[int]]:
    ids = [eng.submit_request(p, params) for p in prompts()]
    done = {r.request_id: r for r in eng.run()}
    assert eng.get_memory_stats().used_blocks == 0
    return [done[i].output_token_ids for i in ids]


@pytest.fixture(scope="module")
def undisturbed(model_dir: Path) -> dict[str, list[list[int]]]:
    eng = engine(model_dir)
    return {"greedy": run_all(eng, GREEDY), "seeded": run_all(eng, SEEDED)}


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_streams_continue_as_undisturbed_ones(model_dir: Path, undisturbed, mode: str, sampling: str) -> None:
    eng = engine(model_dir, max_num_blocks=12, memory_threshold=1.0, preemption_mode=mode)
    assert run_all(eng, GREEDY if sampling == "greedy" else SEEDED) == undisturbed[sampling]
    assert eng.scheduler.num_preemptions > 0
    if mode == "swap":
        assert eng.scheduler.num_swap_outs > 0 and not eng.runner.swapped


@pytest.mark.parametrize("max_total_tokens", [7, 17, 64])
def test_chunk_budgets_give_the_same_streams(model_dir: Path, undisturbed, max_total_tokens: int) -> None:
    eng = engine(model_dir, max_total_tokens=max_total_tokens, max_prefill_chunk_tokens=max_total_tokens)
    assert run_all(eng, GREEDY) == undisturbed["greedy"]

