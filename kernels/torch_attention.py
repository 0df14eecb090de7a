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
        self._new_kv: tuple[torch.Tensor, torch.Tensor] | None = None

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
        # A prompt with no cached prefix attends to exactly these rows: run() reads them here
        # instead of gathering them back out of the pages (same values, so the same result).
        self._new_kv = (key, value)

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D] and one layer's cache [blocks, 2, bs, Hkv, D] -> attention output [T, Hq, D]."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if self._decode is not None:
            out.index_copy_(0, self._decode.rows, self._run_decode(q, kv_cache, self._decode))
        group = self.num_qo_heads // self.num_kv_heads
        for p in self._prefills:
            if p.mask is None and self._new_kv is not None:  # the whole sequence is new this step
                k = self._new_kv[0][p.q_start : p.q_start + p.q_len].transpose(0, 1)
                v = self._new_kv[1][p.q_start : p.q_start + p.q_len].transpose(0, 1)
            else:
                k = kv_cache[:, 0].index_select(0, p.pages).view(-1, self.num_kv_heads, self.head_dim)[: p.kv_len]
                v = kv_cache[:, 1].index_select(0, p.pages).view(-1, self.num_kv_heads, self.head_dim)[: p.kv_len]
                k, v = k.transpose(0, 1), v.transpose(0, 1)
            qp = q[p.q_start : p.q_start + p.q_len].transpose(0, 1)  # [Hq, q_len, D]
            # 4-D inputs: the CPU SDPA kernels are several times faster than on 3-D ones.
            o = _sdpa(qp[None], k[None], v[None], p.mask, self.scale, group)
            out[p.q_start : p.q_start + p.q_len] = o[0].transpose(0, 1)
        self._new_kv = None
        return out

    def _run_decode(self, q: torch.Tensor, kv_cache: torch.Tensor, d: _DecodePlan) -> torch.Tensor:
        """One query token per sequence, all sequences at once -> [Bd, Hq, D].

        K and V are gathered by whole pages with `index_select` (a memcpy per page; advanced
        indexing was ~4-15x slower for the same bytes), each into a dense [Bd, S, Hkv, D].
        """
        bd = d.pages.shape[0]
        flat = d.pages.view(-1)
        k = kv_cache[:, 0].index_select(0, flat).view(bd, -1, self.num_kv_heads, self.head_dim)
        v = kv_cache[:, 1].index_select(0, flat).view(bd, -1, self.num_kv_heads, self.head_dim)
        qd = q.index_select(0, d.rows)  # [Bd, Hq, D]
        group = self.num_qo_heads // self.num_kv_heads
        qg = qd.view(bd, self.num_kv_heads, group, self.head_dim)
        if q.dtype == torch.float32:
            # float32: one bmm pair per KV head on strided views (BLAS reads them in place; the
            # 4-D matmul below copies K and V first and measured slower). Not SDPA: its rows
            # change bitwise with the batch size, and padding a decode batch must not.
            heads = []
            for h in range(self.num_kv_heads):
                scores = torch.bmm(qg[:, h], k[:, :, h].transpose(1, 2)).mul_(self.scale).add_(d.mask)  # [Bd, G, S]
                heads.append(torch.bmm(torch.softmax(scores, dim=-1), v[:, :, h]))  # [Bd, G, D]
            return torch.stack(heads, dim=1).view(bd, self.num_qo_heads, self.head_dim)
        # bfloat16: batched matmuls over [Bd, Hkv, G, *] with a float32 softmax (the per-head
        # loop measured 4.6x slower, strided-view SDPA 10x slower).
        scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).float().mul_(self.scale).add_(d.mask[:, None])
        probs = torch.softmax(scores, dim=-1).to(q.dtype)  # [Bd, Hkv, G, S]
        return torch.matmul(probs, v.transpose(1, 2)).view(bd, self.num_qo_heads, self.head_dim)
