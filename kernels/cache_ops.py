"""KV-cache writes and block copies on the paged layouts, per layer (FlashInfer's names):

- NHD: [num_blocks, 2 (K, V), block_size, kv_heads, head_dim]: FlashInfer's kernels read it;
- HND: [num_blocks, 2 (K, V), kv_heads, block_size, head_dim]: the torch backend's. One head's
  slots of a block are contiguous, so a decode gathers a sequence's K for one head as whole
  [block_size, head_dim] runs straight into the [heads, tokens, head_dim] order that the
  matmuls read, with no transposing copy afterwards.

Either way a block is one contiguous run of every layer's dimension 1, so block copies and
swaps do not depend on the layout.

The cache's element is the model's dtype, or float8_e4m3fn (config `kv_cache_dtype: fp8`): written with
torch's rounding (ties to even, saturating at +-448, as the CPU kernels' kernels/native/kv_fp8.h), and
copied as bytes, since torch's CPU indexing kernels do not take float8 tensors.
"""

from __future__ import annotations

import torch

LAYOUTS = ("NHD", "HND")
FP8_DTYPES = (torch.float8_e4m3fn,)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor viewed as uint8 (for index copies), any other as it is."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def stored(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it (`as_bytes` of x in the cache's dtype)."""
    return as_bytes(x.to(cache_dtype))


def gathered(runs: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """runs[index] (`index_select` along dimension 0) in `dtype`: an fp8 cache's rows widened (exactly)."""
    picked = as_bytes(runs).index_select(0, index)
    return picked.view(runs.dtype).to(dtype) if runs.dtype in FP8_DTYPES else picked


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device | str, layout: str = "NHD") -> torch.Tensor:
    """One tensor for all layers: [layers, blocks, 2 (K, V), ...] with the block in `layout` order."""
    if layout not in LAYOUTS:
        raise ValueError(f"kv cache layout {layout!r} is unknown; use one of {LAYOUTS}")
    inner = (block_size, num_kv_heads) if layout == "NHD" else (num_kv_heads, block_size)
    return torch.zeros(num_layers, num_blocks, 2, *inner, head_dim, dtype=dtype, device=device)


def convert_layout(kv_cache: torch.Tensor, src: str, dst: str) -> torch.Tensor:
    """A copy of a cache (one layer's or all layers') in another layout (tests, references)."""
    return kv_cache if src == dst else kv_cache.transpose(-3, -2).contiguous()


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
             layout: str = "NHD") -> None:
    """Write new tokens' K/V [T, kv_heads, head_dim] into one layer's cache at flat slots [T]."""
    if layout == "HND":
        write_kv_hnd(kv_cache, key, value, *hnd_rows(slots, kv_cache.shape[2], kv_cache.shape[3]))
        return
    num_blocks, _, block_size = kv_cache.shape[:3]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - blocks * block_size
    if kv_cache.is_contiguous():
        # Rows of the flat [blocks * 2 * bs, heads, dim] view: index_copy_ is a row memcpy,
        # several times faster than the advanced-index put below.
        rows = as_bytes(kv_cache).view(-1, *kv_cache.shape[3:])
        k_rows = blocks * (2 * block_size) + offsets
        rows.index_copy_(0, k_rows, stored(key, kv_cache.dtype))
        rows.index_copy_(0, k_rows + block_size, stored(value, kv_cache.dtype))
        return
    as_bytes(kv_cache)[blocks, 0, offsets] = stored(key, kv_cache.dtype)
    as_bytes(kv_cache)[blocks, 1, offsets] = stored(value, kv_cache.dtype)


def hnd_rows(slots: torch.Tensor, num_kv_heads: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(K rows, V rows), each [T * kv_heads], of an HND layer cache seen as [blocks * 2 * heads * bs,
    head_dim]. Computed once per step: every layer writes the same slots."""
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - blocks * block_size
    heads = torch.arange(num_kv_heads, device=slots.device)
    k_rows = ((blocks * (2 * num_kv_heads))[:, None] * block_size + heads[None, :] * block_size
              + offsets[:, None]).reshape(-1)
    return k_rows, k_rows + num_kv_heads * block_size


def write_kv_hnd(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_rows: torch.Tensor,
                 v_rows: torch.Tensor) -> None:
    """Write K/V [T, kv_heads, head_dim] at `hnd_rows(slots, ...)` of one contiguous HND layer cache."""
    head_dim = kv_cache.shape[-1]
    flat = as_bytes(kv_cache).view(-1, head_dim)
    flat.index_copy_(0, k_rows, stored(key.reshape(-1, head_dim), kv_cache.dtype))
    flat.index_copy_(0, v_rows, stored(value.reshape(-1, head_dim), kv_cache.dtype))


def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks (all layers) src[i] -> dst[i]: copy-on-write and swap-in use it."""
    if src.numel():
        cache = as_bytes(kv_cache)
        cache[:, dst] = cache[:, src]


def swap_out_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, pin_memory: bool = True) -> torch.Tensor:
    """A copy of whole blocks (all layers) in host memory: [layers, len(block_ids), 2, block_size, heads, dim].
    From a CUDA cache into page-locked memory with `pin_memory` (config `pin_memory`: faster copies, and
    `swap_in_blocks`' copy back does not block), else pageable; a CPU cache's blocks are copied as they are."""
    blocks = as_bytes(kv_cache)[:, block_ids]  # advanced indexing: already a copy (an fp8 cache's: its bytes)
    if not kv_cache.is_cuda:
        return blocks
    host = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=pin_memory)
    host.copy_(blocks)
    return host


def swap_in_blocks(kv_cache: torch.Tensor, host: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Write blocks saved by `swap_out_blocks` into (possibly other) device blocks."""
    if block_ids.numel():
        as_bytes(kv_cache)[:, block_ids] = host.to(kv_cache.device, non_blocking=True)
