"""Gemma 3 (text: model_type gemma3_text, Gemma3ForCausalLM): sliding-window attention on its local layers (five of
every six), each layer type with its own RoPE (`rope_parameters` per layer type: the local layers' base unscaled,
the global ones' with the checkpoint's scaling), a per-head q/k RMSNorm, the embedding times √hidden, RMSNorms that
multiply by (1 + w), a norm on the attention's and on the MLP's output as well as before them, GELU-tanh, and scores
scaled by `query_pre_attn_scalar` ** -0.5.

The (1 + w) is folded into each norm's weight here, as llama.cpp's converter writes them into GGUF files: every
norm the model computes is then the plain w · x̂. Gemma's checkpoint names its norm before the MLP
`pre_feedforward_layernorm` and the norm on the attention's output `post_attention_layernorm`: the engine's names
are Llama's, where `post_attention_layernorm` is the norm before the MLP, so the two are renamed
(`attention_output_norm`, `mlp_output_norm` for the norms on the outputs)."""

from __future__ import annotations

from typing import Any

import torch

from gpu_worker.model_config import ModelConfig
from gpu_worker.models.families.family import CheckpointError, Family, expected_tensor_names, refuse_true

# checkpoint name -> engine name, per layer (Hugging Face's; GGUF's map onto these first)
_RENAMED = {"post_attention_layernorm": "attention_output_norm",
            "pre_feedforward_layernorm": "post_attention_layernorm",
            "post_feedforward_layernorm": "mlp_output_norm"}
_CHECKPOINT_NAME = {engine: checkpoint for checkpoint, engine in _RENAMED.items()}
_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
# llama.cpp's rules where a GGUF file says nothing: one global layer after every five local ones, a local RoPE base
# of 10000, and scores scaled by hidden / heads for the 62-layer 27B model (head_dim for the others).
_GGUF_PATTERN, _GGUF_LOCAL_THETA, _GGUF_27B_LAYERS = 6, 10000.0, 62


def _layer_types(cfg: dict[str, Any], layers: int, where: str) -> list[str]:
    """Each layer's type from `layer_types`, or (older files) from `sliding_window_pattern`."""
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", _GGUF_PATTERN)))
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"full_attention", "sliding_attention"}:
        raise CheckpointError(f"{where} has layer_types {types!r}: expected {layers} entries of full_attention "
                              "or sliding_attention.")
    return list(types)


