"""The fused bfloat16 element-wise kernels (gpu_worker/cpu/fused_ops.py) against the eager ops they replace."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.cpu import fused_ops
from kernels.native import lib as native_lib

REASON = native_lib.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None and os.environ.get("CI") != "true",
                                reason=f"the C kernels cannot be built here: {REASON}")
BF16 = torch.bfloat16


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within two bfloat16 steps: the kernels round once where the eager ops round every intermediate."""
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * 2**-8, atol=1e-3)


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(rows: int, with_delta: bool) -> None:
    torch.manual_seed(rows)
    hidden = torch.randn(rows, 576).to(BF16)
    delta = torch.randn(rows, 576).to(BF16) if with_delta else None
    weight = (1 + torch.randn(576) / 10).to(BF16)
    expected_hidden = hidden + delta if with_delta else hidden.clone()
    expected = eager_rms_norm(expected_hidden, weight, 1e-5)
    out = fused_ops.add_rms_norm(hidden, delta, weight, 1e-5)
    assert torch.equal(hidden, expected_hidden)  # the residual add, in place, rounded as torch's
    close(out, expected)


@pytest.mark.parametrize("rows", [1, 5, 200])
def test_rope_in_place_on_q_and_k_only(rows: int) -> None:
    torch.manual_seed(rows)
    heads, kv_heads, dim = 9, 3, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim).to(BF16)
    positions = torch.randint(0, 100, (rows,))
    freqs = torch.outer(torch.arange(128, dtype=torch.float64), 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))
    cos, sin = freqs.cos().to(BF16), freqs.sin().to(BF16)
    x = qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim)
    # The reference in float32 on the same bfloat16 inputs: the kernel rounds once, the eager ops
    # round each product and the difference (cancellation makes those off by a step near zero).
    c, s = cos[positions][:, None, :].float(), sin[positions][:, None, :].float()
    x1, x2 = x[..., : dim // 2].float(), x[..., dim // 2 :].float()
    expected = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    fused_ops.rope_(qkv, heads + kv_heads, dim, positions, cos, sin)
    close(qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim), expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # V is not rotated


@pytest.mark.parametrize("rows", [1, 9, 150])
def test_silu_mul(rows: int) -> None:
    torch.manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536) * 3).to(BF16)
    gate, up = gate_up.chunk(2, dim=-1)
    close(fused_ops.silu_mul(gate_up), F.silu(gate) * up)


def test_silu_mul_at_the_extremes() -> None:
    """Gates far out on both sides (the vector path's exp is clamped), zeros, and a width that leaves a tail
    for the scalar loop: finite, and within two bfloat16 steps of float32."""
    gate = torch.tensor([-1e4, -200.0, -88.0, -20.0, -1.0, -0.0, 0.0, 1e-20, 0.5, 3.0, 20.0, 88.0, 200.0, 3e4,
                         -3.5, 7.25, 1.0, -2.0, 60.0], dtype=torch.float32)
    up = torch.linspace(-3.0, 3.0, gate.numel())
    gate_up = torch.cat([gate, up])[None].to(BF16)
    got = fused_ops.silu_mul(gate_up)
    assert got.float().isfinite().all()
    close(got, (F.silu(gate_up[:, : gate.numel()].float()) * gate_up[:, gate.numel():].float()).to(BF16))


def test_strided_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="contiguous elements"):
        fused_ops.silu_mul(torch.zeros(4, 8, dtype=BF16).t())
