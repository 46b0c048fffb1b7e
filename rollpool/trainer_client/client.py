"""The trainer's client: submit prompts, pull whole groups, publish weights.

`TrainerClient` is asyncio; `SyncTrainerClient` (in `sync.py`) runs one on a
background loop thread for plain training loops.

Guarantees the trainer relies on:

* Every prompt gets a unique `prompt_id` (one is made when none is given).
* `get_batch(n)` returns n whole DONE groups, each trajectory at most once
  (deduplicated by `trajectory_id` across the client's life, within a bounded
  window), and the other terminal states (FAILED, CANCELLED, DROPPED_STALE)
  the broker reported meanwhile, each exactly once. Groups are acknowledged to
  the broker only after they were returned (on the next pull, or at `close()`),
  so a client that dies mid-step gets them redelivered when it reconnects with
  the same `client_id`.
* A broker restart is noticed by its new epoch: the client says hello again
  and resubmits every prompt not yet delivered; the broker merges a
  resubmission with a task a worker re-announced, and the first result wins.
* The hard staleness bound: a group whose oldest token is more than
  `max_staleness` versions behind the trainer's version is dropped and
  counted (or resubmitted under a fresh id with ``regenerate_stale=True``).
* Every request has a timeout and a bounded number of retries; a broker that
  does not answer raises `BrokerUnavailableError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollpool.protocol import (
    SUPPORTED_MAJORS,
    Ack,
    Batch,
    BrokerUnavailableError,
    ClientHello,
    ClientWelcome,
    ConfigError,
    Control,
    ControlReply,
    Error,
    GroupResult,
    GroupState,
    MetricsSink,
    NullMetricsSink,
    Prompt,
    ProtocolError,
    Pull,
    RejectedError,
    Reply,
    SamplingParams,
    SecurityConfig,
    SetVersion,
    SocketFactory,
    StatusReply,
    StatusRequest,
    Submit,
    SubmitReply,
    Trajectory,
    decode,
    encode,
    trajectory_staleness,
)
from rollpool.protocol.codec import check_size  # roles hook (issue 21)
from rollpool.protocol.errors import MessageTooLargeError  # roles hook (issue 21)
from rollpool.protocol.limits import DEFAULT_LIMITS  # roles hook (issue 21)

__all__ = ["TrainerClientConfig", "TrainerClient", "RolloutBatch", "SubmitResult", "make_prompt"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainerClientConfig:
    broker: str = field(default="tcp://127.0.0.1:5556", metadata={"help": "the broker's client endpoint"})
    client_id: str | None = field(default=None, metadata={"help": "stable id: a restarted trainer with the same id gets unacknowledged groups again"})
    request_timeout_s: float = field(default=10.0, metadata={"help": "timeout of one request attempt"})
    request_retries: int = field(default=3, metadata={"help": "attempts per request before BrokerUnavailableError"})
    pull_wait_s: float = field(default=1.0, metadata={"help": "long-poll wait of one pull"})
    submit_chunk: int = field(default=512, metadata={"help": "prompts per submit message"})
    dedup_window: int = field(default=1_000_000, metadata={"help": "trajectory ids remembered for deduplication"})
    regenerate_stale: bool = field(default=False, metadata={"help": "resubmit groups dropped by max_staleness instead of only counting them"})
    weight_router_endpoint: str = field(default="tcp://127.0.0.1:*", metadata={"help": "where the hosted weight publisher serves buckets"})
    weight_pub_endpoint: str = field(default="tcp://127.0.0.1:*", metadata={"help": "where the hosted weight publisher announces versions"})
    keep_versions: int = field(default=2, metadata={"help": "weight versions the publisher keeps (0: serve the trainer's tensors while publish waits)"})
    bucket_bytes: int = field(default=512 * 1024 * 1024, metadata={"help": "weight bucket size"})
    curve_dir: str | None = field(default=None, metadata={"help": "CURVE key directory from `rollpool keys gen` (None: plaintext)"})

    def __post_init__(self) -> None:
        if self.request_timeout_s <= 0:
            raise ConfigError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.request_retries < 1:
            raise ConfigError(f"request_retries must be >= 1, got {self.request_retries}")
        if self.pull_wait_s < 0:
            raise ConfigError(f"pull_wait_s must be >= 0, got {self.pull_wait_s}")
        if self.submit_chunk < 1:
            raise ConfigError(f"submit_chunk must be >= 1, got {self.submit_chunk}")
        if self.dedup_window < 1:
            raise ConfigError(f"dedup_window must be >= 1, got {self.dedup_window}")


@dataclass
class SubmitResult:
    accepted: list[str]
    rejected: dict[str, str]
    """prompt_id -> reason (``duplicate``, ``invalid``, ``group_too_large``, ``queue_full``, ...)."""


@dataclass
class RolloutBatch:
    """What `get_batch` returns."""

    groups: list[GroupResult]
    """n whole DONE groups (each with all its trajectories)."""
    other: list[GroupResult]
    """Groups that ended otherwise (FAILED, CANCELLED, DROPPED_STALE) since the last batch."""
    stats: dict[str, float]
    """Lag, staleness and throughput figures, ready for wandb or TensorBoard."""

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]


def make_prompt(item: Prompt | Mapping[str, Any] | str | Sequence[int], *, group_size: int = 1,
                sampling: SamplingParams | Mapping[str, Any] | None = None, metadata: Mapping[str, Any] | None = None) -> Prompt:
    """Turn a Prompt, a dict of Prompt fields, a text or a list of token ids into a `Prompt` with a unique id."""
    if isinstance(item, Prompt):
        return item if item.prompt_id else _with_id(item)
    sp = _sampling(sampling)
    if isinstance(item, str):
        return Prompt(prompt_id=new_prompt_id(), text=item, group_size=group_size, sampling=sp, metadata=dict(metadata or {}))
    if isinstance(item, Mapping):
        kw = dict(item)
        kw.setdefault("prompt_id", new_prompt_id())
        if not kw["prompt_id"]:
            kw["prompt_id"] = new_prompt_id()
        kw.setdefault("group_size", group_size)
        kw["sampling"] = _sampling(kw.get("sampling", sampling))
        if kw.get("input_ids") is not None:
            kw["input_ids"] = np.asarray(kw["input_ids"], dtype=np.int32)
        kw.setdefault("metadata", dict(metadata or {}))
        return Prompt(**kw)
    ids = np.asarray(item, dtype=np.int32)
    if ids.ndim != 1:
        raise ValueError("a prompt given as token ids must be one flat sequence")
    return Prompt(prompt_id=new_prompt_id(), input_ids=ids, group_size=group_size, sampling=sp, metadata=dict(metadata or {}))


_prompt_counter = itertools.count()
_prompt_prefix = uuid.uuid4().hex[:10]


def new_prompt_id() -> str:
    """Unique across processes and runs (random prefix) and cheap (a counter)."""
    return f"{_prompt_prefix}-{next(_prompt_counter)}"


def _with_id(p: Prompt) -> Prompt:
    import dataclasses

    return dataclasses.replace(p, prompt_id=new_prompt_id())


def _sampling(s: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
    if s is None:
        return SamplingParams()
    if isinstance(s, SamplingParams):
        return s
    kw = dict(s)
    kw.pop("n", None)
    for key in ("stop_token_ids", "stop"):
        if key in kw and kw[key] is not None:
            kw[key] = tuple([kw[key]] if isinstance(kw[key], (str, int)) else kw[key])
    if isinstance(kw.get("stop"), tuple) is False and "stop" in kw and kw["stop"] is None:
        kw.pop("stop")
    return SamplingParams(**kw)


class _Dedup:
    """A bounded set that forgets the oldest ids first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, key: str) -> bool:
        """True when `key` is new."""
        if key in self._ids:
            return False
        self._ids[key] = None
        if len(self._ids) > self.capacity:
            self._ids.popitem(last=False)
        return True

    def __contains__(self, key: str) -> bool:
        return key in self._ids


