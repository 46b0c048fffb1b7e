"""The short version of examples/trl_async_grpo.py: TRL's AsyncGRPOTrainer(...).train() through a real pool of
two CPU hf workers (real processes), checked on its --json report. The full run's figures are in docs/integrations.md."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("trl")
pytest.importorskip("torch")

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.mark.timeout(400)
def test_trl_async_grpo_example_trains_through_the_pool_and_loses_nothing(tmp_path: pathlib.Path) -> None:
    report_path = tmp_path / "report.json"
    steps = 6
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "trl_async_grpo.py"), "--steps", str(steps), "--groups-per-step", "4",
         "--json", str(report_path), "--log-dir", str(tmp_path / "logs"), "--quiet"],
        capture_output=True, text=True, timeout=380, cwd=ROOT,
    )
    logs = "\n".join(p.read_text()[-2000:] for p in sorted((tmp_path / "logs").glob("*.log")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:] + logs
    report = json.loads(report_path.read_text())
    assert set(report) >= {"reward_first", "reward_final", "steps", "lost", "duplicated", "wall_s"}
    assert report["steps"] == steps
    assert report["lost"] == 0 and report["duplicated"] == 0
    assert report["weight_versions_published"] == steps + 1  # TRL's cold sync (version 1) and one per step
    assert len(report["reward_per_step"]) == steps and all(0.0 <= r <= 1.0 for r in report["reward_per_step"])
    assert report["adapter"]["groups_delivered"] >= steps * 4
