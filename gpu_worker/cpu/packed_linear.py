"""Linear layers' weights in the form the CPU's fastest matrix product wants.

`F.linear` on a CPU hands a plain [out, in] weight to oneDNN (bfloat16) or MKL (float32),
which re-lay it out into their blocked format on every call. oneDNN can do that once at
load time instead: `torch.ops.mkldnn._reorder_linear_weight` returns the weight already
blocked (an opaque `torch._mkldnn` tensor) and `_linear_pointwise` multiplies with it. It is
the same oneDNN kernel minus the per-call reorder, so it gains most where the product is
small: measured on an AVX512-BF16 CPU (no AMX), SmolLM2-135M shapes, bfloat16: 1.7-2x at
one row (batch-1 decode), 1.2-1.3x at 32-64 rows, ~5% at 512 rows; float32 runs on oneDNN
instead of MKL and gains 2-3x. bfloat16 results are bit-identical to `F.linear`'s here; float32
results differ from MKL's in the last bits (another kernel). The float32 oracle tests stay
token-exact against `transformers` with it; `weight_prepack: false` gives MKL's own products.

On CPUs with AVX512-BF16 and no AMX, bfloat16 weights are packed for the C kernel of
kernels/native/linear.py instead (`native=True`), which is faster than oneDNN there. With AMX they are
packed both ways (`DualPackedWeight`): the C tile kernel takes decoding's products (up to
`native_linear.AMX_MAX_ROWS` rows, 1.4x oneDNN), oneDNN the larger ones; the weights' memory doubles.

A GGUF file's weights in Q4_0, Q4_1 or Q8_0 are held in their blocks where the GGUF kernel runs (config
`quantization` auto, AVX512-VNNI: `GGUFPackedWeight`, kernels/native/linear_gguf.py).

`weight_prepack` in the config turns packing off; CUDA weights are never packed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import fp8_linear, int8_linear
from kernels.fp8_linear import Fp8Weight
from kernels.int8_linear import Int8Weight
from kernels.native import linear as native_linear
from kernels.native import linear_gguf
from kernels.native.linear import NativePackedWeight
from kernels.native.linear_gguf import GGUFPackedWeight


@dataclass(frozen=True)
class DualPackedWeight:
    """One weight packed for oneDNN and for the C kernel: products of up to `native_max_rows` rows take the C one."""

    onednn: torch.Tensor
    native: NativePackedWeight
    native_max_rows: int

    @property
    def shape(self) -> torch.Size:
        return self.native.shape


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed weights can be used for products on this device in this dtype. oneDNN's bfloat16 reorder
    needs AVX512 (BW, VL, DQ) or AVX-NE-CONVERT; on an AVX2-only CPU it raises, so bfloat16 stays unpacked there."""
    if dtype == torch.bfloat16 and torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AMX"):
        return False
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


PackedWeight = torch.Tensor | NativePackedWeight | DualPackedWeight | GGUFPackedWeight | Fp8Weight | Int8Weight


def pack_weight(weight: torch.Tensor, native: bool = False, native_max_rows: int | None = None,
                amx: bool = False) -> PackedWeight:
    """The [out, in] weight in oneDNN's blocked layout (an opaque tensor with the same shape), or
    (`native`, bfloat16 only) in a C kernel's (native_linear.unavailable_reason must be None; `amx`: the
    tile kernel's, as native_linear.plan says), or, with `native_max_rows` too, in both (`DualPackedWeight`)."""
    if native and native_max_rows is not None:
        return DualPackedWeight(pack_weight(weight), native_linear.pack(weight, amx), native_max_rows)
    if native:
        return native_linear.pack(weight, amx)
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def linear_float32(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """(x @ weight.T) in float32: straight from the C panels' float32 sums where they run (the LM head's logits
    of a bfloat16 model on AVX512-BF16 CPUs: no bfloat16 rounding of the logits, no conversion pass), else
    `linear` then a conversion."""
    weight = for_rows(weight, x)
    if type(weight) is NativePackedWeight and not weight.amx:
        return native_linear.linear(x, weight, out_dtype=torch.float32)
    if type(weight) is GGUFPackedWeight:
        return linear_gguf.linear(x, weight, f32_out=True)
    return linear(x, weight).float()


def for_rows(weight: PackedWeight, x: torch.Tensor) -> PackedWeight:
    """The packing of a dual-packed weight that serves x's row count (the C kernel's up to its rows, oneDNN's
    above); any other weight as it is."""
    if type(weight) is DualPackedWeight:
        return weight.native if x.numel() <= weight.native_max_rows * x.shape[-1] else weight.onednn
    return weight


def linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for a plain or a packed weight."""
    weight = for_rows(weight, x)
    if type(weight) is NativePackedWeight:
        return native_linear.linear(x, weight, bias)
    if type(weight) is GGUFPackedWeight:
        return linear_gguf.linear(x, weight, bias)
    if type(weight) is Fp8Weight:
        return fp8_linear.linear(x, weight, bias)
    if type(weight) is Int8Weight:
        return int8_linear.linear(x, weight, bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
