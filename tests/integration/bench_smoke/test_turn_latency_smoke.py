"""Smoke run of bench/turn_latency.py (one tree, one rep, a few sequential turns on the sim child): every turn is
measured at every stage, and the stages nest as the pool's calls do (the endpoint's handler holds the engine's
generate, which holds the hop's call, which holds the child's own time), so the bench's derived stages are not
negative. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[3]


def test_the_turn_latency_bench_measures_every_turn_at_every_stage(tmp_path: Path) -> None:
    out = tmp_path / "latency.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "turn_latency.py"), "--reps", "1", "--episodes", "2", "--warmup", "1", "--turns", "3",
         "--tokens-per-turn", "16", "--model-dir", str(tmp_path / "tiny"), "--json", str(out)],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=200,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["simulated"] is True
    (row,) = data["rows"]
    assert row["turns"] == 2 * 3
    med = row["median_us"]
    assert med["endpoint_handler"] >= med["engine_generate"] >= med["hop_call"] >= med["child_generate"] > 0
    assert med["turn_round_trip"] >= med["endpoint_handler"]
    for stage in ("endpoint_and_episode", "engine_less_hop", "hop_less_child", "sdk_and_http_less_endpoint", "pool_less_child"):
        assert med[stage] >= 0, (stage, med)
