"""What a model family declares: how its Hugging Face config maps onto `ModelConfig`, which tensors its checkpoints
carry under which names (Hugging Face and GGUF), and how they become the engine's own names. The engine's names
are Llama's (`model.layers.{i}.self_attn.q_proj.weight`, ...): one layout that the model
(gpu_worker/models/model.py), LoRA and the quantized paths read whatever the family.

A family is a subclass of `Family` in its own module here, registered in `families/__init__.py`.
"""

from __future__ import annotations

from typing import Any

from gpu_worker.model_config import ModelConfig
from hetero_common.model_files import ModelFileError


class CheckpointError(ModelFileError):
    """A checkpoint cannot be loaded; the message says what to fix."""


def refuse_true(cfg: dict[str, Any], keys: tuple[str, ...], where: str, why: str) -> None:
    """A config whose `keys` are set (truthy) asks for a variant this engine does not compute: refuse it by name
    rather than load it and silently compute something else."""
    for key in keys:
        if cfg.get(key):
            raise CheckpointError(f"{where} sets {key}={cfg[key]!r}: {why}")


def refuse_sliding_window(cfg: dict[str, Any], where: str) -> None:
    """A window below the context is a different attention than the one computed here: refused by name."""
    # (Phi-3-mini-4k's 2047 is one; a window as long as the context, as Phi-3-128k's, is no window)
    window, context = cfg.get("sliding_window"), int(cfg.get("max_position_embeddings", 2048))
    if cfg.get("use_sliding_window", True) and window and int(window) < context:
        raise CheckpointError(f"{where} sets sliding_window={window} below max_position_embeddings={context}: "
                              "sliding-window attention is not supported for this architecture.")


def sliding_window_fields(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """Mistral's, Mixtral's and Phi-3's window over every layer (a query at p sees p - window + 1 .. p), where
    `sliding_window` is below the context: ModelConfig's sliding_window and sliding_layers (all), else none."""
    window, context = cfg.get("sliding_window"), int(cfg.get("max_position_embeddings", 2048))
    if not (cfg.get("use_sliding_window", True) and window and int(window) < context):
        return {}
    if int(window) <= 0:
        raise CheckpointError(f"{where} sets sliding_window={window}: it must be positive or null.")
    return {"sliding_window": int(window), "sliding_layers": tuple(range(int(cfg["num_hidden_layers"])))}


class Family:
    """Llama's layout, which every family starts from: override what differs."""

    architecture: str = ""  # ModelConfig.architecture; what ListModels reports
    hf_model_types: tuple[str, ...] = ()  # config.json `model_type` values
    gguf_architectures: tuple[str, ...] = ()  # GGUF `general.architecture` values
    # llama.cpp permutes the Q/K rows of `llama` files for its interleaved RoPE (gguf_checkpoint._unpermute_rotary)
    gguf_rotary_permuted: bool = False
    # GGUF per-layer tensor names (`blk.{i}.<name>`) beyond the common ones, as checkpoint names (before
    # `to_engine`), e.g. Qwen3's `attn_q_norm` -> `self_attn.q_norm`
    gguf_layer_names: dict[str, str] = {}
    # GGUF per-layer tensors that hold several of the engine's in row order (Phi-3's `attn_qkv`: q, k, v), for
    # the GGUF writer; the loader splits them through `to_engine` as it does the checkpoint's fused ones
    gguf_fused: dict[str, tuple[str, ...]] = {}
    # A mixture of experts' GGUF files carry `{arch}.expert_count` (Mixtral's are `llama` files with experts), and
    # say whether the top-k weights are renormalized only in some architectures (`expert_weights_norm`): the
    # family's rule where they do not, as llama.cpp computes it.
    gguf_with_experts: bool = False
    gguf_normalize_top_k: bool = False

    def config_fields(self, cfg: dict[str, Any], where: str) -> dict[str, Any]:
        """The family's `ModelConfig` fields from its config.json (`where` names the file in errors) beyond the
        common ones the loader reads; raises CheckpointError for variants it does not compute."""
        refuse_true(cfg, ("mlp_bias", "attention_bias"), where,
                    "MLP and output-projection biases are not supported for this architecture.")
        return {}

    def gguf_config_fields(self, field: Any, arch: str, tensor: Any = None) -> dict[str, Any]:
        """The same from a GGUF file's metadata; `field(key, default)` reads one key, `tensor(name)` one small
        tensor as float64 numbers, or None (Phi-3's LongRoPE factors)."""
        return {}

    def checkpoint_names(self, config: ModelConfig) -> list[str]:
        """The tensor names a Hugging Face checkpoint of this family carries for `config` (what the loader reads)."""
        return expected_tensor_names(config)

    def engine_module(self, module: str) -> str:
        """A layer module's engine name from its checkpoint name (`pre_feedforward_layernorm` -> Gemma's
        `post_attention_layernorm`); what `to_engine` renames, and the GGUF writer reverses."""
        return module

    def to_engine(self, name: str, tensor: Any, config: ModelConfig) -> list[tuple[str, Any]]:
        """A checkpoint tensor under the engine's names: renamed, or a fused one split (a fused qkv_proj)."""
        return [(name, tensor)]

    def gguf_to_engine(self, name: str, tensor: Any, config: ModelConfig) -> list[tuple[str, Any]]:
        """The same for a GGUF file's tensor, under its Hugging Face name (where the two formats store a tensor
        differently, as Gemma's norms)."""
        return self.to_engine(name, tensor, config)


def expected_tensor_names(config: ModelConfig) -> list[str]:
    """Every tensor, under the engine's names, that the model for `config` reads."""
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
        names += mlp_tensor_names(config, i)
        names += [f"{prefix}input_layernorm.weight", f"{prefix}post_attention_layernorm.weight"]
        if config.sandwich_norms:  # Gemma's norms on the attention's and the MLP's outputs
            names += [f"{prefix}attention_output_norm.weight", f"{prefix}mlp_output_norm.weight"]
    return names


def mlp_tensor_names(config: ModelConfig, layer: int) -> list[str]:
    """Layer `layer`'s MLP tensors under the engine's names: the dense gate/up/down, or a mixture of experts'
    router (`mlp.gate`), experts (`mlp.experts.{j}.*`) and shared expert (Qwen2-MoE's)."""
    prefix, products = f"model.layers.{layer}.mlp.", ("gate", "up", "down")
    if not config.is_sparse(layer):
        return [f"{prefix}{p}_proj.weight" for p in products]
    moe = config.moe
    assert moe is not None
    names = [f"{prefix}gate.weight"]
    names += [f"{prefix}experts.{j}.{p}_proj.weight" for j in range(moe.num_experts) for p in products]
    if moe.shared_expert_intermediate_size:
        names += [f"{prefix}shared_expert.{p}_proj.weight" for p in products] + [f"{prefix}shared_expert_gate.weight"]
    return names
