"""Pure-torch paged attention: the CPU path and the oracle for the FlashInfer backend.

Its cache is in the HND layout (kernels/cache_ops.py): one head's slots of a block are one
contiguous [block_size, head_dim] run. `plan()` once per step turns the page table into row
indices of those runs; `run()` once per layer gathers them with one `index_select` per K and V
straight into [sequence, head, token, head_dim] order, which the matmuls read in place.
For a bfloat16 cache on the CPU, decode rows go through the C kernel that reads the pages in place
(kernels/native/decode_attention.py, `cpu_kernels`), and so do prompt rows where its AVX512-BF16 path runs
(`native_decode.takes_prompts`): a prompt row at position p is a decode over the sequence's first
p + 1 cached tokens, which also makes it causal. Otherwise decode sequences (one query token) are
batched into one padded gather and two batched matmuls; sequences with several query tokens
(prompt chunks) run one by one with a causal mask offset by their cached prefix: as two matmuls in
bfloat16/float16, through SDPA in float32 or when their score matrix would be large.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kernels.cache_ops import gathered, hnd_rows, row_width, write_kv_hnd
from kernels.native import decode_attention as native_decode
from kernels.native import lib as native_lib
from kernels.native import prompt_attention as native_prompt_attention
from kernels.page_table import PageTable


def _sdpa_supports_gqa() -> bool:
    try:  # enable_gqa arrived in torch 2.5; older versions need K/V repeated per query head
        x = torch.zeros(1, 2, 1, 4)
        F.scaled_dot_product_attention(x, x[:, :1], x[:, :1], enable_gqa=True)
        return True
    except TypeError:
        return False


_GQA = _sdpa_supports_gqa()
# Prompt chunks in bfloat16/float16 whose score matrix (q_len x kv_len x query heads) is at most
# this many elements (64 MiB in float32) run as plain matmuls; larger ones, and float32 (the
# oracle mode, where SDPA is as fast), go through SDPA.
_MATMUL_PREFILL_MAX_SCORES = 1 << 24
# With the AMX prompt kernel, prompt chunks over a cached prefix attend apart from this many rows (one tile of
# query rows): a shorter chunk would re-lay out all of its prefix's K/V for a few rows, which the C rows read
# in place.
APART_MIN_ROWS = 16


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
    k_runs: torch.Tensor  # K runs to gather [Bd * Hkv * P] (padded pages)
    v_runs: torch.Tensor  # the V runs: k_runs + Hkv
    num_slots: int  # P * block_size
    mask: torch.Tensor  # additive mask [Bd, 1, 1, P * block_size]: 0 valid, -inf padding


@dataclass
class _NativePlan:
    """The query rows the C kernel computes (all of the step's, or its decodes'): the i-th attends to its
    sequence's first kv_lens[i] tokens."""
    rows: torch.Tensor  # int64 [R]: indices into the step's query rows
    pages: torch.Tensor  # int32 [R, P]: each row's sequence's pages, padded with page 0
    kv_lens: torch.Tensor  # int32 [R]
    max_page: int  # the largest page id: the C kernel reads pages unchecked, so run() checks this once


@dataclass
class _PrefillSeq:
    q_start: int
    q_len: int
    kv_len: int
    k_runs: torch.Tensor  # K runs to gather [Hkv * num_pages]
    v_runs: torch.Tensor  # the V runs: k_runs + Hkv
    mask: torch.Tensor | None  # bool [q_len, keys], None when plain causal (no cached prefix, no window)
    pages: torch.Tensor  # int32 [num_pages]: the sequence's (the AMX prompt kernel reads K/V there)
    max_page: int  # the largest of them (or -1 if one is negative): checked against the cache once per layer
    additive_mask: torch.Tensor | None = None  # float32 [q_len, keys], 0 / -inf: built by the first layer that needs it
    first_key: int = 0  # the position of the first key gathered (a window's first page's first slot)

    @property
    def keys(self) -> int:
        """How many keys the chunk's rows attend over (masked per row)."""
        return self.kv_len - self.first_key


