"""Gemma 3 (text) against Hugging Face `transformers` on the same weights: its config facts (layer types, each
type's RoPE, the score scale), the checkpoint's norms as the engine's (1 + w), float32 logits and greedy tokens on
prompts longer than its sliding window (whole, in chunks, over cached prefixes, preempted), the window's
attention against a dense masked one without reading the pages it cannot see, bfloat16 through the C linear
kernels, and the variants it refuses by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_worker.cpu.worker_setup import cpu_flags
from gpu_worker.models.checkpoint import CheckpointError, load_checkpoint
from gpu_worker.models.model import LlamaModel
from hetero_common.config import Config
from hetero_common.config_sections import TokenizerConfig
from hetero_infer.bench.gguf_writer import write_gguf
from hetero_infer.engine import GenerationParams, InferenceEngine
from kernels.cache_ops import allocate_kv_cache
from kernels.native import linear as native_linear
from kernels.native import linear_gguf
from kernels.native.linear_gguf import GGUFPackedWeight
from kernels.page_table import PageTable
from kernels.torch_attention import TorchPagedAttention
from tests.helpers.oracle import engine_greedy, hf_greedy, hf_last_logits, make_prompts
from tests.helpers.tiny_models import GEMMA3_WINDOW
from tests.unit.gpu_worker.test_cpu_dtype import REL_TOL, prefill_logits


def long_prompts() -> list[list[int]]:
    """The seeded prompts and two of several windows (up to 12x GEMMA3_WINDOW)."""
    generator = np.random.default_rng(3)
    return make_prompts() + [generator.integers(2, 384, n).tolist() for n in (41, 97)]


def test_config_reads_layer_types_rope_and_scale(tiny_gemma3_dir: Path) -> None:
    config, _ = load_checkpoint(tiny_gemma3_dir)
    assert (config.architecture, config.sliding_window, config.sliding_layers) == ("gemma3", GEMMA3_WINDOW, (0, 1, 3))
    assert (config.rope_theta, config.local_rope_theta, config.rope_scaling) == (
        1e6, 1e4, {"rope_type": "linear", "factor": 2.0})
    assert config.attention_scale == 24 ** -0.5 and config.hidden_activation == "gelu_tanh"
    assert config.sandwich_norms and config.qk_norm and config.final_logit_softcapping == 30.0
    assert config.embedding_scale == 96 ** 0.5


def test_norms_become_one_plus_w_under_the_engines_names(tiny_gemma3_dir: Path) -> None:
    from safetensors.torch import load_file

    _, state = load_checkpoint(tiny_gemma3_dir)
    raw = load_file(str(tiny_gemma3_dir / "model.safetensors"))
    p = "model.layers.1."
    for ours, theirs in (("input_layernorm", "input_layernorm"), ("attention_output_norm", "post_attention_layernorm"),
                         ("post_attention_layernorm", "pre_feedforward_layernorm"),
                         ("mlp_output_norm", "post_feedforward_layernorm"), ("self_attn.q_norm", "self_attn.q_norm")):
        assert torch.equal(state[f"{p}{ours}.weight"], raw[f"{p}{theirs}.weight"] + 1), ours
    assert torch.equal(state["model.norm.weight"], raw["model.norm.weight"] + 1)


def test_float32_logits_match_transformers(tiny_gemma3_dir: Path) -> None:
    prompts = long_prompts()
    torch.testing.assert_close(prefill_logits(tiny_gemma3_dir, torch.float32, prompts),
                               hf_last_logits(tiny_gemma3_dir, prompts), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block_size", [1, 16, 5])
def test_greedy_matches_transformers(tiny_gemma3_dir: Path, block_size: int) -> None:
    prompts = long_prompts()
    assert engine_greedy(tiny_gemma3_dir, prompts, block_size=block_size) == hf_greedy(tiny_gemma3_dir, prompts)


def test_greedy_matches_through_chunks_cached_prefixes_and_preemption(tiny_gemma3_dir: Path) -> None:
    """Prompt chunks of at most 7 tokens (under the window), the prompts twice (the second time over the
    first's cached blocks), and a pool small enough that sequences are preempted and recomputed."""
    prompts = long_prompts()
    expected = hf_greedy(tiny_gemma3_dir, prompts)
    assert engine_greedy(tiny_gemma3_dir, prompts + prompts, block_size=4, max_total_tokens=7,
                         max_num_blocks=40) == expected + expected


def _dense_windowed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, window: int,
                    scale: float) -> torch.Tensor:
    """Reference: each query row at `positions[i]` over keys [0, len(k)) with the causal window mask."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    keys = torch.arange(k.shape[0])[None, :]
    allowed = (keys <= positions[:, None]) & (keys > positions[:, None] - window)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    probs = scores.masked_fill(~allowed[None], float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize("window, block", [(8, 4), (8, 16), (5, 3)])
def test_window_attention_equals_a_dense_mask_and_skips_unseen_pages(window: int, block: int) -> None:
    """A decode, a prompt chunk over a cached prefix and a whole prompt in one step, each longer than the window;
    every page entirely before a row's window is given an id past the cache's end, so reading one would fail."""
    torch.manual_seed(0)
    heads, kv_heads, dim, scale = 4, 2, 8, 0.3
    lens, q_lens = np.array([29, 23, 17]), np.array([1, 6, 17])
    pages = [-(-n // block) for n in lens]
    cache = allocate_kv_cache(1, sum(pages), block, kv_heads, dim, torch.float32, "cpu", "HND")[0]
    starts = np.concatenate([[0], np.cumsum(pages)])
    tables = [np.arange(s, s + n, dtype=np.int32) for s, n in zip(starts, pages)]
    k_all = [torch.randn(n, kv_heads, dim) for n in lens]
    v_all = [torch.randn(n, kv_heads, dim) for n in lens]
    base = TorchPagedAttention(heads, kv_heads, dim, scale=scale)
    # every K/V first, through a plain table
    full = PageTable.build(tables, lens, lens, block)
    base.plan(full)
    _, slots = full.token_positions()
    base.write_kv(cache, torch.cat(k_all), torch.cat(v_all), torch.from_numpy(slots))
    # then the step: pages before each sequence's first visible key replaced by ids past the cache
    unseen = [np.where(np.arange(n) < max(0, int(L - q - window + 1)) // block, 10**6, t).astype(np.int32)
              for t, n, L, q in zip(tables, pages, lens, q_lens)]
    step = PageTable.build(unseen, q_lens, lens, block)
    base.plan(step)
    attention = base.windowed(window)
    assert attention.window == window and not attention.native_decode
    q = torch.randn(int(q_lens.sum()), heads, dim)
    out = attention.run(q, cache)
    rows = 0
    for n, q_len, k, v in zip(lens, q_lens, k_all, v_all):
        positions = torch.arange(n - q_len, n)
        expected = _dense_windowed(q[rows : rows + q_len], k, v, positions, window, scale)
        torch.testing.assert_close(out[rows : rows + q_len], expected, rtol=1e-5, atol=1e-5)
        rows += q_len


REASON = native_linear.unavailable_reason(cpu_flags())


@pytest.mark.parametrize("c_linear", [False, pytest.param(True, marks=pytest.mark.skipif(
    REASON is not None, reason=f"the C linear kernel does not run here: {REASON}"))])
def test_bfloat16_close_to_transformers(tiny_gemma3_dir: Path, c_linear: bool) -> None:
    """Its products through torch or the C linear kernel; its element-wise ops and attention through torch."""
    prompts = long_prompts()
    fast = prefill_logits(tiny_gemma3_dir, torch.bfloat16, prompts, native_linear=c_linear)
    exact = hf_last_logits(tiny_gemma3_dir, prompts)
    rel = (fast - exact).norm(dim=-1) / exact.norm(dim=-1)
    assert float(rel.max()) < REL_TOL, rel


def test_the_model_refuses_a_backend_with_another_scale(tiny_gemma3_dir: Path) -> None:
    config, weights = load_checkpoint(tiny_gemma3_dir)
    model = LlamaModel(config, weights, torch.device("cpu"), torch.float32, max_positions=64)
    attention = TorchPagedAttention(model.num_heads, model.num_kv_heads, config.head_dim)  # head_dim ** -0.5
    with pytest.raises(ValueError, match="scale=config.attention_scale"):
        model.hidden_states(torch.tensor([3]), torch.tensor([0]), torch.tensor([0]), None, attention)


@pytest.mark.parametrize("edit, why", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"hidden_activation": "relu"}, "hidden_activation='relu'"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"sliding_window": None}, "no sliding_window"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}, "local layers' RoPE"),
])
def test_unservable_variants_are_refused_by_name(tiny_gemma3_dir: Path, tmp_path: Path, edit: dict,
                                                 why: str) -> None:
    directory = shutil.copytree(tiny_gemma3_dir, tmp_path / "edited")
    config = json.loads((directory / "config.json").read_text())
    config.update(edit)
    (directory / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    with pytest.raises(CheckpointError, match=why):
        load_checkpoint(directory)


def test_a_gguf_file_of_it_matches_transformers(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    """The same weights as llama.cpp's converter writes them (norms as 1 + w, its names, a flag per layer for the
    window, the score scale and soft cap): the config read back, and transformers' greedy tokens."""
    path = write_gguf(tiny_gemma3_dir, tmp_path / "gemma3.gguf")
    config, _ = load_checkpoint(path)
    direct, _ = load_checkpoint(tiny_gemma3_dir)
    assert config.sliding_layers == direct.sliding_layers and config.local_rope_theta == direct.local_rope_theta
    assert (config.rope_scaling, config.final_logit_softcapping) == (direct.rope_scaling, 30.0)
    assert config.attention_scale == pytest.approx(direct.attention_scale, rel=1e-6)
    prompts = long_prompts()
    tokenizer = TokenizerConfig(path=str(tiny_gemma3_dir))
    assert engine_greedy(path, prompts, tokenizer=tokenizer) == hf_greedy(tiny_gemma3_dir, prompts)


