"""Phi-3 and Phi-4 (model_type phi3), from Hugging Face directories: Llama's computation over fused checkpoint
weights (`qkv_proj`, `gate_up_proj`), split here into the engine's q/k/v and gate/up, and LongRoPE
(`rope_scaling.rope_type` longrope, "su" in older files; gpu_worker/models/rope.py), and a sliding window over
every layer where `sliding_window` is below the context (Phi-3-mini-4k's). Its GGUF files (llama.cpp's `phi3`)
keep the same fused tensors (`attn_qkv`, and `ffn_up` holding gate and up) and LongRoPE's factors as tensors
(`rope_factors_long`/`_short`) beside `rope.scaling.original_context_length` and `attn_factor`."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gpu_worker.gguf_blocks import GGUFBlocks
from gpu_worker.model_config import ModelConfig
from gpu_worker.models.families.family import CheckpointError, Family, expected_tensor_names, sliding_window_fields

_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
_FUSED_FROM = {part: fused for fused, parts in _FUSED.items() for part in parts}


class Phi3(Family):
    architecture = "phi3"
    hf_model_types = ("phi3",)
    gguf_architectures = ("phi3",)
    gguf_layer_names = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
    # GGUF tensor -> the engine's parts it fuses, in row order (what the GGUF writer concatenates)
    gguf_fused = {"attn_qkv": _FUSED["self_attn.qkv_proj"], "ffn_up": _FUSED["mlp.gate_up_proj"]}

    def gguf_config_fields(self, field: Any, arch: str, tensor: Any = None) -> dict[str, Any]:
        window = field(f"{arch}.attention.sliding_window")
        fields = sliding_window_fields({"sliding_window": window, "num_hidden_layers": field(f"{arch}.block_count"),
                                        "max_position_embeddings": field(f"{arch}.context_length", 2048)}, arch)
        long, short = (tensor(f"rope_factors_{kind}.weight") if tensor else None for kind in ("long", "short"))
        original = field(f"{arch}.rope.scaling.original_context_length")
        if long is None or short is None or original is None:
            return fields
        scaling = {"rope_type": "longrope", "long_factor": long, "short_factor": short,
                   "original_max_position_embeddings": int(original)}
        if (factor := field(f"{arch}.rope.scaling.attn_factor")) is not None:
            scaling["attention_factor"] = float(factor)
        return {**fields, "rope_scaling": scaling}

    def config_fields(self, cfg: dict[str, Any], where: str) -> dict[str, Any]:
        super().config_fields(cfg, where)
        window = sliding_window_fields(cfg, where)  # Phi-3-mini-4k's 2047
        rope = dict(cfg.get("rope_parameters") or {})
        partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        if partial != 1.0:
            raise CheckpointError(f"{where} sets partial_rotary_factor={partial}: only full rotary heads are "
                                  "supported (Phi-4-mini's 0.75 is not yet).")
        scaling = cfg.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"}
                                              if rope.get("rope_type", "default") != "default" else None)
        if scaling and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
            original = cfg.get("original_max_position_embeddings", scaling.get("original_max_position_embeddings"))
            if original is None:
                raise CheckpointError(f"{where} asks for LongRoPE without original_max_position_embeddings.")
            return {"rope_scaling": {**scaling, "rope_type": "longrope",
                                     "original_max_position_embeddings": int(original)}, **window}
        return window

    def checkpoint_names(self, config: ModelConfig) -> list[str]:
        """The engine's names with each q/k/v and gate/up part replaced by the fused tensor it comes from."""
        names: dict[str, None] = {}
        for name in expected_tensor_names(config):
            layer, _, module = name.removeprefix("model.layers.").partition(".")
            fused = _FUSED_FROM.get(module.removesuffix(".weight"))
            names[f"model.layers.{layer}.{fused}.weight" if fused else name] = None
        return list(names)

    def to_engine(self, name: str, tensor: Any, config: ModelConfig) -> list[tuple[str, Any]]:
        prefix, _, rest = name.partition(".layers.")
        layer, _, module = rest.partition(".")
        module = module.removesuffix(".weight")
        if module not in _FUSED:
            return [(name, tensor)]
        c = config
        sizes = ([c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim,
                  c.num_key_value_heads * c.head_dim] if module == "self_attn.qkv_proj"
                 else [c.intermediate_size, c.intermediate_size])
        parts = _split_rows(tensor, sizes, name)
        return [(f"{prefix}.layers.{layer}.{part}.weight", t) for part, t in zip(_FUSED[module], parts)]


def _split_rows(tensor: Any, sizes: list[int], what: str) -> list[Any]:
    """A fused weight cut into parts along its rows."""
    if int(tensor.shape[0]) != sum(sizes):
        raise CheckpointError(f"{what} has {int(tensor.shape[0])} rows where the config implies {sum(sizes)}.")
    if isinstance(tensor, GGUFBlocks):  # a row's blocks are its own: cut between rows
        bounds = np.cumsum([0] + sizes)
        return [GGUFBlocks(tensor.ggml_type, (int(b - a), tensor.shape[1]), np.ascontiguousarray(tensor.blocks[a:b]))
                for a, b in zip(bounds[:-1], bounds[1:])]
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointError(f"{what} is fused and quantized ({type(tensor).__name__}): load it unquantized.")
    return [part.contiguous() for part in torch.split(tensor, sizes)]


FAMILY = Phi3()
