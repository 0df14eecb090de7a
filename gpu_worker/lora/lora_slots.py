"""LoRA adapters held in fixed slots on the worker, and one step's LoRA products (issue 41).

A step may mix sequences of several adapters and of the base model. Each of the model's linear products (the
fused q/k/v, o, the fused gate/up, down) is followed by `LoraBatch.add`, which adds every adapter's delta to its
own rows, segmented as Punica's and S-LoRA's SGMV kernels are: the rows are gathered once per step, sorted by
adapter, and each adapter's segment is shrunk by its A and expanded by its B (scaling folded in, each target's
block in its columns of the product's output) at the adapter's own rank, then added back where it came from.
A step without adapters pays nothing (no batch is built); one whose rows all use one adapter skips the gather.

On the CPU the C kernel of kernels/native/lora.c does a product's segments in one call, in tiles of one
adapter's rows, with A and B in float32 (bfloat16 for a bfloat16 model on AVX512-BF16: pairwise products at
twice the rate); elsewhere (CUDA, or no C compiler) each segment is two `linear` calls.

Row invariance: a row's delta is the same bits whatever else is in the step. The C kernel computes each row
alone, always in the same order. The `linear` path uses the packed oneDNN product the base model uses
(gpu_worker/cpu/packed_linear.py), whose rows do not depend on how many rows it multiplies; its gather and
scatter-add copy and add exactly. (Stacking the adapters for batched
products, padded to the largest rank, was faster but changed a row's last bits with the step's mix of adapters,
and greedy tokens with them.)

Slots are filled at start (`lora_modules`) and at run time (`LoadLora`, between steps); the scheduler decides
which slot holds what and never loads into a slot a sequence still uses. A load is three parts: `read` (the
files read and checked, on any thread, under `lora_root` for a run-time load: gpu_worker/lora/lora_adapter.py),
`stage` (this rank's share packed for the device, touching no slot) and `commit` (the slot filled): the model
thread does only the last two, and with tensor parallelism a rank commits only once every rank has staged
(gpu_worker/service.py `load_lora_on_rank`). With tensor parallelism each rank holds its share, split as the
layer it adds to is: B by output rows for the column-parallel q/k/v and gate/up, A by input columns for the
row-parallel o and down (whose partial sums the layer's all-reduce adds).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpu_worker.cpu.packed_linear import PackedWeight, linear, pack_weight, prepack_supported
from gpu_worker.lora.adapter_files import run_time_root
from gpu_worker.lora.lora_adapter import LoraAdapter, load_lora_adapter, target_shape
from gpu_worker.model_config import ModelConfig
from gpu_worker.parallel.tensor_parallel import TensorParallel
from hetero.v1 import common_pb2
from hetero_common.config import Config
from hetero_common.errors import ExecutionError
from hetero_common.lora_modules import parse_lora_modules
from kernels.native import lora as native_lora

# Each of the model's products and the targets its output holds, in order.
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})  # the others are column-parallel (tensor_parallel.py)


@dataclass(frozen=True)
class StagedLora:
    """An adapter packed for one slot of this rank, not yet in it (`LoraSlots.commit` puts it there)."""

    slot: int
    weights: dict[tuple[int, str], GroupWeights]
    info: common_pb2.LoraAdapter


@dataclass
class GroupWeights:
    """One adapter's share of one product in one layer, as `linear` weights: A of its targets stacked
    [rank, in], and B [out, rank] with each target's block in that target's rows of the product's output
    (zeros elsewhere), scaled. Packed for oneDNN on the CPU; for the C kernel, in its layouts
    (kernels/native/lora.py `pack`)."""

    a: PackedWeight
    b: PackedWeight


def load_lora_slots(config: Config, model_config: ModelConfig, device: torch.device, dtype: torch.dtype,
                    tp: TensorParallel) -> LoraSlots:
    """The worker's slots, holding the adapters of `lora_modules` (slot i + 1 the i-th)."""
    slots = LoraSlots(model_config, config.max_loras, config.max_lora_rank, device, dtype, tp,
                      prepack=config.weight_prepack and prepack_supported(device, dtype), lora_root=config.lora_root)
    for slot, (name, path) in enumerate(parse_lora_modules(config.lora_modules, config.max_loras), start=1):
        slots.load(slot, name, path, trusted=True)  # the operator's own configuration: not confined to lora_root
    return slots


