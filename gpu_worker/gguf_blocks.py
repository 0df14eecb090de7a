"""A GGUF tensor kept in its block format (config `quantization` auto): the checkpoint's linear weights
stay as the file holds them until the model packs them for kernels/native/linear_gguf.c, or dequantizes
them where that kernel does not serve them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class GGUFBlocks:
    """An [out, in] weight: its rows of GGUF blocks (in Hugging Face's row order), ggml type `ggml_type`."""

    ggml_type: int
    shape: tuple[int, int]  # [out, in]
    blocks: np.ndarray  # uint8 [out, bytes per row]

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from gguf.quants import dequantize

        return torch.from_numpy(dequantize(self.blocks, self.ggml_type).reshape(self.shape)).to(dtype).contiguous()
