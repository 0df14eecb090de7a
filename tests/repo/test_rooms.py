"""The rooms inside each service, checked on the source: no two rooms import each other (each folder of a
service is one node, each module at a service's top one of its own), the scheduler's `Sequence` is a plain
record of at most 16 fields that imports nothing of the scheduler, and only `scheduler_svc/kv/` touches a
block table."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hetero_infer.bench.harness import REPO_ROOT
from tests.helpers.file_tree import write_tree
from tests.helpers.import_graph import describe_cycle, find_cycles, import_graph
from tests.helpers.room_graph import room_graph

SERVICES = ("gateway", "scheduler_svc", "gpu_worker")
MAX_SEQUENCE_FIELDS = 16
# Where a block table lives: the KV manager's per-sequence record, its read-only copy (`kv_cache.table(seq)`),
# and the Sequence field it used to be.
TABLE_NAMES = {"block_table", "SequenceBlocks"}


def test_no_two_rooms_of_a_service_import_each_other() -> None:
    cycles = find_cycles(room_graph(REPO_ROOT, SERVICES))
    if cycles:
        pytest.fail("rooms that import each other:\n" + "\n".join(describe_cycle(c, REPO_ROOT) for c in cycles))


def test_the_sequence_is_a_plain_record() -> None:
    from scheduler_svc.sequence import Sequence

    fields = Sequence.__dataclass_fields__
    assert len(fields) <= MAX_SEQUENCE_FIELDS, f"Sequence has {len(fields)} fields: {sorted(fields)}"
    imported = [e.imported for e in import_graph(REPO_ROOT, ["scheduler_svc"])["scheduler_svc.sequence"]
                if e.imported != "scheduler_svc"]
    assert imported == [], f"scheduler_svc/sequence.py imports {imported}: feature state belongs to its room"


def test_only_the_kv_room_touches_a_block_table() -> None:
    outside = [path for path in sorted((REPO_ROOT / "scheduler_svc").rglob("*.py"))
               if "kv" not in path.relative_to(REPO_ROOT / "scheduler_svc").parts[:-1]]
    touching = [f"{path.relative_to(REPO_ROOT)}:{line}: {name}" for path in outside
                for line, name in table_touches(path)]
    assert not touching, "a block table read or written outside scheduler_svc/kv/:\n" + "\n".join(touching)


def table_touches(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every name of a block table in the module, and every `<kv...>.table`."""
    touches = []
    for node in ast.walk(ast.parse(path.read_text())):
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        if name in TABLE_NAMES or (isinstance(node, ast.Attribute) and name == "table"
                                   and "kv" in ast.unparse(node.value).lower()):
            touches.append((node.lineno, name))
    return touches


# --- the checks themselves, on a tiny tree made for each case ---


def test_a_cycle_between_two_rooms_is_found_through_any_of_their_modules(tmp_path: Path) -> None:
    root = write_tree(tmp_path, {
        "svc/__init__.py": "",
        "svc/top.py": "import svc.a.one\n",  # into a room: no cycle by itself
        "svc/a/__init__.py": "", "svc/a/one.py": "from svc.b import two\n", "svc/a/three.py": "",
        "svc/b/__init__.py": "", "svc/b/two.py": "", "svc/b/four.py": "from svc.a.three import x\n",
    })
    cycles = find_cycles(room_graph(root, ["svc"]))
    assert [describe_cycle(c, root) for c in cycles] == ["svc.a -> svc.b -> svc.a (svc/a/one.py:1, svc/b/four.py:1)"]


def test_a_table_attribute_is_found(tmp_path: Path) -> None:
    path = write_tree(tmp_path, {"m.py": "def f(seq, kv_cache, ngrams):\n"
                                         "    return seq.block_table, kv_cache.table(seq), ngrams.table\n"}) / "m.py"
    assert sorted(table_touches(path)) == [(2, "block_table"), (2, "table")]  # an n-gram table is no block table
