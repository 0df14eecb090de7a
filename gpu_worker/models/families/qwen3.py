"""Qwen3 (dense): a per-head RMSNorm on q and k after their projections and before RoPE, no q/k/v biases, and a
head_dim its config.json states (not hidden_size / heads)."""

from __future__ import annotations

from typing import Any

from gpu_worker.models.families.family import Family


class Qwen3(Family):
    architecture = "qwen3"
    hf_model_types = ("qwen3",)
    gguf_architectures = ("qwen3",)
    gguf_layer_names = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}

    def config_fields(self, cfg: dict[str, Any], where: str) -> dict[str, Any]:
        super().config_fields(cfg, where)
        return {"qk_norm": True}

    def gguf_config_fields(self, field: Any, arch: str, tensor: Any = None) -> dict[str, Any]:
        return {"qk_norm": True}


FAMILY = Qwen3()
