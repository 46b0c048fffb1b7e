"""Smoke run of bench/episodes.py's many-sessions bench (sim workers, token-level episodes): what it asserts is
what the bench reports and a user relies on, not timing: every episode delivered exactly once, none timed out or
failed, no worker declared dead, and all of them held at once across the workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)  # ~12 s measured on the 2-core box under load; the subprocess's own timeout is 200 s

ROOT = Path(__file__).resolve().parents[3]


def test_many_sessions_bench_delivers_every_episode_once(tmp_path: Path) -> None:
    out = tmp_path / "sessions.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "episodes.py"), "--bench", "sessions", "--sessions", "400", "--n", "4",
         "--workers", "2", "--session-turns", "2", "--reps", "1", "--json", str(out)],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=200,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["simulated"] is True and "error" not in data
    assert [r["workers"] for r in data["rows"]] == [2]
    for row in data["rows"]:
        assert (row["sessions"], row["delivered"], row["lost"], row["duplicated"], row["unexpected"]) == (400, 400, 0, 0, 0), row
        assert (row["timed_out"], row["failed"], row["worker_declared_dead"]) == (0, 0, 0), row
        assert row["turns"] == 800, row
        assert row["max_held_by_one_worker"] <= 400 // row["workers"], row
