"""Loading and unloading LoRA adapters at run time, on every worker replica (issue 41; docs/lora.md).

A load reserves a free slot, fills it on every replica that is up (a replica that is down gets it before its
next step, replica_loras.py) and only then lets requests name the adapter. If any worker refuses the adapter
(missing files, shapes of another model, a rank over max_lora_rank...), the slot is emptied again everywhere
and its error, which names what is wrong, is the caller's: the served model and the other adapters never
notice. An unload (and a replace, for the adapter it replaces) makes the name unknown to new requests at
once and waits for the requests already using the adapter to finish with it; then it empties the slot.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Callable, Protocol

import grpc
import structlog

from hetero.v1 import common_pb2, worker_pb2
from hetero_common.errors import ValidationError
from scheduler_svc.lora.lora_registry import LoadedAdapter, LoraRegistry

log = structlog.get_logger("scheduler_svc.lora.lora_manager")
DRAIN_POLL_S = 0.02


class Replica(Protocol):
    """What a load or unload asks of one replica (`scheduler_svc.replicas.replica.Replica`; named by its shape:
    the replicas build on this room, not the other way round)."""

    index: int

    async def fill_lora_slot(self, load: worker_pb2.LoadLoraRequest) -> common_pb2.LoraAdapter: ...

    async def empty_lora_slot(self, slot: int) -> None: ...


class LoraManager:
    """`replicas_up` lists the replicas to load on; `slots_in_use` counts the requests per slot everywhere
    (replicas and parked requests)."""

    def __init__(self, registry: LoraRegistry, replicas_up: Callable[[], list[Replica]],
                 slots_in_use: Callable[[], Counter[int]]) -> None:
        self.registry = registry
        self._replicas_up, self._slots_in_use = replicas_up, slots_in_use
        self._retiring: set[asyncio.Task[None]] = set()

    async def load(self, request: common_pb2.LoadLoraAdapterRequest) -> common_pb2.LoraAdapter:
        if not request.path:
            raise ValidationError("path is empty: give the adapter's directory (adapter_config.json and "
                                  "adapter_model.safetensors)", "path")
        slot = self.registry.reserve(request.name, request.replace)
        filled: list[Replica] = []
        load = worker_pb2.LoadLoraRequest(slot=slot, name=request.name, path=request.path)
        info = common_pb2.LoraAdapter(name=request.name, path=request.path, slot=slot)
        try:
            for replica in self._replicas_up():
                filled.append(replica)
                info = await replica.fill_lora_slot(load)
        except BaseException:
            for replica in filled:  # the slot empty again everywhere, then free
                await _quietly(replica.empty_lora_slot(slot), replica)
            self.registry.cancel(slot)
            raise
        replaced = self.registry.commit(info)
        log.info("LoRA adapter loaded", adapter=request.name, path=request.path, slot=slot, rank=info.rank,
                 replaced=replaced is not None)
        if replaced is not None:
            self._retire_later(replaced)
        return self._described(self.registry.adapters(), Counter())[request.name]

    async def unload(self, request: common_pb2.UnloadLoraAdapterRequest) -> common_pb2.UnloadLoraAdapterResponse:
        adapter = self.registry.remove(request.name)
        waited = self._slots_in_use()[adapter.info.slot]
        log.info("LoRA adapter unloading", adapter=request.name, slot=adapter.info.slot, requests_using_it=waited)
        # The caller going away does not stop the unload: the name is gone already.
        await asyncio.shield(self._retire_later(adapter))
        return common_pb2.UnloadLoraAdapterResponse(waited_requests=waited)

    def list(self) -> common_pb2.ListLoraAdaptersResponse:
        described = self._described(self.registry.adapters(), self._slots_in_use())
        return common_pb2.ListLoraAdaptersResponse(adapters=list(described.values()))

    def _retire_later(self, adapter: LoadedAdapter) -> asyncio.Task[None]:
        task = asyncio.create_task(self._retire(adapter))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        return task

    async def _retire(self, adapter: LoadedAdapter) -> None:
        """Wait until no request uses the adapter's slot, then empty it on every replica and free it."""
        slot = adapter.info.slot
        while self._slots_in_use()[slot]:
            await asyncio.sleep(DRAIN_POLL_S)
        for replica in self._replicas_up():
            await _quietly(replica.empty_lora_slot(slot), replica)
        self.registry.release(slot)  # a replica that failed to empty it does so before its next step
        log.info("LoRA adapter unloaded", adapter=adapter.info.name, slot=slot)

    @staticmethod
    def _described(adapters: list[LoadedAdapter], in_use: Counter[int]) -> dict[str, common_pb2.LoraAdapter]:
        described = {}
        for adapter in adapters:
            info = common_pb2.LoraAdapter()
            info.CopyFrom(adapter.info)
            info.active_requests = in_use[adapter.info.slot]
            described[info.name] = info
        return described


async def _quietly(call: object, replica: Replica) -> None:
    """Empty a slot as part of cleaning up; a worker that fails is brought in line before its next step."""
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        log.warning("could not empty a LoRA slot; the replica does so before its next step", replica=replica.index,
                    error=exc.details())
