"""The episode runner: n episodes of a prompt group, side by side on one engine.

The seam a worker calls (one runner per worker, beside its engine)::

    runner = EpisodeRunner(engine, load_episode_functions(["pkg.mod:solve"]), EpisodeConfig(...),
                           tokenizer=tokenizer, worker_id=worker_id)
    await runner.start()                       # the loopback HTTP endpoint
    trajectories = await runner.run_group(task.prompt, task.prompt.group_size,
                                          attempt=task.attempt, queued_at=task.queued_at,
                                          request_prefix=task.task_id)
    ...
    await runner.close()

`run_group` returns when every episode of the group has ended, with one `Trajectory` per segment of
every episode (``sample_index`` the episode, ``segment_index`` the segment), in episode order. A
per-episode outcome is data: an exception in the episode function gives that episode
``finish_reason`` ``error`` and the message in ``metadata["episode_error"]``; an episode past
`EpisodeConfig.episode_timeout_s` is cut (``abort``, its partial recording kept); one that went past
the context ends with ``length``. `run_group` raises only `asyncio.CancelledError` (the worker
cancelled the group: drain deadline, broker cancel, engine restart), after closing every episode
of the group; the worker then hands the group back, to be re-run from the start. A re-run is given
the turns the earlier attempts recorded (``replay``): each episode is served them back while its
requests match (see `episode`), so only the turn that was not finished is sampled again.

The episode function is ``fn(ctx, prompt)``, async or sync (a sync one runs in the runner's own
thread pool, never on the event loop), and returns the reward (a number) or None. At most
`EpisodeConfig.max_episodes` episodes run at once per runner; the engine's own capacity bounds the
turns sampled at once. Which function runs: ``prompt.metadata["episode"]`` names one of the loaded
functions, else the default (the first given).

With `EpisodeConfig.agent_processes` N > 0 the episode functions run in N child processes of the
runner (`processes.AgentProcesses`, given the ``--episode`` paths as `specs`), each with its own event
loop; the episode, its recording and its endpoint stay here, and the outcomes are the same (a child
that dies fails its episodes as an exception would).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import importlib
import inspect
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rollpool.protocol.errors import ConfigError
from rollpool.protocol.messages import FinishReason, Prompt, RecordedTurn, Trajectory
from rollpool.workers.engines.base import Engine
from rollpool.workers.episodes.episode import (
    ContextLengthExceededError,
    Episode,
    EpisodeContext,
    EpisodeStats,
    TokenizerLane,
    decode_tokens,
)
from rollpool.workers.episodes.processes import AgentProcesses
from rollpool.workers.episodes.sdk import close_shared_http_client
from rollpool.workers.episodes.server import MAX_REQUEST_BYTES, EpisodeServer
from rollpool.workers.episodes.toolcalls import get_tool_call_parser
from rollpool.workers.images import ImagePolicy

__all__ = ["DEFAULT_EPISODE", "EpisodeConfig", "EpisodeFn", "EpisodeRunner", "load_episode_function", "load_episode_functions"]

log = logging.getLogger(__name__)

EpisodeFn = Callable[[EpisodeContext, Prompt], Any]
DEFAULT_EPISODE = "default"
BODY_BYTES_PER_TOKEN = 64
"""Bytes of request body per context token that the default body limit allows: a token is a few characters of
text, which JSON may escape to six bytes each (``\\uXXXX``), and tool definitions ride beside the messages."""
MIN_BODY_BYTES = 1 << 20
MAX_AGENT_PROCESSES = 256
START_SLICE_S = 0.02
"""Most seconds of one pass of the event loop that episode starts take before the pass is yielded (see `_turnstile`)."""


@dataclass(frozen=True, slots=True)
class EpisodeConfig:
    """How a worker runs episodes."""

    max_episodes: int = 64
    """Most episodes running at once on this worker."""
    episode_timeout_s: float = 600.0
    """Most seconds one episode may run; then it is cut (``abort``)."""
    tool_call_parser: str = "hermes"
    """The endpoint's tool-call parser, by name (see `toolcalls`)."""
    max_context_tokens: int = 0
    """The engine's context in tokens; 0: ``engine.info().extra["max_context_tokens"]`` when the engine states it,
    else the engine's own check only."""
    max_request_bytes: int = 0
    """The endpoint's body limit (413 above it); 0: what the context can hold, `BODY_BYTES_PER_TOKEN` per context
    token and at least `MIN_BODY_BYTES`, or `MAX_REQUEST_BYTES` when no context is known."""
    host: str = "127.0.0.1"
    port: int = 0
    """The endpoint's port; 0 picks a free one."""
    serve_openai: bool = True
    """False: no HTTP endpoint (token-level episodes only; ``ctx.openai_base_url`` is "")."""
    image_policy: ImagePolicy = field(default_factory=ImagePolicy)
    """What the endpoint accepts as ``image_url`` parts (the worker's image rules: count, bytes, pixels, formats,
    fetching http(s) URLs or not)."""
    agent_processes: int = 0
    """Run the episode functions in this many child processes of the worker, each with its own event loop
    (`rollpool.workers.episodes.processes`); 0: in the worker's process, on its event loop."""
    agent_restart_backoff_s: float = 1.0
    """First wait before an agent process that died is started again (doubling)."""
    agent_restart_backoff_max_s: float = 30.0
    """Longest wait between starts of an agent process; one that lived this long starts its next row at the first wait."""

    def __post_init__(self) -> None:
        if self.max_episodes < 1:
            raise ConfigError(f"EpisodeConfig.max_episodes must be >= 1, got {self.max_episodes}")
        if not self.episode_timeout_s > 0:
            raise ConfigError(f"EpisodeConfig.episode_timeout_s must be > 0, got {self.episode_timeout_s}")
        if self.max_context_tokens < 0:
            raise ConfigError(f"EpisodeConfig.max_context_tokens must be >= 0, got {self.max_context_tokens}")
        if self.max_request_bytes < 0:
            raise ConfigError(f"EpisodeConfig.max_request_bytes must be >= 0, got {self.max_request_bytes}")
        if not 0 <= self.agent_processes <= MAX_AGENT_PROCESSES:
            raise ConfigError(f"EpisodeConfig.agent_processes must be in [0, {MAX_AGENT_PROCESSES}], got {self.agent_processes}")
        if not 0 < self.agent_restart_backoff_s <= self.agent_restart_backoff_max_s:
            raise ConfigError("EpisodeConfig.agent_restart_backoff_s must be > 0 and <= agent_restart_backoff_max_s, got "
                              f"{self.agent_restart_backoff_s} and {self.agent_restart_backoff_max_s}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"EpisodeConfig.port must be in [0, 65535], got {self.port}")
        get_tool_call_parser(self.tool_call_parser)


def load_episode_function(path: str) -> EpisodeFn:
    """Import ``package.module:function``; `ConfigError` names the path and what was not found."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"--episode must look like package.module:function (or name=package.module:function), got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure is the path's fault
        raise ConfigError(f"--episode {path!r}: cannot import {module_name}: {type(exc).__name__}: {exc}") from exc
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ConfigError(f"--episode {path!r}: {module_name} has no {attr}")
    if not callable(fn):
        raise ConfigError(f"--episode {path!r}: {attr} is not callable")
    return fn  # type: ignore[no-any-return]


def load_episode_functions(specs: Sequence[str]) -> dict[str, EpisodeFn]:
    """``["pkg.mod:fn", "name=pkg.mod:other"]`` -> ``{"default": fn, "name": other}`` (the first is also the default)."""
    out: dict[str, EpisodeFn] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = DEFAULT_EPISODE, spec
        name = name.strip()
        if not name:
            raise ConfigError(f"--episode {spec!r}: the name before '=' is empty")
        if name in out:
            raise ConfigError(f"--episode {spec!r}: the name {name!r} is given twice")
        out[name] = load_episode_function(path.strip())
    if out and DEFAULT_EPISODE not in out:
        out[DEFAULT_EPISODE] = next(iter(out.values()))
    return out


def _reward(value: Any) -> tuple[float | None, str | None]:
    if value is None:
        return None, None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(float(value)):
        return None, f"the episode returned {value!r}, not a finite number or None"
    return float(value), None


class _StartGate:
    """Admits callers in slices of at most `slice_s` of one pass of the event loop; the rest wait their turn, parked.

    A caller that finds the slice used up (or others waiting) queues; an opening, one pass later, wakes
    up to `batch` of them in order and starts a new slice, which the first of them to run begins to
    time. A woken caller that finds the slice used up again queues at the front. So a slow start (a
    TLS set-up) has a pass to itself, timers and I/O (heartbeats, other episodes' turns) run between
    two slices, and quick starts go `batch` to a pass without anyone polling.
    """

    def __init__(self, slice_s: float, batch: int = 64) -> None:
        self.slice_s = slice_s
        self.batch = batch
        self._slice_at = -math.inf
        self._fresh = False
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._opening = False

    def _room(self) -> bool:
        if self._fresh:  # the first caller to run after an opening begins the slice's clock
            self._fresh = False
            self._slice_at = time.monotonic()
        return time.monotonic() - self._slice_at < self.slice_s

    async def enter(self) -> None:
        if not self._waiters and self._room():
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append(fut)
        while True:
            self._schedule_opening(loop)
            try:
                await fut
            except asyncio.CancelledError:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
                raise
            if self._room():
                return
            fut = loop.create_future()
            self._waiters.appendleft(fut)

    def _schedule_opening(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._opening:
            self._opening = True
            loop.call_soon(self._open, loop)

    def _open(self, loop: asyncio.AbstractEventLoop) -> None:
        self._opening = False
        self._fresh = True
        for _ in range(min(self.batch, len(self._waiters))):
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
        if self._waiters:
            self._schedule_opening(loop)


@dataclass(frozen=True, slots=True)
class _Replay:
    """What a group's episodes are given of an earlier attempt's turns (`run_group`'s replay arguments)."""

    turns: tuple[RecordedTurn, ...] = ()
    serve: bool = True
    min_version: int = -1
    on_turn: Callable[[RecordedTurn], None] | None = None


class EpisodeRunner:
    """Runs episodes on one engine and serves their endpoint (see the module docstring)."""

    def __init__(self, engine: Engine, functions: Mapping[str, EpisodeFn] | EpisodeFn, config: EpisodeConfig | None = None,
                 *, tokenizer: Any = None, worker_id: str = "", specs: Sequence[str] = ()) -> None:
        self.engine = engine
        self.functions: dict[str, EpisodeFn] = (
            {DEFAULT_EPISODE: functions} if callable(functions) else dict(functions))
        if not self.functions:
            raise ConfigError("an episode runner needs at least one episode function")
        self.functions.setdefault(DEFAULT_EPISODE, next(iter(self.functions.values())))
        self.config = config or EpisodeConfig()
        self.tokenizer = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
        self.worker_id = worker_id
        self.stats = EpisodeStats()
        self.server = EpisodeServer(self.config.host, self.config.port)
        self._slots = asyncio.Semaphore(self.config.max_episodes)
        # sync episode functions and tools: a pool of our own, so they never wait on the default one
        self._threads = ThreadPoolExecutor(max_workers=1)
        self._tokenizer_lane: TokenizerLane | None = None
        self._started = False
        self._end_of_turn_cache: dict[tuple[str, str, str], tuple[str, int | None]] = {}
        self._start_gate = _StartGate(START_SLICE_S)
        # with agent_processes, the children import the functions by these paths (the worker loaded them too: a
        # bad path fails at the worker's start)
        self.agents: AgentProcesses | None = None
        if self.config.agent_processes:
            self.agents = AgentProcesses(specs, self.config.agent_processes, max_episodes=self.config.max_episodes, stats=self.stats,
                                         restart_backoff_s=self.config.agent_restart_backoff_s,
                                         restart_backoff_max_s=self.config.agent_restart_backoff_max_s)

    async def start(self) -> None:
        if not self._started:
            self._threads = ThreadPoolExecutor(max_workers=2 * self.config.max_episodes, thread_name_prefix="rollpool-episode")
            self._tokenizer_lane = TokenizerLane(tokenizer=self.tokenizer)
            if self.config.serve_openai:
                self.server.max_request_bytes = self._max_request_bytes()
                await self.server.start()
            if self.agents is not None:
                await self.agents.start()
            self._started = True

    async def close(self) -> None:
        if self.agents is not None:
            await self.agents.close()
        await self.server.close()
        await close_shared_http_client()  # the episodes' `ctx.openai_client()` connections (in this process)
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self._tokenizer_lane is not None:
            self._tokenizer_lane.shutdown()
            self._tokenizer_lane = None
        self._started = False

    async def __aenter__(self) -> EpisodeRunner:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _model_name(self) -> str:
        """The engine's model; a local directory by its last part (the id agents see, not a path of this host)."""
        try:
            name = str(self.engine.info().model)
        except Exception:  # noqa: BLE001 - a name for the endpoint only
            return "rollpool"
        if os.path.isdir(name):
            name = os.path.basename(os.path.normpath(name))
        return name or "rollpool"

    def _max_context_tokens(self) -> int:
        """The configured context, else what the engine states (``info().extra["max_context_tokens"]``), else 0."""
        if self.config.max_context_tokens:
            return self.config.max_context_tokens
        try:
            value = self.engine.info().extra.get("max_context_tokens", 0)
        except Exception:  # noqa: BLE001 - optional information
            return 0
        return value if isinstance(value, int) and value > 0 else 0

    def _max_request_bytes(self) -> int:
        if self.config.max_request_bytes:
            return self.config.max_request_bytes
        context = self._max_context_tokens()
        limit = max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * context) if context else MAX_REQUEST_BYTES
        try:
            images = bool(self.engine.info().images)
        except Exception:  # noqa: BLE001 - optional information
            images = False
        if images:  # room for the images' data URLs (base64: 4 bytes per 3), up to the endpoint's largest body
            policy = self.config.image_policy
            limit = min(max(limit, MAX_REQUEST_BYTES), limit + policy.max_images * (policy.max_image_bytes * 4 // 3 + 64))
        return limit

    async def run_group(self, prompt: Prompt, n: int | None = None, *, attempt: int = 0, queued_at: float = 0.0,
                        request_prefix: str | None = None, replay: Sequence[RecordedTurn] = (), serve_replay: bool = True,
                        min_version: int = -1, on_turn: Callable[[RecordedTurn], None] | None = None) -> list[Trajectory]:
        """Run `n` (default ``prompt.group_size``) episodes of `prompt` concurrently; every segment's trajectory.

        `replay`: turns an earlier attempt recorded (served back where the requests match, unless `serve_replay` is
        False; a record with a token older than `min_version` is not served); `on_turn` is given every turn sampled."""
        if not self._started:
            await self.start()
        count = prompt.group_size if n is None else n
        prefix = request_prefix or f"{prompt.prompt_id}@{attempt}"
        play = _Replay(tuple(replay), serve_replay, min_version, on_turn)
        tasks = [asyncio.create_task(self._run_episode(prompt, i, attempt, queued_at, prefix, play), name=f"episode-{prompt.prompt_id}:{i}")
                 for i in range(count)]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return [t for r in results for t in r]

    async def _turnstile(self) -> None:
        """Let episodes start in slices of at most `START_SLICE_S` of one pass of the event loop (`_StartGate`).

        Every episode of the groups a worker takes arrives at once, and an episode function's first
        step is often long (an ``openai.AsyncOpenAI()`` builds a TLS context: tens of milliseconds).
        Run in one pass, 128 of them held the loop for seconds, the worker's heartbeats with it, and
        the broker declared the worker dead and handed its groups to be run again.
        """
        await self._start_gate.enter()

    async def _run_episode(self, prompt: Prompt, index: int, attempt: int, queued_at: float, prefix: str,
                           play: _Replay | None = None) -> list[Trajectory]:
        play = play or _Replay()
        async with self._slots:
            await self._turnstile()
            name = prompt.metadata.get("episode", DEFAULT_EPISODE) if isinstance(prompt.metadata, Mapping) else DEFAULT_EPISODE
            fn = self.functions.get(str(name))
            episode = Episode(
                engine=self.engine, prompt=prompt, sample_index=index, start_version=self.engine.info().weight_version,
                tokenizer=self.tokenizer, parser=get_tool_call_parser(self.config.tool_call_parser),
                model_name=self._model_name(), max_context_tokens=self._max_context_tokens(),
                request_prefix=prefix, stats=self.stats, loop=asyncio.get_running_loop(),
                tokenizer_lane=self._tokenizer_lane, end_of_turn_cache=self._end_of_turn_cache,
                image_policy=self.config.image_policy,
                replay=play.turns, serve_replay=play.serve, min_version=play.min_version, on_turn=play.on_turn)
            base_url, key = self.server.register(episode) if self.config.serve_openai else ("", "")
            ctx = EpisodeContext(episode, openai_base_url=base_url, api_key=key, executor=self._threads)
            self.stats.in_flight += 1
            self.stats.started += 1
            scope = asyncio.timeout(self.config.episode_timeout_s)
            finish: str | None = None
            error: str | None = None
            value: Any = None
            try:
                if fn is None:
                    raise ConfigError(f"the prompt names episode function {name!r}; this worker has {sorted(self.functions)}")
                async with scope:
                    if self.agents is not None:
                        value = await self.agents.run(str(name), ctx, prompt)
                    else:
                        value = await self._call(fn, ctx, prompt)
            except TimeoutError as exc:
                if scope.expired():
                    finish, error = FinishReason.ABORT, f"the episode timed out after {self.config.episode_timeout_s}s"
                    self.stats.timed_out += 1
                else:  # a timeout inside the episode's own code is its error, not ours
                    finish, error = FinishReason.ERROR, f"{type(exc).__name__}: {exc}"
                    self.stats.failed += 1
            except ContextLengthExceededError as exc:
                finish, error = FinishReason.LENGTH, str(exc)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a failing episode is a per-sample outcome
                if episode.recording.context_exceeded:
                    finish = FinishReason.LENGTH
                else:
                    finish = FinishReason.ERROR
                    self.stats.failed += 1
                error = f"{type(exc).__name__}: {exc}"
            finally:
                await episode.close()
                if base_url:
                    self.server.unregister(base_url)
                self.stats.in_flight -= 1
            self.stats.finished += 1
            reward, reward_error = _reward(value) if finish is None else (None, None)
            metadata = dict(ctx.metadata)
            if error is not None:
                metadata["episode_error"] = error
                log.warning("episode %s:%d: %s", prompt.prompt_id, index, error)
            if reward_error is not None:
                metadata["reward_error"] = reward_error
            texts = await self._output_texts(episode)
            if not episode.recording.segments and prompt.input_ids is not None:
                episode.recording.begin(prompt.input_ids.tolist())  # recorded nothing: the prompt, no output
            return episode.recording.trajectories(finish_reason=finish, worker_id=self.worker_id, attempt=attempt,
                                                  queued_at=queued_at, reward=reward, metadata=metadata, output_text=texts)

    async def _output_texts(self, episode: Episode) -> list[str] | None:
        """Each segment's output decoded, in the tokenizer thread (an episode's whole output, off the event loop); a
        small output (the estimate the endpoint uses for a reply: 8 characters a token) at once, when that thread is
        idle, as a turn's small tokenizer work is (`TokenizerLane.call`'s ``small``)."""
        if self.tokenizer is None:
            return None
        tok, outputs, lane = self.tokenizer, [s.output_ids for s in episode.recording.segments], self._tokenizer_lane

        def decode() -> list[str]:
            return [decode_tokens(tok, ids, skip_special_tokens=True) for ids in outputs]

        small = 8 * sum(len(ids) for ids in outputs) <= TokenizerLane.INLINE_CHARS
        return await lane.call(decode, small=small) if lane is not None else decode()

    async def _call(self, fn: EpisodeFn, ctx: EpisodeContext, prompt: Prompt) -> Any:
        if inspect.iscoroutinefunction(fn):
            return await fn(ctx, prompt)
        loop = asyncio.get_running_loop()
        value = await loop.run_in_executor(self._threads, fn, ctx, prompt)
        if inspect.isawaitable(value):
            value = await value
        return value
