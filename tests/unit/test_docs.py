"""The docs against the code, without running anything: every shell or Python block of README.md and docs/*.md
says what CI does with it (tests/doc_blocks.py), and every `rollpool SUBCOMMAND --flag` the docs name exists
in that subcommand's parser (what `rollpool SUBCOMMAND --help` lists)."""

from __future__ import annotations

import argparse
import re

import pytest

from rollpool.cli import build_parser
from tests.doc_blocks import KINDS, NOT_YET_MARKED, REPO, doc_files, read_blocks

_COMMAND_END = re.compile(r"(\s#|\s\||&&|;|\s>|`|\)\s|$)")


def _options(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    """Per command path ("broker", "launch local"), its option strings (with the top-level ones)."""
    top = {s for a in parser._actions for s in a.option_strings}
    out: dict[str, set[str]] = {}

    def walk(p: argparse.ArgumentParser, path: str) -> None:
        opts = top | {s for a in p._actions for s in a.option_strings}
        out[path] = opts
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    walk(sub, f"{path} {name}".strip())

    walk(parser, "")
    return out


def _doc_commands() -> list[tuple[str, str, str]]:
    """(where, command path, the command's text) for each `rollpool ...` command line the docs show."""
    options = _options(build_parser())
    paths = sorted((p for p in options if p), key=len, reverse=True)
    found = []
    for path in doc_files():
        text = path.read_text().replace("\\\n", " ")
        for lineno, line in enumerate(text.splitlines(), 1):
            for m in re.finditer(r"(?:^|[\s`(/])rollpool\s+((?:--log-level\s+\S+\s+)?[a-z][a-z-]*(?:\s+[a-z]+)?)", line):
                words = m.group(1).split()
                words = words[2:] if words[0] == "--log-level" else words
                cmd = next((p for p in paths if " ".join(words[: len(p.split())]) == p), None)
                if cmd is None:
                    continue
                rest = line[m.end():]
                cut = _COMMAND_END.search(rest)
                found.append((f"{path.relative_to(REPO)}:{lineno}", cmd, rest[: cut.start()] if cut else rest))
    return found


def test_every_shell_or_python_block_says_what_ci_does_with_it() -> None:
    unmarked, bad = [], []
    for path in doc_files():
        rel = str(path.relative_to(REPO))
        for b in read_blocks(path):
            if not b.is_code or rel in NOT_YET_MARKED:
                continue
            if b.kind is None:
                unmarked.append(b.id)
            elif b.kind not in KINDS or (b.kind == "illustrative" and len(b.reason) < 10):
                bad.append(f"{b.id} ({b.kind}: {b.reason!r})")
    assert not unmarked, f"blocks without a <!-- doc-test: ... --> marker: {unmarked}"
    assert not bad, f"unknown kinds, or illustrative without a reason: {bad}"


def test_the_harness_finds_the_blocks_the_issue_names() -> None:
    readme = {b.language: b for b in read_blocks(REPO / "README.md") if b.is_code and b.kind == "run"}
    assert "SyncTrainerClient" in readme["python"].text
    loop = [b for b in read_blocks(REPO / "docs/trainer_client.md") if b.language == "python"]
    assert loop and all(b.kind in ("run", "slow") for b in loop)


def test_every_option_the_docs_name_exists_in_the_subcommands_help() -> None:
    options = _options(build_parser())
    commands = _doc_commands()
    assert len(commands) > 30  # the docs show many: a broken extractor must not pass by finding none
    missing = []
    for where, cmd, rest in commands:
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest):
            if flag not in options[cmd]:
                missing.append(f"{where}: rollpool {cmd} {flag}")
    assert not missing, "options the docs name that the parser does not have:\n" + "\n".join(missing)


@pytest.mark.parametrize("line, cmd, flags", [("rollpool launch local --workers 4 --engine sim", "launch local", ["--workers", "--engine"]),
                                              ("`rollpool top --redis-url URL --once`", "top", ["--redis-url", "--once"])])
def test_the_extractor_reads_a_command_line(line: str, cmd: str, flags: list[str], tmp_path: object) -> None:
    m = re.search(r"rollpool\s+(" + cmd + r")(.*)", line)
    assert m is not None
    assert re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", m.group(2)) == flags


def test_the_index_maps_every_page() -> None:
    index = (REPO / "docs" / "index.md").read_text()
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md") if p.name != "index.md")
    assert [p for p in pages if f"]({p}" not in index] == []


def test_code_comments_say_why_not_which_issue() -> None:
    """A reader cannot look an issue number up; a comment says the reason itself. (The chaos CLI's ``issue20`` alias
    is a value, not a comment.)"""
    found = []
    for path in sorted((REPO / "rollpool").rglob("*.py")):
        rel = str(path.relative_to(REPO))
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"#.*\b[Ii]ssues? ?\d+\b", line):
                found.append(f"{rel}:{lineno}: {line.strip()}")
    assert found == []


def test_every_flag_of_every_subcommand_has_help() -> None:
    missing = []

    def walk(p: argparse.ArgumentParser, path: str) -> None:
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    walk(sub, f"{path} {name}")
            elif a.option_strings and not (a.help and a.help.strip()) and a.help != argparse.SUPPRESS:
                missing.append(f"{path} {'/'.join(a.option_strings)}")
            elif not a.option_strings and not a.help:
                missing.append(f"{path} {a.dest} (positional)")

    walk(build_parser(), "rollpool")
    assert missing == []
