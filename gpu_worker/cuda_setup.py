"""A worker on a CUDA device: warm-up (FlashInfer JIT), KV pool sized from free memory, decode graphs.

Order matters: the weights are already on the device; a warm-up pass (one prompt of the
step's token budget, then a decode) compiles FlashInfer's kernels and measures the peak
activation memory; the KV pool then takes `gpu_memory_utilization` of the memory still free,
less that peak; decode graphs are captured last, over the final KV cache tensor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import structlog
import torch

from gpu_worker.cuda_graphs import DecodeGraphs, graph_batch_sizes
from hetero_common.config import Config
from hetero_common.errors import ConfigError
from kernels.attention_backend import AttentionBackend, create_attention_backend
from kernels.cache_ops import allocate_kv_cache
from kernels.page_table import PageTable

log = structlog.get_logger("gpu_worker.cuda_setup")


def kv_blocks_for_memory(free_bytes: int, utilization: float, activation_bytes: int, bytes_per_block: int,
                         max_num_blocks: int) -> int:
    """Blocks that fit in utilization x free memory once the activation peak is set aside (capped)."""
    budget = int(free_bytes * utilization) - activation_bytes
    return max(0, min(max_num_blocks, budget // bytes_per_block))


@dataclass
class CudaWorker:
    attention: AttentionBackend
    kv_cache: torch.Tensor  # num_blocks + 1 blocks: the last is the graphs' padding scratch block
    num_blocks: int
    graphs: DecodeGraphs | None


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
        torch.softmax(logits, dim=-1)  # the sampler's largest temporary
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated(device) - base - scratch_bytes
    del scratch
    return seconds, max(0, peak)


def prepare_cuda_worker(model, config: Config, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                        block_size: int, bytes_per_block: int, max_positions: int) -> CudaWorker:
    """kv_dtype: the cache's element (gpu_worker/kv_dtype.py), dtype or float8_e4m3fn."""
    mc = model.config
    # The heads this rank holds (all of them without tensor parallelism).
    attention = create_attention_backend(config.attention_backend, model.num_heads, model.num_kv_heads,
                                         mc.head_dim, device, dtype=dtype, kv_dtype=kv_dtype)
    warm_tokens = max(1, min(config.max_total_tokens, max_positions - 1))
    rows = min(config.max_batch_size, warm_tokens)
    seconds, activation = _warm_up(model, attention, warm_tokens, rows, block_size, device)
    log.info("warm-up done (includes FlashInfer JIT compilation on first use)", backend=attention.name,
             seconds=round(seconds, 2), tokens=warm_tokens, activation_mib=round(activation / 2**20, 1))
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    num_blocks = kv_blocks_for_memory(free, config.gpu_memory_utilization, activation, bytes_per_block,
                                      config.max_num_blocks)
    if num_blocks < 1:
        raise ConfigError(f"config key 'gpu_memory_utilization' = {config.gpu_memory_utilization}: no KV block fits "
                          f"({free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB after weights, "
                          f"{activation / 2**30:.2f} GiB activations); raise it or lower max_total_tokens")
    pad_block = num_blocks  # one extra block, never reported to the scheduler
    # Allocated outside inference mode, like the CPU worker's: an inference tensor refuses every
    # in-place write made outside inference mode (a test filling the cache, a swap-in from a
    # caller that is not inside `execute`), and such a write would fail on CUDA alone.
    kv_cache = allocate_kv_cache(mc.num_hidden_layers, num_blocks + 1, block_size, model.num_kv_heads,
                                 mc.head_dim, kv_dtype, device, attention.kv_layout)
    graphs = None
    if not config.enable_cuda_graphs:
        log.info("cuda graphs off", reason="enable_cuda_graphs is false")
    elif attention.name != "flashinfer":
        log.info("cuda graphs off", reason="decode graphs need the flashinfer backend")
    else:
        graphs = capture_decode_graphs(model, attention, kv_cache, config, pad_block, block_size, max_positions)
    return CudaWorker(attention, kv_cache, num_blocks, graphs)


def capture_decode_graphs(model, attention, kv_cache: torch.Tensor, config: Config, pad_block: int, block_size: int,
                    max_positions: int) -> DecodeGraphs:
    from kernels.flashinfer_backend import FlashInferGraphDecode

    mc = model.config
    sizes = graph_batch_sizes(min(config.max_batch_size, config.max_num_seqs), config.num_cuda_graphs)
    pages_per_seq = -(-max_positions // block_size)
    kv_indices = torch.zeros(sizes[-1] * pages_per_seq, dtype=torch.int32, device=kv_cache.device)

    def make_attention(bs: int) -> FlashInferGraphDecode:
        return FlashInferGraphDecode(bs, kv_indices, model.num_heads, model.num_kv_heads, mc.head_dim,
                                     kv_cache.device, model.dtype, attention.workspace, kv_cache.dtype)

    graphs = DecodeGraphs(model, kv_cache, sizes, pad_block, block_size, make_attention)
    graphs.capture()
    return graphs