def _runs(pages: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """K runs [..., Hkv, P] of pages [..., P] in a layer cache seen as [blocks * 2 * Hkv, bs, D]:
    block b's K for head h is run (2 b) Hkv + h, its V run Hkv further."""
    heads = np.arange(num_kv_heads, dtype=np.int64)[:, None]
    return pages[..., None, :].astype(np.int64) * (2 * num_kv_heads) + heads


class TorchPagedAttention:
    name = "torch"
    kv_layout = "HND"

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, device: torch.device | str = "cpu",
                 decode_kernel: str = "torch", dtype: torch.dtype | None = None, prompts_apart: bool = False,
                 prompt_tiles: bool = True, kv_dtype: torch.dtype | None = None, scale: float | None = None,
                 window: int = 0) -> None:
        """`decode_kernel` (config `cpu_kernels`): "c" runs a bfloat16 cache's attention on the CPU through
        the C kernel (kernels/native/decode_attention.py; raises if it cannot be built), "auto" does so where it can
        be built, "torch" never. `dtype`: the cache's, when known (another than bfloat16: never).
        `prompts_apart` (AMX CPUs): where the C kernel takes prompt rows, prompt chunks are left out of its plan,
        which then covers every other row (`native_rows`, `apart_prompts`), and attend apart (`attend_apart_prompts`):
        through the AMX tile kernel where it takes the head size (kernels/native/prompt_attention.py; chunks of at
        least APART_MIN_ROWS rows over a cached prefix too), else only prompts with no cached prefix, through
        torch's SDPA (its bfloat16 flash kernel is 1.7-3.4x the C rows at 136-256 tokens there; the tile kernel
        1.5-2x SDPA, and about 9x the C rows over a prefix).
        `prompt_tiles`: the C kernel computes prompt chunks of 8 rows or more in 16-row tiles
        (kernels/native/prompt_row_tiles.c), 2-4x faster than per row and the same bits (one arithmetic:
        kernels/native/attention_order.h); false: every row per row, for comparisons. `kv_dtype`: the cache's
        element where it is not `dtype` (float8_e4m3fn: the C kernel widens it, the torch code what it gathers).
        `scale`: what q·k is multiplied by (head_dim ** -0.5 unless given). `window` (sliding-window layers): a query
        at position p sees the keys p - window + 1 .. p only, its earlier pages are not read; the torch code
        computes it (`windowed` makes such a backend beside this one, planned with the same table)."""
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if decode_kernel not in ("auto", "c", "torch"):
            raise ValueError(f"decode_kernel {decode_kernel!r} is unknown; use auto, c or torch")
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)
        self.scale = scale or head_dim ** -0.5
        self.window = window
        self._settings = dict(device=device, dtype=dtype, prompt_tiles=prompt_tiles, kv_dtype=kv_dtype, scale=scale)
        self._table: PageTable | None = None
        self._windows: dict[int, TorchPagedAttention] = {}
        self._decode: _DecodePlan | None = None
        self._prefills: list[_PrefillSeq] = []
        self._new_kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self._write_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (slots, K rows, V rows)
        self.kv_dtype = kv_dtype or dtype
        self.native_decode = False  # bfloat16 decodes through the C kernel
        if decode_kernel != "torch" and self.device.type == "cpu" and native_decode.supports(
                torch.bfloat16, num_qo_heads, num_kv_heads, head_dim):
            self.native_decode = native_lib.load() is not None
        if decode_kernel == "c" and not self.native_decode:
            raise ValueError("cpu_kernels 'c' cannot be used: "
                             f"{native_lib.unavailable_reason() or 'the CPU kernel does not take these shapes'}; "
                             "use 'auto' or 'torch'")
        if (dtype is not None and dtype != torch.bfloat16) or window:
            self.native_decode = False  # float32 (the oracle mode) and float16 run the torch code
        self._native: _NativePlan | None = None
        self.prompts_apart = prompts_apart
        self.prompt_tiles = prompt_tiles
        self._apart = False  # this step's prefills are exactly the prompt chunks that attend apart
        self._amx_prompts = (prompts_apart and self.native_decode
                             and native_prompt_attention.supported(head_dim, num_qo_heads, num_kv_heads))

    def native_rows(self) -> _NativePlan | None:
        """The step's C plan when it covers every query row but the `apart_prompts` (gpu_worker/cpu/c_layers.py needs
        that), else None."""
        return self._native if self._decode is None and (self._apart or not self._prefills) else None

    def apart_prompts(self) -> list[tuple[int, int]]:
        """(first query row, rows) of the step's prompt chunks left out of the C plan (`run` attends to them, or
        the caller through `attend_apart_prompts`); usually none."""
        return [(p.q_start, p.q_len) for p in self._prefills] if self._apart else []

    def attend_apart_prompts(self, qkv: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor) -> None:
        """Attention of each of `apart_prompts` from the step's q/k/v product qkv [T, (Hq + 2 Hkv) * D] (RoPE
        applied; this step's K/V already written into the layer's cache kv_cache) into out [T, Hq * D]."""
        hq, d = self.num_qo_heads, self.head_dim
        for p in self._prefills if self._apart else ():
            rows = slice(p.q_start, p.q_start + p.q_len)
            self._attend_apart(qkv[rows, : hq * d].view(p.q_len, hq, d), kv_cache, p, out[rows].view(p.q_len, hq, d))

    def _attend_apart(self, q: torch.Tensor, kv_cache: torch.Tensor, p: _PrefillSeq, out: torch.Tensor) -> None:
        """One apart prompt chunk, q and out [q_len, Hq, D], whichever path asked (the same kernel for both, so the
        same bits): the AMX tile kernel, else (it could not allocate, or does not run here) its K/V gathered from
        the pages and SDPA."""
        if self._amx_prompts and kv_cache.dtype == torch.bfloat16 and native_prompt_attention.prompt_attention(q, kv_cache, p.pages, p.kv_len, out,
                                                                          self.scale, p.max_page):
            return
        runs = kv_cache.view(-1, kv_cache.shape[3], kv_cache.shape[4])
        k = gathered(runs, p.k_runs, q.dtype).view(self.num_kv_heads, -1, self.head_dim)[:, : p.keys]
        v = gathered(runs, p.v_runs, q.dtype).view(self.num_kv_heads, -1, self.head_dim)[:, : p.keys]
        o = _sdpa(q.transpose(0, 1)[None], k[None], v[None], p.mask, self.scale, self.num_qo_heads // self.num_kv_heads)
        out.copy_(o[0].transpose(0, 1))

    def windowed(self, window: int) -> TorchPagedAttention:
        """The backend of the sliding-window layers of `window` positions, planned with this one's table."""
        sibling = self._windows.get(window)
        if sibling is None:
            sibling = self._windows[window] = TorchPagedAttention(self.num_qo_heads, self.num_kv_heads, self.head_dim,
                                                                  window=window, **self._settings)
        if self._table is not None:
            sibling.plan_once(self._table)
        return sibling

    def plan_once(self, table: PageTable) -> None:
        """`plan`, unless this table is the one planned already (each window layer asks in turn)."""
        if table is not self._table:
            self.plan(table)

    def plan(self, table: PageTable) -> None:
        self._table = table
        self._decode, self._prefills, self._write_rows, self._native = None, [], None, None
        self._apart = False
        bs = table.block_size
        is_decode = table.qo_lens == 1
        prefill_ids = np.flatnonzero(~is_decode)
        if self.native_decode:
            if native_decode.takes_prompts(self.head_dim, bs):  # every row of the step, in one call
                apart = None
                if self.prompts_apart:
                    apart = ~is_decode & (table.qo_lens == table.kv_lens)  # no cached prefix
                    if self._amx_prompts:
                        apart |= table.qo_lens >= APART_MIN_ROWS
                if apart is None or not apart.any():
                    self._native = self._plan_native(table, np.arange(len(is_decode)))
                    return
                self._native = self._plan_native(table, np.flatnonzero(~apart))  # may have no rows
                prefill_ids, self._apart = np.flatnonzero(apart), True
            elif is_decode.any():
                self._native = self._plan_native(table, np.flatnonzero(is_decode))
        qo_indptr = table.qo_indptr.numpy()
        kv_indptr = table.kv_indptr.numpy()
        kv_indices = table.kv_indices.numpy()
        decode_ids = np.flatnonzero(is_decode) if self._native is None else np.empty(0, dtype=np.int64)
        if decode_ids.size:
            kv_lens = table.kv_lens[decode_ids]
            # A window's decode reads from the page of its first visible key (position kv_len - window) on.
            first_page = np.maximum(kv_lens - self.window, 0) // bs if self.window else np.zeros_like(kv_lens)
            num_pages = kv_indptr[decode_ids + 1] - kv_indptr[decode_ids] - first_page
            max_pages = int(num_pages.max())
            # Padded [Bd, P] page matrix built with one fancy-index: pad entries point at page 0
            # and are masked out below.
            col = np.arange(max_pages)
            valid = col[None, :] < num_pages[:, None]
            flat = np.where(valid, (kv_indptr[decode_ids] + first_page)[:, None] + col[None, :], 0)
            pages = np.where(valid, kv_indices[np.minimum(flat, max(len(kv_indices) - 1, 0))], 0)
            key = (first_page * bs)[:, None] + np.arange(max_pages * bs)[None, :]  # each slot's position
            slot_valid = key < kv_lens[:, None]
            if self.window:
                slot_valid &= key >= (kv_lens - self.window)[:, None]
            mask = torch.zeros(slot_valid.shape, dtype=torch.float32)
            mask.masked_fill_(torch.from_numpy(~slot_valid), float("-inf"))
            k_runs = _runs(pages, self.num_kv_heads).reshape(-1)
            self._decode = _DecodePlan(
                rows=torch.from_numpy(qo_indptr[decode_ids].astype(np.int64)).to(self.device),
                k_runs=torch.from_numpy(k_runs).to(self.device),
                v_runs=torch.from_numpy(k_runs + self.num_kv_heads).to(self.device),
                num_slots=max_pages * bs,
                mask=mask[:, None, None, :].to(self.device),
            )
        for i in prefill_ids:
            q_len, kv_len = int(table.qo_lens[i]), int(table.kv_lens[i])
            # A window's chunk reads from the page of its first row's first visible key on.
            first_page = max(0, kv_len - q_len - self.window + 1) // bs if self.window else 0
            mask = None
            if q_len != kv_len or (self.window and kv_len > self.window):
                # Query j sits at position kv_len - q_len + j and sees keys 0..that position (the last `window`).
                q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
                key = torch.arange(first_page * bs, kv_len)[None, :]
                mask = key <= q_pos
                if self.window:
                    mask &= key > q_pos - self.window
                mask = mask.to(self.device)
            pages = kv_indices[kv_indptr[i] + first_page:kv_indptr[i + 1]]
            k_runs = _runs(pages, self.num_kv_heads).reshape(-1)
            self._prefills.append(_PrefillSeq(int(qo_indptr[i]), q_len, kv_len, torch.from_numpy(k_runs).to(self.device),
                                              torch.from_numpy(k_runs + self.num_kv_heads).to(self.device), mask,
                                              torch.from_numpy(pages.astype(np.int32)),
                                              -1 if pages.min(initial=0) < 0 else int(pages.max(initial=0)),
                                              first_key=first_page * bs))

    def _plan_native(self, table: PageTable, seq_ids: np.ndarray) -> _NativePlan:
        """The C kernel's rows for the sequences `seq_ids` (in order): every query row of each."""
        qo_indptr, kv_indptr, kv_indices = table.qo_indptr.numpy(), table.kv_indptr.numpy(), table.kv_indices.numpy()
        starts = kv_indptr[seq_ids]
        num_pages = kv_indptr[seq_ids + 1] - starts
        col = np.arange(max(int(num_pages.max(initial=0)), 1))
        valid = col[None, :] < num_pages[:, None]
        flat = np.where(valid, starts[:, None] + col[None, :], 0)
        seq_pages = np.where(valid, kv_indices[np.minimum(flat, max(len(kv_indices) - 1, 0))], 0).astype(np.int32)
        q_lens = table.qo_lens[seq_ids]
        seq_of_row = np.repeat(np.arange(len(seq_ids)), q_lens)
        row_in_seq = np.arange(len(seq_of_row)) - np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
        # Row j of a chunk of q rows sits at position kv_len - q + j and sees the tokens up to it.
        kv_lens = table.kv_lens[seq_ids][seq_of_row] - q_lens[seq_of_row] + 1 + row_in_seq
        rows = qo_indptr[seq_ids][seq_of_row] + row_in_seq
        return _NativePlan(rows=torch.from_numpy(rows.astype(np.int64)),
                           pages=torch.from_numpy(np.ascontiguousarray(seq_pages[seq_of_row])),
                           kv_lens=torch.from_numpy(kv_lens.astype(np.int32)),
                           max_page=int(seq_pages.max(initial=0)))

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        if self._write_rows is None or self._write_rows[0] is not slots:  # every layer writes the same slots
            self._write_rows = (slots, *hnd_rows(slots, self.num_kv_heads, kv_cache.shape[3]))
        write_kv_hnd(kv_cache, key, value, self._write_rows[1], self._write_rows[2])
        # A prompt with no cached prefix attends to exactly these rows: run() reads them here
        # instead of gathering them back out of the pages (same values, so the same result; an fp8 or int8
        # cache's are rounded, so those are read back).
        self._new_kv = (key, value) if kv_cache.dtype == key.dtype else None

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D] and one layer's cache [blocks, 2, Hkv, bs, D] (HND) -> attention output [T, Hq, D]."""
        if kv_cache.shape[2] != self.num_kv_heads or kv_cache.shape[4] != row_width(kv_cache.dtype, self.head_dim):
            raise ValueError(f"cache shape {tuple(kv_cache.shape)} is not an HND layer cache [blocks, 2, "
                             f"{self.num_kv_heads}, block_size, {self.head_dim}]")
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if (d := self._native) is not None:
            if q.dtype != torch.bfloat16:
                raise ValueError(f"the C attention kernel takes a bfloat16 cache's queries, not {q.dtype}")
            if d.max_page >= kv_cache.shape[0]:
                raise IndexError(f"page {d.max_page} is outside the cache's {kv_cache.shape[0]} blocks")
            native_decode.decode_attention(q, d.rows, kv_cache, d.pages, d.kv_lens, out, self.scale, self.prompt_tiles)
        runs = kv_cache.view(-1, kv_cache.shape[3], kv_cache.shape[4])  # [blocks * 2 * Hkv, bs, D (+ a scale)]
        if self._decode is not None:
            out.index_copy_(0, self._decode.rows, self._run_decode(q, runs, self._decode))
        group = self.num_qo_heads // self.num_kv_heads
        for p in self._prefills:
            if self._apart:  # as attend_apart_prompts
                rows = slice(p.q_start, p.q_start + p.q_len)
                self._attend_apart(q[rows], kv_cache, p, out[rows])
                continue
            if p.mask is None and self._new_kv is not None:  # the whole sequence is new this step
                k = self._new_kv[0][p.q_start : p.q_start + p.q_len].transpose(0, 1)
                v = self._new_kv[1][p.q_start : p.q_start + p.q_len].transpose(0, 1)
            else:  # [Hkv, kv_len, D], gathered in that order
                k = gathered(runs, p.k_runs, q.dtype).view(self.num_kv_heads, -1, self.head_dim)[:, : p.keys]
                v = gathered(runs, p.v_runs, q.dtype).view(self.num_kv_heads, -1, self.head_dim)[:, : p.keys]
            if (q.dtype != torch.float32
                    and p.q_len * p.keys * self.num_qo_heads <= _MATMUL_PREFILL_MAX_SCORES):
                self._run_prefill_matmul(q, k, v, p, out)
                continue
            qp = q[p.q_start : p.q_start + p.q_len].transpose(0, 1)  # [Hq, q_len, D]
            # 4-D inputs: the CPU SDPA kernels are several times faster than on 3-D ones.
            o = _sdpa(qp[None], k[None], v[None], p.mask, self.scale, group)
            out[p.q_start : p.q_start + p.q_len] = o[0].transpose(0, 1)
        self._new_kv = None
        return out

    def _run_prefill_matmul(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: _PrefillSeq,
                            out: torch.Tensor) -> None:
        """One prompt chunk as two batched matmuls per KV head with a float32 softmax: in bfloat16
        about twice as fast on the CPU as SDPA's flash kernel at prompt lengths of 100-300
        (it materialises the [q_len, kv_len] scores, hence the size cap in `run`).
        The query rows of a KV head's G query heads are stacked, so K and V are read once per KV
        head. k, v [Hkv, kv_len, D]."""
        hkv, group, dim, n = self.num_kv_heads, self.num_qo_heads // self.num_kv_heads, self.head_dim, p.q_len
        if p.additive_mask is None:
            allowed = p.mask if p.mask is not None else torch.ones(n, n, dtype=torch.bool, device=q.device).tril_()
            p.additive_mask = torch.zeros(allowed.shape, dtype=torch.float32, device=q.device).masked_fill_(
                ~allowed, float("-inf"))
        # [Hq, q_len, D] flattened head-major is KV head h's G query heads' rows one after another.
        qg = q[p.q_start : p.q_start + n].transpose(0, 1).reshape(hkv, group * n, dim)
        scores = torch.matmul(qg, k.transpose(1, 2)).float().mul_(self.scale)  # [Hkv, G * q_len, kv_len]
        scores.view(hkv, group, n, p.keys).add_(p.additive_mask)
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        o = torch.matmul(probs, v).view(self.num_qo_heads, n, dim)
        out[p.q_start : p.q_start + n] = o.transpose(0, 1)

    def _run_decode(self, q: torch.Tensor, runs: torch.Tensor, d: _DecodePlan) -> torch.Tensor:
        """One query token per sequence, all sequences at once -> [Bd, Hq, D].

        K and V are gathered by whole [block_size, D] runs with `index_select` (a memcpy per run)
        into dense [Bd, Hkv, S, D]; the matmuls read them in place (K as a transposed operand).
        Not SDPA: its rows change bitwise with the batch size, and padding a decode batch must not.
        """
        bd = d.rows.shape[0]
        k = gathered(runs, d.k_runs, q.dtype).view(bd, self.num_kv_heads, d.num_slots, self.head_dim)
        v = gathered(runs, d.v_runs, q.dtype).view(bd, self.num_kv_heads, d.num_slots, self.head_dim)
        qg = q.index_select(0, d.rows).view(bd, self.num_kv_heads, -1, self.head_dim)  # [Bd, Hkv, G, D]
        # The softmax in float32 whatever the cache's dtype.
        scores = torch.matmul(qg, k.transpose(2, 3)).float().mul_(self.scale).add_(d.mask)  # [Bd, Hkv, G, S]
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, v).view(bd, self.num_qo_heads, self.head_dim)
