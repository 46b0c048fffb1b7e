"""The code blocks of README.md and docs/*.md, with what each one's marker says to do with it.

Every fenced block in a shell or Python language (``bash``, ``sh``, ``shell``, ``console``, ``python``,
``py``) carries a marker in the HTML comment right above it (several comments may stack there):

- ``<!-- doc-test: run -->``: run by ``tests/integration/docs/test_doc_blocks.py`` (CI's one pytest run);
- ``<!-- doc-test: slow -->``: run there too, marked ``slow`` (``-m "not slow"`` skips it);
- ``<!-- doc-test: serve -->``: each line starts a service; it must come up and stop cleanly on SIGINT;
- ``<!-- doc-test: illustrative: REASON -->``: not run, and REASON says why (a GPU, another
  framework, a fragment of the block above, ...).

A run block that names ``tcp://broker:5556`` (or ``:5555``) meets a fresh local pool (``rollpool launch
local``) there (tests/integration/docs/test_doc_blocks.py `POOL_NAMES`), and a Python block gets the names of
``tests/integration/docs/prelude.py`` (``prompts``, ``data``, ``model``, ``train_step``, ...).
"""

from __future__ import annotations

import pathlib
import re
from dataclasses import dataclass

__all__ = ["Block", "CODE_LANGUAGES", "KINDS", "REPO", "doc_files", "read_blocks"]

REPO = pathlib.Path(__file__).resolve().parents[1]
CODE_LANGUAGES = ("bash", "sh", "shell", "console", "python", "py")
KINDS = ("run", "slow", "serve", "illustrative")
_FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
_MARKER = re.compile(r"<!--\s*doc-test:\s*(\w+)\s*(?::\s*(.*?))?\s*-->")

NOT_YET_MARKED: dict[str, str] = {}
"""Pages whose blocks this harness does not hold to markers yet, with the reason."""


@dataclass(frozen=True)
class Block:
    path: str
    """Relative to the repository root."""
    line: int
    """1-based line of the opening fence."""
    language: str
    text: str
    kind: str | None
    """The marker's kind (`KINDS`), None when the block has no marker."""
    reason: str

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def is_code(self) -> bool:
        return self.language in CODE_LANGUAGES


def doc_files() -> list[pathlib.Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def read_blocks(path: pathlib.Path) -> list[Block]:
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not re.match(r"^\s*```\s*$", lines[j]):
            j += 1
        kind, reason = None, ""
        k = i - 1
        while k >= 0 and lines[k].strip().startswith("<!--"):  # the comments stacked right above the fence
            mk = _MARKER.search(lines[k])
            if mk:
                kind, reason = mk.group(1), (mk.group(2) or "").strip()
            k -= 1
        indent = len(m.group(1))
        text = "\n".join(ln[indent:] for ln in lines[i + 1:j])
        out.append(Block(str(path.relative_to(REPO)), i + 1, m.group(2), text, kind, reason))
        i = j + 1
    return out
