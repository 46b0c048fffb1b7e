"""A worker killed outright (SIGKILL, the OOM killer) cannot stop the SGLang child it started in a session of its own;
the child ends by itself once that worker is gone (a real SGLang server left behind would hold its GPU memory from the
worker restarted in its place). Real processes: a stand-in worker that launches the engine's child the way the
sglang engine does (its command line), then is killed."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

from rollpool.workers.engines.sglang.engine import SGLangEngine


def _alive(pid: int) -> bool:
    """Running (an exited child of a dead parent may stay a zombie until init reaps it: that counts as gone)."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(cond: object, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


def test_the_engine_child_names_its_worker() -> None:
    engine = SGLangEngine(model="/nonexistent-model", backend="sim", port=1, device="cpu")
    cmd = engine.command()
    assert cmd[cmd.index("--parent-pid") + 1] == str(os.getpid())


def test_the_engine_child_ends_when_its_worker_is_killed(tmp_path: pathlib.Path) -> None:
    port = _free_port()
    # the stand-in worker: starts the child as the sglang engine does (own session, --parent-pid of itself), then waits
    launcher = (
        "import os, subprocess, sys, time\n"
        "cmd = [sys.executable, '-m', 'rollpool.workers.engines.sglang.server', '--backend', 'sim',\n"
        f"       '--model-path', {str(tmp_path)!r}, '--port', '{port}', '--parent-pid', str(os.getpid())]\n"
        "p = subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(3600)\n"
    )
    worker = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert worker.stdout is not None
        child = int(worker.stdout.readline())

        def listening() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        assert _wait(listening, 60), "the child never served"
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        assert _wait(lambda: not _alive(child), 30), "the child outlived the worker that started it"
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        if worker.stdout is not None:
            worker.stdout.close()
        if child and _alive(child):
            os.kill(child, signal.SIGKILL)
