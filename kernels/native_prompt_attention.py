"""Causal attention of fresh prompts (no cached prefix) on AMX tiles (kernels/native/prompt_attention_amx.c),
for `TorchPagedAttention.attend_fresh_prompts`: about 2-2.5x torch's bfloat16 SDPA on prompts of 16-256 tokens on
a 2-core Xeon (benchmarks/cpu_kernels.py). Where it cannot run (no AMX, a head size that is not a multiple
of 64, no library), `supported` is False and the caller keeps SDPA."""

from __future__ import annotations

import functools

import torch

from kernels import native_lib

MAX_HEAD_DIM = 1024  # the K re-layout's row buffer


@functools.cache
def _amx_granted() -> bool:
    library = native_lib.load()
    return library is not None and bool(library.linear_amx_supported())  # also asks the kernel for the tile state


def supported(head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
    return (head_dim % 64 == 0 and head_dim <= MAX_HEAD_DIM and num_kv_heads > 0 and num_heads % num_kv_heads == 0
            and _amx_granted())


def _rows(t: torch.Tensor, heads: int, head_dim: int, name: str) -> int:
    """The row stride of t [n, heads, head_dim] (bfloat16, each row's heads contiguous, one after another)."""
    if t.dtype != torch.bfloat16 or t.dim() != 3 or t.shape[1:] != (heads, head_dim) or t.stride(2) != 1 \
            or t.stride(1) != head_dim:
        raise ValueError(f"prompt_attention: {name} must be bfloat16 [n, {heads}, {head_dim}] with each row's heads "
                         f"contiguous, got {t.dtype} {tuple(t.shape)} strides {t.stride()}")
    return t.stride(0)


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, scale: float) -> bool:
    """out [n, Hq, D] = causal attention of one prompt's q [n, Hq, D] over its k, v [n, Hkv, D] (RoPE applied;
    rows may be strided, each row's heads contiguous). False (out untouched) when the kernel could not
    allocate its scratch: the caller falls back to SDPA."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    strides = [_rows(t, h, d, name) for t, h, name in ((q, hq, "q"), (k, hkv, "k"), (v, hkv, "v"), (out, hq, "out"))]
    if not k.shape[0] == v.shape[0] == out.shape[0] == n:
        raise ValueError(f"prompt_attention: q, k, v and out must have the same rows, got {n}, {k.shape[0]}, "
                         f"{v.shape[0]}, {out.shape[0]}")
    rc = native_lib.load().prompt_attention_amx(  # type: ignore[union-attr]
        q.data_ptr(), strides[0], k.data_ptr(), strides[1], v.data_ptr(), strides[2], n, hq, hkv, d, scale,
        out.data_ptr(), strides[3])
    return rc == 0
