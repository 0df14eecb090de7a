"""KV-cache writes and block copies on the paged layout [num_blocks, 2, block_size, kv_heads, head_dim]."""

from __future__ import annotations

import torch


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """One tensor for all layers: [layers, blocks, 2 (K, V), block_size, kv_heads, head_dim] (NHD per layer)."""
    return torch.zeros(num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """Write new tokens' K/V [T, kv_heads, head_dim] into one layer's cache at flat slots [T]."""
    num_blocks, _, block_size = kv_cache.shape[:3]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - blocks * block_size
    if kv_cache.is_contiguous():
        # Rows of the flat [blocks * 2 * bs, heads, dim] view: index_copy_ is a row memcpy,
        # several times faster than the advanced-index put below.
        rows = kv_cache.view(-1, *kv_cache.shape[3:])
        k_rows = blocks * (2 * block_size) + offsets
        rows.index_copy_(0, k_rows, key.to(kv_cache.dtype))
        rows.index_copy_(0, k_rows + block_size, value.to(kv_cache.dtype))
        return
    kv_cache[blocks, 0, offsets] = key
    kv_cache[blocks, 1, offsets] = value


def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks (all layers) src[i] -> dst[i]: copy-on-write and swap-in use it."""
    if src.numel():
        kv_cache[:, dst] = kv_cache[:, src]


def swap_out_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """A copy of whole blocks (all layers) in host memory: [layers, len(block_ids), 2, block_size, heads, dim]."""
    host = kv_cache[:, block_ids].to("cpu", copy=True)
    return host.pin_memory() if kv_cache.is_cuda else host


def swap_in_blocks(kv_cache: torch.Tensor, host: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Write blocks saved by `swap_out_blocks` into (possibly other) device blocks."""
    if block_ids.numel():
        kv_cache[:, block_ids] = host.to(kv_cache.device, non_blocking=True)
