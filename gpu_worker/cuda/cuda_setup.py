"""A worker on a CUDA device: warm-up (FlashInfer JIT), KV pool sized from free memory, decode graphs.

Order matters: the weights are already on the device; a warm-up pass (one prompt of the
step's token budget, then a decode, each sampled through the sampler's widest path) compiles
FlashInfer's kernels and measures the peak activation memory; the KV pool then takes
`gpu_memory_utilization` of the memory still free, less that peak and less what the decode
graphs will hold (`MemoryHeadroom`); the graphs are captured last, over the final KV cache tensor.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import structlog
import torch

from gpu_worker.cuda.cuda_graphs import DecodeGraphs, graph_batch_sizes
from gpu_worker.cuda.static_kv_memory import StaticDeviceMemory
from gpu_worker.sampling.sampler import sample, widest_sampling_batch
from hetero_common.config import Config
from hetero_common.device_defaults import kv_blocks_cap, planned_batch_size
from hetero_common.errors import ConfigError
from kernels.attention_backend import AttentionBackend, create_attention_backend
from kernels.cache_ops import allocate_kv_cache
from kernels.page_table import PageTable

log = structlog.get_logger("gpu_worker.cuda.cuda_setup")


# FlashInfer's decode wrapper allocates an int workspace of its own (8 MiB in 0.7.2's decode.py), beside the
# float workspace all wrappers share: one per captured batch size.
WRAPPER_INT_WORKSPACE_BYTES = 8 * 2**20


def kv_blocks_for_memory(free_bytes: int, utilization: float, headroom_bytes: int, bytes_per_block: int,
                         max_num_blocks: int) -> int:
    """Blocks that fit in utilization x free memory once the headroom is set aside (capped)."""
    budget = int(free_bytes * utilization) - headroom_bytes
    return max(0, min(max_num_blocks, budget // bytes_per_block))


@dataclass(frozen=True)
class MemoryHeadroom:
    """What the worker allocates after the KV cache, set aside before the pool is sized: without it an 8B
    model at a high `gpu_memory_utilization` starts and then runs out of memory at its first large batch."""

    activations: int  # the warm-up's measured peak: a prompt of the token budget, a decode, the widest sampling
    graph_outputs: int  # the float32 logits [bs, vocab] every captured batch size keeps in the graphs' pool
    graph_activations: int  # the largest graph's intermediates in that pool (the eager peak's share per token)
    graph_workspaces: int  # each captured size's decode wrapper's int workspace

    @property
    def total(self) -> int:
        return self.activations + self.graph_outputs + self.graph_activations + self.graph_workspaces

    def mib(self) -> dict[str, float]:
        return {f"{name}_mib": round(getattr(self, name) / 2**20, 1)
                for name in ("activations", "graph_outputs", "graph_activations", "graph_workspaces", "total")}


def memory_headroom(activation_bytes: int, warm_tokens: int, graph_sizes: list[int], vocab_size: int) -> MemoryHeadroom:
    """The headroom of a worker whose warm-up over `warm_tokens` tokens peaked at `activation_bytes`, and which
    captures decode graphs of `graph_sizes` (none: graphs off)."""
    per_token = activation_bytes / max(1, warm_tokens)  # an upper bound: the peak includes the sampler's rows
    return MemoryHeadroom(activations=activation_bytes, graph_outputs=sum(graph_sizes) * vocab_size * 4,
                          graph_activations=math.ceil(per_token * max(graph_sizes, default=0)),
                          graph_workspaces=len(graph_sizes) * WRAPPER_INT_WORKSPACE_BYTES)


def planned_graph_sizes(config: Config, attention: AttentionBackend, sliding_window: int = 0) -> list[int]:
    """The decode graphs' batch sizes this worker will capture; none when it captures none (and why, logged)."""
    if not config.enable_cuda_graphs:
        log.info("cuda graphs off", reason="enable_cuda_graphs is false")
        return []
    if attention.name != "flashinfer":
        log.info("cuda graphs off", reason="decode graphs need the flashinfer backend")
        return []
    if sliding_window:  # a graph replays one planned backend; the window layers need a second
        log.info("cuda graphs off", reason="the model has sliding-window layers")
        return []
    return graph_batch_sizes(min(planned_batch_size(config, "cuda"), config.max_num_seqs), config.num_cuda_graphs)


@dataclass
class CudaWorker:
    attention: AttentionBackend
    kv_cache: torch.Tensor  # num_blocks + 1 blocks: the last is the graphs' padding scratch block
    num_blocks: int
    graphs: DecodeGraphs | None
    static_memory: StaticDeviceMemory | None = None  # the cache's, with static_kv_memory_pointers


