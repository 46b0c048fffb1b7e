"""The one child-process `Supervisor` (launch local, demo, chaos) on real processes.

Restart within the policy, give up after it, manual children left down until started again,
a staged stop that takes stubborn and paused children too, and the synchronous facade the demo uses.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pathlib
import signal
import sys
import time
from collections.abc import Callable

import pytest

from rollpool.launch.policy import RestartPolicy
from rollpool.launch.supervisor import ProcessSpec, Supervisor, SupervisorThread
from tests.integration.launch._procs import alive

SLEEPER = (sys.executable, "-c", "import time\nwhile True: time.sleep(0.1)")
# fails quickly, each time differently (a fresh uuid): restarted by the backoff up to max_restarts
CRASHER = (sys.executable, "-c", "import uuid\nraise SystemExit(f'crash {uuid.uuid4().hex}')")
# ignores SIGTERM: only the SIGKILL after stop_timeout_s ends it
STUBBORN = (sys.executable, "-c", "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "print('ready', flush=True)\nwhile True: time.sleep(0.1)")
QUICK = RestartPolicy(backoff_s=0.05, backoff_max_s=0.2, max_restarts=2, stable_after_s=60.0)




async def _until(pred: Callable[[], object], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_a_crashed_child_is_restarted_within_the_policy_and_every_child_stops_on_shutdown(tmp_path: pathlib.Path) -> None:
    specs = [ProcessSpec("sleeper", SLEEPER), ProcessSpec("crasher", CRASHER),
             ProcessSpec("stubborn", STUBBORN, stop_stage=1, critical=True)]
    sup = Supervisor(specs, tmp_path, policy=QUICK, stop_timeout_s=1.0)
    run = asyncio.create_task(sup.run())
    await sup.wait_started()
    first = sup.pid("sleeper")
    assert first is not None
    os.kill(first, signal.SIGKILL)  # a crash
    await _until(lambda: sup.restarts["sleeper"] == 1 and sup.pid("sleeper"), "the sleeper restarted")
    second = sup.pid("sleeper")
    assert second is not None and second != first and alive(second)
    # the crasher fails quickly every time: restarted max_restarts times, then given up (not critical: the rest runs on)
    await _until(lambda: json.loads((tmp_path / "launch.json").read_text())["processes"]["crasher"]["given_up"],
                 "the crasher given up")
    assert sup.restarts["crasher"] == QUICK.max_restarts
    assert not run.done()
    stubborn = sup.pid("stubborn")
    assert stubborn is not None
    await _until(lambda: "ready" in (tmp_path / "stubborn.log").read_text(), "the stubborn child's SIGTERM handler")
    sup.stop()
    assert await run == 0
    assert not alive(second) and not alive(stubborn)  # the one that ignored SIGTERM was killed after stop_timeout_s
    state = json.loads((tmp_path / "launch.json").read_text())
    assert all(p["pid"] is None for p in state["processes"].values())
    log = (tmp_path / "sleeper.log").read_text()
    assert "starting sleeper" in log and "(restart 1)" in log


async def test_a_critical_child_given_up_stops_the_supervisor_with_status_1(tmp_path: pathlib.Path) -> None:
    sup = Supervisor([ProcessSpec("sleeper", SLEEPER), ProcessSpec("broker", CRASHER, stop_stage=2, critical=True)],
                     tmp_path, policy=QUICK, stop_timeout_s=5.0)
    assert await asyncio.wait_for(sup.run(), 60) == 1
    assert sup.restarts["broker"] == QUICK.max_restarts


async def test_a_manual_child_stays_down_until_started_and_a_paused_one_still_stops(tmp_path: pathlib.Path) -> None:
    """The chaos run's use: no restarts of its own; kill, SIGSTOP and start are the caller's."""
    sup = Supervisor([ProcessSpec("w0", SLEEPER, restart=False), ProcessSpec("w1", SLEEPER, restart=False)],
                     tmp_path, policy=QUICK, stop_timeout_s=5.0, state_file=None, label="rollpool chaos")
    run = asyncio.create_task(sup.run())
    await sup.wait_started()
    first = sup.pid("w0")
    assert first is not None
    await sup.kill("w0")
    assert sup.pid("w0") is None and not alive(first)
    await asyncio.sleep(5 * QUICK.backoff_max_s)  # longer than any policy backoff: nothing restarts it
    assert sup.pid("w0") is None and sup.restarts["w0"] == 0
    second = await sup.start("w0", argv=SLEEPER)
    assert alive(second) and second != first and sup.restarts["w0"] == 1
    paused = sup.pid("w1")
    assert paused is not None
    sup.send_signal("w1", signal.SIGSTOP)
    sup.stop()  # SIGCONT before SIGTERM: the paused child exits on SIGTERM, no SIGKILL needed
    assert await run == 0
    assert not alive(second) and not alive(paused)
    assert not (tmp_path / "launch.json").exists()
    assert "rollpool chaos: starting w0" in (tmp_path / "w0.log").read_text()


def test_the_threaded_facade_for_synchronous_callers(tmp_path: pathlib.Path) -> None:
    """The demo's use: a synchronous trainer loop kills a worker and starts it again, then stops everything."""
    sup = SupervisorThread(Supervisor([ProcessSpec("broker", SLEEPER, restart=False),
                                       ProcessSpec("worker-0", SLEEPER, restart=False, env={"ROLLPOOL_T": "1"})],
                                      tmp_path, stop_timeout_s=5.0, state_file=None))
    sup.start()
    first = sup.supervisor.pid("worker-0")
    assert first is not None
    assert "ROLLPOOL_T=1" in pathlib.Path(f"/proc/{first}/environ").read_bytes().replace(b"\0", b"\n").decode()
    sup.kill("worker-0")
    assert not alive(first)
    second = sup.start_child("worker-0")
    assert alive(second) and second != first
    broker = sup.supervisor.pid("broker")
    assert broker is not None
    assert sup.stop() == 0
    assert not alive(second) and not alive(broker)


