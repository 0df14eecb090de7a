"""The C kernels' quantized KV caches (config `kv_cache_dtype`, kernels/native/kv_formats.h):
- fp8: the rounding is torch's float8_e4m3fn conversion for every bfloat16 value, the widening torch's for every
  e4m3 code, and attention over an fp8 cache is bit for bit attention over a bfloat16 cache holding the same
  values, on every path (decodes, the per-row path, the prompt tiles);
- int8 rows: the C quantizer writes kernels/cache_ops.py's bytes, attention matches dense float32 attention over
  the dequantized values, and a tiled row is the per-row path's bits (attention_order.h, with the scales);
- the one-call attention block writes either as torch's write_kv_hnd does."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.cpu.c_layers import attention_block
from kernels.cache_ops import (dequantize_int8_rows, hnd_rows, kv_row_bytes, quantize_int8, quantize_int8_rows,
                               write_kv_hnd)
from kernels.native import decode_attention as native_decode
from kernels.native import lib as native_lib
from tests.unit.kernels.test_kernels import dense_attention
from tests.unit.kernels.test_native_decode import needs_kernel
from tests.unit.kernels.test_native_prompt_tiles import SEQS, attend, chunk_case, skip_without_tiles

FP8 = torch.float8_e4m3fn
KIND = native_decode.KV_KINDS


def c_write(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows x [R, D] bfloat16 written by the C kernels' writer into rows of `dtype`'s format, as bytes."""
    rows, dim = x.shape
    out = torch.empty(rows, kv_row_bytes(dtype, dim), dtype=torch.uint8)
    native_lib.load().kv_rows_write(KIND[dtype], x.data_ptr(), out.data_ptr(), rows, dim)
    return out


@needs_kernel
def test_fp8_rounding_is_torchs_for_every_bfloat16_value() -> None:
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    ours, torchs = c_write(every.view(-1, 32), FP8).view(-1), every.to(FP8).view(torch.uint8)
    nan = every.isnan()
    assert torch.equal(ours[~nan], torchs[~nan])  # ties to even, +-448 for everything beyond, signed zeros
    assert (ours[nan] & 0x7F == 0x7F).all()  # NaN stays NaN


@needs_kernel
def test_fp8_widening_is_exact_for_every_code() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    ours = torch.empty(256, dtype=torch.bfloat16)
    if native_lib.load().kv_rows_read(KIND[FP8], codes.data_ptr(), ours.data_ptr(), 8, 32) != 0:
        pytest.skip("no AVX512-BF16 here: the kernels' widening is not compiled in")
    torchs = codes.view(FP8).to(torch.bfloat16)
    nan = torchs.isnan()
    assert torch.equal(ours.isnan(), nan)
    assert torch.equal(ours[~nan].view(torch.int16), torchs[~nan].view(torch.int16))


@needs_kernel
def test_the_int8_quantizer_writes_cache_ops_bytes() -> None:
    """Random rows, an all-zero row, a row of one value, rows at bfloat16's extremes, exact ties (x * 127 /
    absmax = k + 0.5), D = 64 and 128, in the cache's groups of 16 rows: byte for byte the torch reference's, and
    within half a step of x."""
    for dim in (64, 128):
        x = torch.randn(304, dim) * torch.logspace(-3, 3, 304)[:, None]
        x[0] = 0
        x[1] = 7.5
        x[2, 0], x[3, 0] = 3.0e38, 1.0e-38
        x[4] = torch.arange(dim) * (127 / (2 * (dim - 1)))  # absmax maps to 127: k + 0.5 at odd k / 2 ... ties
        x = x.to(torch.bfloat16)
        ours = c_write(x, torch.int8)
        assert torch.equal(ours, quantize_int8_rows(x).view(torch.uint8))
        back = dequantize_int8_rows(ours.view(torch.int8), torch.float32)
        step = x.float().abs().amax(-1, keepdim=True) / 127
        assert ((back - x.float()).abs() <= step / 2 * 1.0001).all()


