"""LoRA adapters held in fixed slots on the worker, and one step's batched LoRA products (issue 41).

A step may mix sequences of several adapters and of the base model. Each of the model's linear products (the
fused q/k/v, o, the fused gate/up, down) is followed by `LoraBatch.add`, which adds every adapter's delta to its
own rows in two batched products, as Punica's and S-LoRA's kernels do: the rows are gathered per adapter
(padded to the adapter with the most rows), shrunk by the adapters' A matrices of that product's targets
stacked ([adapters, in, rank]) and expanded by their B matrices (scaling folded in, each target's block in
its columns of the product's output), then added back where they came from. Ranks are padded to the largest
among the adapters in the step, not to `max_lora_rank`; a step without adapters pays nothing (no batch is
built), and one whose rows all use one adapter takes two plain products.

Slots are filled at start (`lora_modules`) and at run time (`LoadLora`, between steps); the scheduler decides
which slot holds what and never loads into a slot a sequence still uses. With tensor parallelism each rank
holds its share, split as the layer it adds to is: B by output rows for the column-parallel q/k/v and
gate/up, A by input columns for the row-parallel o and down (whose partial sums the layer's all-reduce adds).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.checkpoint import ModelConfig
from gpu_worker.lora_adapter import LoraAdapter, load_lora_adapter, target_shape
from gpu_worker.tensor_parallel import TensorParallel
from hetero.v1 import common_pb2
from hetero_common.config import Config
from hetero_common.errors import ExecutionError
from hetero_common.lora_modules import parse_lora_modules

# Each of the model's products and the targets its output holds, in order.
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})  # the others are column-parallel (tensor_parallel.py)


@dataclass
class GroupWeights:
    """One adapter's share of one product in one layer: A of its targets stacked, and B with each target's
    block in that target's columns of the product's output (zeros elsewhere), scaled."""

    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank]


def load_lora_slots(config: Config, model_config: ModelConfig, device: torch.device, dtype: torch.dtype,
                    tp: TensorParallel) -> LoraSlots:
    """The worker's slots, holding the adapters of `lora_modules` (slot i + 1 the i-th)."""
    slots = LoraSlots(model_config, config.max_loras, config.max_lora_rank, device, dtype, tp)
    for slot, (name, path) in enumerate(parse_lora_modules(config.lora_modules, config.max_loras), start=1):
        slots.load(slot, name, path)
    return slots


