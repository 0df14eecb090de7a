"""Phi-3 (fused qkv_proj / gate_up_proj in the checkpoint, LongRoPE) against Hugging Face `transformers` on the same
weights: the fused weights split back into q/k/v and gate/up, and greedy tokens in float32 with LongRoPE's short
factors (the served context, 256, fits the pretrained one) and its attention factor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_worker.models.checkpoint import load_checkpoint
from gpu_worker.models.rope import rope_attention_factor, rope_inv_freq
from tests.helpers.oracle import engine_greedy, hf_greedy, hf_last_logits, make_prompts
from tests.unit.gpu_worker.test_cpu_dtype import prefill_logits


def test_fused_weights_split_into_the_engines_names(tiny_phi3_dir: Path) -> None:
    from safetensors.torch import load_file

    config, state = load_checkpoint(tiny_phi3_dir)
    raw = load_file(str(tiny_phi3_dir / "model.safetensors"))
    qkv = raw["model.layers.1.self_attn.qkv_proj.weight"]
    q, k, v = (state[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(torch.cat([q, k, v]), qkv) and q.shape == (96, 96) and k.shape == v.shape == (32, 96)
    gate, up = state["model.layers.0.mlp.gate_proj.weight"], state["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(torch.cat([gate, up]), raw["model.layers.0.mlp.gate_up_proj.weight"])
    assert config.rope_scaling["rope_type"] == "longrope"
    assert config.rope_scaling["original_max_position_embeddings"] == 256


def test_longrope_factors_follow_the_served_context(tiny_phi3_dir: Path) -> None:
    config, _ = load_checkpoint(tiny_phi3_dir)
    short, long = rope_inv_freq(config, 256), rope_inv_freq(config, 512)
    assert not torch.equal(short, long)
    assert rope_attention_factor(config) == pytest.approx((1 + torch.log(torch.tensor(2.0)).item()
                                                           / torch.log(torch.tensor(256.0)).item()) ** 0.5)


def test_float32_logits_match_transformers(tiny_phi3_dir: Path) -> None:
    """Logits, not only greedy tokens: LongRoPE's attention factor (about 1.06 here) moves them by more than
    the tolerance and may leave a tiny model's argmax alone."""
    prompts = make_prompts()
    torch.testing.assert_close(prefill_logits(tiny_phi3_dir, torch.float32, prompts),
                               hf_last_logits(tiny_phi3_dir, prompts), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block_size", [16, 5])
def test_greedy_matches_transformers(tiny_phi3_dir: Path, block_size: int) -> None:
    prompts = make_prompts()
    ours = engine_greedy(tiny_phi3_dir, prompts, block_size=block_size, max_model_len=256)
    assert ours == hf_greedy(tiny_phi3_dir, prompts)
