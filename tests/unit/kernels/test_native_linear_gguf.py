"""The GGUF linear kernel (kernels/native/linear_gguf.c, CPUs with AVX512-VNNI) against a float64
dequantize-then-multiply (gguf's own dequantizer) on random blocks of Q4_0, Q4_1 and Q8_0: extremes included
(all-zero scales, the largest fp16 scales, every nibble or byte value), odd row counts, k not a multiple of
256. Exact up to float32 rounding against the same product with the activations as the kernel quantizes
them (per block of 32 to int16), and within that quantization's bound against the exact activations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from kernels.native import linear_gguf as lg

TYPES = [lg.Q4_0, lg.Q4_1, lg.Q8_0]
pytestmark = pytest.mark.skipif(not lg.supported(lg.Q4_1, 16, 32), reason="no AVX512-VNNI here (or no C compiler)")


def random_blocks(ggml_type: int, n: int, k: int, rng: np.random.Generator, scale_kind: str = "normal") -> np.ndarray:
    """[n, k / 32 * block bytes] uint8: random quants; fp16 scales (and Q4_1's minimums) of `scale_kind`."""
    nb = k // lg.BLOCK
    blocks = rng.integers(0, 256, size=(n, nb, lg.BLOCK_BYTES[ggml_type]), dtype=np.uint8)
    if scale_kind == "zero":
        scales = np.zeros((n, nb, 2), dtype=np.float16)
    elif scale_kind == "huge":  # the largest fp16 magnitudes a block may carry (Q8_0's m = -128 d must stay finite)
        top = 511.0 if ggml_type == lg.Q8_0 else 8000.0
        scales = (rng.choice([-1.0, 1.0], size=(n, nb, 2)) * top).astype(np.float16)
    else:
        scales = (rng.standard_normal((n, nb, 2)) * 0.02).astype(np.float16)
    blocks[:, :, 0:2] = scales[:, :, 0:1].view(np.uint8)
    if ggml_type == lg.Q4_1:
        blocks[:, :, 2:4] = scales[:, :, 1:2].view(np.uint8)
    return blocks.reshape(n, -1)


def quantized_activations(x: torch.Tensor) -> np.ndarray:
    """x as the kernel sees it: per block of 32, int16 = round_half_even(x * (32767 / max|x|)) in float32, times
    max|x| / 32767; float64."""
    xf = x.float().numpy().reshape(x.shape[0], -1, lg.BLOCK)
    amax = np.abs(xf).max(axis=2, keepdims=True).astype(np.float32)
    scale = amax / np.float32(32767.0)
    inv = np.where(amax > 0, np.float32(32767.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(xf * inv), -32768, 32767)
    return (q.astype(np.float64) * scale.astype(np.float64)).reshape(x.shape[0], -1)


def check(ggml_type: int, n: int, k: int, rows: int, seed: int, scale_kind: str = "normal") -> None:
    rng = np.random.default_rng(seed)
    blocks = random_blocks(ggml_type, n, k, rng, scale_kind)
    w = dequantize(blocks, ggml_type).astype(np.float64).reshape(n, k)
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32)).to(torch.bfloat16)
    weight = lg.pack(blocks, ggml_type, n, k)
    out = lg.linear(x, weight, f32_out=True).double().numpy()
    xd = quantized_activations(x)
    ref = xd @ w.T
    magnitude = np.abs(xd) @ np.abs(w).T
    assert np.all(np.abs(out - ref) <= 2e-6 * magnitude + 1e-30), np.abs(out - ref).max()
    # Against the exact activations: at most half a quantization step of each block, times its weights.
    exact = x.double().numpy() @ w.T
    steps = np.abs(x.float().numpy().reshape(rows, -1, lg.BLOCK)).max(axis=2) / 32767.0 / 2  # [rows, blocks]
    bound = steps @ np.abs(w).reshape(n, -1, lg.BLOCK).sum(axis=2).T
    assert np.all(np.abs(out - exact) <= bound * (1 + 1e-5) + 2e-6 * magnitude + 1e-30)
    # bfloat16 output: the float32 sums rounded to nearest even.
    assert torch.equal(lg.linear(x, weight), torch.from_numpy(out.astype(np.float32)).to(torch.bfloat16))


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 5, 17])
def test_random_blocks_match_float64(ggml_type: int, rows: int) -> None:
    check(ggml_type, n=48, k=96, rows=rows, seed=rows)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_the_models_shapes(ggml_type: int) -> None:
    check(ggml_type, n=192, k=576, rows=4, seed=1)
    check(ggml_type, n=32, k=1536, rows=2, seed=2)


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("scale_kind", ["zero", "huge"])
def test_extreme_scales(ggml_type: int, scale_kind: str) -> None:
    check(ggml_type, n=32, k=64, rows=3, seed=4, scale_kind=scale_kind)


