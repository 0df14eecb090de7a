"""bfloat16 linear layers through the C kernels: linear_bf16.c's AVX512-BF16 panels, and on AMX CPUs
linear_amx.c's tiles (gpu_worker/cpu/packed_linear.py). Without AMX the panels beat oneDNN at every row count measured
(most at decoding's 1-64 rows). With AMX, oneDNN's tile kernels win on large products, and the C
kernels only at decoding's row counts, where a product streams the weights from memory (`plan`).

A weight is packed once at load (`pack`) into its kernel's layout; `linear` multiplies by it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.native import lib


@dataclass(frozen=True)
class NativePackedWeight:
    """An [out, in] bfloat16 weight in a C kernel's layout; `shape` is the weight's own."""

    packed: torch.Tensor  # int16: linear_bf16's panels, or linear_amx's tiles (`amx`)
    shape: torch.Size
    amx: bool = False


# The most rows a product takes a C kernel on AMX CPUs, oneDNN taking the larger ones. One forward's
# products at SmolLM2-135M's shapes on a 2-core Xeon with AMX (benchmarks/cpu_kernels.py), against
# oneDNN's prepacked weights: the tile kernel 1.4x at 1-32 rows, 1.1x at 64, 1.0x at 128, 0.85x at 256;
# the AVX512-BF16 panels (where the tile kernel cannot take the shapes) 1.5x at 1 row, 1.0x at 8, 0.7x at 12.
AMX_MAX_ROWS = 64
PANELS_ON_AMX_MAX_ROWS = 8


def unavailable_reason(cpu_flags: set[str]) -> str | None:
    """None when the kernels can run here, else why not (the caller then keeps oneDNN)."""
    library = lib.load()
    if library is None:
        return lib.unavailable_reason()
    if not library.linear_bf16_supported():
        return "the CPU has no AVX512-BF16"
    return None


def amx_fits(out_features: int, in_features: int) -> bool:
    return out_features % 32 == 0 and in_features % 32 == 0


def plan(cpu_flags: set[str], shapes: list[tuple[int, int]]) -> tuple[bool, int | None]:
    """(tile kernel, most rows) for the C kernels on this CPU and these [out, in] weight shapes (the caller
    checked `unavailable_reason`): without AMX the panels take every product (None); with it the tile
    kernel takes up to AMX_MAX_ROWS rows where it can run and take every shape, else the panels up to
    PANELS_ON_AMX_MAX_ROWS."""
    if "amx_bf16" not in cpu_flags:
        return False, None
    library = lib.load()
    if library is not None and library.linear_amx_supported() and all(amx_fits(*shape) for shape in shapes):
        return True, AMX_MAX_ROWS
    return False, PANELS_ON_AMX_MAX_ROWS


def pack(weight: torch.Tensor, amx: bool = False) -> NativePackedWeight:
    """The [out, in] bfloat16 weight in the panels' layout, or the tile kernel's (`amx`: the caller checked
    `plan`)."""
    library = lib.load()
    assert library is not None, "pack without the C library"
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise ValueError(f"the C linear kernel takes a 2-D bfloat16 weight, not {weight.dtype} {tuple(weight.shape)}")
    weight = weight.contiguous()
    out_features, in_features = weight.shape
    if amx:
        if not amx_fits(out_features, in_features):
            raise ValueError(f"the AMX linear kernel takes multiples of 32 features, not {tuple(weight.shape)}")
        packed = torch.empty(out_features * in_features, dtype=torch.int16)
        library.linear_amx_pack(weight.data_ptr(), out_features, in_features, packed.data_ptr())
    else:
        packed = torch.empty(library.linear_bf16_packed_elements(out_features, in_features), dtype=torch.int16)
        library.linear_bf16_pack(weight.data_ptr(), out_features, in_features, packed.data_ptr())
    return NativePackedWeight(packed, weight.shape, amx)


def linear(x: torch.Tensor, weight: NativePackedWeight, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x @ weight.T (+ bias): x [..., in] bfloat16 -> [..., out] bfloat16. Called ~120 times per decode
    step: a few microseconds of Python each is a few percent of a batch-1 step, so checks are kept lean.
    `out_dtype` float32 (panel-packed weights only, not AMX tiles): the float32 sums themselves, which the
    bfloat16 output is the rounding of (the LM head's logits: no rounding to bfloat16, no conversion pass)."""
    out_features, in_features = weight.shape
    if x.dtype is not torch.bfloat16 or x.shape[-1] != in_features:
        raise ValueError(f"input {x.dtype} {tuple(x.shape)} does not fit a bfloat16 [{out_features}, {in_features}] weight")
    rows = x if x.dim() == 2 else x.reshape(-1, in_features)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    if bias is not None and (bias.dtype is not torch.bfloat16 or not bias.is_contiguous()):
        bias = bias.to(torch.bfloat16).contiguous()
    num_rows = rows.shape[0]
    if out_dtype is not torch.bfloat16 and (out_dtype is not torch.float32 or weight.amx):
        raise ValueError(f"out_dtype {out_dtype}: the output is bfloat16, or float32 from the panel kernel "
                         "(linear_bf16_f32), not from the AMX tiles")
    out = torch.empty((num_rows, out_features), dtype=out_dtype)
    if num_rows:
        _kernel(weight.amx, out_dtype is torch.float32)(rows.data_ptr(), rows.stride(0), weight.packed.data_ptr(),
                            None if bias is None else bias.data_ptr(), out.data_ptr(), out_features, num_rows,
                            out_features, in_features)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)


_kernels: dict[tuple[bool, bool], object] = {}


def _kernel(amx: bool, f32_out: bool):  # the library's function (it exists: the weight was packed with it)
    fn = _kernels.get((amx, f32_out))
    if fn is None:
        library = lib.load()
        assert library is not None, "linear without the C library"
        name = "linear_amx" if amx else "linear_bf16_f32" if f32_out else "linear_bf16"
        fn = _kernels[(amx, f32_out)] = getattr(library, name)
    return fn
