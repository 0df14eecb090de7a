"""Device memory whose addresses outlive the memory itself: the KV cache of config `static_kv_memory_pointers`
(Megatron's name).

CUDA graphs capture the KV cache's address. A `SuspendKVCache` that releases the cache's memory
(`offload`, `recompute`) would otherwise drop the graphs and capture them again on resume. CUDA's virtual
memory API separates the two: an address range is reserved once (`cuMemAddressReserve`), and physical
memory is created and mapped into it (`cuMemCreate`, `cuMemMap`), then unmapped and released on suspend
(`cuMemUnmap`, `cuMemRelease`) while the range stays reserved. Resume maps new memory at the same
addresses, and the captured graphs replay as they were.

The driver is called through ctypes (libcuda.so.1, loaded by torch's CUDA runtime already); torch sees
the range as a tensor through `__cuda_array_interface__`. Call everything from the thread that runs the
model: it has the device's primary context current.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemAllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class CUmemAllocationProp(ctypes.Structure):
    """cuda.h's CUmemAllocationProp (CUDA 11.x-13.x): 32 bytes."""

    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", CUmemLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", CUmemAllocFlags)]


class CUmemAccessDesc(ctypes.Structure):
    """cuda.h's CUmemAccessDesc: 12 bytes."""

    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(result: int, call: str) -> None:
    if result != 0:
        raise RuntimeError(f"{call} failed with CUDA driver error {result}")


class StaticDeviceMemory:
    """`nbytes` (rounded up to the allocation granularity) at one reserved address range of a CUDA device,
    mapped to physical memory or not."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.zeros(1, device=self.device)  # the device's primary context, current on this thread
        self._cuda = _driver()
        self._prop = CUmemAllocationProp(type=CU_MEM_ALLOCATION_TYPE_PINNED,
                                         location=CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, self.device.index))
        granularity = ctypes.c_size_t()
        _check(self._cuda.cuMemGetAllocationGranularity(ctypes.byref(granularity), ctypes.byref(self._prop),
                                                        CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity")
        self.size = -(-nbytes // granularity.value) * granularity.value
        self.nbytes = nbytes
        self.address = ctypes.c_uint64()
        _check(self._cuda.cuMemAddressReserve(ctypes.byref(self.address), ctypes.c_size_t(self.size),
                                              ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_uint64(0)),
               "cuMemAddressReserve")
        self._handle: ctypes.c_uint64 | None = None
        self.map()

    @property
    def mapped(self) -> bool:
        return self._handle is not None

    def map(self) -> None:
        """Back the range with new physical memory (its contents undefined)."""
        if self._handle is not None:
            return
        handle = ctypes.c_uint64()
        _check(self._cuda.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(self.size), ctypes.byref(self._prop),
                                      ctypes.c_uint64(0)), "cuMemCreate")
        _check(self._cuda.cuMemMap(self.address, ctypes.c_size_t(self.size), ctypes.c_size_t(0), handle,
                                   ctypes.c_uint64(0)), "cuMemMap")
        access = CUmemAccessDesc(CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, self.device.index),
                                 CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        _check(self._cuda.cuMemSetAccess(self.address, ctypes.c_size_t(self.size), ctypes.byref(access),
                                         ctypes.c_size_t(1)), "cuMemSetAccess")
        self._handle = handle

    def unmap(self) -> None:
        """Release the physical memory; the addresses stay reserved (nothing may touch them until `map`)."""
        if self._handle is None:
            return
        torch.cuda.synchronize(self.device)  # no kernel still reads or writes it
        _check(self._cuda.cuMemUnmap(self.address, ctypes.c_size_t(self.size)), "cuMemUnmap")
        _check(self._cuda.cuMemRelease(self._handle), "cuMemRelease")
        self._handle = None

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.address.value, False), "strides": None,
                "version": 2}

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The range as a tensor of `shape` and `dtype` (its bytes: `nbytes`); it reads the range while it lives,
        so the caller keeps this object at least as long."""
        raw = torch.as_tensor(self, device=self.device)
        return raw.view(dtype).view(shape)

    def close(self) -> None:
        """Release the memory and the address range (no tensor over it may be used after)."""
        self.unmap()
        if self.address.value:
            _check(self._cuda.cuMemAddressFree(self.address, ctypes.c_size_t(self.size)), "cuMemAddressFree")
            self.address = ctypes.c_uint64()
