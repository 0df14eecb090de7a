"""Qwen3 (q/k RMSNorm per head, an explicit head_dim that differs from hidden / heads) against Hugging Face
`transformers` on the same weights: float32 logits and greedy tokens on the torch path, and bfloat16 logits
through the C kernels (the per-layer loop with the C attention block: the all-layers C call has no q/k norm)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_worker.cpu.worker_setup import cpu_flags
from gpu_worker.models.checkpoint import load_checkpoint
from gpu_worker.models.model import LlamaModel
from hetero_infer.bench.harness import save_tiny_model
from kernels.cache_ops import allocate_kv_cache
from kernels.native import decode_attention as native_decode
from kernels.native import linear as native_linear
from kernels.page_table import PageTable
from kernels.torch_attention import TorchPagedAttention
from tests.helpers.oracle import engine_greedy, hf_greedy, hf_last_logits, make_prompts
from tests.unit.gpu_worker.test_cpu_dtype import REL_TOL, prefill_logits


def test_config_reads_head_dim_and_qk_norm(tiny_qwen3_dir: Path) -> None:
    config, state = load_checkpoint(tiny_qwen3_dir)
    assert (config.architecture, config.head_dim, config.hidden_size // config.num_attention_heads) == ("qwen3", 24, 16)
    assert config.qk_norm and not config.attention_bias
    assert state["model.layers.1.self_attn.q_norm.weight"].shape == (24,)


def test_float32_logits_match_transformers(tiny_qwen3_dir: Path) -> None:
    prompts = make_prompts()
    ours = prefill_logits(tiny_qwen3_dir, torch.float32, prompts)
    ref = hf_last_logits(tiny_qwen3_dir, prompts)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block_size", [1, 16, 5])
def test_greedy_matches_transformers(tiny_qwen3_dir: Path, block_size: int) -> None:
    prompts = make_prompts()
    assert engine_greedy(tiny_qwen3_dir, prompts, block_size=block_size) == hf_greedy(tiny_qwen3_dir, prompts)


REASON = native_linear.unavailable_reason(cpu_flags())
BLOCK = 16


@pytest.fixture(scope="module")
def head64_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Heads of 64 (the C attention's vector path) over a hidden size of 128: head_dim != hidden / heads."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(4)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
        eos_token_id=0, tie_word_embeddings=False, use_sliding_window=False, torch_dtype="float32")).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.uniform_(0.5, 2.0)
    return save_tiny_model(model, tmp_path_factory.mktemp("head64-qwen3"))


@pytest.mark.skipif(REASON is not None, reason=f"the C linear kernel does not run here: {REASON}")
@pytest.mark.skipif(not native_decode.takes_prompts(64, 16), reason="the C attention has no AVX512-BF16 path here")
def test_bfloat16_c_kernels_close_to_transformers(head64_qwen3_dir: Path) -> None:
    config, weights = load_checkpoint(head64_qwen3_dir)
    model = LlamaModel(config, weights, torch.device("cpu"), torch.bfloat16, max_positions=256, prepack=True,
                       native_linear=True, fused=True)
    assert model.elementwise == "c" and model.c_layers is None  # the loop, each attention block one C call
    prompts = [list(range(2, 22)), list(range(40, 75))]
    cache = allocate_kv_cache(config.num_hidden_layers, 8, BLOCK, model.num_kv_heads, config.head_dim,
                              torch.bfloat16, "cpu", TorchPagedAttention.kv_layout)
    attention = TorchPagedAttention(model.num_heads, model.num_kv_heads, config.head_dim, decode_kernel="c",
                                    dtype=torch.bfloat16)
    lens = np.array([len(p) for p in prompts])
    table = PageTable.build([np.array([3, 1], dtype=np.int32), np.array([0, 5, 6], dtype=np.int32)], lens, lens, BLOCK)
    attention.plan(table)
    assert attention.native_rows() is not None  # the C attention block runs
    positions, slots = table.token_positions()
    ids = torch.tensor([t for p in prompts for t in p])
    rows = table.qo_indptr[1:].to(torch.int64) - 1
    with torch.inference_mode():
        fast = model.forward(ids, torch.from_numpy(positions), torch.from_numpy(slots), cache, attention, rows)
    exact = hf_last_logits(head64_qwen3_dir, prompts)
    rel = (fast - exact).norm(dim=-1) / exact.norm(dim=-1)
    assert float(rel.max()) < REL_TOL, rel
    assert torch.equal(fast.argmax(-1), exact.argmax(-1))
