"""bfloat16 linear layers through the C kernel (kernels/native/linear_bf16.c), for CPUs with
AVX512-BF16. Without AMX it beats oneDNN at every row count measured (most at decoding's 1-64 rows).
With AMX, oneDNN's tile kernels win from about 8 rows up, and the C kernel only at the few rows of
small-batch decoding, where the product streams the weights from memory (`max_rows`).

A weight is packed once at load (`pack`) into the kernel's panel layout; `linear` multiplies by it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import native_lib


@dataclass(frozen=True)
class NativePackedWeight:
    """An [out, in] bfloat16 weight in the C kernel's layout; `shape` is the weight's own."""

    packed: torch.Tensor  # int16, linear_bf16_packed_elements(out, in)
    shape: torch.Size


# On AMX CPUs, the most rows the C kernel takes: one forward's products at SmolLM2-135M's shapes on a
# 2-core Xeon with AMX (benchmarks/cpu_kernels.py) took 1.58x less time than oneDNN's at 1 row, 1.27x at
# 4, 1.03x at 8, and 0.73x at 12 (0.22x at 64).
AMX_MAX_ROWS = 8


def unavailable_reason(cpu_flags: set[str]) -> str | None:
    """None when the kernel can run here, else why not (the caller then keeps oneDNN)."""
    library = native_lib.load()
    if library is None:
        return native_lib.unavailable_reason()
    if not library.linear_bf16_supported():
        return "the CPU has no AVX512-BF16"
    return None


def max_rows(cpu_flags: set[str]) -> int | None:
    """The most rows a product goes through the C kernel: None (every product) without AMX; AMX_MAX_ROWS with
    it, oneDNN's tile kernels taking the larger products."""
    return AMX_MAX_ROWS if "amx_bf16" in cpu_flags else None


def pack(weight: torch.Tensor) -> NativePackedWeight:
    """The [out, in] bfloat16 weight in the kernel's layout (the caller checked `unavailable_reason`)."""
    library = native_lib.load()
    assert library is not None, "pack without the C library"
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise ValueError(f"the C linear kernel takes a 2-D bfloat16 weight, not {weight.dtype} {tuple(weight.shape)}")
    weight = weight.contiguous()
    out_features, in_features = weight.shape
    packed = torch.empty(library.linear_bf16_packed_elements(out_features, in_features), dtype=torch.int16)
    library.linear_bf16_pack(weight.data_ptr(), out_features, in_features, packed.data_ptr())
    return NativePackedWeight(packed, weight.shape)


def linear(x: torch.Tensor, weight: NativePackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias): x [..., in] bfloat16 -> [..., out] bfloat16. Called ~120 times per decode
    step: a few microseconds of Python each is a few percent of a batch-1 step, so checks are kept lean."""
    out_features, in_features = weight.shape
    if x.dtype is not torch.bfloat16 or x.shape[-1] != in_features:
        raise ValueError(f"input {x.dtype} {tuple(x.shape)} does not fit a bfloat16 [{out_features}, {in_features}] weight")
    rows = x if x.dim() == 2 else x.reshape(-1, in_features)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    if bias is not None and (bias.dtype is not torch.bfloat16 or not bias.is_contiguous()):
        bias = bias.to(torch.bfloat16).contiguous()
    num_rows = rows.shape[0]
    out = torch.empty((num_rows, out_features), dtype=torch.bfloat16)
    if num_rows:
        _kernel()(rows.data_ptr(), rows.stride(0), weight.packed.data_ptr(), None if bias is None else bias.data_ptr(),
                  out.data_ptr(), out_features, num_rows, out_features, in_features)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)


_linear_fn = None


def _kernel():  # the library's function (it exists: the weight was packed with it)
    global _linear_fn
    if _linear_fn is None:
        library = native_lib.load()
        assert library is not None, "linear without the C library"
        _linear_fn = library.linear_bf16
    return _linear_fn
