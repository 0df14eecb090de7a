"""The Scheduler's state is changed only by the Scheduler: checked on the source with `ast`.

The attributes class `Scheduler` sets on `self`, and its properties, are its state. Anywhere else in
the project, an expression `x.<one of them>` with `x` not the `self` of a method is someone else's
hand in it, and these are flagged: rebinding (`=`, `+=`, annotated, `del`, `setattr`/`delattr` with
a literal name), item assignment or deletion (`x.sequences[k] = v`), a mutating call on it or on one
of its items (`x.running.remove(q)`, `x.samples[k].append(q)`), and any use at all of one of its
private members (`x._in_flight`, `x._end(...)`). A collaborator keeps its own state on its own
`self`, which is its business, not the Scheduler's. Also flagged: a base class of `Scheduler` (a
mixin is the class spread over files again) and a `Protocol` in scheduler_svc that declares a
private member (a list of what another class keeps to itself).

The checks are run against small sources of each pattern too, so that they are known to fire.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from hetero_infer.bench.harness import REPO_ROOT
from tests.helpers.import_graph import module_files

PACKAGES = ("hetero", "hetero_common", "gateway", "scheduler_svc", "gpu_worker", "kernels", "hetero_infer")
SCHEDULER_FILE = REPO_ROOT / "scheduler_svc" / "core" / "scheduler.py"
# Methods that change the list, deque, dict, set or queue they are called on.
MUTATORS = frozenset({"append", "appendleft", "extend", "extendleft", "insert", "remove", "pop", "popleft",
                      "popitem", "clear", "update", "setdefault", "add", "discard", "sort", "reverse", "rotate"})
# Receivers, by module and variable name, that share a field name with the Scheduler but are something else.
NOT_A_SCHEDULER = {("scheduler_svc/core/stats.py", "total"): "merge_pools' PoolStats message (block_size, suspended)"}


def scheduler_class(tree: ast.Module) -> ast.ClassDef:
    return next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Scheduler")


def _targets(node: ast.AST) -> Iterator[ast.expr]:
    """The expressions an assignment, augmented or annotated assignment, `del` or `for` binds."""
    if isinstance(node, ast.Assign):
        roots = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor)):
        roots = [node.target]
    elif isinstance(node, ast.Delete):
        roots = node.targets
    elif isinstance(node, (ast.With, ast.AsyncWith)):
        roots = [item.optional_vars for item in node.items if item.optional_vars is not None]
    else:
        return
    stack = list(roots)
    while stack:
        target = stack.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            stack.extend(target.elts)
        elif isinstance(target, ast.Starred):
            stack.append(target.value)
        else:
            yield target


def scheduler_state(tree: ast.Module) -> tuple[set[str], set[str]]:
    """The attribute names class `Scheduler` assigns on `self` and its properties (read-only views of what
    a collaborator keeps for it), and its private members (those of them and of its methods whose names
    start with one underscore)."""
    cls = scheduler_class(tree)
    attributes = {t.attr for node in ast.walk(cls) for t in _targets(node)
                  if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    methods = {node.name for node in cls.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    attributes |= {node.name for node in cls.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                   and any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)}
    private = {name for name in attributes | methods if name.startswith("_") and not name.startswith("__")}
    return attributes, private


class _Visitor(ast.NodeVisitor):
    """Walks one module, knowing for each node whether `self` there is a method's own instance."""

    def __init__(self, where: str, attributes: set[str], private: set[str]) -> None:
        self.where, self.attributes, self.private = where, attributes, private
        self.scopes: list[str] = []  # "class", "method" (a function defined in a class body) or "function"
        self.found: list[str] = []

    def _own(self, expr: ast.expr) -> bool:
        """`self` directly inside a method: the state of the method's own class."""
        return isinstance(expr, ast.Name) and expr.id == "self" and bool(self.scopes) and self.scopes[-1] == "method"

    def _flag(self, node: ast.AST, what: str) -> None:
        self.found.append(f"{self.where}:{node.lineno}: {what}: {ast.unparse(node)[:100]}")

    def _state(self, expr: ast.expr) -> bool:
        """`x.<a Scheduler attribute>` with `x` not a method's own `self` (nor a receiver known to be no Scheduler)."""
        if not isinstance(expr, ast.Attribute) or expr.attr not in self.attributes or self._own(expr.value):
            return False
        return not (isinstance(expr.value, ast.Name) and (self.where, expr.value.id) in NOT_A_SCHEDULER)

    def _scoped(self, node: ast.AST, scope: str) -> None:
        self.scopes.append(scope)
        self.generic_visit(node)
        self.scopes.pop()

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._scoped(node, "class")

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._scoped(node, "method" if self.scopes and self.scopes[-1] == "class" else "function")

    visit_FunctionDef = visit_AsyncFunctionDef = _visit_function

    def generic_visit(self, node: ast.AST) -> None:
        for target in _targets(node):
            if self._state(target):
                self._flag(node, "rebinds a Scheduler attribute")
            elif isinstance(target, ast.Subscript) and self._state(target.value):
                self._flag(node, "changes an item of a Scheduler attribute")
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in MUTATORS:
                if self._state(func.value):
                    self._flag(node, "mutates a Scheduler attribute")
                elif isinstance(func.value, ast.Subscript) and self._state(func.value.value):
                    self._flag(node, "changes an item of a Scheduler attribute")
            if (isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in self.attributes
                    and not self._own(node.args[0])):
                self._flag(node, f"{func.id} on a Scheduler attribute")
        if isinstance(node, ast.Attribute) and node.attr in self.private and not self._own(node.value):
            self._flag(node, "uses a private member of the Scheduler")
        super().generic_visit(node)


