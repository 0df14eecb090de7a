"""Pure-torch paged attention: the CPU path and the oracle for the FlashInfer backend.

`plan()` once per step turns the page table into gather indices and masks; `run()` once
per layer. Decode sequences (one query token) are batched into one padded gather and two
matmuls; sequences with several query tokens (prompt chunks) go through SDPA one by one
with a causal mask offset by their cached prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kernels.cache_ops import write_kv
from kernels.page_table import PageTable


def _sdpa_supports_gqa() -> bool:
    try:  # enable_gqa arrived in torch 2.5; older versions need K/V repeated per query head
        x = torch.zeros(1, 2, 1, 4)
        F.scaled_dot_product_attention(x, x[:, :1], x[:, :1], enable_gqa=True)
        return True
    except TypeError:
        return False


_GQA = _sdpa_supports_gqa()


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
          group: int) -> torch.Tensor:
    if _GQA:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=group > 1)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)


@dataclass
class _DecodePlan:
    rows: torch.Tensor  # query rows of the decode sequences [Bd]
    pages: torch.Tensor  # padded page ids [Bd, P]
    mask: torch.Tensor  # additive mask [Bd, 1, P * block_size]: 0 valid, -inf padding


@dataclass
class _PrefillSeq:
    q_start: int
    q_len: int
    kv_len: int
    pages: torch.Tensor  # [num_pages]
    mask: torch.Tensor | None  # bool [q_len, kv_len], None when plain causal (no cached prefix)


class TorchPagedAttention:
    name = "torch"

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, device: torch.device | str = "cpu") -> None:
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)
        self.scale = head_dim ** -0.5
        self._decode: _DecodePlan | None = None
        self._prefills: list[_PrefillSeq] = []

    def plan(self, table: PageTable) -> None:
        bs = table.block_size
        qo_indptr = table.qo_indptr.numpy()
        kv_indptr = table.kv_indptr.numpy()
        kv_indices = table.kv_indices.numpy()
        is_decode = table.qo_lens == 1
        self._decode = None
        decode_ids = np.flatnonzero(is_decode)
        if decode_ids.size:
            num_pages = kv_indptr[decode_ids + 1] - kv_indptr[decode_ids]
            max_pages = int(num_pages.max())
            # Padded [Bd, P] page matrix built with one fancy-index: pad entries point at page 0
            # and are masked out below.
            col = np.arange(max_pages)
            valid = col[None, :] < num_pages[:, None]
            flat = np.where(valid, kv_indptr[decode_ids][:, None] + col[None, :], 0)
            pages = np.where(valid, kv_indices[np.minimum(flat, max(len(kv_indices) - 1, 0))], 0)
            slot_valid = np.arange(max_pages * bs)[None, :] < table.kv_lens[decode_ids][:, None]
            mask = torch.zeros(slot_valid.shape, dtype=torch.float32)
            mask.masked_fill_(torch.from_numpy(~slot_valid), float("-inf"))
            self._decode = _DecodePlan(
                rows=torch.from_numpy(qo_indptr[decode_ids].astype(np.int64)).to(self.device),
                pages=torch.from_numpy(pages.astype(np.int64)).to(self.device),
                mask=mask[:, None, :].to(self.device),
            )
        self._prefills = []
        for i in np.flatnonzero(~is_decode):
            q_len, kv_len = int(table.qo_lens[i]), int(table.kv_lens[i])
            mask = None
            if q_len != kv_len:
                # Query j sits at position kv_len - q_len + j and sees keys 0..that position.
                q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
                mask = (torch.arange(kv_len)[None, :] <= q_pos).to(self.device)
            pages = torch.from_numpy(kv_indices[kv_indptr[i]:kv_indptr[i + 1]].astype(np.int64)).to(self.device)
            self._prefills.append(_PrefillSeq(int(qo_indptr[i]), q_len, kv_len, pages, mask))

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        write_kv(kv_cache, key, value, slots)

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D] and one layer's cache [blocks, 2, bs, Hkv, D] -> attention output [T, Hq, D]."""
        out = torch.empty_like(q)
        group = self.num_qo_heads // self.num_kv_heads
        if self._decode is not None:
            d = self._decode
            bd = d.pages.shape[0]
            # Gather K and V separately: each result is contiguous [Bd, S, Hkv, D], and the
            # per-head slices below are BLAS-friendly strided views, so nothing is copied twice.
            k = kv_cache[:, 0][d.pages].view(bd, -1, self.num_kv_heads, self.head_dim)
            v = kv_cache[:, 1][d.pages].view(bd, -1, self.num_kv_heads, self.head_dim)
            qd = q[d.rows].view(bd, self.num_kv_heads, group, self.head_dim)
            heads = []
            for h in range(self.num_kv_heads):
                scores = torch.bmm(qd[:, h], k[:, :, h].transpose(1, 2)).mul_(self.scale).add_(d.mask)  # [Bd, G, S]
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
                heads.append(torch.bmm(probs, v[:, :, h]))  # [Bd, G, D]
            out[d.rows] = torch.stack(heads, dim=1).reshape(bd, self.num_qo_heads, self.head_dim)
        for p in self._prefills:
            kv = kv_cache[p.pages]  # [pages, 2, bs, Hkv, D]
            k = kv[:, 0].reshape(-1, self.num_kv_heads, self.head_dim)[: p.kv_len].transpose(0, 1)
            v = kv[:, 1].reshape(-1, self.num_kv_heads, self.head_dim)[: p.kv_len].transpose(0, 1)
            qp = q[p.q_start : p.q_start + p.q_len].transpose(0, 1)  # [Hq, q_len, D]
            # 4-D inputs: the CPU SDPA kernels are several times faster than on 3-D ones.
            o = _sdpa(qp[None], k[None], v[None], p.mask, self.scale, group)
            out[p.q_start : p.q_start + p.q_len] = o[0].transpose(0, 1)
        return out
