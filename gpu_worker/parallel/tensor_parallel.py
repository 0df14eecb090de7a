"""Tensor parallelism inside one replica: ranks split attention heads and the MLP (Megatron style).

q/k/v and gate/up are column-parallel (each rank holds a slice of heads / of the
intermediate size); o_proj and down_proj are row-parallel, followed by an all_reduce sum.
Every rank holds the KV cache of its own KV heads. Rank 0 serves gRPC and broadcasts each
step plan (and each KV-cache suspend/resume) to the other ranks; all ranks run the same
step; rank 0's sampled tokens are broadcast so every rank appends the same token even when
sampling is random.
Collectives go through torch.distributed (gloo on the CPU, NCCL on GPUs).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import structlog
import torch
import torch.distributed as dist

from gpu_worker.parallel.tp_rendezvous import init_method, prepare_gloo
from hetero_common.errors import ConfigError

log = structlog.get_logger("gpu_worker.parallel.tensor_parallel")

# What rank 0 sends the other ranks, in the order it runs them: ("step", serialized StepPlan),
# ("suspend", mode), ("resume", ""), ("lora_load" | "lora_unload", serialized request). Every rank runs each
# one on its own shard.
Command = tuple[str, bytes | str]

# A rank that died leaves the others blocked in a collective: fail instead of hanging for 30 min.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @staticmethod
    def initialize(rank: int, size: int, init_file: str | None, device: torch.device,
                   configured_init_method: str = "") -> "TensorParallel":
        """Join the replica's group: through `serve`'s rendezvous file when given (ranks on one
        host), else through the configured `tp_init_method` (ranks on several hosts)."""
        if size > 1:
            method = init_method(init_file, configured_init_method)
            if method is None:
                raise ConfigError("tensor_parallel_size > 1 needs tp_init_method (e.g. tcp://<rank 0's address>:29500) "
                                  "or --tp-init-file (hetero-infer serve passes it)")
            backend = "nccl" if device.type == "cuda" else "gloo"
            if backend == "gloo":
                prepare_gloo(method)
            dist.init_process_group(backend, init_method=method, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
        return TensorParallel(rank, size)

    def check_divides(self, **dims: int) -> None:
        for name, value in dims.items():
            if value % self.size:
                raise ConfigError(f"config key 'tensor_parallel_size' = {self.size} must divide the model's {name} ({value})")

    def rows(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the output features (column-parallel layer; also for biases)."""
        if not self.enabled:
            return weight
        n = weight.shape[0] // self.size
        return weight[self.rank * n:(self.rank + 1) * n]

    def columns(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the input features (row-parallel layer)."""
        if not self.enabled:
            return weight
        n = weight.shape[1] // self.size
        return weight[:, self.rank * n:(self.rank + 1) * n]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(x)
        return x

    def broadcast_command(self, command: Command | None) -> Command | None:
        """Rank 0 sends the next command (None = stop); every rank returns it."""
        box = [command]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def rank0_choice(self, value: object) -> object:
        """Rank 0's `value` on every rank: a start-up choice that ranks could otherwise make
        differently (e.g. a dtype decided by a timing), which would split the group."""
        if not self.enabled:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def sum_over_ranks(self, value: int, device: torch.device) -> int:
        """Every rank's value added up, on every rank. Also a barrier: it returns once all ranks got here."""
        if not self.enabled:
            return value
        total = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(total)
        return int(total.item())

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The smallest rank's value, on every rank. Also a barrier."""
        if not self.enabled:
            return value
        smallest = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
        return int(smallest.item())

    def agreed_kv_blocks(self, own: int, device: torch.device) -> int:
        """The KV block count every rank allocates: the smallest any rank's memory allows. Each rank sizes its
        own pool (its free memory, its budget) and the scheduler hands out block ids up to rank 0's report, so a
        rank holding fewer blocks would be sent ids past its cache, which FlashInfer reads unchecked."""
        agreed = self.min_over_ranks(own, device)
        if agreed < own:
            log.info("kv blocks lowered to the smallest rank's", rank=self.rank, own=own, agreed=agreed)
        return agreed

    def broadcast_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            dist.broadcast(tokens, src=0)
        return tokens

    def shutdown(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()
