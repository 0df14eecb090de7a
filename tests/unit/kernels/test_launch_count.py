"""Kernel launches per decoder layer of the GPU worker's decode step, counted on the CPU (issue 55).

The fused element-wise path (config `use_flashinfer_fused_rope`, `LlamaModel.elementwise == "flashinfer"`) exists
to cut launches: at batch 1 a decode step is bound by them. A change that slips a torch op back into a layer
(a `.contiguous()` copy, an unfused residual add) costs a launch per layer on every step, and nothing but a GPU
profile would show it. Here the model's forward runs on the CPU under a TorchDispatchMode that counts aten ops,
with FlashInfer's kernels replaced by stand-ins that each count as one launch and compute the same result in
torch (so shapes, and every op downstream, are the real ones). The stand-ins sit where FlashInfer begins: the JIT
modules' functions under kernels/flashinfer_fused.py, and `flashinfer.append_paged_kv_cache` and the decode
wrapper under kernels/flashinfer_backend.py; so our own glue around them (the `.contiguous()` of q before
attention, the `empty` of an output) runs for real and is counted as the GPU would run it.

Per layer = (ops of a 2-layer model) - (ops of a 1-layer model): the embedding, final norm, LM head and the
fused path's last residual add are the same in both and drop out.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from gpu_worker.cpu import fused_ops
from gpu_worker.models.checkpoint import load_checkpoint
from gpu_worker.model_config import ModelConfig
from gpu_worker.models.model import LlamaModel
from gpu_worker.models.model_build import fused_elementwise
from hetero_common.config import Config
from hetero_infer.bench.harness import make_random_llama
from kernels import flashinfer_fused
from kernels.cache_ops import allocate_kv_cache
from kernels.flashinfer_backend import FlashInferPagedAttention
from kernels.page_table import PageTable

aten = torch.ops.aten

# Ops that launch no kernel on a GPU, left out of the count. Views (and `detach`) only make a new tensor header
# over the same storage: aten.reshape and aten.contiguous never reach the dispatch mode themselves (they are
# composite: a view, or a clone when a copy is needed, which is counted). Allocations (`empty*`) take memory from
# the caching allocator and run nothing on the device.
NO_LAUNCH = frozenset({
    aten.view, aten._unsafe_view, aten.t, aten.slice, aten.select, aten.expand, aten.unsqueeze, aten.squeeze,
    aten.as_strided, aten.detach, aten.alias, aten.split, aten.split_with_sizes, aten.chunk, aten.unbind,
    aten.permute, aten.transpose, aten.reshape,
    aten.lift_fresh,  # a tensor made from host data taken as it is (no copy)
    aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty,
})

# The fused path's layer: input RMSNorm (its residual add fused in), q/k/v product, RoPE in place, K/V append,
# q's copy out of the q/k/v buffer (`run`'s q.contiguous()), decode attention, o product, post-attention RMSNorm
# (residual fused), gate/up product, SiLU·mul, down product.
FUSED_LAUNCHES_PER_LAYER = 11
# torch's element-wise ops: each RMSNorm is eight (float, pow, mean, +eps, rsqrt, *, back to the dtype, *weight),
# RoPE seven (four products, a difference, a sum, the cat), two residual adds, SiLU and the product apart.
UNFUSED_LAUNCHES_PER_LAYER = 34

BLOCK_SIZE = 16
KV_LENS = (5, 17, 40)  # a decode step of three sequences (17: the first slot of a second page)


class LaunchCounter(TorchDispatchMode):
    """Counts aten ops that launch a kernel, plus one per stand-in (`launch`); ops inside `uncounted` are not."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: Counter[str] = Counter()
        self._paused = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not self._paused and func.overloadpacket not in NO_LAUNCH:
            self.launches[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    def launch(self, name: str) -> None:
        self.launches[f"flashinfer.{name}"] += 1

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """A stand-in's own torch arithmetic: on the GPU it is one FlashInfer kernel, counted by `launch`."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @property
    def total(self) -> int:
        return sum(self.launches.values())


class _Counting:
    """The counter the stand-ins report to: the one of the forward being counted (None: count nothing)."""

    counter: LaunchCounter | None = None

    @classmethod
    @contextmanager
    def kernel(cls, name: str) -> Iterator[None]:
        if cls.counter is None:
            yield
            return
        cls.counter.launch(name)
        with cls.counter.uncounted():
            yield


# --- stand-ins for the fused element-wise JIT modules (kernels/flashinfer_fused.py's _norm, _rope, _silu_and_mul)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _rmsnorm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, enable_pdl: bool) -> None:
    with _Counting.kernel("rmsnorm"):
        out.copy_(_rms(x, weight, eps))


def _fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       enable_pdl: bool) -> None:
    """residual += x; x = RMSNorm(residual) * weight (FlashInfer's argument order: input, residual)."""
    with _Counting.kernel("fused_add_rmsnorm"):
        residual.add_(x)
        x.copy_(_rms(residual, weight, eps))


def _rope_cos_sin(q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor, table: torch.Tensor,
                  positions: torch.Tensor, interleave: bool) -> None:
    """Rotate-half RoPE from the [positions, head_dim] float32 cos|sin table, into q_out/k_out (here q, k)."""
    assert not interleave
    with _Counting.kernel("apply_rope_pos_ids_cos_sin_cache"):
        cos, sin = table[positions.long()].chunk(2, dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        for x, out in ((q, q_out), (k, k_out)):
            x1, x2 = x.float().chunk(2, dim=-1)
            out.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))


def _silu_and_mul(out: torch.Tensor, gate_up: torch.Tensor, enable_pdl: bool) -> None:
    with _Counting.kernel("silu_and_mul"):
        gate, up = gate_up.chunk(2, dim=-1)
        out.copy_(F.silu(gate) * up)


JIT_STAND_INS: dict[str, types.SimpleNamespace] = {
    "_norm": types.SimpleNamespace(rmsnorm=_rmsnorm, fused_add_rmsnorm=_fused_add_rmsnorm),
    "_rope": types.SimpleNamespace(apply_rope_pos_ids_cos_sin_cache=_rope_cos_sin),
    "_silu_and_mul": types.SimpleNamespace(silu_and_mul=_silu_and_mul),
}


# --- a stand-in `flashinfer` module for kernels/flashinfer_backend.py: the paged-KV append and the wrappers


def _append_paged_kv_cache(key: torch.Tensor, value: torch.Tensor, batch: torch.Tensor, positions: torch.Tensor,
                           cache: torch.Tensor, kv_indices: torch.Tensor, kv_indptr: torch.Tensor,
                           last_page_len: torch.Tensor, kv_layout: str = "NHD") -> None:
    assert kv_layout == "NHD"
    with _Counting.kernel("append_paged_kv_cache"):
        block = cache.shape[2]
        pos = positions.long()
        pages = kv_indices.long()[kv_indptr.long()[batch.long()] + pos // block]
        cache[pages, 0, pos % block] = key
        cache[pages, 1, pos % block] = value


def _paged_attention(q: torch.Tensor, cache: torch.Tensor, qo_indptr: list[int], kv_indptr: list[int],
                     kv_indices: list[int], last_page_len: list[int]) -> torch.Tensor:
    """Causal attention of each sequence's query rows over its pages (NHD cache), bottom-right aligned."""
    out = torch.empty_like(q)
    block, kv_heads, dim = cache.shape[2], cache.shape[3], cache.shape[4]
    group = q.shape[1] // kv_heads
    for b in range(len(qo_indptr) - 1):
        pages = kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
        kv_len = (len(pages) - 1) * block + last_page_len[b]
        kv = cache[pages].float()  # [pages, 2, block, heads, dim]
        k, v = (kv[:, i].reshape(-1, kv_heads, dim)[:kv_len].repeat_interleave(group, dim=1) for i in (0, 1))
        rows = q[qo_indptr[b]:qo_indptr[b + 1]].float()
        scores = torch.einsum("qhd,khd->hqk", rows, k) * dim ** -0.5
        first = kv_len - rows.shape[0]  # the position of the first query row
        mask = torch.arange(kv_len)[None, :] > (first + torch.arange(rows.shape[0]))[:, None]
        weights = scores.masked_fill(mask, float("-inf")).softmax(-1)
        out[qo_indptr[b]:qo_indptr[b + 1]] = torch.einsum("hqk,khd->qhd", weights, v).to(q.dtype)
    return out


class _Wrapper:
    """FlashInfer's decode or prefill wrapper: `plan` keeps the page table, `run` is one launch."""

    kind = ""

    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", **options: Any) -> None:
        assert kv_layout == "NHD"
        self._plan: tuple[list[int], ...] = ()

    def _keep(self, qo_indptr: list[int], kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
              last_page_len: torch.Tensor) -> None:
        self._plan = (qo_indptr, kv_indptr.tolist(), kv_indices.tolist(), last_page_len.tolist())

    def run(self, q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        with _Counting.kernel(f"{self.kind}.run"):
            return _paged_attention(q, cache, *self._plan)


class _DecodeWrapper(_Wrapper):
    kind = "decode"

    def plan(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, last_page_len: torch.Tensor, *shape: int,
             **options: Any) -> None:
        self._keep(list(range(len(kv_indptr))), kv_indptr, kv_indices, last_page_len)


class _PrefillWrapper(_Wrapper):
    kind = "prefill"

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
             last_page_len: torch.Tensor, *shape: int, **options: Any) -> None:
        self._keep(qo_indptr.tolist(), kv_indptr, kv_indices, last_page_len)


FLASHINFER_STAND_IN = types.SimpleNamespace(
    BatchDecodeWithPagedKVCacheWrapper=_DecodeWrapper, BatchPrefillWithPagedKVCacheWrapper=_PrefillWrapper,
    append_paged_kv_cache=_append_paged_kv_cache, __version__="stand-in")


# --- the model, the step, the count


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A 2-layer Llama of a served model's head size (64: one FlashInfer instantiates), in bfloat16 as on a GPU;
    models of fewer layers read its first layers."""
    directory = make_random_llama(tmp_path_factory.mktemp("llama"), hidden=256, intermediate=512, layers=2, heads=4,
                                  kv_heads=2, seed=5)
    return load_checkpoint(directory, dtype=torch.bfloat16)


@pytest.fixture
def gpu_like(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the GPU worker's model sees on CUDA, on the CPU: FlashInfer's fused kernels available (the CPU's C
    kernels not), their JIT modules and the `flashinfer` module replaced by the stand-ins above."""
    monkeypatch.setattr(flashinfer_fused, "available", lambda device, dtype: True)
    monkeypatch.setattr(fused_ops, "available", lambda device, dtype: False)
    for name, module in JIT_STAND_INS.items():
        monkeypatch.setattr(flashinfer_fused, name, lambda module=module: module)
    monkeypatch.setitem(sys.modules, "flashinfer", FLASHINFER_STAND_IN)


def build(checkpoint: tuple[ModelConfig, dict[str, torch.Tensor]], layers: int, fused_rope: bool) -> LlamaModel:
    """The model as gpu_worker/models/model_build.py builds it on CUDA (no CPU packing), with `layers` of the layers."""
    config, weights = checkpoint
    fused = fused_elementwise(Config(use_flashinfer_fused_rope=fused_rope).validate(), torch.device("cuda"))
    model = LlamaModel(dataclasses.replace(config, num_hidden_layers=layers), weights, torch.device("cpu"),
                       torch.bfloat16, max_positions=128, fused=fused)
    assert model.elementwise == ("flashinfer" if fused_rope else "torch")
    return model


def decode_step(model: LlamaModel, seed: int = 0) -> Callable[[], torch.Tensor]:
    """A planned decode step of len(KV_LENS) sequences over a randomly filled cache: a function running its forward."""
    c, g = model.config, torch.Generator().manual_seed(seed)
    pages = np.arange(sum(-(-n // BLOCK_SIZE) for n in KV_LENS), dtype=np.int32)[::-1].copy()  # not in order
    tables, start = [], 0
    for n in KV_LENS:
        tables.append(pages[start:start + -(-n // BLOCK_SIZE)])
        start += len(tables[-1])
    table = PageTable.build(tables, np.ones(len(KV_LENS)), np.array(KV_LENS), BLOCK_SIZE)
    cache = allocate_kv_cache(c.num_hidden_layers, len(pages), BLOCK_SIZE, c.num_key_value_heads, c.head_dim,
                              torch.bfloat16, "cpu")
    cache.copy_(torch.randn(cache.shape, generator=g))  # the sequences' earlier tokens
    attention = FlashInferPagedAttention(c.num_attention_heads, c.num_key_value_heads, c.head_dim, "cpu",
                                         torch.bfloat16, workspace=torch.empty(0, dtype=torch.uint8))
    attention.plan(table)  # outside the count: the runner plans before the forward
    positions, slots = (torch.from_numpy(a) for a in table.token_positions())
    ids = torch.randint(0, c.vocab_size, (len(KV_LENS),), generator=g)
    rows = torch.arange(len(KV_LENS))
    return lambda: model.forward(ids, positions, slots, cache, attention, rows)


def count(step: Callable[[], torch.Tensor]) -> tuple[LaunchCounter, torch.Tensor]:
    with LaunchCounter() as counter:
        _Counting.counter = counter
        try:
            logits = step()
        finally:
            _Counting.counter = None
    return counter, logits


def per_layer(checkpoint: tuple[ModelConfig, dict[str, torch.Tensor]], fused_rope: bool) -> Counter[str]:
    """The launches one more layer adds to a decode step, by op."""
    one, _ = count(decode_step(build(checkpoint, 1, fused_rope)))
    two, _ = count(decode_step(build(checkpoint, 2, fused_rope)))
    layer = two.launches.copy()
    layer.subtract(one.launches)
    assert all(n >= 0 for n in layer.values()), layer
    return +layer


def test_the_fused_layer_launches_what_it_is_pinned_to(checkpoint, gpu_like) -> None:
    layer = per_layer(checkpoint, fused_rope=True)
    assert sum(layer.values()) == FUSED_LAUNCHES_PER_LAYER, dict(layer)
    assert layer == Counter({"aten.mm": 4, "aten.clone": 1, "flashinfer.fused_add_rmsnorm": 2,
                             "flashinfer.apply_rope_pos_ids_cos_sin_cache": 1, "flashinfer.append_paged_kv_cache": 1,
                             "flashinfer.decode.run": 1, "flashinfer.silu_and_mul": 1})


def test_the_unfused_layer_launches_what_it_is_pinned_to(checkpoint, gpu_like) -> None:
    layer = per_layer(checkpoint, fused_rope=False)
    assert sum(layer.values()) == UNFUSED_LAUNCHES_PER_LAYER, dict(layer)
    assert layer == Counter({"aten._to_copy": 4, "aten.pow": 2, "aten.mean": 2, "aten.add": 3, "aten.rsqrt": 2,
                             "aten.mul": 8, "aten.sub": 1, "aten.cat": 1, "aten.mm": 4, "aten.clone": 1,
                             "aten.add_": 2, "aten.silu_": 1, "aten.mul_": 1, "flashinfer.append_paged_kv_cache": 1,
                             "flashinfer.decode.run": 1})


def test_fusing_saves_launches(checkpoint, gpu_like) -> None:
    fused, unfused = (sum(per_layer(checkpoint, fused_rope=on).values()) for on in (True, False))
    assert fused < unfused
    assert FUSED_LAUNCHES_PER_LAYER < UNFUSED_LAUNCHES_PER_LAYER


def test_the_count_is_the_same_every_time(checkpoint, gpu_like) -> None:
    step = decode_step(build(checkpoint, 2, fused_rope=True))
    assert count(step)[0].launches == count(step)[0].launches


def test_the_stand_ins_compute_what_torchs_ops_do(checkpoint, gpu_like) -> None:
    """The fused path through the stand-ins gives the unfused path's logits (bfloat16 rounding apart): the counted
    forward is the real computation, not a shape-only imitation."""
    fused = count(decode_step(build(checkpoint, 2, fused_rope=True)))[1]
    unfused = count(decode_step(build(checkpoint, 2, fused_rope=False)))[1]
    assert fused.shape == unfused.shape == (len(KV_LENS), checkpoint[0].vocab_size)
    torch.testing.assert_close(fused, unfused, atol=0.15, rtol=0.05)
    assert torch.equal(fused.argmax(-1), unfused.argmax(-1))


def test_views_and_allocations_are_not_counted() -> None:
    x = torch.randn(4, 6)
    with LaunchCounter() as counter:
        x.view(6, 4).t()[1:].unsqueeze(0).expand(2, -1, -1).select(0, 1).squeeze().permute(1, 0).transpose(0, 1)
        x.reshape(2, 12).contiguous().chunk(2)[0].split(3)[0].detach()
        torch.empty(3), torch.empty_like(x)
    assert counter.total == 0, dict(counter.launches)
    with LaunchCounter() as counter:
        x.t().contiguous()  # a copy: one launch
        with counter.uncounted():
            x + 1
        counter.launch("stand-in")
    assert counter.launches == Counter({"aten.clone": 1, "flashinfer.stand-in": 1})


def test_a_torch_op_slipped_into_the_layer_is_counted(checkpoint, gpu_like, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pin catches a regression: an extra copy in a layer shows as one launch more per layer."""
    real = flashinfer_fused.silu_mul
    monkeypatch.setattr(flashinfer_fused, "silu_mul", lambda gate_up: real(gate_up.clone()))
    assert sum(per_layer(checkpoint, fused_rope=True).values()) == FUSED_LAUNCHES_PER_LAYER + 1
