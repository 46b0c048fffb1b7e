"""`Supervisor`: run a set of child processes, restart the ones that die, stop them all cleanly.

The one child-process manager of the applications: ``rollpool launch local``
(`rollpool.launch.local`), the demo (`rollpool.demo.runner`, through
`SupervisorThread`: its trainer loop is synchronous) and the chaos run
(`rollpool.chaos.runner`, which kills, pauses and starts children itself).

Guarantees:

- every child runs in its own session (process group) with a parent-death
  signal (SIGTERM), so a supervisor killed with SIGKILL still takes its
  children with it;
- a child that exits while the supervisor is not stopping is restarted after
  the `RestartPolicy` backoff (bounded); a ``critical`` child given up on stops
  the whole supervisor (exit 1), a non-critical one is left dead and logged.
  A usage error (exit status 2) and a quick failure that repeats the previous
  one identically are given up at once (`RestartTracker`: a restart cannot
  help). Every unplanned exit is logged with its status and the last lines
  the child wrote (``TAIL_LINES``), so the reason shows without opening its log.
  A child whose spec says ``restart=False`` is left down instead, until the
  caller starts it again (`start`): the demo and the chaos run inject their
  faults on purpose and choose when a killed child comes back;
- stdout and stderr of each child go to ``<log_dir>/<name>.log`` (appended
  across restarts, with a marker line per start);
- ``<log_dir>/<state_file>`` (``launch.json`` unless None) always names the
  live pid of every child (tests and operators read it);
- `stop()` (SIGTERM/SIGINT, installed by the CLI) stops children in stages:
  each stage gets SIGCONT and SIGTERM, then ``stop_timeout_s`` to exit, then
  SIGKILL of its whole process group. Workers drain first, the broker last, so
  results the workers hand back still reach it. `run()` returns only when no
  child is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import pathlib
import signal
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, TypeVar

from rollpool.launch.policy import RestartPolicy, RestartTracker

__all__ = ["ProcessSpec", "Supervisor", "SupervisorThread", "set_parent_death_signal"]

log = logging.getLogger(__name__)

T = TypeVar("T")

TAIL_LINES = 12
"""Lines of a dead child's output shown with its exit (read from its log, since its last start)."""
_TAIL_BYTES = 64 * 1024


