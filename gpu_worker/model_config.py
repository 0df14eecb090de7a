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
    # Sliding-window attention (Gemma 3's local layers): the layers in `sliding_layers` see only the last
    # `sliding_window` positions (a query at p the keys p - sliding_window + 1 .. p), with their own RoPE base
    # `local_rope_theta` and no RoPE scaling; the other layers attend to the whole sequence.
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None
    # Gemma 3's layer variant: the embedding times `embedding_scale` (√hidden, rounded to the model's dtype),
    # an RMSNorm on the attention's and on the MLP's output before each residual add (`attention_output_norm`,
    # `mlp_output_norm`), the MLP's gate through `hidden_activation` (silu or gelu_tanh), scores scaled by
    # `query_pre_attn_scalar` ** -0.5 instead of head_dim ** -0.5, and the logits soft-capped
    # (cap * tanh(logits / cap)) where `final_logit_softcapping` is set.
    embedding_scale: float = 1.0
    sandwich_norms: bool = False
    hidden_activation: str = "silu"
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None

    @property
    def attention_scale(self) -> float:
        """What attention multiplies q·k by."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends within a sliding window."""
        return layer in self.sliding_layers

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return self.moe is not None and layer in self.moe.sparse_layers