def foreign_changes(tree: ast.Module, where: str, attributes: set[str], private: set[str],
                    scheduler: ast.ClassDef | None = None) -> list[str]:
    """Where `tree` changes Scheduler state from outside class `Scheduler` (`scheduler`: that class's
    node when `tree` is its module; its own methods' `self` is the Scheduler)."""
    visitor = _Visitor(where, attributes, private)
    for node in tree.body:
        if node is not scheduler:
            visitor.visit(node)
    if scheduler is not None:  # its nested functions and classes are held to the rule; its own `self` is not
        visitor.scopes.append("class")
        for node in scheduler.body:
            visitor.visit(node)
    return visitor.found


def private_protocol_members(tree: ast.Module, where: str) -> list[str]:
    """`Protocol` classes that declare a private member (an annotated name or a method)."""
    found = []
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        if not any(ast.unparse(base).split(".")[-1].split("[")[0] == "Protocol" for base in cls.bases):
            continue
        for node in cls.body:
            name = (node.target.id if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    else node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else "")
            if name.startswith("_") and not name.startswith("__"):
                found.append(f"{where}:{node.lineno}: Protocol {cls.name} declares {name}")
    return found


def project_modules() -> dict[str, Path]:
    return module_files(REPO_ROOT, PACKAGES)


# --- the project


def test_the_scheduler_state_is_read_from_its_source() -> None:
    attributes, private = scheduler_state(ast.parse(SCHEDULER_FILE.read_text()))
    assert {"running", "waiting", "swapped", "step_id", "kv_cache"} <= attributes  # the walker sees `self.x = ...`
    assert {"requests", "samples", "sequences"} <= attributes  # and the properties
    assert private, "the Scheduler keeps nothing to itself?"


def test_no_module_changes_scheduler_state_from_outside() -> None:
    attributes, private = scheduler_state(ast.parse(SCHEDULER_FILE.read_text()))
    found = []
    for name, path in project_modules().items():
        tree = ast.parse(path.read_text())
        where = str(path.relative_to(REPO_ROOT))
        scheduler = scheduler_class(tree) if path == SCHEDULER_FILE else None
        found += foreign_changes(tree, where, attributes, private, scheduler)
    assert not found, "Scheduler state changed outside the Scheduler:\n" + "\n".join(found)


def test_scheduler_has_no_base_class() -> None:
    cls = scheduler_class(ast.parse(SCHEDULER_FILE.read_text()))
    assert not cls.bases, f"Scheduler inherits from {[ast.unparse(b) for b in cls.bases]}: its code belongs in it"


def test_no_protocol_in_scheduler_svc_lists_private_members() -> None:
    found = []
    for name, path in project_modules().items():
        if name.startswith("scheduler_svc."):
            found += private_protocol_members(ast.parse(path.read_text()), str(path.relative_to(REPO_ROOT)))
    assert not found, "\n".join(found)


# --- the checks fire on each pattern

