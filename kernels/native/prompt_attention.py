"""Causal attention of prompt chunks on AMX tiles (kernels/native/prompt_attention_amx.c), reading K/V from the
paged cache, any cached prefix included, for `TorchPagedAttention.attend_apart_prompts`: 1.5-2x torch's bfloat16
SDPA on fresh prompts of 136-1,024 tokens on a 2-core Xeon, and about 9x the C decode kernel's prompt rows on a
512-row chunk over 1,536 cached tokens (benchmarks/cpu_kernels.py). Where it cannot run (no AMX, a head
size that is not a multiple of 64, no library), `supported` is False and the caller keeps its other paths."""

from __future__ import annotations

import functools

import torch

from kernels.native import lib

MAX_HEAD_DIM = 1024  # the K re-layout's row buffer


@functools.cache
def _amx_granted() -> bool:
    library = lib.load()
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


def prompt_attention(q: torch.Tensor, cache: torch.Tensor, pages: torch.Tensor, kv_len: int, out: torch.Tensor,
                     scale: float, max_page: int | None = None) -> bool:
    """out [n, Hq, D] = causal attention of a prompt chunk: q [n, Hq, D] (RoPE applied; rows may be strided, each
    row's heads contiguous) holds the sequence's last n of kv_len tokens, whose K/V (this chunk's too) are in the
    paged layer cache [blocks, 2, Hkv, block_size, D] at pages (int32, at least ceil(kv_len / block_size) of
    them). `max_page`: the largest of those pages, when the caller has it (the attention backend finds it once per
    step, not once per layer); else it is read here. False (out untouched) when the kernel could not allocate its
    scratch: the caller takes another path."""
    n, hq, d = q.shape
    if cache.dim() != 5 or cache.dtype != torch.bfloat16 or not cache.is_contiguous() or cache.shape[1] != 2 \
            or cache.shape[4] != d:
        raise ValueError(f"prompt_attention: the cache must be a contiguous bfloat16 [blocks, 2, kv_heads, "
                         f"block_size, {d}] layer, got {cache.dtype} {tuple(cache.shape)}")
    hkv, block_size = cache.shape[2], cache.shape[3]
    strides = [_rows(t, hq, d, name) for t, name in ((q, "q"), (out, "out"))]
    needed = -(-kv_len // block_size)
    if not 0 < n <= kv_len or out.shape[0] != n:
        raise ValueError(f"prompt_attention: {n} query rows (out: {out.shape[0]}) for a sequence of {kv_len} tokens")
    if pages.dtype != torch.int32 or pages.dim() != 1 or not pages.is_contiguous() or pages.numel() < needed:
        raise ValueError(f"prompt_attention: pages must be contiguous int32 with at least {needed} entries, got "
                         f"{pages.dtype} {tuple(pages.shape)}")
    if max_page is None:
        used = pages[:needed]
        max_page = -1 if int(used.min()) < 0 else int(used.max())
    if not 0 <= max_page < cache.shape[0]:  # the kernel reads its pages unchecked
        raise IndexError(f"prompt_attention: a page is outside the cache's {cache.shape[0]} blocks")
    rc = lib.load().prompt_attention_amx(  # type: ignore[union-attr]
        q.data_ptr(), strides[0], cache.data_ptr(), pages.data_ptr(), block_size, kv_len, n, hq, hkv, d, scale,
        out.data_ptr(), strides[1])
    return rc == 0
