"""`rollpool launch local` as a user runs it: a subprocess serving a trainer, surviving a worker crash, stopping clean."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from rollpool.trainer_client import SyncTrainerClient
from tests.integration.launch._procs import alive

REPO = pathlib.Path(__file__).resolve().parents[3]
SIM = "length=fixed,length_median=20,decode_s_per_token=0.01,capacity=8"




def _procs_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line contains ``text`` (a /proc scan, no psutil)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and alive(int(entry)):
            out.append(int(entry))
    return out


def _wait_for(predicate: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _state(log_dir: pathlib.Path) -> dict[str, Any]:
    try:
        return dict(json.loads((log_dir / "launch.json").read_text()))
    except (OSError, ValueError):
        return {}


@pytest.fixture
def launch_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[pathlib.Path]:
    # ipc paths are limited to ~100 bytes: a short folder under /tmp
    import shutil
    import tempfile

    d = pathlib.Path(tempfile.mkdtemp(prefix="rpl-", dir="/tmp"))
    yield d
    for pid in _procs_mentioning(str(d)):  # never leave a process behind, even when the test failed
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(d, ignore_errors=True)


def _launch(d: pathlib.Path, workers: int, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "rollpool", "--log-level", "INFO", "launch", "local", "--workers", str(workers),
            "--engine", "sim", "--engine-options", SIM, "--worker-endpoint", f"ipc://{d}/w",
            "--client-endpoint", f"ipc://{d}/c", "--log-dir", str(d / "logs"), "--heartbeat-interval-s", "0.3",
            "--restart-backoff-s", "0.2", "--stop-timeout-s", "10", "--pool", "lt", *extra]
    with open(d / "supervisor.out", "ab") as out:
        return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=d)


def test_local_pool_serves_exactly_once_survives_a_killed_worker_and_stops_clean(launch_dir: pathlib.Path) -> None:
    d = launch_dir
    logs = d / "logs"
    sup = _launch(d, 3)
    try:
        state = _wait_for(lambda: (s := _state(logs)) and all(p["pid"] for p in s["processes"].values()) and s,
                          30, "every process started")
        first_pids = {name: p["pid"] for name, p in state["processes"].items()}
        prompts, group_size = 60, 4
        seen: Counter[str] = Counter()
        done_prompts: set[str] = set()
        with SyncTrainerClient(f"ipc://{d}/c", connect_timeout_s=30) as client:
            client.submit([[1, 2, 3]] * prompts, group_size=group_size)
            batch = client.get_batch(10, timeout=60)
            for t in batch.trajectories:
                seen[t.trajectory_id] += 1
            done_prompts |= {g.prompt_id for g in batch.groups}
            # a worker crashes mid-run (it holds leases now: the queue is far from empty)
            os.kill(first_pids["worker-0"], signal.SIGKILL)
            state = _wait_for(lambda: (s := _state(logs))["processes"]["worker-0"]["restarts"] >= 1
                              and s["processes"]["worker-0"]["pid"] and s, 30, "worker-0 restarted")
            assert state["processes"]["worker-0"]["pid"] != first_pids["worker-0"]
            while len(done_prompts) < prompts:
                batch = client.get_batch(prompts - len(done_prompts), timeout=60)
                for t in batch.trajectories:
                    seen[t.trajectory_id] += 1
                done_prompts |= {g.prompt_id for g in batch.groups}
                assert not batch.other, f"unexpected terminal states: {batch.other}"
            assert client.pending() == 0
        # every trajectory of every prompt exactly once, nothing lost
        assert len(seen) == prompts * group_size
        assert set(seen.values()) == {1}
        assert "restart 1" in (logs / "worker-0.log").read_text()
        # SIGTERM the supervisor: exit 0, every child (first and restarted) gone
        all_pids = set(first_pids.values()) | {p["pid"] for p in state["processes"].values()}
        sup.send_signal(signal.SIGTERM)
        sup.wait(timeout=60)
        assert sup.returncode == 0, (d / "supervisor.out").read_text()[-3000:]
        assert not [p for p in all_pids if alive(p)]
        assert _procs_mentioning(str(d)) == []
        for name in ("broker", "worker-0", "worker-1", "worker-2"):
            assert (logs / f"{name}.log").stat().st_size > 0
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()


def test_sigkilled_supervisor_takes_its_children_with_it(launch_dir: pathlib.Path) -> None:
    """Even without a chance to clean up, no child outlives the supervisor (parent-death signal)."""
    d = launch_dir
    sup = _launch(d, 1)
    state = _wait_for(lambda: (s := _state(d / "logs")) and all(p["pid"] for p in s["processes"].values()) and s,
                      30, "every process started")
    pids = [p["pid"] for p in state["processes"].values()]
    sup.kill()
    sup.wait()
    _wait_for(lambda: not [p for p in pids if alive(p)], 30, "children to exit after the supervisor died")
    _wait_for(lambda: _procs_mentioning(str(d)) == [], 30, "no process of the pool left")


def test_bad_configuration_exits_2(launch_dir: pathlib.Path) -> None:
    out = subprocess.run([sys.executable, "-m", "rollpool", "launch", "local", "--workers", "0"],
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, cwd=launch_dir, timeout=60)
    assert out.returncode == 2
    assert b"workers must be in 1..1024" in out.stderr
