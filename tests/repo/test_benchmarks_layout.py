"""benchmarks/: its README lists every file there and no other, and nothing there imports the tests.

The README's tables name one file per row, in the first cell (`| `NAME` | ...`); every other mention of
`benchmarks/NAME.py` or `.sh` in it must exist too. The benchmarks' shared helpers live in
hetero_infer/bench/harness.py: a benchmark importing `tests` (directly, or in code it hands to another Python
process) would tie the tests' layout to tools that run without them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from hetero_infer.bench.harness import REPO_ROOT

BENCHMARKS = REPO_ROOT / "benchmarks"
TABLE_ROW_FILE = re.compile(r"^\|\s*`([^`/]+\.(?:py|sh))`\s*\|", re.M)
PATH_MENTION = re.compile(r"\bbenchmarks/([\w.-]+\.(?:py|sh))\b")
# `tests` as a module in text another process runs: `python -m tests.x`, `-c "from tests... / import tests"`.
TESTS_IN_TEXT = re.compile(r"\bfrom\s+tests[\s.]|\bimport\s+tests\b|-m\s+tests\.|\btests\.[A-Za-z_]\w*\.[A-Za-z_]")


def benchmark_files() -> set[str]:
    return {p.name for p in BENCHMARKS.iterdir() if p.is_file() and p.suffix in (".py", ".sh")}


def readme_listing(text: str) -> set[str]:
    return set(TABLE_ROW_FILE.findall(text))


def imports_of_tests(source: str) -> list[str]:
    """Where `source` (Python) imports `tests`, in a statement or in a string it may hand to another process."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] == "tests"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "tests":
            found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and TESTS_IN_TEXT.search(node.value):
            found.append(f"line {node.lineno}: a string naming the tests package: {node.value[:80]!r}")
    return found


def test_readme_lists_every_benchmark_file_and_no_other() -> None:
    text = (BENCHMARKS / "README.md").read_text(encoding="utf-8")
    files, listed = benchmark_files(), readme_listing(text)
    assert not files - listed, f"benchmarks/README.md does not list: {sorted(files - listed)}"
    assert not listed - files, f"benchmarks/README.md lists files that are not in benchmarks/: {sorted(listed - files)}"
    mentioned = set(PATH_MENTION.findall(text))
    assert not mentioned - files, f"benchmarks/README.md mentions missing files: {sorted(mentioned - files)}"


def test_no_benchmark_imports_the_tests() -> None:
    offenders = {}
    for path in sorted(BENCHMARKS.iterdir()):
        if path.suffix == ".py":
            found = imports_of_tests(path.read_text(encoding="utf-8"))
        elif path.suffix == ".sh":
            found = [f"line {n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1)
                     if not line.lstrip().startswith("#") and TESTS_IN_TEXT.search(line)]
        else:
            continue
        if found:
            offenders[path.name] = found
    assert not offenders, f"benchmarks import from tests (use hetero_infer/bench/harness.py): {offenders}"


# --- the checks themselves, on made-up text ---


def test_listing_reads_first_cells_only() -> None:
    text = ("| file | what |\n|---|---|\n| `a.py` | uses `b.py` and `hetero_infer/x.py` |\n"
            "| `run.sh` | set-up |\n| `dir/c.py` | not a benchmarks/ file |\n")
    assert readme_listing(text) == {"a.py", "run.sh"}


def test_finds_imports_of_tests_in_statements_and_subprocess_strings() -> None:
    source = ("import os\nimport tests.helpers.oracle\nfrom tests.helpers import x\nfrom .tests import y\n"
              "def f():\n    from tests import z\n"
              "CMD = ['python', '-c', 'from tests.helpers.stack import run_stack']\n"
              "MOD = ['python', '-m', 'tests.helpers.scheduler_replay']\n"
              "NOTE = 'the oracle the tests compare with; tests/unit/x.py'\n")
    lines = [f.split(":")[0] for f in imports_of_tests(source)]
    assert lines == ["line 2", "line 3", "line 6", "line 7", "line 8"]