SCHEDULER_SOURCE = """
class Scheduler:
    def __init__(self):
        self.running = []
        self.sequences = {}
        self._in_flight = []
        self.step_id = 0
        self.helper = Helper(self)

    @property
    def samples(self):
        return self.helper.samples

    def _end(self, seq):
        self.running.remove(seq)
        self.sequences[seq.seq_id] = seq
        self._in_flight = []

    def nested(self):
        def inner(s):
            s.running = []
        return inner
"""


def _found(source: str) -> list[str]:
    attributes, private = scheduler_state(ast.parse(SCHEDULER_SOURCE))
    return foreign_changes(ast.parse(source), "m.py", attributes, private)


def test_the_state_is_the_self_attributes_and_private_methods() -> None:
    attributes, private = scheduler_state(ast.parse(SCHEDULER_SOURCE))
    assert attributes == {"running", "sequences", "_in_flight", "step_id", "helper", "samples"}
    assert private == {"_in_flight", "_end"}


def test_the_scheduler_itself_passes_but_not_a_function_nested_in_it() -> None:
    tree = ast.parse(SCHEDULER_SOURCE)
    attributes, private = scheduler_state(tree)
    found = foreign_changes(tree, "m.py", attributes, private, scheduler_class(tree))
    assert [f.split(": ")[1] for f in found] == ["rebinds a Scheduler attribute"]


def test_each_foreign_change_is_flagged() -> None:
    cases = {
        "def f(s):\n    s._in_flight = []\n": {"rebinds a Scheduler attribute", "uses a private member of the Scheduler"},
        "def f(s):\n    s.step_id += 1\n": {"rebinds a Scheduler attribute"},
        "def f(s):\n    s.step_id: int = 1\n": {"rebinds a Scheduler attribute"},
        "def f(s):\n    del s.running\n": {"rebinds a Scheduler attribute"},
        "def f(s):\n    a, (s.step_id, b) = 1, (2, 3)\n": {"rebinds a Scheduler attribute"},
        "def f(s):\n    setattr(s, 'running', [])\n": {"setattr on a Scheduler attribute"},
        "def f(s, c):\n    s.sequences[c.seq_id] = c\n": {"changes an item of a Scheduler attribute"},
        "def f(s, c):\n    del s.sequences[c.seq_id]\n": {"changes an item of a Scheduler attribute"},
        "def f(s, c):\n    s.running.append(c)\n": {"mutates a Scheduler attribute"},
        "def f(s, c):\n    s.samples[c.request_id].append(c)\n": {"changes an item of a Scheduler attribute"},
        "def f(s, c):\n    s.samples.pop(c.request_id)\n": {"mutates a Scheduler attribute"},
        "def f(s, c):\n    s._end(c)\n": {"uses a private member of the Scheduler"},
        "def f(self):\n    self.running = []\n": {"rebinds a Scheduler attribute"},  # a function, not a method
        "class H:\n    def f(self, s):\n        s.running.remove(1)\n": {"mutates a Scheduler attribute"},
        "class H:\n    def f(self):\n        self.scheduler.step_id = 2\n": {"rebinds a Scheduler attribute"},
        "class H:\n    def f(self):\n        def g():\n            self.step_id = 2\n        g()\n":
            {"rebinds a Scheduler attribute"},
    }
    for source, expected in cases.items():
        assert {f.split(": ")[1] for f in _found(source)} == expected, source


def test_a_collaborator_keeping_its_own_state_passes() -> None:
    source = ("class Collaborator:\n    def __init__(self):\n        self.running = []\n        self._in_flight = []\n"
              "    def add(self, seq):\n        self.running.append(seq)\n        self._in_flight.clear()\n"
              "def read(s):\n    return len(s.running), s.step_id\n")
    assert _found(source) == []


def test_a_protocol_listing_private_members_is_flagged() -> None:
    source = ("from typing import Protocol\nimport typing\n"
              "class A(Protocol):\n    running: list\n    _swap_out: list\n    def _end(self) -> None: ...\n"
              "class B(typing.Protocol):\n    _x: int\n    def __len__(self) -> int: ...\n"
              "class C(Protocol):\n    running: list\n    def abort(self) -> None: ...\n")
    assert [f.split(": ", 1)[1] for f in private_protocol_members(ast.parse(source), "m.py")] == [
        "Protocol A declares _swap_out", "Protocol A declares _end", "Protocol B declares _x"]
