"""Episode functions in child processes of the worker (``--agent-processes N``), each with its own event loop.

An SDK agent costs several times the pool's own CPU per turn (the `openai` client builds and parses
every request), so with the agents in the worker's process its one event loop is the limit. With
`AgentProcesses` the worker starts N children, each
of which (``python -m rollpool.workers.episodes``) imports the worker's ``--episode`` paths and runs the episode function of every episode the
worker hands it. The worker keeps everything else: the episode's recording, its endpoint, the engine.

Contract:

- the child's context (`ChildEpisodeContext`) carries what an SDK agent needs: ``openai_base_url``,
  ``api_key``, ``model``, ``sample_index``, ``prompt``, ``metadata`` (set in the child, echoed on the
  trajectories as in the worker) and the reward the function returns. ``await ctx.generate(...)``,
  ``ctx.append(...)`` and ``await ctx.tool(...)`` are forwarded to the worker's episode over the same
  socket (``generate_sync`` from a synchronous function), in order; an ``append`` the worker refuses
  raises at the episode's next forwarded call, or fails the episode when it returns. ``ctx.token_ids`` is
  refused (it would ship the whole sequence every call); ``ctx.segment_index`` is the segment after the
  last forwarded call;
- an exception in the child's episode function is the episode's error as in the worker: the same
  exception (by its type's name and text, see Transport) ends it with ``error``, or ``length`` for
  `ContextLengthExceededError`;
- a child that dies fails the episodes it was running with `AgentProcessError` (``finish_reason``
  ``error``, the message in ``metadata["episode_error"]``: exactly what an episode that raised gets;
  the group is delivered once, with that sample's error), and is started again with a doubling backoff
  (reset once a child has lived ``restart_backoff_max_s``). Episodes wait for a live child; none is lost;
- a cancelled episode (timeout, drain deadline, broker cancel) is cancelled in its child too;
- a child exits when its socket to the worker closes (the worker stopped or died).

Transport: one unix socket in a private (0700) directory of the worker; every frame is a 4-byte
length and a msgpack map of plain values, never code: the prompt travels as the wire codec's frames of
a `Task` (decoded with its checks and limits), a `SampleOutput` as its fields, an exception as its type's
name and its text (rebuilt as that class where it is one of `_KNOWN_ERRORS`, so an agent can catch
`ContextLengthExceededError`; otherwise as an `AgentProcessError` subclass of the same name, so the
episode's ``episode_error`` reads as in the worker). Metadata and the reward must be plain values (what a
trajectory carries on the wire anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
import os
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack

from rollpool.protocol.codec import decode, encode
from rollpool.protocol.errors import ConfigError, RequestRefusedError, RollpoolError
from rollpool.protocol.messages import Prompt, Task
from rollpool.workers.engines.base import SampleOutput
from rollpool.workers.episodes.episode import (
    ContextLengthExceededError,
    EpisodeClosedError,
    EpisodeContext,
    EpisodeStats,
)
from rollpool.workers.episodes.sdk import close_shared_http_client
from rollpool.workers.heap import freeze_start_up_heap

__all__ = ["AgentProcessError", "AgentProcesses", "ChildEpisodeContext", "main"]

log = logging.getLogger(__name__)
T = TypeVar("T")
_HEADER = struct.Struct("!I")
MAX_FRAME_BYTES = 1 << 30


class AgentProcessError(RollpoolError):
    """An agent process failed: it died during the episode, or could not start."""


async def _read_frame(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """The next frame, or None at the end of the stream."""
    try:
        head = await reader.readexactly(_HEADER.size)
        (size,) = _HEADER.unpack(head)
        if size > MAX_FRAME_BYTES:
            raise AgentProcessError(f"an agent-process frame of {size} bytes")
        body = await reader.readexactly(size)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    try:
        frame = msgpack.unpackb(body, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        log.warning("a malformed agent-process frame (%s): the connection is closed", exc)
        return None
    if not isinstance(frame, dict):
        log.warning("an agent-process frame that is not a map (%s): the connection is closed", type(frame).__name__)
        return None
    return frame


def _write_frame(writer: asyncio.StreamWriter, frame: dict[str, Any]) -> None:
    body: bytes = msgpack.packb(frame, use_bin_type=True)
    writer.write(_HEADER.pack(len(body)) + body)


def _prompt_fields(prompt: Prompt) -> list[bytes]:
    """A prompt as the wire codec's frames (of a `Task` that carries it)."""
    return [bytes(f) for f in encode(Task(task_id="agent-process", prompt=prompt))]


