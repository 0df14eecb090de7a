"""bfloat16 linear layers through the C kernel (kernels/native/linear_bf16.c), for CPUs with
AVX512-BF16 and no AMX, where it beats oneDNN at every row count measured (most at decoding's
1-64 rows). On AMX CPUs oneDNN's tile kernels are several times faster, so they keep it.

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


def unavailable_reason(cpu_flags: set[str]) -> str | None:
    """None when the kernel can run here, else why not (the caller then keeps oneDNN)."""
    if "amx_bf16" in cpu_flags:
        return "the CPU has AMX, where oneDNN's bfloat16 products are faster"
    library = native_lib.load()
    if library is None:
        return native_lib.unavailable_reason()
    if not library.linear_bf16_supported():
        return "the CPU has no AVX512-BF16"
    return None


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
