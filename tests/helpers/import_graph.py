"""The import graph of the project's own modules, read from their source with `ast` (nothing is
imported, so a module that needs CUDA or a missing extra is read like any other).

Every import statement counts, wherever it is: at the top, inside a function, or under
`if TYPE_CHECKING:` (a cycle through a type-only import is still a cycle in the design).
`from pkg import name` is an edge to the submodule `pkg.name` when that is a module, else to `pkg`;
an import of a submodule is an edge to each package above it too (`import a.b.c`: a, a.b and a.b.c),
whose `__init__.py` runs first.
Imports of anything outside the given packages (the standard library, torch, ...) are dropped.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Import:
    """One import statement's edge: `importer` imports `imported`, at `path`:`line`."""

    importer: str
    imported: str
    path: Path
    line: int

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root)}:{self.line}"


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py under each package (a package's
    `__init__.py` is the package itself)."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The most specific project module that `import name` loads (None: not the project's)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def _relative_base(module: str, is_package: bool, level: int) -> str:
    """The package that `from .(level dots) import ...` is relative to, inside `module`."""
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]  # a plain module's imports are relative to its package
    return ".".join(parts[: len(parts) - (level - 1)])


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement loads, before resolving them to project modules."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        prefix = _relative_base(module, is_package, node.level)
        base = f"{prefix}.{base}" if base and prefix else (base or prefix)
    # `from pkg import name` loads pkg.name when that is a submodule; the caller falls back to pkg.
    return [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"] or [base]


def _packages_above(module: str, modules: dict[str, Path]) -> list[str]:
    """The project packages that contain `module`, outermost first."""
    parts = module.split(".")
    return [name for end in range(1, len(parts)) if (name := ".".join(parts[:end])) in modules]


def imports_in(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """Every edge from `module` (its file `path`) to another project module: to the module an import
    statement loads, and to each package above that module, since loading a.b.c runs a/__init__.py and
    a/b/__init__.py first (`from kernels import native_decode` in a module that kernels/__init__.py
    imports is a cycle through that __init__)."""
    is_package = path.name == "__init__.py"
    edges: list[Import] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        targets: dict[str, None] = {}  # each once per statement, in order
        for name in _imported_names(node, module, is_package):
            target = _resolve(name, modules)
            if target is not None:
                targets.update(dict.fromkeys([target, *_packages_above(target, modules)]))
        edges += [Import(module, target, path, node.lineno) for target in targets if target != module]
    return edges


def import_graph(root: Path, packages: Sequence[str]) -> dict[str, list[Import]]:
    """Module -> its import edges, for every module of `packages` under `root`."""
    modules = module_files(root, packages)
    return {module: imports_in(module, path, modules) for module, path in modules.items()}


def find_cycles(graph: dict[str, list[Import]]) -> list[list[Import]]:
    """One cycle (as the chain of import edges that closes it) per strongly connected group of
    modules that import each other, found with Tarjan's algorithm."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(module: str) -> None:  # recursion depth is bounded by the number of modules
        index[module] = lowlink[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for edge in graph.get(module, []):
            if edge.imported not in index:
                visit(edge.imported)
                lowlink[module] = min(lowlink[module], lowlink[edge.imported])
            elif edge.imported in on_stack:
                lowlink[module] = min(lowlink[module], index[edge.imported])
        if lowlink[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return [_cycle_through(group, graph) for group in sorted(groups)]


def _cycle_through(group: list[str], graph: dict[str, list[Import]]) -> list[Import]:
    """The shortest chain of edges inside `group` from its first module back to itself."""
    members = set(group)
    start = group[0]
    came_by: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        next_frontier = []
        for module in frontier:
            for edge in graph.get(module, []):
                if edge.imported not in members:
                    continue
                if edge.imported == start:
                    chain = [edge]
                    while chain[0].importer != start:
                        chain.insert(0, came_by[chain[0].importer])
                    return chain
                if edge.imported not in came_by:
                    came_by[edge.imported] = edge
                    next_frontier.append(edge.imported)
        frontier = next_frontier
    raise AssertionError(f"no cycle through {group}")  # a strongly connected group always has one


def describe_cycle(cycle: list[Import], root: Path) -> str:
    """`a -> b -> a (a.py:3, b.py:7)`."""
    names = " -> ".join([cycle[0].importer, *(edge.imported for edge in cycle)])
    return f"{names} ({', '.join(edge.where(root) for edge in cycle)})"


def package_of(module: str) -> str:
    return module.split(".", 1)[0]


def imports_across_layers(graph: dict[str, list[Import]], layers: Sequence[Sequence[str]]) -> list[Import]:
    """Edges from a module to a package of a higher layer (`layers` lists packages bottom to top)."""
    layer_of = {package: level for level, packages in enumerate(layers) for package in packages}
    return [edge for edges in graph.values() for edge in edges
            if layer_of[package_of(edge.imported)] > layer_of[package_of(edge.importer)]]


def crowded_folders(root: Path, packages: Iterable[str], max_modules: int) -> list[tuple[Path, int]]:
    """(folder, count) of every folder under the packages holding more than `max_modules` modules of its own
    (`__init__.py` and sub-folders' modules not counted)."""
    crowded = []
    for package in packages:
        for folder in sorted({p.parent for p in (root / package).rglob("*.py")}):
            count = sum(1 for p in folder.glob("*.py") if p.name != "__init__.py")
            if count > max_modules:
                crowded.append((folder, count))
    return crowded


def long_modules(root: Path, packages: Iterable[str], max_lines: int) -> list[tuple[Path, int]]:
    """Source files over `max_lines` lines, generated protobuf modules (`*_pb2*`) excepted."""
    found = []
    for path in module_files(root, packages).values():
        if "_pb2" in path.name:
            continue
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > max_lines:
            found.append((path, lines))
    return found


def long_functions(root: Path, packages: Iterable[str], max_lines: int) -> list[tuple[Path, int, str, int]]:
    """(file, line, name, lines) of every function over `max_lines` lines (`end_lineno - lineno + 1`): plain
    and async, methods and nested functions too, each counted whole (a nested one also inside its outer's)."""
    found = []
    for path in module_files(root, packages).values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > max_lines:
                    found.append((path, node.lineno, node.name, lines))
    return sorted(found)


def external_imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(top-level name, line) of every absolute import in `path` that is not one of `modules`'
    packages: the standard library's and third parties', wherever the statement is (a function's
    import runs too, when that function does)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        else:
            continue
        found += [(name.split(".")[0], node.lineno) for name in names if _resolve(name, modules) is None]
    return found


def reachable_modules(entry_points: Iterable[str], modules: dict[str, Path]) -> list[str]:
    """Every project module that importing `entry_points` (module names) can load, them included,
    following every import statement (those inside functions too)."""
    seen: list[str] = []
    pending = list(entry_points)
    while pending:
        module = pending.pop()
        if module in seen:
            continue
        seen.append(module)
        pending += _packages_above(module, modules)  # importing a.b.c runs a/__init__.py and a/b/__init__.py first
        pending += [edge.imported for edge in imports_in(module, modules[module], modules)]
    return sorted(seen)