def int8_values(x: torch.Tensor) -> torch.Tensor:
    """The values int8 rows hold for rows x [..., D]."""
    q, scale = quantize_int8(x)
    return q.float() * scale[..., None]


def quantized(cache: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A bfloat16 layer cache in `dtype`'s rows, and the values those rows hold as bfloat16 (float32 for int8)."""
    if dtype == FP8:
        fp8 = cache.to(FP8)
        return fp8, fp8.to(torch.bfloat16)
    rows = quantize_int8_rows(cache)
    return rows, dequantize_int8_rows(rows, torch.float32)


@needs_kernel
@pytest.mark.parametrize("tiles", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (9, 3)])  # G = 1, 3 and 3 over 3 KV heads (SmolLM2's)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_over_fp8_is_attention_over_its_values_in_bfloat16(tiles: bool, heads: tuple[int, int],
                                                                      head_dim: int) -> None:
    skip_without_tiles(head_dim, 16)
    cache, tables, q, _, _ = chunk_case(SEQS, *heads, head_dim, 16, seed=5)
    fp8, bf16 = quantized(cache, FP8)
    out = attend(fp8, tables, SEQS, q, tiles)
    assert not out.isnan().any()
    assert torch.equal(out.view(torch.int16), attend(bf16, tables, SEQS, q, tiles).view(torch.int16))


@needs_kernel
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (9, 3), (8, 2)])  # G = 1, 3, 3 and 4
@pytest.mark.parametrize("head_dim", [64, 128])
def test_int8_attention_matches_dense_float32_and_a_tiled_row_is_the_per_row_bits(heads: tuple[int, int],
                                                                                   head_dim: int) -> None:
    skip_without_tiles(head_dim, 16)
    cache, tables, q, keys, values = chunk_case(SEQS, *heads, head_dim, 16, seed=9)
    rows, _ = quantized(cache, torch.int8)
    tiled, per_row = attend(rows, tables, SEQS, q, True), attend(rows, tables, SEQS, q, False)
    assert not tiled.isnan().any()
    assert torch.equal(tiled.view(torch.int16), per_row.view(torch.int16))
    start = 0
    for (n, m), k, v in zip(SEQS, keys, values):
        ref = dense_attention(q[start:start + m].float(), int8_values(k), int8_values(v), n - m)
        torch.testing.assert_close(tiled[start:start + m].float(), ref, rtol=1e-2, atol=1e-2)
        start += m


@needs_kernel
@pytest.mark.parametrize("dtype", [FP8, torch.int8])
def test_the_attention_blocks_write_is_torchs(dtype: torch.dtype) -> None:
    """attention_block (RoPE, the K/V write, attention in one C call) into a quantized cache: the bytes torch's
    write_kv_hnd stores, and the output of the C kernel over that cache alone."""
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
    width = kv_row_bytes(dtype, d) // torch.empty(0, dtype=dtype).element_size()
    cache, expected = torch.zeros(6, 2, hkv, bs, width, dtype=dtype), torch.zeros(6, 2, hkv, bs, width, dtype=dtype)
    roped = qkv.clone()
    attn = attention_block(roped, hq, hkv, d, positions, cos, sin, cache, k_rows, v_rows, q_rows, pages, kv_lens,
                           d ** -0.5)
    kv = roped[:, hq * d:].view(t, 2, hkv, d)
    write_kv_hnd(expected, kv[:, 0], kv[:, 1], k_rows, v_rows)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    alone = torch.empty(t, hq, d, dtype=torch.bfloat16)
    native_decode.decode_attention(roped[:, : hq * d].view(t, hq, d), q_rows, cache, pages, kv_lens, alone, d ** -0.5)
    assert torch.equal(attn.view(torch.int16), alone.view(t, hq * d).view(torch.int16))
