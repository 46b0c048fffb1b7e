"""`Supervisor`: run a set of child processes, restart the ones that die, stop them all cleanly.

Guarantees:

- every child runs in its own session (process group) with a parent-death
  signal (SIGTERM), so a supervisor killed with SIGKILL still takes its
  children with it;
- a child that exits while the supervisor is not stopping is restarted after
  the `RestartPolicy` backoff (bounded); a ``critical`` child given up on stops
  the whole supervisor (exit 1), a non-critical one is left dead and logged;
- stdout and stderr of each child go to ``<log_dir>/<name>.log`` (appended
  across restarts, with a marker line per start);
- ``<log_dir>/launch.json`` always names the live pid of every child (tests and
  operators read it);
- `stop()` (SIGTERM/SIGINT, installed by the CLI) stops children in stages:
  each stage gets SIGTERM, then ``stop_timeout_s`` to exit, then SIGKILL of its
  whole process group. Workers drain first, the broker last, so results the
  workers hand back still reach it. `run()` returns only when no child is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import pathlib
import signal
import time
from dataclasses import dataclass, field
from typing import IO

from rollpool.launch.policy import RestartPolicy, RestartTracker

__all__ = ["ProcessSpec", "Supervisor", "set_parent_death_signal"]

log = logging.getLogger(__name__)


def set_parent_death_signal() -> None:
    """In a child (preexec): get SIGTERM when the parent dies, whatever the cause (Linux)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    """One supervised child: its name (log file and key in launch.json) and command line.

    ``stop_stage``: children stop in increasing stage order (workers 0, relay 1, broker 2).
    """

    name: str
    argv: tuple[str, ...]
    stop_stage: int = 0
    critical: bool = False
    env: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class _Child:
    spec: ProcessSpec
    tracker: RestartTracker
    proc: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    given_up: bool = False


class Supervisor:
    def __init__(self, specs: list[ProcessSpec], log_dir: pathlib.Path, *, policy: RestartPolicy | None = None,
                 stop_timeout_s: float = 30.0, extra_state: dict[str, object] | None = None) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"process names must be unique, got {names}")
        self.log_dir = log_dir
        self.policy = policy or RestartPolicy()
        self.stop_timeout_s = stop_timeout_s
        self.extra_state = dict(extra_state or {})
        self._children = {s.name: _Child(s, RestartTracker(self.policy)) for s in specs}
        self._stopping = asyncio.Event()
        self._failed: str | None = None
        self._logs: dict[str, IO[bytes]] = {}

    # public

    def stop(self) -> None:
        """Begin the staged shutdown (idempotent; safe from a signal handler)."""
        self._stopping.set()

    @property
    def restarts(self) -> dict[str, int]:
        return {name: c.tracker.restarts for name, c in self._children.items()}

    async def run(self) -> int:
        """Run until `stop()` (0) or a critical child is given up (1); every child is gone on return."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            async with asyncio.TaskGroup() as tg:
                for child in self._children.values():
                    tg.create_task(self._watch_loop(child), name=f"watch-{child.spec.name}")
                await self._stopping.wait()
                await self._stop_all()
        finally:
            await self._kill_leftovers()
            for f in self._logs.values():
                f.close()
            self._write_state()
        return 1 if self._failed else 0

    # internals

    async def _start(self, child: _Child) -> None:
        spec = child.spec
        logf = self._open_log(child)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
        child.proc = await asyncio.create_subprocess_exec(
            *spec.argv, stdin=asyncio.subprocess.DEVNULL, stdout=logf, stderr=asyncio.subprocess.STDOUT, env=env,
            start_new_session=True, preexec_fn=set_parent_death_signal,
        )
        child.started_at = time.monotonic()
        log.info("started %s (pid %d)", spec.name, child.proc.pid)
        self._write_state()

    def _open_log(self, child: _Child) -> IO[bytes]:
        """The child's log file (opened once, appended across restarts) with a start marker written."""
        name = child.spec.name
        logf = self._logs.get(name)
        if logf is None:
            logf = self._logs[name] = open(self.log_dir / f"{name}.log", "ab")  # closed in run()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        logf.write(f"--- rollpool launch: starting {name} at {stamp} (restart {child.tracker.restarts}) ---\n".encode())
        logf.flush()
        return logf

    async def _watch_loop(self, child: _Child) -> None:
        """Keep one child running until the supervisor stops (or the child is given up)."""
        name = child.spec.name
        while not self._stopping.is_set():
            await self._start(child)
            assert child.proc is not None
            if self._stopping.is_set():
                # stop() came while this child was being started: the staged stop may not have seen it
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGTERM)
                await self._wait_or_kill(child)
                return
            rc = await child.proc.wait()
            if self._stopping.is_set():
                return
            ran_for_s = time.monotonic() - child.started_at
            delay_s = child.tracker.on_exit(ran_for_s)
            if delay_s is None:
                child.given_up = True
                log.error("%s exited with %s %d times in a row; giving up on it", name, rc, child.tracker.failures)
                self._write_state()
                if child.spec.critical:
                    self._failed = name
                    self.stop()
                elif all(c.given_up for c in self._children.values() if c.spec.stop_stage == child.spec.stop_stage):
                    self._failed = name
                    self.stop()
                return
            log.warning("%s exited with %s after %.1f s; restarting in %.1f s", name, rc, ran_for_s, delay_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=delay_s)

    async def _stop_all(self) -> None:
        stages = sorted({c.spec.stop_stage for c in self._children.values()})
        for stage in stages:
            group = [c for c in self._children.values() if c.spec.stop_stage == stage and _alive(c)]
            for c in group:
                assert c.proc is not None
                log.info("stopping %s (pid %d)", c.spec.name, c.proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    c.proc.send_signal(signal.SIGTERM)
            await asyncio.gather(*(self._wait_or_kill(c) for c in group))

    async def _wait_or_kill(self, child: _Child) -> None:
        assert child.proc is not None
        try:
            await asyncio.wait_for(child.proc.wait(), timeout=self.stop_timeout_s)
        except TimeoutError:
            log.warning("%s did not exit within %.1f s of SIGTERM; killing it", child.spec.name, self.stop_timeout_s)
        # the child's session may hold grandchildren (an engine server): take the whole group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.proc.pid, signal.SIGKILL)
        await child.proc.wait()

    async def _kill_leftovers(self) -> None:
        """Last resort (a cancelled run, an exception): no child outlives the supervisor."""
        for child in self._children.values():
            if child.proc is None:
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.proc.pid, signal.SIGKILL)
            if child.proc.returncode is None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(asyncio.wait_for(child.proc.wait(), timeout=5.0))

    def _write_state(self) -> None:
        state = {
            **self.extra_state,
            "supervisor_pid": os.getpid(),
            "stopping": self._stopping.is_set(),
            "processes": {
                name: {
                    "pid": c.proc.pid if c.proc is not None and c.proc.returncode is None else None,
                    "restarts": c.tracker.restarts,
                    "given_up": c.given_up,
                    "log": str(self.log_dir / f"{name}.log"),
                }
                for name, c in self._children.items()
            },
        }
        tmp = self.log_dir / "launch.json.tmp"
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.log_dir / "launch.json")


def _alive(child: _Child) -> bool:
    return child.proc is not None and child.proc.returncode is None
