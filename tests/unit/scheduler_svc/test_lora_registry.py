"""The scheduler's LoRA slots (scheduler_svc/lora/lora_registry.py, issue 41): names resolve to slots and to a
prefix-cache salt of their own load; a name is loaded once unless replaced; a replaced or removed adapter's
slot drains before it is free; every refusal is a typed error naming what to fix, never an internal error."""

from __future__ import annotations

import pytest

from hetero.v1 import common_pb2
from hetero_common.errors import LoraAdapterExistsError, LoraSlotsFullError, ModelNotFoundError, ValidationError
from scheduler_svc.lora.lora_registry import LoraRegistry


def loaded(registry: LoraRegistry, name: str, replace: bool = False) -> int:
    slot = registry.reserve(name, replace)
    registry.commit(common_pb2.LoraAdapter(name=name, path=f"/p/{name}", slot=slot))
    return slot


def test_names_resolve_to_slots_and_a_salt_per_load() -> None:
    registry = LoraRegistry(2, "base", "a=/x")
    assert registry.resolve("") == (0, "")
    assert registry.resolve("a")[0] == 1
    salt = registry.place("a", "s")[1]
    assert loaded(registry, "b") == 2
    with pytest.raises(LoraAdapterExistsError, match="'a' is loaded already"):
        registry.reserve("a", replace=False)
    with pytest.raises(LoraSlotsFullError, match="all 2 LoRA slots"):
        registry.reserve("a", replace=True)  # a replace needs a free slot too
    registry.remove("b")
    with pytest.raises(LoraSlotsFullError, match="'b' finishing"):
        registry.reserve("c", replace=False)  # b drains until released
    registry.release(2)
    assert loaded(registry, "a", replace=True) == 2  # the old a drains in slot 1
    assert registry.is_draining(1) and registry.place("a", "s")[1] != salt
    assert set(registry.wanted()) == {1, 2} and registry.slots_in_use == 2


@pytest.mark.parametrize("name", ["", "never", "base"])
def test_removing_what_is_not_loaded_is_not_found(name: str) -> None:
    registry = LoraRegistry(2, "base", "a=/x")
    with pytest.raises(ModelNotFoundError, match="loaded: 'a'"):
        registry.remove(name)


@pytest.mark.parametrize("name,words", [("", "must start"), ("base", "served model"), ("a b", "must start"),
                                        ("x" * 201, "at most 200")])
def test_bad_names_are_refused(name: str, words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        LoraRegistry(2, "base").reserve(name, replace=False)
