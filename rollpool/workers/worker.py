"""The rollout worker: one engine, one DEALER to the broker, versioned weights.

`Worker` is wiring, in the broker's shape. The decisions live in four parts, and this
module moves bytes between them:

- `session.WorkerSession` (pure): task ledger, credits, outbox, epoch, hello schedule.
  Each call returns the `Effects` to carry out (messages to send, tasks to start,
  requests to abort, runners to cancel);
- `link.BrokerLink`: the one DEALER socket;
- `engine_supervisor.EngineSupervisor`: start, and restart with a bounded backoff. The
  hand-back goes through the session's effects, the re-apply through weight_sync;
- `weight_sync.WeightSync`: the one apply path (fetch, stage, grant, pause/update/resume, done).

`run()` owns a task group of named loops: ``_recv_loop`` (broker messages to the
session, grants to weight_sync, control ops), ``_hello_loop`` (the session's hello
schedule), ``_heartbeat_loop``, ``_weights_loop``, ``_engine_loop`` (the supervisor)
and ``_drain_loop``. It also owns one runner per task. The guarantees are those of the
parts (their docstrings, docs/workers.md):

- each task yields exactly one message: a Result, a non-retryable error Result for a
  request the engine refuses (`RequestRefusedError`), a Nack, or nothing when cancelled.
  Any other exception out of the engine is an engine failure;
- engine failure: generating tasks are handed back at once, and the engine is restarted
  with backoff and given the served version again. Then a hello. After
  ``max_restarts`` failures in a row the worker drains, says Goodbye, and `run()`
  raises `EngineError`;
- `stop()` (SIGTERM): stop intake, finish in-flight work until ``drain_timeout_s``,
  hand back the rest (Nack), say Goodbye, return.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

from rollpool.protocol import inline_for, settle_minor
from rollpool.protocol.errors import (
    ConfigError,
    EngineError,
    MessageTooLargeError,
    RequestRefusedError,
    RollpoolError,
    WeightSyncError,
)
from rollpool.protocol.limits import DEFAULT_LIMITS
from rollpool.protocol.logs import RateLimitedLog
from rollpool.protocol.messages import (
    ApplyGrant,
    Control,
    ControlReply,
    Error,
    Feature,
    RecordedTurn,
    Result,
    Task,
    TurnRecordBatch,
    TurnRecords,
    Welcome,
)
from rollpool.protocol.metrics import MetricsSink, NullMetricsSink
from rollpool.protocol.sockets import SocketFactory
from rollpool.workers.config import WorkerConfig
from rollpool.workers.engine_supervisor import EngineFactory, EngineSupervisor
from rollpool.workers.engines.base import Engine, EngineInfo
from rollpool.workers.engines.tokenizer import load_tokenizer
from rollpool.workers.episodes.runner import EpisodeConfig, EpisodeFn, EpisodeRunner, load_episode_functions
from rollpool.workers.heap import freeze_start_up_heap
from rollpool.workers.images import LoadedImage, load_images
from rollpool.workers.link import BrokerLink
from rollpool.workers.reward import RewardFn, load_reward
from rollpool.workers.session import Effects, EngineFacts, SessionConfig, WorkerSession, WorkerState
from rollpool.workers.trajectories import build_trajectories, score_trajectories
from rollpool.workers.weight_sync import SubscriberFactory, WeightSync

__all__ = ["Worker", "freeze_start_up_heap"]

log = logging.getLogger(__name__)

_REFUSED_BROKER = ("wrong_pool", "version")
_MAX_PENDING_TURNS = 4096
"""Finished episode turns waiting to be streamed to the broker; past it a turn is not streamed (counted)."""
_TURNS_GATHER_S = 0.05
"""How long finished turns gather before they are streamed, all at once: sent one by one as each turn ended, each
`TurnRecords` woke the link's I/O thread and the broker on its own, most of the streaming's CPU (about 90 us a
message on the worker's side on a 2-core box, against about 16 us for messages sent back to back). A task's turns
still reach the broker before its result (`_flush_turns`)."""
"""Errors answering a Hello that no retry can change: the worker stops and `run` raises `ConfigError`."""


def _facts(info: EngineInfo) -> EngineFacts:
    return EngineFacts(info.name, info.capacity, tuple(info.apply_modes), info.fingerprint, info.weight_version, info.as_dict())


class Worker:
    """One rollout worker (see the module docstring)."""

    def __init__(
        self,
        config: WorkerConfig,
        sockets: SocketFactory,
        engine: Engine | None = None,
        metrics: MetricsSink | None = None,
        *,
        engine_factory: EngineFactory | None = None,
        subscriber_factory: SubscriberFactory | None = None,
        reward_fn: RewardFn | None = None,
        episodes: Mapping[str, EpisodeFn] | None = None,
        tokenizer: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.worker_id = config.worker_id
        self.metrics: MetricsSink = metrics if metrics is not None else NullMetricsSink()
        self._now = clock
        self.session = WorkerSession(
            SessionConfig(
                worker_id=config.worker_id,
                pool=config.pool,
                capacity_limit=config.capacity,
                heartbeat_interval_s=config.heartbeat_interval_s,
                missed_heartbeats=config.missed_heartbeats,
                reconnect_backoff_s=config.reconnect_backoff_s,
                reconnect_backoff_max_s=config.reconnect_backoff_max_s,
                host=socket.gethostname(),
                pid=os.getpid(),
                max_msg_bytes=sockets.options.max_msg_bytes,
                max_header_bytes=DEFAULT_LIMITS.max_header_bytes,
            )
        )
        self.link = BrokerLink(sockets, config.broker, config.worker_id, config.send_timeout_s)
        self.supervisor = EngineSupervisor(
            config, engine_factory or self._registry_factory, self.metrics, engine=engine, on_down=self._hand_back, on_up=self._engine_up, clock=clock
        )
        self.weights = WeightSync(
            config,
            sockets,
            self.link,
            self.supervisor,
            self.metrics,
            served_version=lambda: self.session.version,
            subscriber_factory=subscriber_factory,
            on_apply_started=lambda: self.session.apply_started(self._now()),
            on_apply_finished=lambda version: self.session.apply_finished(self._now(), version),
            adapters_need_grant=lambda: self.session.adapters_need_grant(),
        )
        self._reward_fn = reward_fn if reward_fn is not None else (load_reward(config.reward) if config.reward else None)
        # episodes: the functions load here, so a bad --episode path fails before anything starts (ConfigError)
        self._episode_fns: dict[str, EpisodeFn] = dict(episodes) if episodes is not None else load_episode_functions(config.episode)
        self._tokenizer = tokenizer
        self.episodes: EpisodeRunner | None = None
        self._runners: dict[str, asyncio.Task[None]] = {}
        self._controls: set[asyncio.Task[None]] = set()
        self._loops: list[asyncio.Task[None]] = []
        self._tg: asyncio.TaskGroup | None = None
        self._stop_requested = asyncio.Event()
        self.started = asyncio.Event()
        """Set once the engine is up and the worker begins serving (`rollpool worker` then freezes its start-up heap:
        `freeze_start_up_heap`)."""
        self._poll_wake = asyncio.Event()
        self._poll_deadline = math.inf
        self._bad_msgs = RateLimitedLog(log)
        self._fatal: RollpoolError | None = None
        self.stopped_cleanly = False
        # finished episode turns on their way to the broker (best effort: a turn not sent is sampled again on a re-run)
        self._turns: collections.deque[tuple[str, str, RecordedTurn]] = collections.deque()
        self._turns_ready = asyncio.Event()
        self._turns_now = asyncio.Event()
        """Send what is queued without gathering (a task's result waits for its turns)."""
        self._turns_sending = False
        self._turns_passes = 0
        """Passes of `_turns_loop` done; each sends everything queued when it began."""
        self._turns_passed = asyncio.Event()
        self.turns_dropped = 0
        """Episode turns not streamed to the broker (the queue was full, or the broker did not take them)."""

    # -- public API

    @property
    def engine(self) -> Engine | None:
        return self.supervisor.engine

    @property
    def state(self) -> str:
        return self.session.state

    @property
    def weight_version(self) -> int:
        return self.session.version

    @property
    def restarts(self) -> int:
        return self.supervisor.restarts

    @property
    def hellos_sent(self) -> int:
        return self.session.hellos_sent

    @property
    def tokens_total(self) -> int:
        return self.session.tokens_total

    def inflight_task_ids(self) -> tuple[str, ...]:
        return self.session.inflight_task_ids()

    def stop(self) -> None:
        """Begin the graceful drain; `run()` returns when it is done. Safe to call twice."""
        self.session.stop(self._now())
        self._stop_requested.set()

    async def run(self) -> None:
        """Serve until stopped; raises `EngineError` when the engine could not be kept running, `ConfigError` when the
        broker at its endpoint refused it for good (another pool's broker, no common protocol version)."""
        try:
            await self.weights.prepare()
            info = await self.supervisor.start()
            self.weights.engine_started()
            await self._start_episodes()
            self.link.connect()
            self.started.set()
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                self._loops = [
                    tg.create_task(self._recv_loop(), name="_recv_loop"),
                    tg.create_task(self._hello_loop(), name="_hello_loop"),
                    tg.create_task(self._heartbeat_loop(), name="_heartbeat_loop"),
                    tg.create_task(self._weights_loop(), name="_weights_loop"),
                    tg.create_task(self._engine_loop(), name="_engine_loop"),
                ]
                if self._episode_fns:
                    self._loops.append(tg.create_task(self._turns_loop(), name="_turns_loop"))
                tg.create_task(self._drain_loop(), name="_drain_loop")
                await self._do(self.session.engine_started(self._now(), _facts(info)))
        finally:
            await self._close()
        if self._fatal is not None:
            raise self._fatal

    async def apply_version(self, named_tensors: Mapping[str, Any], version: int) -> bool:
        """Apply a whole version through the rolling-update flow; True when the engine serves it."""
        try:
            return await self.weights.apply(named_tensors, version)
        except WeightSyncError as exc:
            log.error("version %d not applied: %s", version, exc, extra={"worker": self.worker_id})
            return False

    # -- carrying out the session's effects

    async def _do(self, eff: Effects) -> None:  # noqa: C901 - over 13 since oversize results became error results; to split per effect kind
        me = asyncio.current_task()
        for task_id in eff.stop_runners:
            runner = self._runners.pop(task_id, None)
            if runner is not None and runner is not me:
                runner.cancel()
        engine = self.supervisor.engine
        for task_id in eff.abort:
            if self.episodes is not None:
                # an episode group has no engine request of its own id: cancel its runner (run_group closes
                # every episode, aborting its turn in flight, and cancels its awaited tools); credits now
                runner = self._runners.pop(task_id, None)
                if runner is not None and runner is not me:
                    runner.cancel()
                eff.send += self.session.generation_finished(self._now(), task_id).send
                continue
            if engine is not None:
                try:
                    await engine.abort(task_id)
                except Exception:  # a failing engine is noticed by its task
                    log.debug("abort of %s raised", task_id, exc_info=True)
        if eff.rebase is not None:
            self.weights.rebase(eff.rebase)
        if eff.weights is not None:
            self.weights.note_weights(*eff.weights)
        pending = list(eff.send)
        for i, msg in enumerate(pending):
            try:
                sent = await self.link.send(msg)
            except MessageTooLargeError as exc:
                if not isinstance(msg, Result):
                    continue  # logged and counted by the link (a control message; a task's lease covers what it said)
                # the broker would drop it with the connection: the task fails, with the limit named
                log.error("result of task %s (%d trajectories) not sent: %s", msg.task_id, len(msg.trajectories), exc,
                          extra={"worker": self.worker_id})
                self.metrics.event("result_refused", {"worker_id": self.worker_id, "task_id": msg.task_id,
                                                      "limit": exc.limit, "bytes": exc.nbytes, "limit_bytes": exc.limit_bytes})
                msg = pending[i] = Result(task_id=msg.task_id, prompt_id=msg.prompt_id, error=f"the worker could not send its result: {exc}", retryable=False)
                try:
                    sent = await self.link.send(msg)
                except MessageTooLargeError:  # a limit too small for an error result: the lease deadline ends the task
                    continue
            if not sent:
                # the broker is unreachable: results wait in the outbox (a hello follows); the rest is dropped
                self.session.unsent(self._now(), [m for m in pending[i:] if isinstance(m, Result)])
                break
        for task in eff.start:
            assert self._tg is not None
            self._runners[task.task_id] = self._tg.create_task(self._run_task(task), name=f"task-{task.task_id}")
        if self.session.next_poll_at < self._poll_deadline:
            self._poll_wake.set()

    async def _hand_back(self, reason: str) -> None:
        """The supervisor's ``on_down``: every generating task goes back to the broker now."""
        await self._do(self.session.engine_failed(self._now(), reason))

    async def _engine_up(self, info: EngineInfo) -> None:
        """The supervisor's ``on_up``: a restarted engine serves; say hello again."""
        await self._do(self.session.engine_started(self._now(), _facts(info)))

    # -- one task

    async def _run_task(self, task: Task) -> None:
        task_id, prompt = task.task_id, task.prompt
        try:
            engine = self.supervisor.engine
            assert engine is not None
            if not self.session.wants_result(task_id):
                # cancelled before its runner reached the engine (an abort then finds no request): end it here
                await self._do(self.session.generation_finished(self._now(), task_id))
                return
            unsupported = self._unsupported(task, engine)
            if unsupported is not None:  # honoured or refused, never ignored: the trainer gets an error result naming it
                log.warning("task %s refused: %s", task_id, unsupported, extra={"worker": self.worker_id})
                await self._do(self.session.task_refused(self._now(), task_id, unsupported))
                return
            if self.episodes is not None:
                await self._run_episodes(task)
                return
            loaded: list[LoadedImage] = []
            try:
                loaded, extra = await self._images(task)
                out = await engine.generate(
                    None if prompt.input_ids is None else prompt.input_ids.tolist(),
                    prompt.group_size,
                    prompt.sampling,
                    task_id,
                    text=prompt.text,
                    apply_chat_template=prompt.apply_chat_template,
                    **extra,
                )
            except asyncio.CancelledError:
                raise
            except RequestRefusedError as exc:
                log.warning("task %s refused by the engine: %s", task_id, exc, extra={"worker": self.worker_id})
                await self._do(self.session.task_refused(self._now(), task_id, str(exc)))
                return
            except Exception as exc:  # noqa: BLE001 - the engine failed: hand back, restart
                if task_id in self.session.tasks:
                    log.error("engine failed on task %s: %s", task_id, exc, extra={"worker": self.worker_id})
                    await self.supervisor.fail(f"{type(exc).__name__}: {exc}")
                return
            ended = self.session.generation_finished(self._now(), task_id)
            if self._reward_fn is not None or not self.session.wants_result(task_id):
                await self._do(ended)  # the credits now: scoring may take a while (or there is no result)
                ended = Effects()
            if not self.session.wants_result(task_id):
                self.session.output_discarded(sum(len(s.output_ids) for s in out.samples))  # reported as wasted (cancel)
                return
            try:
                trajectories = build_trajectories(task, out, self.worker_id, tuple(im.sha256 for im in loaded))
            except BaseException:
                await self._do(ended)  # the credits are not lost with the result
                raise
            if self._reward_fn is not None:
                trajectories = await score_trajectories(self._reward_fn, task, trajectories, self.config.reward_timeout_s)
            # without scoring here the result is ready at once: its credits travel in it (Feature.RESULT_CREDITS)
            await self._do(self.session.fold_credits(ended.merge(self.session.task_finished(self._now(), task_id, trajectories))))
        finally:
            if self._runners.get(task_id) is asyncio.current_task():
                del self._runners[task_id]

    async def _images(self, task: Task) -> tuple[list[LoadedImage], dict[str, Any]]:
        """The prompt's images read and checked, and the engine's ``images=`` keyword (none without images).

        Off the event loop (a path or a fetch may block); a bad image raises `RequestRefusedError`: this prompt only."""
        if not task.prompt.images:
            return [], {}
        loaded = await asyncio.to_thread(load_images, task.prompt.images, self.config.image_policy())
        return loaded, {"images": [im.data for im in loaded]}

    def _unsupported(self, task: Task, engine: Engine) -> str | None:
        """Why this worker cannot honour the task's sampling (top or prompt logprobs), or None."""
        sp, info = task.prompt.sampling, engine.info()
        what = "the episode runner" if self.episodes is not None else f"the {info.name} engine"
        if sp.top_logprobs_num > 0 and (self.episodes is not None or not info.top_logprobs):
            return f"top_logprobs_num={sp.top_logprobs_num}: {what} does not report top logprobs"
        if sp.logprob_start_len >= 0 and (self.episodes is not None or not info.prompt_logprobs):
            return f"logprob_start_len={sp.logprob_start_len}: {what} does not report prompt logprobs"
        if task.prompt.images and (self.episodes is not None or not info.images):
            return f"{len(task.prompt.images)} images: {what} takes no images"
        return None

    async def _run_episodes(self, task: Task) -> None:
        """The task's group as n episodes (n credits, as n samples). A cancel (drain deadline, broker cancel,
        engine failure) cancels every episode and its awaited tools; the session hands the group back."""
        assert self.episodes is not None
        trajectories = await self.episodes.run_group(
            task.prompt, task.prompt.group_size, attempt=task.attempt, queued_at=task.queued_at, request_prefix=task.task_id,
            replay=task.replay, serve_replay=self.config.episode_replay, min_version=task.min_version,
            on_turn=functools.partial(self._turn_finished, task.task_id, task.prompt.prompt_id),
        )
        await self._flush_turns(task.task_id)
        await self._do(self.session.generation_finished(self._now(), task.task_id))
        if not self.session.wants_result(task.task_id):
            return
        if self._reward_fn is not None:
            # the episode's return value wins; --reward scores only the trajectories it left unscored
            unscored = [t for t in trajectories if t.reward is None and "episode_error" not in t.metadata]
            if unscored:
                scored = {id(t): s for t, s in zip(unscored, await score_trajectories(
                    self._reward_fn, task, unscored, self.config.reward_timeout_s), strict=True)}
                trajectories = [scored.get(id(t), t) for t in trajectories]
        await self._do(self.session.task_finished(self._now(), task.task_id, trajectories))

    def _turn_finished(self, task_id: str, prompt_id: str, turn: RecordedTurn) -> None:
        """An episode's turn ended: stream it to a broker that keeps turns (`Feature.REPLAY`), in `_turns_loop`."""
        if Feature.REPLAY not in self.session.broker_features:
            return
        if len(self._turns) >= _MAX_PENDING_TURNS:
            self.turns_dropped += 1
            return
        self._turns.append((task_id, prompt_id, turn))
        self._turns_ready.set()

    async def _turns_loop(self) -> None:
        """Send finished turns, those of `_TURNS_GATHER_S` together: one `TurnRecordBatch` of every task's `TurnRecords` to a
        broker listing `Feature.TURN_BATCH`, else (or when that message is over the broker's limits) one `TurnRecords` per
        task, in order."""
        while True:
            await self._turns_ready.wait()
            if not self._turns_now.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_TURNS_GATHER_S):
                        await self._turns_now.wait()
            self._turns_ready.clear()
            self._turns_now.clear()
            self._turns_sending = True
            try:
                batches: dict[str, tuple[str, list[RecordedTurn]]] = {}
                while self._turns:
                    task_id, prompt_id, turn = self._turns.popleft()
                    batches.setdefault(task_id, (prompt_id, []))[1].append(turn)
                records = [TurnRecords(task_id=task_id, prompt_id=prompt_id, turns=tuple(turns))
                           for task_id, (prompt_id, turns) in batches.items()]
                if len(records) > 1 and Feature.TURN_BATCH in self.session.broker_features:
                    try:  # one message for the pass (`TurnRecordBatch`): each message costs a send and a read
                        sent = await self.link.send(TurnRecordBatch(records=tuple(records)))
                    except MessageTooLargeError:  # over the broker's limit together: task by task, as before
                        sent = None
                    if sent is not None:
                        if not sent:
                            self.turns_dropped += sum(len(r.turns) for r in records)
                        records = []
                for r in records:
                    try:
                        sent = await self.link.send(r)
                    except MessageTooLargeError:
                        sent = False
                    if not sent:
                        self.turns_dropped += len(r.turns)
            finally:
                self._turns_sending = False
                self._turns_passes += 1
                self._turns_passed.set()

    async def _flush_turns(self, task_id: str | None = None) -> None:
        """Return once the task's finished turns (every task's, when None) were sent: before its result, as when each
        was sent at once, and before a drain hands the unfinished episodes back."""
        queued = any(task_id is None or t == task_id for t, _, _ in self._turns)
        if not queued and not self._turns_sending:
            return
        target = self._turns_passes + (1 if self._turns_sending else 0) + (1 if queued else 0)
        self._turns_now.set()
        self._turns_ready.set()
        with contextlib.suppress(TimeoutError):  # a link that cannot send: the result goes on (turns are best effort)
            async with asyncio.timeout(self.config.send_timeout_s * 2 + 1):
                while self._turns_passes < target:
                    self._turns_passed.clear()
                    await self._turns_passed.wait()

    async def _start_episodes(self) -> None:
        if not self._episode_fns:
            return
        engine = self.supervisor.engine
        assert engine is not None
        tokenizer = self._tokenizer if self._tokenizer is not None else getattr(engine, "tokenizer", None)
        if tokenizer is None and self.config.model:
            # an engine without a public tokenizer (sglang): the model directory's own
            tokenizer = await asyncio.to_thread(load_tokenizer, self.config.model)
        cfg = EpisodeConfig(
            max_episodes=self.config.max_episodes,
            episode_timeout_s=self.config.episode_timeout_s,
            tool_call_parser=self.config.tool_call_parser,
            max_context_tokens=self.config.max_context_tokens,
            image_policy=self.config.image_policy(),
            agent_processes=self.config.agent_processes,
            agent_restart_backoff_s=self.config.restart_backoff_s,
            agent_restart_backoff_max_s=max(self.config.restart_backoff_s, self.config.restart_backoff_max_s),
        )
        watched = cast(Engine, _SupervisedEngine(self.supervisor))
        self.episodes = EpisodeRunner(watched, self._episode_fns, cfg, tokenizer=tokenizer, worker_id=self.worker_id,
                                      specs=self.config.episode)
        await self.episodes.start()

    # -- loops

    async def _recv_loop(self) -> None:
        while True:
            msg = await self.link.recv()
            if msg is None:
                continue
            if isinstance(msg, Error) and msg.ref_type == "hello" and msg.code in _REFUSED_BROKER:
                # another pool's broker (or one of no common protocol) answers at this endpoint: no hello will change that
                self._fatal = ConfigError(f"the broker at {self.config.broker} refused this worker ({msg.code}): {msg.message}")
                log.critical("%s", self._fatal, extra={"worker": self.worker_id})
                self.stop()
                continue
            if isinstance(msg, Welcome):  # what the broker accepts: every message from now on is checked against it
                if msg.epoch != self.session.epoch:
                    log.info("joined the broker at %s (epoch %s, protocol minor %d)", self.config.broker, msg.epoch,
                             msg.protocol_minor, extra={"worker": self.worker_id})
                self.link.peer_limits = (msg.max_msg_bytes, msg.max_header_bytes)
                self.link.inline = inline_for(settle_minor(msg.protocol_minor), msg.max_header_bytes)
            eff = self.session.handle(self._now(), msg)
            if eff is not None:
                await self._do(eff)
            elif isinstance(msg, ApplyGrant):
                self.weights.on_grant(msg.version)
            elif isinstance(msg, Control):
                self._spawn_control(msg)
            else:
                self._bad_msgs.warning(f"type:{type(msg).__name__}", "unexpected %s from the broker", type(msg).__name__)

    async def _hello_loop(self) -> None:
        """The session's hello schedule: retries with backoff, and the broker-silence check."""
        while True:
            await self._do(self.session.poll(self._now()))
            self._poll_deadline = self.session.next_poll_at
            self._poll_wake.clear()
            delay = self._poll_deadline - self._now()
            if delay <= 0:
                continue
            try:
                await asyncio.wait_for(self._poll_wake.wait(), None if math.isinf(delay) else delay)
            except TimeoutError:
                pass

    async def _heartbeat_loop(self) -> None:
        ttl_s = 3 * self.config.heartbeat_interval_s
        while True:
            beat = self.session.heartbeat(self._now())
            if beat is not None:
                await self.link.send(beat)
            if type(self.metrics) is not NullMetricsSink:  # the fields are built only for a sink that takes them
                self.metrics.publish_state("worker", self.worker_id, self._state_fields(self.session.state), ttl_s=ttl_s)
            await asyncio.sleep(self.config.heartbeat_interval_s)

    async def _weights_loop(self) -> None:
        await self.weights.run()

    async def _engine_loop(self) -> None:
        try:
            await self.supervisor.run()
        except EngineError as exc:
            log.critical("%s", exc, extra={"worker": self.worker_id})
            self._fatal = exc
            self.stop()

    async def _drain_loop(self) -> None:
        await self._stop_requested.wait()
        log.info("draining: finishing in-flight work for up to %.1fs", self.config.drain_timeout_s, extra={"worker": self.worker_id})
        runners = [r for r in self._runners.values() if not r.done()]
        if runners:
            await asyncio.wait(runners, timeout=self.config.drain_timeout_s)
        await self._flush_turns()  # the turns of the episodes handed back: a re-run elsewhere samples only the rest
        await self._do(self.session.hand_back_rest(self._now()))
        await self._do(self.session.goodbye(self._now()))
        self.stopped_cleanly = True
        for task in [*self._loops, *self._controls]:
            task.cancel()

    # -- control ops

    def _spawn_control(self, msg: Control) -> None:
        assert self._tg is not None
        task = self._tg.create_task(self._on_control(msg), name=f"control-{msg.request_id}")
        self._controls.add(task)
        task.add_done_callback(self._controls.discard)

    async def _on_control(self, msg: Control) -> None:
        engine = self.supervisor.engine
        error: str | None = None
        try:
            if engine is None:
                raise RuntimeError("no engine")
            if msg.op == "sleep":
                await engine.release_memory(msg.tags)
                self.session.set_sleeping(self._now(), True)
            elif msg.op == "wake":
                await engine.resume_memory(msg.tags)
                self.session.set_sleeping(self._now(), False)
            elif msg.op == "flush_cache":
                await engine.flush_cache()
            elif msg.op == "drain":
                self.stop()
            elif msg.op == "resume":
                pass
            elif msg.op == "update_weights_from_disk":
                path, version = str(msg.args["path"]), int(msg.args["version"])
                from rollpool.workers.engines.checkpoint import load_checkpoint_tensors

                tensors = await asyncio.to_thread(load_checkpoint_tensors, path)
                if not await self.apply_version(tensors, version):
                    raise RuntimeError(f"version {version} from {path} was not applied")
            else:
                raise ValueError(f"unknown control op {msg.op!r}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            error = f"{type(exc).__name__}: {exc}"
        reply = ControlReply(
            request_id=msg.request_id,
            ok=error is None,
            error=error,
            results={self.worker_id: {"ok": error is None, "error": error}},
            epoch=self.session.epoch,
        )
        await self.link.send(reply)

    # -- engine, monitoring, close

    def _registry_factory(self) -> Engine:
        from rollpool.workers.engines.registry import get_engine

        engine: Engine = get_engine(self.config.engine)(**self.config.engine_kwargs())
        return engine

    def _state_fields(self, state: str) -> dict[str, Any]:
        engine = self.supervisor.engine
        info = engine.info() if engine is not None else None
        s = self.session
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "engine": info.name if info else self.config.engine,
            "model": info.model if info else (self.config.model or ""),
            "weight_version": s.version,
            "state": state,
            "inflight": len(s.tasks),
            "credits": s.free_credits(),
            "tokens_total": s.tokens_total,
            "tokens_per_s": round(s.tokens_per_s(self._now()), 3),
            "last_seen": time.time(),
            "simulated": bool(info.simulated) if info else False,
            "restarts": self.supervisor.restarts,
            **{f"refused.limit.{k}": v for k, v in self.link.refused.items()},
            **(self._episode_fields() if self.episodes is not None else {}),
            **self._weight_fields(),
        }

    def _episode_fields(self) -> dict[str, Any]:
        assert self.episodes is not None
        out = {f"episodes_{k}": v for k, v in self.episodes.stats.as_dict().items()}
        out["episodes_turns_not_streamed"] = self.turns_dropped
        return out

    def _weight_fields(self) -> dict[str, Any]:
        """How the weights arrive (`rollpool top` and the exporter show them): the last path, the bytes per lane,
        the fallbacks, the held digest lists asked for."""
        sub = self.weights.subscriber
        out: dict[str, Any] = {"held_lists_sent": self.session.held_lists_sent}
        if sub is None:
            return out
        for key, attr in (("weights_last_path", "last_path"), ("weights_network_bytes", "bytes_received"),
                          ("weights_bulk_bytes", "bulk_bytes"), ("weights_early_bytes", "early_bytes"), ("weights_shm_bytes", "shm_bytes"), ("weights_ipc_bytes", "ipc_bytes"),
                          ("weights_refetched", "buckets_refetched")):
            value = getattr(sub, attr, None)  # a subscriber of a test's factory may have fewer
            if value is not None:
                out[key] = value
        fallbacks = getattr(sub, "fallbacks", None)
        if isinstance(fallbacks, dict):
            out["weights_fallbacks"] = sum(fallbacks.values())
        last = getattr(sub, "last_fallback", None)
        if isinstance(last, str) and last:
            out["weights_last_fallback"] = last[:200]
        for key, attr in (("weights_delta_versions", "delta_versions"), ("weights_delta_fallbacks", "delta_fallbacks")):
            value = getattr(sub, attr, None)
            if isinstance(value, int):
                out[key] = value
        wire = getattr(sub, "last_wire", None)
        if wire is not None:  # the last version on the wire: its bytes by encoding (``full``: not a delta), the changed fraction
            out["weights_wire_version"] = wire.version
            out["weights_wire_model_bytes"] = wire.model_bytes
            out["weights_wire_bytes"] = wire.wire_bytes
            out["weights_wire_changed_fraction"] = round(wire.changed_fraction, 6)
            for enc, n in wire.bytes_by_encoding.items():
                out[f"weights_wire_{enc}_bytes"] = n
        return out

    async def _close(self) -> None:
        for runner in list(self._runners.values()):
            runner.cancel()
        if self.episodes is not None:
            await self.episodes.close()
        await self.supervisor.stop()
        self.weights.close()
        # a clean drain gives the Goodbye a moment on the wire; otherwise linger 0
        self.link.close(linger_ms=200 if self.stopped_cleanly else 0)
        self.metrics.publish_state("worker", self.worker_id, self._state_fields(WorkerState.STOPPED), ttl_s=3 * self.config.heartbeat_interval_s)



class _SupervisedEngine:
    """The engine as the episodes see it: always the supervisor's current one, and a failure of its
    ``generate`` (anything but `RequestRefusedError`) is an engine failure, as for a plain task: the
    supervisor hands back every task (their episodes are cancelled) and restarts the engine. The
    episode that saw it gets the exception too, but its group is re-run elsewhere, not reported."""

    def __init__(self, supervisor: EngineSupervisor) -> None:
        self._supervisor = supervisor

    def _engine(self) -> Engine:
        engine = self._supervisor.engine
        if engine is None:
            raise EngineError("the engine is restarting")
        return engine

    def __getattr__(self, name: str) -> Any:
        if name == "generate_constrained":  # only where the engine has it (`ConstrainedEngine` is checked by attribute)
            getattr(self._engine(), name)
            return self._generate_constrained
        return getattr(self._engine(), name)

    def info(self) -> EngineInfo:
        return self._engine().info()

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        return await self._watched("generate", *args, **kwargs)

    async def _generate_constrained(self, *args: Any, **kwargs: Any) -> Any:
        return await self._watched("generate_constrained", *args, **kwargs)

    async def _watched(self, method: str, *args: Any, **kwargs: Any) -> Any:
        engine = self._engine()
        try:
            return await getattr(engine, method)(*args, **kwargs)
        except (asyncio.CancelledError, RequestRefusedError):
            raise
        except Exception as exc:
            if self._supervisor.engine is engine:
                await self._supervisor.fail(f"{type(exc).__name__}: {exc}")
            raise
