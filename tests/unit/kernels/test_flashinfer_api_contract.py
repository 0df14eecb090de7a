"""Every FlashInfer call our code makes fits the installed (pinned) flashinfer-python, checked on the CPU (issue 55).

A renamed keyword (`page_size` for `page_sz`), a dropped positional or a moved function shows only when the
call runs, which for FlashInfer means on a GPU. Here the calls are read from our source with `ast`: names bound to
`flashinfer` objects (imports, `self.x = flashinfer.Wrapper(...)`, locals, functions returning them) are
followed, and every call on them is bound, with its positional count and keyword names, to the installed
function's `inspect.signature`. A new call is covered without touching this file; `EXPECTED_TARGETS` says which
ones must be found, so a collector gone blind fails too.

- A keyword that a signature takes only through `**kwargs` is followed to where FlashInfer forwards it
  (BatchDecodeWithPagedKVCacheWrapper.plan forwards every keyword to `_plan_impl`) and must be a parameter there.
- Positional arguments that would land in a `*args` (FlashInfer's deprecated positional forms) are flagged.
- The functions of a built JIT module (`get_norm_module().rmsnorm(...)`: tvm-ffi functions, which exist only after
  an nvcc build) have no signature here: their calls must match, in positional count and keywords, a call of the
  same function that FlashInfer's own Python makes on the same getter's module (flashinfer/norm's
  `get_norm_module().rmsnorm(out, input, weight, eps, enable_pdl)`), read with `ast` from its source.
- What `ast` cannot type (a JitSpec held in a dict or passed as `spec: Any`) is in `UNTYPED_USES`.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

flashinfer = pytest.importorskip("flashinfer")

ROOT = Path(__file__).resolve().parents[3]
# Where our code calls FlashInfer: the backend, fused kernels and JIT list (kernels/), the worker, the GPU benchmarks
# and the JIT build script.
SCANNED = ("kernels", "gpu_worker", "benchmarks", "scripts")
PINNED = "0.7.2.post1"

# Calls the collector must find in our source (by target): what kernels/flashinfer_backend.py, flashinfer_fused.py
# and flashinfer_jit.py call today. The checks cover every call found; this guards the finding.
EXPECTED_TARGETS = {
    "flashinfer.BatchDecodeWithPagedKVCacheWrapper", "flashinfer.BatchDecodeWithPagedKVCacheWrapper.plan",
    "flashinfer.BatchDecodeWithPagedKVCacheWrapper.run", "flashinfer.BatchPrefillWithPagedKVCacheWrapper",
    "flashinfer.BatchPrefillWithPagedKVCacheWrapper.plan", "flashinfer.BatchPrefillWithPagedKVCacheWrapper.run",
    "flashinfer.append_paged_kv_cache",
    "flashinfer.norm.get_norm_module", "flashinfer.norm.get_norm_module().rmsnorm",
    "flashinfer.norm.get_norm_module().fused_add_rmsnorm", "flashinfer.rope.get_rope_module",
    "flashinfer.rope.get_rope_module().apply_rope_pos_ids_cos_sin_cache",
    "flashinfer.activation.get_act_and_mul_module", "flashinfer.activation.get_act_and_mul_module().silu_and_mul",
    "flashinfer.jit.attention.modules.gen_batch_decode_module",
    "flashinfer.jit.attention.modules.gen_batch_prefill_module",
    "flashinfer.jit.attention.modules._gen_batch_prefill_primary_module", "flashinfer.jit.page.gen_page_module",
    "flashinfer.jit.norm.gen_norm_module", "flashinfer.jit.rope.gen_rope_module",
    "flashinfer.jit.activation.gen_act_and_mul_module", "flashinfer.utils.is_fa3_prefill_head_dim_supported",
    "flashinfer.jit.core.JitSpecNvcc.build_and_load",
}

# Uses `ast` cannot tie to a FlashInfer object: the JitSpecs of kernels/flashinfer_jit.py and scripts/flashinfer_jit.py
# travel in dicts and as `spec: Any` parameters. (class, attribute, positional arguments of our calls of it, or None
# for an attribute read). gen_jit_spec, behind every gen_*_module, builds a JitSpecNvcc.
UNTYPED_USES = (
    ("flashinfer.jit.core.JitSpecNvcc", "name", None),
    ("flashinfer.jit.core.JitSpecNvcc", "ninja_path", None),
    ("flashinfer.jit.core.JitSpecNvcc", "build_dir", None),
    ("flashinfer.jit.core.JitSpecNvcc", "jit_library_path", None),
    ("flashinfer.jit.core.JitSpecNvcc", "is_aot", None),
    ("flashinfer.jit.core.JitSpecNvcc", "write_ninja", 0),
    ("flashinfer.jit.core.JitSpecNvcc", "build_and_load", 0),
)


# --- what our source holds and calls


@dataclass(frozen=True)
class Ref:
    """A FlashInfer object a name in our code holds. `path`: its import path; `kind`: "object" (the object at
    path), "instance" (of the class at path), "method" (path = class path + "." + name), "jit" (the JIT module the
    getter at path returns), "jitfn" (path = getter path + "()." + function name)."""

    path: str
    kind: str = "object"

    def attribute(self, name: str) -> Ref | None:
        if self.kind == "object":
            return Ref(f"{self.path}.{name}")
        if self.kind == "instance":
            return Ref(f"{self.path}.{name}", "method")
        if self.kind == "jit":
            return Ref(f"{self.path}().{name}", "jitfn")
        return None


@dataclass(frozen=True)
class Call:
    where: str
    target: Ref
    positional: int
    keywords: tuple[str, ...]


@dataclass(frozen=True)
class Access:
    """An attribute read or assignment on a FlashInfer object (`flashinfer.__version__`, `JitSpecNvcc.x = ...`)."""

    where: str
    target: Ref


@dataclass
class Scope:
    """Names bound in one function (or the module) and what they hold, over the enclosing scope's."""

    parent: Scope | None = None
    refs: dict[str, frozenset[Ref]] = field(default_factory=dict)
    tuples: dict[str, int] = field(default_factory=dict)  # a tuple literal's length: what `*name` spreads
    dicts: dict[str, tuple[str, ...]] = field(default_factory=dict)  # a dict's constant keys: what `**name` passes
    shadowed: set[str] = field(default_factory=set)  # parameters: hide the enclosing scope's names

    def find(self, table: str, name: str) -> Any:
        scope: Scope | None = self
        while scope is not None:
            if name in getattr(scope, table):
                return getattr(scope, table)[name]
            if name in scope.shadowed:
                return None
            scope = scope.parent
        return None


