"""The layering the design asks for, checked on the source: no two modules import each other
(directly or round a longer loop, a package's __init__ included), nothing imports upward (the base
and the services never import the product; no package of the product imports the tests), no folder
of a service holds more than 15 modules, and no function of the scheduler, the worker or the gateway
is over 60 lines. A module over 400 lines is a warning, not a failure (over 800 it is one): one concept per
module is the rule, and a long module of one concept beats several fragments of it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import warnings

import pytest

from tests.helpers.import_graph import (Import, crowded_folders, describe_cycle, find_cycles, import_graph,
                                        imports_across_layers, long_functions, long_modules, package_of)
from hetero_infer.bench.harness import REPO_ROOT
from tests.helpers.file_tree import write_tree

# Bottom to top: the generated stubs and the shared base, the services, the product.
LAYERS = (("hetero", "hetero_common"), ("gateway", "scheduler_svc", "gpu_worker", "kernels"), ("hetero_infer",))
PACKAGES = tuple(package for layer in LAYERS for package in layer)
MAX_MODULE_LINES = 400  # a warning past it
HARD_MAX_MODULE_LINES = 800
SERVICES = ("gateway", "scheduler_svc", "gpu_worker")
MAX_FOLDER_MODULES = 15
# The services whose step logic reads as a few named steps; a longer function is split into them.
SHORT_FUNCTION_PACKAGES = ("scheduler_svc", "gpu_worker", "gateway")
MAX_FUNCTION_LINES = 60


def test_no_import_cycles() -> None:
    cycles = find_cycles(import_graph(REPO_ROOT, PACKAGES))
    if cycles:
        pytest.fail("modules that import each other:\n" + "\n".join(describe_cycle(c, REPO_ROOT) for c in cycles))


def test_nothing_imports_a_higher_layer() -> None:
    upward = imports_across_layers(import_graph(REPO_ROOT, PACKAGES), LAYERS)
    if upward:
        pytest.fail("imports of a higher layer:\n" + "\n".join(
            f"{edge.where(REPO_ROOT)}: {edge.importer} imports {edge.imported}" for edge in upward))


def imports_of_the_tests(root: Path, packages: Sequence[str]) -> list[Import]:
    """Edges from a module of `packages` into `tests` (the graph keeps only edges inside the packages it reads,
    so it reads `tests` too)."""
    graph = import_graph(root, (*packages, "tests"))
    return [edge for module, edges in graph.items() if package_of(module) != "tests"
            for edge in edges if package_of(edge.imported) == "tests"]


def test_no_product_package_imports_the_tests() -> None:
    found = imports_of_the_tests(REPO_ROOT, PACKAGES)
    if found:
        pytest.fail("product modules importing the tests (shared helpers go in hetero_infer/bench/harness.py):\n"
                    + "\n".join(f"{edge.where(REPO_ROOT)}: {edge.importer} imports {edge.imported}" for edge in found))


def test_a_module_over_400_lines_is_a_warning_and_over_800_a_failure() -> None:
    for path, lines in long_modules(REPO_ROOT, PACKAGES, MAX_MODULE_LINES):
        warnings.warn(f"{path.relative_to(REPO_ROOT)} has {lines} lines: still one concept?", stacklevel=1)
    huge = long_modules(REPO_ROOT, PACKAGES, HARD_MAX_MODULE_LINES)
    if huge:
        pytest.fail(f"modules over {HARD_MAX_MODULE_LINES} lines (surely more than one concept):\n" + "\n".join(
            f"{path.relative_to(REPO_ROOT)}: {lines}" for path, lines in huge))


def test_no_service_folder_holds_more_than_15_modules() -> None:
    crowded = crowded_folders(REPO_ROOT, SERVICES, MAX_FOLDER_MODULES)
    if crowded:
        pytest.fail(f"folders of more than {MAX_FOLDER_MODULES} modules (group them by concept):\n" + "\n".join(
            f"{folder.relative_to(REPO_ROOT)}/: {count}" for folder, count in crowded))


def test_no_function_over_60_lines_in_the_scheduler_the_worker_and_the_gateway() -> None:
    long = long_functions(REPO_ROOT, SHORT_FUNCTION_PACKAGES, MAX_FUNCTION_LINES)
    if long:
        pytest.fail(f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(
            f"{path.relative_to(REPO_ROOT)}:{line} {name}: {lines}" for path, line, name, lines in long))


# --- the walker itself, on a tiny tree made for each case ---


def test_walker_finds_a_cycle_through_function_type_checking_and_relative_imports(tmp_path: Path) -> None:
    root = write_tree(tmp_path, {
        "low/__init__.py": "",
        "low/a.py": "def f():\n    from low import b\n",  # `from pkg import module` inside a function
        "low/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import Thing\n",
        "low/c.py": "import os\n\nimport low.a\n",
        "low/d.py": "from low.a import f\n",  # imports into the cycle, is not part of it
    })
    cycles = find_cycles(import_graph(root, ["low"]))
    assert [describe_cycle(c, root) for c in cycles] == [
        "low.a -> low.b -> low.c -> low.a (low/a.py:2, low/b.py:3, low/c.py:3)"]


def test_walker_adds_the_packages_an_import_runs(tmp_path: Path) -> None:
    root = write_tree(tmp_path, {
        "a/__init__.py": "",
        "a/b/__init__.py": "",
        "a/b/c.py": "",
        "a/b/d.py": "from a.b import c\n",  # its own packages too (they ran before it; no edge to itself)
        "app/__init__.py": "",
        "app/user.py": "import a.b.c\n",
        "app/other.py": "from a.b.c import thing\n",
    })
    graph = import_graph(root, ["a", "app"])
    assert [e.imported for e in graph["app.user"]] == ["a.b.c", "a", "a.b"]
    assert [e.imported for e in graph["app.other"]] == ["a.b.c", "a", "a.b"]
    assert [e.imported for e in graph["a.b.d"]] == ["a.b.c", "a", "a.b"]


def test_walker_finds_a_cycle_through_a_package_init(tmp_path: Path) -> None:
    root = write_tree(tmp_path, {  # kernels/__init__ -> torch_attention -> `from kernels import native_decode`
        "pkg/__init__.py": "from pkg.user import run\n",
        "pkg/user.py": "from pkg import helper\n",
        "pkg/helper.py": "X = 1\n",
    })
    cycles = find_cycles(import_graph(root, ["pkg"]))
    assert [describe_cycle(c, root) for c in cycles] == ["pkg -> pkg.user -> pkg (pkg/__init__.py:1, pkg/user.py:1)"]


def test_walker_reports_an_upward_import_with_its_line(tmp_path: Path) -> None:
    root = write_tree(tmp_path, {
        "base/__init__.py": "",
        "base/util.py": "X = 1\n",
        "svc/__init__.py": "",
        "svc/run.py": "from base.util import X\n\n\ndef late():\n    from product import cli\n",
        "product/__init__.py": "",
        "product/cli.py": "from svc import run\n",
    })
    upward = imports_across_layers(import_graph(root, ["base", "svc", "product"]), [["base"], ["svc"], ["product"]])
    assert [(e.where(root), e.imported) for e in upward] == [("svc/run.py:5", "product.cli"), ("svc/run.py:5", "product")]
    assert find_cycles(import_graph(root, ["base", "svc", "product"])) != []  # svc.run <-> product.cli


def test_walker_finds_a_product_module_importing_the_tests(tmp_path: Path) -> None:
    root = write_tree(tmp_path, {
        "product/__init__.py": "",
        "product/cli.py": "import os\n",
        "product/bench.py": "def late():\n    from tests.helpers.stack import run_stack\n",  # planted
        "tests/__init__.py": "",
        "tests/helpers/__init__.py": "",
        "tests/helpers/stack.py": "from product import cli\n",  # the tests importing the product is fine
        "tests/test_cli.py": "from tests.helpers.stack import run_stack\n",
    })
    assert [(e.where(root), e.imported) for e in imports_of_the_tests(root, ["product"])] == [
        ("product/bench.py:2", "tests.helpers.stack"), ("product/bench.py:2", "tests"),
        ("product/bench.py:2", "tests.helpers")]
    assert import_graph(root, ["product"])["product.bench"] == []  # why `tests` must be read too


def test_walker_counts_lines_and_skips_generated_stubs(tmp_path: Path) -> None:
    root = write_tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/short.py": "x = 1\n" * 400,
        "pkg/long.py": "x = 1\n" * 401,
        "pkg/thing_pb2.py": "x = 1\n" * 1000,
        "pkg/thing_pb2_grpc.py": "x = 1\n" * 1000,
    })
    assert long_modules(root, ["pkg"], 400) == [(root / "pkg/long.py", 401)]


def test_walker_counts_each_folders_own_modules(tmp_path: Path) -> None:
    files = {"svc/__init__.py": "", "svc/top.py": "", "svc/room/__init__.py": "", "svc/room/deep/__init__.py": ""}
    files |= {f"svc/room/m{i}.py": "" for i in range(16)} | {f"svc/room/deep/d{i}.py": "" for i in range(15)}
    root = write_tree(tmp_path, files)
    assert crowded_folders(root, ["svc"], 15) == [(root / "svc/room", 16)]  # __init__ and sub-folders not counted


def test_walker_measures_every_function_whole(tmp_path: Path) -> None:
    line, nested_line = "    x = 1\n", "        x = 1\n"
    root = write_tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/mod.py": ("def short():\n" + line * 59  # 60 lines: the limit
                       + "async def long():\n" + line * 60  # 61
                       + "class C:\n    def method(self):\n" + nested_line * 60  # 61
                       + "def outer():\n    def inner():\n" + nested_line * 60 + "    return inner\n"),  # 63, 61
    })
    assert [(at, name, lines) for _, at, name, lines in long_functions(root, ["pkg"], 60)] == [
        (61, "long", 61), (123, "method", 61), (184, "outer", 63), (185, "inner", 61)]
