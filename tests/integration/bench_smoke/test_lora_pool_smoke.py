"""Smoke run of bench/lora_pool.py (a real broker process, 2 hf workers, one adapter version per arm).

What it asserts does not depend on timing: against a rolling broker every worker applies the `no_slot` arm's adapter
version without asking for an apply slot (`Feature.ADAPTER_NO_GRANT`) and the `slot` arm's after asking, every version
reaches every worker, and the broker records each version converged (its accounting moved on the ungranted
`ApplyDone`s too). No wall-clock assertions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(200)

ROOT = Path(__file__).resolve().parents[3]


def test_adapter_versions_reach_every_worker_with_and_without_the_apply_slot(tmp_path: Path) -> None:
    out = tmp_path / "lora_pool.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "lora_pool.py"), "--workers", "2", "--versions", "1", "--warmup", "0",
         "--json", str(out)],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert [r["slots_skipped"] for r in data["no_slot"]["rows"]] == [2]
    assert [r["slots_skipped"] for r in data["slot"]["rows"]] == [0]
    assert data["broker_versions_converged"] == 2
    for arm in ("slot", "no_slot"):
        assert 0 < data[arm]["publish_to_first_applied_s"] <= data[arm]["publish_to_all_applied_s"]
