"""The documentation as a clone has it: every relative link in README.md and docs/ leads to a
file or folder inside the repository, and the README stays a front page (docs/ holds the rest)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetero_infer.bench.harness import REPO_ROOT
from tests.helpers.doc_links import broken_links, link_targets, markdown_files
from tests.helpers.file_tree import write_tree

MAX_README_LINES = 400


def test_relative_links_resolve_inside_the_repository() -> None:
    broken = broken_links(REPO_ROOT)
    if broken:
        pytest.fail("links that lead nowhere in a clone:\n" + "\n".join(b.where(REPO_ROOT) for b in broken))


def test_readme_is_at_most_400_lines() -> None:
    lines = len((REPO_ROOT / "README.md").read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail into docs/ (at most {MAX_README_LINES})"


# --- the link reader itself, on a tiny tree made for each case ---


def test_reader_reports_missing_paths_and_paths_outside_the_clone(tmp_path: Path) -> None:
    root = write_tree(tmp_path / "repo", {
        "README.md": "See [the design](../shared/DESIGN.md).\n\n[gone](docs/gone.md) and ![a chart](docs/chart.png)\n",
        "docs/api.md": "[up](../README.md) [config](configuration.md#keys) [tree](../src/)\n"
                       "[ref]: ./missing.md\n<img alt=x src=\"img/none.svg\">\n",
        "docs/configuration.md": "",
        "src/x.py": "",
    })
    write_tree(tmp_path, {"shared/DESIGN.md": "exists, but outside the repository"})
    assert [b.where(root) for b in broken_links(root)] == [
        "README.md:1: ../shared/DESIGN.md", "README.md:3: docs/gone.md", "README.md:3: docs/chart.png",
        "docs/api.md:2: ./missing.md", "docs/api.md:3: img/none.svg"]


def test_reader_skips_code_web_addresses_and_anchors(tmp_path: Path) -> None:
    root = write_tree(tmp_path, {
        "README.md": "[site](https://example.com/x) [mail](mailto:a@b.c) [here](#layout) [web](http://x/y)\n"
                     "`[not a link](nowhere.md)`\n"
                     "```python\nitems[0](nowhere)  # [text](nowhere.md)\n```\n"
                     "[root-relative](/docs/a.md) [encoded](docs/a%20b.md) [titled](docs/a.md \"A\")\n",
        "docs/a.md": "", "docs/a b.md": "",
    })
    assert broken_links(root) == []
    assert [target for _, target in link_targets((root / "README.md").read_text())] == [
        "https://example.com/x", "mailto:a@b.c", "#layout", "http://x/y", "/docs/a.md", "docs/a%20b.md", "docs/a.md"]


def test_reader_reads_the_readme_and_every_docs_page(tmp_path: Path) -> None:
    root = write_tree(tmp_path, {"README.md": "", "docs/a.md": "", "docs/perf/b.md": "", "docs/c.txt": "", "x.md": ""})
    assert [p.relative_to(root).as_posix() for p in markdown_files(root)] == ["README.md", "docs/a.md", "docs/perf/b.md"]
