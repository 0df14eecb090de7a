"""Hugging Face checkpoints whose linear weights are already fp8 (the `fp8` and `compressed-tensors` layouts on
the Hub: float8_e4m3fn weights, each with a float32 `<name>_scale` of one value per tensor or per output
channel). Such a weight loads as a kernels/fp8_linear.Fp8Weight: served as it is with `quantization: fp8`,
dequantized to the model's dtype otherwise (gpu_worker/models/model.py's WeightPlacer). Activation scales in the
file (`input_scale`, a static scheme) are not used: activations are scaled per token on each call.
Block-wise scales (`weight_block_size`, one scale per 128 x 128 tile) are refused.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.fp8_linear import FP8, Fp8Weight, from_checkpoint

SCALE_SUFFIX = "_scale"


def is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype == FP8


def check_quantization_config(cfg: dict[str, Any], source: str) -> str | None:
    """Why the config's `quantization_config` cannot be loaded (block-wise fp8, another method), or None."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method not in ("fp8", "compressed-tensors"):
        return f"{source} is quantized with {method!r}; only fp8 and compressed-tensors fp8 checkpoints load"
    if q.get("weight_block_size"):
        return f"{source} has block-wise fp8 scales (weight_block_size {q['weight_block_size']}), which do not load"
    return None


def load_weight(name: str, weight: torch.Tensor, handle: Any) -> Fp8Weight:
    """An fp8 weight and its scale from the same safetensors file (`handle`: safe_open's)."""
    scale_name = name + SCALE_SUFFIX
    if scale_name not in handle.keys():
        raise ValueError(f"fp8 weight {name!r} has no {scale_name!r} beside it in its file")
    return from_checkpoint(weight, handle.get_tensor(scale_name))