class LoraSlots:
    """The adapters loaded on this worker by slot (1..max_loras; 0 is the base model)."""

    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, device: torch.device, dtype: torch.dtype,
                 tp: TensorParallel, prepack: bool = False, native: bool | None = None,
                 lora_root: str | None = None) -> None:
        self.config, self.max_loras, self.max_rank, self.device, self.dtype, self.tp = (
            config, max_loras, max_rank, device, dtype, tp)
        self.lora_root = lora_root  # where run-time loads must lie (None: none is allowed)
        self._prepack = prepack
        # The C kernel (kernels/native/lora.c) on the CPU: every adapter of a step in one call per product.
        self._native = native_lora.available(device, dtype) if native is None else native
        self._bf16_weights = self._native and native_lora.bfloat16_weights(dtype)
        self._slots: dict[int, dict[tuple[int, str], GroupWeights]] = {}
        self._tables: dict[tuple[int, str], native_lora.SlotTable] = {}  # the C kernel's, by (layer, product)
        # The same for the whole-model C layers: per (layer, product) the addresses of its table's three arrays
        # and the weights' kind.
        self._layer_tables = torch.zeros(config.num_hidden_layers * len(GROUPS) * 4, dtype=torch.int64)
        self._infos: dict[int, common_pb2.LoraAdapter] = {}

    def load(self, slot: int, name: str, path: str, *, trusted: bool) -> common_pb2.LoraAdapter:
        """Read the adapter in `path` into `slot` (what it held goes); LoraAdapterError leaves the slot as it was.
        `trusted`: see `read`."""
        self.check_slot(slot)
        return self.commit(self.stage(slot, self.read(name, path, trusted=trusted), path))

    def check_slot(self, slot: int) -> None:
        if not 1 <= slot <= self.max_loras:
            raise ExecutionError(f"LoRA slot {slot} is outside 1..max_loras ({self.max_loras})")

    def read(self, name: str, path: str, *, trusted: bool) -> LoraAdapter:
        """The adapter in `path`, read and checked; touches no slot, so any thread may call it. `trusted`: a path
        from the operator's own configuration (`lora_modules`), read where it is; otherwise (a run-time load, a
        path a client sent) it must lie under `lora_root`, and with none set it is refused."""
        root = None if trusted else run_time_root(self.lora_root, name)
        return load_lora_adapter(name, path, self.config, self.max_rank, root=root)

    def stage(self, slot: int, adapter: LoraAdapter, path: str | Path) -> StagedLora:
        """`adapter`'s share on this rank packed for `slot`, which keeps what it holds until `commit`."""
        self.check_slot(slot)
        try:
            weights = {key: (GroupWeights(*native_lora.pack(a, b, self._bf16_weights)) if self._native
                             else GroupWeights(self._weight(a), self._weight(b)))
                       for key, (a, b) in self._group_weights(adapter).items()}
        except torch.OutOfMemoryError as exc:  # typed: no reason to end a tensor-parallel worker
            raise ExecutionError(f"LoRA adapter {adapter.name!r}: no room on {self.device} for its weights; unload "
                                 "an adapter, or restart with fewer max_loras or a smaller model") from exc
        info = common_pb2.LoraAdapter(name=adapter.name, path=str(path), rank=adapter.rank, slot=slot,
                                      target_modules=sorted(adapter.targets))
        return StagedLora(slot, weights, info)

    def commit(self, staged: StagedLora) -> common_pb2.LoraAdapter:
        """Put a staged adapter in its slot (what it held goes)."""
        self._slots[staged.slot] = staged.weights
        self._build_tables()
        self._infos[staged.slot] = staged.info
        return staged.info

    def _group_weights(self, adapter: LoraAdapter) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """Per (layer, product): this rank's A of the product's targets stacked, and its B in block form."""
        groups: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(self.config.num_hidden_layers):
            for group, targets in GROUPS.items():
                outs = [target_shape(self.config, target)[0] // (1 if target in ROW_PARALLEL else self.tp.size)
                        for target in targets]
                present = [(t, self._shard(target, *adapter.weights[(layer, target)]))
                           for t, target in enumerate(targets) if (layer, target) in adapter.weights]
                if not present:
                    continue
                a = torch.cat([pair[0] for _, pair in present])
                b = torch.zeros(sum(outs), a.shape[0])
                rank = 0
                for t, (_, target_b) in present:
                    column = sum(outs[:t])
                    b[column:column + outs[t], rank:rank + target_b.shape[1]] = target_b * adapter.scaling
                    rank += target_b.shape[1]
                groups[(layer, group)] = (a, b)
        return groups

    def _build_tables(self) -> None:
        """The C kernel's pointers by slot, per product (the C path holds A and B transposed, in float32)."""
        if self._native:
            keys = {key for weights in self._slots.values() for key in weights}
            self._tables = {key: native_lora.SlotTable.of(
                {slot: (w[key].a, w[key].b) for slot, w in self._slots.items() if key in w}, self.max_loras + 1)
                for key in keys}
            self._layer_tables.zero_()
            for (layer, group), table in self._tables.items():
                at = (layer * len(GROUPS) + list(GROUPS).index(group)) * 4
                self._layer_tables[at:at + 4] = torch.tensor(
                    [table.a_ptrs.data_ptr(), table.bt_ptrs.data_ptr(), table.ranks.data_ptr(), int(self._bf16_weights)])

    def _weight(self, weight: torch.Tensor) -> PackedWeight:
        weight = weight.to(self.device, self.dtype)
        return pack_weight(weight) if self._prepack else weight

    def _shard(self, target: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of one target's A [rank, in] and B [out, rank], split as its layer is."""
        if target in ROW_PARALLEL:
            return self.tp.columns(a), b
        return a, self.tp.rows(b)

    def unload(self, slot: int) -> None:
        self._slots.pop(slot, None)
        self._infos.pop(slot, None)
        self._build_tables()

    def loaded(self) -> list[common_pb2.LoraAdapter]:
        """What each filled slot holds (WorkerInfo.lora_adapters)."""
        return [self._infos[slot] for slot in sorted(self._infos)]

    def has(self, slot: int) -> bool:
        return slot in self._slots

    def batch(self, row_slots: np.ndarray) -> StepLora | None:
        """The step's LoRA work for its flattened tokens' slots (0: base), or None when no row has an adapter."""
        if not self._slots:  # nothing loaded: not even a scan of the rows
            return None
        present = [int(s) for s in np.unique(row_slots) if s]
        if not present:
            return None
        if self._native:
            return NativeLoraBatch(self._tables, torch.from_numpy(row_slots.astype(np.int32)), self._layer_tables,
                                   self.max_loras + 1, self._bf16_weights)
        if len(present) == 1 and bool(row_slots.all()):
            return LoraBatch([(self._slots[present[0]], 0, len(row_slots))], None)
        order = np.argsort(row_slots, kind="stable")
        order = order[row_slots[order] != 0]  # the adapters' rows, grouped by slot; the base model's left out
        ends = np.cumsum([np.count_nonzero(row_slots == s) for s in present])
        segments = [(self._slots[s], int(end - count), int(end))
                    for s, end, count in zip(present, ends, np.diff(ends, prepend=0))]
        return LoraBatch(segments, torch.from_numpy(order).to(self.device))


class NativeLoraBatch:
    """One step's adapters for the C kernel: its rows' slots; each product is one call."""

    def __init__(self, tables: dict[tuple[int, str], native_lora.SlotTable], row_slots: torch.Tensor,
                 layer_tables: torch.Tensor, num_slots: int, bf16_weights: bool) -> None:
        self.tables, self.row_slots, self.layer_tables, self.num_slots = tables, row_slots, layer_tables, num_slots
        self.bf16_weights = bf16_weights

    def c_arguments(self) -> tuple[int, int, int]:
        """What the whole-model C layers take to add the deltas themselves (kernels/native/llama_layers.c)."""
        return self.row_slots.data_ptr(), self.layer_tables.data_ptr(), self.num_slots

    def add(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        table = self.tables.get((layer, group))
        if table is not None:
            native_lora.lora_add(x if x.stride(-1) == 1 else x.contiguous(), y, self.row_slots, table,
                                 self.bf16_weights)


class LoraBatch:
    """One step's adapters: per adapter its weights and its segment of the gathered rows, and the rows gathered
    (None: every row, in order, is one adapter's)."""

    def __init__(self, segments: list[tuple[dict[tuple[int, str], GroupWeights], int, int]],
                 rows: torch.Tensor | None) -> None:
        self.segments, self.rows = segments, rows

    def add(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y (the product of x in `group` of `layer`) += each adapter's delta on its rows."""
        if self.rows is None:
            weights = self.segments[0][0].get((layer, group))
            if weights is not None:
                y += linear(linear(x, weights.a), weights.b)
            return
        gathered = x.index_select(0, self.rows)
        deltas, places = [], []
        for slot_weights, start, end in self.segments:
            weights = slot_weights.get((layer, group))
            if weights is not None:
                deltas.append(linear(linear(gathered[start:end], weights.a), weights.b))
                places.append(self.rows[start:end])
        if len(deltas) == len(self.segments):
            y.index_add_(0, self.rows, torch.cat(deltas))
        elif deltas:  # some adapters in the step leave this product alone
            y.index_add_(0, torch.cat(places), torch.cat(deltas))


StepLora = LoraBatch | NativeLoraBatch  # what the model's products call `add` on
