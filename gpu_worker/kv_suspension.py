"""The worker's KV cache while suspended (`SuspendKVCache` / `ResumeKVCache`): `persist` keeps it on the device,
`offload` holds a copy in host memory, `recompute` drops it (the scheduler re-queues its sequences). Its
device memory is released in the last two. CUDA graphs captured its address: with config
`static_kv_memory_pointers` the cache's physical memory is unmapped and mapped again at the same addresses
(gpu_worker/cuda/static_kv_memory.py) and the graphs stay; otherwise they go with the memory and are captured
again on resume (the runner does that: it owns the model)."""

from __future__ import annotations

from typing import Protocol

import torch


class StaticMemory(Protocol):
    """Memory that keeps its addresses while unmapped (static_kv_memory.StaticDeviceMemory)."""

    def map(self) -> None: ...

    def unmap(self) -> None: ...


class KVSuspension:
    """Whether the cache is suspended, and what resuming needs: the host copy or the shape to allocate."""

    __slots__ = ("mode", "_host", "_shape", "recapture_graphs", "static")

    def __init__(self, static: StaticMemory | None = None) -> None:
        self.mode = ""  # "" while not suspended
        self._host: torch.Tensor | None = None
        self._shape: tuple[int, ...] = ()
        self.recapture_graphs = False
        self.static = static  # the cache's memory, when its addresses are kept (static_kv_memory_pointers)

    def suspend(self, mode: str, kv_cache: torch.Tensor, had_graphs: bool) -> tuple[torch.Tensor, int]:
        """(the cache to hold meanwhile, the bytes released): an empty tensor where the memory goes (the caller
        drops its own reference, then empties CUDA's cache), or the same tensor over unmapped addresses."""
        self.mode, self.recapture_graphs = mode, False
        if mode not in ("offload", "recompute"):
            return kv_cache, 0
        released = kv_cache.numel() * kv_cache.element_size()
        self._shape = tuple(kv_cache.shape)
        self._host = kv_cache.to("cpu", copy=True) if mode == "offload" else None
        if self.static is not None:  # the same addresses after resume: the captured graphs stay valid
            self.static.unmap()
            return kv_cache, released
        self.recapture_graphs = had_graphs
        return torch.empty(0, dtype=kv_cache.dtype, device=kv_cache.device), released

    def resume(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, str]:
        """(the cache back on the device (zeros after `recompute`), the mode it was suspended in)."""
        mode, self.mode = self.mode, ""
        if self.static is not None and mode in ("offload", "recompute"):
            self.static.map()  # new memory at the old addresses: the offloaded copy goes back into it
            if self._host is not None:
                kv_cache.copy_(self._host)
            else:
                kv_cache.zero_()
        elif mode == "offload" and self._host is not None:
            kv_cache = self._host.to(kv_cache.device)
        elif mode == "recompute":
            kv_cache = torch.zeros(self._shape, dtype=kv_cache.dtype, device=kv_cache.device)
        self._host = None
        return kv_cache, mode
