"""The KV block count a replica's tensor-parallel ranks agree on: the smallest any rank can hold.

Each rank sizes its own pool (its own free memory on CUDA, its budget on the CPU) and the scheduler
hands out block ids up to rank 0's count; a rank with fewer blocks would get ids past its cache. Two
real gloo ranks here, each with its own count."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import torch

from gpu_worker.cpu.worker_setup import allocate_cpu_kv_cache
from gpu_worker.parallel.tensor_parallel import TensorParallel
from hetero_common.config import Config
from kernels.cache_ops import kv_row_bytes


def _rank(rank: int, init_file: str, own: int, out: "multiprocessing.Queue[tuple[int, int]]") -> None:
    tp = TensorParallel.initialize(rank, 2, init_file, torch.device("cpu"))
    try:
        out.put((rank, tp.agreed_kv_blocks(own, torch.device("cpu"))))
    finally:
        tp.shutdown()


def test_ranks_agree_on_the_smallest_block_count(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    ranks = [context.Process(target=_rank, args=(r, str(tmp_path / "rendezvous"), own, out))
             for r, own in enumerate((1200, 700))]
    for p in ranks:
        p.start()
    agreed = dict(out.get(timeout=120) for _ in ranks)
    for p in ranks:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert agreed == {0: 700, 1: 700}
    assert TensorParallel().agreed_kv_blocks(1200, torch.device("cpu")) == 1200  # one rank: its own


class _Model:
    config = type("C", (), {"num_hidden_layers": 2, "attention_scale": 8 ** -0.5})()
    num_heads, num_kv_heads, dtype = 4, 2, torch.float32


def test_the_cpu_pool_is_allocated_at_the_agreed_count() -> None:
    config = Config(attention_backend="torch", max_num_blocks=64, block_size=4).validate()
    per_block = 2 * 2 * 4 * 2 * kv_row_bytes(torch.float32, 8)
    blocks, _, cache = allocate_cpu_kv_cache(config, _Model(), 8, torch.float32, per_block, agree=lambda own: own - 24)
    assert blocks == 40 and cache.shape[1] == 40
