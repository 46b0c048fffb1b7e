"""Smoke run of bench/fanout.py (2 nodes x 2 workers, 16 MiB, 1 Gbit/s links) where network namespaces can be
made (root with ip and tc, as in CI); skipped with the bench's own reason elsewhere.

What it asserts is what the relay is for and does not depend on timing: straight from the publisher,
the publisher's link carries one copy per worker; through one relay per node, one copy per node; and
every worker ends with the verified version. No wall-clock assertions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)  # ~13 s measured; the bench's own subprocess timeout is 240 s

ROOT = Path(__file__).resolve().parents[3]


def test_fanout_relay_serves_one_copy_per_node(tmp_path: Path) -> None:
    out = tmp_path / "fanout.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "fanout.py"), "--nodes", "2", "--workers-per-node", "2", "--mib", "16", "--reps", "1",
         "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    if data.get("skipped"):
        pytest.skip(f"bench/fanout.py: {data['skipped']}")
    assert data["simulated"] is False and data["emulated_links"] is True
    for mode, copies in (("direct", 4.0), ("relay", 2.0)):
        (run,) = data[mode]["runs"]
        assert run["publisher_served_x_version"] == copies, (mode, run)
        assert run["publisher_bytes_served"] == copies * run["version_bytes"] == copies * 16 * 1024 * 1024
        assert 0 < run["first_verified_s"] <= run["all_verified_s"]
        assert data[mode]["bound_s"] > 0
