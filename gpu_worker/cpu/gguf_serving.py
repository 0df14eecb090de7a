"""Config `quantization: auto` on the CPU: which of a GGUF file's weights stay in their blocks at load, and the
log line saying how it serves them (gpu_worker/models/weight_quantization.py decides the other values)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog
import torch

from gpu_worker.gguf_blocks import GGUFBlocks
from hetero_common.config import Config
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
    served = sum(type(w) is GGUFPackedWeight for w in model.products())
    if served:
        log.info("gguf weights served from their blocks", products=served,
                 types=sorted({w.ggml_type for w in kept}), one_c_call=model.c_layers is not None)
    else:
        log.info("gguf weights dequantized", dtype=str(model.dtype).removeprefix("torch."),
                 reason="the GGUF kernel needs bfloat16 on the C kernels (cpu_kernels, weight_prepack, dtype)")