def _rope(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """The global layers' RoPE base and scaling and the local layers' base: from `rope_parameters` per layer type
    (transformers >= 5), or from `rope_theta`, `rope_scaling` and `rope_local_base_freq`."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        full, local = dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise CheckpointError(f"{where} scales the local layers' RoPE ({local['rope_type']}): only their "
                                  "unscaled RoPE is supported.")
        theta, local_theta = float(full.pop("rope_theta", 1e6)), float(local.get("rope_theta", _GGUF_LOCAL_THETA))
        scaling = full if full.get("rope_type", "default") != "default" else None
    else:
        theta = float(cfg.get("rope_theta", params.get("rope_theta", 1e6)))
        local_theta = float(cfg.get("rope_local_base_freq", _GGUF_LOCAL_THETA))
        scaling = cfg.get("rope_scaling")
    return {"rope_theta": theta, "rope_scaling": dict(scaling) if scaling else None, "local_rope_theta": local_theta}


class Gemma3(Family):
    architecture = "gemma3"
    hf_model_types = ("gemma3_text",)
    gguf_architectures = ("gemma3",)
    gguf_layer_names = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                        "post_attention_norm": "post_attention_layernorm",
                        "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}

    def config_fields(self, cfg: dict[str, Any], where: str) -> dict[str, Any]:
        super().config_fields(cfg, where)
        refuse_true(cfg, ("attn_logit_softcapping",), where, "soft-capped attention scores (Gemma 2's) are not "
                    "supported.")
        refuse_true(cfg, ("use_bidirectional_attention",), where, "bidirectional attention is not supported.")
        activation = str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh")
        if activation not in _ACTIVATIONS:
            raise CheckpointError(f"{where} sets hidden_activation={activation!r}: supported is gelu_pytorch_tanh.")
        layers, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
        types = _layer_types(cfg, layers, where)
        window = int(cfg.get("sliding_window") or 0)
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        if sliding and window <= 0:
            raise CheckpointError(f"{where} has sliding_attention layers and no sliding_window: set it.")
        softcap = cfg.get("final_logit_softcapping")
        return {**_rope(cfg, where), **self._variant(hidden, window if sliding else 0, sliding),
                "hidden_activation": _ACTIVATIONS[activation],
                "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 256),
                "final_logit_softcapping": None if softcap is None else float(softcap)}

    @staticmethod
    def _variant(hidden: int, window: int, sliding: tuple[int, ...]) -> dict[str, Any]:
        return {"qk_norm": True, "sandwich_norms": True, "embedding_scale": hidden ** 0.5,
                "sliding_window": window, "sliding_layers": sliding}

    def gguf_config_fields(self, field: Any, arch: str, tensor: Any = None) -> dict[str, Any]:
        layers, hidden = int(field(f"{arch}.block_count")), int(field(f"{arch}.embedding_length"))
        heads = int(field(f"{arch}.attention.head_count"))
        head_dim = int(field(f"{arch}.attention.key_length") or hidden // heads)
        pattern = field(f"{arch}.attention.sliding_window_pattern") or _GGUF_PATTERN
        if isinstance(pattern, list):  # a flag per layer, true for a sliding-window one
            sliding = tuple(i for i, swa in enumerate(pattern) if swa)
        else:  # every pattern-th layer global
            sliding = tuple(i for i in range(layers) if (i + 1) % int(pattern))
        window = int(field(f"{arch}.attention.sliding_window") or 0)
        if sliding and window <= 0:
            raise CheckpointError(f"the GGUF file lacks {arch}.attention.sliding_window.")
        softcap, scale = field(f"{arch}.final_logit_softcapping"), field(f"{arch}.attention.scale")
        scalar = (float(scale) ** -2 if scale else hidden // heads if layers == _GGUF_27B_LAYERS else head_dim)
        return {**self._variant(hidden, window if sliding else 0, sliding), "hidden_activation": "gelu_tanh",
                "local_rope_theta": float(field(f"{arch}.rope.freq_base_swa") or _GGUF_LOCAL_THETA),
                "query_pre_attn_scalar": float(scalar),
                "final_logit_softcapping": None if softcap is None else float(softcap)}

    def checkpoint_names(self, config: ModelConfig) -> list[str]:
        names = []
        for name in expected_tensor_names(config):
            stem, _, kind = name.rpartition(".")
            head, _, module = stem.rpartition(".")
            names.append(f"{head}.{_CHECKPOINT_NAME[module]}.{kind}" if module in _CHECKPOINT_NAME else name)
        return names

    def engine_module(self, module: str) -> str:
        return _RENAMED.get(module, module)

    def gguf_to_engine(self, name: str, tensor: Any, config: ModelConfig) -> list[tuple[str, Any]]:
        """Renamed alone: a GGUF file's norms already hold 1 + w (llama.cpp's converter adds it)."""
        return self.to_engine(name, tensor, config, shifted=True)

    def to_engine(self, name: str, tensor: Any, config: ModelConfig, shifted: bool = False) -> list[tuple[str, Any]]:
        """Renamed (the module docstring), and a norm's w as 1 + w, added in float32 (`shifted`: already so)."""
        stem, _, kind = name.rpartition(".")
        head, _, module = stem.rpartition(".")
        name = f"{head}.{self.engine_module(module)}.{kind}"
        if name.endswith("norm.weight") and not shifted:
            if not isinstance(tensor, torch.Tensor):
                raise CheckpointError(f"{name} is quantized ({type(tensor).__name__}): norms load unquantized.")
            tensor = (tensor.float() + 1.0).to(tensor.dtype)
        return [(name, tensor)]


FAMILY = Gemma3()
