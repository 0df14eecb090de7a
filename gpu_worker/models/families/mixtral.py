"""Mixtral: Mistral's attention with a mixture of experts in every layer, softmax over the router's logits and
the top-2 (`num_experts_per_tok`) renormalized. Its checkpoints name the router `block_sparse_moe.gate` and each
expert's products w1 (gate), w3 (up), w2 (down); they become the engine's names here."""

from __future__ import annotations

from typing import Any

from gpu_worker.model_config import ModelConfig
from gpu_worker.models.families.family import Family, expected_tensor_names, sliding_window_fields
from gpu_worker.models.families.moe import moe_config

# the engine's name for a Mixtral expert's product, and back
_PRODUCTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_CHECKPOINT_PRODUCTS = {v: k for k, v in _PRODUCTS.items()}


class Mixtral(Family):
    architecture = "mixtral"
    hf_model_types = ("mixtral",)
    gguf_architectures = ("llama",)  # llama.cpp writes Mixtral as a `llama` file with experts, its Q/K permuted
    gguf_with_experts = True
    gguf_rotary_permuted = True
    gguf_normalize_top_k = True

    def config_fields(self, cfg: dict[str, Any], where: str) -> dict[str, Any]:
        super().config_fields(cfg, where)
        return {"moe": moe_config(cfg, where, expert_size_key="intermediate_size", normalize_top_k=True),
                **sliding_window_fields(cfg, where)}

    def checkpoint_names(self, config: ModelConfig) -> list[str]:
        return [_to_checkpoint(name) for name in expected_tensor_names(config)]

    def to_engine(self, name: str, tensor: Any, config: ModelConfig) -> list[tuple[str, Any]]:
        if ".block_sparse_moe." not in name:
            return [(name, tensor)]
        name = name.replace(".block_sparse_moe.", ".mlp.")
        stem, _, product = name.removesuffix(".weight").rpartition(".")
        return [(f"{stem}.{_PRODUCTS.get(product, product)}.weight", tensor)]


def _to_checkpoint(name: str) -> str:
    """An engine name as a Mixtral checkpoint spells it."""
    if ".mlp." not in name:
        return name
    name = name.replace(".mlp.", ".block_sparse_moe.")
    stem, _, product = name.removesuffix(".weight").rpartition(".")
    return f"{stem}.{_CHECKPOINT_PRODUCTS.get(product, product)}.weight" if ".experts." in name else name


FAMILY = Mixtral()
