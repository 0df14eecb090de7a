"""Load a model's weights from a Hugging Face directory or a GGUF file (gguf_checkpoint.py), for any family in
gpu_worker/models/families/.

Either way the result is one `ModelConfig` and a state dict under the engine's names (families/family.py), so the
engine has a single weight layout to understand. GGUF tensors are dequantized to `dtype`, except the linear weights
the caller asks to keep in their blocks (`keep_blocks`: gpu_worker/gguf_blocks.py), which the model packs for the
GGUF kernel; a Hugging Face checkpoint's fp8 weights stay fp8 with their scales (gpu_worker/models/fp8_checkpoint.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from gpu_worker.model_config import ModelConfig
from gpu_worker.models import fp8_checkpoint
from gpu_worker.models.families import registry
from gpu_worker.models.families.family import CheckpointError, Family, expected_tensor_names
from gpu_worker.models.gguf_checkpoint import BLOCK_WEIGHTS, load_gguf
from hetero_common.model_files import read_json, token_ids

__all__ = ["BLOCK_WEIGHTS", "CheckpointError", "expected_tensor_names", "load_checkpoint"]


def load_checkpoint(
    path: str | Path, dtype: torch.dtype = torch.float32, keep_blocks: Callable[[int, int, int], bool] | None = None
) -> tuple[ModelConfig, dict[str, Any]]:
    """Config and engine-named state dict (tensors in `dtype`, contiguous) from a HF dir or .gguf file.
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
        config, tensors = load_gguf(path, dtype, keep_blocks)
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


def _hf_config(directory: Path) -> tuple[ModelConfig, Family]:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{str(directory)!r} has no config.json: it is not a Hugging Face model directory.")
    cfg = read_json(config_path)
    where = repr(str(config_path))
    family = registry.for_hf_model_type(str(cfg.get("model_type", "")), where)
    if why := fp8_checkpoint.check_quantization_config(cfg, where):
        raise CheckpointError(why)

    # transformers >= 5 writes `rope_parameters` (theta + scaling together); older files use
    # `rope_theta` and `rope_scaling` at the top level.
    rope_params = dict(cfg.get("rope_parameters") or {})
    rope_theta = float(cfg.get("rope_theta", rope_params.pop("rope_theta", 10000.0)))
    rope_params.pop("rope_theta", None)
    rope_scaling = cfg.get("rope_scaling")
    if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
        rope_scaling = rope_params

    generation = directory / "generation_config.json"
    eos = token_ids(cfg.get("eos_token_id"))
    if generation.is_file():
        eos += token_ids(read_json(generation).get("eos_token_id"))
    try:
        heads = int(cfg["num_attention_heads"])
        common: dict[str, Any] = dict(
            architecture=family.architecture,
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
            attention_bias=False,
            bos_token_id=None if cfg.get("bos_token_id") is None else int(cfg["bos_token_id"]),
            eos_token_ids=tuple(dict.fromkeys(eos)),
        )
        return ModelConfig(**{**common, **family.config_fields(cfg, where)}), family
    except KeyError as exc:
        raise CheckpointError(f"{where} lacks the required field {exc.args[0]!r}.") from exc
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{where} has a field of the wrong type: {exc}.") from exc


def _load_hf_dir(directory: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, Any]]:
    from safetensors import safe_open

    config, family = _hf_config(directory)
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
    wanted = set(family.checkpoint_names(config))
    tensors: dict[str, Any] = {}
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
                        tensor = fp8_checkpoint.load_weight(name, tensor, handle)
                    except ValueError as e:
                        raise CheckpointError(f"{str(file)!r}: {e}") from e
                else:
                    tensor = tensor.to(dtype).contiguous()
                tensors.update(family.to_engine(name, tensor, config))
    return config, tensors
