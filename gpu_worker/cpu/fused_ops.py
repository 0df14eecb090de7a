"""A Llama layer's element-wise passes, fused, for bfloat16 on the CPU (kernels/native/fused_elementwise.c).

Eager torch runs RMSNorm as seven ops, RoPE as about ten (slices, products, a concatenation),
SiLU·mul as two, each a dispatch of a few microseconds and a pass over memory: at batch 1 a
SmolLM2 step spends milliseconds on them. Each function here is one C call. float32 inside and
one bfloat16 rounding per output, so results differ from the eager ops' in the last bit where
those round intermediates; float32 (the exact mode) keeps the eager ops (gpu_worker/models/model.py), and CUDA has
FlashInfer's fused kernels behind the same functions (kernels/flashinfer_fused.py).
"""

from __future__ import annotations

import torch

from kernels.native import lib as native_lib


def available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.bfloat16 and native_lib.load() is not None


def _row_stride(t: torch.Tensor) -> int:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"expected rows with contiguous elements, got shape {tuple(t.shape)} strides {t.stride()}")
    return t.stride(0)


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """hidden += delta (in place, when given), then RMSNorm(hidden) * weight as a new [rows, dim] tensor."""
    out = torch.empty_like(hidden)
    native_lib.load().add_rms_norm_bf16(  # type: ignore[union-attr]
        hidden.data_ptr(), _row_stride(hidden), 0 if delta is None else delta.data_ptr(),
        0 if delta is None else _row_stride(delta), weight.data_ptr(), out.data_ptr(), out.stride(0),
        hidden.shape[0], hidden.shape[1], eps)
    return out


def rope_(x: torch.Tensor, num_heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> None:
    """Rotate-half RoPE in place on the first `num_heads` heads of each row of x [rows, >= num_heads * head_dim];
    cos/sin [max_positions, head_dim / 2] contiguous, positions int64 [rows]."""
    if x.shape[1] < num_heads * head_dim or head_dim % 2 or head_dim > 1024:
        raise ValueError(f"rope_ on {tuple(x.shape)} with {num_heads} heads of {head_dim}")
    positions = positions.contiguous()
    native_lib.load().rope_bf16(  # type: ignore[union-attr]
        x.data_ptr(), _row_stride(x), x.shape[0], num_heads, head_dim, positions.data_ptr(), cos.data_ptr(),
        sin.data_ptr())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up [rows, 2n] = [gate | up]: a new [rows, n] tensor."""
    n = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], n, dtype=gate_up.dtype)
    native_lib.load().silu_mul_bf16(  # type: ignore[union-attr]
        gate_up.data_ptr(), _row_stride(gate_up), out.data_ptr(), out.stride(0), gate_up.shape[0], n)
    return out
