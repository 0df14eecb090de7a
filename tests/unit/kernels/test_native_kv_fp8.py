"""The C kernels' fp8 KV cache (config `kv_cache_dtype: fp8`, kernels/native/kv_fp8.h): its rounding is torch's
float8_e4m3fn conversion for every bfloat16 value, its widening torch's for every e4m3 code, and attention over
an fp8 cache is bit for bit attention over a bfloat16 cache that holds the same values, on every path (decodes,
the per-row path, the prompt tiles, the one-call attention block)."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.cpu.c_layers import attention_block
from kernels.cache_ops import hnd_rows, write_kv_hnd
from kernels.native import decode_attention as native_decode
from kernels.native import lib as native_lib
from tests.unit.kernels.test_native_decode import needs_kernel
from tests.unit.kernels.test_native_prompt_tiles import SEQS, attend, chunk_case, skip_without_tiles

FP8 = torch.float8_e4m3fn


def c_fp8_from_bf16(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.uint8)
    native_lib.load().kv_fp8_from_bf16(x.data_ptr(), out.data_ptr(), x.numel())
    return out


@needs_kernel
def test_rounding_is_torchs_for_every_bfloat16_value() -> None:
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    ours, torchs = c_fp8_from_bf16(every), every.to(FP8).view(torch.uint8)
    nan = every.isnan()
    assert torch.equal(ours[~nan], torchs[~nan])  # ties to even, +-448 for everything beyond, signed zeros
    assert (ours[nan] & 0x7F == 0x7F).all()  # NaN stays NaN


@needs_kernel
def test_widening_is_exact_for_every_code() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    ours = torch.empty(256, dtype=torch.bfloat16)
    if native_lib.load().kv_fp8_to_bf16(codes.data_ptr(), ours.data_ptr(), 256) != 0:
        pytest.skip("no AVX512-BW here: the kernels' fp8 path is not compiled in")
    torchs = codes.view(FP8).to(torch.bfloat16)
    nan = torchs.isnan()
    assert torch.equal(ours.isnan(), nan)
    assert torch.equal(ours[~nan].view(torch.int16), torchs[~nan].view(torch.int16))


def as_fp8_and_bf16(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache rounded to fp8, and the same values held in bfloat16 (NaN slots stay NaN in both)."""
    fp8 = cache.to(FP8)
    return fp8, fp8.to(torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize("tiles", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (9, 3)])  # G = 1, 3 and 3 over 3 KV heads (SmolLM2's)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_over_fp8_is_attention_over_its_values_in_bfloat16(tiles: bool, heads: tuple[int, int],
                                                                      head_dim: int) -> None:
    skip_without_tiles(head_dim, 16)
    cache, tables, q, _, _ = chunk_case(SEQS, *heads, head_dim, 16, seed=5)
    fp8, bf16 = as_fp8_and_bf16(cache)
    out = attend(fp8, tables, SEQS, q, tiles)
    assert not out.isnan().any()
    assert torch.equal(out.view(torch.int16), attend(bf16, tables, SEQS, q, tiles).view(torch.int16))


@needs_kernel
def test_the_attention_blocks_fp8_write_is_torchs() -> None:
    """attention_block (RoPE, the K/V write, attention in one C call) into an fp8 cache: the K/V bytes torch's
    write_kv_hnd stores, and the output of the same call over a bfloat16 cache holding those values."""
    hq, hkv, d, bs = 6, 2, 64, 16
    skip_without_tiles(d, bs)
    t = 20
    qkv = torch.randn(t, (hq + 2 * hkv) * d).to(torch.bfloat16)
    positions = torch.arange(t, dtype=torch.int64)
    cos = torch.randn(64, d // 2).to(torch.bfloat16)
    sin = torch.randn(64, d // 2).to(torch.bfloat16)
    slots = torch.arange(t, dtype=torch.int64) + 3 * bs
    k_rows, v_rows = hnd_rows(slots, hkv, bs)
    pages = torch.tensor([[3, 4]], dtype=torch.int32).repeat(t, 1)
    kv_lens = torch.arange(1, t + 1, dtype=torch.int32)
    q_rows = torch.arange(t, dtype=torch.int64)
    cache = torch.zeros(6, 2, hkv, bs, d, dtype=FP8)
    roped = qkv.clone()
    attn = attention_block(roped, hq, hkv, d, positions, cos, sin, cache, k_rows, v_rows, q_rows, pages, kv_lens,
                           d ** -0.5)
    expected = torch.zeros(6, 2, hkv, bs, d, dtype=FP8)
    kv = roped[:, hq * d:].view(t, 2, hkv, d)
    write_kv_hnd(expected, kv[:, 0], kv[:, 1], k_rows, v_rows)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    over_bf16 = torch.empty(t, hq, d, dtype=torch.bfloat16)
    native_decode.decode_attention(roped[:, : hq * d].view(t, hq, d), q_rows, cache.to(torch.bfloat16), pages,
                                   kv_lens, over_bf16, d ** -0.5)
    assert torch.equal(attn.view(torch.int16), over_bf16.view(t, hq * d).view(torch.int16))
