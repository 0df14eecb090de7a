"""Where a CUDA-graph decode step's time goes: the host's preparation, the GPU's replay, the read-back.

    python benchmarks/gpu_step_breakdown.py [--batch-sizes 1,64] [--context 1000] [--steps 50]

The worker's graph decode step (`DecodeGraphs.run`, then the greedy argmax read back to the host, as
`benchmarks/gpu_bench.py` times it whole) is host work (padding the page table, FlashInfer's `plan()`,
the input copies), the replay on the GPU, and the read-back, which waits for the replay. For the same
Llama-3.2-1B-shaped model with random weights as gpu_bench.py, per batch size (medians of `--steps`):

- the whole step (what gpu_bench.py reports);
- `run()` on the host: from an idle GPU to its return (the replay is only launched by then);
- `plan()` alone on the host (the page table already padded);
- the replay alone, between CUDA events (the plan of the step before left in place);
- the read-back alone (argmax and `.tolist()` of logits already computed).

The whole step minus the replay is what the GPU waits for the host. On a machine without a CUDA
device it says so and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.gpu_bench import (  # noqa: E402
    BLOCK_SIZE, DTYPE, LLAMA_1B, decode_table, gpu_unavailable, graph_decode_attention, random_weights)
from kernels.cache_ops import allocate_kv_cache  # noqa: E402


def median_ms(fn, steps: int, sync_before: bool = True) -> float:
    """Median host time of `fn()` in ms, the GPU idle before each call when `sync_before`."""
    times = []
    for _ in range(steps):
        if sync_before:
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--context", type=int, default=1000, help="cached tokens per sequence")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    if (code := gpu_unavailable("gpu_step_breakdown")) is not None:
        return code
    device = torch.device("cuda")

    from gpu_worker.cuda_graphs import DecodeGraphs, pad_decode_table, padded_batch_size
    from gpu_worker.model import LlamaModel
    from kernels.flashinfer_backend import FlashInferPagedAttention

    cfg = LLAMA_1B
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    print(f"device: {torch.cuda.get_device_name(device)}; Llama-3.2-1B shape, random weights, {args.context} cached "
          f"tokens per sequence; medians of {args.steps} steps")
    print(f"{'batch':>6} {'step ms':>8} {'run() host':>11} {'plan()':>8} {'replay':>8} {'read-back':>10} "
          f"{'GPU waits':>10}")
    with torch.inference_mode():
        torch.manual_seed(0)
        model = LlamaModel(cfg, random_weights(cfg, device), device, DTYPE, args.context + args.steps * 8 + 16)
        pages_per_seq = -(-(args.context + 1) // BLOCK_SIZE)
        num_blocks = max(batch_sizes) * pages_per_seq + 1
        kv = allocate_kv_cache(cfg.num_hidden_layers, num_blocks, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim,
                               DTYPE, device).normal_()
        attention = FlashInferPagedAttention(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, device,
                                             DTYPE)
        for b in batch_sizes:
            table = decode_table(b, args.context, 0)
            positions, _ = table.token_positions()
            ids = np.random.default_rng(b).integers(0, cfg.vocab_size, b)
            graphs = DecodeGraphs(model, kv, [b], num_blocks - 1, BLOCK_SIZE,
                                  graph_decode_attention(cfg, pages_per_seq, device, attention.workspace))
            graphs.capture()
            g = graphs.graphs[padded_batch_size(b, graphs.sizes)]
            padded = pad_decode_table(table, g.attention.batch_size, graphs.pad_block)
            for _ in range(3):
                graphs.run(table, ids, positions).argmax(-1).tolist()
            step = median_ms(lambda: graphs.run(table, ids, positions).argmax(-1).tolist(), args.steps)
            host = median_ms(lambda: graphs.run(table, ids, positions), args.steps)
            plan = median_ms(lambda: g.attention.plan(padded), args.steps)
            replay = replay_ms(g.graph, args.steps)
            logits = graphs.run(table, ids, positions)
            read_back = median_ms(lambda: logits.argmax(-1).tolist(), args.steps)
            print(f"{b:>6} {step:>8.2f} {host:>11.2f} {plan:>8.2f} {replay:>8.2f} {read_back:>10.2f} "
                  f"{step - replay:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
