"""Qwen2: Llama's layout with biases on the q/k/v projections (implicit: its config.json does not say so)."""

from __future__ import annotations

from typing import Any

from gpu_worker.models.families.family import Family, refuse_true


class Qwen2(Family):
    architecture = "qwen2"
    hf_model_types = ("qwen2",)
    gguf_architectures = ("qwen2",)

    def config_fields(self, cfg: dict[str, Any], where: str) -> dict[str, Any]:
        refuse_true(cfg, ("mlp_bias",), where, "MLP biases are not supported.")
        return {"attention_bias": True}

    def gguf_config_fields(self, field: Any, arch: str, tensor: Any = None) -> dict[str, Any]:
        return {"attention_bias": True}


FAMILY = Qwen2()