def _prompt_from(frames: Sequence[bytes]) -> Prompt:
    task = decode(list(frames), accept=("task",))
    assert isinstance(task, Task)
    return task.prompt


def _sample_fields(out: SampleOutput) -> dict[str, Any]:
    return {f: getattr(out, f) for f in SampleOutput.__dataclass_fields__}


def _sample_from(fields: dict[str, Any]) -> SampleOutput:
    return SampleOutput(**{k: v for k, v in fields.items() if k in SampleOutput.__dataclass_fields__})


_KNOWN_ERRORS: dict[str, type[Exception]] = {cls.__name__: cls for cls in (
    ValueError, TypeError, RuntimeError, TimeoutError, AssertionError, NotImplementedError, ConnectionError, OSError,
    ContextLengthExceededError, EpisodeClosedError, RequestRefusedError, ConfigError, AgentProcessError)}
"""Exceptions rebuilt as themselves from a frame (each takes its message as its one argument)."""


def _exception_fields(exc: BaseException) -> dict[str, Any]:
    """An exception as frame fields: its type's name and its text."""
    return {"exc_type": type(exc).__name__, "text": str(exc)}


def _exception_from(frame: dict[str, Any]) -> BaseException:
    name, text = str(frame.get("exc_type") or "AgentProcessError"), str(frame.get("text", "the agent process failed"))
    known = _KNOWN_ERRORS.get(name)
    if known is not None:
        return known(text)
    if not name.isidentifier():
        return AgentProcessError(f"{name}: {text}")
    # a class of the agent's own: an AgentProcessError under its name, so the episode's error reads as in the worker
    cls: type[AgentProcessError] = type(name, (AgentProcessError,), {"__module__": __name__})
    return cls(text)


# --------------------------------------------------------------------------- the worker's side


@dataclass(slots=True)
class _Running:
    """One episode handed to a child: its future (reward, metadata) and its worker-side context."""

    future: asyncio.Future[tuple[Any, dict[str, Any]]]
    ctx: EpisodeContext
    append_error: BaseException | None = None


@dataclass(slots=True)
class _Child:
    index: int
    proc: asyncio.subprocess.Process | None = None
    writer: asyncio.StreamWriter | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    hello: asyncio.Future[dict[str, Any]] | None = None
    running: dict[int, _Running] = field(default_factory=dict)
    calls: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def live(self) -> bool:
        return self.writer is not None and self.ready.is_set()


