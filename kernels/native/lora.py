"""LoRA deltas of one product for a step's rows through the C kernel (kernels/native/lora.c): each row's own
adapter at its own rank, in one call for all adapters, row-invariant. Per product the adapters' weights are
reached through a `SlotTable` (pointers by slot), built when an adapter is loaded, so a step passes only its
rows' slots."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.native import lib

_KERNELS = {torch.float32: "lora_add_f32", torch.bfloat16: "lora_add_bf16"}
MAX_RANK = 1024  # the kernel's bound (max_lora_rank's too)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in _KERNELS and lib.load() is not None


def bfloat16_weights(dtype: torch.dtype) -> bool:
    """Whether a model in `dtype` takes the bfloat16-weight kernel (lora_add_bf16_dp: AVX512-BF16's pairwise
    products, twice the float32 kernel's rate): a bfloat16 model where it was compiled."""
    library = lib.load()
    return dtype == torch.bfloat16 and library is not None and bool(library.lora_bf16_dp_supported())


def pack(a: torch.Tensor, b: torch.Tensor, bfloat16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One product's A [rank, in] and B [out, rank] (float32) in the kernel's layouts: A as is and B transposed
    [rank, out], in float32; or, for bfloat16 weights, A in bfloat16 and B as pairs of ranks [rank / 2, out, 2]."""
    if not bfloat16:
        return a.contiguous(), b.t().contiguous()
    bt = b.t()
    if bt.shape[0] % 2:
        bt = torch.cat([bt, bt.new_zeros(1, bt.shape[1])])
    pairs = bt.reshape(bt.shape[0] // 2, 2, bt.shape[1]).transpose(1, 2).contiguous()
    return a.to(torch.bfloat16).contiguous(), pairs.to(torch.bfloat16)


@dataclass
class SlotTable:
    """One product's adapters by slot (index 0 unused): A and Bt in `pack`'s layouts, kept alive here; their
    addresses and ranks as the kernel reads them."""

    weights: dict[int, tuple[torch.Tensor, torch.Tensor]]
    a_ptrs: torch.Tensor  # int64 [num_slots]
    bt_ptrs: torch.Tensor  # int64 [num_slots]
    ranks: torch.Tensor  # int32 [num_slots]

    @staticmethod
    def of(weights: dict[int, tuple[torch.Tensor, torch.Tensor]], num_slots: int) -> SlotTable:
        a_ptrs = torch.zeros(num_slots, dtype=torch.int64)
        bt_ptrs = torch.zeros(num_slots, dtype=torch.int64)
        ranks = torch.zeros(num_slots, dtype=torch.int32)
        for slot, (a, bt) in weights.items():
            a_ptrs[slot], bt_ptrs[slot], ranks[slot] = a.data_ptr(), bt.data_ptr(), a.shape[0]
        return SlotTable(weights, a_ptrs, bt_ptrs, ranks)


def lora_add(x: torch.Tensor, y: torch.Tensor, row_slots: torch.Tensor, table: SlotTable,
             bfloat16: bool = False) -> None:
    """y[i] += row i's adapter's delta (row_slots int32 [rows]; slot 0 and slots the table lacks add nothing).
    x [rows, in] and y [rows, out] in the same dtype, rows contiguous; `bfloat16`: the table's weights are
    `pack`'s bfloat16 ones."""
    library = lib.load()
    assert library is not None and x.stride(1) == 1 and y.stride(1) == 1
    code = getattr(library, "lora_add_bf16_dp" if bfloat16 else _KERNELS[x.dtype])(
        x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), x.shape[0], row_slots.data_ptr(),
        table.a_ptrs.data_ptr(), table.bt_ptrs.data_ptr(), table.ranks.data_ptr(), table.ranks.shape[0],
        x.shape[1], y.shape[1])
    if code:
        raise RuntimeError(f"lora_add failed ({code}): a rank over {MAX_RANK}, or out of memory")