@pytest.mark.skipif(not linear_gguf.supported(linear_gguf.Q8_0, 16, 32),
                    reason="the GGUF kernel does not run here (AVX512-VNNI)")
def test_its_products_are_served_from_q8_0_blocks(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    """`quantization: auto` on a Q8_0 file: every layer's products from the file's blocks; greedy tokens agree with
    the same file dequantized and run in float32 (a random model's near ties may part a few streams late)."""
    path = write_gguf(tiny_gemma3_dir, tmp_path / "q8.gguf", quantize="Q8_0")
    prompts = long_prompts()
    params = GenerationParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def run(**overrides) -> tuple[InferenceEngine, list[list[int]]]:
        engine = InferenceEngine(Config(model=str(path), tokenizer=TokenizerConfig(path=str(tiny_gemma3_dir)),
                                        block_size=16, **overrides).validate())
        ids = [engine.submit_request(p, params) for p in prompts]
        done = {r.request_id: r.output_token_ids for r in engine.run()}
        return engine, [done[i] for i in ids]

    served, ours = run(quantization="auto")
    assert all(type(served.runner.model.layers[i][n]) is GGUFPackedWeight for i in range(4) for n in ("qkv", "down"))
    _, reference = run(quantization="none", dtype="float32")
    agreed = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(ours, reference))
    assert agreed >= 0.75 * 12 * len(prompts), (agreed, ours, reference)
