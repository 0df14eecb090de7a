"""Config `quantization`: which of LlamaModel's quantized weight forms this worker serves, on its device; a
value that cannot be served here is refused (ConfigError), never quietly dequantized. `auto` keeps a GGUF file's
blocks on the CPU (gpu_worker/cpu/gguf_serving.py); `int8` is the GGUF kernel's int8 weights on the CPU and
torch._int_mm's W8A8 on CUDA; `fp8` is torch._scaled_mm's."""

from __future__ import annotations

import torch

from hetero_common.config import Config
from hetero_common.errors import ConfigError
from kernels import fp8_linear
from kernels.native import linear_gguf


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