class AgentProcesses:
    """N supervised children that run a worker's episode functions (see the module docstring)."""

    def __init__(self, specs: Sequence[str], count: int, *, max_episodes: int = 64, restart_backoff_s: float = 1.0,
                 restart_backoff_max_s: float = 30.0, start_timeout_s: float = 120.0, stats: EpisodeStats | None = None) -> None:
        if count < 1:
            raise ConfigError(f"agent_processes must be >= 1 here, got {count}")
        if not specs:
            raise ConfigError("agent_processes needs --episode paths: each agent process imports the episode functions by path")
        self.specs = tuple(specs)
        self.count = count
        self.max_episodes = max_episodes
        self.restart_backoff_s = restart_backoff_s
        self.restart_backoff_max_s = restart_backoff_max_s
        self.start_timeout_s = start_timeout_s
        self.stats = stats if stats is not None else EpisodeStats()
        self._children = [_Child(i) for i in range(count)]
        self._ids = itertools.count()
        self._turns = itertools.count()
        self._dir = ""
        self._path = ""
        self._server: asyncio.Server | None = None
        self._supervisors: list[asyncio.Task[None]] = []
        self._closing = False
        self._changed = asyncio.Event()

    @property
    def pids(self) -> list[int]:
        """The live children's process ids, by index (0 where one is restarting)."""
        return [c.proc.pid if c.proc is not None and c.live else 0 for c in self._children]

    async def start(self) -> None:
        """Start every child and wait until each has loaded the episode functions; `ConfigError` if one cannot."""
        self._dir = tempfile.mkdtemp(prefix="rollpool-agents-")  # mkdtemp: mode 0700, this user's only
        self._path = os.path.join(self._dir, "agents.sock")
        self._server = await asyncio.start_unix_server(self._accept, self._path, limit=1 << 20)
        first = [asyncio.get_running_loop().create_future() for _ in self._children]
        self._supervisors = [asyncio.create_task(self._supervise(c, f), name=f"agent-process-{c.index}")
                             for c, f in zip(self._children, first, strict=True)]
        try:
            async with asyncio.timeout(self.start_timeout_s):
                for fut in first:
                    await fut
        except BaseException as exc:
            await self.close()
            if isinstance(exc, TimeoutError):
                raise AgentProcessError(f"--agent-processes: the agent processes were not ready within {self.start_timeout_s} s") from None
            raise

    async def close(self) -> None:
        self._closing = True
        for task in self._supervisors:
            task.cancel()
        await asyncio.gather(*self._supervisors, return_exceptions=True)
        await asyncio.gather(*(self._stop_child(c) for c in self._children))
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = ""

    async def _stop_child(self, child: _Child) -> None:
        proc = child.proc
        if child.writer is not None:
            child.writer.close()  # the child exits at the end of its stream
            child.writer = None
        if proc is not None and proc.returncode is None:
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()

    async def _spawn(self, child: _Child) -> asyncio.subprocess.Process:
        loop = asyncio.get_running_loop()
        child.hello = loop.create_future()
        args = [sys.executable, "-m", "rollpool.workers.episodes", "--socket", self._path, "--index", str(child.index),
                "--max-episodes", str(self.max_episodes)]
        for spec in self.specs:
            args += ["--episode", spec]
        return await asyncio.create_subprocess_exec(*args, stdin=asyncio.subprocess.DEVNULL)

    async def _supervise(self, child: _Child, first: asyncio.Future[None]) -> None:
        """Start the child, wait for its hello, then for its exit; fail its episodes and start it again (backoff)."""
        backoff = self.restart_backoff_s
        while True:
            proc = child.proc = await self._spawn(child)
            assert child.hello is not None
            exited = asyncio.create_task(proc.wait())
            waits: list[asyncio.Future[Any]] = [exited, child.hello]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            hello = child.hello.result() if child.hello.done() and not child.hello.cancelled() else None
            if hello is None or "fatal" in hello:
                await exited
                why = (hello or {}).get("fatal") or f"it exited with code {proc.returncode} before it was ready"
                if not first.done():
                    first.set_exception(ConfigError(f"--agent-processes: agent process {child.index} could not start: {why}"))
                    return
                log.error("agent process %d could not start again: %s", child.index, why)
            else:
                started = time.monotonic()
                child.ready.set()
                self._changed.set()
                if not first.done():
                    first.set_result(None)
                log.info("agent process %d is up (pid %d)", child.index, proc.pid)
                rc = await exited
                child.ready.clear()
                self._fail_running(child, f"the agent process {child.index} (pid {proc.pid}) died during the episode (exit code {rc})")
                if self._closing:
                    return
                log.warning("agent process %d (pid %d) exited with code %s; starting it again", child.index, proc.pid, rc)
                if time.monotonic() - started >= self.restart_backoff_max_s:
                    backoff = self.restart_backoff_s
            self.stats.agent_process_restarts += 1
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, self.restart_backoff_max_s)

    def _fail_running(self, child: _Child, why: str) -> None:
        if child.writer is not None:
            child.writer.close()
            child.writer = None
        for running in child.running.values():
            if not running.future.done():
                running.future.set_exception(AgentProcessError(why))
        child.running.clear()
        for task in child.calls:
            task.cancel()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = await _read_frame(reader)
        if hello is None or not isinstance(hello.get("index"), int) or not 0 <= hello["index"] < self.count:
            writer.close()
            return
        child = self._children[hello["index"]]
        if child.hello is None or child.hello.done() or child.proc is None or hello.get("pid") != child.proc.pid:
            writer.close()  # not the child we are waiting for (a stale one): refused
            return
        if "fatal" not in hello:
            child.writer = writer
        child.hello.set_result(hello)
        try:
            while (frame := await _read_frame(reader)) is not None:
                self._on_frame(child, frame)
        finally:
            if child.writer is writer:
                child.ready.clear()
                proc, rc = child.proc, None
                if proc is not None:  # its exit code, for the episodes' error, when it is dying
                    with contextlib.suppress(TimeoutError):
                        rc = await asyncio.wait_for(proc.wait(), 2.0)
                    if rc is None:  # alive without its socket: of no use; the supervisor starts it again
                        with contextlib.suppress(ProcessLookupError):
                            proc.kill()
                pid = proc.pid if proc is not None else 0
                how = f"died during the episode (exit code {rc})" if rc is not None else "closed its socket during the episode"
                self._fail_running(child, f"the agent process {child.index} (pid {pid}) {how}")
            writer.close()

    def _on_frame(self, child: _Child, frame: dict[str, Any]) -> None:
        op = frame.get("op")
        running = child.running.get(frame.get("id", -1))
        if op == "done" or op == "error":
            if running is None or running.future.done():
                return
            if op == "error":
                running.future.set_exception(_exception_from(frame))
            elif running.append_error is not None:
                running.future.set_exception(running.append_error)
            else:
                running.future.set_result((frame.get("value"), dict(frame.get("metadata") or {})))
        elif op == "generate":
            task = asyncio.create_task(self._generate(child, running, frame))
            child.calls.add(task)
            task.add_done_callback(child.calls.discard)
        elif op == "append" and running is not None:
            try:
                running.ctx.append(frame["token_ids"])
            except Exception as exc:  # noqa: BLE001 - raised in the child at its next forwarded call, or at the end
                running.append_error = running.append_error or exc
        elif op == "tool" and running is not None:
            running.ctx._episode.tool_calls += 1
            running.ctx._episode.stats.tool_calls += 1

    async def _generate(self, child: _Child, running: _Running | None, frame: dict[str, Any]) -> None:
        reply: dict[str, Any] = {"op": "reply", "call": frame["call"]}
        try:
            if running is None:
                raise EpisodeClosedError("the episode is over")
            if running.append_error is not None:
                raise running.append_error
            out = await running.ctx.generate(frame.get("input_ids"), **frame.get("kwargs", {}))
            reply.update(out=_sample_fields(out), segment=running.ctx.segment_index)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - raised in the child, where the episode function sees it
            reply.update(_exception_fields(exc))
        if child.writer is not None:
            _write_frame(child.writer, reply)

    async def _pick(self) -> _Child:
        """The live child with the fewest episodes; waits while none is live."""
        while True:
            live = [c for c in self._children if c.live]
            if live:  # the least busy; among equals, the next after the last one picked
                turn = next(self._turns)
                return min(live, key=lambda c: (len(c.running), (c.index - turn) % self.count))
            self._changed.clear()
            await self._changed.wait()

    async def run(self, name: str, ctx: EpisodeContext, prompt: Prompt) -> Any:
        """Run episode function `name` in a child for this episode; its return value (``ctx.metadata`` updated)."""
        if self._closing:
            raise AgentProcessError("the agent processes are stopped")
        child = await self._pick()
        assert child.writer is not None
        eid = next(self._ids)
        running = _Running(asyncio.get_running_loop().create_future(), ctx)
        child.running[eid] = running
        try:
            _write_frame(child.writer, {"op": "run", "id": eid, "name": name, "prompt": _prompt_fields(prompt), "base_url": ctx.openai_base_url,
                                        "api_key": ctx.api_key, "model": ctx.model, "sample_index": ctx.sample_index,
                                        "metadata": ctx.metadata})
            value, metadata = await running.future
        except asyncio.CancelledError:
            if child.writer is not None and child.running.get(eid) is running:
                _write_frame(child.writer, {"op": "cancel", "id": eid})
            raise
        finally:
            if child.running.get(eid) is running:
                del child.running[eid]
        ctx.metadata.clear()
        ctx.metadata.update(metadata)
        return value


