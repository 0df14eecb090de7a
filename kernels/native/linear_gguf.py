"""Linear layers straight from GGUF's Q4_0, Q4_1 and Q8_0 blocks through the C kernel
(kernels/native/linear_gguf.c, CPUs with AVX512-VNNI): the weights stay in their block format (re-laid into
tiles of 16 rows, the same bytes per weight), the activations are quantized per block of 32 to int16 on
each call, and the products are integer dot products."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.native import lib

# GGML's type ids (gguf.GGMLQuantizationType) and each block's bytes per 32 weights.
Q4_0, Q4_1, Q8_0 = 2, 3, 8
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
BLOCK = 32


@dataclass(frozen=True)
class GGUFPackedWeight:
    """One [out, in] weight in linear_gguf_pack's tiles."""

    packed: torch.Tensor  # uint8
    type: int
    shape: tuple[int, int]  # [out, in]


def supported(ggml_type: int, out_features: int, in_features: int) -> bool:
    """Whether the kernel runs here (AVX512-VNNI, the library built) and takes this type and shape (in a multiple
    of 32, out of 16)."""
    library = lib.load()
    return library is not None and bool(library.linear_gguf_supported(int(ggml_type), out_features, in_features))


def pack(blocks: np.ndarray, ggml_type: int, out_features: int, in_features: int) -> GGUFPackedWeight:
    """GGUF's raw blocks of an [out, in] weight (uint8, rows in order: what gguf.GGUFReader's tensor.data holds)
    -> the kernel's tiles. The caller checked `supported`."""
    library = lib.load()
    assert library is not None, "pack without the C library"
    expected = out_features * in_features // BLOCK * BLOCK_BYTES[ggml_type]
    source = np.ascontiguousarray(blocks, dtype=np.uint8)
    if source.size != expected:
        raise ValueError(f"{source.size} bytes of blocks for a [{out_features}, {in_features}] weight of type "
                         f"{ggml_type}: expected {expected}")
    packed = torch.empty(library.linear_gguf_packed_bytes(ggml_type, out_features, in_features), dtype=torch.uint8)
    rc = library.linear_gguf_pack(source.ctypes.data, ggml_type, out_features, in_features, packed.data_ptr())
    if rc != 0:
        raise ValueError(f"the GGUF linear kernel does not take type {ggml_type} [{out_features}, {in_features}] here")
    return GGUFPackedWeight(packed, int(ggml_type), (out_features, in_features))


def linear(x: torch.Tensor, weight: GGUFPackedWeight, bias: torch.Tensor | None = None,
           f32_out: bool = False) -> torch.Tensor:
    """x [..., in] bfloat16 (rows may be strided, the last dimension contiguous) -> [..., out] bfloat16, or
    float32 with `f32_out`."""
    library = lib.load()
    assert library is not None, "linear without the C library"
    out_features, in_features = weight.shape
    if x.dtype != torch.bfloat16 or x.shape[-1] != in_features:
        raise ValueError(f"the GGUF linear kernel takes bfloat16 [..., {in_features}], not {x.dtype} {tuple(x.shape)}")
    rows = x.reshape(-1, in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
        raise ValueError("the GGUF linear kernel takes a contiguous bfloat16 bias")
    out = torch.empty(rows.shape[0], out_features, dtype=torch.float32 if f32_out else torch.bfloat16)
    rc = library.linear_gguf(rows.data_ptr(), rows.stride(0), weight.packed.data_ptr(), weight.type,
                             bias.data_ptr() if bias is not None else None, out.data_ptr(), out.stride(0),
                             rows.shape[0], out_features, in_features, int(f32_out))
    if rc != 0:
        raise RuntimeError(f"linear_gguf failed ({rc}): unsupported type or shape, or out of memory")
    return out.reshape(*x.shape[:-1], out_features)


def concat_rows(parts: list[GGUFPackedWeight]) -> GGUFPackedWeight:
    """Weights of one type and input size stacked along their outputs (q/k/v, gate/up: one product): the tiles are
    laid out 16 rows at a time, so the packed bytes simply follow each other."""
    kinds = {(p.type, p.shape[1]) for p in parts}
    if len(kinds) != 1:
        raise ValueError(f"cannot stack GGUF weights of different types or input sizes: {sorted(kinds)}")
    return GGUFPackedWeight(torch.cat([p.packed for p in parts]), parts[0].type,
                            (sum(p.shape[0] for p in parts), parts[0].shape[1]))


def int8_blocks(weight: torch.Tensor) -> np.ndarray:
    """A float [out, in] weight (in a multiple of 32) quantized symmetrically to int8 per block of 32 along each
    output row, as Q8_0 (scale max |w| / 127 as fp16, q = round(w / scale) in [-127, 127]) for `pack`. One scale
    per output row instead cost the default model's greedy outputs their agreement with float32 (58% of tokens
    before the first divergence against 91%; docs/performance.md)."""
    w = weight.float().reshape(weight.shape[0], -1, BLOCK)
    scale = (w.abs().amax(dim=2, keepdim=True) / 127.0).to(torch.float16)
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    q = torch.clamp(torch.round(w / safe), -127, 127).to(torch.int8)
    blocks = torch.empty(w.shape[0], w.shape[1], BLOCK_BYTES[Q8_0], dtype=torch.uint8)
    blocks[:, :, :2] = scale.view(torch.uint8).reshape(w.shape[0], w.shape[1], 2)
    blocks[:, :, 2:] = q.view(torch.uint8)
    return blocks.reshape(w.shape[0], -1).numpy()


def rows(weight: GGUFPackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight dequantized to bfloat16 [len(ids), in]: an embedding lookup straight from the
    blocks (the same bits as the dequantized table's rows)."""
    library = lib.load()
    assert library is not None, "rows without the C library"
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.shape[0], weight.shape[1], dtype=torch.bfloat16)
    if library.linear_gguf_rows(weight.packed.data_ptr(), weight.type, weight.shape[0], weight.shape[1],
                                ids.data_ptr(), ids.shape[0], out.data_ptr()) != 0:
        raise IndexError(f"token ids outside [0, {weight.shape[0]}) or an unsupported weight")
    return out
