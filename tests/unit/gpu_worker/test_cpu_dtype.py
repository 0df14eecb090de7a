"""The CPU bfloat16 path against float32 (the exact mode), and the `dtype: auto` / thread choices.

bfloat16 keeps 8 mantissa bits, so logits cannot match float32 exactly: they must agree
within REL_TOL (relative L2 error over the vocabulary), and greedy decoding must pick the
same first tokens on the seeded prompts of the oracle tests, up to the first step whose choice
float32 itself makes by less than TIE_MARGIN (a near-tie, which bfloat16 rounding may break
either way: that step and what follows it are not compared).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_worker.cpu import worker_setup
from gpu_worker.models.checkpoint import load_checkpoint
from gpu_worker.models.model import LlamaModel
from hetero_common import host_cores
from hetero_common.config import Config
from hetero_common.errors import ConfigError
from kernels.cache_ops import allocate_kv_cache
from kernels.page_table import PageTable
from kernels.torch_attention import TorchPagedAttention
from tests.helpers.oracle import engine_greedy, make_prompts

REL_TOL = 0.03  # ||logits_bf16 - logits_fp32|| / ||logits_fp32||, per sequence
FIRST_TOKENS = 3  # greedy tokens that must be identical
TIE_MARGIN = 0.01  # float32 top-1 minus top-2 logit, relative to the top-1 logit (about two bfloat16 steps)


def prefill_logits(model_dir: Path, dtype: torch.dtype, prompts: list[list[int]], block_size: int = 4,
                   prepack: bool = False, native_linear: bool = False) -> torch.Tensor:
    """Last-position logits [len(prompts), vocab] of all prompts computed in one batched step
    (`native_linear`: the linear layers through the C kernel, bfloat16)."""
    config, weights = load_checkpoint(model_dir)
    model = LlamaModel(config, weights, torch.device("cpu"), dtype, max_positions=128,
                       prepack=prepack or native_linear, native_linear=native_linear)
    pages = [(len(p) + block_size - 1) // block_size for p in prompts]
    starts = np.concatenate([[0], np.cumsum(pages)])
    tables = [np.arange(s, s + n, dtype=np.int32) for s, n in zip(starts, pages)]
    lens = np.array([len(p) for p in prompts])
    table = PageTable.build(tables, lens, lens, block_size)
    cache = allocate_kv_cache(config.num_hidden_layers, int(starts[-1]), block_size, model.num_kv_heads,
                              config.head_dim, dtype, "cpu", TorchPagedAttention.kv_layout)
    attention = TorchPagedAttention(model.num_heads, model.num_kv_heads, config.head_dim, scale=config.attention_scale)
    attention.plan(table)
    positions, slots = table.token_positions()
    ids = torch.tensor([t for p in prompts for t in p])
    rows = table.qo_indptr[1:].to(torch.int64) - 1
    with torch.inference_mode():
        return model.forward(ids, torch.from_numpy(positions), torch.from_numpy(slots), cache, attention, rows)


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_bfloat16_logits_close_to_float32(model_fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(model_fixture)
    prompts = make_prompts()
    exact = prefill_logits(model_dir, torch.float32, prompts)
    fast = prefill_logits(model_dir, torch.bfloat16, prompts)
    assert fast.dtype == torch.float32 and fast.shape == exact.shape
    rel = (fast - exact).norm(dim=-1) / exact.norm(dim=-1)
    assert float(rel.max()) < REL_TOL, rel
    assert torch.equal(fast.argmax(-1), exact.argmax(-1))


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_bfloat16_first_greedy_tokens_match_float32(model_fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(model_fixture)
    prompts = make_prompts()
    exact = engine_greedy(model_dir, prompts, dtype="float32")
    fast = engine_greedy(model_dir, prompts, dtype="bfloat16")
    compared = 0
    for prompt, want, got in zip(prompts, exact, fast):
        for j in range(FIRST_TOKENS):
            top2 = prefill_logits(model_dir, torch.float32, [prompt + want[:j]])[0].topk(2).values
            if float(top2[0] - top2[1]) < TIE_MARGIN * abs(float(top2[0])):
                break  # a near-tie in float32: bfloat16 may pick either
            assert got[j] == want[j], (prompt, j, want[:FIRST_TOKENS], got[:FIRST_TOKENS])
            compared += 1
    assert compared >= len(prompts) * FIRST_TOKENS // 2  # most steps are clear choices


def test_auto_dtype_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    assert worker_setup.resolve_cpu_dtype("float32", 64)[0] == torch.float32
    assert worker_setup.resolve_cpu_dtype("bfloat16", 64)[0] == torch.bfloat16
    monkeypatch.setattr(worker_setup, "cpu_flags", lambda: {"avx2", "amx_bf16", "amx_tile"})
    assert worker_setup.resolve_cpu_dtype("auto", 64) == (torch.bfloat16, "cpu has amx_bf16")
    monkeypatch.setattr(worker_setup, "cpu_flags", lambda: {"avx2", "fma"})
    assert worker_setup.resolve_cpu_dtype("auto", 64)[0] == torch.float32
    monkeypatch.setattr(worker_setup, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    # Without the C linear kernel (cpu_kernels torch) a measurement decides.
    monkeypatch.setattr(worker_setup, "measure_bf16_speedup", lambda width, prepack=True: 4.0)
    assert worker_setup.resolve_cpu_dtype("auto", 64, cpu_kernels="torch")[0] == torch.bfloat16
    monkeypatch.setattr(worker_setup, "measure_bf16_speedup", lambda width, prepack=True: 1.1)
    assert worker_setup.resolve_cpu_dtype("auto", 64, cpu_kernels="torch")[0] == torch.float32
    # With it (where this CPU can run it), bfloat16 whatever a measurement would say.
    monkeypatch.setattr(worker_setup.native_linear, "unavailable_reason", lambda flags: None)
    assert worker_setup.resolve_cpu_dtype("auto", 64) == (
        torch.bfloat16, "cpu has avx512_bf16: bfloat16 linear layers through the C kernel")
    assert worker_setup.resolve_cpu_dtype("auto", 64, prepack=False)[0] == torch.float32
    assert worker_setup.measure_bf16_speedup(64) > 0


def test_worker_threads_share_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_cores.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert worker_setup.worker_threads(0, 1, 1) == 2
    assert worker_setup.worker_threads(0, 2, 1) == 1  # two replicas on two cores: one each
    assert worker_setup.worker_threads(0, 2, 2) == 1  # never below one
    assert worker_setup.worker_threads(3, 2, 1) == 3  # a set count is kept
    assert worker_setup.worker_threads(0, 1, 1, reserved_cpus=1) == 1
    assert worker_setup.worker_threads(0, 1, 1, reserved_cpus=5) == 1  # never below one
    assert worker_setup.worker_threads(0, 1, 1, reserved_cpus=-1) == 2  # auto outside serve: none reserved


def test_reserved_cpus_leave_the_services_cores_on_large_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [host_cores.default_reserved_cpus(n) for n in (1, 2, 4, 7, 8, 16, 64)] == [0, 0, 0, 0, 2, 2, 2]
    monkeypatch.setattr(host_cores.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert worker_setup.worker_threads(0, 1, 1, reserved_cpus=2) == 14
    assert worker_setup.worker_threads(0, 2, 1, reserved_cpus=2) == 7  # two replicas share the rest
    assert worker_setup.worker_threads(6, 1, 1, reserved_cpus=2) == 6  # a set count is kept


@pytest.mark.parametrize(("cores", "configured", "expected"), [(16, -1, 2), (2, -1, 0), (16, 0, 0), (2, 3, 3)])
def test_serve_resolves_auto_reserved_cpus_before_starting_workers(
        monkeypatch: pytest.MonkeyPatch, cores: int, configured: int, expected: int) -> None:
    """The supervisor writes the resolved count into the config file its workers read: a worker started
    by `hetero-infer worker` alone (no services beside it) keeps auto, which reserves none."""
    import json

    from hetero_infer import supervisor

    monkeypatch.setattr(supervisor, "host_cores", lambda: cores)
    sup = supervisor.Supervisor(Config(reserved_cpus=configured).validate())
    try:
        assert sup.config.reserved_cpus == expected
        with open(sup.config_path) as f:
            assert json.load(f)["reserved_cpus"] == expected
    finally:
        os.unlink(sup.config_path)
        os.rmdir(sup.tp_dir)


def test_reserved_cpus_below_auto_is_refused() -> None:
    with pytest.raises(ConfigError, match="reserved_cpus"):
        Config(reserved_cpus=-2).validate()