def test_zero_activations_and_bias() -> None:
    rng = np.random.default_rng(5)
    blocks = random_blocks(lg.Q4_1, 32, 64, rng)
    weight = lg.pack(blocks, lg.Q4_1, 32, 64)
    bias = torch.randn(32).to(torch.bfloat16)
    out = lg.linear(torch.zeros(2, 64, dtype=torch.bfloat16), weight, bias)
    assert torch.equal(out, bias.expand(2, 32))
    x = torch.randn(3, 64).to(torch.bfloat16)
    with_bias = lg.linear(x, weight, bias, f32_out=True)
    torch.testing.assert_close(with_bias, lg.linear(x, weight, f32_out=True) + bias.float(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_a_rows_output_does_not_depend_on_the_other_rows(ggml_type: int) -> None:
    """Row tiles of 1-8 rows and the threads' split: each row of a 19-row product equals the row computed alone."""
    rng = np.random.default_rng(6)
    weight = lg.pack(random_blocks(ggml_type, 64, 256, rng), ggml_type, 64, 256)
    x = torch.randn(19, 256).to(torch.bfloat16)
    together = lg.linear(x, weight, f32_out=True)
    for r in range(19):
        assert torch.equal(lg.linear(x[r : r + 1], weight, f32_out=True), together[r : r + 1]), r


def test_unsupported_shapes_are_refused() -> None:
    assert not lg.supported(lg.Q4_1, 24, 64)  # out not a multiple of 16
    assert not lg.supported(lg.Q4_1, 32, 48)  # in not a multiple of 32
    assert not lg.supported(12, 32, 64)  # Q4_K: not served by this kernel
    with pytest.raises(ValueError, match="expected"):
        lg.pack(np.zeros(10, dtype=np.uint8), lg.Q4_1, 32, 64)


def test_int8_blocks_round_to_the_nearest_step_of_each_block() -> None:
    """`quantization: int8`'s weights: symmetric per block of 32, within half a step of the float weight; an
    all-zero block stays zero."""
    from gguf.quants import dequantize

    w = torch.randn(32, 96) * torch.logspace(-3, 1, 96)  # blocks of very different magnitudes
    w[3, 32:64] = 0.0
    blocks = lg.int8_blocks(w)
    back = torch.from_numpy(dequantize(blocks, lg.Q8_0).reshape(32, 96))
    step = (w.reshape(32, 3, lg.BLOCK).abs().amax(dim=2) / 127.0).repeat_interleave(lg.BLOCK, dim=1)
    assert torch.all((back - w).abs() <= step / 2 * 1.01 + 1e-12)
    assert torch.all(back[3, 32:64] == 0)
    x = torch.randn(2, 96).to(torch.bfloat16)
    out = lg.linear(x, lg.pack(blocks, lg.Q8_0, 32, 96), f32_out=True)
    torch.testing.assert_close(out, x.float() @ back.float().T, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_rows_are_the_dequantized_tables_rows(ggml_type: int) -> None:
    """The embedding lookup from the blocks: bit for bit gguf's dequantized rows rounded to bfloat16."""
    rng = np.random.default_rng(7)
    blocks = random_blocks(ggml_type, 48, 96, rng)
    table = torch.from_numpy(dequantize(blocks, ggml_type).reshape(48, 96)).to(torch.bfloat16)
    ids = torch.tensor([0, 47, 17, 17, 3])
    assert torch.equal(lg.rows(lg.pack(blocks, ggml_type, 48, 96), ids), table[ids])
    with pytest.raises(IndexError):
        lg.rows(lg.pack(blocks, ggml_type, 48, 96), torch.tensor([48]))