class TrainerClient:
    """The asyncio trainer client. Use ``async with TrainerClient(...) as c:`` or `connect()`/`close()`."""

    def __init__(
        self,
        broker: str | None = None,
        *,
        config: TrainerClientConfig | None = None,
        sockets: SocketFactory | None = None,
        metrics: MetricsSink | None = None,
        fingerprint: str = "",
    ) -> None:
        cfg = config or TrainerClientConfig()
        if broker is not None:
            import dataclasses

            cfg = dataclasses.replace(cfg, broker=broker)
        self.config = cfg
        self.client_id = cfg.client_id or f"trainer-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.fingerprint = fingerprint
        self._own_context = sockets is None
        if sockets is None:
            import zmq.asyncio

            sockets = SocketFactory(zmq.asyncio.Context(), security=SecurityConfig.from_dir(cfg.curve_dir, role="trainer"))
        self.sockets = sockets
        self.metrics = metrics or NullMetricsSink()
        self._sock: Any = None
        self._broker_limits: tuple[int, int] = (0, 0)
        """What the broker said it accepts (max_msg_bytes, max_header_bytes); 0: the defaults (roles hook, issue 21)."""
        self._recv_task: asyncio.Task[None] | None = None
        self._waiters: dict[str, asyncio.Future[Any]] = {}
        self._req_counter = itertools.count()
        self.epoch: str | None = None
        self.version = 0
        self._pending: dict[str, Prompt] = {}  # accepted, not yet delivered
        self._to_ack: list[str] = []
        self._to_ack_stale: list[str] = []
        self._delivered = _Dedup(cfg.dedup_window)
        self._traj_seen = _Dedup(cfg.dedup_window)
        self._ready: deque[GroupResult] = deque()
        self._other: list[GroupResult] = []
        self._epoch_lock = asyncio.Lock()
        self._publisher: Any = None
        self._closed = False
        self.counters: dict[str, int] = {
            "submitted": 0,
            "rejected": 0,
            "resubmitted": 0,
            "groups_delivered": 0,
            "trajectories_delivered": 0,
            "duplicates_dropped": 0,
            "dropped_stale": 0,
            "regenerated_stale": 0,
            "failed": 0,
            "cancelled": 0,
            "broker_restarts": 0,
        }
        self._last_batch_at: float | None = None

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> TrainerClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        if self._sock is not None:
            return
        self._sock = self.sockets.dealer(self.config.broker, identity=self.client_id.encode())
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop(), name="trainer_client._recv_loop")
        await self._hello()

    async def close(self) -> None:
        """Acknowledge what was returned, stop the publisher, close the socket."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._sock is not None and (self._to_ack or self._to_ack_stale):
                with contextlib.suppress(Exception):
                    stale = tuple(self._to_ack_stale)
                    await self._send(Ack(prompt_ids=tuple(self._to_ack) + stale, dropped_stale=stale))
                    self._to_ack, self._to_ack_stale = [], []
            if self._publisher is not None:
                with contextlib.suppress(Exception):
                    await self._publisher.close()
        finally:
            if self._recv_task is not None:
                self._recv_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await self._recv_task
            if self._sock is not None:
                self._sock.close(linger=0)
                self._sock = None
            for fut in self._waiters.values():
                if not fut.done():
                    fut.set_exception(BrokerUnavailableError("client closed"))
            self._waiters.clear()
            if self._own_context:
                self.sockets.close()
                self.sockets.context.term()

    # ------------------------------------------------------------------ requests

    def _rid(self) -> str:
        return f"{self.client_id}:{next(self._req_counter)}"

    async def _send(self, msg: Any) -> None:
        frames = encode(msg)
        # roles hook (issue 21): refuse what the broker said it would drop, naming the limit
        check_size(frames, self._broker_limits[0], msg.TYPE, self._broker_limits[1])
        await self._sock.send_multipart(frames, copy=False)

    async def _recv_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                msg = decode(frames)
            except ProtocolError as exc:
                log.warning("undecodable reply from the broker: %s", exc)
                continue
            # ClientWelcome carries no request id: it answers the one outstanding hello
            rid = "hello" if isinstance(msg, ClientWelcome) else getattr(msg, "request_id", None)
            fut = self._waiters.pop(rid, None) if rid is not None else None
            if fut is not None and not fut.done():
                fut.set_result(msg)
            elif isinstance(msg, Error):
                log.warning("broker error: %s %s", msg.code, msg.message)

    async def _request(self, make: Any, timeout_s: float | None = None, key: str | None = None) -> Any:
        """Send `make(request_id)` and await the reply, retrying with backoff; epoch changes are handled here."""
        timeout = timeout_s if timeout_s is not None else self.config.request_timeout_s
        last: BaseException | None = None
        for attempt in range(self.config.request_retries):
            rid = key or self._rid()
            fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._waiters[rid] = fut
            try:
                await self._send(make(rid))
                reply = await asyncio.wait_for(fut, timeout)
            except MessageTooLargeError:  # roles hook (issue 21): retrying cannot help
                self._waiters.pop(rid, None)
                raise
            except TimeoutError as exc:
                last = exc
                self._waiters.pop(rid, None)
                log.warning("broker did not answer within %.1f s (attempt %d/%d)", timeout, attempt + 1, self.config.request_retries)
                await asyncio.sleep(min(0.1 * 2**attempt, 2.0))
                continue
            except Exception as exc:  # zmq.Again on a full socket, for example
                last = exc
                self._waiters.pop(rid, None)
                await asyncio.sleep(min(0.1 * 2**attempt, 2.0))
                continue
            if isinstance(reply, Error):
                raise RejectedError(reply.code, reply.message)
            epoch = getattr(reply, "epoch", "")
            if epoch and self.epoch is not None and epoch != self.epoch:
                await self._on_new_epoch(epoch)
            return reply
        raise BrokerUnavailableError(f"broker {self.config.broker} did not answer after {self.config.request_retries} attempts: {last!r}")

    async def _hello(self) -> ClientWelcome:
        reply = await self._request(
            lambda rid: ClientHello(client_id=self.client_id, protocol_min=min(SUPPORTED_MAJORS),
                                    protocol_max=max(SUPPORTED_MAJORS), fingerprint=self.fingerprint,
                                    max_msg_bytes=self.sockets.options.max_msg_bytes,
                                    max_header_bytes=DEFAULT_LIMITS.max_header_bytes),
            key="hello",
        )
        if not isinstance(reply, ClientWelcome):
            raise ProtocolError("unexpected", f"expected client_welcome, got {type(reply).__name__}")
        self.epoch = reply.epoch
        self._broker_limits = (reply.max_msg_bytes, reply.max_header_bytes)  # roles hook (issue 21)
        return reply

    async def _on_new_epoch(self, epoch: str) -> None:
        """The broker restarted: hello again, re-announce the version, resubmit what was not delivered."""
        async with self._epoch_lock:
            if epoch == self.epoch:
                return
            log.warning("broker restarted (epoch %s -> %s): resubmitting %d undelivered prompts", self.epoch, epoch, len(self._pending))
            self.counters["broker_restarts"] += 1
            self.epoch = epoch
            self.metrics.event("broker_restart_seen", {"client_id": self.client_id, "epoch": epoch})
            await self._hello()
            if self.version or self._publisher is not None:
                await self._set_version_request(self.version)
            prompts = list(self._pending.values())
            for i in range(0, len(prompts), self.config.submit_chunk):
                chunk = tuple(prompts[i : i + self.config.submit_chunk])
                reply = await self._request(lambda rid, c=chunk: Submit(request_id=rid, prompts=c))
                self.counters["resubmitted"] += len(reply.accepted)

    # ------------------------------------------------------------------ public API

    async def submit(self, prompts: Iterable[Prompt | Mapping[str, Any] | str | Sequence[int]], *, group_size: int = 1,
                     sampling: SamplingParams | Mapping[str, Any] | None = None) -> SubmitResult:
        """Submit prompts; returns the accepted ids and the rejected ones with reasons (nothing is silently lost)."""
        items = [make_prompt(p, group_size=group_size, sampling=sampling) for p in prompts]
        result = SubmitResult(accepted=[], rejected={})
        for i in range(0, len(items), self.config.submit_chunk):
            chunk = tuple(items[i : i + self.config.submit_chunk])
            reply = await self._request(lambda rid, c=chunk: Submit(request_id=rid, prompts=c))
            if not isinstance(reply, SubmitReply):
                raise ProtocolError("unexpected", f"expected submit_reply, got {type(reply).__name__}")
            by_id = {p.prompt_id: p for p in chunk}
            for pid in reply.accepted:
                if pid in by_id:
                    self._pending[pid] = by_id[pid]
                    result.accepted.append(pid)
            for rej in reply.rejected:
                if rej.reason == "duplicate" and rej.prompt_id in self._pending:
                    result.accepted.append(rej.prompt_id)  # a retried submit the broker already had
                    continue
                result.rejected[rej.prompt_id] = rej.reason
        self.counters["submitted"] += len(result.accepted)
        self.counters["rejected"] += len(result.rejected)
        return result

    async def get_batch(self, n: int, max_staleness: int | None = None, timeout: float | None = None) -> RolloutBatch:  # noqa: ASYNC109
        """Wait for n whole DONE groups (and collect other terminal states meanwhile).

        Raises `TimeoutError` when `timeout` passes first; groups received so
        far stay buffered for the next call (nothing is lost).
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        t0 = time.monotonic()
        deadline = None if timeout is None else t0 + timeout
        dropped_before = self.counters["dropped_stale"]
        while len(self._ready) < n:
            wait = self.config.pull_wait_s
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"get_batch({n}) got {len(self._ready)} groups within {timeout} s")
                wait = min(wait, left)
            if self._to_ack_stale:
                stale = tuple(self._to_ack_stale)
                await self._send(Ack(prompt_ids=stale, dropped_stale=stale))
                self._to_ack_stale = self._to_ack_stale[len(stale):]
            acks = tuple(self._to_ack)
            reply = await self._request(
                lambda rid, w=wait, a=acks: Pull(request_id=rid, max_groups=n - len(self._ready), wait_s=w, ack=a),
                timeout_s=wait + self.config.request_timeout_s,
            )
            # the broker took the acks with the pull; keep only those added since
            self._to_ack = self._to_ack[len(acks):]
            if not isinstance(reply, Batch):
                raise ProtocolError("unexpected", f"expected batch, got {type(reply).__name__}")
            if reply.weight_version > self.version:
                self.version = reply.weight_version
            for g in reply.groups:
                await self._take(g, max_staleness)
        groups = [self._ready.popleft() for _ in range(n)]
        other, self._other = self._other, []
        for g in groups:
            self._to_ack.append(g.prompt_id)
        for g in other:
            self._to_ack.append(g.prompt_id)
        return RolloutBatch(groups=groups, other=other, stats=self._batch_stats(groups, t0, dropped_before))

    async def _take(self, g: GroupResult, max_staleness: int | None) -> None:
        if g.prompt_id in self._delivered:
            self.counters["duplicates_dropped"] += 1
            self._to_ack.append(g.prompt_id)  # the broker redelivered something we already returned
            return
        self._pending.pop(g.prompt_id, None)
        if g.state != GroupState.DONE:
            self._delivered.add(g.prompt_id)
            self._other.append(g)
            if g.state == GroupState.FAILED:
                self.counters["failed"] += 1
            elif g.state == GroupState.CANCELLED:
                self.counters["cancelled"] += 1
            elif g.state == GroupState.DROPPED_STALE:
                self.counters["dropped_stale"] += 1
            return
        fresh = [t for t in g.trajectories if self._traj_seen.add(t.trajectory_id)]
        if len(fresh) != len(g.trajectories):
            self.counters["duplicates_dropped"] += len(g.trajectories) - len(fresh)
        if max_staleness is not None and fresh:
            staleness = max(trajectory_staleness(self.version, t.token_versions) for t in fresh)
            if staleness > max_staleness:
                self._delivered.add(g.prompt_id)
                self.counters["dropped_stale"] += 1
                self._to_ack_stale.append(g.prompt_id)
                self.metrics.event("dropped_stale", {"prompt_id": g.prompt_id, "staleness": staleness})
                if self.config.regenerate_stale:
                    import dataclasses

                    original = self._prompt_for(g)
                    if original is not None:
                        await self.submit([dataclasses.replace(original, prompt_id=new_prompt_id())])
                        self.counters["regenerated_stale"] += 1
                return
        self._delivered.add(g.prompt_id)
        if not fresh:
            return
        if len(fresh) != len(g.trajectories):
            import dataclasses

            g = dataclasses.replace(g, trajectories=tuple(fresh))
        self._ready.append(g)

    def _prompt_for(self, g: GroupResult) -> Prompt | None:
        t = g.trajectories[0] if g.trajectories else None
        if t is None:
            return None
        return Prompt(prompt_id=g.prompt_id, input_ids=np.array(t.input_ids, dtype=np.int32),
                      group_size=len(g.trajectories), metadata=dict(t.metadata))

    def _batch_stats(self, groups: list[GroupResult], t0: float, dropped_before: int) -> dict[str, float]:
        now = time.monotonic()
        trajs = [t for g in groups for t in g.trajectories]
        tokens = sum(len(t.output_ids) for t in trajs)
        lags = [trajectory_staleness(self.version, t.token_versions) for t in trajs if len(t.token_versions)]
        for lag in lags:
            self.metrics.observe("staleness", float(lag))
        interval = now - self._last_batch_at if self._last_batch_at is not None else now - t0
        self._last_batch_at = now
        self.counters["groups_delivered"] += len(groups)
        self.counters["trajectories_delivered"] += len(trajs)
        rewards = [t.reward for t in trajs if t.reward is not None]
        return {
            "rollout/version": float(self.version),
            "rollout/groups": float(len(groups)),
            "rollout/samples": float(len(trajs)),
            "rollout/tokens": float(tokens),
            "rollout/wait_s": now - t0,
            "rollout/tokens_per_s": tokens / interval if interval > 0 else 0.0,
            "rollout/staleness_mean": float(np.mean(lags)) if lags else 0.0,
            "rollout/staleness_max": float(max(lags)) if lags else 0.0,
            "rollout/dropped_stale": float(self.counters["dropped_stale"] - dropped_before),
            "rollout/reward_mean": float(np.mean(rewards)) if rewards else float("nan"),
            "rollout/pending_prompts": float(len(self._pending)),
        }

    async def set_version(self, version: int) -> None:
        """Tell the broker the trainer's version (admission control counts from it)."""
        self.version = max(self.version, version)
        await self._set_version_request(version)

    async def _set_version_request(self, version: int) -> None:
        router = pub = None
        if self._publisher is not None:
            router, pub = self._publisher.router_endpoint, self._publisher.pub_endpoint
        reply = await self._request(lambda rid: SetVersion(request_id=rid, version=version, weight_endpoint=router, announce_endpoint=pub))
        if isinstance(reply, Reply) and not reply.ok:
            raise RejectedError("set_version", reply.error or "refused")

    async def publish_weights(self, model_or_named_tensors: Any, version: int) -> Any:
        """Publish a new weight version (hosting the publisher) and announce it to the broker."""
        if self._publisher is None:
            from rollpool.weights import WeightPublisher

            cfg = self.config
            self._publisher = WeightPublisher(
                self.sockets,
                router_endpoint=cfg.weight_router_endpoint,
                pub_endpoint=cfg.weight_pub_endpoint,
                keep_versions=cfg.keep_versions,
                bucket_bytes=cfg.bucket_bytes,
                metrics=self.metrics,
            )
            await self._publisher.start()
        manifest = await self._publisher.publish(model_or_named_tensors, version)
        await self.set_version(version)
        return manifest

    async def status(self) -> dict[str, Any]:
        reply = await self._request(lambda rid: StatusRequest(request_id=rid))
        if not isinstance(reply, StatusReply):
            raise ProtocolError("unexpected", f"expected status_reply, got {type(reply).__name__}")
        return {"epoch": reply.epoch, "counters": dict(reply.counters), "workers": dict(reply.workers),
                "client": dict(self.counters)}

    async def control(self, op: str, tags: Sequence[str] = (), timeout_s: float = 60.0, **args: Any) -> dict[str, Any]:
        reply = await self._request(
            lambda rid: Control(request_id=rid, op=op, tags=tuple(tags), args=args, timeout_s=timeout_s),
            timeout_s=timeout_s + self.config.request_timeout_s,
        )
        if isinstance(reply, ControlReply):
            if not reply.ok:
                raise RejectedError(op, reply.error or f"{op} failed on some workers: {reply.results}")
            return dict(reply.results)
        if isinstance(reply, Reply):
            if not reply.ok:
                raise RejectedError(op, reply.error or "refused")
            return dict(reply.data)
        raise ProtocolError("unexpected", f"expected control_reply, got {type(reply).__name__}")

    async def sleep(self, tags: Sequence[str] = ()) -> dict[str, Any]:
        return await self.control("sleep", tags)

    async def wake(self, tags: Sequence[str] = ()) -> dict[str, Any]:
        return await self.control("wake", tags)

    async def flush_cache(self) -> dict[str, Any]:
        return await self.control("flush_cache")

    def pending(self) -> int:
        """Prompts accepted and not yet delivered."""
        return len(self._pending)
