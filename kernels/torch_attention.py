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

from kernels.page_table import PageTable


@dataclass
class _DecodePlan:
    rows: torch.Tensor  # query rows of the decode sequences [Bd]
    pages: torch.Tensor  # padded page ids [Bd, P]
    mask: torch.Tensor  # additive mask [Bd, 1, 1, P * block_size]: 0 valid, -inf padding


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
                mask=mask[:, None, None, :].to(self.device),
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

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D] and one layer's cache [blocks, 2, bs, Hkv, D] -> attention output [T, Hq, D]."""
        out = torch.empty_like(q)
        group = self.num_qo_heads // self.num_kv_heads
        if self._decode is not None:
            d = self._decode
            kv = kv_cache[d.pages]  # [Bd, P, 2, bs, Hkv, D]
            bd = kv.shape[0]
            k = kv[:, :, 0].reshape(bd, -1, self.num_kv_heads, self.head_dim).permute(0, 2, 3, 1)  # [Bd, Hkv, D, S]
            v = kv[:, :, 1].reshape(bd, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [Bd, Hkv, S, D]
            qd = q[d.rows].view(bd, self.num_kv_heads, group, self.head_dim)
            scores = torch.matmul(qd, k).mul_(self.scale).add_(d.mask)  # [Bd, Hkv, G, S]
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out[d.rows] = torch.matmul(probs, v).reshape(bd, self.num_qo_heads, self.head_dim)
        for p in self._prefills:
            kv = kv_cache[p.pages].transpose(0, 1).reshape(2, -1, self.num_kv_heads, self.head_dim)[:, : p.kv_len]
            k = kv[0].transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, kv_len, D]
            v = kv[1].transpose(0, 1).repeat_interleave(group, dim=0)
            qp = q[p.q_start : p.q_start + p.q_len].transpose(0, 1)  # [Hq, q_len, D]
            o = F.scaled_dot_product_attention(qp, k, v, attn_mask=p.mask, is_causal=p.mask is None, scale=self.scale)
            out[p.q_start : p.q_start + p.q_len] = o.transpose(0, 1)
        return out
