"""No function in scheduler_svc is over 60 lines (nested ones counted on their own too): a longer one
is several steps that want names (`Scheduler.schedule` reads as its phases)."""

from __future__ import annotations

import ast

from hetero_infer.testing.stack import REPO_ROOT

MAX_FUNCTION_LINES = 60


def long_functions(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of every def over MAX_FUNCTION_LINES, decorators not counted."""
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_function_in_scheduler_svc_is_over_60_lines() -> None:
    found = [f"{path.relative_to(REPO_ROOT)}:{line}: {name} has {lines} lines"
             for path in sorted((REPO_ROOT / "scheduler_svc").rglob("*.py"))
             for name, line, lines in long_functions(path.read_text())]
    assert not found, "\n".join(found)


def _body(lines: int, indent: str) -> str:
    return "".join(f"{indent}x{i} = {i}\n" for i in range(lines))


def test_the_count_takes_nested_functions_and_methods() -> None:
    source = ("def fits():\n" + _body(59, "    ")  # 60 lines with its def
              + "class C:\n    async def method(self):\n" + _body(60, "        ")  # 61
              + "def outer():\n    def inner():\n" + _body(60, "        ") + "    return inner\n")  # 63, 61
    assert sorted((name, lines) for name, _, lines in long_functions(source)) == [("inner", 61), ("method", 61), ("outer", 63)]
