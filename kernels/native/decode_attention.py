"""Paged decode attention through the C kernel (kernels/native/decode_attention.c).

The pure-torch decode gathers every sequence's K/V pages into a copy padded to the longest
sequence, then runs two batched matmuls over it: three passes over memory, and the padding.
The C kernel reads each K and V row once, in place, and only the rows a sequence has.
"""

from __future__ import annotations

import torch

from kernels.native import lib

MAX_HEAD_DIM, MAX_GROUP = 256, 16  # the kernel's limits (decode_attention.c)
# The cache row formats the kernel reads (kv_formats.h's kinds): bfloat16, and on its AVX512-BF16 path only fp8
# e4m3 and int8 rows with a scale (kernels/cache_ops.py).
KV_KINDS = {torch.bfloat16: 0, torch.float8_e4m3fn: 1, torch.int8: 2}
CACHE_DTYPES = tuple(KV_KINDS)


def supports(dtype: torch.dtype, num_qo_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Shapes and dtypes the kernel takes (the library itself may still be unavailable: `lib.load()`)."""
    return (dtype == torch.bfloat16 and head_dim <= MAX_HEAD_DIM and num_qo_heads % num_kv_heads == 0
            and num_qo_heads // num_kv_heads <= MAX_GROUP)


def takes_prompts(head_dim: int, block_size: int) -> bool:
    """Whether prompt rows go through the kernel too: where its AVX512-BF16 path runs (1.4-4x the torch
    prompt path there as rows; chunks of 8+ rows now run in 16-row tiles, kernels/native/prompt_row_tiles.c,
    2.3x those rows); its plain loops are no faster than torch's matmuls on prompts."""
    library = lib.load()
    return library is not None and bool(library.decode_attention_bf16_vectorized(head_dim, block_size))


def decode_attention(q: torch.Tensor, q_rows: torch.Tensor, layer_cache: torch.Tensor, pages: torch.Tensor,
                     kv_lens: torch.Tensor, out: torch.Tensor, scale: float, tiles: bool = True) -> None:
    """out[q_rows[b]] = attention of q[q_rows[b]] over sequence b's first kv_lens[b] cached tokens.

    q, out [T, Hq, D] bfloat16 (rows may be strided, heads contiguous); q_rows int64 [B];
    layer_cache [blocks, 2, Hkv, bs, D] bfloat16 contiguous, or float8_e4m3fn / int8 rows (kernels/cache_ops.py)
    where `takes_prompts` (the AVX512-BF16 path); pages int32 [B, P]; kv_lens int32 [B].
    The caller checks `supports` and that `lib.load()` succeeded. `tiles=False`: prompt chunks on the
    per-row path too (for comparisons; decode_attention_bf16_rows).
    """
    library = lib.load()
    assert library is not None, "decode_attention without the C library"
    num_seqs, num_qo_heads, head_dim = q_rows.shape[0], q.shape[1], q.shape[2]
    num_kv_heads, block_size = layer_cache.shape[2], layer_cache.shape[3]
    for name, t in (("q", q), ("out", out)):
        if t.dtype != torch.bfloat16 or t.stride(2) != 1 or t.stride(1) != head_dim:
            raise ValueError(f"{name} must be bfloat16 [T, Hq, D] with contiguous heads")
    if layer_cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"the C attention kernel reads a bfloat16, float8_e4m3fn or int8 cache, not {layer_cache.dtype}")
    if not (layer_cache.is_contiguous() and pages.is_contiguous() and kv_lens.is_contiguous()
            and q_rows.is_contiguous()):
        raise ValueError("layer_cache, pages, kv_lens and q_rows must be contiguous")
    rc = (library.decode_attention_bf16 if tiles else library.decode_attention_bf16_rows)(
        q.data_ptr(), q.stride(0), q_rows.data_ptr(), layer_cache.data_ptr(), pages.data_ptr(), pages.shape[1],
        kv_lens.data_ptr(), out.data_ptr(), out.stride(0), num_seqs, num_qo_heads, num_kv_heads, head_dim,
        block_size, scale, KV_KINDS[layer_cache.dtype])
    if rc != 0:
        raise RuntimeError(f"decode_attention_bf16 failed ({rc}): unsupported sizes, an fp8 or int8 cache off "
                           "the AVX512-BF16 path, or out of memory")
