"""Config `quantization` on the CPU: which of a GGUF file's weights stay in their blocks at load (`auto`),
whether the model quantizes its linear weights to int8 (`int8`), and the log line saying how it serves them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog
import torch

from gpu_worker.gguf_blocks import GGUFBlocks
from hetero_common.config import Config
from hetero_common.errors import ConfigError
from kernels import fp8_linear
from kernels.native import linear_gguf
from kernels.native.linear_gguf import GGUFPackedWeight

log = structlog.get_logger("gpu_worker.gguf")


def gguf_blocks_kept(config: Config, device: torch.device, tensor_parallel: Any) -> Callable[[int, int, int], bool] | None:
    """checkpoint.load_checkpoint's `keep_blocks`: with `quantization` auto, on a CPU worker without tensor
    parallelism, the weights whose type and shape the GGUF kernel takes here; else None (all dequantized)."""
    if config.quantization != "auto" or device.type != "cpu" or tensor_parallel.enabled:
        return None
    return linear_gguf.supported


def log_gguf_serving(weights: dict[str, Any], model: Any) -> None:
    """One line for a GGUF file's weights: how many the model computes from their blocks, and why the others
    (if any) were dequantized."""
    kept = [w for w in weights.values() if isinstance(w, GGUFBlocks)]
    if not kept:
        return
    served = sum(type(w) is GGUFPackedWeight for layer in model.layers for w in layer.values())
    served += type(model.lm_head) is GGUFPackedWeight
    if served:
        log.info("gguf weights served from their blocks", products=served,
                 types=sorted({w.ggml_type for w in kept}), one_c_call=model.c_layers is not None)
    else:
        log.info("gguf weights dequantized", dtype=str(model.dtype).removeprefix("torch."),
                 reason="the GGUF kernel needs bfloat16 on the C kernels (cpu_kernels, weight_prepack, dtype)")


def quantized_weights(config: Config, device: torch.device, dtype: torch.dtype, c_linear: bool) -> dict[str, bool]:
    """LlamaModel's `gguf_blocks`, `int8_weights`, `int8_w8a8` and `fp8_weights` for this worker: `int8` is the
    GGUF kernel's int8 weights on the CPU, torch._int_mm's W8A8 on CUDA. `int8` or `fp8` that cannot be served
    here is refused (ConfigError), not quietly dequantized."""
    if config.quantization == "fp8" and (why := fp8_linear.unavailable_reason(device, dtype)):
        raise ConfigError(f"config key 'quantization' = 'fp8' cannot be served here: {why}; use none")
    int8 = config.quantization == "int8"
    cuda_int8 = int8 and device.type == "cuda"
    if int8 and not cuda_int8 and (not c_linear or not linear_gguf.supported(linear_gguf.Q8_0, 16, 32)):
        raise ConfigError("config key 'quantization' = 'int8' cannot be served on this CPU: it needs AVX512-VNNI and "
                          "bfloat16 on the C kernels (dtype, cpu_kernels, weight_prepack); use none")
    return {"gguf_blocks": c_linear, "int8_weights": int8 and not cuda_int8, "int8_w8a8": cuda_int8,
            "fp8_weights": config.quantization == "fp8"}