async def test_a_usage_error_is_given_up_at_once_and_its_last_lines_are_logged(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    usage = (sys.executable, "-c", "import sys\nprint('line one')\nprint('worker: error: no such model dir /nope', "
             "file=sys.stderr)\nsys.exit(2)")
    caplog.set_level(logging.WARNING, logger="rollpool.launch.supervisor")
    sup = Supervisor([ProcessSpec("broker", usage, stop_stage=2, critical=True)], tmp_path, policy=QUICK, stop_timeout_s=5.0)
    assert await asyncio.wait_for(sup.run(), 60) == 1
    assert sup.restarts["broker"] == 0  # not restarted even once
    (rec,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "broker exited with 2" in rec.getMessage() and "usage error" in rec.getMessage()
    assert "| worker: error: no such model dir /nope" in rec.getMessage() and "| line one" in rec.getMessage()


async def test_a_failure_that_repeats_identically_is_given_up_after_one_restart(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    # numbers differ between the runs (pid, time), the failure does not
    same = (sys.executable, "-c", "import os, time\nprint('pid', os.getpid(), time.time())\n"
            "raise SystemExit('FileNotFoundError: /models/policy')")
    caplog.set_level(logging.WARNING, logger="rollpool.launch.supervisor")
    policy = RestartPolicy(backoff_s=0.05, backoff_max_s=0.2, max_restarts=10, stable_after_s=60.0)
    sup = Supervisor([ProcessSpec("broker", same, stop_stage=2, critical=True)], tmp_path, policy=policy, stop_timeout_s=5.0)
    assert await asyncio.wait_for(sup.run(), 60) == 1
    assert sup.restarts["broker"] == 1
    warned, gave_up = [r.getMessage() for r in caplog.records if r.name == "rollpool.launch.supervisor" and "exited" in r.getMessage()]
    assert "restarting in" in warned and "| FileNotFoundError: /models/policy" in warned
    assert "same way" in gave_up and "| FileNotFoundError: /models/policy" in gave_up
