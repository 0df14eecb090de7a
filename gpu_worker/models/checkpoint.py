"""Load Llama-family weights (llama, mistral, qwen2, qwen3) from a Hugging Face directory or a GGUF file.

Either way the result is one `ModelConfig` and a state dict under Hugging Face names, so the
engine has a single weight layout to understand. GGUF tensors are dequantized to `dtype` here, except the
linear weights the caller asks to keep in their blocks (`keep_blocks`: gpu_worker/gguf_blocks.py), which
the model packs for the GGUF kernel; a Hugging Face checkpoint's fp8 weights stay fp8 with their scales
(gpu_worker/models/fp8_checkpoint.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from gpu_worker.gguf_blocks import GGUFBlocks
from gpu_worker.model_config import ModelConfig
from gpu_worker.models import fp8_checkpoint
from hetero_common.model_files import ModelFileError, read_json, token_ids

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


class CheckpointError(ModelFileError):
    """A checkpoint cannot be loaded; the message says what to fix."""


def expected_tensor_names(config: ModelConfig) -> list[str]:
    """Every state-dict key a checkpoint for `config` must provide."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        names += [f"{prefix}self_attn.{p}_proj.weight" for p in ("q", "k", "v", "o")]
        if config.attention_bias:
            names += [f"{prefix}self_attn.{p}_proj.bias" for p in ("q", "k", "v")]
        if config.qk_norm:
            names += [f"{prefix}self_attn.q_norm.weight", f"{prefix}self_attn.k_norm.weight"]
        names += [f"{prefix}mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        names += [f"{prefix}input_layernorm.weight", f"{prefix}post_attention_layernorm.weight"]
    return names


def load_checkpoint(
    path: str | Path, dtype: torch.dtype = torch.float32, keep_blocks: Callable[[int, int, int], bool] | None = None
) -> tuple[ModelConfig, dict[str, Any]]:
    """Config and HF-named state dict (tensors in `dtype`, contiguous) from a HF dir or .gguf file.
    `keep_blocks(ggml_type, out, in)`: which of a GGUF file's linear weights stay in their blocks
    (gpu_worker/gguf_blocks.GGUFBlocks) instead of being dequantized."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"Model path {str(path)!r} does not exist: pass a Hugging Face model directory "
            "(config.json + *.safetensors) or a .gguf file."
        )
    if path.is_dir():
        config, tensors = _load_hf_dir(path, dtype)
    elif path.suffix.lower() == ".gguf":
        config, tensors = _load_gguf(path, dtype, keep_blocks)
    else:
        raise CheckpointError(
            f"{str(path)!r} is neither a directory nor a .gguf file: pass a Hugging Face model "
            "directory or a .gguf file."
        )
    missing = [name for name in expected_tensor_names(config) if name not in tensors]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(
            f"Checkpoint {str(path)!r} lacks {len(missing)} tensor(s) its config needs: {shown}. "
            "Check that every weight file (all shards) is present and matches config.json."
        )
    return config, {name: tensors[name] for name in expected_tensor_names(config)}


# --- Hugging Face directories ---------------------------------------------------------------


def _unique(ids: list[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(ids))


def _check_architecture(architecture: str, source: Path, supported: tuple[str, ...]) -> None:
    if architecture not in supported:
        raise CheckpointError(
            f"Unsupported architecture {architecture!r} in {str(source)!r}: supported are "
            f"{', '.join(supported)} (Llama-family decoders)."
        )


def _hf_config(directory: Path) -> ModelConfig:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{str(directory)!r} has no config.json: it is not a Hugging Face model directory.")
    cfg = read_json(config_path)
    architecture = str(cfg.get("model_type", ""))
    _check_architecture(architecture, config_path, SUPPORTED_ARCHITECTURES)
    if why := fp8_checkpoint.check_quantization_config(cfg, repr(str(config_path))):
        raise CheckpointError(why)
    # Unsupported variants would otherwise load and silently compute something else.
    # (Llama's and Qwen3's attention_bias puts a bias on o_proj too; Qwen2's q/k/v biases are implicit.)
    if cfg.get("mlp_bias") or (architecture in ("llama", "qwen3") and cfg.get("attention_bias")):
        raise CheckpointError(
            f"{str(config_path)!r} asks for MLP or output-projection biases, which this engine does not support."
        )

    # transformers >= 5 writes `rope_parameters` (theta + scaling together); older files use
    # `rope_theta` and `rope_scaling` at the top level.
    rope_params = dict(cfg.get("rope_parameters") or {})
    rope_theta = float(cfg.get("rope_theta", rope_params.pop("rope_theta", 10000.0)))
    rope_params.pop("rope_theta", None)
    rope_scaling = cfg.get("rope_scaling")
    if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
        rope_scaling = rope_params

    heads = int(cfg["num_attention_heads"])
    generation = directory / "generation_config.json"
    eos = token_ids(cfg.get("eos_token_id"))
    if generation.is_file():
        eos += token_ids(read_json(generation).get("eos_token_id"))
    try:
        return ModelConfig(
            architecture=architecture,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=architecture == "qwen2" or bool(cfg.get("attention_bias", False)),
            bos_token_id=None if cfg.get("bos_token_id") is None else int(cfg["bos_token_id"]),
            eos_token_ids=_unique(eos),
            qk_norm=architecture == "qwen3",
        )
    except KeyError as exc:
        raise CheckpointError(f"{str(config_path)!r} lacks the required field {exc.args[0]!r}.") from exc


def _load_hf_dir(directory: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    config = _hf_config(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({directory / name for name in read_json(index).get("weight_map", {}).values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{str(directory)!r} has no *.safetensors weights (PyTorch .bin files are not supported): "
            "convert the checkpoint with `save_pretrained(..., safe_serialization=True)`."
        )
    wanted = set(expected_tensor_names(config))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"Weight shard {str(file)!r} named by the index is missing.")
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                if name not in wanted:  # skips e.g. a tied lm_head.weight or rotary inv_freq buffers
                    continue
                tensor = handle.get_tensor(name)
                if fp8_checkpoint.is_fp8(tensor):
                    try:
                        tensors[name] = fp8_checkpoint.load_weight(name, tensor, handle)
                    except ValueError as e:
                        raise CheckpointError(f"{str(file)!r}: {e}") from e
                    continue
                tensors[name] = tensor.to(dtype).contiguous()
    return config, tensors


# --- GGUF files -----------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for unknown tensors."""
    stem, _, kind = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{kind}"
    if stem in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[stem]}.{kind}"
    return None  # e.g. rope_freqs, which llama.cpp precomputes and the engine derives itself


