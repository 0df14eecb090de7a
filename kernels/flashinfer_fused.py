"""A Llama layer's element-wise passes on CUDA through FlashInfer's fused kernels (config
`use_flashinfer_fused_rope`): the same three functions as the CPU's C kernels
(gpu_worker/cpu/fused_ops.py), so the model's fused path serves both.

Eager torch runs RMSNorm as about eight kernels, RoPE as about seven, the residual add and SiLU·mul
apart: at batch 1 a decode step is bound by those launches, not by memory. Each function here is
one kernel: RMSNorm (`norm` module, the residual add fused into it), RoPE from a float32 cos/sin
table on q and k in place inside the q/k/v buffer (`rope` module; rotate-half, as the model's
`_rope`), SiLU·mul (`silu_and_mul` module). They are the kernels under `flashinfer.norm.rmsnorm`,
`flashinfer.norm.fused_add_rmsnorm`, `flashinfer.rope.apply_rope_with_cos_sin_cache_inplace` and
`flashinfer.activation.silu_and_mul`, called on the JIT modules directly: `flashinfer.norm`'s entry
points would pick CuTe DSL kernels where nvidia-cutlass-dsl is installed (compiled on first call,
outside what `kernels/flashinfer_jit.py` compiles in CI and builds on the GPU machine), and each
public call adds API logging and a custom-op dispatch to every launch.

Nothing here reads a value back to the host: these run inside CUDA graph capture. Positions are
not bounds-checked here (the runner checks them on the host). `flashinfer` is imported only inside
the functions, so CPU machines never need it. PDL (programmatic dependent launch) stays off: launches
in captured graphs keep the plain stream order.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)  # the kernels dispatch on 16-bit floats only


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether these kernels can serve a model on `device` in `dtype` (CUDA, 16-bit, flashinfer importable)."""
    if device.type != "cuda" or dtype not in SUPPORTED_DTYPES:
        return False
    try:
        import flashinfer  # noqa: F401
    except Exception:  # ImportError, or a missing runtime dependency inside it
        return False
    return True


@functools.cache
def _norm() -> Any:
    from flashinfer.norm import get_norm_module  # builds (or loads) the `norm` JIT module

    return get_norm_module()


@functools.cache
def _rope() -> Any:
    from flashinfer.rope import get_rope_module

    return get_rope_module()


@functools.cache
def _silu_and_mul() -> Any:
    from flashinfer.activation import get_act_and_mul_module

    return get_act_and_mul_module("silu")


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """hidden += delta (in place, when given), then RMSNorm(hidden) * weight, [rows, dim]; rows with a contiguous
    last dimension (any row stride), weight [dim] in their dtype.

    With `delta`, the normed rows are written over `delta` and returned: it is the last block's output, a fresh
    buffer the caller reads no more, so the pair takes one kernel and no new buffer (FlashInfer's
    fused_add_rmsnorm(input=delta, residual=hidden)). Without, a new tensor."""
    if delta is None:
        out = torch.empty_like(hidden)
        if hidden.shape[0]:  # no launch for no rows (a grid of 0 blocks is a launch error)
            _norm().rmsnorm(out, hidden, weight, eps, False)
        return out
    if hidden.shape[0]:
        _norm().fused_add_rmsnorm(delta, hidden, weight, eps, False)  # hidden += delta; delta = norm(hidden) * w
    return delta


def cos_sin_cache(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """FlashInfer's table from the model's rotate-half tables [positions, head_dim / 2] (gpu_worker/models/model.py's
    `rope_tables`): float32 [positions, head_dim], cos in the first half and sin in the second."""
    return torch.cat([cos, sin], dim=-1).to(torch.float32).contiguous()


def rope_(qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int, positions: torch.Tensor,
          table: torch.Tensor) -> None:
    """Rotate-half RoPE in place on the q and k heads at the front of each row of qkv [rows, (Hq + 2 Hkv) D]
    (v untouched); positions int32 or int64 [rows] on the device, each below table's rows (unchecked), `table`
    from `cos_sin_cache`."""
    rows, q_size = qkv.shape[0], q_heads * head_dim
    if not rows:
        return
    # Strided views of the buffer (row stride (Hq + 2 Hkv) D): the kernel takes the row and head strides and
    # needs only the last dimension contiguous; output = input makes it in place.
    q = qkv[:, :q_size].view(rows, q_heads, head_dim)
    k = qkv[:, q_size:q_size + kv_heads * head_dim].view(rows, kv_heads, head_dim)
    _rope().apply_rope_pos_ids_cos_sin_cache(q, k, q, k, table, positions.contiguous(), False)  # not interleaved


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up [rows, 2n] = [gate | up]: a new [rows, n] tensor."""
    gate_up = gate_up.contiguous()  # the kernel reads rows of 2n packed elements (a no-op for a product's output)
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype, device=gate_up.device)
    if gate_up.shape[0]:
        _silu_and_mul().silu_and_mul(out, gate_up, False)
    return out
