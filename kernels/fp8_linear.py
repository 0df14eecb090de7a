"""Linear layers in fp8 (config `quantization: fp8`): weights float8 e4m3 with a scale per output channel,
quantized at load; activations quantized per row (token) on each call; the product by `torch._scaled_mm`
(cuBLASLt's fp8 GEMM on Hopper and Ada GPUs; torch's reference implementation on the CPU, which the tests
use), accumulated in float32 and scaled back in the epilogue: out = (x_q @ w_q.T) * s_x * s_w.

vLLM's W8A8 fp8 scheme (dynamic per-token activation scales, per-channel weight scales). The LM head and the
embedding stay in the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# The smallest scale: an all-zero row quantizes to zeros instead of dividing by zero.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


@dataclass(frozen=True)
class Fp8Weight:
    """A linear weight [out, in] in fp8 and its per-output-channel float32 scales [1, out]."""

    weight: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.float() * self.scale.t()).to(dtype)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], float32 scales [M, 1]): each row scaled so that its largest magnitude is 448."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp_(min=MIN_SCALE)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_weight(weight: torch.Tensor) -> Fp8Weight:
    """A linear weight [out, in] of any float dtype -> fp8 with per-output-channel scales."""
    q, scale = quantize_rows(weight)
    return Fp8Weight(q.contiguous(), scale.t().contiguous())


def from_checkpoint(weight: torch.Tensor, weight_scale: torch.Tensor) -> Fp8Weight:
    """A checkpoint's fp8 weight [out, in] and its `weight_scale` (one per tensor, or one per output channel:
    the `fp8` / `compressed-tensors` layouts) as an Fp8Weight."""
    scale = weight_scale.float().reshape(-1)
    if scale.numel() not in (1, weight.shape[0]):
        raise ValueError(f"weight_scale of {scale.numel()} values for a weight of {weight.shape[0]} outputs: "
                         "per-tensor or per-channel scales only")
    return Fp8Weight(weight.to(FP8).contiguous(), scale.expand(weight.shape[0]).reshape(1, -1).contiguous())


def linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight.T (+ bias) in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    q, scale = quantize_rows(rows)
    out = torch._scaled_mm(q, weight.weight.t(), scale_a=scale, scale_b=weight.scale, out_dtype=x.dtype)
    if bias is not None:
        out = out.add_(bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why fp8 products cannot run on this device in this dtype (a tiny product tried), or None."""
    try:
        w = quantize_weight(torch.ones(16, 32, device=device))
        linear(torch.ones(16, 32, device=device, dtype=dtype), w)
    except (RuntimeError, TypeError, NotImplementedError) as e:
        return f"torch._scaled_mm does not run here ({str(e).splitlines()[0][:160]})"
    return None


def concat_rows(weights: list[Fp8Weight]) -> Fp8Weight:
    """Weights stacked along their outputs (q/k/v, gate/up: one product), each keeping its scales."""
    if len(weights) == 1:
        return weights[0]
    return Fp8Weight(torch.cat([w.weight for w in weights]), torch.cat([w.scale for w in weights], dim=1))


def to_device(weight: Fp8Weight, device: torch.device) -> Fp8Weight:
    return Fp8Weight(weight.weight.to(device), weight.scale.to(device))