class LoraSlots:
    """The adapters loaded on this worker by slot (1..max_loras; 0 is the base model)."""

    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, device: torch.device, dtype: torch.dtype,
                 tp: TensorParallel) -> None:
        self.config, self.max_loras, self.max_rank, self.device, self.dtype, self.tp = (
            config, max_loras, max_rank, device, dtype, tp)
        self._slots: dict[int, dict[tuple[int, str], GroupWeights]] = {}
        self._infos: dict[int, common_pb2.LoraAdapter] = {}
        # Per set of adapters in a step, their weights stacked for the batched products (a few sets kept).
        self._stacks: dict[tuple[int, ...], dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]] = {}

    def load(self, slot: int, name: str, path: str) -> common_pb2.LoraAdapter:
        """Read the adapter in `path` into `slot` (what it held goes); LoraAdapterError leaves the slot as it was."""
        if not 1 <= slot <= self.max_loras:
            raise ExecutionError(f"LoRA slot {slot} is outside 1..max_loras ({self.max_loras})")
        adapter = load_lora_adapter(name, path, self.config, self.max_rank)
        self._slots[slot] = self._group_weights(adapter)
        self._infos[slot] = common_pb2.LoraAdapter(name=name, path=str(path), rank=adapter.rank, slot=slot,
                                                   target_modules=sorted(adapter.targets))
        self._stacks.clear()
        return self._infos[slot]

    def _group_weights(self, adapter: LoraAdapter) -> dict[tuple[int, str], GroupWeights]:
        """Per (layer, product): this rank's A of the product's targets stacked, and its B in block form."""
        groups: dict[tuple[int, str], GroupWeights] = {}
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
                groups[(layer, group)] = GroupWeights(a.to(self.device, self.dtype), b.to(self.device, self.dtype))
        return groups

    def _shard(self, target: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of one target's A [rank, in] and B [out, rank], split as its layer is."""
        if target in ROW_PARALLEL:
            return self.tp.columns(a), b
        return a, self.tp.rows(b)

    def unload(self, slot: int) -> None:
        self._slots.pop(slot, None)
        self._infos.pop(slot, None)
        self._stacks.clear()

    def loaded(self) -> list[common_pb2.LoraAdapter]:
        """What each filled slot holds (WorkerInfo.lora_adapters)."""
        return [self._infos[slot] for slot in sorted(self._infos)]

    def has(self, slot: int) -> bool:
        return slot in self._slots

    def batch(self, row_slots: np.ndarray) -> LoraBatch | None:
        """The step's LoRA work for its flattened tokens' slots (0: base), or None when no row has an adapter."""
        present = tuple(int(s) for s in np.unique(row_slots) if s)
        if not present:
            return None
        stacks = self._stacked(present)
        rows = [np.flatnonzero(row_slots == s) for s in present]
        if len(present) == 1 and len(rows[0]) == len(row_slots):
            return LoraBatch(stacks, None)
        width = max(len(r) for r in rows)
        gather = np.zeros((len(present), width), dtype=np.int64)  # padding gathers row 0; it is never added back
        for j, r in enumerate(rows):
            gather[j, :len(r)] = r
        flat = gather.reshape(-1)
        real = np.concatenate([j * width + np.arange(len(r)) for j, r in enumerate(rows)])
        gather_t, real_t, rows_t = (torch.from_numpy(a).to(self.device) for a in (flat, real, flat[real]))
        return LoraBatch(stacks, (gather_t, real_t, rows_t, len(present), width))

    def _stacked(self, present: tuple[int, ...]) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """Per (layer, product) the adapters' A as [n, in, rank] and B as [n, rank, out], ranks zero-padded."""
        if present in self._stacks:
            return self._stacks[present]
        stacks = {}
        for key in {k for s in present for k in self._slots[s]}:
            parts = [self._slots[s].get(key) for s in present]
            rank = max(p.a.shape[0] for p in parts if p is not None)
            ref = next(p for p in parts if p is not None)
            a = torch.zeros(len(present), ref.a.shape[1], rank, device=self.device, dtype=self.dtype)
            b = torch.zeros(len(present), rank, ref.b.shape[0], device=self.device, dtype=self.dtype)
            for j, p in enumerate(parts):
                if p is not None:
                    a[j, :, :p.a.shape[0]] = p.a.t()
                    b[j, :p.a.shape[0], :] = p.b.t()
            stacks[key] = (a, b)
        if len(self._stacks) >= 8:
            self._stacks.pop(next(iter(self._stacks)))
        self._stacks[present] = stacks
        return stacks


class LoraBatch:
    """One step's adapters: their stacked weights, and where their rows are (None: one adapter, every row;
    else the gather index [n * width], the real rows' places in it, those rows, n and width)."""

    def __init__(self, stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
                 rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int] | None) -> None:
        self.stacks, self.rows = stacks, rows

    def add(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y (the product of x in `group` of `layer`) += each adapter's delta on its rows."""
        weights = self.stacks.get((layer, group))
        if weights is None:
            return
        a, b = weights
        if self.rows is None:
            y += (x @ a[0]) @ b[0]
            return
        gather, real, rows, n, width = self.rows
        delta = torch.bmm(torch.bmm(x.index_select(0, gather).view(n, width, -1), a), b)
        y.index_add_(0, rows, delta.view(n * width, -1).index_select(0, real))