class Unresolved(Exception):
    """A call on a FlashInfer object whose arguments the collector cannot count (`*args` of unknown length)."""


def _body_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """Every node inside a function (or module) body, not descending into nested functions or classes."""
    for child in ast.iter_child_nodes(node):
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield from _body_nodes(child)


def _function_defs(node: ast.AST) -> list[ast.FunctionDef]:
    return [n for n in ast.iter_child_nodes(node) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _dict_keys(node: ast.AST) -> tuple[str, ...] | None:
    """The keys of `dict(a=..., b=...)` or `{"a": ...}` with constant keys, else None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" and not node.args:
        if all(k.arg is not None for k in node.keywords):
            return tuple(k.arg for k in node.keywords)
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
        return tuple(k.value for k in node.keys)  # type: ignore[union-attr]
    return None


@functools.cache
def resolve(path: str) -> Any:
    """The object at a dotted import path, importing submodules on the way (LookupError if there is none)."""
    parts = path.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            if not inspect.ismodule(obj):
                raise LookupError(f"{'.'.join(parts[:i - 1])} has no {part!r}") from None
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                raise LookupError(f"{'.'.join(parts[:i - 1])} has no {part!r}") from None
    return obj


def _is_jit_getter(path: str) -> bool:
    """FlashInfer names the functions that build and load a JIT module get_<name>_module."""
    name = path.rsplit(".", 1)[-1]
    return name.startswith("get_") and name.endswith("_module")


class SourceScan:
    """The FlashInfer calls and attribute uses of one file of our source."""

    def __init__(self, source: str, name: str) -> None:
        self.name = name
        self.tree = ast.parse(source)
        self.calls: list[Call] = []
        self.accesses: list[Access] = []
        self.unresolved: list[str] = []
        self.functions = {f.name: f for f in _function_defs(self.tree)}
        self.classes = {c.name: c for c in self.tree.body if isinstance(c, ast.ClassDef)}
        self.self_attrs: dict[str, dict[str, frozenset[Ref]]] = {c: {} for c in self.classes}
        self._returning: set[str] = set()  # the helpers whose returns are being evaluated (recursion stops there)
        self.module = self._scope(self.tree, None, None)
        self._bind_self_attributes()
        self._collect(self.tree, self.module, None)
        for cls_name, cls in self.classes.items():
            for method in _function_defs(cls):
                self._collect_function(method, self.module, cls_name)

    # binding: what each name holds

    def _lineage(self, cls: str) -> list[str]:
        """A class of this file and its bases defined in this file, nearest first."""
        lineage, queue = [], [cls]
        while queue:
            name = queue.pop(0)
            if name in self.classes and name not in lineage:
                lineage.append(name)
                queue += [b.id for b in self.classes[name].bases if isinstance(b, ast.Name)]
        return lineage

    def _self_attribute(self, cls: str, name: str) -> frozenset[Ref]:
        for owner in self._lineage(cls):
            if name in self.self_attrs[owner]:
                return self.self_attrs[owner][name]
        return frozenset()

    def _method(self, cls: str, name: str) -> ast.FunctionDef | None:
        for owner in self._lineage(cls):
            for method in _function_defs(self.classes[owner]):
                if method.name == name:
                    return method
        return None

    def _scope(self, node: ast.AST, parent: Scope | None, cls: str | None) -> Scope:
        scope = Scope(parent)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            scope.shadowed = {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if p}
        for _ in range(3):  # to a fixpoint: a name may be bound from one bound below it
            for stmt in _body_nodes(node):
                self._bind(stmt, scope, cls)
        return scope

    def _bind(self, node: ast.AST, scope: Scope, cls: str | None) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "flashinfer":
                    bound = alias.asname or alias.name.split(".")[0]
                    scope.refs[bound] = frozenset({Ref(alias.name if alias.asname else "flashinfer")})
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "flashinfer":
            for alias in node.names:
                scope.refs[alias.asname or alias.name] = frozenset({Ref(f"{node.module}.{alias.name}")})
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, node.value
            refs = self.evaluate(value, scope, cls)
            if refs:
                scope.refs[name] = refs | scope.refs.get(name, frozenset())
            if isinstance(value, ast.Tuple) and not any(isinstance(e, ast.Starred) for e in value.elts):
                scope.tuples[name] = len(value.elts)
            if (keys := _dict_keys(value)) is not None:
                scope.dicts[name] = keys

    def _bind_self_attributes(self) -> None:
        """`self.x = <FlashInfer object>` in any method of a class: what `self.x` holds in all of them."""
        for _ in range(3):  # `self._wrapper = self.decode` after `self.decode = flashinfer.Wrapper(...)`
            for cls_name, cls in self.classes.items():
                for method in _function_defs(cls):
                    scope = self._scope(method, self.module, cls_name)
                    for node in _body_nodes(method):
                        if isinstance(node, ast.Assign) and len(node.targets) == 1:
                            self._bind_self_attribute(node.targets[0], node.value, scope, cls_name)

    def _bind_self_attribute(self, target: ast.AST, value: ast.AST, scope: Scope, cls: str) -> None:
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
            refs = self.evaluate(value, scope, cls)
            if refs:
                attrs = self.self_attrs[cls]
                attrs[target.attr] = attrs.get(target.attr, frozenset()) | refs

    def _returns(self, function: ast.FunctionDef, cls: str | None) -> frozenset[Ref]:
        key = f"{cls}.{function.name}"
        if key in self._returning:
            return frozenset()
        self._returning.add(key)
        try:
            scope = self._scope(function, self.module, cls)
            refs: frozenset[Ref] = frozenset()
            for node in _body_nodes(function):
                if isinstance(node, ast.Return) and node.value is not None:
                    refs |= self.evaluate(node.value, scope, cls)
            return refs
        finally:
            self._returning.discard(key)

    def _local_function(self, func: ast.AST, cls: str | None) -> ast.FunctionDef | None:
        """The function of this file a call names: `name(...)` or `self.method(...)`."""
        if isinstance(func, ast.Name):
            return self.functions.get(func.id)
        if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self"
                and cls is not None):
            return self._method(cls, func.attr)
        return None

    def evaluate(self, node: ast.AST, scope: Scope, cls: str | None) -> frozenset[Ref]:
        """The FlashInfer objects an expression may hold (empty: none, or not known)."""
        if isinstance(node, ast.Name):
            return scope.find("refs", node.id) or frozenset()
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and cls is not None:
                return self._self_attribute(cls, node.attr)
            refs = (ref.attribute(node.attr) for ref in self.evaluate(node.value, scope, cls))
            return frozenset(r for r in refs if r is not None)
        if isinstance(node, ast.Call):
            return self._call_result(node, scope, cls)
        return frozenset()

    def _call_result(self, node: ast.Call, scope: Scope, cls: str | None) -> frozenset[Ref]:
        results = set()
        for ref in self.evaluate(node.func, scope, cls):
            if ref.kind != "object":
                continue
            try:
                obj = resolve(ref.path)
            except LookupError:
                continue  # reported where the name is used
            if inspect.isclass(obj):
                results.add(Ref(ref.path, "instance"))
            elif _is_jit_getter(ref.path):
                results.add(Ref(ref.path, "jit"))
        local = self._local_function(node.func, cls)
        if local is not None:  # a helper of ours returning a FlashInfer object (`_norm()`)
            results |= self._returns(local, cls if isinstance(node.func, ast.Attribute) else None)
        return frozenset(results)

    # collecting: every call and attribute use on those objects

    def _collect(self, node: ast.AST, scope: Scope, cls: str | None) -> None:
        for child in _body_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self._collect_function(child, scope, cls)  # a nested function sees its enclosing names
            elif isinstance(child, ast.Call):
                self._record_call(child, scope, cls)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                self._record_import(child)
            elif isinstance(child, ast.Attribute) and not (isinstance(child.value, ast.Name)
                                                           and child.value.id == "self"):  # ours, not FlashInfer's
                for ref in self.evaluate(child, scope, cls):
                    if ref.kind in ("object", "method"):
                        self.accesses.append(Access(f"{self.name}:{child.lineno}", ref))

    def _collect_function(self, function: ast.FunctionDef, parent: Scope, cls: str | None) -> None:
        self._collect(function, self._scope(function, parent, cls), cls)

    def _record_import(self, node: ast.Import | ast.ImportFrom) -> None:
        """An imported FlashInfer module or name must exist, used or not."""
        where = f"{self.name}:{node.lineno}"
        if isinstance(node, ast.Import):
            paths = [a.name for a in node.names if a.name.split(".")[0] == "flashinfer"]
        elif (node.module or "").split(".")[0] == "flashinfer":
            paths = [f"{node.module}.{a.name}" for a in node.names]
        else:
            paths = []
        self.accesses.extend(Access(where, Ref(path)) for path in paths)

    def _record_call(self, node: ast.Call, scope: Scope, cls: str | None) -> None:
        targets = self.evaluate(node.func, scope, cls)
        if not targets:
            return
        where = f"{self.name}:{node.lineno}"
        try:
            positional = self._count_positional(node, scope)
            keywords = self._keywords(node, scope, cls)
        except Unresolved as exc:
            self.unresolved.append(f"{where}: {ast.unparse(node)[:120]}: {exc}")
            return
        self.calls.extend(Call(where, ref, positional, keywords) for ref in targets)

    def _count_positional(self, node: ast.Call, scope: Scope) -> int:
        count = 0
        for arg in node.args:
            if not isinstance(arg, ast.Starred):
                count += 1
            elif isinstance(arg.value, ast.Tuple):
                count += len(arg.value.elts)
            elif isinstance(arg.value, ast.Name) and scope.find("tuples", arg.value.id) is not None:
                count += scope.find("tuples", arg.value.id)
            else:
                raise Unresolved(f"cannot count *{ast.unparse(arg.value)}")
        return count

    def _keywords(self, node: ast.Call, scope: Scope, cls: str | None) -> tuple[str, ...]:
        names: list[str] = []
        for keyword in node.keywords:
            if keyword.arg is not None:
                names.append(keyword.arg)
                continue
            keys = self._spread_keys(keyword.value, scope, cls)
            if keys is None:
                raise Unresolved(f"cannot tell the keys of **{ast.unparse(keyword.value)}")
            names.extend(keys)
        return tuple(names)

    def _spread_keys(self, value: ast.AST, scope: Scope, cls: str | None) -> tuple[str, ...] | None:
        """The keys `**value` passes: a dict literal, a name bound to one, or a helper returning one
        (`**self.plan_kwargs()`)."""
        if (keys := _dict_keys(value)) is not None:
            return keys
        if isinstance(value, ast.Name):
            return scope.find("dicts", value.id)
        if isinstance(value, ast.Call) and (local := self._local_function(value.func, cls)) is not None:
            returned = [_dict_keys(n.value) for n in _body_nodes(local) if isinstance(n, ast.Return) and n.value]
            if returned and all(k is not None and k == returned[0] for k in returned):
                return returned[0]
        return None


# --- checking them against the installed FlashInfer


def _placeholders(n: int) -> list[None]:
    return [None] * n


def _signature_problems(fn: Any, positional: int, keywords: tuple[str, ...], label: str) -> list[str]:
    """Whether `fn(<positional args>, **{keywords})` binds; keywords taken by **kwargs are followed."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        return [f"{label}: no signature ({exc})"]
    params = sig.parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if unknown := [k for k in keywords if k not in named]:
            return [f"{label}: no parameter named {', '.join(unknown)} (signature {sig})"]
    try:
        bound = sig.bind(*_placeholders(positional), **dict.fromkeys(keywords))
    except TypeError as exc:
        return [f"{label}: {exc} (signature {sig})"]
    problems = []
    for name, value in bound.arguments.items():
        kind = params[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL and value:
            problems.append(f"{label}: {len(value)} positional argument(s) go to *{name} (signature {sig})")
        elif kind is inspect.Parameter.VAR_KEYWORD and value:
            problems += _forwarded_problems(fn, name, tuple(value), label)
    return problems


def _forwarded_problems(fn: Any, varkw: str, keywords: tuple[str, ...], label: str, depth: int = 0) -> list[str]:
    """Keywords a function takes by **varkw must be parameters of each function it forwards **varkw to (a call of
    `self.name(...)` or of a module-level name). No forwarding found: taken as accepted."""
    problems = []
    for target in _forward_targets(fn, varkw):
        try:
            sig = inspect.signature(target)
        except (TypeError, ValueError):
            continue
        named = {n for n, p in sig.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        takes_more = [n for n, p in sig.parameters.items() if p.kind is p.VAR_KEYWORD]
        unknown = [k for k in keywords if k not in named]
        if unknown and takes_more and depth < 3:
            problems += _forwarded_problems(target, takes_more[0], tuple(unknown), label, depth + 1)
        elif unknown:
            problems.append(f"{label}: keyword(s) {unknown} pass through **{varkw} to "
                            f"{target.__qualname__}{sig}, which has no such parameter")
    return problems


def _forward_targets(fn: Any, varkw: str) -> list[Any]:
    """The functions `fn`'s body calls with **varkw: self.<method> (looked up on fn's class) or a global."""
    fn = inspect.unwrap(fn)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return []
    owner = _defining_class(fn)
    targets = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and any(k.arg is None and isinstance(k.value, ast.Name)
                                                   and k.value.id == varkw for k in node.keywords)):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self" and owner:
            targets.append(getattr(owner, func.attr, None))
        elif isinstance(func, ast.Name):
            targets.append(fn.__globals__.get(func.id))
    return [t for t in targets if callable(t)]


def _defining_class(fn: Any) -> type | None:
    qualname = getattr(fn, "__qualname__", "")
    if "." not in qualname or "<locals>" in qualname:
        return None
    owner: Any = inspect.getmodule(fn)
    for part in qualname.split(".")[:-1]:
        owner = getattr(owner, part, None)
    return owner if inspect.isclass(owner) else None


@functools.cache
def reference_calls(getter_path: str, function: str) -> frozenset[tuple[int, tuple[str, ...]]]:
    """(positional count, keywords) of each call FlashInfer's own source makes of `<getter>(...).<function>(...)`,
    read from the file that defines the getter."""
    getter = inspect.unwrap(resolve(getter_path))
    tree = ast.parse(Path(inspect.getsourcefile(getter)).read_text())
    getter_name = getter_path.rsplit(".", 1)[-1]
    found = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == function
                and isinstance(node.func.value, ast.Call) and _names(node.func.value.func, getter_name)):
            if not any(isinstance(a, ast.Starred) for a in node.args) and all(k.arg for k in node.keywords):
                found.add((len(node.args), tuple(sorted(k.arg for k in node.keywords))))
    return frozenset(found)


def _names(func: ast.AST, name: str) -> bool:
    return (isinstance(func, ast.Name) and func.id == name) or (isinstance(func, ast.Attribute) and func.attr == name)


def _jit_problems(call: Call) -> list[str]:
    getter_path, function = call.target.path.split("().")
    label = f"{call.where}: {call.target.path}"
    try:
        references = reference_calls(getter_path, function)
    except LookupError as exc:
        return [f"{label}: {exc}"]
    if not references:
        return [f"{label}: FlashInfer's own source never calls {function} on {getter_path}()'s module: nothing to "
                "check the call against (the function may be gone)"]
    ours = (call.positional, tuple(sorted(call.keywords)))
    if ours not in references:
        return [f"{label}: called with {call.positional} positional and keywords {list(call.keywords)}; FlashInfer "
                f"calls it with {sorted(references)} (positional count, keywords)"]
    return []


def call_problems(call: Call) -> list[str]:
    """Why a call does not fit the installed FlashInfer (empty: it fits)."""
    label = f"{call.where}: {call.target.path}"
    if call.target.kind == "jitfn":
        return _jit_problems(call)
    if call.target.kind == "method":
        owner_path, name = call.target.path.rsplit(".", 1)
        try:
            owner = resolve(owner_path)
            method = getattr(owner, name)
        except (LookupError, AttributeError):
            return [f"{label}: {owner_path} has no {name!r}"]
        takes_self = not isinstance(inspect.getattr_static(owner, name), (staticmethod, classmethod))
        return _signature_problems(method, call.positional + takes_self, call.keywords, label)
    try:
        obj = resolve(call.target.path)
    except LookupError as exc:
        return [f"{label}: {exc}"]
    return _signature_problems(obj, call.positional, call.keywords, label)


def attribute_problems(owner: Any, name: str) -> str | None:
    """None when a class or module has the attribute (a class: also a dataclass field or a `self.name =` of its
    source, which instances hold), else why not."""
    if hasattr(owner, name):
        return None
    if dataclasses.is_dataclass(owner) and name in {f.name for f in dataclasses.fields(owner)}:
        return None
    if inspect.isclass(owner):
        try:
            source = textwrap.dedent(inspect.getsource(owner))
        except (OSError, TypeError):
            source = ""
        if f"self.{name} =" in source:
            return None
    return f"{getattr(owner, '__qualname__', owner)} has no attribute {name!r}"


def access_problems(access: Access) -> list[str]:
    """A module's or class's attribute must resolve (a submodule is imported); an instance's must be on its class."""
    label = f"{access.where}: {access.target.path}"
    if access.target.kind == "object":
        try:
            resolve(access.target.path)
            return []
        except (LookupError, ImportError) as exc:
            failure = f"{label}: {exc}"
        if "." not in access.target.path:
            return [failure]
    owner_path, name = access.target.path.rsplit(".", 1)
    try:
        owner = resolve(owner_path)
    except LookupError as exc:
        return [f"{label}: {exc}"]
    if access.target.kind == "object" and not inspect.isclass(owner):
        return [failure]
    problem = attribute_problems(owner, name)
    return [f"{label}: {problem}"] if problem else []


def scan_problems(scan: SourceScan) -> list[str]:
    """Each distinct problem of a file's FlashInfer uses, in file order of the checks (calls, then attributes)."""
    problems = list(scan.unresolved)
    for call in scan.calls:
        problems += call_problems(call)
    for access in scan.accesses:
        problems += access_problems(access)
    return list(dict.fromkeys(problems))  # a call's name is also an attribute read: one report


@functools.cache
def our_scans() -> tuple[SourceScan, ...]:
    scans = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            if "import flashinfer" in text or "from flashinfer" in text:
                scans.append(SourceScan(text, str(path.relative_to(ROOT))))
    return tuple(scans)


# --- the tests


def test_the_installed_flashinfer_is_the_pinned_one() -> None:
    """The signatures below are the pinned version's: another installed version checks something else."""
    assert flashinfer.__version__ == PINNED


def test_every_flashinfer_call_of_ours_fits_the_installed_signatures() -> None:
    problems = [p for scan in our_scans() for p in scan_problems(scan)]
    assert not problems, "\n".join(problems)


def test_the_collector_finds_the_calls_we_make() -> None:
    """Guards the test above from passing on nothing: each known call site's target is found in our source."""
    found = {call.target.path for scan in our_scans() for call in scan.calls}
    assert EXPECTED_TARGETS <= found, sorted(EXPECTED_TARGETS - found)
    decode_plans = [c for s in our_scans() for c in s.calls
                    if c.target.path == "flashinfer.BatchDecodeWithPagedKVCacheWrapper.plan"]
    # kernels/flashinfer_backend.py's `*shape` and `**self.plan_kwargs()` are spread into the count
    assert any(c.positional == 7 and set(c.keywords) == {"pos_encoding_mode", "q_data_type", "kv_data_type", "sm_scale",
                                                         "window_left"}
               for c in decode_plans if c.where.startswith("kernels/flashinfer_backend.py")), decode_plans


@pytest.mark.parametrize("owner_path, name, positional", UNTYPED_USES)
def test_the_jit_spec_attributes_we_use_exist(owner_path: str, name: str, positional: int | None) -> None:
    owner = resolve(owner_path)
    assert attribute_problems(owner, name) is None, attribute_problems(owner, name)
    if positional is not None:
        assert not _signature_problems(getattr(owner, name), positional + 1, (), f"{owner_path}.{name}")


# A file of calls that each break the pinned API one way, and the same calls made right.
PLANTED = '''
import flashinfer
from flashinfer.norm import get_norm_module

def step(ws, a, b, c, d):
    prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    prefill.plan(a, b, c, d, 4, 2, 64, page_sz=16)                          # line 7: no such keyword
    decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_core=True)  # line 8: keyword
    decode.plan(a, b, c, 4, 2, 64, 16, pos_encodng_mode="NONE")             # line 9: through **kwargs
    flashinfer.append_paged_kv_cache(a, b, c, d)                            # line 10: too few
    flashinfer.no_such_function(a)                                          # line 11: no such name
    from flashinfer.jit.core import NoSuchSpec                              # line 12: nor that
    get_norm_module().rmsnorm(a, b, c, 1e-5)                                # line 13: FlashInfer passes 5
    decode.plan(a, b, c, 4, 2, 64, 16, "NONE")                              # line 14: into *args
    print(flashinfer.no_such_attribute)                                     # line 15: no such attribute
'''
RIGHT = '''
import flashinfer
from flashinfer.norm import get_norm_module

def step(ws, a, b, c, d):
    prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    prefill.plan(a, b, c, d, 4, 2, 64, 16, causal=True)
    decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    decode.plan(a, b, c, 4, 2, 64, 16, pos_encoding_mode="NONE")
    flashinfer.append_paged_kv_cache(a, b, c, d, a, b, c, d, kv_layout="NHD")
    get_norm_module().rmsnorm(a, b, c, 1e-5, False)
    print(flashinfer.__version__)
'''


def test_the_checker_flags_each_planted_mistake() -> None:
    problems = scan_problems(SourceScan(PLANTED, "planted.py"))
    flagged = {int(p.split(":")[1]) for p in problems}
    assert flagged == set(range(7, 16)), "\n".join(problems)
    by_line = {int(p.split(":")[1]): p for p in problems}
    assert "no parameter named page_sz" in by_line[7]
    assert "use_tensor_core" in by_line[8]
    assert "pos_encodng_mode" in by_line[9] and "_plan_impl" in by_line[9]
    assert "missing a required argument" in by_line[10]
    assert "NoSuchSpec" in by_line[12]
    assert "4 positional" in by_line[13] and "[(5, ())]" in by_line[13]
    assert "*deprecated_positional_args" in by_line[14]


def test_the_checker_passes_the_same_calls_made_right() -> None:
    scan = SourceScan(RIGHT, "right.py")
    assert len(scan.calls) == 7  # 2 constructors, 2 plans, the append, the getter and its rmsnorm (print: not ours)
    assert not scan_problems(scan)


def test_arguments_it_cannot_count_are_reported_not_skipped() -> None:
    source = "import flashinfer\n\ndef f(args):\n    flashinfer.append_paged_kv_cache(*args)\n"
    assert scan_problems(SourceScan(source, "unknown.py")) == [
        "unknown.py:4: flashinfer.append_paged_kv_cache(*args): cannot count *args"]


def _mutated(path: str, anchor: str, replacement: str) -> SourceScan:
    """A scan of one of our files with one edit, the anchor checked to be there (else the test names it)."""
    source = (ROOT / path).read_text()
    if anchor not in source:
        pytest.fail(f"{path} no longer holds {anchor!r}: pick another anchor for this test")
    return SourceScan(source.replace(anchor, replacement), path)


def test_a_keyword_misspelt_in_our_backend_is_caught() -> None:
    """Through kernels/flashinfer_backend.py's own indirections: `plan_kwargs()` is spread into the decode and prefill
    plans (`**self.plan_kwargs()`), and the decode wrapper's plan takes it by **kwargs."""
    scan = _mutated("kernels/flashinfer_backend.py", "dict(pos_encoding_mode=", "dict(pos_encoding=")
    problems = scan_problems(scan)
    assert problems and all("pos_encoding" in p for p in problems), problems
    plans = {p.split(": ")[1] for p in problems}
    assert plans == {"flashinfer.BatchDecodeWithPagedKVCacheWrapper.plan",
                     "flashinfer.BatchPrefillWithPagedKVCacheWrapper.plan"}, problems


def test_a_jit_call_missing_an_argument_in_our_fused_kernels_is_caught() -> None:
    scan = _mutated("kernels/flashinfer_fused.py", "_norm().rmsnorm(out, hidden, weight, eps, False)",
                    "_norm().rmsnorm(out, hidden, weight, eps)")
    (problem,) = scan_problems(scan)
    assert "get_norm_module().rmsnorm: called with 4 positional" in problem
