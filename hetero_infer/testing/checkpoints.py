"""Checkpoints written from tensors, for benchmarks that need variants of a model offline: a Hugging Face
directory from a state dict (an early-exit draft, a model with a LoRA adapter merged in) and a LoRA adapter in
PEFT's format with random weights, written without `peft` or `transformers`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from gpu_worker.lora.lora_adapter import target_shape
from gpu_worker.models.checkpoint import ModelConfig


def save_checkpoint(config: ModelConfig, weights: dict[str, torch.Tensor], directory: Path,
                    dtype: torch.dtype = torch.bfloat16, **overrides) -> Path:
    """`weights` (HF names) and `config` (with `overrides`, e.g. num_hidden_layers) as a Hugging Face directory."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file({name: t.to(dtype).contiguous() for name, t in weights.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    settings = {k: v for k, v in dataclasses.asdict(config).items()
                if k not in ("architecture", "eos_token_ids", "attention_bias")}
    settings.update(model_type=config.architecture, eos_token_id=list(config.eos_token_ids), **overrides)
    (directory / "config.json").write_text(json.dumps(settings))
    return directory


def module_name(layer: int, target: str) -> str:
    kind = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"model.layers.{layer}.{kind}.{target}"


def write_random_lora(config: ModelConfig, directory: Path, rank: int, targets: list[str], seed: int = 0,
                      alpha: float = 32.0, scale: float = 0.02) -> Path:
    """A LoRA adapter for `config` in PEFT's format (adapter_config.json, adapter_model.safetensors) with A and B
    drawn N(0, scale)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for target in targets:
            out, inp = target_shape(config, target)
            prefix = f"base_model.model.{module_name(layer, target)}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=g) * scale
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets, "bias": "none"}))
    return directory
