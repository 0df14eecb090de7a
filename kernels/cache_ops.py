"""KV-cache writes and block copies on the paged layouts, per layer (FlashInfer's names):

- NHD: [num_blocks, 2 (K, V), block_size, kv_heads, head_dim]: FlashInfer's kernels read it;
- HND: [num_blocks, 2 (K, V), kv_heads, block_size, head_dim]: the torch backend's. One head's
  slots of a block are contiguous, so a decode gathers a sequence's K for one head as whole
  [block_size, head_dim] runs straight into the [heads, tokens, head_dim] order that the
  matmuls read, with no transposing copy afterwards.

Either way a block is one contiguous run of every layer's dimension 1, so block copies and
swaps do not depend on the layout.

A row (one token's K or V of one head) holds the model's dtype, or (config `kv_cache_dtype`, the C kernels'
kernels/native/kv_formats.h):
- float8_e4m3fn (`fp8`): clamped to +-448, then written with torch's rounding (ties to even; `to_fp8`), copied
  as bytes, since torch's CPU indexing kernels do not take float8 tensors;
- int8 (`int8`, the CPU's): head_dim int8 values q and a float32 scale s per row (value = q * s,
  s = absmax / 127), so an int8 cache's last dimension is head_dim + 4; the rows of a block's run are stored
  in groups of 16, the 16 rows' values and then their 16 scales (the C kernels read aligned rows and a group's
  scales at once), so an int8 run is bytes to be read through `int8_rows`.
"""

from __future__ import annotations

import torch

LAYOUTS = ("NHD", "HND")
FP8_DTYPES = (torch.float8_e4m3fn,)
INT8_SCALE_BYTES = 4  # an int8 row's float32 scale, after its values


def row_width(dtype: torch.dtype, head_dim: int) -> int:
    """The cache's last dimension: head_dim, or head_dim + the scale's bytes for int8 rows."""
    return head_dim + INT8_SCALE_BYTES if dtype == torch.int8 else head_dim


def kv_row_bytes(dtype: torch.dtype, head_dim: int) -> int:
    """Bytes of one row (one token's K or V of one KV head)."""
    return row_width(dtype, head_dim) * torch.empty(0, dtype=dtype).element_size()


INT8_GROUP = 16  # int8 rows per group: their values, then their scales


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (q int8 [..., D], scale float32 [...]): q = round_to_even(x * (127 / absmax)), scale =
    absmax / 127 (the C kernels' quantizer computes the same float32 operations)."""
    x = x.float()
    absmax = x.abs().amax(-1, keepdim=True)
    # A tensor over a tensor: torch computes `127.0 / absmax` as reciprocal times 127, one more rounding.
    inv = torch.where(absmax > 0, torch.full_like(absmax, 127.0) / absmax, torch.zeros_like(absmax))
    q = (x * inv).round_().clamp_(-127, 127).to(torch.int8)
    return q, (absmax / 127.0).squeeze(-1)


def int8_rows(rows: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of int8 rows [..., R, D + 4] (R a multiple of 16, the row order of a run): (values [..., R/16, 16, D],
    scales float32 [..., R/16, 16]), writable."""
    r = rows.shape[-2]
    groups = rows.reshape(*rows.shape[:-2], r // INT8_GROUP, INT8_GROUP * (head_dim + INT8_SCALE_BYTES))
    values = groups[..., : INT8_GROUP * head_dim].unflatten(-1, (INT8_GROUP, head_dim))
    return values, groups[..., INT8_GROUP * head_dim:].view(torch.float32)


def quantize_int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., R, D] (R a multiple of 16) -> int8 rows [..., R, D + 4] in the cache's group layout."""
    q, scale = quantize_int8(x)
    rows = torch.empty(*x.shape[:-1], x.shape[-1] + INT8_SCALE_BYTES, dtype=torch.int8)
    values, scales = int8_rows(rows, x.shape[-1])
    values.copy_(q.unflatten(-2, (-1, INT8_GROUP)))
    scales.copy_(scale.unflatten(-1, (-1, INT8_GROUP)))
    return rows


def dequantize_int8_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., R, D + 4] (contiguous, the group layout) -> their values [..., R, D] in dtype."""
    values, scales = int8_rows(rows, rows.shape[-1] - INT8_SCALE_BYTES)
    return (values.float() * scales[..., None]).flatten(-3, -2).to(dtype)


def write_int8_rows(flat: torch.Tensor, rows: torch.Tensor, x: torch.Tensor) -> None:
    """Rows x [T, D] quantized into an int8 cache seen as rows flat [N, D + 4] at row indices rows [T]."""
    q, scale = quantize_int8(x)
    values, scales = int8_rows(flat, x.shape[-1])
    group, slot = torch.div(rows, INT8_GROUP, rounding_mode="floor"), rows % INT8_GROUP
    values[group, slot] = q
    scales[group, slot] = scale


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor viewed as uint8 (for index copies), any other as it is."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def to_fp8(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """x in an fp8 dtype, saturated at its largest finite value (448 for e4m3fn). e4m3fn has no infinity:
    torch's conversion is not bound to saturate (c10's scalar one turns a value beyond 448 into NaN, and the CUDA
    kernels have changed between releases), and one NaN in a cached K or V row poisons every later query that
    reads it. The C kernels' writer saturates the same way (kernels/native/kv_formats.h)."""
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)


def in_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x in a (non-int8) cache's element type: fp8 saturated (`to_fp8`), any other cast as it is."""
    if x.dtype == cache_dtype:
        return x
    return to_fp8(x, cache_dtype) if cache_dtype in FP8_DTYPES else x.to(cache_dtype)


def stored(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Rows x [..., R, D] as the cache stores them (`as_bytes` of them in the cache's dtype, fp8 saturated;
    int8: quantized whole runs, R a multiple of 16)."""
    if cache_dtype == torch.int8:
        return quantize_int8_rows(x)
    return as_bytes(in_cache_dtype(x, cache_dtype))


def gathered(runs: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """runs[index] (`index_select` along dimension 0) as values in `dtype`: an fp8 cache's rows widened
    (exactly), an int8 cache's dequantized."""
    picked = as_bytes(runs).index_select(0, index)
    if runs.dtype in FP8_DTYPES:
        return picked.view(runs.dtype).to(dtype)
    return dequantize_int8_rows(picked, dtype) if runs.dtype == torch.int8 else picked


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device | str, layout: str = "NHD") -> torch.Tensor:
    """One tensor for all layers: [layers, blocks, 2 (K, V), ...] with the block in `layout` order."""
    if layout not in LAYOUTS:
        raise ValueError(f"kv cache layout {layout!r} is unknown; use one of {LAYOUTS}")
    inner = (block_size, num_kv_heads) if layout == "NHD" else (num_kv_heads, block_size)
    return torch.zeros(num_layers, num_blocks, 2, *inner, row_width(dtype, head_dim), dtype=dtype, device=device)


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
    if kv_cache.dtype == torch.int8:
        raise ValueError("an int8 cache is the CPU's, in the HND layout (write_kv_hnd)")
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
    head_dim = key.shape[-1]
    flat = as_bytes(kv_cache).view(-1, kv_cache.shape[-1])
    if kv_cache.dtype == torch.int8:  # values and scales in the group layout
        write_int8_rows(flat, k_rows, key.reshape(-1, head_dim))
        write_int8_rows(flat, v_rows, value.reshape(-1, head_dim))
        return
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
