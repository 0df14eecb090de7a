"""W8A8 int8 linear layers (CUDA's `quantization: int8`, kernels/int8_linear.py) through torch._int_mm, run on
the CPU (torch's implementation there; cuBLASLt's on a GPU): the int32 sums are exact, so the result is the
quantized operands' product scaled back, to float32 rounding."""

from __future__ import annotations

import pytest
import torch

from kernels import int8_linear


@pytest.mark.parametrize("rows", [1, 7, 16, 33])
def test_the_product_is_the_quantized_operands_product(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=g) * torch.logspace(-2, 1, 96)[:, None]
    x = (torch.randn(rows, 64, generator=g) * 3).to(torch.bfloat16)
    x[0] = 0
    bias = torch.randn(96, generator=g)
    w = int8_linear.quantize_weight(weight)
    assert w.weight_t.dtype == torch.int8 and w.shape == (96, 64) and w.scale.shape == (1, 96)
    q, scale = int8_linear.quantize_rows(x)
    expected = ((q.double() @ w.weight_t.double()) * scale.double() * w.scale.double() + bias.double())
    out = int8_linear.linear(x, w, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out[0].float(), bias.to(torch.bfloat16).float())


def test_the_weights_error_is_half_a_step() -> None:
    weight = torch.randn(64, 128)
    back = int8_linear.quantize_weight(weight).dequantized(torch.float32)
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((back - weight).abs() <= step / 2 * 1.0001).all()
