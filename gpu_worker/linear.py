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
kernels/native_linear.py instead (`native=True`), which is faster than oneDNN there.

`weight_prepack` in the config turns packing off; CUDA weights are never packed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import native_linear
from kernels.native_linear import NativePackedWeight


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed weights can be used for products on this device in this dtype."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_weight(weight: torch.Tensor, native: bool = False) -> torch.Tensor | NativePackedWeight:
    """The [out, in] weight in oneDNN's blocked layout (an opaque tensor with the same shape), or
    (`native`, bfloat16 only) in the C kernel's (native_linear.unavailable_reason must be None)."""
    if native:
        return native_linear.pack(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def linear(x: torch.Tensor, weight: torch.Tensor | NativePackedWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for a plain or a packed weight."""
    if type(weight) is NativePackedWeight:
        return native_linear.linear(x, weight, bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
