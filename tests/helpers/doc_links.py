"""Relative links in the repository's markdown that lead nowhere inside the repository: to a
path that does not exist, or out of the clone (`../shared/DESIGN.md` exists on one machine,
not in anybody's clone).

Read as GitHub renders them: inline links and images `[text](target "title")`, reference
definitions `[name]: target`, and `<img src="...">`; nothing inside fenced code blocks or code
spans is a link. Web and mail addresses and pure `#anchors` are not checked; a target's
`#fragment` and `?query` are dropped, and `/path` is from the repository root.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

INLINE = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'(][^)]*)?\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)>?", re.MULTILINE)
IMG_SRC = re.compile(r"<img\b[^>]*?\bsrc\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
FENCED = re.compile(r"^ {0,3}(`{3,}|~{3,}).*?^ {0,3}\1[`~]*[ \t]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.DOTALL)
NOT_CHECKED = ("http://", "https://", "mailto:", "#")


@dataclass(frozen=True)
class BrokenLink:
    source: Path
    line: int
    target: str

    def where(self, root: Path) -> str:
        return f"{self.source.relative_to(root)}:{self.line}: {self.target}"


def markdown_files(root: Path) -> list[Path]:
    """README.md and every page under docs/."""
    readme = root / "README.md"
    return ([readme] if readme.is_file() else []) + sorted((root / "docs").rglob("*.md"))


def link_targets(markdown: str) -> list[tuple[int, str]]:
    """(line, target) of every link, image and <img src> outside code."""
    def blank(match: re.Match[str]) -> str:  # keep the newlines, so line numbers stay right
        return re.sub(r"[^\n]", " ", match.group(0))

    prose = CODE_SPAN.sub(blank, FENCED.sub(blank, markdown))
    found = sorted((m.start(), m.group(1)) for pattern in (INLINE, REFERENCE, IMG_SRC) for m in pattern.finditer(prose))
    return [(prose.count("\n", 0, start) + 1, target) for start, target in found]


def resolve(root: Path, source: Path, target: str) -> Path | None:
    """Where a relative link leads, or None for one that is not checked."""
    if target.lower().startswith(NOT_CHECKED):
        return None
    path = unquote(re.split(r"[#?]", target, maxsplit=1)[0])
    return (root / path.lstrip("/") if path.startswith("/") else source.parent / path).resolve()


def broken_links(root: Path, files: list[Path] | None = None) -> list[BrokenLink]:
    root = root.resolve()
    broken = []
    for source in files if files is not None else markdown_files(root):
        for line, target in link_targets(source.read_text()):
            path = resolve(root, source.resolve(), target)
            if path is not None and not (path.is_relative_to(root) and path.exists()):
                broken.append(BrokenLink(source.resolve(), line, target))
    return broken
