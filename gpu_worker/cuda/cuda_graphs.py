"""CUDA graphs for decode-only steps (Megatron's `num_cuda_graphs`).

A decode step of B sequences is padded to the smallest captured batch size >= B; the padded
rows are dummy one-token sequences whose single page is a scratch block the scheduler never
hands out, so their K/V writes land nowhere that matters. Per captured size the graph owns
static input buffers (token ids, positions, slots) and its output logits; `plan()` runs
outside the graph before each replay and fills the attention's fixed page-table buffers.
Steps with a prompt chunk, or more sequences than the largest size, run eagerly.

Each graph also takes every row's argmax of its logits (the greedy choice, as the sampler's
`argmax_rows` picks it): a step whose rows are all plain greedy takes its tokens from there and
runs no sampler kernel and builds no sampling tensor on the host's critical path.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import structlog
import torch

from kernels.native.argmax import argmax_rows
from kernels.page_table import PageTable

log = structlog.get_logger("gpu_worker.cuda.cuda_graphs")


def graph_batch_sizes(max_batch_size: int, num_cuda_graphs: int | None = None) -> list[int]:
    """The padded batch sizes to capture: 1, 2, 4, 8, 16, 24, 32, ... (steps of 8), and max_batch_size.

    With `num_cuda_graphs` = N smaller than that ladder, N sizes spread evenly over it are kept,
    always including the largest (so every batch up to max_batch_size still has a graph).
    """
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, not {max_batch_size}")
    ladder = sorted({s for s in (1, 2, 4, 8) if s < max_batch_size} | set(range(16, max_batch_size, 8))
                    | {max_batch_size})
    if num_cuda_graphs is None or num_cuda_graphs >= len(ladder):
        return ladder
    if num_cuda_graphs < 1:
        raise ValueError(f"num_cuda_graphs must be >= 1, not {num_cuda_graphs}")
    if num_cuda_graphs == 1:
        return [ladder[-1]]
    picks = np.linspace(0, len(ladder) - 1, num_cuda_graphs).round().astype(int)
    return sorted({ladder[i] for i in picks})


def padded_batch_size(batch_size: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= batch_size, or None when the batch is larger than every graph."""
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


def pad_decode_table(table: PageTable, padded: int, pad_block: int) -> PageTable:
    """Append padded - B dummy decode sequences (one token, one page: `pad_block`) to a decode-only table."""
    extra = padded - table.batch_size
    if extra < 0:
        raise ValueError(f"cannot pad a batch of {table.batch_size} down to {padded}")
    if extra == 0:
        return table
    num_pages = int(table.kv_indptr[-1])
    return PageTable(
        qo_indptr=torch.cat([table.qo_indptr, table.qo_indptr[-1] + torch.arange(1, extra + 1, dtype=torch.int32)]),
        kv_indptr=torch.cat([table.kv_indptr, num_pages + torch.arange(1, extra + 1, dtype=torch.int32)]),
        kv_indices=torch.cat([table.kv_indices, torch.full((extra,), pad_block, dtype=torch.int32)]),
        kv_last_page_len=torch.cat([table.kv_last_page_len, torch.ones(extra, dtype=torch.int32)]),
        block_size=table.block_size,
        qo_lens=np.concatenate([table.qo_lens, np.ones(extra, dtype=np.int64)]),
        kv_lens=np.concatenate([table.kv_lens, np.ones(extra, dtype=np.int64)]),
    )


# PyTorch's CUDA-graph examples run the region three times on a side stream before capture:
# lazy initialization (cuBLAS handles and workspaces, FlashInfer's first-call setup) and the
# caching allocator's pools settle, so the capture records the steady-state kernels.
WARMUP_RUNS = 3


