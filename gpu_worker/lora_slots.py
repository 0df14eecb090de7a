"""LoRA adapters held in fixed slots on the worker, and one step's batched LoRA products (issue 41).

A step may mix sequences of several adapters and of the base model. Each of the model's linear products (the
fused q/k/v, o, the fused gate/up, down) is followed by `LoraBatch.add`: for each adapter present, its rows of
the product's input are shrunk once by the adapter's A matrices of that product's targets stacked ([n, r] per
target) and expanded by each target's B (its scaling folded in) into that target's slice of the output. That
is S-LoRA's segmented product grouped by adapter, in torch: an adapter costs its own rank, not
`max_lora_rank`, and a step without adapters pays nothing (no batch is built).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.checkpoint import ModelConfig
from gpu_worker.lora_adapter import LoraAdapter, load_lora_adapter, target_shape
from hetero_common.config import Config
from hetero_common.errors import ExecutionError
from hetero_common.lora_modules import parse_lora_modules

# Each of the model's products and the targets its output holds, in order.
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}


@dataclass
class GroupWeights:
    """One adapter's share of one product in one layer: A of its targets stacked, and per target the slice of
    the product's output it adds to, its rows of the shrunk input, and its B (scaled)."""

    a: torch.Tensor  # [sum of ranks, in]
    parts: list[tuple[slice, slice, torch.Tensor]]  # (output columns, shrunk columns, B [out, rank])


def load_lora_slots(config: Config, model_config: ModelConfig, device: torch.device,
                    dtype: torch.dtype) -> LoraSlots | None:
    """The adapters of `lora_modules`, slot i + 1 the i-th; None when there are none."""
    modules = parse_lora_modules(config.lora_modules, config.max_loras)
    if not modules:
        return None
    slots = LoraSlots(model_config, config.max_loras, device, dtype)
    for slot, (name, path) in enumerate(modules, start=1):
        slots.load(slot, load_lora_adapter(name, path, model_config, config.max_lora_rank))
    return slots


class LoraSlots:
    """The adapters loaded on this worker by slot (1..max_loras; 0 is the base model)."""

    def __init__(self, config: ModelConfig, max_loras: int, device: torch.device, dtype: torch.dtype) -> None:
        self.config, self.max_loras, self.device, self.dtype = config, max_loras, device, dtype
        self._slots: dict[int, dict[tuple[int, str], GroupWeights]] = {}
        self.names: dict[int, str] = {}

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        if not 1 <= slot <= self.max_loras:
            raise ExecutionError(f"LoRA slot {slot} is outside 1..max_loras ({self.max_loras})")
        groups: dict[tuple[int, str], GroupWeights] = {}
        for layer in range(self.config.num_hidden_layers):
            for group, targets in GROUPS.items():
                a_parts, parts, column, rank = [], [], 0, 0
                for target in targets:
                    out = target_shape(self.config, target)[0]
                    pair = adapter.weights.get((layer, target))
                    if pair is not None:
                        a, b = pair
                        a_parts.append(a)
                        parts.append((slice(column, column + out), slice(rank, rank + a.shape[0]),
                                      (b * adapter.scaling).to(self.device, self.dtype)))
                        rank += a.shape[0]
                    column += out
                if a_parts:
                    groups[(layer, group)] = GroupWeights(torch.cat(a_parts).to(self.device, self.dtype), parts)
        self._slots[slot] = groups
        self.names[slot] = adapter.name

    def unload(self, slot: int) -> None:
        self._slots.pop(slot, None)
        self.names.pop(slot, None)

    def has(self, slot: int) -> bool:
        return slot in self._slots

    def batch(self, row_slots: np.ndarray) -> LoraBatch | None:
        """The step's LoRA work for its flattened tokens' slots (0: base), or None when no row has an adapter."""
        present = [int(s) for s in np.unique(row_slots) if s]
        if not present:
            return None
        if len(present) == 1 and bool((row_slots == present[0]).all()):
            return LoraBatch([(self._slots[present[0]], None)])
        return LoraBatch([(self._slots[s], torch.from_numpy(np.flatnonzero(row_slots == s)).to(self.device))
                          for s in present])


class LoraBatch:
    """One step's adapters and their rows (None: every row)."""

    def __init__(self, groups: list[tuple[dict[tuple[int, str], GroupWeights], torch.Tensor | None]]) -> None:
        self.groups = groups

    def add(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y (the product of x in `group` of `layer`) += each adapter's delta on its rows."""
        for weights, rows in self.groups:
            w = weights.get((layer, group))
            if w is None:
                continue
            shrunk = (x if rows is None else x.index_select(0, rows)) @ w.a.t()
            for columns, ranks, b in w.parts:
                delta = shrunk[:, ranks] @ b.t()
                if rows is None:
                    y[:, columns] += delta
                else:
                    y[:, columns].index_add_(0, rows, delta)