def _f32(value: Any) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _unpermute_rotary(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's HF->GGUF Q/K row permutation for the llama architecture.

    HF orders each head's rows as [first rotary half | second half] (rotate_half); llama.cpp
    interleaves them as pairs (x0, x_{d/2}), (x1, x_{d/2+1}), ... for its GPT-J style rope.
    The stored layout is therefore (head, d/2, 2); swapping the last two axes restores HF's
    (head, 2, d/2).
    """
    rows = weight.shape[0]
    return weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _load_gguf(path: Path, dtype: torch.dtype,
               keep_blocks: Callable[[int, int, int], bool] | None) -> tuple[ModelConfig, dict[str, Any]]:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise CheckpointError(f"{str(path)!r} is not a readable GGUF file: {exc}.") from exc
    meta = _GGUFMetadata(reader, path)
    # llama.cpp writes Mistral models under "llama", so these two cover the supported family.
    # llama.cpp permutes llama's Q/K rows alone (_unpermute_rotary); qwen2/qwen3 keep HF's order.
    _check_architecture(meta.architecture, path, ("llama", "qwen2", "qwen3"))
    gguf_tensors = {t.name: t for t in reader.tensors}
    config = _gguf_config(meta, gguf_tensors)
    return config, _gguf_state(gguf_tensors, config, dtype, keep_blocks)


class _GGUFMetadata:
    """A GGUF file's metadata fields; `required` ones are the architecture's (`llama.block_count`)."""

    def __init__(self, reader: Any, path: Path) -> None:  # reader: gguf.GGUFReader
        self.reader = reader
        self.path = path
        self.architecture = str(self.field("general.architecture", ""))

    def field(self, key: str, default: Any = None) -> Any:
        entry = self.reader.get_field(key)
        return default if entry is None else entry.contents()

    def required(self, key: str) -> Any:
        value = self.field(f"{self.architecture}.{key}")
        if value is None:
            raise CheckpointError(f"GGUF file {str(self.path)!r} lacks metadata key {self.architecture}.{key!s}.")
        return value


def _gguf_config(meta: _GGUFMetadata, gguf_tensors: dict[str, Any]) -> ModelConfig:
    """The HF-style config from the metadata, and from the tensors where it says nothing."""
    arch = meta.architecture
    hidden, heads = int(meta.required("embedding_length")), int(meta.required("attention.head_count"))
    kv_heads = int(meta.field(f"{arch}.attention.head_count_kv") or heads)
    vocab_size = _gguf_vocab_size(meta, gguf_tensors)
    rope_scaling = _gguf_rope_scaling(meta)
    eos = token_ids(meta.field("tokenizer.ggml.eos_token_id")) + token_ids(meta.field("tokenizer.ggml.eot_token_id"))
    bos = meta.field("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(meta.required("feed_forward_length")),
        num_hidden_layers=int(meta.required("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(meta.field(f"{arch}.attention.key_length") or hidden // heads),
        rms_norm_eps=_f32(meta.required("attention.layer_norm_rms_epsilon")),
        rope_theta=_f32(meta.field(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(meta.field(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in gguf_tensors,
        attention_bias="blk.0.attn_q.bias" in gguf_tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_unique(eos),
        qk_norm=arch == "qwen3",
    )


def _gguf_vocab_size(meta: _GGUFMetadata, gguf_tensors: dict[str, Any]) -> int:
    tokens = meta.reader.get_field("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)  # one entry per token string
    if "token_embd.weight" in gguf_tensors:
        return int(gguf_tensors["token_embd.weight"].shape[-1])  # GGUF order: (hidden, vocab)
    return int(meta.required("vocab_size"))


def _gguf_rope_scaling(meta: _GGUFMetadata) -> dict[str, Any] | None:
    # Note: Llama 3.1-style scaling is baked into a `rope_freqs` tensor by llama.cpp, and its HF
    # parameters are not recoverable from the metadata; such files load with rope_scaling=None.
    arch = meta.architecture
    scaling_type = meta.field(f"{arch}.rope.scaling.type")
    if scaling_type in (None, "none"):
        return None
    rope_scaling: dict[str, Any] = {"rope_type": str(scaling_type),
                                    "factor": _f32(meta.field(f"{arch}.rope.scaling.factor", 1.0))}
    original = meta.field(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        rope_scaling["original_max_position_embeddings"] = int(original)
    return rope_scaling


# The linear weights a GGUF file may keep in its blocks: the layers' products, the LM head and the embedding
# (the model looks tokens up in its blocks; a tied head computes from the same ones).
BLOCK_WEIGHTS = ("proj.weight", "lm_head.weight", "embed_tokens.weight")


def _gguf_state(gguf_tensors: dict[str, Any], config: ModelConfig, dtype: torch.dtype,
                keep_blocks: Callable[[int, int, int], bool] | None = None) -> dict[str, Any]:
    """The tensors under HF names, dequantized to `dtype` (or, where `keep_blocks` says so, a linear weight
    kept in its blocks); llama's Q/K rows back in HF's rotary order."""
    from gguf.quants import dequantize

    state: dict[str, Any] = {}
    for name, tensor in gguf_tensors.items():
        hf_name = _hf_name(name)
        if hf_name is None:
            continue
        # GGUF lists dimensions fastest-first (ne0 = columns): reverse for torch's row-major order.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if (keep_blocks is not None and len(shape) == 2 and hf_name.endswith(BLOCK_WEIGHTS)
                and keep_blocks(int(tensor.tensor_type), shape[0], shape[1])):
            blocks = torch.from_numpy(np.array(tensor.data)).reshape(shape[0], -1)  # a copy: the file is read-only
            if config.architecture == "llama" and ".attn_q." in name:
                blocks = _unpermute_rotary(blocks, config.num_attention_heads)
            elif config.architecture == "llama" and ".attn_k." in name:
                blocks = _unpermute_rotary(blocks, config.num_key_value_heads)
            state[hf_name] = GGUFBlocks(int(tensor.tensor_type), (shape[0], shape[1]), blocks.contiguous().numpy())
            continue
        # np.asarray drops the memmap subclass (still no copy): numpy's memmap bookkeeping on
        # every block slice otherwise doubles the dequantization time.
        array = dequantize(np.asarray(tensor.data), tensor.tensor_type)
        if not array.flags.writeable:  # F32 tensors come back as the read-only memmap itself
            array = np.array(array)
        weight = torch.from_numpy(array).reshape(shape)
        if config.architecture == "llama" and name.startswith("blk."):
            if ".attn_q." in name:
                weight = _unpermute_rotary(weight, config.num_attention_heads)
            elif ".attn_k." in name:
                weight = _unpermute_rotary(weight, config.num_key_value_heads)
        state[hf_name] = weight.to(dtype).contiguous()
    return state
