"""fp8 linear layers (config `quantization: fp8`, kernels/fp8_linear.py) through torch._scaled_mm, on the CPU
(torch's reference implementation; cuBLASLt's on a GPU, tests/gpu): the product is the float64 product of the
quantized operands, rounded once; weights from checkpoints with per-tensor or per-channel scales."""

from __future__ import annotations

import pytest
import torch

from kernels import fp8_linear
from kernels.fp8_linear import FP8, FP8_MAX

pytestmark = pytest.mark.skipif(fp8_linear.unavailable_reason(torch.device("cpu"), torch.bfloat16) is not None,
                                reason="torch._scaled_mm does not run on this CPU build")


def reference(x: torch.Tensor, w: fp8_linear.Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The float64 product of x's per-row fp8 quantization and the fp8 weight, both scaled back."""
    q, scale = fp8_linear.quantize_rows(x.reshape(-1, x.shape[-1]))
    out = (q.double() * scale.double()) @ (w.weight.double() * w.scale.double().t()).t()
    return out + bias.double() if bias is not None else out


@pytest.mark.parametrize("rows", [1, 5, 16, 33])
def test_the_product_is_the_quantized_operands_product(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=g) * torch.logspace(-2, 1, 96, dtype=torch.float32)[:, None]
    x = (torch.randn(rows, 64, generator=g) * 3).to(torch.bfloat16)
    x[0] = 0  # an all-zero row: zeros out, no division by zero
    bias = torch.randn(96, generator=g).to(torch.bfloat16)
    w = fp8_linear.quantize_weight(weight)
    assert w.weight.dtype == FP8 and w.scale.shape == (1, 96)
    assert torch.equal(w.weight.float().abs().amax(dim=1), torch.full((96,), FP8_MAX))  # each row's range used
    out = fp8_linear.linear(x, w, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    torch.testing.assert_close(out.double(), reference(x, w, bias), rtol=1e-2, atol=1e-2)  # bfloat16's rounding
    torch.testing.assert_close(out[0].float(), bias.float())


def test_the_weights_error_is_fp8s() -> None:
    weight = torch.randn(64, 128)
    back = fp8_linear.quantize_weight(weight).dequantized(torch.float32)
    # e4m3: 3 mantissa bits, so at most 1/16 relative error per weight above the row's subnormal range
    big = weight.abs() > weight.abs().amax(dim=1, keepdim=True) / 64
    assert ((back - weight).abs()[big] <= weight.abs()[big] / 16).all()


def test_checkpoint_weights_take_per_tensor_and_per_channel_scales() -> None:
    q = torch.randn(32, 64).to(FP8)
    per_tensor = fp8_linear.from_checkpoint(q, torch.tensor(0.5))
    per_channel = fp8_linear.from_checkpoint(q, torch.full((32, 1), 0.5))
    assert torch.equal(per_tensor.scale, per_channel.scale) and per_tensor.scale.shape == (1, 32)
    torch.testing.assert_close(per_tensor.dequantized(torch.float32), q.float() * 0.5)
    with pytest.raises(ValueError, match="per-tensor or per-channel"):
        fp8_linear.from_checkpoint(q, torch.ones(4))
