"""Linear layers in int8 on CUDA (config `quantization: int8` there): weights int8 with a scale per output
channel, quantized at load; activations quantized per row (token) on each call; the product by
`torch._int_mm` (cuBLASLt's int8 GEMM, int32 sums), scaled back in float32: out = (x_q @ w_q.T) * s_x * s_w
(W8A8, SmoothQuant's per-token / per-channel scheme without the smoothing). The CPU serves `int8` with its own
kernel instead (kernels/native/linear_gguf.py: int8 weights, int16 activations).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# torch._int_mm on CUDA takes more than 16 rows: fewer are padded with zero rows.
CUDA_MIN_ROWS = 17


@dataclass(frozen=True)
class Int8Weight:
    """A linear weight [out, in] in int8, transposed for the product ([in, out], column-major), and its
    per-output-channel float32 scales [1, out]."""

    weight_t: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.weight_t.shape[1], self.weight_t.shape[0]))

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight_t.t().float() * self.scale.t()).to(dtype)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], float32 scales [M, 1]): symmetric, each row's largest magnitude to 127."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().div_(127.0).clamp_(min=1e-12)
    return (x.float() / scale).round_().clamp_(-127, 127).to(torch.int8), scale


def quantize_weight(weight: torch.Tensor) -> Int8Weight:
    q, scale = quantize_rows(weight)
    return Int8Weight(q.t(), scale.t().contiguous())  # q.t(): the column-major [in, out] cuBLASLt wants


def linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight.T (+ bias) in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    q, scale = quantize_rows(rows)
    m = q.shape[0]
    if q.is_cuda and m < CUDA_MIN_ROWS:
        q = torch.cat([q, q.new_zeros(CUDA_MIN_ROWS - m, q.shape[1])])
    sums = torch._int_mm(q, weight.weight_t)[:m]
    out = sums.float().mul_(scale).mul_(weight.scale)
    if bias is not None:
        out = out.add_(bias)
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
