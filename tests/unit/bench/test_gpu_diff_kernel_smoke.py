"""`bench/gpu_diff_kernel.py --smoke`: the bench's code path on the CPU, the kernels in Triton's interpreter. Both
paths' deltas are byte-identical every version, the kernels compared every bucket of their row, and a smoke run
reports no ratio (it is not a figure)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]


def test_the_smoke_run_compares_both_paths_byte_for_byte_and_reports_no_figure(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "ROLLPOOL_DIFF_TRITON": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_diff_kernel.py"), "--smoke", "--versions", "3",
                          "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "cpu-diff-kernel.json").read_text())
    s = result["summary"]
    assert s["all_equal"] is True and s["kernels_ran"] is True
    assert s["kernels_vs_torch"] is None and "smoke" in s["why_not_measured"]
    assert [v["kernel_calls"] for v in result["versions"]] == [0, result["buckets"], result["buckets"]]
    assert all(v["equal"] for v in result["versions"][1:]) and 0.01 < s["changed_fraction"] < 0.04
