"""The import graph with each folder of a service as one node (a room), and each module directly in a
service's folder as a node of its own: the rooms must form layers too, so no two of them import each
other, directly or round a longer loop.

An edge to a service package itself (`import gateway.x` runs `gateway/__init__.py`) is left out: a
service's `__init__` holds nothing, and counting it would tie every room to the service's top.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tests.helpers.import_graph import Import, import_graph


def room_of(module: str) -> str:
    """`scheduler_svc.kv.block_pool` -> `scheduler_svc.kv`; a module at a service's top is its own room."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) >= 3 else module


def room_graph(root: Path, services: Sequence[str]) -> dict[str, list[Import]]:
    """Room -> its import edges into other rooms of the same service (each edge as the import that made it)."""
    rooms: dict[str, list[Import]] = {}
    for module, edges in import_graph(root, services).items():
        here = room_of(module)
        out = rooms.setdefault(here, [])
        for edge in edges:
            if edge.imported in services:
                continue
            there = room_of(edge.imported)
            if there != here and there.split(".")[0] == here.split(".")[0]:
                out.append(Import(here, there, edge.path, edge.line))
    return rooms
