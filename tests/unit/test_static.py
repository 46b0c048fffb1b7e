"""Lint and strict typing stay green (ruff on everything; mypy strict on the files listed under [tool.mypy])."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("ruff") is None and not (pathlib.Path(sys.executable).parent / "ruff").exists(), reason="ruff not installed")
def test_ruff_clean() -> None:
    ruff = shutil.which("ruff") or str(pathlib.Path(sys.executable).parent / "ruff")
    out = subprocess.run([ruff, "check", "rollpool", "tests", "bench"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.timeout(300)  # a cold run (no .mypy_cache, as in CI) took 24 s on a loaded 2-core box
def test_mypy_strict_on_the_core() -> None:
    pytest.importorskip("mypy")
    out = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
