"""Qwen3-MoE: Qwen3's attention (q/k RMSNorm per head) with a mixture of experts of `moe_intermediate_size`,
top-k (`num_experts_per_tok`) of a softmax, renormalized where `norm_topk_prob`; the layers in `mlp_only_layers`
(and off `decoder_sparse_step`) keep a dense MLP of `intermediate_size`. Its checkpoints use the engine's names."""

from __future__ import annotations

from typing import Any

from gpu_worker.models.families.family import Family, refuse_sliding_window
from gpu_worker.models.families.moe import moe_config


class Qwen3Moe(Family):
    architecture = "qwen3_moe"
    hf_model_types = ("qwen3_moe",)
    gguf_architectures = ("qwen3moe",)
    gguf_layer_names = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
    gguf_with_experts = True
    gguf_normalize_top_k = True

    def config_fields(self, cfg: dict[str, Any], where: str) -> dict[str, Any]:
        super().config_fields(cfg, where)
        refuse_sliding_window(cfg, where)
        return {"qk_norm": True, "moe": moe_config(cfg, where, expert_size_key="moe_intermediate_size")}

    def gguf_config_fields(self, field: Any, arch: str, tensor: Any = None) -> dict[str, Any]:
        return {"qk_norm": True}


FAMILY = Qwen3Moe()