def set_parent_death_signal() -> None:
    """In a child (preexec): get SIGTERM when the parent dies, whatever the cause (Linux)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    """One supervised child: its name (log file and key in the state file) and command line.

    ``stop_stage``: children stop in increasing stage order (workers 0, relay 1, broker 2).
    ``env``: added to this process's environment (with ``PYTHONUNBUFFERED=1``).
    ``restart``: False leaves an exited child down until `Supervisor.start` (no restart policy, never given up).
    """

    name: str
    argv: tuple[str, ...]
    stop_stage: int = 0
    critical: bool = False
    env: dict[str, str] = field(default_factory=dict)
    restart: bool = True


@dataclass(slots=True)
class _Child:
    spec: ProcessSpec
    tracker: RestartTracker
    proc: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    log_offset: int = 0  # where its log file stood at its last start: the tail of one run starts there
    starts: int = 0
    given_up: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # start() asks a child left down to start again
    up: asyncio.Event = field(default_factory=asyncio.Event)  # set by each start


class Supervisor:
    def __init__(self, specs: Sequence[ProcessSpec], log_dir: pathlib.Path, *, policy: RestartPolicy | None = None,
                 stop_timeout_s: float = 30.0, extra_state: dict[str, object] | None = None,
                 state_file: str | None = "launch.json", label: str = "rollpool launch") -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"process names must be unique, got {names}")
        self.log_dir = log_dir
        self.policy = policy or RestartPolicy()
        self.stop_timeout_s = stop_timeout_s
        self.extra_state = dict(extra_state or {})
        self.state_file = state_file
        self.label = label
        self._children = {s.name: _Child(s, RestartTracker(self.policy)) for s in specs}
        self._stopping = asyncio.Event()
        self._all_up = asyncio.Event()
        self._done = False
        self._failed: str | None = None
        self._logs: dict[str, IO[bytes]] = {}

    # public

    def stop(self) -> None:
        """Begin the staged shutdown (idempotent; safe from a signal handler)."""
        self._stopping.set()

    @property
    def restarts(self) -> dict[str, int]:
        """Per child, how many times it was started again (by the policy or by `start`)."""
        return {name: max(0, c.starts - 1) for name, c in self._children.items()}

    def pid(self, name: str) -> int | None:
        """The live pid of child ``name``, or None while it is down."""
        child = self._children[name]
        return child.proc.pid if child.proc is not None and _alive(child) else None

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
            self._done = True
            self._all_up.set()  # wakes wait_started() callers whatever happened
            await self._kill_leftovers()
            for f in self._logs.values():
                f.close()
            self._write_state()
        return 1 if self._failed else 0

    async def wait_started(self) -> None:
        """Return once every child has been started once (`run()` must be running)."""
        await self._all_up.wait()
        if self._done and not all(c.starts for c in self._children.values()):
            raise RuntimeError("the supervisor ended before every child was started")

    def send_signal(self, name: str, sig: int) -> None:
        """Send ``sig`` to child ``name`` (its main process) if it is running."""
        pid = self.pid(name)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    async def kill(self, name: str) -> None:
        """SIGKILL child ``name`` and wait until it is reaped (a ``restart=True`` child then restarts by the policy)."""
        child = self._children[name]
        proc = child.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)
        await proc.wait()

    async def start(self, name: str, argv: Sequence[str] | None = None) -> int:
        """Start child ``name`` again (it must be down; ``argv`` replaces its command line); returns its pid."""
        child = self._children[name]
        if _alive(child):
            raise RuntimeError(f"{name} is running (pid {child.proc.pid if child.proc else None})")
        if argv is not None:
            child.spec = dataclasses.replace(child.spec, argv=tuple(argv))
        child.up.clear()
        child.wake.set()
        await _first_of(child.up.wait(), self._stopping.wait())
        if self._stopping.is_set() or child.proc is None:
            raise RuntimeError(f"the supervisor is stopping: {name} not started")
        return child.proc.pid

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
        child.starts += 1
        child.up.set()
        if all(c.starts for c in self._children.values()):
            self._all_up.set()
        log.info("started %s (pid %d)", spec.name, child.proc.pid)
        self._write_state()

    def _open_log(self, child: _Child) -> IO[bytes]:
        """The child's log file (opened once, appended across restarts) with a start marker written."""
        name = child.spec.name
        logf = self._logs.get(name)
        if logf is None:
            logf = self._logs[name] = open(self.log_dir / f"{name}.log", "ab")  # closed in run()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        logf.write(f"--- {self.label}: starting {name} at {stamp} (restart {child.starts}) ---\n".encode())
        logf.flush()
        child.log_offset = logf.tell()
        return logf

    def last_lines(self, name: str, n: int = TAIL_LINES) -> list[str]:
        """The last ``n`` lines child ``name`` wrote since its last start (from its log file)."""
        child = self._children[name]
        try:
            with open(self.log_dir / f"{name}.log", "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(child.log_offset, size - _TAIL_BYTES))
                data = f.read()
        except OSError:
            return []
        return data.decode("utf-8", "replace").splitlines()[-n:]

    async def _watch_loop(self, child: _Child) -> None:
        """Keep one child running until the supervisor stops (or the child is given up)."""
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
            self._write_state()
            if not child.spec.restart:
                log.info("%s exited with %s; left down until it is started again", child.spec.name, rc)
                await _first_of(child.wake.wait(), self._stopping.wait())
                child.wake.clear()
                continue
            delay_s = self._after_exit(child, rc)
            if delay_s is None:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=delay_s)

    def _after_exit(self, child: _Child, rc: int) -> float | None:
        """The policy's wait before restarting a child that exited, or None when it is given up."""
        name = child.spec.name
        ran_for_s = time.monotonic() - child.started_at
        tail = self.last_lines(name)
        delay_s = child.tracker.on_exit(ran_for_s, rc, tail)
        shown = "".join(f"\n    | {line}" for line in tail) or " (it wrote nothing)"
        where = self.log_dir / f"{name}.log"
        if delay_s is not None:
            log.warning("%s exited with %s after %.1f s; restarting in %.1f s. Its last lines (%s):%s",
                        name, rc, ran_for_s, delay_s, where, shown)
            return delay_s
        child.given_up = True
        log.error("%s exited with %s after %.1f s; giving up on it: %s. Its last lines (%s):%s",
                  name, rc, ran_for_s, child.tracker.gave_up_because, where, shown)
        self._write_state()
        stage = [c for c in self._children.values() if c.spec.stop_stage == child.spec.stop_stage]
        if child.spec.critical or all(c.given_up for c in stage):
            self._failed = name
            self.stop()
        return None

    async def _stop_all(self) -> None:
        stages = sorted({c.spec.stop_stage for c in self._children.values()})
        for stage in stages:
            group = [c for c in self._children.values() if c.spec.stop_stage == stage and _alive(c)]
            for c in group:
                assert c.proc is not None
                log.info("stopping %s (pid %d)", c.spec.name, c.proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    c.proc.send_signal(signal.SIGCONT)  # a paused child (SIGSTOP) could not act on SIGTERM
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
        if self.state_file is None:
            return
        state = {
            **self.extra_state,
            "supervisor_pid": os.getpid(),
            "stopping": self._stopping.is_set(),
            "processes": {
                name: {
                    "pid": c.proc.pid if c.proc is not None and c.proc.returncode is None else None,
                    "restarts": max(0, c.starts - 1),
                    "given_up": c.given_up,
                    "log": str(self.log_dir / f"{name}.log"),
                }
                for name, c in self._children.items()
            },
        }
        tmp = self.log_dir / f"{self.state_file}.tmp"
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.log_dir / self.state_file)


