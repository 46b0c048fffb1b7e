"""`rollpool launch ray` on a local Ray cluster (this CPU machine): sim workers as actors, one killed and replaced."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from rollpool.trainer_client import SyncTrainerClient
from tests.integration.launch._procs import alive
from tests.integration.launch.test_local import REPO, SIM, _procs_mentioning, _wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),  # ~50 s measured; its own waits add up to 210 s
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray (pip install 'rollpool[ray]')"),
]


def _state(path: pathlib.Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


@pytest.fixture
def ray_dir() -> Iterator[pathlib.Path]:
    import shutil
    import tempfile

    d = pathlib.Path(tempfile.mkdtemp(prefix="rpr-", dir="/tmp"))
    yield d
    for pid in _procs_mentioning(str(d)):
        os.kill(pid, signal.SIGKILL)
    if os.environ.get("ROLLPOOL_KEEP_TEST_LOGS"):
        shutil.copytree(d, pathlib.Path(os.environ["ROLLPOOL_KEEP_TEST_LOGS"]) / d.name, ignore=shutil.ignore_patterns("w", "c"))
    shutil.rmtree(d, ignore_errors=True)


def test_ray_workers_serve_exactly_once_and_a_killed_actor_is_replaced(ray_dir: pathlib.Path) -> None:
    d = ray_dir
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled",
           "RAY_DISABLE_USAGE_STATS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    state_file = d / "ray.json"
    with open(d / "broker.log", "ab") as blog, open(d / "ray.log", "ab") as rlog:
        broker = subprocess.Popen([sys.executable, "-m", "rollpool", "broker", "--worker-endpoint", f"ipc://{d}/w",
                                   "--client-endpoint", f"ipc://{d}/c", "--heartbeat-interval-s", "0.3", "--pool", "rt"],
                                  env=env, stdout=blog, stderr=subprocess.STDOUT, start_new_session=True)
        launcher = subprocess.Popen([sys.executable, "-m", "rollpool", "--log-level", "INFO", "launch", "ray",
                                     "--workers", "2", "--gpus-per-worker", "0", "--cpus-per-worker", "0.5",
                                     "--strategy", "SPREAD", "--engine", "sim", "--broker", f"ipc://{d}/w",
                                     "--engine-options", SIM, "--worker-args", "--heartbeat-interval-s 0.3",
                                     "--poll-interval-s", "0.3", "--restart-backoff-s", "0.2", "--pool", "rt",
                                     "--stop-timeout-s", "10", "--state-file", str(state_file)],
                                    env=env, stdout=rlog, stderr=subprocess.STDOUT, cwd=d)
    try:
        state = _wait_for(lambda: (s := _state(state_file)) and all(w.get("worker_pid") for w in s["workers"]) and s,
                          120, "both worker actors up")
        first = state["workers"][0]
        prompts, group_size = 40, 4
        seen: Counter[str] = Counter()
        done: set[str] = set()
        with SyncTrainerClient(f"ipc://{d}/c", connect_timeout_s=30) as client:
            client.submit([[5, 6, 7]] * prompts, group_size=group_size)
            batch = client.get_batch(8, timeout=60)
            seen.update(t.trajectory_id for t in batch.trajectories)
            done |= {g.prompt_id for g in batch.groups}
            os.kill(first["actor_pid"], signal.SIGKILL)  # the actor process dies (and its worker with it)
            state = _wait_for(lambda: (s := _state(state_file))["replacements"] >= 1
                              and s["workers"][0].get("worker_pid") and s, 60, "the dead actor replaced")
            assert state["workers"][0]["actor_pid"] != first["actor_pid"]
            while len(done) < prompts:
                batch = client.get_batch(prompts - len(done), timeout=60)
                assert not batch.other, f"unexpected terminal states: {batch.other}"
                seen.update(t.trajectory_id for t in batch.trajectories)
                done |= {g.prompt_id for g in batch.groups}
        assert len(seen) == prompts * group_size and set(seen.values()) == {1}
        worker_pids = [first["worker_pid"], *(w["worker_pid"] for w in state["workers"])]
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=90) == 0, (d / "ray.log").read_text()[-3000:]
        _wait_for(lambda: not [p for p in worker_pids if alive(p)], 30, "every worker process gone")
    finally:
        for proc in (launcher, broker):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
