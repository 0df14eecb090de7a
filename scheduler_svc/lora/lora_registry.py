"""The LoRA adapters this scheduler serves, by name and worker slot (issue 41; docs/lora.md).

One registry for the whole service: every worker replica holds every adapter in the same slot, so any replica
can serve any adapter (data-parallel routing needs no preference for one) and a sequence keeps its slot when
it is recomputed on another replica. The registry is the truth; each replica brings its worker in line with
it before planning a step (replica_loras.py), so a worker that restarted gets the adapters loaded since.

A slot is free, reserved (its adapter loading on the replicas), loaded (requests may name it), or draining:
unloaded or replaced, no new request gets it, and the requests still using it finish with it. Only then is it
emptied and free again. Each load has its own id, mixed into the prefix-cache salt, so the blocks of an
adapter that was replaced are never reused for its successor of the same name.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetero.v1 import common_pb2
from hetero_common.errors import LoraAdapterExistsError, LoraSlotsFullError, ModelNotFoundError
from hetero_common.lora_modules import check_adapter_name, lora_cache_salt, parse_lora_modules


@dataclass(frozen=True)
class LoadedAdapter:
    info: common_pb2.LoraAdapter  # name, path, slot, and (once a worker reported them) rank and targets
    load_id: int  # unique per load

    @property
    def cache_key(self) -> str:
        """What the prefix-cache salt holds for requests served with it."""
        return f"{self.info.name}#{self.load_id}"


class LoraRegistry:
    def __init__(self, max_loras: int, served_model: str, lora_modules: str = "") -> None:
        self.max_loras, self.served_model = max_loras, served_model
        self._loaded: dict[str, LoadedAdapter] = {}
        self._draining: dict[int, LoadedAdapter] = {}  # by slot
        self._reserved: dict[int, str] = {}  # slot -> the name loading into it
        self._next_load_id = 1
        self.version = 0  # changes whenever what the workers should hold does
        for slot, (name, path) in enumerate(parse_lora_modules(lora_modules, max_loras), start=1):
            self.commit(common_pb2.LoraAdapter(name=name, path=path, slot=slot))  # as the workers load them at start

    # ------------------------------------------------------------------ requests

    def resolve(self, name: str) -> tuple[int, str]:
        """The slot serving requests for adapter `name` and its prefix-cache key; (0, "") for the base model."""
        if not name:
            return 0, ""
        adapter = self._loaded.get(name)
        if adapter is None:
            raise ModelNotFoundError(f"model {name!r} is neither the served model ({self.served_model!r}) nor a "
                                     f"loaded LoRA adapter ({self._loaded_names()})", "model")
        return adapter.info.slot, adapter.cache_key

    def _loaded_names(self) -> str:
        return "loaded: " + (", ".join(repr(n) for n in sorted(self._loaded)) or "none") + "; see ListLoraAdapters"

    def place(self, adapter: str, cache_salt: str) -> tuple[int, str]:
        """A request's slot and the prefix-cache salt its blocks are hashed with (the router's and the pool's)."""
        slot, cache_key = self.resolve(adapter)
        return slot, lora_cache_salt(cache_salt, cache_key)

    # ------------------------------------------------------------------ loading and unloading

    def reserve(self, name: str, replace: bool) -> int:
        """A free slot for a new load of `name`; the caller loads it on the workers, then commits or cancels."""
        check_adapter_name(name, self.served_model)
        if name in self._loaded and not replace:
            raise LoraAdapterExistsError(f"a LoRA adapter named {name!r} is loaded already; set replace to load "
                                         "over it, or unload it first")
        if name in self._reserved.values():
            raise LoraAdapterExistsError(f"a LoRA adapter named {name!r} is being loaded now; retry when it is done")
        taken = {a.info.slot for a in self._loaded.values()} | set(self._draining) | set(self._reserved)
        free = next((slot for slot in range(1, self.max_loras + 1) if slot not in taken), None)
        if free is None:
            draining = ", ".join(repr(a.info.name) for a in self._draining.values())
            raise LoraSlotsFullError(
                f"all {self.max_loras} LoRA slots (max_loras) are taken: {len(self._loaded)} adapters loaded"
                + (f", and {draining} finishing the requests that use them" if draining else "")
                + "; unload one, or restart with a larger max_loras")
        self._reserved[free] = name
        return free

    def cancel(self, slot: int) -> None:
        """A reserved slot whose load failed is free again."""
        self._reserved.pop(slot, None)

    def commit(self, info: common_pb2.LoraAdapter) -> LoadedAdapter | None:
        """`info` (loaded on the workers in its slot) now serves its name; the adapter it replaced, now draining."""
        self.cancel(info.slot)
        old = self._loaded.get(info.name)
        if old is not None:
            self._draining[old.info.slot] = old
        self._loaded[info.name] = LoadedAdapter(info, self._next_load_id)
        self._next_load_id += 1
        self.version += 1
        return old

    def remove(self, name: str) -> LoadedAdapter:
        """New requests for `name` are NOT_FOUND from now on; its slot drains."""
        adapter = self._loaded.pop(name, None)
        if adapter is None:
            raise ModelNotFoundError(f"no LoRA adapter named {name!r} is loaded ({self._loaded_names()})", "name")
        self._draining[adapter.info.slot] = adapter
        self.version += 1
        return adapter

    def release(self, slot: int) -> None:
        """A drained slot: the workers empty it and it is free."""
        self._draining.pop(slot, None)
        self.version += 1

    def learn(self, reported: list[common_pb2.LoraAdapter]) -> None:
        """Fill in rank and targets of adapters loaded at start, from a worker's report (WorkerInfo)."""
        for adapter in self._loaded.values():
            match = next((r for r in reported if r.slot == adapter.info.slot and r.name == adapter.info.name
                          and r.path == adapter.info.path), None)
            if match is not None and not adapter.info.rank:
                adapter.info.rank = match.rank
                adapter.info.target_modules.extend(match.target_modules)

    # ------------------------------------------------------------------ views

    def adapters(self) -> list[LoadedAdapter]:
        """The adapters requests may name, by slot."""
        return sorted(self._loaded.values(), key=lambda a: a.info.slot)

    def wanted(self) -> dict[int, common_pb2.LoraAdapter]:
        """What each worker slot should hold: the loaded adapters and the draining ones (still in use)."""
        wanted = {a.info.slot: a.info for a in self._loaded.values()}
        wanted.update({slot: a.info for slot, a in self._draining.items()})
        return wanted

    def is_draining(self, slot: int) -> bool:
        return slot in self._draining

    @property
    def slots_in_use(self) -> int:
        """Slots holding an adapter: loaded, draining, or being loaded."""
        return len(self._loaded) + len(self._draining) + len(self._reserved)
