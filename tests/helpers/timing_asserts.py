"""Assertions that compare a measured time or memory reading with a constant, found with `ast`.

Such an assertion fails by turns on a shared, loaded machine: the same code takes 0.3 s or 0.6 s,
and the heap holds 40 MiB or 60 MiB more, depending on what else runs. Tests assert the mechanism
instead (what ran on which thread, what was called, what was freed); a hang is caught by a
deadline or a timeout on the blocking call, not by an assertion on the time taken.

What counts as measured (`Scope.measured`): a call of `perf_counter`, `monotonic`, `time`,
`process_time` and the like; a name or attribute that reads memory (`rss`, `memory_info`,
`resident`, `maxrss`) or names a measurement (`elapsed`, `seconds`, `latency`, `lag`, `stall`);
a name assigned from a measured value in the same function (nested functions included, since they
fill their parent's lists), arithmetic on one, or its element; and the result of a function,
defined in the scanned files, that returns one (element by element when it returns a tuple).
A call of any other function on a measured value is measured too (`p99(gaps)`), but for the few
that say something else of it (`len`, `isinstance`, ...).

A threshold is a constant (a number, an UPPER_CASE or module-level numeric name, or arithmetic on
these) or a constant times a measured value (`2 * p99(baseline)`). A comparison of a measured value
with another one as it is (`now < deadline`) is not: it is how a deadline reads; nor is one with a
parameter (a polling helper's `timeout_s`, which its callers give as a hang guard). An assertion holds
a threshold when one of its comparisons (with <, <=, > or >=) sets a measured value against one, or
when it tests what a comprehension filtered by such a comparison kept (`slow = [s for s in seconds
if s >= 1.0]; assert not slow`).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

CLOCK_CALLS = frozenset({"perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time", "time_ns",
                         "process_time", "process_time_ns", "thread_time", "thread_time_ns", "getrusage"})
# Snake-case parts of a name that reads memory or names a measurement (`loop_lag_s`, `rss_mib`, `latencies`).
MEASURED_PARTS = frozenset({"rss", "maxrss", "resident", "elapsed", "seconds", "latency", "latencies", "lag", "lags",
                            "stall", "stalls", "gap", "gaps", "duration", "durations"})
MEASURED_SUBSTRINGS = ("rss", "memory_info")
# Calls whose result says something other than the measured value given them.
OPAQUE_CALLS = frozenset({"len", "isinstance", "issubclass", "str", "repr", "bool", "type", "id", "hash", "print",
                          "format", "enumerate", "zip", "range", "any", "all", "callable", "hasattr", "getattr", "set",
                          "dict", "iter", "next", "count", "index", "keys", "items", "startswith", "endswith", "split",
                          "join", "encode", "decode", "is_set", "is_alive", "wait", "put", "append"})
MUTATORS = frozenset({"append", "extend", "add", "insert", "appendleft", "put", "put_nowait", "update", "setdefault"})
ORDERINGS = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)
CONSTANT_NAME = re.compile(r"^_?[A-Z][A-Z0-9_]*$")

# What a function returns: measured or not, or one flag per element of the tuple it returns.
Returns = bool | tuple[bool, ...]


@dataclass(frozen=True)
class Finding:
    path: Path
    line: int
    source: str

    def describe(self, root: Path) -> str:
        return f"{self.path.relative_to(root)}:{self.line}: assert {self.source}"


def _any(returned: Returns) -> bool:
    return any(returned) if isinstance(returned, tuple) else returned


def _identifier(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _names_a_measurement(identifier: str) -> bool:
    lowered = identifier.lower()
    return (any(s in lowered for s in MEASURED_SUBSTRINGS)
            or any(part in MEASURED_PARTS for part in lowered.split("_")))


def _own_nodes(function: ast.AST) -> Iterator[ast.AST]:
    """The nodes of `function`'s body, not those of functions nested in it (their returns are theirs)."""
    stack = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


