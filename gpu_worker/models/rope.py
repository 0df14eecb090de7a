"""Rotary position embeddings: the inverse frequencies a checkpoint's `rope_theta` and `rope_scaling` give, and the
cos/sin tables every attention path reads (computed in float64, then cast)."""

from __future__ import annotations

import math

import torch

from gpu_worker.model_config import ModelConfig


def _kind(scaling: dict) -> str | None:
    """A rope_scaling dict's kind: `rope_type`, or `type` in older files."""
    return scaling.get("rope_type", scaling.get("type"))


def rope_inv_freq(config: ModelConfig, max_positions: int, local: bool = False) -> torch.Tensor:
    """Inverse frequencies, with the checkpoint's scaling: Llama 3's, linear, or LongRoPE's (Phi-3). LongRoPE's
    factors are chosen once, from the positions the engine serves (`max_positions`): its short factors when they
    fit the pretrained context, its long ones otherwise. transformers chooses per forward pass by the sequence's
    length; a fixed choice keeps each token's output independent of what it is batched with (and equals
    transformers wherever the served context fits the pretrained one). `local`: the sliding-window layers'
    (their own base, `local_rope_theta`, unscaled)."""
    dim = config.head_dim
    theta = config.local_rope_theta if local and config.local_rope_theta else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = {} if local else config.rope_scaling or {}
    kind = _kind(scaling)
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "longrope":
        long = max_positions > scaling["original_max_position_embeddings"]
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float64)
        inv_freq = inv_freq / factors
    elif kind not in (None, "default"):
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: llama3, linear, longrope)")
    return inv_freq


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor LongRoPE multiplies cos and sin by (its `attention_factor`, by default from the context's
    extension); 1 for every other kind."""
    scaling = config.rope_scaling or {}
    if _kind(scaling) != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_tables(config: ModelConfig, max_positions: int, device: torch.device,
                dtype: torch.dtype, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_positions, head_dim / 2] for rotate-half RoPE (the HF layout), computed in float64;
    `local`: the sliding-window layers' (rope_inv_freq)."""
    positions = torch.arange(max_positions, dtype=torch.float64)
    freqs = torch.outer(positions, rope_inv_freq(config, max_positions, local))
    scale = 1.0 if local else rope_attention_factor(config)
    return (freqs.cos() * scale).to(device=device, dtype=dtype), (freqs.sin() * scale).to(device=device, dtype=dtype)
