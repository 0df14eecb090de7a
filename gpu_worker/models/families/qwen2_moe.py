"""Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention (q/k/v biases) with a mixture of experts of
`moe_intermediate_size` and a shared expert every token goes through (`shared_expert_intermediate_size`), scaled
by the sigmoid of its own gate. Its checkpoints use the engine's names."""

from __future__ import annotations

from typing import Any

from gpu_worker.models.families.family import CheckpointError, Family, refuse_sliding_window, refuse_true
from gpu_worker.models.families.moe import moe_config


class Qwen2Moe(Family):
    architecture = "qwen2_moe"
    hf_model_types = ("qwen2_moe",)
    gguf_architectures = ("qwen2moe",)
    gguf_with_experts = True

    def config_fields(self, cfg: dict[str, Any], where: str) -> dict[str, Any]:
        refuse_true(cfg, ("mlp_bias",), where, "MLP biases are not supported.")
        refuse_sliding_window(cfg, where)
        if cfg.get("qkv_bias") is False:
            raise CheckpointError(f"{where} sets qkv_bias=false: Qwen2-MoE is served with its q/k/v biases only.")
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        return {"attention_bias": True,
                "moe": moe_config(cfg, where, expert_size_key="moe_intermediate_size", shared_expert_size=shared)}

    def gguf_config_fields(self, field: Any, arch: str, tensor: Any = None) -> dict[str, Any]:
        return {"attention_bias": True}


FAMILY = Qwen2Moe()
