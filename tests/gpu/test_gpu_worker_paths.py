"""The CUDA worker's own paths on a device (issue 37): greedy tokens taken inside the decode graphs, the
position bound checked on the host, each worker process on its own GPU. Marked `gpu` and skipped without a
CUDA device, like tests/gpu/test_gpu.py, whose small Llama these tests share."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from tests.gpu.test_gpu import GPU_TEST_BLOCKS, PROMPT_LENGTHS, make_gpu_llama, require_flashinfer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (none is visible); run scripts/gpu_run.sh on the GPU machine"),
]


@pytest.fixture(scope="module")
def gpu_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gpu_llama(tmp_path_factory.mktemp("gpu_llama_paths"))


def _generate(model_dir: Path, monkeypatch: pytest.MonkeyPatch, config: dict | None = None,
              **params) -> tuple[list[list[int]], int]:
    """(each prompt's 8 greedy tokens with decode graphs, how many steps ran the sampler); `config`: more config
    keys; the model's element-wise path is checked against `use_flashinfer_fused_rope`."""
    from gpu_worker import runner as runner_module
    from hetero_common.config import Config
    from hetero_infer.engine import GenerationParams, InferenceEngine

    sampled = [0]
    real_sample = runner_module.sample

    def counting(*args, **kwargs):
        sampled[0] += 1
        return real_sample(*args, **kwargs)

    monkeypatch.setattr(runner_module, "sample", counting)
    settings = Config(model=str(model_dir), device="cuda", dtype="bfloat16", block_size=16, max_total_tokens=256,
                      max_num_blocks=GPU_TEST_BLOCKS, attention_backend="flashinfer", enable_cuda_graphs=True,
                      **(config or {})).validate()
    engine = InferenceEngine(settings)
    assert engine.runner.model.elementwise == ("flashinfer" if settings.use_flashinfer_fused_rope else "torch")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    ids = [engine.submit_request(p, GenerationParams(max_tokens=8, temperature=0.0, ignore_eos=True, **params))
           for p in prompts]
    done = {r.request_id: r for r in engine.run()}
    tokens = [done[i].output_token_ids for i in ids]
    del engine, done
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, sampled[0]


def test_greedy_tokens_from_the_graph_equal_the_samplers(gpu_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain greedy decode steps take their tokens from the graph's own argmax and skip the sampler; a zero
    logit bias changes no logit but sends every step through the sampler. Same tokens, exactly."""
    require_flashinfer(64)
    from_graph, sampler_steps = _generate(gpu_llama_dir, monkeypatch)
    through_sampler, all_steps = _generate(gpu_llama_dir, monkeypatch, logit_bias={5: 0.0})
    assert from_graph == through_sampler
    print(f"steps through the sampler: {sampler_steps} (graph greedy) against {all_steps}")
    assert sampler_steps < all_steps  # the decode steps took the graph's tokens


def test_a_position_past_the_model_leaves_the_cuda_context_alive(gpu_llama_dir: Path) -> None:
    """The host refuses the step before RoPE's unchecked lookup could assert on the device; the worker then
    serves the next step."""
    require_flashinfer(64)
    from gpu_worker.runner import ModelRunner
    from hetero_common.config import Config
    from hetero_common.errors import ExecutionError
    from tests.unit.gpu_worker.test_position_bound import _prompt_step

    runner = ModelRunner(Config(model=str(gpu_llama_dir), device="cuda", dtype="bfloat16", max_model_len=32,
                                max_total_tokens=64, max_num_blocks=GPU_TEST_BLOCKS,
                                attention_backend="flashinfer").validate())
    with pytest.raises(ExecutionError, match="beyond the model's 32 positions"):
        runner.execute(_prompt_step(1, 1, 40))
    assert list(runner.execute(_prompt_step(2, 2, 32)).seq_ids) == [2]
    torch.cuda.synchronize()


def test_each_worker_process_binds_its_own_gpu() -> None:
    from gpu_worker.service import on_own_device
    from hetero_common.config import Config
    from hetero_common.errors import ConfigError

    count = torch.cuda.device_count()
    config = Config(device="cuda", data_parallel_size=2).validate()
    if count < 2:
        with pytest.raises(ConfigError, match="sees 1 CUDA device"):
            on_own_device(config, tp_rank=0, local_rank=1)
    else:
        assert on_own_device(config, tp_rank=0, local_rank=1).device == "cuda:1"
        assert torch.cuda.current_device() == 1
    assert on_own_device(config, tp_rank=0, local_rank=0).device == "cuda:0"
    assert torch.cuda.current_device() == 0


def _suspended_midway(model_dir: Path, mode: str | None, **overrides) -> tuple[list[list[int]], object]:
    """Each prompt's 8 greedy tokens, the KV cache suspended in `mode` (None: never) after 4 steps and resumed;
    and the engine, to look at its runner."""
    from hetero_common.config import Config
    from hetero_infer.engine import GenerationParams, InferenceEngine

    # A small pool: `offload` copies the whole cache to host memory, and the host has less than the device.
    config = Config(model=str(model_dir), device="cuda", dtype="bfloat16", block_size=16, max_total_tokens=256,
                    max_num_blocks=GPU_TEST_BLOCKS, attention_backend="flashinfer", enable_cuda_graphs=True,
                    **overrides).validate()
    engine = InferenceEngine(config)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    ids = [engine.submit_request(p, GenerationParams(max_tokens=8, temperature=0.0, ignore_eos=True)) for p in prompts]
    done = {}
    for step in range(200):
        if not engine.has_pending_work():
            break
        if step == 4 and mode is not None:
            assert engine.suspend(mode) > 0
            engine.resume()
        done.update({r.request_id: r for r in engine.step()})
    return [done[i].output_token_ids for i in ids], engine


@pytest.mark.parametrize("mode", ["offload", "recompute"])
def test_static_kv_pointers_replay_the_same_graphs_after_a_suspend(gpu_llama_dir: Path, mode: str) -> None:
    """static_kv_memory_pointers: the cache's memory is released and mapped again at its addresses; the decode
    graphs captured before the suspend replay after it, and the tokens are those of the same run with the cache
    freed and the graphs captured again (`recompute` recomputes through prefill, which may round differently from
    the decodes it replaces: so the reference is suspended the same way, not a run never suspended)."""
    require_flashinfer(64)
    plain, engine = _suspended_midway(gpu_llama_dir, None, static_kv_memory_pointers=True)
    runner = engine.runner
    graphs, address = runner.graphs, runner.kv_cache.data_ptr()
    assert graphs is not None
    free_before = torch.cuda.mem_get_info()[0]
    released = engine.suspend(mode)
    assert torch.cuda.mem_get_info()[0] - free_before >= released * 0.9  # the memory went back to the device
    engine.resume()
    assert runner.graphs is graphs and runner.kv_cache.data_ptr() == address
    del engine, runner
    gc.collect()
    suspended, engine = _suspended_midway(gpu_llama_dir, mode, static_kv_memory_pointers=True)
    del engine
    gc.collect()
    reference, engine = _suspended_midway(gpu_llama_dir, mode)
    assert suspended == reference
    if mode == "offload":  # the cache came back exactly: as if never suspended
        assert suspended == plain
    del engine
    gc.collect()
    torch.cuda.empty_cache()


# --- the fused element-wise kernels (kernels/flashinfer_fused.py) against the unfused torch ops they replace ---

def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within bf16 rounding: the fused kernels keep float32 inside and round once, torch's ops round between."""
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2e-2)


def test_fused_rms_norm_and_its_residual_add_match_torch() -> None:
    require_flashinfer(64)
    from kernels import flashinfer_fused

    torch.manual_seed(0)
    hidden = torch.randn(37, 2048, dtype=torch.bfloat16, device="cuda")
    delta = torch.randn_like(hidden)
    weight = torch.rand(2048, dtype=torch.bfloat16, device="cuda") + 0.5

    def reference(x: torch.Tensor) -> torch.Tensor:  # LlamaModel._rms_norm
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)

    _close(flashinfer_fused.add_rms_norm(hidden, None, weight, 1e-5), reference(hidden))
    summed = hidden + delta
    normed = flashinfer_fused.add_rms_norm(hidden, delta, weight, 1e-5)
    _close(hidden, summed)  # the residual, added in place
    _close(normed, reference(summed))


