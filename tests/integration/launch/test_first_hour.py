"""What a new user meets in the first hour, run as they run it: real `rollpool` processes on loopback.

A worker whose broker does not answer names the endpoint it cannot reach; a worker that finds another
pool's broker at its endpoint stops with one line and exit 2 instead of saying hello forever.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def spawn() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts; each is killed and reaped at the end, whatever happened."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=30)


def _rollpool(*argv: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "rollpool", *argv], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_a_worker_without_a_broker_names_the_endpoint_it_cannot_reach(spawn: list[subprocess.Popen[str]]) -> None:
    endpoint = f"tcp://127.0.0.1:{_free_port()}"  # nobody listens there
    worker = _rollpool("worker", "--broker", endpoint, "--engine", "sim", "--send-timeout-s", "0.2",
                       "--reconnect-backoff-s", "0.1")
    spawn.append(worker)
    assert worker.stdout is not None
    deadline = time.monotonic() + 45
    lines: list[str] = []
    while time.monotonic() < deadline:
        line = worker.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "send of Hello" in line:
            break
    said = [ln for ln in lines if "send of Hello" in ln]
    assert said, "".join(lines)
    assert endpoint in said[0] and "is a broker listening there?" in said[0]


def test_a_worker_refuses_another_pools_broker_with_one_line_and_exit_2(spawn: list[subprocess.Popen[str]]) -> None:
    wport, cport = _free_port(), _free_port()
    endpoint = f"tcp://127.0.0.1:{wport}"
    broker = _rollpool("broker", "--worker-endpoint", endpoint, "--client-endpoint", f"tcp://127.0.0.1:{cport}",
                       "--pool", "someone-elses")
    spawn.append(broker)
    worker = _rollpool("worker", "--broker", endpoint, "--engine", "sim", "--pool", "mine", "--log-level", "WARNING")
    spawn.append(worker)
    out, _ = worker.communicate(timeout=45)
    assert worker.returncode == 2, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("rollpool worker: error: ") and endpoint in last and "wrong_pool" in last, out
    assert "someone-elses" in last and "Traceback" not in out
