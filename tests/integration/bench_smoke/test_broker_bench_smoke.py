"""Smoke run of bench/broker.py, tiny: both methods against the real broker, and the heartbeat runs at 60 workers.

It asserts what the measurement relies on and what does not depend on timing: the broker's own
timestamps cover the measured round trips (latency source "broker"), every key the issue asks the
JSON to keep is there, no simulated worker is declared dead, and a minor-1 worker's held digest
always agrees with the broker's leases. No wall-clock assertions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)  # ~20 s measured; the bench's own subprocess timeout is 240 s

ROOT = Path(__file__).resolve().parents[3]


def test_broker_bench_measures_with_the_brokers_own_timestamps(tmp_path: Path) -> None:
    out = tmp_path / "broker.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "broker.py"), "--systems", "rollpool", "--workers", "4", "--reps", "1", "--seconds", "0.3",
         "--sat-reps", "1", "--load-reps", "1", "--new-workers", "4", "--hosts", "1", "--clients", "1", "--heartbeat-workers", "60", "--hold", "2",
         "--hb-seconds", "0.6", "--hb-warmup-s", "0.5", "--warmup-s", "0.3", "--skip", "scale", "--json", str(out)],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    for key in ("ratio", "vs_trivial", "p99_ms", "broker_cpu_us_per_rt", "false_dead_1000", "false_dead_10000", "machine"):
        assert key in data
    runs = data["new_method"]["runs"]["rollpool"]
    assert set(runs) == {"saturation", "25%", "50%", "90%", "50%, 32 per submit"}
    for r in runs.values():
        assert r["latency_source"] == "broker" and r["rt_per_s"] > 0 and r["false_dead"] == 0
        assert r["p50_ms"] <= r["p99_ms"]
    for wire in ("old", "new"):
        hb = data["heartbeats"][f"60:{wire}"]
        assert hb["false_dead"] == 0 and hb["workers_alive"] == 60 and hb["worker_errors"] == 0
    assert data["heartbeats"]["60:new"]["held_mismatches"] == 0
