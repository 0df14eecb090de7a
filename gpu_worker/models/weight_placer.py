"""Checkpoint tensors onto the model's device, in its dtype, each linear weight packed for the product that will
compute it: oneDNN's or the C kernel's layout, GGUF blocks, int8 or fp8 (gpu_worker/models/model.py's plan)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu_worker.cpu.packed_linear import PackedWeight, pack_weight
from gpu_worker.gguf_blocks import GGUFBlocks
from kernels import fp8_linear, int8_linear
from kernels.native import linear_gguf
from kernels.native.linear import amx_fits


@dataclass(frozen=True)
class WeightPlacer:
    """Checkpoint tensors onto the model's device in its dtype, linear weights packed as the runner planned
    (LlamaModel's arguments of the same names)."""

    weights: dict[str, torch.Tensor]
    device: torch.device
    dtype: torch.dtype
    prepack: bool
    native_linear: bool
    native_linear_max_rows: int | None
    native_linear_amx: bool
    gguf_blocks: bool = False  # GGUF weights kept in their blocks are packed for the GGUF kernel
    int8_weights: bool = False  # the others quantized to int8 (Q8_0 blocks) for it (config `quantization` int8)
    fp8_weights: bool = False  # the layers' linear weights quantized to fp8 (config `quantization` fp8)
    int8_w8a8: bool = False  # ... to int8 for torch._int_mm (config `quantization` int8 on CUDA)

    def tensor(self, name: str, shard: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """The checkpoint's tensor `name` (or this rank's `shard` of it), contiguous; one kept in GGUF blocks or
        loaded in fp8, dequantized."""
        tensor = self.weights[name]
        if isinstance(tensor, GGUFBlocks):
            tensor = tensor.dequantized()
        elif isinstance(tensor, fp8_linear.Fp8Weight):
            tensor = tensor.dequantized(torch.float32)
        tensor = tensor if shard is None else shard(tensor)
        return tensor.to(device=self.device, dtype=self.dtype).contiguous()

    def from_blocks(self, names: list[str]) -> bool:
        """Whether `linear` computes these weights from their GGUF blocks."""
        parts = [self.weights[name] for name in names]
        return (self.gguf_blocks and all(isinstance(p, GGUFBlocks) for p in parts)
                and len({p.ggml_type for p in parts}) == 1
                and all(linear_gguf.supported(p.ggml_type, *p.shape) for p in parts))

    def linear(self, names: list[str], shard: Callable[[torch.Tensor], torch.Tensor] | None = None) -> PackedWeight:
        """The linear weight of `names` stacked along their outputs (q/k/v, gate/up: one product), this rank's
        `shard` of each: from the GGUF blocks where every part is kept in blocks of one type the kernel takes
        (and no shard applies), else from their tensors."""
        parts = [self.weights[name] for name in names]
        if shard is None and self.from_blocks(names):
            return linear_gguf.concat_rows([linear_gguf.pack(p.blocks, p.ggml_type, *p.shape) for p in parts])
        if shard is None and self.fp8_weights and all(isinstance(p, fp8_linear.Fp8Weight) for p in parts):
            return fp8_linear.concat_rows([fp8_linear.to_device(p, self.device) for p in parts])  # the file's own
        tensors = [self.tensor(name, shard) for name in names]
        weight = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
        if self.int8_weights and linear_gguf.supported(linear_gguf.Q8_0, *weight.shape):
            return linear_gguf.pack(linear_gguf.int8_blocks(weight), linear_gguf.Q8_0, *weight.shape)
        if self.fp8_weights:
            return fp8_linear.quantize_weight(weight)
        if self.int8_w8a8:
            return int8_linear.quantize_weight(weight)
        return self.matrix(weight)

    def matrix(self, tensor: torch.Tensor) -> PackedWeight:
        """A linear layer's weight, packed when `prepack`."""
        if not self.prepack:
            return tensor
        amx = self.native_linear_amx and amx_fits(*tensor.shape)  # else the panels (the runner's plan checked them all)
        return pack_weight(tensor, self.native_linear, self.native_linear_max_rows, amx)
