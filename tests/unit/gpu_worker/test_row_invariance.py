"""Row invariance in bfloat16 on the CPU's C kernels (config `deterministic`, issue 38): one token's
K/V in every layer and its logits are the same bits whether it is computed alone as a decode, in a
decode batch of 7, in a 16-row or a 100-row prompt chunk, or after a chunk boundary at 1, 15, 16, 17
or 255 tokens, and also as a row in the middle of a chunk; with the attention kernel's 16-row tiles for
chunks of 8+ rows (as the worker runs) and without them.

Where the C kernels do not take every row (no AVX512-BF16), bfloat16 is not the default dtype and
nothing here applies: skipped."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker.cpu.worker_setup import row_invariance_unavailable
from gpu_worker.models.checkpoint import load_checkpoint
from gpu_worker.models.model import LlamaModel
from hetero_infer.bench.harness import make_random_llama
from kernels.attention_backend import create_attention_backend
from kernels.cache_ops import allocate_kv_cache, int8_rows
from kernels.native import linear_gguf
from kernels.page_table import PageTable
from tests.helpers.tiny_models import make_head64_qwen3_moe

BLOCK = 16
TARGET = 255  # the position whose K/V and logits are compared
OTHERS = 6  # decoding sequences beside it in "a batch of 7"

pytestmark = pytest.mark.skipif(row_invariance_unavailable(64, BLOCK) is not None,
                                reason=f"bfloat16 rows are not invariant here: {row_invariance_unavailable(64, BLOCK)}")


@pytest.fixture(scope="module", params=["bfloat16", "int8", "moe", "moe-int8"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    """Head size 64 (the vectorized attention's), 3 layers: what the worker builds on such a CPU; also with
    `quantization: int8`'s weights (the GGUF kernel's products, where it runs), and a mixture of experts (a
    Qwen3-MoE: its experts' products over each expert's group of tokens, layer by layer)."""
    int8 = request.param.endswith("int8")
    if int8 and not linear_gguf.supported(linear_gguf.Q8_0, 16, 32):
        pytest.skip("the GGUF kernel does not run here (AVX512-VNNI)")
    if request.param.startswith("moe"):
        directory = make_head64_qwen3_moe(tmp_path_factory.mktemp("qwen3-moe-d64"))
    else:
        directory = make_random_llama(tmp_path_factory.mktemp("llama-d64"), hidden=256, intermediate=512, layers=3,
                                      heads=4, kv_heads=2, max_position_embeddings=1024, seed=3)
    config, weights = load_checkpoint(directory)
    built = LlamaModel(config, weights, torch.device("cpu"), torch.bfloat16, max_positions=1024, prepack=True,
                       native_linear=True, fused=True, int8_weights=int8)
    # every layer in one C call, as the worker runs a dense model here; a mixture of experts layer by layer
    assert (built.c_layers is None) == (config.moe is not None)
    return built


def compute(model: LlamaModel, chunks: list[int], tiles: bool, others: int = 0,
            row: int | None = None, seed: int = 0, kv_dtype: torch.dtype = torch.bfloat16
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed one sequence's tokens in steps of `chunks` rows (each step may carry `others` sequences decoding
    beside it) into a cache of `kv_dtype`; the logits of position `row` (default TARGET, which the last chunk
    must hold) and every layer's K/V at TARGET (as bytes: an fp8 or int8 cache's rows)."""
    row = TARGET if row is None else row
    torch.manual_seed(0)
    tokens = torch.randint(2, 500, (sum(chunks),)).tolist()
    if seed:  # one token of the prompt changed, far from the target
        tokens[seed] = tokens[seed] % 499 + 2
    c = model.config
    attention = create_attention_backend("torch", model.num_heads, model.num_kv_heads, c.head_dim, "cpu",
                                         torch.bfloat16, decode_kernel="c", prompt_tiles=tiles)
    cache = allocate_kv_cache(c.num_hidden_layers, 64 + 4 * others, BLOCK, model.num_kv_heads, c.head_dim,
                              kv_dtype, "cpu", attention.kv_layout)
    own = np.arange(0, 64, dtype=np.int32)
    done, logits = 0, None
    with torch.inference_mode():
        for n in chunks:
            tables, qo_lens, kv_lens, ids = [own], [n], [done + n], tokens[done:done + n]
            for o in range(others):  # 40 tokens each, the last one decoding
                tables.append(np.arange(64 + 4 * o, 68 + 4 * o, dtype=np.int32))
                qo_lens.append(1), kv_lens.append(40), ids.append(7 + o)
            table = PageTable.build(tables, np.array(qo_lens), np.array(kv_lens), BLOCK)
            attention.plan(table)
            positions, slots = table.token_positions()
            if done <= row < done + n:
                logits = model.forward(torch.tensor(ids), torch.from_numpy(positions), torch.from_numpy(slots),
                                       cache, attention, torch.tensor([row - done]))[0].clone()
            else:
                model.forward(torch.tensor(ids), torch.from_numpy(positions), torch.from_numpy(slots), cache,
                              attention, torch.tensor([n - 1]))
            done += n
    assert logits is not None
    block = cache[:, TARGET // BLOCK]  # [layers, 2, kv heads, BLOCK, row]
    if kv_dtype == torch.int8:  # the row's values and scale, in the group layout
        values, scales = int8_rows(block, c.head_dim)
        g, j = divmod(TARGET % BLOCK, 16)
        return logits, torch.cat([values[..., g, j, :], scales[..., g, j, None].view(torch.int8)], dim=-1).clone()
    return logits, block[..., TARGET % BLOCK, :].view(torch.uint8).clone()


def same_bits(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


WAYS = {
    "alone, as a decode": [TARGET, 1],
    "in a 16-row chunk": [TARGET + 1 - 16, 16],
    "in a 100-row chunk": [TARGET + 1 - 100, 100],
    "after a boundary at 1": [1, TARGET],
    "after a boundary at 15": [15, TARGET + 1 - 15],
    "after a boundary at 16": [16, TARGET + 1 - 16],
    "after a boundary at 17": [17, TARGET + 1 - 17],
    "in one chunk of the whole prompt": [TARGET + 1],
}


@pytest.mark.parametrize("tiles", [True, False], ids=["tiles", "per-row"])
def test_a_tokens_kv_and_logits_do_not_depend_on_the_path_that_computed_it(model: LlamaModel, tiles: bool) -> None:
    """With the prompt tiles (as the worker runs) and with every row on the per-row path: the same bits as the
    token computed alone as a decode."""
    reference = compute(model, WAYS["alone, as a decode"], tiles=False)
    for way, chunks in WAYS.items():
        assert same_bits(compute(model, chunks, tiles=tiles), reference), way
    assert same_bits(compute(model, [TARGET, 1], tiles=tiles, others=OTHERS), reference), "in a decode batch of 7"
    assert same_bits(compute(model, [TARGET + 45], tiles=tiles, row=TARGET), reference), "mid-chunk"
    assert same_bits(compute(model, [100, 100, 100], tiles=tiles, row=TARGET), reference), "mid-chunk, 3rd chunk"


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
def test_a_quantized_caches_rows_and_logits_do_not_depend_on_the_path(model: LlamaModel,
                                                                      kv_dtype: torch.dtype) -> None:
    """kv_cache_dtype fp8 and int8 (kernels/native/kv_formats.h): the same, with the prompt tiles."""
    reference = compute(model, WAYS["alone, as a decode"], tiles=False, kv_dtype=kv_dtype)
    for way in ("in a 16-row chunk", "in a 100-row chunk", "after a boundary at 17", "in one chunk of the whole prompt"):
        assert same_bits(compute(model, WAYS[way], tiles=True, kv_dtype=kv_dtype), reference), way
    assert same_bits(compute(model, [TARGET, 1], tiles=True, others=OTHERS, kv_dtype=kv_dtype), reference), \
        "in a decode batch of 7"
    changed = compute(model, WAYS["alone, as a decode"], tiles=False, seed=5, kv_dtype=kv_dtype)
    assert not same_bits(changed, reference)  # the comparison sees a changed prompt


def test_the_comparison_sees_a_changed_prompt(model: LlamaModel) -> None:
    """So that the equalities above are known to compare what they should: one earlier token of the prompt
    changed changes the target's K/V and logits."""
    reference = compute(model, WAYS["alone, as a decode"], tiles=True)
    assert not same_bits(compute(model, WAYS["alone, as a decode"], tiles=True, seed=1), reference)
