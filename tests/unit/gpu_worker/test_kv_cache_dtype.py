"""Config `kv_cache_dtype: fp8 | int8` on the CPU worker (gpu_worker/kv_dtype.py): twice (fp8) or 1.88x (int8
rows with a scale, head size 64) the blocks in the same memory, served through the C attention kernel, the
blocks copied and swapped as bytes; refused, naming the key, where that kernel cannot read them. Their
arithmetic is tests/unit/kernels/test_native_kv_formats.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetero_common.config import Config
from hetero_common.errors import ConfigError
from hetero_infer.engine import GenerationParams, InferenceEngine
from hetero_infer.bench.harness import make_random_llama
from kernels.cache_ops import allocate_kv_cache, copy_blocks, swap_in_blocks, swap_out_blocks, write_kv
from kernels.native import decode_attention as native_decode

FP8 = torch.float8_e4m3fn
needs_fp8_kernel = pytest.mark.skipif(not native_decode.takes_prompts(64, 16),
                                      reason="no AVX512-BF16 here: the C kernel's fp8 path does not run")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head size 64 (256 / 4): the C kernel's vectorized path
    return make_random_llama(tmp_path_factory.mktemp("llama"), hidden=256, intermediate=512, layers=2, heads=4,
                             kv_heads=2, seed=3)


def engine(model: Path, **overrides) -> InferenceEngine:
    return InferenceEngine(Config(model=str(model), dtype="bfloat16", block_size=16, kv_cache_memory_gb=0.01,
                                  max_num_blocks=1 << 20, **overrides).validate())


@needs_fp8_kernel
@pytest.mark.parametrize("name, dtype, row_bytes", [("fp8", FP8, 64), ("int8", torch.int8, 68)])
def test_a_quantized_pool_holds_more_blocks_and_serves(model: Path, name: str, dtype: torch.dtype,
                                                       row_bytes: int) -> None:
    bf16, quantized = engine(model), engine(model, kv_cache_dtype=name)
    assert quantized.runner.kv_cache.dtype == dtype and bf16.runner.kv_cache.dtype == torch.bfloat16
    budget = int(0.01 * 2**30)
    per_block = 2 * 2 * 16 * 2  # layers x (K, V) x block_size x KV heads rows
    assert bf16.runner.num_blocks == budget // (per_block * 128)
    assert quantized.runner.num_blocks == budget // (per_block * row_bytes)  # fp8: exactly twice
    params = GenerationParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    quantized.submit_request(list(range(5, 45)), params)  # a 40-token prompt: the tiles, then decodes
    (result,) = quantized.run()
    assert len(result.output_token_ids) == 12


@needs_fp8_kernel
def test_fp8_e4m3_is_the_same_cache(model: Path) -> None:
    assert engine(model, kv_cache_dtype="fp8_e4m3").runner.kv_cache.dtype == FP8


@pytest.mark.parametrize("name", ["fp8", "int8"])
@pytest.mark.parametrize("overrides, why", [
    ({"dtype": "float32"}, "needs dtype bfloat16"),
    ({"cpu_kernels": "torch", "dtype": "bfloat16"}, "cpu_kernels is torch"),  # not auto: it measures, and may pick float32
])
def test_a_quantized_cache_where_the_c_kernel_cannot_read_it_is_refused(model: Path, name: str, overrides: dict,
                                                                        why: str) -> None:
    with pytest.raises(ConfigError, match=f"'kv_cache_dtype' = '{name}' cannot be served here: .*{why}"):
        InferenceEngine(Config(model=str(model), kv_cache_dtype=name, **overrides).validate())


def test_int8_on_cuda_is_refused_naming_fp8() -> None:
    from gpu_worker.kv_dtype import kv_cache_torch_dtype

    with pytest.raises(ConfigError, match="'kv_cache_dtype' = 'int8' cannot be served here.*use fp8 on CUDA"):
        kv_cache_torch_dtype(Config(kv_cache_dtype="int8").validate(), torch.bfloat16, torch.device("cuda"), 64)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_fp8_blocks_are_written_copied_and_swapped_as_their_values(layout: str) -> None:
    """write_kv rounds as torch's conversion does; copy_blocks and a swap out and back in keep every byte (an int8
    cache's blocks are plain int8 tensors to torch's copies)."""
    cache = allocate_kv_cache(2, 6, 16, 2, 64, FP8, "cpu", layout)
    key, value = torch.randn(20, 2, 64).to(torch.bfloat16), torch.randn(20, 2, 64).to(torch.bfloat16)
    slots = torch.arange(20) + 16
    for layer in range(2):
        write_kv(cache[layer], key, value, slots, layout)
    k_at = cache[0, 1, 0] if layout == "NHD" else cache[0, 1, 0].transpose(0, 1)  # block 1's K, [bs, heads, dim]
    assert torch.equal(k_at.view(torch.uint8), key[:16].to(FP8).view(torch.uint8))
    copy_blocks(cache, torch.tensor([1, 2]), torch.tensor([4, 5]))
    assert torch.equal(cache[:, 4:6].view(torch.uint8), cache[:, 1:3].view(torch.uint8))
    saved = swap_out_blocks(cache, torch.tensor([1, 2]))
    before = cache[:, 1:3].view(torch.uint8).clone()
    cache.view(torch.uint8).zero_()
    swap_in_blocks(cache, saved, torch.tensor([3, 0]))
    assert torch.equal(cache[:, 3].view(torch.uint8), before[:, 0])
    assert torch.equal(cache[:, 0].view(torch.uint8), before[:, 1])


def test_cuda_takes_fp8_through_flashinfer_with_its_rows_rounded_on_append() -> None:
    """The CUDA side's host logic (run on a GPU by tests/gpu/test_gpu.py): the cache dtype resolves to
    float8_e4m3fn, FlashInfer plans with it, and new K/V rows are rounded to it as they are appended."""
    from gpu_worker.kv_dtype import kv_cache_torch_dtype
    from kernels.flashinfer_backend import _Shape

    config = Config(kv_cache_dtype="fp8").validate()
    assert kv_cache_torch_dtype(config, torch.bfloat16, torch.device("cuda"), 128) == FP8
    shape = _Shape(8, 2, 128, "cpu", torch.bfloat16, FP8)
    assert shape.plan_kwargs()["kv_data_type"] == FP8 and shape.plan_kwargs()["q_data_type"] == torch.bfloat16
    rows = torch.randn(4, 2, 128).to(torch.bfloat16)
    assert shape.appended(rows).dtype == FP8 and shape.appended(rows.to(FP8)).dtype == FP8
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        _Shape(8, 2, 128, "cpu", torch.bfloat16, torch.float16)
