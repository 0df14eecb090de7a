"""The timed parts of benchmarks/gpu_bench.py: one step of each kind the benchmark measures, and how it is timed.

- `decode_table`: B sequences of a given context decoding one token, on consecutive blocks;
- `cuda_time`, `median_ms`, `replay_ms`: CUDA-event time per call, host time with an idle GPU before each
  call, a graph's replay alone;
- `graph_step_breakdown` / `print_breakdown` (`--breakdown`): where a graph decode step's time goes;
- `mixed_step_ms`: issue 37's mixed step, one 512-token prompt chunk beside 63 decodes, eagerly;
- `decode_cores_us` (`--compare-decode-cores`): decode attention on CUDA cores against tensor cores.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from gpu_worker.model_config import ModelConfig
from kernels.page_table import PageTable

if TYPE_CHECKING:  # imported where a GPU is there, as the worker's CUDA modules are
    from gpu_worker.cuda.cuda_graphs import DecodeGraphs

DTYPE = torch.bfloat16
BLOCK_SIZE = 16


def cuda_time(fn, iters: int) -> float:
    """Seconds per call, by CUDA events around `iters` calls (after the caller's warm-up)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / iters


def decode_table(batch: int, context: int, first_block: int) -> PageTable:
    """`batch` sequences of `context` cached tokens + the one decoded now, on consecutive blocks."""
    pages = -(-(context + 1) // BLOCK_SIZE)
    tables = [np.arange(first_block + i * pages, first_block + (i + 1) * pages, dtype=np.int32) for i in range(batch)]
    return PageTable.build(tables, np.ones(batch), np.full(batch, context + 1), BLOCK_SIZE)


def median_ms(fn: Callable[[], object], steps: int) -> float:
    """Median host time of `fn()` in ms, the GPU idle before each call."""
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e3


def replay_ms(graph: torch.cuda.CUDAGraph, steps: int) -> float:
    """Median GPU time of one replay in ms, between CUDA events."""
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_step_breakdown(graphs: DecodeGraphs, table: PageTable, ids: np.ndarray, positions: np.ndarray,
                         steps: int) -> dict[str, float]:
    """`--breakdown`: a graph decode step of `table`'s batch, whole and in its parts (the module docstring), ms."""
    from gpu_worker.cuda.cuda_graphs import pad_decode_table, padded_batch_size

    g = graphs.graphs[padded_batch_size(table.batch_size, graphs.sizes)]
    padded = pad_decode_table(table, g.attention.batch_size, graphs.pad_block)
    for _ in range(3):
        graphs.run(table, ids, positions).argmax(-1).tolist()
    step = median_ms(lambda: graphs.run(table, ids, positions).argmax(-1).tolist(), steps)
    host = median_ms(lambda: graphs.run(table, ids, positions), steps)
    plan = median_ms(lambda: g.attention.plan(padded), steps)
    replay = replay_ms(g.graph, steps)
    logits = graphs.run(table, ids, positions)
    read_back = median_ms(lambda: logits.argmax(-1).tolist(), steps)
    return {"step_ms": step, "run_host_ms": host, "plan_ms": plan, "replay_ms": replay, "read_back_ms": read_back,
            "gpu_waits_ms": step - replay}


def mixed_step_ms(model, attention, kv: torch.Tensor, cfg: ModelConfig, context: int, steps: int) -> float:
    """Median ms of an eager step of one 512-token prompt chunk beside 63 decodes of `context` cached tokens
    (plan, forward, argmax to the host): issue 37's mixed step."""
    decodes = decode_table(63, context, 0)
    chunk_pages = np.arange(int(decodes.kv_indptr[-1]), int(decodes.kv_indptr[-1]) + 32, dtype=np.int32)
    tables = [chunk_pages] + [decodes.kv_indices[decodes.kv_indptr[i]:decodes.kv_indptr[i + 1]].numpy()
                              for i in range(63)]
    table = PageTable.build(tables, np.array([512] + [1] * 63), np.array([512] + [context + 1] * 63), BLOCK_SIZE)
    positions, slots = table.token_positions()
    device = kv.device
    ids = torch.randint(0, cfg.vocab_size, (table.num_tokens,), device=device)
    pos, slot = torch.from_numpy(positions).to(device), torch.from_numpy(slots).to(device)
    rows = (table.qo_indptr[1:].to(torch.int64) - 1).to(device)

    def step() -> list[int]:
        attention.plan(table)
        return model.forward(ids, pos, slot, kv, attention, rows).argmax(-1).tolist()

    for _ in range(3):
        step()
    return median_ms(step, steps)


def decode_cores_us(workspace: torch.Tensor, table: PageTable, q: torch.Tensor, layer: torch.Tensor,
                    cfg: ModelConfig, kv_dtype: torch.dtype) -> dict[str, float]:
    """`--compare-decode-cores`: µs of one layer's decode attention through FlashInfer's CUDA-core kernel and
    through its tensor-core (prefill-kernel) path, same table and cache (issue 37: is group 4 faster on tensor
    cores?)."""
    import flashinfer

    timings = {}
    for name, cores in (("cuda_cores", False), ("tensor_cores", True)):
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=cores)
        wrapper.plan(table.kv_indptr, table.kv_indices.to(q.device), table.kv_last_page_len, cfg.num_attention_heads,
                     cfg.num_key_value_heads, cfg.head_dim, BLOCK_SIZE, pos_encoding_mode="NONE", q_data_type=DTYPE,
                     kv_data_type=kv_dtype)
        for _ in range(3):
            wrapper.run(q, layer)
        timings[name] = cuda_time(lambda: wrapper.run(q, layer), 100) * 1e6  # noqa: B023 (called at once)
    return timings


def print_breakdown(rows: list[dict], steps: int) -> None:
    print(f"\nwhere a graph decode step's time goes (ms, medians of {steps} steps; the GPU waits = step - replay)")
    print(f"{'batch':>6} {'step ms':>8} {'run() host':>11} {'plan()':>8} {'replay':>8} {'read-back':>10} "
          f"{'GPU waits':>10}")
    for r in rows:
        print(f"{r['batch']:>6} {r['step_ms']:>8.2f} {r['run_host_ms']:>11.2f} {r['plan_ms']:>8.2f} "
              f"{r['replay_ms']:>8.2f} {r['read_back_ms']:>10.2f} {r['gpu_waits_ms']:>10.2f}")
