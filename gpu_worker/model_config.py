"""The architecture a checkpoint describes: the shapes and constants every part of the worker reads (the
model, its LoRA adapters, the KV cache's size per token). Read from a checkpoint by
`gpu_worker/models/checkpoint.py`; kept apart from it so that the rooms the model builds on (LoRA, the
CPU path) can know the shapes without importing the model's room.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