@dataclass
class _Graph:
    """One captured batch size. The graph reads its static inputs at the addresses captured, so
    every one of them lives here, as long as the graph does: `DecodeGraphs._forward` reads its
    inputs from this record and nowhere else (a tensor held only by a closure or a local would
    be freed after capture and its block reused while replay still reads it)."""

    attention: object  # a FlashInferGraphDecode for this batch size (its page-table buffers)
    input_ids: torch.Tensor  # int64 [bs]
    positions: torch.Tensor  # int64 [bs]
    slots: torch.Tensor  # int64 [bs] (the torch write path's argument; the FlashInfer write ignores it)
    rows: torch.Tensor  # int64 [bs]: the rows whose logits the graph computes (all of them)
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # float32 [bs, vocab]: the graph's output
    greedy: torch.Tensor | None = None  # int64 [bs]: each row's argmax of `logits`, computed in the graph

    def static_inputs(self) -> tuple[torch.Tensor, ...]:
        return self.input_ids, self.positions, self.slots, self.rows


class DecodeGraphs:
    """Captured decode graphs, one per padded batch size, sharing one memory pool."""

    def __init__(self, model, kv_cache: torch.Tensor, sizes: list[int], pad_block: int, block_size: int,
                 make_attention: Callable[[int], object]) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = sorted(sizes)
        self.pad_block = pad_block
        self.block_size = block_size
        self.make_attention = make_attention
        self.graphs: dict[int, _Graph] = {}
        self.capture_seconds = 0.0
        self._replayed: tuple[_Graph, int] | None = None  # the last replay's graph and its real batch size

    def _forward(self, g: _Graph) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model.forward(g.input_ids, g.positions, g.slots, self.kv_cache, g.attention, g.rows)
        return logits, argmax_rows(logits)

    @torch.inference_mode()
    def capture(self) -> None:
        started = time.perf_counter()
        pool = None
        device = self.kv_cache.device
        # Largest first: the smaller graphs then fit in the pool the largest one reserved.
        for bs in reversed(self.sizes):
            g = _Graph(attention=self.make_attention(bs),
                       input_ids=torch.zeros(bs, dtype=torch.int64, device=device),
                       positions=torch.zeros(bs, dtype=torch.int64, device=device),
                       slots=torch.full((bs,), self.pad_block * self.block_size, dtype=torch.int64, device=device),
                       rows=torch.arange(bs, dtype=torch.int64, device=device))
            dummy = pad_decode_table(PageTable.build([], np.zeros(0), np.zeros(0), self.block_size), bs, self.pad_block)
            g.attention.plan(dummy)
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    self._forward(g)
            torch.cuda.current_stream(device).wait_stream(side)
            g.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g.graph, pool=pool):
                g.logits, g.greedy = self._forward(g)
            pool = g.graph.pool()
            self.graphs[bs] = g
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - started
        log.info("cuda graphs captured", batch_sizes=self.sizes, seconds=round(self.capture_seconds, 2))

    def can_run(self, table: PageTable) -> bool:
        return bool((table.qo_lens == 1).all()) and padded_batch_size(table.batch_size, self.sizes) is not None

    @torch.inference_mode()  # the static inputs are inference tensors: written in inference mode only
    def run(self, table: PageTable, input_ids: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """Replay the graph for a decode-only step; logits [B, vocab] for every sequence of the table."""
        b = table.batch_size
        bs = padded_batch_size(b, self.sizes)
        if bs is None or not bool((table.qo_lens == 1).all()):
            raise ValueError(f"no graph serves a step of {b} sequences with {table.num_tokens} tokens")
        g = self.graphs[bs]
        padded = pad_decode_table(table, bs, self.pad_block)
        g.attention.plan(padded)
        ids = np.zeros(bs, dtype=np.int64)
        ids[:b] = input_ids
        pos = np.zeros(bs, dtype=np.int64)
        pos[:b] = positions
        g.input_ids.copy_(torch.from_numpy(ids), non_blocking=True)
        g.positions.copy_(torch.from_numpy(pos), non_blocking=True)
        g.graph.replay()
        self._replayed = (g, b)
        return g.logits[:b]

    def greedy_tokens(self) -> torch.Tensor:
        """The last replay's greedy tokens, int64 [B]: what `argmax_rows` gives on the logits `run` returned."""
        if self._replayed is None:
            raise ValueError("no graph has been replayed")
        g, b = self._replayed
        return g.greedy[:b]
