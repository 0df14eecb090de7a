"""Phi-3 (fused qkv_proj / gate_up_proj in the checkpoint, LongRoPE) against Hugging Face `transformers` on the same
weights: the fused weights split back into q/k/v and gate/up, and greedy tokens in float32 with LongRoPE's short
factors (the served context, 256, fits the pretrained one) and its attention factor, from its directory and from a
GGUF file of it."""

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


def test_a_gguf_file_of_it_matches_transformers(tiny_phi3_dir: Path, tmp_path: Path) -> None:
    """llama.cpp's layout: `attn_qkv` and `ffn_up` (gate and up) fused, LongRoPE's factors as tensors beside
    `rope.scaling.original_context_length` and `attn_factor`; read back to the same config, and served."""
    from hetero_common.config_sections import TokenizerConfig
    from hetero_infer.bench.gguf_writer import write_gguf

    path = write_gguf(tiny_phi3_dir, tmp_path / "phi3.gguf")
    config, state = load_checkpoint(path)
    direct, direct_state = load_checkpoint(tiny_phi3_dir)
    scaling, expected = config.rope_scaling, direct.rope_scaling
    assert (scaling["rope_type"], scaling["original_max_position_embeddings"]) == ("longrope", 256)
    for which in ("long_factor", "short_factor"):
        assert scaling[which] == pytest.approx(expected[which], rel=1e-6)
    assert rope_attention_factor(config) == pytest.approx(rope_attention_factor(direct), rel=1e-6)
    assert torch.equal(state["model.layers.1.mlp.up_proj.weight"], direct_state["model.layers.1.mlp.up_proj.weight"])
    prompts = make_prompts()
    ours = engine_greedy(path, prompts, max_model_len=256, tokenizer=TokenizerConfig(path=str(tiny_phi3_dir)))
    assert ours == hf_greedy(tiny_phi3_dir, prompts)


def test_a_quantized_fused_tensor_kept_in_blocks_splits_between_rows(tiny_phi3_dir: Path, tmp_path: Path) -> None:
    """`quantization: auto` keeps a Q8_0 `attn_qkv` in its blocks: cut into q, k and v between rows, each part
    dequantizes to the rows of the whole."""
    from gpu_worker.gguf_blocks import GGUFBlocks
    from hetero_infer.bench.gguf_writer import write_gguf

    path = write_gguf(tiny_phi3_dir, tmp_path / "q8.gguf", quantize="Q8_0")
    _, kept = load_checkpoint(path, keep_blocks=lambda *_: True)
    _, plain = load_checkpoint(path)
    for part, rows in (("q_proj", 96), ("k_proj", 32), ("v_proj", 32)):
        weight = kept[f"model.layers.0.self_attn.{part}.weight"]
        assert isinstance(weight, GGUFBlocks) and weight.shape == (rows, 96)
        assert torch.equal(weight.dequantized(), plain[f"model.layers.0.self_attn.{part}.weight"])
