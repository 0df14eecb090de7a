"""Rotary position embeddings: the inverse frequencies a checkpoint's `rope_theta` and `rope_scaling` give, and the
cos/sin tables every attention path reads (computed in float64, then cast)."""

from __future__ import annotations

import math

import torch

from gpu_worker.model_config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, with Llama-3 style scaling when the checkpoint asks for it."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
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
    elif kind not in (None, "default"):
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: llama3, linear)")
    return inv_freq


def rope_tables(config: ModelConfig, max_positions: int, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_positions, head_dim / 2] for rotate-half RoPE (the HF layout), computed in float64."""
    positions = torch.arange(max_positions, dtype=torch.float64)
    freqs = torch.outer(positions, rope_inv_freq(config))
    return freqs.cos().to(device=device, dtype=dtype), freqs.sin().to(device=device, dtype=dtype)
