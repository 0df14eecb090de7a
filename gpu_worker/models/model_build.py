"""A model on the worker's device from its checkpoint's tensors: the served model (runner.py) and a speculative
draft model (draft_model.py) are built the same way; the device and dtype `auto` resolve to."""

from __future__ import annotations

import torch

from gpu_worker.cpu.gguf_serving import log_gguf_serving
from gpu_worker.cpu.packed_linear import prepack_supported
from gpu_worker.cpu.worker_setup import plan_c_linear, resolve_cpu_dtype
from gpu_worker.model_config import ModelConfig
from gpu_worker.models.model import LlamaModel
from gpu_worker.models.model_shapes import linear_shapes
from gpu_worker.models.weight_quantization import quantized_weights
from gpu_worker.parallel.tensor_parallel import TensorParallel
from hetero_common.config import Config


def build_model(config: Config, model_config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                dtype: torch.dtype, max_positions: int, tp: TensorParallel) -> tuple[LlamaModel, bool]:
    """(the model on `device`, its linear weights packed where the CPU's products want them; whether its linear
    layers go through the C kernel)."""
    prepack = config.weight_prepack and prepack_supported(device, dtype)
    c_linear, c_linear_amx, c_linear_max_rows = plan_c_linear(
        dtype, prepack, config.cpu_kernels, linear_shapes(model_config, tp), config.deterministic)
    model = LlamaModel(model_config, weights, device, dtype, max_positions, tp,
                       prepack=prepack, native_linear=c_linear, native_linear_max_rows=c_linear_max_rows,
                       native_linear_amx=c_linear_amx, fused=fused_elementwise(config, device),
                       **quantized_weights(config, device, dtype, c_linear))
    log_gguf_serving(weights, model)
    return model, c_linear


def fused_elementwise(config: Config, device: torch.device) -> bool:
    """Whether the model runs its element-wise passes fused: on CUDA by config `use_flashinfer_fused_rope`
    (FlashInfer's kernels), on a CPU unless `cpu_kernels` is torch (the C kernels, bfloat16)."""
    return config.use_flashinfer_fused_rope if device.type == "cuda" else config.cpu_kernels != "torch"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, hidden_size: int = 0, prepack: bool = True,
                  cpu_kernels: str = "auto") -> torch.dtype:
    """`auto`: bfloat16 on CUDA; on a CPU, bfloat16 where its matrix products are faster (cpu.worker_setup)."""
    if device.type == "cpu":
        return resolve_cpu_dtype(name, hidden_size, prepack, cpu_kernels)[0]
    return torch.bfloat16 if name == "auto" else getattr(torch, name)
