"""`rollpool demo` end to end, short: it completes (through a LoRA adapter), writes its report, and leaves no process
behind (the whole-model demo, interrupted)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest


def _procs_with(tag: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if tag in cmd and "pytest" not in cmd:
            pids.append(int(entry))
    return pids

pytestmark = pytest.mark.timeout(300)  # ~40 s each measured; the demo's own waits are 240 s


def _demo(tmp_path: Path, pool: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "rollpool.demo", "--log-level", "WARNING", "--pool", pool, "--out", str(tmp_path / "out"),
            "--json", str(tmp_path / "summary.json"), "--prompts-per-step", "8", "--group-size", "4",
            "--eval-prompts", "16", *extra]


@pytest.mark.slow
def test_short_demo_completes_with_a_report_and_no_process_left(tmp_path: Path) -> None:
    """Through a LoRA adapter (``--lora``), publishing adapter versions only: one short run checks both the demo's
    report and the adapter path (the whole-model demo runs to its third step in the Ctrl-C test below)."""
    pool = f"demo-ci-{uuid.uuid4().hex[:8]}"
    out = subprocess.run(_demo(tmp_path, pool, "--steps", "3", "--quiet", "--lora"), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["lost"] == 0 and summary["duplicated"] == 0
    assert 0.0 <= summary["reward_first"] <= 1.0 and 0.0 <= summary["heldout_reward_final"] <= 1.0
    lora = summary["lora"]
    assert lora["rank"] == 8 and lora["adapter_bytes_per_version"] * 5 < lora["full_bytes_per_version"]
    report = json.loads((tmp_path / "out" / "demo-report-lora.json").read_text())
    assert len(report["summary"]["reward_per_step"]) == 3
    assert (tmp_path / "out" / "demo-report-lora.png").stat().st_size > 1000
    # every worker applied the adapter versions the trainer published (the hf engine's resident adapters)
    for log in sorted((tmp_path / "out").glob("worker-*.log")):
        assert "applied weight version 3" in log.read_text(), log.name
    assert _procs_with(pool) == []



@pytest.mark.slow
def test_async_demo_stopped_early_cancels_its_lookahead_and_completes(tmp_path: Path) -> None:
    """``--stop-at-reward`` in async mode ends training with the next steps' prompts still in the pool: they are
    cancelled and the pool drained before the held-out evaluation. (It used to ask for as many DONE groups as
    prompts were pending, cancelled ones included, and wait until its 300 s timeout.)"""
    pool = f"demo-ci-{uuid.uuid4().hex[:8]}"
    out = subprocess.run(_demo(tmp_path, pool, "--steps", "20", "--quiet", "--stop-at-reward", "0.01"),
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stop_reason"] == "stop_at_reward" and summary["steps"] == 1
    assert summary["mode"] == "async" and summary["lost"] == 0 and summary["duplicated"] == 0
    assert 0.0 <= summary["heldout_reward_final"] <= 1.0
    assert _procs_with(pool) == []

@pytest.mark.slow
def test_ctrl_c_leaves_no_process_behind(tmp_path: Path) -> None:
    pool = f"demo-ci-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen(_demo(tmp_path, pool, "--steps", "200"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 180
    for line in proc.stdout:  # wait until training runs, so every child has started
        if line.startswith("step   2"):
            break
        assert time.monotonic() < deadline
    assert _procs_with(pool), "the demo's broker and workers should be running"
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode != 0  # interrupted, not completed
    deadline = time.monotonic() + 15
    while _procs_with(pool) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _procs_with(pool) == []