# --------------------------------------------------------------------------- the child's side


class ChildEpisodeContext:
    """What an episode function gets in an agent process (the worker-side `EpisodeContext`'s fields; see the module
    docstring for what is forwarded and what is refused)."""

    def __init__(self, link: _ChildLink, eid: int, frame: dict[str, Any], executor: ThreadPoolExecutor) -> None:
        self._link = link
        self._id = eid
        self.openai_base_url: str = frame["base_url"]
        self.api_key: str = frame["api_key"]
        self.model: str = frame["model"]
        self.prompt: Prompt = _prompt_from(frame["prompt"])
        self.sample_index: int = frame["sample_index"]
        self.metadata: dict[str, Any] = dict(frame["metadata"])
        self._segment_index = 0
        self._executor = executor
        self._loop = asyncio.get_running_loop()

    def openai_client(self, **options: Any) -> Any:
        """An ``openai.AsyncOpenAI`` bound to this episode, over the process's one HTTP client (no TLS context and no
        connection pool per episode; closing it is harmless): `rollpool.workers.episodes.sdk`. `options` go to
        ``AsyncOpenAI`` (``max_retries``, ``timeout``, ...)."""
        from rollpool.workers.episodes.sdk import episode_client

        return episode_client(self.openai_base_url, self.api_key, **options)

    @property
    def segment_index(self) -> int:
        return self._segment_index

    @property
    def token_ids(self) -> list[int]:
        raise AgentProcessError("ctx.token_ids is not served in an agent process (--agent-processes): keep the ids "
                                "ctx.generate returns, or run this episode function in the worker (--agent-processes 0)")

    def _on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    async def generate(self, input_ids: Sequence[int] | None = None, **sampling: Any) -> SampleOutput:
        """Sample one turn in the worker's episode (`EpisodeContext.generate`'s arguments)."""
        reply = await self._link.call({"op": "generate", "id": self._id, "input_ids": None if input_ids is None else list(input_ids),
                                       "kwargs": sampling})
        self._segment_index = int(reply["segment"])
        return _sample_from(reply["out"])

    def generate_sync(self, input_ids: Sequence[int] | None = None, **sampling: Any) -> SampleOutput:
        if self._on_loop():
            raise RuntimeError("generate_sync called on the event loop: await ctx.generate(...) instead")
        return asyncio.run_coroutine_threadsafe(self.generate(input_ids, **sampling), self._loop).result()

    def append(self, token_ids: Sequence[int]) -> None:
        """Insert tokens (loss mask 0) in the worker's episode; in order with this episode's next call."""
        frame = {"op": "append", "id": self._id, "token_ids": [int(t) for t in token_ids]}
        if self._on_loop():
            self._link.send(frame)
        else:
            self._loop.call_soon_threadsafe(self._link.send, frame)

    async def tool(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a tool here (a coroutine function awaited, a plain one in a thread); counted in the worker's episode."""
        self._link.send({"op": "tool", "id": self._id})
        if inspect.iscoroutinefunction(fn):
            result: T = await fn(*args, **kwargs)
            return result
        return await asyncio.get_running_loop().run_in_executor(self._executor, lambda: fn(*args, **kwargs))


class _ChildLink:
    """The child's end of the socket: runs episodes the worker sends, forwards their calls."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, functions: dict[str, Any], max_episodes: int) -> None:
        self.reader, self.writer, self.functions = reader, writer, functions
        self.episodes: dict[int, asyncio.Task[None]] = {}
        self.calls: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._call_ids = itertools.count()
        self.executor = ThreadPoolExecutor(max_workers=2 * max_episodes, thread_name_prefix="rollpool-agent")

    def send(self, frame: dict[str, Any]) -> None:
        _write_frame(self.writer, frame)

    async def call(self, frame: dict[str, Any]) -> dict[str, Any]:
        cid = next(self._call_ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.calls[cid] = fut
        try:
            self.send({**frame, "call": cid})
            reply = await fut
        finally:
            self.calls.pop(cid, None)
        if "out" not in reply:
            raise _exception_from(reply)
        return reply

    async def serve(self) -> None:
        while (frame := await _read_frame(self.reader)) is not None:
            op = frame.get("op")
            if op == "run":
                eid = frame["id"]
                self.episodes[eid] = asyncio.create_task(self._episode(eid, frame))
            elif op == "cancel":
                task = self.episodes.get(frame["id"])
                if task is not None:
                    task.cancel()
            elif op == "reply":
                fut = self.calls.get(frame["call"])
                if fut is not None and not fut.done():
                    fut.set_result(frame)
        for task in self.episodes.values():  # the worker is gone: nothing to report to
            task.cancel()

    async def _episode(self, eid: int, frame: dict[str, Any]) -> None:
        try:
            ctx = ChildEpisodeContext(self, eid, frame, self.executor)
            fn = self.functions.get(frame["name"])
            if fn is None:
                raise ConfigError(f"the prompt names episode function {frame['name']!r}; this agent process has {sorted(self.functions)}")
            if inspect.iscoroutinefunction(fn):
                value = await fn(ctx, ctx.prompt)
            else:
                value = await asyncio.get_running_loop().run_in_executor(self.executor, fn, ctx, ctx.prompt)
                if inspect.isawaitable(value):
                    value = await value
            reply: dict[str, Any] = {"op": "done", "id": eid, "value": value, "metadata": ctx.metadata}
            try:
                self.send(reply)
            except Exception as exc:  # noqa: BLE001 - a reward or metadata that is not plain values is the episode's error
                self.send({"op": "error", "id": eid, **_exception_fields(exc)})
        except asyncio.CancelledError:
            pass  # the worker cancelled it, or is gone: it reports nothing
        except Exception as exc:  # noqa: BLE001 - the episode's error, reported to the worker
            self.send({"op": "error", "id": eid, **_exception_fields(exc)})
        finally:
            self.episodes.pop(eid, None)


async def _child_main(path: str, index: int, specs: Sequence[str], max_episodes: int) -> int:
    from rollpool.workers.episodes.runner import load_episode_functions

    reader, writer = await asyncio.open_unix_connection(path, limit=1 << 20)
    hello: dict[str, Any] = {"index": index, "pid": os.getpid()}
    try:
        functions = load_episode_functions(specs)
    except ConfigError as exc:
        _write_frame(writer, {**hello, "fatal": str(exc)})
        await writer.drain()
        writer.close()
        return 2
    # this process runs episode functions and nothing else: its start-up heap (the functions' modules) leaves the
    # collector, and the collections of the episodes' objects come rarer, as in the worker
    freeze_start_up_heap()
    _write_frame(writer, hello)
    link = _ChildLink(reader, writer, dict(functions), max_episodes)
    try:
        await link.serve()
    finally:
        with contextlib.suppress(Exception):
            await close_shared_http_client()  # the episodes' `ctx.openai_client()` connections
        link.executor.shutdown(wait=False, cancel_futures=True)
        writer.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rollpool.workers.episodes --socket PATH --index I --episode SPEC...`` (the worker starts it)."""
    import argparse

    ap = argparse.ArgumentParser(prog="rollpool-agent-process", description="an agent process of a rollpool worker (started by it)")
    ap.add_argument("--socket", required=True)
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--episode", action="append", default=[])
    ap.add_argument("--max-episodes", type=int, default=64)
    args = ap.parse_args(argv)
    if os.getcwd() not in sys.path:  # the worker's episode paths import from its working directory, as in the worker
        sys.path.insert(0, os.getcwd())
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s agent-process-{args.index} %(levelname)s %(name)s: %(message)s")
    rc = asyncio.run(_child_main(args.socket, args.index, args.episode, args.max_episodes))
    logging.shutdown()
    # not a normal exit: a synchronous episode function's thread may still wait on the closed loop, and the
    # interpreter would join it forever (the worker is gone; nothing is left to report)
    os._exit(rc)

