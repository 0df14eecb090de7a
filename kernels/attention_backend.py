"""Attention backends behind one interface, with FlashInfer's page-table metadata for all.

A backend has `plan(PageTable)` (once per step), then per layer `write_kv(layer_cache, k, v,
slots)` (the step's new K/V into the paged cache) and `run(q, layer_kv_cache)`.
"""

from __future__ import annotations

from typing import Protocol

import structlog
import torch

from kernels.flashinfer_backend import flashinfer_unavailable_reason
from kernels.page_table import PageTable
from kernels.torch_attention import TorchPagedAttention

log = structlog.get_logger("kernels")


class AttentionBackend(Protocol):
    name: str
    kv_layout: str  # the cache layout its kernels read: NHD | HND (kernels/cache_ops.py)
    kv_dtype: torch.dtype | None  # the cache's element it expects (None: whatever the cache holds)

    def plan(self, table: PageTable) -> None: ...

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None: ...

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor: ...

    def windowed(self, window: int) -> AttentionBackend: ...


def select_attention_backend(name: str, device: torch.device | str, head_dim: int,
                             dtype: torch.dtype | None = None) -> tuple[str, str | None]:
    """(backend name, why FlashInfer is not used or None). `auto` -> flashinfer when it can serve, else torch.

    Raises ValueError when `flashinfer` is forced but cannot serve (the message says why).
    """
    if name not in ("auto", "torch", "flashinfer"):
        raise ValueError(f"attention_backend {name!r} is unknown; use auto, torch or flashinfer")
    if name == "torch":
        return "torch", "attention_backend is torch"
    reason = flashinfer_unavailable_reason(torch.device(device), head_dim, dtype)
    if reason is None:
        return "flashinfer", None
    if name == "flashinfer":
        raise ValueError(f"attention_backend 'flashinfer' cannot be used: {reason}; use 'torch' or 'auto'")
    return "torch", reason


def create_attention_backend(name: str, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                             device: torch.device | str, dtype: torch.dtype | None = None,
                             workspace: torch.Tensor | None = None, decode_kernel: str = "torch",
                             prompts_apart: bool = False, prompt_tiles: bool = True,
                             kv_dtype: torch.dtype | None = None, scale: float | None = None) -> AttentionBackend:
    """`auto` picks FlashInfer on a CUDA device of sm75+ when it is importable, else torch.
    `decode_kernel`, `prompts_apart`, `prompt_tiles`: the torch backend's CPU paths (TorchPagedAttention).
    `kv_dtype`: the cache's element where it is not `dtype` (float8_e4m3fn: config `kv_cache_dtype: fp8`).
    `scale`: q·k's factor where it is not head_dim ** -0.5 (ModelConfig.attention_scale). Both backends make the
    sliding-window layers' backend beside them (`windowed(window)`)."""
    device = torch.device(device)
    chosen, reason = select_attention_backend(name, device, head_dim, dtype)
    if chosen == "flashinfer":
        from kernels.flashinfer_backend import FlashInferPagedAttention

        return FlashInferPagedAttention(num_qo_heads, num_kv_heads, head_dim, device,
                                        dtype=dtype or torch.bfloat16, workspace=workspace, kv_dtype=kv_dtype,
                                        scale=scale)
    if device.type == "cuda":
        log.warning("attention on CUDA uses the torch reference (slow)", reason=reason)
    return TorchPagedAttention(num_qo_heads, num_kv_heads, head_dim, device, decode_kernel=decode_kernel, dtype=dtype,
                               prompts_apart=prompts_apart, prompt_tiles=prompt_tiles, kv_dtype=kv_dtype,
                               scale=scale)