def test_fused_rope_rotates_q_and_k_in_place_and_leaves_v() -> None:
    require_flashinfer(64)
    from gpu_worker.model_config import ModelConfig
    from gpu_worker.models.rope import rope_tables
    from kernels import flashinfer_fused

    torch.manual_seed(1)
    heads, kv_heads, dim, rows = 32, 8, 64, 29
    config = ModelConfig(architecture="llama", vocab_size=8, hidden_size=heads * dim, intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=dim,
                         rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None, max_position_embeddings=4096,
                         tie_word_embeddings=True, attention_bias=False, bos_token_id=None, eos_token_ids=())
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, dtype=torch.bfloat16, device="cuda")
    positions = torch.randint(0, 4096, (rows,), device="cuda")
    cos, sin = rope_tables(config, 4096, torch.device("cuda"), torch.float32)
    want = qkv.clone()
    qk = want[:, :(heads + kv_heads) * dim].view(rows, heads + kv_heads, dim)
    c, s, x = cos[positions][:, None, :], sin[positions][:, None, :], qk.float()  # rotate-half, as model._rope
    x1, x2 = x[..., : dim // 2], x[..., dim // 2:]
    qk.copy_(torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(torch.bfloat16))
    flashinfer_fused.rope_(qkv, heads, kv_heads, dim, positions, flashinfer_fused.cos_sin_cache(cos, sin))
    _close(qkv, want)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], want[:, (heads + kv_heads) * dim:])  # v as it was


def test_fused_silu_mul_matches_torch() -> None:
    require_flashinfer(64)
    import torch.nn.functional as F

    from kernels import flashinfer_fused

    gate_up = torch.randn(19, 2 * 8192, dtype=torch.bfloat16, device="cuda")
    gate, up = gate_up.chunk(2, dim=-1)
    _close(flashinfer_fused.silu_mul(gate_up), F.silu(gate) * up)


def test_the_model_with_fused_kernels_generates_as_without(gpu_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy generation, eager prompts and graph decodes, with use_flashinfer_fused_rope on and off: the first
    token of every prompt equal, the rest by the agreement rule of tests/gpu/test_gpu.py (bf16 near-ties)."""
    require_flashinfer(64)
    fused, _ = _generate(gpu_llama_dir, monkeypatch)
    unfused, _ = _generate(gpu_llama_dir, monkeypatch, config={"use_flashinfer_fused_rope": False})
    assert [t[0] for t in fused] == [t[0] for t in unfused]
    agree = sum(a == b for x, y in zip(fused, unfused) for a, b in zip(x, y))
    total = sum(len(x) for x in unfused)
    print(f"fused element-wise kernels vs torch's ops: agreement {agree}/{total}")
    assert agree / total >= 0.5