class Scope:
    """One top-level function (or method, or the module's own statements) with the functions
    nested in it: the names in it that hold a measured value."""

    def __init__(self, body: ast.AST, functions: dict[str, Returns], constants: set[str]) -> None:
        self.body, self.functions, self.constants = body, dict(functions), set(constants)
        self.nodes = list(ast.walk(body))
        self.tainted: set[str] = set()
        self.filtered: set[str] = set()  # names of what a comprehension filtered by a threshold kept
        self.measures = mentions_a_measure(self.nodes, functions)
        if not self.measures:  # nothing here can be measured: nothing to follow
            return
        self.constants |= self._local_constants()
        for node in self.nodes:  # nested functions: callable by name here, in place of a helper's namesake
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node is not body:
                self.functions[node.name] = False
        self._settle()

    def _local_constants(self) -> set[str]:
        """Names every assignment of which, in this scope, is a constant (`num_blocks = 32768`)."""
        values: dict[str, list[ast.AST]] = {}
        for node in self.nodes:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.comprehension, ast.NamedExpr)) else []
            value = getattr(node, "value", None) if not isinstance(node, (ast.For, ast.comprehension)) else None
            for target in targets:
                pairs = (zip(target.elts, value.elts) if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple)
                         and len(target.elts) == len(value.elts) else [(target, value)])
                for name, assigned in pairs:
                    if isinstance(name, ast.Name):
                        values.setdefault(name.id, []).append(assigned)
        return {name for name, assigned in values.items()
                if all(v is not None and self.constant(v) for v in assigned)}

    def _settle(self) -> None:
        """Propagate measured values through assignments until nothing changes."""
        while True:
            before = (len(self.tainted), tuple(sorted(self.functions.items())))
            for node in self.nodes:
                self._assignment(node)
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node is not self.body:
                    self.functions[node.name] = self.returns(node) or self.functions[node.name]
            if (len(self.tainted), tuple(sorted(self.functions.items()))) == before:
                return

    def _assignment(self, node: ast.AST) -> None:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                self._bind(target, node.value)
                if self._filters_by_a_threshold(node.value) and (name := _identifier(target)):
                    self.filtered.add(name)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None:
            self._bind(node.target, node.value)
        elif isinstance(node, ast.NamedExpr):
            self._bind(node.target, node.value)
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            self._bind(node.target, node.iter)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
              and any(self.measured(arg) for arg in [*node.args, *(k.value for k in node.keywords)])):
            self._bind(node.func.value, None, measured=True)  # `seconds.append(elapsed)`: seconds holds times

    def _bind(self, target: ast.AST, value: ast.AST | None, measured: bool | None = None) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            flags = self._elements(value, len(target.elts)) if value is not None else None
            for i, element in enumerate(target.elts):
                self._bind(element, None, measured=flags[i] if flags else bool(measured))
            return
        if isinstance(target, ast.Starred):
            return self._bind(target.value, value, measured)
        if isinstance(target, ast.Subscript):  # `lags[key] = measured`: the container holds it
            return self._bind(target.value, value, measured)
        name = _identifier(target)
        if name and (measured if measured is not None else value is not None and self.measured(value)):
            self.tainted.add(name)

    def _elements(self, value: ast.AST, count: int) -> tuple[bool, ...]:
        """Per element of a tuple assignment: `a, b = x, time.monotonic()` or `a, b = f()`."""
        if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == count:
            return tuple(self.measured(e) for e in value.elts)
        returned = self._call_returns(value)
        if isinstance(returned, tuple) and len(returned) == count:
            return returned
        return (self.measured(value),) * count

    def _call_returns(self, node: ast.AST) -> Returns:
        """What a call returns: a scanned function's returns, through asyncio.run/await/wait_for."""
        if isinstance(node, ast.Await):
            return self._call_returns(node.value)
        if not isinstance(node, ast.Call):
            return False
        name = _identifier(node.func)
        if name in self.functions:
            return self.functions[name]
        if name in ("run", "wait_for") and node.args:
            return self._call_returns(node.args[0])
        return False

    def returns(self, function: ast.FunctionDef | ast.AsyncFunctionDef) -> Returns:
        if not self.measures:
            return False
        flags: Returns = False
        for node in _own_nodes(function):
            if isinstance(node, ast.Return) and node.value is not None:
                if isinstance(node.value, ast.Tuple):
                    flags = tuple(self.measured(e) for e in node.value.elts)
                else:
                    flags = flags if isinstance(flags, tuple) else self.measured(node.value)
        return flags

    def measured(self, node: ast.AST) -> bool:
        """Whether `node` evaluates to a measured time or memory reading (or holds some)."""
        if isinstance(node, ast.Call):
            return self._measured_call(node)
        name = _identifier(node)
        if name is not None and (name in self.tainted or _names_a_measurement(name)):
            return True
        if isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred, ast.Await, ast.NamedExpr)):
            return self.measured(node.value)
        if isinstance(node, ast.BinOp):
            return self.measured(node.left) or self.measured(node.right)
        if isinstance(node, ast.UnaryOp):
            return self.measured(node.operand)
        if isinstance(node, ast.BoolOp):  # `resident_bytes() or 0`
            return any(self.measured(v) for v in node.values)
        if isinstance(node, ast.IfExp):
            return self.measured(node.body) or self.measured(node.orelse)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(self.measured(e) for e in node.elts)
        if isinstance(node, ast.Dict):
            return any(self.measured(v) for v in node.values)
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
            return self.measured(node.elt) or any(self.measured(g.iter) for g in node.generators)
        if isinstance(node, ast.DictComp):
            return self.measured(node.value)
        return False

    def _measured_call(self, node: ast.Call) -> bool:
        name = _identifier(node.func)
        if name in CLOCK_CALLS or (name is not None and _names_a_measurement(name)):
            return True
        if _any(self._call_returns(node)):
            return True
        if name in OPAQUE_CALLS or name in self.functions:  # or a function nested here that returns no measure
            return False
        # `max(latencies)`, `p99(gaps)`, and a method of a measured value (`elapsed.total_seconds()`).
        return (any(self.measured(arg) for arg in node.args)
                or isinstance(node.func, ast.Attribute) and self.measured(node.func.value))

    def constant(self, node: ast.AST) -> bool:
        """A number, a constant's name, or arithmetic on these."""
        if isinstance(node, ast.Constant):
            return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
        name = _identifier(node)
        if name is not None:
            return name in self.constants or bool(CONSTANT_NAME.match(name))
        if isinstance(node, ast.BinOp):
            return self.constant(node.left) and self.constant(node.right)
        if isinstance(node, ast.UnaryOp):
            return self.constant(node.operand)
        return False

    def bound(self, node: ast.AST) -> bool:
        """A constant, or a constant times (or over) a measured value: `2 * p99(baseline)`."""
        if self.constant(node):
            return True
        return (isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div, ast.FloorDiv))
                and (self.constant(node.left) and self.measured(node.right)
                     or self.measured(node.left) and self.constant(node.right)))

    def thresholds(self) -> Iterator[ast.Assert]:
        """The assertions of this scope (nested functions' included) that hold a threshold."""
        for node in self.nodes if self.measures else ():
            if isinstance(node, ast.Assert) and (
                    any(self._threshold(c) for c in ast.walk(node.test) if isinstance(c, ast.Compare))
                    or any(_identifier(n) in self.filtered for n in ast.walk(node.test) if isinstance(n, ast.Name))):
                yield node

    def _threshold(self, compare: ast.Compare) -> bool:
        sides = [compare.left, *compare.comparators]
        return any(isinstance(op, ORDERINGS)
                   and (self.measured(a) and self.bound(b) or self.bound(a) and self.measured(b))
                   for op, a, b in zip(compare.ops, sides, sides[1:]))

    def _filters_by_a_threshold(self, node: ast.AST) -> bool:
        if not isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            return False
        return any(self._threshold(c) for g in node.generators for test in g.ifs for c in ast.walk(test)
                   if isinstance(c, ast.Compare))


