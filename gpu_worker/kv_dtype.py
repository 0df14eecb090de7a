"""The KV cache's element type (config `kv_cache_dtype`), resolved against the model's dtype and the device.

- `fp8` (`fp8_e4m3`): float8 e4m3fn, unscaled (vLLM's default k/v scale of 1.0): half the bytes per token of
  bfloat16, so the same `kv_cache_memory_gb` (or free GPU memory) holds twice the blocks. On CUDA, FlashInfer
  reads it (or the torch reference, widening what it gathers); on the CPU, the C attention kernel's
  AVX512-BF16 path, which widens each row exactly (kernels/native/kv_formats.h).
- `int8` (the CPU only): int8 rows with a float32 scale per row (one token's K or V of one head): head_dim + 4
  bytes a row, 1.88x bfloat16's blocks at head size 64; 3 more significant bits than e4m3's for a row's
  largest values, which is what the scores depend on (docs/performance.md compares their accuracy).
Elsewhere both are refused, naming the key.
"""

from __future__ import annotations

import torch

from hetero_common.config import Config
from hetero_common.errors import ConfigError
from kernels.native import decode_attention as native_decode

CPU_QUANTIZED = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}


def kv_cache_torch_dtype(config: Config, model_dtype: torch.dtype, device: torch.device, head_dim: int) -> torch.dtype:
    """The cache's torch dtype; ConfigError where a quantized cache cannot be read on this device."""
    name = config.kv_cache_dtype
    if name == "auto":
        return model_dtype
    if name == "fp16":  # the config has checked that the model runs in float16
        return torch.float16
    if name not in CPU_QUANTIZED:
        raise ConfigError(f"config key 'kv_cache_dtype' = {name!r} is unknown; use auto, fp16, fp8 or int8")
    if device.type == "cuda":
        if name == "int8":
            raise ConfigError("config key 'kv_cache_dtype' = 'int8' cannot be served here: an int8 cache is the CPU "
                              "kernels' (FlashInfer has no int8 KV); use fp8 on CUDA")
        return torch.float8_e4m3fn
    why = _cpu_unavailable(config, model_dtype, head_dim)
    if why:
        raise ConfigError(f"config key 'kv_cache_dtype' = {name!r} cannot be served here: {why}; use auto")
    return CPU_QUANTIZED[name]


def _cpu_unavailable(config: Config, model_dtype: torch.dtype, head_dim: int) -> str | None:
    if model_dtype != torch.bfloat16:
        return f"on the CPU a quantized cache needs dtype bfloat16 (the model runs in {str(model_dtype)[6:]})"
    if config.cpu_kernels == "torch":
        return "on the CPU a quantized cache is read by the C attention kernel, and cpu_kernels is torch"
    if not native_decode.takes_prompts(head_dim, config.block_size):
        return ("on the CPU a quantized cache is read by the C attention kernel's AVX512-BF16 path, which needs "
                "that instruction set, head size 64 or 128 and a block_size that is a multiple of 16")
    return None
