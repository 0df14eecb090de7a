"""The worker's KV cache while suspended (`SuspendKVCache` / `ResumeKVCache`): `persist` keeps it on the device,
`offload` holds a copy in host memory, `recompute` drops it (the scheduler re-queues its sequences). Its
device memory is released in the last two; CUDA graphs captured its address, so they go with it and are
captured again on resume (the runner does that: it owns the model)."""

from __future__ import annotations

import torch


class KVSuspension:
    """Whether the cache is suspended, and what resuming needs: the host copy or the shape to allocate."""

    __slots__ = ("mode", "_host", "_shape", "recapture_graphs")

    def __init__(self) -> None:
        self.mode = ""  # "" while not suspended
        self._host: torch.Tensor | None = None
        self._shape: tuple[int, ...] = ()
        self.recapture_graphs = False

    def suspend(self, mode: str, kv_cache: torch.Tensor, had_graphs: bool) -> tuple[torch.Tensor, int]:
        """(the cache to hold meanwhile, the bytes released): an empty tensor where the memory goes (the caller
        drops its own reference, then empties CUDA's cache)."""
        self.mode = mode
        if mode not in ("offload", "recompute"):
            return kv_cache, 0
        released = kv_cache.numel() * kv_cache.element_size()
        self._shape = tuple(kv_cache.shape)
        self._host = kv_cache.to("cpu", copy=True) if mode == "offload" else None
        self.recapture_graphs = had_graphs
        return torch.empty(0, dtype=kv_cache.dtype, device=kv_cache.device), released

    def resume(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, str]:
        """(the cache back on the device (zeros after `recompute`), the mode it was suspended in)."""
        mode, self.mode = self.mode, ""
        if mode == "offload" and self._host is not None:
            kv_cache = self._host.to(kv_cache.device)
        elif mode == "recompute":
            kv_cache = torch.zeros(self._shape, dtype=kv_cache.dtype, device=kv_cache.device)
        self._host = None
        return kv_cache, mode
