"""OLMoE: Llama's attention with an RMSNorm over all of q's heads at once and another over all of k's (weights
[heads * head_dim], [kv_heads * head_dim]; not per head as Qwen3's), and a mixture of experts of
`intermediate_size` in every layer, top-k of a softmax, renormalized where `norm_topk_prob`. Its checkpoints use
the engine's names; `clip_qkv` (clamping q, k and v) is refused."""

from __future__ import annotations

from typing import Any

from gpu_worker.models.families.family import CheckpointError, Family
from gpu_worker.models.families.moe import moe_config


class Olmoe(Family):
    architecture = "olmoe"
    hf_model_types = ("olmoe",)
    gguf_architectures = ("olmoe",)
    gguf_layer_names = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
    gguf_with_experts = True

    def config_fields(self, cfg: dict[str, Any], where: str) -> dict[str, Any]:
        super().config_fields(cfg, where)
        if cfg.get("clip_qkv") is not None:
            raise CheckpointError(f"{where} sets clip_qkv={cfg['clip_qkv']!r}: clamping q, k and v is not supported.")
        return {"qk_norm": True, "qk_norm_all_heads": True,
                "moe": moe_config(cfg, where, expert_size_key="intermediate_size")}

    def gguf_config_fields(self, field: Any, arch: str, tensor: Any = None) -> dict[str, Any]:
        return {"qk_norm": True, "qk_norm_all_heads": True}


FAMILY = Olmoe()
