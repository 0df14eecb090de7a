"""Suspend and resume of the KV cache (gpu_worker/kv_suspension.py): what each mode keeps, and, with
`static_kv_memory_pointers`, the same tensor over memory unmapped and mapped again (a stand-in for CUDA's
virtual memory API here; tests/gpu/test_gpu_worker_paths.py runs the real one), so no graph is recaptured."""

from __future__ import annotations

import ctypes
import gc
import weakref
from pathlib import Path

import pytest
import torch

from gpu_worker.cuda.static_kv_memory import CUmemAccessDesc, CUmemAllocationProp
from gpu_worker.kv_suspension import KVSuspension
from hetero_common.config import Config
from hetero_common.errors import ConfigError


class StandInMemory:
    """Records map/unmap; 'unmapping' scribbles over the tensor, as memory mapped anew holds anything."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.calls = tensor, []

    def map(self) -> None:
        self.calls.append("map")

    def unmap(self) -> None:
        self.calls.append("unmap")
        self.tensor.fill_(-7.0)


@pytest.mark.parametrize("mode", ["offload", "recompute"])
def test_static_memory_keeps_the_tensor_and_the_graphs(mode: str) -> None:
    cache = torch.randn(2, 3, 4)
    before = cache.clone()
    memory = StandInMemory(cache)
    suspension = KVSuspension(memory)
    held, released = suspension.suspend(mode, cache, had_graphs=True)
    assert held is cache and released == cache.numel() * 4 and memory.calls == ["unmap"]
    assert not suspension.recapture_graphs  # the addresses stay: the graphs replay as captured
    resumed, resumed_mode = suspension.resume(held)
    assert resumed is cache and resumed_mode == mode and memory.calls == ["unmap", "map"]
    assert torch.equal(cache, before if mode == "offload" else torch.zeros_like(before))


def test_without_static_memory_the_cache_goes_and_the_graphs_with_it() -> None:
    cache = torch.randn(2, 3, 4)
    suspension = KVSuspension()
    held, released = suspension.suspend("offload", cache, had_graphs=True)
    assert held.numel() == 0 and released == cache.numel() * 4 and suspension.recapture_graphs
    resumed, _ = suspension.resume(held)
    assert torch.equal(resumed, cache) and suspension.recapture_graphs  # the runner recaptures on resume
    assert suspension.suspend("persist", resumed, had_graphs=True) == (resumed, 0)
    assert not suspension.recapture_graphs  # persist releases nothing: the graphs stay


def test_driver_structs_have_cuda_h_layouts() -> None:
    assert ctypes.sizeof(CUmemAllocationProp) == 32 and CUmemAllocationProp.win32HandleMetaData.offset == 16
    assert ctypes.sizeof(CUmemAccessDesc) == 12 and CUmemAccessDesc.flags.offset == 8


def test_the_cpu_worker_refuses_static_pointers(tiny_llama_dir: Path) -> None:
    from gpu_worker.runner import ModelRunner

    with pytest.raises(ConfigError, match="static_kv_memory_pointers"):
        ModelRunner(Config(model=str(tiny_llama_dir), dtype="float32", static_kv_memory_pointers=True).validate())


@pytest.mark.parametrize("mode", ["offload", "recompute"])
def test_a_suspended_runner_holds_no_reference_to_its_cache(tiny_llama_dir: Path, mode: str) -> None:
    """The memory goes back because nothing holds the cache once it is suspended: the tensor is freed
    when the runner drops it, not at a later collection (what tests/stack/test_tensor_parallel.py
    relies on for every rank). `offload` keeps a host copy, a tensor of its own."""
    from gpu_worker.runner import ModelRunner

    config = Config(model=str(tiny_llama_dir), dtype="float32", max_num_blocks=64, block_size=16)
    runner = ModelRunner(config.validate())
    cache = weakref.ref(runner.kv_cache)
    size = runner.kv_cache.numel() * runner.kv_cache.element_size()
    gc.disable()  # freed by its reference count, at once
    try:
        assert runner.suspend_kv_cache(mode) == size
        assert cache() is None
    finally:
        gc.enable()
    runner.resume_kv_cache()
    assert runner.kv_cache.numel() * runner.kv_cache.element_size() == size
