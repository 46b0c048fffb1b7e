"""The rollout worker: one engine, one DEALER to the broker, versioned weights.

Guarantees (see docs/workers.md and docs/contracts.md):

- Hello (protocol range, engine fingerprint, capacity, credits, in-flight
  tasks) until a Welcome answers, with backoff (``reconnect_backoff_s``
  doubling to ``reconnect_backoff_max_s``); again whenever the broker shows a
  new epoch, falls silent for ``missed_heartbeats`` intervals, or the engine
  was restarted. The DEALER sets ZMQ_IMMEDIATE, so nothing piles up for an
  absent broker; results finished meanwhile wait in an outbox and go out
  after the next Welcome (their tasks are re-announced as in flight).
- Credits: the broker is never told it may send more sequences than the
  engine's free capacity; a task that would exceed it is handed back (Nack).
  Credits come back as soon as generation ends (a reward function runs off
  the engine's credits).
- Each task yields exactly one message: a Result (every trajectory field
  filled, per-token versions, rewards), a Result with ``error`` for a prompt
  the engine refuses, a Nack (engine failure, draining, over credit), or
  nothing when the broker cancelled it.
- Engine failure: every generating task is handed back at once (Nack), the
  engine is restarted with backoff and given the current weights again, then
  the worker says hello again. A failed apply is treated the same way, and
  the whole version is applied to the new engine before it takes work.
- Weights: a `WeightSubscriber` (from `rollpool.weights`, or the injected
  `subscriber_factory`) fetches a newer version completely while generation
  goes on; an engine with `stage_weights` copies it to its device while it
  still generates; then ApplyRequest -> ApplyGrant -> pause(mode),
  update_weights, resume -> ApplyDone. `apply_version()` runs the same flow on
  given tensors. The worker holds at most two versions in host memory (the
  applied one, kept to re-apply after an engine restart, and the one being
  fetched, which reuses the buffers of the one before).
- `stop()` (SIGTERM): stop intake, let in-flight work finish until
  ``drain_timeout_s``, hand back the rest (Nack), say Goodbye, return.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollpool.protocol import SUPPORTED_MAJORS, decode, encode
from rollpool.protocol.errors import ProtocolError, RequestRefusedError, WeightSyncError
from rollpool.protocol.logs import RateLimitedLog
from rollpool.protocol.messages import (
    ApplyDone,
    ApplyGrant,
    ApplyRequest,
    BrokerHeartbeat,
    Cancel,
    Control,
    ControlReply,
    Credit,
    Error,
    Goodbye,
    Hello,
    InflightTask,
    Nack,
    Result,
    Task,
    Trajectory,
    Welcome,
    WorkerHeartbeat,
)
from rollpool.protocol.metrics import MetricsSink, NullMetricsSink
from rollpool.protocol.sockets import SocketFactory
from rollpool.workers.config import WorkerConfig
from rollpool.workers.engines.base import Engine, GenerateOutput
from rollpool.workers.reward import RewardFn, load_reward, score

__all__ = ["Worker"]

log = logging.getLogger(__name__)

SubscriberFactory = Callable[..., Any]
EngineFactory = Callable[[], Engine]


@dataclass(eq=False)
class _TaskState:
    task: Task
    received_at: float
    phase: str = "generating"
    """generating -> scoring -> done; or handed_back / cancelled."""
    runner: asyncio.Task[None] | None = None
    cancelled: bool = False
    handed_back: bool = False
    seqs: int = field(init=False)

    def __post_init__(self) -> None:
        self.seqs = self.task.prompt.group_size


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
    ) -> None:
        self.config = config
        self.sockets = sockets
        self.metrics: MetricsSink = metrics if metrics is not None else NullMetricsSink()
        self.worker_id = config.worker_id
        self._engine_factory = engine_factory or self._registry_factory
        self._engine: Engine | None = engine
        self._subscriber_factory = subscriber_factory
        self._reward_fn = reward_fn if reward_fn is not None else (load_reward(config.reward) if config.reward else None)
        self._sock: Any = None
        self._send_lock = asyncio.Lock()
        self._tasks: dict[str, _TaskState] = {}
        self._outbox: deque[Result] = deque()
        self._epoch = ""
        self._welcomed = asyncio.Event()
        self._hello_needed = asyncio.Event()
        self._stop_requested = asyncio.Event()
        self._last_broker_msg = 0.0
        self._state = "starting"
        self._capacity = 0
        self._version = -1
        self._current_weights: tuple[Mapping[str, Any], int] | None = None
        self._fetched: Any = None
        """The `WeightVersion` whose tensors are `_current_weights` (recycled once a newer one is applied)."""
        self._weight_endpoints: tuple[str, str | None] | None = None
        self._subscriber: Any = None
        self._subscriber_ready = asyncio.Event()
        self._apply_lock = asyncio.Lock()
        self._grants: dict[int, asyncio.Future[None]] = {}
        self._restart_lock = asyncio.Lock()
        self._engine_ok = asyncio.Event()
        self.tokens_total = 0
        self._token_window: deque[tuple[float, int]] = deque(maxlen=256)
        self._bad_msgs = RateLimitedLog(log)
        self._loops: list[asyncio.Task[Any]] = []
        self._tg: asyncio.TaskGroup | None = None
        self.restarts = 0
        self.hellos_sent = 0
        self.stopped_cleanly = False

    # -- public API

    @property
    def engine(self) -> Engine | None:
        return self._engine

    @property
    def state(self) -> str:
        return self._state

    @property
    def weight_version(self) -> int:
        return self._version

    def inflight_task_ids(self) -> tuple[str, ...]:
        return tuple(tid for tid, ts in self._tasks.items() if ts.phase in ("generating", "scoring"))

    def stop(self) -> None:
        """Begin the graceful drain; `run()` returns when it is done. Safe to call twice."""
        self._stop_requested.set()

    async def run(self) -> None:
        try:
            if self._subscriber_factory is None:
                # importing the weight channel imports torch (seconds): do it off the loop, before the
                # first hello, so that a later weight update never stalls heartbeats
                await asyncio.to_thread(importlib.import_module, "rollpool.weights.subscriber")
            await self._start_engine()
            self._connect()
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                self._loops = [
                    tg.create_task(self._recv_loop(), name="_recv_loop"),
                    tg.create_task(self._hello_loop(), name="_hello_loop"),
                    tg.create_task(self._heartbeat_loop(), name="_heartbeat_loop"),
                    tg.create_task(self._weights_loop(), name="_weights_loop"),
                ]
                tg.create_task(self._drain_loop(), name="_drain_loop")
        finally:
            await self._close()

    async def apply_version(self, named_tensors: Mapping[str, Any], version: int) -> bool:
        """Apply a fully fetched version through the rolling-update flow; True when applied."""
        async with self._apply_lock:
            if version <= self._version:
                return True
            await self._engine_ok.wait()
            await self._wait_grant(version)
            self._state = "applying"
            t0 = time.monotonic()
            error: str | None = None
            engine = self._engine
            assert engine is not None
            try:
                mode = self._apply_mode(engine)
                await engine.pause(mode)
                await engine.update_weights(named_tensors, version)
                await engine.resume()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure here means a restart
                error = f"{type(exc).__name__}: {exc}"
            duration = time.monotonic() - t0
            await self._send(ApplyDone(version=version, ok=error is None, duration_s=duration, error=error))
            if error is None:
                self._version = version
                self._current_weights = (named_tensors, version)
                self._state = "ready" if not self._stop_requested.is_set() else "draining"
                self.metrics.event("version_applied", {"worker_id": self.worker_id, "version": version, "duration_s": duration})
                log.info("applied weight version %d in %.3fs", version, duration, extra={"worker": self.worker_id})
                return True
            log.error("apply of version %d failed (%s); restarting the engine", version, error, extra={"worker": self.worker_id})
            self.metrics.event("apply_failed", {"worker_id": self.worker_id, "version": version, "error": error})
            await self._restart_engine(f"apply failed: {error}", reapply=(named_tensors, version))
            return self._version >= version

    # -- engine lifecycle

    def _registry_factory(self) -> Engine:
        from rollpool.workers.engines.registry import get_engine

        return get_engine(self.config.engine)(**self.config.engine_kwargs())

    async def _start_engine(self) -> None:
        if self._engine is None:
            self._engine = self._engine_factory()
        await self._engine.start()
        info = self._engine.info()
        self._capacity = min(self.config.capacity, info.capacity) if self.config.capacity else info.capacity
        if self._version < 0:
            self._version = info.weight_version
        self._state = "ready"
        self._engine_ok.set()

    def _apply_mode(self, engine: Engine) -> str:
        modes = engine.info().apply_modes
        if self.config.apply_mode in modes:
            return self.config.apply_mode
        log.warning("engine does not support apply mode %s; using %s", self.config.apply_mode, modes[0])
        return modes[0]

    async def _engine_failed(self, reason: str) -> None:
        """Hand back every generating task now, then restart the engine."""
        if self._restart_lock.locked():
            return
        await self._restart_engine(reason)

    async def _restart_engine(self, reason: str, reapply: tuple[Mapping[str, Any], int] | None = None) -> None:
        async with self._restart_lock:
            self._engine_ok.clear()
            self._state = "restarting"
            self.restarts += 1
            self.metrics.event("engine_restart", {"worker_id": self.worker_id, "reason": reason})
            handed = [ts for ts in self._tasks.values() if ts.phase == "generating"]
            for ts in handed:
                ts.handed_back, ts.phase = True, "handed_back"
                self._tasks.pop(ts.task.task_id, None)
            if handed:
                await self._send(Nack(task_ids=tuple(ts.task.task_id for ts in handed), reason=f"engine_failed: {reason}"))
            for ts in handed:
                if ts.runner is not None and ts.runner is not asyncio.current_task():
                    ts.runner.cancel()
            old, self._engine = self._engine, None
            if old is not None:
                try:
                    await old.stop()
                except Exception:  # noqa: BLE001 - it is dead anyway
                    log.debug("stopping the failed engine raised", exc_info=True)
            weights = reapply or self._current_weights
            backoff = self.config.restart_backoff_s
            while True:
                try:
                    engine = self._engine_factory()
                    await engine.start()
                    if weights is not None:
                        mode = self._apply_mode(engine)
                        await engine.pause(mode)
                        await engine.update_weights(weights[0], weights[1])
                        await engine.resume()
                        self._version = weights[1]
                        self._current_weights = weights
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - retried with backoff
                    log.error("engine restart failed (%s); retrying in %.1fs", exc, backoff, extra={"worker": self.worker_id})
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, self.config.restart_backoff_max_s)
            self._engine = engine
            self._state = "draining" if self._stop_requested.is_set() else "ready"
            self._engine_ok.set()
            log.warning("engine restarted (%s) at version %d", reason, self._version, extra={"worker": self.worker_id})
            self._welcomed.clear()
            self._hello_needed.set()

    # -- sockets

    def _connect(self) -> None:
        import zmq

        sock = self.sockets.dealer(None, identity=self.worker_id.encode())
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no queue for an absent broker: hellos retry instead
        sock.connect(self.config.broker)
        self._sock = sock

    async def _send(self, msg: Any) -> bool:
        """Send one message; False when the broker is unreachable within the send timeout."""
        if self._sock is None:
            return False
        frames = encode(msg)
        async with self._send_lock:
            try:
                await asyncio.wait_for(self._sock.send_multipart(frames), self.config.send_timeout_s)
            except TimeoutError:
                log.debug("send of %s timed out", type(msg).__name__)
                return False
            except Exception as exc:  # noqa: BLE001 - zmq errors: the broker is unreachable
                log.warning("send of %s failed: %s", type(msg).__name__, exc)
                return False
        return True

    async def _close(self) -> None:
        for ts in list(self._tasks.values()):
            if ts.runner is not None and not ts.runner.done():
                ts.runner.cancel()
        if self._engine is not None:
            try:
                await self._engine.stop()
            except Exception:  # noqa: BLE001
                log.warning("engine stop raised", exc_info=True)
        if self._subscriber is not None:
            try:
                self._subscriber.close()
            except Exception:  # noqa: BLE001
                log.warning("weight subscriber close raised", exc_info=True)
        if self._sock is not None:
            # a clean drain gives the Goodbye a moment on the wire; otherwise linger 0
            self._sock.close(linger=200 if self.stopped_cleanly else 0)
            self._sock = None
        self.metrics.publish_state("worker", self.worker_id, self._state_fields("stopped"), ttl_s=3 * self.config.heartbeat_interval_s)

    # -- loops

    async def _recv_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                msg = decode(frames)
            except ProtocolError as exc:
                self._bad_msgs.warning("broker", "undecodable message from the broker: %s", exc)
                continue
            self._last_broker_msg = time.monotonic()
            await self._handle(msg)

    async def _handle(self, msg: Any) -> None:
        if isinstance(msg, Welcome):
            await self._on_welcome(msg)
        elif isinstance(msg, Task):
            await self._on_task(msg)
        elif isinstance(msg, BrokerHeartbeat):
            self._on_broker_heartbeat(msg)
        elif isinstance(msg, Cancel):
            for task_id in msg.task_ids:
                await self._cancel(task_id)
        elif isinstance(msg, ApplyGrant):
            fut = self._grants.get(msg.version)
            if fut is not None and not fut.done():
                fut.set_result(None)
        elif isinstance(msg, Control):
            assert self._tg is not None
            self._tg.create_task(self._on_control(msg), name=f"control-{msg.request_id}")
        elif isinstance(msg, Error):
            log.warning("broker error %s: %s", msg.code, msg.message, extra={"worker": self.worker_id})
            if msg.code == "hello_required":
                self._welcomed.clear()
                self._hello_needed.set()
        elif isinstance(msg, Goodbye):
            log.warning("broker said goodbye (%s)", msg.reason, extra={"worker": self.worker_id})
            self._welcomed.clear()
            self._hello_needed.set()
        else:
            self._bad_msgs.warning(f"type:{type(msg).__name__}", "unexpected %s from the broker", type(msg).__name__)

    async def _hello_loop(self) -> None:
        interval = self.config.heartbeat_interval_s
        backoff = self.config.reconnect_backoff_s
        while True:
            if not self._welcomed.is_set():
                await self._engine_ok.wait()
                self._hello_needed.clear()
                await self._send(self._hello())
                self.hellos_sent += 1
                try:
                    await asyncio.wait_for(self._welcomed.wait(), backoff)
                    backoff = self.config.reconnect_backoff_s
                except TimeoutError:
                    backoff = min(backoff * 2, self.config.reconnect_backoff_max_s)
                continue
            try:
                await asyncio.wait_for(self._hello_needed.wait(), interval)
                self._welcomed.clear()
                continue
            except TimeoutError:
                pass
            silent_s = time.monotonic() - self._last_broker_msg
            if silent_s > self.config.missed_heartbeats * interval:
                log.warning("broker silent for %.1fs; saying hello again", silent_s, extra={"worker": self.worker_id})
                self._welcomed.clear()

    async def _heartbeat_loop(self) -> None:
        while True:
            if self._epoch:  # also while a re-hello is pending, so the broker keeps us alive
                await self._send(
                    WorkerHeartbeat(
                        worker_id=self.worker_id,
                        inflight_task_ids=self.inflight_task_ids(),
                        weight_version=self._version,
                        state=self._state,
                        tokens_total=self.tokens_total,
                        epoch=self._epoch,
                    )
                )
            self.metrics.publish_state("worker", self.worker_id, self._state_fields(self._state), ttl_s=3 * self.config.heartbeat_interval_s)
            await asyncio.sleep(self.config.heartbeat_interval_s)

    async def _weights_loop(self) -> None:
        await self._subscriber_ready.wait()
        sub = self._subscriber
        backoff = self.config.reconnect_backoff_s
        while True:
            target = await sub.wait_for_newer(self._version)
            if target <= self._version:
                continue
            try:
                wv = await sub.fetch(target)
            except WeightSyncError as exc:
                log.warning("weight version %d not fetched (%s); retrying in %.1fs", target, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.config.reconnect_backoff_max_s)
                continue
            backoff = self.config.reconnect_backoff_s
            await self._stage(wv.tensors, int(wv.version))
            if await self.apply_version(wv.tensors, int(wv.version)):
                # the engine copied the previous version: its buffers take the next fetch (no fresh pages)
                previous, self._fetched = self._fetched, wv
                if previous is not None and hasattr(sub, "recycle"):
                    sub.recycle(previous)

    async def _stage(self, named_tensors: Mapping[str, Any], version: int) -> None:
        """Let an engine that can (`stage_weights`) copy the version to its device while it still generates."""
        engine = self._engine
        stage = getattr(engine, "stage_weights", None)
        if stage is None or not self._engine_ok.is_set():
            return
        try:
            await stage(named_tensors, version)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - staging is an optimisation; the apply checks again and fails loudly
            log.warning("staging weight version %d failed (%s); it is copied during the pause instead", version, exc,
                        extra={"worker": self.worker_id})

    async def _drain_loop(self) -> None:
        await self._stop_requested.wait()
        self._state = "draining"
        log.info("draining: finishing in-flight work for up to %.1fs", self.config.drain_timeout_s, extra={"worker": self.worker_id})
        runners = [ts.runner for ts in self._tasks.values() if ts.runner is not None and not ts.runner.done()]
        if runners:
            await asyncio.wait(runners, timeout=self.config.drain_timeout_s)
        rest = [ts for ts in self._tasks.values() if ts.phase in ("generating", "scoring")]
        for ts in rest:
            ts.handed_back, ts.phase = True, "handed_back"
            if ts.runner is not None:
                ts.runner.cancel()
        handed = [ts.task.task_id for ts in rest]
        while self._outbox:  # results finished while the broker was away: deliver, or hand back
            result = self._outbox.popleft()
            if not self._epoch or not await self._send(result):
                handed.append(result.task_id)
        if handed:
            await self._send(Nack(task_ids=tuple(handed), reason="worker_shutdown"))
        if self._epoch:
            await self._send(Goodbye(reason="shutdown"))
        self.stopped_cleanly = True
        self._state = "stopped"
        for loop_task in self._loops:
            loop_task.cancel()

    # -- message handlers

    def _hello(self) -> Hello:
        engine = self._engine
        assert engine is not None
        info = engine.info()
        inflight = [
            InflightTask(task_id=ts.task.task_id, prompt_id=ts.task.prompt.prompt_id, group_size=ts.seqs, attempt=ts.task.attempt)
            for ts in self._tasks.values()
            if ts.phase in ("generating", "scoring")
        ]
        inflight += [
            InflightTask(task_id=r.task_id, prompt_id=r.prompt_id, group_size=len(r.trajectories), attempt=r.trajectories[0].attempt if r.trajectories else 0)
            for r in self._outbox
        ]
        return Hello(
            worker_id=self.worker_id,
            protocol_min=min(SUPPORTED_MAJORS),
            protocol_max=max(SUPPORTED_MAJORS),
            engine=info.name,
            capacity=self._capacity,
            credits=self._free_credits(),
            weight_version=self._version,
            apply_modes=tuple(info.apply_modes),
            fingerprint=info.fingerprint,
            inflight=tuple(inflight),
            engine_info=info.as_dict(),
            host=socket.gethostname(),
            pid=os.getpid(),
            pool=self.config.pool,
        )

    def _free_credits(self) -> int:
        if self._stop_requested.is_set() or self._state in ("restarting", "draining", "stopped"):
            return 0
        return max(0, self._capacity - self._engine_seqs())

    def _engine_seqs(self) -> int:
        return sum(ts.seqs for ts in self._tasks.values() if ts.phase == "generating")

    async def _on_welcome(self, msg: Welcome) -> None:
        new_epoch = msg.epoch != self._epoch
        if new_epoch and self._epoch:
            log.warning("broker epoch changed %s -> %s", self._epoch, msg.epoch, extra={"worker": self.worker_id})
        self._epoch = msg.epoch
        for task_id in msg.refused:
            ts = self._tasks.pop(task_id, None)
            if ts is not None:
                ts.cancelled, ts.phase = True, "cancelled"
                if self._engine is not None:
                    await self._engine.abort(task_id)
            self._outbox = deque(r for r in self._outbox if r.task_id != task_id)
        self._note_weights(msg.weight_version, msg.weight_endpoint, msg.announce_endpoint)
        self._welcomed.set()
        while self._outbox:
            result = self._outbox[0]
            if not await self._send(result):
                self._welcomed.clear()
                return
            self._outbox.popleft()

    def _on_broker_heartbeat(self, msg: BrokerHeartbeat) -> None:
        if self._welcomed.is_set() and msg.epoch != self._epoch:
            log.warning("broker heartbeat from new epoch %s; saying hello again", msg.epoch, extra={"worker": self.worker_id})
            self._welcomed.clear()
            self._hello_needed.set()
        self._note_weights(msg.weight_version, msg.weight_endpoint, msg.announce_endpoint)

    def _note_weights(self, version: int, endpoint: str | None, announce: str | None) -> None:
        if self.config.weight_endpoint:  # a node-local relay overrides what the broker names
            endpoint, announce = self.config.weight_endpoint, self.config.weight_announce_endpoint
        if endpoint and self._subscriber is None:
            factory = self._subscriber_factory
            if factory is None:
                from rollpool.weights import WeightSubscriber  # type: ignore[attr-defined]

                factory = WeightSubscriber
            extra: dict[str, Any] = {}
            if self._engine is not None and str(self._engine.info().device or "").startswith("cuda"):
                # page-locked buckets: the copy to the GPU (staging) runs at full PCIe speed, asynchronously
                extra["pin_memory"] = True
            self._subscriber = factory(
                self.sockets,
                worker_id=self.worker_id,
                fetch_timeout_s=self.config.fetch_timeout_s,
                window_chunks=self.config.window_chunks,
                max_refetch=self.config.max_refetch,
                **extra,
            )
            self._subscriber.connect(endpoint, announce)
            self._weight_endpoints = (endpoint, announce)
            self._subscriber_ready.set()
        if self._subscriber is not None and version >= 0:
            self._subscriber.note_version(version)

    async def _on_task(self, task: Task) -> None:
        task_id = task.task_id
        if task_id in self._tasks:
            return  # already running (re-sent after a re-hello)
        n = task.prompt.group_size
        reason = None
        if self._stop_requested.is_set():
            reason = "worker_draining"
        elif self._state == "restarting" or not self._engine_ok.is_set():
            reason = "engine_restarting"
        elif self._engine_seqs() + n > self._capacity:
            reason = "over_credit"
        if reason is not None:
            log.info("handing back task %s: %s", task_id, reason, extra={"worker": self.worker_id})
            await self._send(Nack(task_ids=(task_id,), reason=reason))
            return
        ts = _TaskState(task, time.time())
        self._tasks[task_id] = ts
        assert self._tg is not None
        ts.runner = self._tg.create_task(self._run_task(ts), name=f"task-{task_id}")

    async def _cancel(self, task_id: str) -> None:
        ts = self._tasks.get(task_id)
        if ts is None:
            self._outbox = deque(r for r in self._outbox if r.task_id != task_id)
            return
        ts.cancelled = True
        if ts.phase == "generating" and self._engine is not None:
            try:
                await self._engine.abort(task_id)
            except Exception:  # noqa: BLE001 - a failing engine is noticed by its task
                log.debug("abort of %s raised", task_id, exc_info=True)
        elif ts.phase == "scoring" and ts.runner is not None:
            ts.runner.cancel()
            self._tasks.pop(task_id, None)

    async def _run_task(self, ts: _TaskState) -> None:
        task = ts.task
        prompt = task.prompt
        engine = self._engine
        assert engine is not None
        try:
            out = await engine.generate(
                None if prompt.input_ids is None else prompt.input_ids.tolist(),
                prompt.group_size,
                prompt.sampling,
                task.task_id,
                text=prompt.text,
                apply_chat_template=prompt.apply_chat_template,
            )
        except asyncio.CancelledError:
            raise
        except RequestRefusedError as exc:
            self._finish_generation(ts)
            log.warning("task %s refused by the engine: %s", task.task_id, exc, extra={"worker": self.worker_id})
            await self._deliver(Result(task_id=task.task_id, prompt_id=prompt.prompt_id, error=f"invalid: {exc}", retryable=False))
            self._tasks.pop(task.task_id, None)
            await self._return_credits(ts)
            return
        except Exception as exc:  # noqa: BLE001 - the engine failed: hand back, restart
            if ts.handed_back:
                return
            log.error("engine failed on task %s: %s", task.task_id, exc, extra={"worker": self.worker_id})
            await self._engine_failed(f"{type(exc).__name__}: {exc}")
            return
        if ts.handed_back:
            return
        self._finish_generation(ts)
        await self._return_credits(ts)
        if ts.cancelled:
            self._tasks.pop(task.task_id, None)
            return
        trajectories = await self._trajectories(ts, out)
        self._tasks.pop(task.task_id, None)
        ts.phase = "done"
        if ts.cancelled:
            return
        await self._deliver(Result(task_id=task.task_id, prompt_id=prompt.prompt_id, trajectories=tuple(trajectories)))

    def _finish_generation(self, ts: _TaskState) -> None:
        ts.phase = "scoring"

    async def _return_credits(self, ts: _TaskState) -> None:
        if self._stop_requested.is_set() or self._state == "restarting" or not self._epoch:
            return  # no more work wanted, or the next hello grants afresh
        await self._send(Credit(credits=ts.seqs))

    async def _deliver(self, result: Result) -> None:
        if self._welcomed.is_set() and await self._send(result):
            return
        self._outbox.append(result)

    async def _trajectories(self, ts: _TaskState, out: GenerateOutput) -> list[Trajectory]:
        task, prompt = ts.task, ts.task.prompt
        input_ids = np.asarray(out.input_ids, dtype=np.int32)
        base_meta = dict(prompt.metadata)
        if out.simulated:
            base_meta["simulated"] = True
        trajectories = []
        for s in out.samples:
            n_out = len(s.output_ids)
            self.tokens_total += n_out
            self._token_window.append((time.monotonic(), n_out))
            traj = Trajectory(
                prompt_id=prompt.prompt_id,
                sample_index=s.index,
                input_ids=input_ids,
                output_ids=np.asarray(s.output_ids, dtype=np.int32),
                output_logprobs=np.asarray(s.logprobs, dtype=np.float32),
                token_versions=np.asarray(s.token_versions, dtype=np.int32),
                loss_mask=np.ones(n_out, dtype=np.uint8),
                finish_reason=s.finish_reason,
                worker_id=self.worker_id,
                attempt=task.attempt,
                output_text=s.output_text,
                queued_at=task.queued_at,
                started_at=out.started_at,
                first_token_at=s.first_token_at,
                finished_at=s.finished_at,
                reward=None,
                metadata=dict(base_meta),
            )
            trajectories.append(traj)
        if self._reward_fn is None:
            return trajectories
        scored = await asyncio.gather(*(score(self._reward_fn, prompt.metadata, t, self.config.reward_timeout_s) for t in trajectories))
        out_list = []
        for t, (value, error) in zip(trajectories, scored, strict=True):
            if error is not None:
                t.metadata["reward_error"] = error
                log.warning("reward for %s: %s", t.trajectory_id, error, extra={"worker": self.worker_id})
            out_list.append(dataclasses.replace(t, reward=value))
        return out_list

    async def _wait_grant(self, version: int) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                fut: asyncio.Future[None] = loop.create_future()
                self._grants[version] = fut
                await self._send(ApplyRequest(version=version))
                try:
                    await asyncio.wait_for(fut, self.config.apply_grant_timeout_s)
                    return
                except TimeoutError:
                    log.warning("no apply grant for version %d yet; asking again", version)
        finally:
            self._grants.pop(version, None)

    async def _on_control(self, msg: Control) -> None:
        engine = self._engine
        error: str | None = None
        try:
            if engine is None:
                raise RuntimeError("no engine")
            if msg.op == "sleep":
                await engine.release_memory(msg.tags)
                self._state = "sleeping"
            elif msg.op == "wake":
                await engine.resume_memory(msg.tags)
                self._state = "ready"
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
        await self._send(
            ControlReply(
                request_id=msg.request_id,
                ok=error is None,
                error=error,
                results={self.worker_id: {"ok": error is None, "error": error}},
                epoch=self._epoch,
            )
        )

    # -- monitoring

    def _tokens_per_s(self) -> float:
        now = time.monotonic()
        window = [(t, n) for t, n in self._token_window if now - t <= 10.0]
        if not window:
            return 0.0
        span = max(now - window[0][0], self.config.heartbeat_interval_s)
        return sum(n for _, n in window) / span

    def _state_fields(self, state: str) -> dict[str, Any]:
        info = self._engine.info() if self._engine is not None else None
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "engine": info.name if info else self.config.engine,
            "model": info.model if info else (self.config.model or ""),
            "weight_version": self._version,
            "state": state,
            "inflight": len(self.inflight_task_ids()),
            "credits": self._free_credits(),
            "tokens_total": self.tokens_total,
            "tokens_per_s": round(self._tokens_per_s(), 3),
            "last_seen": time.time(),
            "simulated": bool(info.simulated) if info else False,
            "restarts": self.restarts,
        }
