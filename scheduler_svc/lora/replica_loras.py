"""What one worker's LoRA slots hold, as its replica knows it, and bringing them in line with the registry.

The worker reports its slots when it joins (WorkerInfo.lora_adapters: `lora_modules` at its start, or what an
earlier scheduler loaded). Before each step the replica compares that with the registry (one integer compare
when nothing changed) and loads or empties the slots that differ, so a worker that restarted, or one that was
down while an adapter was loaded, serves the same adapters in the same slots as every other replica.
"""

from __future__ import annotations

from hetero.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from scheduler_svc.lora.lora_registry import LoraRegistry


class WorkerLoras:
    def __init__(self) -> None:
        self._held: dict[int, tuple[str, str]] = {}  # slot -> (name, path)
        self._version = -1  # the registry version last brought in line with

    def joined(self, reported: list[common_pb2.LoraAdapter]) -> None:
        """A worker (new or restarted) answered Describe with these slots."""
        self._held = {a.slot: (a.name, a.path) for a in reported}
        self._version = -1

    def in_line(self, registry: LoraRegistry) -> bool:
        return self._version == registry.version

    async def fill(self, stub: worker_pb2_grpc.WorkerStub, request: worker_pb2.LoadLoraRequest,
                   timeout_s: float) -> common_pb2.LoraAdapter:
        """Load an adapter into a slot; raises the worker's error (INVALID_ARGUMENT naming what is wrong)."""
        self._held.pop(request.slot, None)  # whatever it held is gone even if this fails half-way
        info = await stub.LoadLora(request, timeout=timeout_s)
        self._held[request.slot] = (request.name, request.path)
        return info

    async def empty(self, stub: worker_pb2_grpc.WorkerStub, slot: int, timeout_s: float) -> None:
        if slot in self._held:
            await stub.UnloadLora(worker_pb2.UnloadLoraRequest(slot=slot), timeout=timeout_s)
            del self._held[slot]

    async def bring_in_line(self, stub: worker_pb2_grpc.WorkerStub, registry: LoraRegistry, timeout_s: float) -> None:
        """Load what the registry wants and the worker lacks, empty the slots it no longer wants."""
        version, wanted = registry.version, registry.wanted()
        for slot, info in wanted.items():
            if self._held.get(slot) != (info.name, info.path):
                await self.fill(stub, worker_pb2.LoadLoraRequest(slot=slot, name=info.name, path=info.path), timeout_s)
        for slot in set(self._held) - set(wanted):
            await self.empty(stub, slot, timeout_s)
        self._version = version