@torch.inference_mode()
def _warm_up(model, attention: AttentionBackend, num_tokens: int, rows: int, block_size: int,
             device: torch.device) -> tuple[float, int]:
    """One prompt of num_tokens tokens, then a one-token decode, on a scratch cache.

    Returns (seconds, peak activation bytes beyond the scratch cache).
    """
    mc = model.config
    pages = -(-(num_tokens + 1) // block_size)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    scratch = allocate_kv_cache(mc.num_hidden_layers, pages, block_size, model.num_kv_heads, mc.head_dim,
                                attention.kv_dtype, device, attention.kv_layout)
    scratch_bytes = scratch.numel() * scratch.element_size()
    table_pages = np.arange(pages, dtype=np.int32)
    started = time.perf_counter()
    for qo, kv in ((num_tokens, num_tokens), (1, num_tokens + 1)):
        table = PageTable.build([table_pages], np.array([qo]), np.array([kv]), block_size)
        positions, slots = table.token_positions()
        attention.plan(table)
        ids = torch.zeros(qo, dtype=torch.int64, device=device)
        sampled = torch.arange(qo - min(rows, qo), qo, dtype=torch.int64, device=device)
        logits = model.forward(ids, torch.from_numpy(positions).to(device), torch.from_numpy(slots).to(device),
                               scratch, attention, sampled)
        sample(logits, widest_sampling_batch(logits.shape[0], device))  # the sort of top-k/top-p: its temporaries
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated(device) - base - scratch_bytes
    del scratch
    return seconds, max(0, peak)


def prepare_cuda_worker(model, config: Config, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                        block_size: int, bytes_per_block: int, max_positions: int,
                        agree: Callable[[int], int] = lambda blocks: blocks) -> CudaWorker:
    """kv_dtype: the cache's element (gpu_worker/kv_dtype.py), dtype or float8_e4m3fn. `agree` turns this rank's
    block count into the one every rank holds (TensorParallel.agreed_kv_blocks)."""
    mc = model.config
    # The heads this rank holds (all of them without tensor parallelism).
    attention = create_attention_backend(config.attention_backend, model.num_heads, model.num_kv_heads,
                                         mc.head_dim, device, dtype=dtype, kv_dtype=kv_dtype,
                                         scale=mc.attention_scale)
    warm_tokens = max(1, min(config.max_total_tokens, max_positions - 1))
    rows = min(planned_batch_size(config, "cuda"), warm_tokens)
    seconds, activation = _warm_up(model, attention, warm_tokens, rows, block_size, device)
    log.info("warm-up done (includes FlashInfer JIT compilation on first use)", backend=attention.name,
             seconds=round(seconds, 2), tokens=warm_tokens, activation_mib=round(activation / 2**20, 1))
    sizes = planned_graph_sizes(config, attention, mc.sliding_window)
    headroom = memory_headroom(activation, warm_tokens, sizes, mc.vocab_size)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    own = kv_blocks_for_memory(free, config.gpu_memory_utilization, headroom.total, bytes_per_block,
                               kv_blocks_cap(config, "cuda"))
    if own < 1:
        raise ConfigError(f"config key 'gpu_memory_utilization' = {config.gpu_memory_utilization}: no KV block fits "
                          f"({free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB after weights, "
                          f"{headroom.total / 2**30:.2f} GiB set aside for activations and graphs); raise it, or "
                          "lower max_total_tokens or max_batch_size")
    num_blocks = agree(own)
    log.info("kv cache sized", blocks=num_blocks, free_gib=round(free / 2**30, 2),
             utilization=config.gpu_memory_utilization, max_num_blocks=config.max_num_blocks, **headroom.mib())
    pad_block = num_blocks  # one extra block, never reported to the scheduler
    # Allocated outside inference mode, like the CPU worker's: an inference tensor refuses every
    # in-place write made outside inference mode (a test filling the cache, a swap-in from a
    # caller that is not inside `execute`), and such a write would fail on CUDA alone.
    kv_cache = allocate_kv_cache(mc.num_hidden_layers, num_blocks + 1, block_size, model.num_kv_heads,
                                 mc.head_dim, kv_dtype, "meta" if config.static_kv_memory_pointers else device,
                                 attention.kv_layout)
    static = None
    if config.static_kv_memory_pointers:  # the same tensor over memory whose addresses outlive a suspend
        static = StaticDeviceMemory(kv_cache.numel() * kv_cache.element_size(), device)
        kv_cache = static.tensor(tuple(kv_cache.shape), kv_cache.dtype).zero_()
    graphs = (capture_decode_graphs(model, attention, kv_cache, config, pad_block, block_size, max_positions)
              if sizes else None)
    return CudaWorker(attention, kv_cache, num_blocks, graphs, static)


def capture_decode_graphs(model, attention, kv_cache: torch.Tensor, config: Config, pad_block: int, block_size: int,
                    max_positions: int) -> DecodeGraphs:
    from kernels.flashinfer_backend import FlashInferGraphDecode

    mc = model.config
    sizes = planned_graph_sizes(config, attention, mc.sliding_window)
    pages_per_seq = -(-max_positions // block_size)
    kv_indices = torch.zeros(sizes[-1] * pages_per_seq, dtype=torch.int32, device=kv_cache.device)

    def make_attention(bs: int) -> FlashInferGraphDecode:
        return FlashInferGraphDecode(bs, kv_indices, model.num_heads, model.num_kv_heads, mc.head_dim,
                                     kv_cache.device, model.dtype, attention.workspace, kv_cache.dtype,
                                     scale=mc.attention_scale)

    graphs = DecodeGraphs(model, kv_cache, sizes, pad_block, block_size, make_attention)
    graphs.capture()
    model.take_expert_load()  # the capture's dummy steps routed tokens too: not the served load
    return graphs