class SupervisorThread:
    """A `Supervisor` for synchronous callers (the demo): its event loop runs in a daemon thread.

    `start()` returns once every child runs; `kill`, `start_child` and `send_signal` are the
    supervisor's, called across threads; `stop()` is the staged stop and returns `run()`'s status.
    """

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name="rollpool-supervisor", daemon=True)
        self._rc: int | None = None
        self._error: BaseException | None = None

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._rc = self._loop.run_until_complete(self.supervisor.run())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread by stop()/_call()
            self._error = exc
        finally:
            self._loop.close()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if not self._thread.is_alive():
            coro.close()
            raise RuntimeError("the supervisor is not running") from self._error
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        while True:  # never wait on a loop that has ended
            with contextlib.suppress(TimeoutError):
                return fut.result(timeout=0.2)
            if not self._thread.is_alive():
                raise RuntimeError("the supervisor ended") from self._error

    def start(self) -> None:
        self._thread.start()
        self._call(self.supervisor.wait_started())

    def kill(self, name: str) -> None:
        self._call(self.supervisor.kill(name))

    def start_child(self, name: str, argv: Sequence[str] | None = None) -> int:
        return self._call(self.supervisor.start(name, argv))

    def send_signal(self, name: str, sig: int) -> None:
        self._loop.call_soon_threadsafe(self.supervisor.send_signal, name, sig)

    def stop(self) -> int:
        """The staged stop; returns once every child is gone (0, or 1 when a critical child was given up)."""
        if self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop closed in between
                self._loop.call_soon_threadsafe(self.supervisor.stop)
            self._thread.join()
        if self._error is not None:
            raise RuntimeError("the supervisor failed") from self._error
        return self._rc if self._rc is not None else 1


async def _first_of(*aws: Coroutine[Any, Any, Any]) -> None:
    """Wait until the first of ``aws`` finishes; cancel the rest."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _alive(child: _Child) -> bool:
    return child.proc is not None and child.proc.returncode is None