def module_constants(tree: ast.Module) -> set[str]:
    """Module-level names bound to a number or arithmetic on numbers (`MIB = 2**20`)."""
    names: set[str] = set()
    probe = Scope(ast.Module(body=[], type_ignores=[]), {}, names)
    for node in tree.body:
        if isinstance(node, ast.Assign) and probe.constant(node.value):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _scopes(tree: ast.Module) -> Iterator[ast.AST]:
    """Each top-level function and method, and the module's other statements as one scope."""
    rest: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        elif isinstance(node, ast.ClassDef):
            yield from (n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
        else:
            rest.append(node)
    yield ast.Module(body=rest, type_ignores=[])


def mentions_a_measure(nodes: Iterable[ast.AST], functions: dict[str, Returns]) -> bool:
    """Whether any of `nodes` is a source of a measured value: a clock, a name that reads memory or
    names a measurement, a call of a measuring function. Where none is, nothing is measured."""
    for node in nodes:
        name = _identifier(node)
        if name is not None and (name in CLOCK_CALLS or name in functions or _names_a_measurement(name)):
            return True
    return False


def measuring_functions(trees: Iterable[ast.Module]) -> dict[str, Returns]:
    """Top-level functions (by name, across `trees`) that return a measured value; settled over
    helpers that call helpers. Not methods: a method `run` would make every `.run()` measured."""
    candidates: list[tuple[set[str], ast.FunctionDef | ast.AsyncFunctionDef]] = []
    for tree in trees:
        constants = module_constants(tree)
        candidates += [(constants, body) for body in tree.body if isinstance(body, (ast.FunctionDef, ast.AsyncFunctionDef))]
    measuring: dict[str, Returns] = {}
    while True:
        found: dict[str, Returns] = {}
        for constants, body in candidates:
            returned = Scope(body, measuring, constants).returns(body)
            if _any(returned):
                found[body.name] = returned
        if found == measuring:
            return measuring
        measuring = found


def thresholds_in_source(source: str, path: Path = Path("<source>"),
                         functions: dict[str, Returns] | None = None) -> list[Finding]:
    tree = ast.parse(source)
    functions = measuring_functions([tree]) if functions is None else functions
    constants = module_constants(tree)
    findings = []
    for body in _scopes(tree):
        for node in Scope(body, functions, constants).thresholds():
            findings.append(Finding(path, node.lineno, ast.get_source_segment(source, node.test) or ""))
    return sorted(findings, key=lambda f: (str(f.path), f.line))


def thresholds_in_files(paths: Iterable[Path], helper_paths: Iterable[Path] = ()) -> list[Finding]:
    """The threshold assertions in `paths`, knowing the measuring functions of `paths` and `helper_paths`."""
    paths = sorted(paths)
    sources = {path: path.read_text() for path in paths}
    helpers = [ast.parse(p.read_text()) for p in helper_paths]
    functions = measuring_functions([*(ast.parse(s) for s in sources.values()), *helpers])
    return [finding for path, source in sources.items() for finding in thresholds_in_source(source, path, functions)]
