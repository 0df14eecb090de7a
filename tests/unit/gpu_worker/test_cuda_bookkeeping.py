"""The CUDA worker's start-up and graph capture, run on the CPU with torch.cuda's calls replaced
by stand-ins: what they keep alive, what they run in inference mode, how often they warm up.

The kernels are not tested here (tests/gpu/test_gpu.py does that on a GPU): a recording model
stands in for the Llama, and the stand-in graph checks at replay that every tensor the
captured forward read still exists, as a real graph silently needs.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gpu_worker.cuda import cuda_graphs, cuda_setup
from gpu_worker.cuda.cuda_graphs import DecodeGraphs
from hetero_common.config import Config
from kernels.page_table import PageTable

VOCAB = 11


class FakeStream:
    def __init__(self, device: object = None) -> None:
        pass

    def wait_stream(self, other: object) -> None:
        pass


class FakeGraph:
    capturing = False

    def __init__(self) -> None:
        self.read: list[weakref.ref] = []  # what the captured forward read, as the GPU would: by address

    def pool(self) -> tuple[str, int]:
        return ("pool", id(self))

    def replay(self) -> None:
        freed = [i for i, ref in enumerate(self.read) if ref() is None]
        assert not freed, f"replay reads freed tensors (arguments {freed} of the captured forward)"


@contextlib.contextmanager
def fake_capture(graph: FakeGraph, pool: object = None):
    FakeGraph.capturing = True
    RecordingModel.capture_target = graph
    try:
        yield
    finally:
        FakeGraph.capturing = False


class RecordingModel:
    capture_target: FakeGraph | None = None

    def __init__(self) -> None:
        self.config = SimpleNamespace(num_hidden_layers=2, head_dim=8, vocab_size=VOCAB, attention_scale=8 ** -0.5,
                                      sliding_window=0)
        self.num_heads, self.num_kv_heads, self.dtype = 4, 2, torch.float32
        self.calls: list[tuple[bool, int]] = []  # (during capture, batch size)

    def forward(self, input_ids, positions, slots, kv_cache, attention, rows) -> torch.Tensor:
        self.calls.append((FakeGraph.capturing, len(input_ids)))
        if FakeGraph.capturing:
            self.capture_target.read = [weakref.ref(t) for t in (input_ids, positions, slots, kv_cache, rows)]
        return torch.eye(VOCAB)[torch.arange(len(rows)) * 3 % VOCAB]  # row i's largest logit: token 3i mod VOCAB


class FakeAttention:
    name = "flashinfer"

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.planned: list[PageTable] = []

    def plan(self, table: PageTable) -> None:
        assert table.batch_size == self.batch_size
        self.planned.append(table)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"Stream": FakeStream, "stream": lambda s: contextlib.nullcontext(),
                        "current_stream": lambda device=None: FakeStream(), "CUDAGraph": FakeGraph,
                        "graph": fake_capture, "synchronize": lambda device=None: None,
                        "empty_cache": lambda: None, "memory_allocated": lambda device=None: 0,
                        "reset_peak_memory_stats": lambda device=None: None,
                        "max_memory_allocated": lambda device=None: 1000,
                        "mem_get_info": lambda device=None: (2**30, 2**31)}.items():
        monkeypatch.setattr(torch.cuda, name, value)


def _captured(sizes: list[int]) -> tuple[DecodeGraphs, RecordingModel]:
    model = RecordingModel()
    kv_cache = torch.zeros(2, 9, 2, 4, 2, 8)
    graphs = DecodeGraphs(model, kv_cache, sizes, pad_block=8, block_size=4, make_attention=FakeAttention)
    graphs.capture()
    gc.collect()  # what only the capture's locals held is gone now, as the caching allocator would reuse it
    return graphs, model


def test_graph_record_keeps_every_tensor_the_captured_forward_reads(fake_cuda: None) -> None:
    graphs, _ = _captured([1, 2, 4])
    for bs, g in graphs.graphs.items():
        freed = [i for i, ref in enumerate(g.graph.read) if ref() is None]
        assert not freed, f"graph {bs}: arguments {freed} of the captured forward were freed after capture"
        g.graph.replay()
    for bs, g in graphs.graphs.items():
        held = (*g.static_inputs(), graphs.kv_cache)
        assert all(any(ref() is t for t in held) for ref in g.graph.read), \
            f"graph {bs}: a captured input is held by something other than its record"


def test_three_warm_up_runs_before_each_capture(fake_cuda: None) -> None:
    _, model = _captured([1, 2, 4])
    assert model.calls == [(False, 4)] * cuda_graphs.WARMUP_RUNS + [(True, 4)] + \
        [(False, 2)] * cuda_graphs.WARMUP_RUNS + [(True, 2)] + [(False, 1)] * cuda_graphs.WARMUP_RUNS + [(True, 1)]
    assert cuda_graphs.WARMUP_RUNS == 3


def test_replay_pads_the_batch_and_works_outside_inference_mode(fake_cuda: None) -> None:
    graphs, _ = _captured([1, 2, 4])
    table = PageTable.build([np.array([0, 1]), np.array([2]), np.array([3])], np.ones(3), np.array([6, 1, 3]), 4)
    logits = graphs.run(table, np.array([5, 6, 7]), np.array([5, 0, 2]))  # not under inference_mode
    g = graphs.graphs[4]
    assert logits.shape == (3, VOCAB) and g.attention.planned[-1].batch_size == 4
    assert graphs.greedy_tokens().tolist() == logits.argmax(-1).tolist() == [0, 3, 6]  # taken in the graph
    assert g.input_ids.tolist() == [5, 6, 7, 0] and g.positions.tolist() == [5, 0, 2, 0]


def test_cuda_worker_kv_cache_takes_writes_outside_inference_mode(fake_cuda: None) -> None:
    """The cache `prepare_cuda_worker` returns is an ordinary tensor, as the CPU worker's is:
    tests/gpu/test_gpu.py fills it with `normal_()` outside inference mode."""
    model = RecordingModel()
    config = Config(attention_backend="torch", max_total_tokens=16, max_batch_size=4, max_num_blocks=8).validate()
    worker = cuda_setup.prepare_cuda_worker(model, config, torch.device("cpu"), torch.float32, torch.float32, block_size=4,
                                            bytes_per_block=1024, max_positions=64)
    assert worker.graphs is None and worker.num_blocks == 8 and worker.kv_cache.shape[1] == 9
    assert not worker.kv_cache.is_inference()
    worker.kv_cache.normal_()  # raised "Inplace update to inference tensor outside InferenceMode"
    assert model.calls == [(False, 16), (False, 1)]  # the warm-up: a prompt of max_total_tokens, then a decode


def test_headroom_sets_aside_what_the_graphs_hold() -> None:
    """An 8B-shaped worker at batch 256 (128K vocabulary): the graphs' logits alone take about 2 GiB, which the
    warm-up's peak does not include; the pool is sized without them."""
    sizes = cuda_graphs.graph_batch_sizes(256)
    headroom = cuda_setup.memory_headroom(2**30, 4096, sizes, 128_256)
    assert headroom.graph_outputs == sum(sizes) * 128_256 * 4 and 2.0 < headroom.graph_outputs / 2**30 < 2.1
    assert headroom.graph_activations == 2**30 // 4096 * 256  # the eager peak's share of the largest graph
    assert headroom.graph_workspaces == len(sizes) * cuda_setup.WRAPPER_INT_WORKSPACE_BYTES
    assert headroom.total == 2**30 + headroom.graph_outputs + headroom.graph_activations + headroom.graph_workspaces
    assert cuda_setup.memory_headroom(2**30, 4096, [], 128_256).total == 2**30  # graphs off: the peak alone
    gib = 2**30
    assert cuda_setup.kv_blocks_for_memory(80 * gib, 0.9, headroom.total, gib // 8, 10**6) == \
        (int(80 * gib * 0.9) - headroom.total) // (gib // 8)


class GraphAttention:
    """A backend named as FlashInfer's, so the worker plans decode graphs; its steps compute nothing."""

    name, kv_layout, kv_dtype = "flashinfer", "NHD", torch.float32

    def plan(self, table: PageTable) -> None:
        pass


def test_the_pool_is_sized_after_the_headroom_and_agreed_across_ranks(fake_cuda: None, monkeypatch) -> None:
    """prepare_cuda_worker with a FlashInfer-named backend (graphs on): free memory less the warm-up's peak, the
    graphs' headroom, then the ranks' agreement; the warm-up samples through the sampler's widest path."""
    sampled: list[object] = []
    monkeypatch.setattr(cuda_setup, "create_attention_backend", lambda *a, **k: GraphAttention())
    monkeypatch.setattr(cuda_setup, "capture_decode_graphs", lambda *a: "captured")
    monkeypatch.setattr(cuda_setup, "sample", lambda logits, batch: sampled.append(batch))
    scratch = 2 * 5 * 2 * 4 * 2 * 8 * 4  # the warm-up's cache: 2 layers, 5 blocks of 4 tokens, K and V, 2 x 8 floats
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: scratch + 4096)
    model = RecordingModel()
    config = Config(max_total_tokens=16, max_batch_size=4, max_num_blocks=10**6).validate()
    agreed: list[int] = []
    worker = cuda_setup.prepare_cuda_worker(model, config, torch.device("cpu"), torch.float32, torch.float32,
                                            block_size=4, bytes_per_block=1024, max_positions=64,
                                            agree=lambda own: agreed.append(own) or own // 2)
    headroom = cuda_setup.memory_headroom(4096, 16, [1, 2, 4], VOCAB)  # a peak of 4096 bytes beyond the scratch
    own = (int(2**30 * 0.9) - headroom.total) // 1024
    assert agreed == [own] and worker.num_blocks == own // 2 and worker.graphs == "captured"
    assert [len(b.seeds) for b in sampled] == [4, 1]  # the prompt's sampled rows, then the decode's
    assert all(min(b.temperature) > 0 and max(b.top_p) < 1 and min(b.top_k) > 0 and b.want_logprobs for b in sampled)
