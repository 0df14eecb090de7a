"""A mixture-of-experts MLP over flattened tokens (Mixtral, Qwen2/3-MoE, OLMoE; gpu_worker/model_config.MoeConfig).

The router's logits are computed in float32 and soft-maxed; each token takes its top-k experts. Tokens are then
grouped by expert, and each expert with tokens runs its gate/up product, SiLU·mul and down product once over its
group, through the same `linear` (and, on the CPU, the same C kernels) as a dense layer. Each token's output is
accumulated from its experts in expert order, so its bits depend on its own row and experts only, never on which
other tokens share an expert or how many rows the step has: the bfloat16 row invariance of the dense layers holds
here too (tests/unit/gpu_worker/test_row_invariance.py).

On CUDA the experts are stacked instead (`GroupedExperts`) and computed by two grouped products over all of a
step's (token, expert) pairs sorted by expert (torch._grouped_mm), with no read-back to the host: a step stays
one CUDA graph. Each token's k outputs are then summed in a fixed order, with no atomics.

Under tensor parallelism each rank holds its slice of every expert's intermediate features (gate/up rows, down
columns), as the dense MLP; the router and the shared expert's gate are whole on every rank, and the caller
all-reduces the partial sums as after a dense down product.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu_worker.cpu.packed_linear import PackedWeight, linear, linear_float32


@dataclass
class ExpertMlp:
    """One expert's (or the shared expert's) products on this rank: gate|up stacked, and down."""

    gate_up: PackedWeight
    down: PackedWeight


@dataclass
class GroupedExperts:
    """Every expert's products stacked, for the grouped products on CUDA: gate|up [experts, 2n, hidden] and
    down [experts, hidden, n] (this rank's n)."""

    gate_up: torch.Tensor
    down: torch.Tensor

    @classmethod
    def stack(cls, experts: list[ExpertMlp]) -> GroupedExperts:
        return cls(torch.stack([e.gate_up for e in experts]), torch.stack([e.down for e in experts]))

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                 silu_mul: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the experts' weighted sum [T, hidden], the tokens per expert) for x [T, hidden] routed to `chosen`
        [T, k] with `weights` [T, k]; every size stays on the device."""
        t, k = chosen.shape
        flat = chosen.flatten()
        load = torch.zeros(self.gate_up.shape[0], dtype=torch.int64, device=x.device)
        load.scatter_add_(0, flat, torch.ones_like(flat))
        if not t:
            return torch.zeros_like(x), load
        order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
        ends = torch.cumsum(load, 0).to(torch.int32)  # each expert's group ends there
        rows = x[order // k]
        y = torch._grouped_mm(silu_mul(torch._grouped_mm(rows, self.gate_up.transpose(1, 2), offs=ends)),
                              self.down.transpose(1, 2), offs=ends)
        per_slot = torch.empty_like(y)
        per_slot[order] = y  # back in (token, slot) order
        out = (per_slot.view(t, k, -1).float() * weights[..., None]).sum(dim=1)  # slot by slot, in order
        return out.to(x.dtype), load


@dataclass
class SparseMoe:
    router: PackedWeight  # [num_experts, hidden]
    experts: list[ExpertMlp]  # none where `grouped` holds them
    top_k: int
    normalize_top_k: bool
    shared: ExpertMlp | None = None  # Qwen2-MoE's shared expert, and its [1, hidden] gate
    shared_gate: PackedWeight | None = None
    grouped: GroupedExperts | None = None  # on CUDA

    def products(self) -> list[PackedWeight]:
        """Every linear weight it holds: the router, each expert's two (or their stacks), the shared expert's and
        its gate."""
        shared = [] if self.shared is None else [self.shared.gate_up, self.shared.down, self.shared_gate]
        stacked = [] if self.grouped is None else [self.grouped.gate_up, self.grouped.down]
        return [self.router, *(w for e in self.experts for w in (e.gate_up, e.down)), *stacked, *shared]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the top-k experts' weights [T, k] float32, their indices [T, k] int64) for x [T, hidden]. Ties between
        equal probabilities go to the lower expert index (torch.topk on the CPU, as transformers)."""
        probs = torch.softmax(linear_float32(x, self.router), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize_top_k:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    def __call__(self, x: torch.Tensor, silu_mul: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor,
                                                                                                    torch.Tensor]:
        """(this rank's partial MLP output [T, hidden] in x's dtype, the tokens routed to each expert
        [num_experts] int64: the step's expert load). `silu_mul` maps gate|up [rows, 2n] to [rows, n]."""
        weights, chosen = self.route(x)
        out, load = (self._per_expert(x, weights, chosen, silu_mul) if self.grouped is None
                     else self.grouped(x, weights, chosen, silu_mul))
        if self.shared is not None and self.shared_gate is not None:
            shared = linear(silu_mul(linear(x, self.shared.gate_up)), self.shared.down)
            out += torch.sigmoid(linear(x, self.shared_gate)) * shared
        return out, load

    def _per_expert(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                    silu_mul: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each expert with tokens over its group, through `linear` (the C kernels on a bfloat16 CPU)."""
        out = torch.zeros_like(x)
        flat = chosen.flatten()
        load = torch.bincount(flat, minlength=len(self.experts))
        # The (token, slot) assignments sorted by expert; a stable sort keeps each group in token order. Their
        # tokens, rows and weights are gathered once for all experts: each expert then slices its group.
        order = torch.argsort(flat, stable=True)
        tokens = order // self.top_k
        rows = x[tokens]
        picked = weights.view(-1)[order, None]  # the router's weights in float32, as transformers' Mixtral
        start = 0
        for expert, count in zip(self.experts, load.tolist()):
            if not count:
                continue
            end = start + count
            y = linear(silu_mul(linear(rows[start:end], expert.gate_up)), expert.down)
            out.index_add_(0, tokens[start:end], (y * picked[start:end]).to(out.dtype))  # the sum in x's dtype
            start = end
        return out, load
