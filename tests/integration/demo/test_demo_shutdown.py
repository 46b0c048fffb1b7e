"""The demo's shutdown with a real broker and a real worker process: the worker's Goodbye reaches the broker.

Before the fix the demo's children stopped in one stage: SIGTERM to every child at once, broker first: a broker with
nothing leased closed at once, so each worker's Goodbye found no connection (``send of Goodbye failed:
Resource temporarily unavailable`` after the 5 s send timeout) and the broker never saw it.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest

from rollpool.demo.runner import demo_process_specs
from rollpool.launch.supervisor import Supervisor, SupervisorThread

pytestmark = pytest.mark.timeout(60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(path: Path, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"{text!r} not in {path.name}:\n{path.read_text(errors='replace')[-3000:]}"
        time.sleep(0.05)


def test_stop_all_lets_the_worker_say_goodbye_to_a_live_broker(tmp_path: Path) -> None:
    wep, cep = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[3]), os.environ.get("PYTHONPATH", "")])}
    broker = [sys.executable, "-m", "rollpool.broker", "--log-level", "INFO", "--worker-endpoint", wep,
              "--client-endpoint", cep, "--heartbeat-interval-s", "0.5"]
    worker = [sys.executable, "-m", "rollpool.workers", "--log-level", "INFO", "--broker", wep,
              "--engine", "sim", "--worker-id", "demo-w0", "--heartbeat-interval-s", "0.5"]
    children = SupervisorThread(Supervisor(demo_process_specs(broker, env, [("worker-0", worker, env)]), tmp_path,
                                           stop_timeout_s=10.0, state_file=None, label="test"))
    children.start()
    try:
        _wait_for(tmp_path / "broker.log", "worker demo-w0 joined", 30)
        # and the worker has its Welcome (a worker stopped before it has one says no Goodbye: it never joined in its view)
        _wait_for(tmp_path / "worker-0.log", "joined the broker", 30)
    finally:
        status = children.stop()
    broker_log = (tmp_path / "broker.log").read_text(errors="replace")
    worker_log = (tmp_path / "worker-0.log").read_text(errors="replace")
    assert "'worker_id': 'demo-w0', 'reason': 'goodbye'" in broker_log, broker_log[-3000:]
    assert "send of Goodbye failed" not in worker_log, worker_log[-3000:]
    assert status == 0
