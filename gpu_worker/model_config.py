"""The architecture a checkpoint describes: the shapes and constants every part of the worker reads (the
model, its LoRA adapters, the KV cache's size per token). Read from a checkpoint by
`gpu_worker/models/checkpoint.py`; kept apart from it so that the rooms the model builds on (LoRA, the
CPU path) can know the shapes without importing the model's room.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP (Mixtral, Qwen2/3-MoE, OLMoE): a router picks `top_k` of `num_experts` SiLU-gated
    MLPs per token, whose outputs are summed weighted by the router's softmax probabilities (renormalized over
    the picked ones when `normalize_top_k`)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    normalize_top_k: bool
    sparse_layers: tuple[int, ...]  # the layers with experts; the others have the dense MLP (intermediate_size)
    # Qwen2-MoE's shared expert: a dense MLP of this size every token goes through, scaled by the sigmoid of its
    # own one-output gate (`mlp.shared_expert_gate`); 0 for none.
    shared_expert_intermediate_size: int = 0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # a family's name (gpu_worker/models/families/)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # HF rope_scaling dict (e.g. llama3) or None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections have biases (qwen2)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # A per-head RMSNorm on q and on k (weights [head_dim], eps rms_norm_eps) after their projections and before
    # RoPE (qwen3: `self_attn.q_norm` / `self_attn.k_norm`).
    qk_norm: bool = False
    # The same norm over all heads at once (weights [heads * head_dim] and [kv_heads * head_dim]: OLMoE).
    qk_norm_all_heads: bool = False
    moe: MoeConfig | None = None

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return self.moe is not None and layer in self.moe.sparse_layers
