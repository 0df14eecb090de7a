"""Decode steps over long contexts with a bfloat16, an fp8 and an int8 KV cache (config `kv_cache_dtype`, issue 39):
`--batch` sequences of `--context` cached tokens each, every sequence on its own pages, one decode step of the
served model (the engine's model, attention backend and C kernels) timed per round, the arms alternating.
The cached K/V are random values of the model's K/V scale (a decode reads every cached byte whatever they
hold); the pool's block count for the same `kv_cache_memory_gb` is printed per arm.

    python benchmarks/kv_cache_dtype.py [--model FILE] [--batch 16] [--context 4000] [--rounds 5]
                                        [--kv-cache-memory-gb 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

if not __package__:  # run as a file (`python benchmarks/NAME.py`): the repository root on the path, as -m has it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.roofline import cpu_line  # noqa: E402
from hetero_common.config import Config  # noqa: E402
from hetero_common.log import configure_logging  # noqa: E402
from hetero_infer.engine import InferenceEngine  # noqa: E402
from kernels.cache_ops import allocate_kv_cache, as_bytes, stored  # noqa: E402
from kernels.page_table import PageTable  # noqa: E402

BLOCK = 16
ARMS = {"bfloat16 KV": "auto", "fp8 KV": "fp8", "int8 KV": "int8"}


class DecodeCase:
    """One arm: its engine's model, a cache of its element type holding batch x context tokens, the step's plan."""

    def __init__(self, kv_cache_dtype: str, args: argparse.Namespace) -> None:
        config = Config(model=args.model, block_size=BLOCK, kv_cache_dtype=kv_cache_dtype,
                        kv_cache_memory_gb=args.kv_cache_memory_gb, max_num_blocks=1 << 24,
                        max_model_len=args.context + 16).validate()
        self.engine = InferenceEngine(config)
        runner = self.engine.runner
        model, c = runner.model, runner.model.config
        pages = (args.context + 1 + BLOCK - 1) // BLOCK
        self.cache = allocate_kv_cache(c.num_hidden_layers, pages * args.batch, BLOCK, model.num_kv_heads, c.head_dim,
                                       runner.kv_dtype, "cpu", runner.attention.kv_layout)
        gen = torch.Generator().manual_seed(0)
        values = (*self.cache.shape[1:-1], c.head_dim)
        for layer in range(c.num_hidden_layers):  # layer by layer: one float32 layer at a time in memory
            as_bytes(self.cache[layer]).copy_(stored(torch.randn(values, generator=gen) * 2, runner.kv_dtype))
        tables = [np.arange(b * pages, (b + 1) * pages, dtype=np.int32) for b in range(args.batch)]
        self.table = PageTable.build(tables, np.ones(args.batch, dtype=np.int64),
                                     np.full(args.batch, args.context + 1, dtype=np.int64), BLOCK)
        positions, slots = self.table.token_positions()
        self.inputs = (torch.full((args.batch,), 100, dtype=torch.int64), torch.from_numpy(positions),
                       torch.from_numpy(slots))
        self.num_blocks, self.kv_dtype = runner.num_blocks, runner.kv_dtype

    @torch.inference_mode()
    def step_seconds(self) -> float:
        runner = self.engine.runner
        started = time.perf_counter()
        runner.attention.plan(self.table)
        runner.model.forward(*self.inputs, self.cache, runner.attention, torch.arange(len(self.inputs[0])))
        return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    args = parser.parse_args()
    configure_logging("warning", "console")
    cases = {label: DecodeCase(name, args) for label, name in ARMS.items()}
    times: dict[str, list[float]] = {label: [] for label in cases}
    for case in cases.values():
        case.step_seconds()  # warm-up
    for _ in range(args.rounds):
        for label, case in cases.items():
            times[label].append(case.step_seconds())
    print(cpu_line())
    print(f"decode steps of {args.batch} sequences x {args.context} cached tokens, {args.rounds} alternating rounds; "
          f"pool blocks at kv_cache_memory_gb {args.kv_cache_memory_gb}")
    base = statistics.median(times["bfloat16 KV"])
    for label, case in cases.items():
        median = statistics.median(times[label])
        print(f"  {label:<12} ({str(case.kv_dtype)[6:]}): step median {median * 1e3:8.1f} ms, best "
              f"{min(times[label]) * 1e3:8.1f} ms, {base / median:.2f}x bfloat16's speed; {case.num_blocks} blocks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
