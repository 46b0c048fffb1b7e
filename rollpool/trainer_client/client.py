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
* The hard staleness bound: what happens to a group whose oldest sampled token
  is more than `max_staleness` versions behind the trainer's version is the
  ``stale_policy`` (per client in the config, or per `get_batch`): ``drop``
  (counted and released), ``regenerate`` (its original prompt resubmitted under
  a fresh id, the old one reported DROPPED_STALE with ``regenerated_as``) or
  ``keep`` (delivered with its staleness stated, up to ``max_staleness_keep``,
  for importance-weight correction; see `RolloutBatch.samples`). Every group
  the bound drops is reported in `RolloutBatch.other` / `RolloutBatch.reports`.
* Every request has a timeout and a bounded number of retries; a broker that
  does not answer raises `BrokerUnavailableError`.
* Versioned service: ``submit(..., exact_weight_version=v)`` has each group served only at weight version
  v (`Prompt.exact_weight_version`): delivered only when every sampled token is of v, or reported FAILED
  at once with the reason when no live worker holds v and none can reach it; a v the pool cannot serve
  is rejected at submit. A broker older than protocol 1.14 (`CONTRACT_MINOR`) would ignore the field, so
  such a submit to it raises `RejectedError` before anything is sent. `wait_for_version(v, fraction, timeout)`
  returns once that share of the live workers serves v or newer, and raises at once when the rest gave v up.
* Named policies: ``submit(..., policy=name)`` (or `Prompt.policy`) has each group generated with the LoRA adapter
  of that name (`AdapterSpec.name`, as `publish_weights(..., adapter=spec)` published it; docs/lora.md). Every
  version this client announces says which adapter the pool serves from it on, so a prompt naming another policy is
  rejected at submit (``policy_unavailable``, naming what is served) and the delivered trajectories say
  ``policy``. A broker older than protocol 1.25 (`POLICY_MINOR`) would ignore the field: such a submit raises
  `RejectedError` before anything is sent.
* `get_batch` without a timeout never waits for what cannot come: when fewer
  groups could ever arrive than it asks for (those buffered here, plus this
  client's prompts still pending, or plus every group the broker holds queued,
  leased or done), it raises `UnfillableBatchError` at once
  (``raise_when_unfillable``; a group dropped as stale under ``drop`` does not
  come back). A caller that gave a timeout bounded the wait itself and gets
  `TimeoutError` as before. While it waits it logs what it waits for every
  ``wait_log_s``.
* Versions move forward: `set_version` with a version older than the pool's is
  refused (`RejectedError` naming both). A trainer that resumed from a
  checkpoint calls `rebase_version(v)` first: the pool's version becomes v and
  admission restarts from it (see `rebase_version`).

The bookkeeping behind these (pending prompts, dedup windows, acks, stale
verdicts, what to regenerate, counters) is the pure `ClientLedger` in
`ledger.py`; this module is the I/O around it: requests, retries, epochs, the
hosted weight publisher and metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
import os
import socket
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from rollpool.protocol import (
    CONTRACT_MINOR,
    POLICY_MINOR,
    PROTOCOL_MINOR,
    SUPPORTED_MAJORS,
    Ack,
    AdapterSpec,
    Batch,
    BrokerUnavailableError,
    CancelPrompts,
    ClientHello,
    ClientWelcome,
    ConfigError,
    Control,
    ControlReply,
    Error,
    GroupResult,
    Inline,
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
    WeightSyncError,
    decode,
    encode,
    inline_for,
    settle_minor,
)
from rollpool.trainer_client.ledger import (
    ABANDONED_POLICIES,
    STALE_POLICIES,
    ClientLedger,
    RolloutBatch,
    SubmitResult,
    TakeOutcome,
)
from rollpool.weights.config import WeightPathConfig

if TYPE_CHECKING:
    from rollpool.weights import WeightPublisher
from rollpool.protocol.codec import check_size
from rollpool.protocol.errors import MessageTooLargeError, RollpoolError, WeightsRefusedError
from rollpool.protocol.limits import DEFAULT_LIMITS
from rollpool.protocol.sampling import sampling_problem

__all__ = ["TrainerClientConfig", "TrainerClient", "RolloutBatch", "SubmitResult", "UnfillableBatchError", "make_prompt"]

log = logging.getLogger(__name__)

_R = TypeVar("_R")


class UnfillableBatchError(RollpoolError):
    """`get_batch(n)` asked for more groups than can ever arrive; the message says what there is and why."""


@dataclass(frozen=True)
class TrainerClientConfig:
    broker: str = field(default="tcp://127.0.0.1:5556", metadata={"help": "the broker's client endpoint"})
    client_id: str | None = field(default=None, metadata={"help": "stable id: a restarted trainer with the same id gets unacknowledged groups again"})
    request_timeout_s: float = field(default=10.0, metadata={"help": "timeout of one request attempt"})
    request_retries: int = field(default=3, metadata={"help": "attempts per request before BrokerUnavailableError"})
    pull_wait_s: float = field(default=1.0, metadata={"help": "long-poll wait of one pull"})
    wait_log_s: float = field(default=30.0, metadata={"help": "get_batch logs what it still waits for this often"})
    raise_when_unfillable: bool = field(default=True, metadata={"help": "get_batch without a timeout raises UnfillableBatchError when fewer groups can arrive than it asks for (False: wait for prompts others will submit)"})
    submit_chunk: int = field(default=512, metadata={"help": "prompts per submit message"})
    dedup_window: int = field(default=1_000_000, metadata={"help": "trajectory ids remembered for deduplication"})
    stale_policy: str = field(default="drop", metadata={"help": "groups staler than max_staleness: drop, regenerate (resubmit the original prompt under a fresh id) or keep (deliver with staleness stated, up to max_staleness_keep)"})
    max_staleness_keep: int | None = field(default=None, metadata={"help": "stale_policy keep: most staleness delivered (None: 2 x max_staleness)"})
    regenerate_stale: bool = field(default=False, metadata={"help": "deprecated: stale_policy='regenerate'"})
    abandoned_policy: str = field(default="drop", metadata={"help": "after rebase_version: groups made on weights of the abandoned run are dropped (drop) or their original prompts resubmitted under fresh ids (regenerate); never delivered as fresh"})
    weight_router_endpoint: str = field(default="tcp://127.0.0.1:*", metadata={"help": "where the hosted weight publisher serves buckets"})
    weight_pub_endpoint: str = field(default="tcp://127.0.0.1:*", metadata={"help": "where the hosted weight publisher announces versions"})
    keep_versions: int = field(default=2, metadata={"help": "weight versions the publisher keeps (0: serve the trainer's tensors while publish waits)"})
    bucket_bytes: int = field(default=512 * 1024 * 1024, metadata={"help": "weight bucket size"})
    weights: WeightPathConfig = field(default_factory=WeightPathConfig.from_env,
                                      metadata={"help": "the hosted publisher's weight-path knobs (flat flags --weight-path, --pinned-budget-bytes, ...)"})
    pool: str = field(default="default", metadata={"help": "pool name (the publisher's shared-memory segment names)"})
    curve_dir: str | None = field(default=None, metadata={"help": "CURVE key directory from `rollpool keys gen` (None: plaintext)"})

    def __post_init__(self) -> None:
        if self.request_timeout_s <= 0:
            raise ConfigError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.request_retries < 1:
            raise ConfigError(f"request_retries must be >= 1, got {self.request_retries}")
        if self.pull_wait_s < 0:
            raise ConfigError(f"pull_wait_s must be >= 0, got {self.pull_wait_s}")
        if self.wait_log_s <= 0:
            raise ConfigError(f"wait_log_s must be > 0, got {self.wait_log_s}")
        if self.submit_chunk < 1:
            raise ConfigError(f"submit_chunk must be >= 1, got {self.submit_chunk}")
        if self.dedup_window < 1:
            raise ConfigError(f"dedup_window must be >= 1, got {self.dedup_window}")
        if self.abandoned_policy not in ABANDONED_POLICIES:
            raise ConfigError(f"abandoned_policy must be one of {ABANDONED_POLICIES}, got {self.abandoned_policy!r}")
        if self.stale_policy not in STALE_POLICIES:
            raise ConfigError(f"stale_policy must be one of {STALE_POLICIES}, got {self.stale_policy!r}")
        if self.max_staleness_keep is not None and self.max_staleness_keep < 0:
            raise ConfigError(f"max_staleness_keep must be >= 0, got {self.max_staleness_keep}")
        if self.regenerate_stale:
            if self.stale_policy not in ("drop", "regenerate"):
                raise ConfigError(f"regenerate_stale=True contradicts stale_policy={self.stale_policy!r}")
            warnings.warn("TrainerClientConfig(regenerate_stale=True) is deprecated: use stale_policy='regenerate'",
                          DeprecationWarning, stacklevel=3)
            object.__setattr__(self, "stale_policy", "regenerate")


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
        self._stale_bound = -1
        """The bound of the last `get_batch` (`ClientLedger.stale_bound`), sent with every version."""
        self.ledger = ClientLedger(dedup_window=cfg.dedup_window, stale_policy=cfg.stale_policy,
                                   max_staleness_keep=cfg.max_staleness_keep, new_prompt_id=new_prompt_id,
                                   abandoned_policy=cfg.abandoned_policy)
        self._sock: Any = None  # a zmq.asyncio DEALER (the socket factory is untyped)
        self._broker_limits: tuple[int, int] = (0, 0)
        """What the broker said it accepts (max_msg_bytes, max_header_bytes); 0: the defaults."""
        self._inline: Inline | None = None
        self._broker_minor = 0
        """The protocol minor settled with the broker at the last hello."""
        """How small arrays travel to the broker: inline in the header once a ClientWelcome settled on minor 12 or
        later (`inline_for`); None (every array in a frame) before, and from each hello until its welcome."""
        self._recv_task: asyncio.Task[None] | None = None
        self._waiters: dict[str, asyncio.Future[object]] = {}
        self._req_counter = itertools.count()
        self.epoch: str | None = None
        self._epoch_lock = asyncio.Lock()
        self._publisher: WeightPublisher | None = None
        self._closed = False
        self._adapter: AdapterSpec | None = None
        """The LoRA adapter the pool serves as far as this client knows (the last one it published or was told of), sent
        with every version (`SetVersion.adapter`: its name is the policy prompts may name)."""
        self._adapter_since = -1
        """The first version `_adapter` (by name) was published at."""

    @property
    def version(self) -> int:
        """The trainer's version as far as this client knows (set, published, or reported by the broker)."""
        return self.ledger.version

    @property
    def broker_minor(self) -> int:
        """The protocol minor settled with the broker at the last hello (0: none yet)."""
        return self._broker_minor

    @property
    def counters(self) -> dict[str, int]:
        """The client's own counters (live; copy them to keep a snapshot)."""
        return self.ledger.counters

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
            ack = self.ledger.final_ack()
            if self._sock is not None and ack is not None:
                with contextlib.suppress(Exception):
                    await self._send(ack)
                    self.ledger.acks_sent(ack.prompt_ids, ack.dropped_stale)
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
        if type(msg) is ClientHello:
            self._inline = None  # the broker answering it may be an older one
        frames = encode(msg, self._inline)
        # refuse what the broker said it would drop (libzmq drops it with the connection), naming the limit
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
            elif isinstance(msg, Batch):
                # its pull was given up on (timed out, cancelled): the broker counts these groups as sent, keep them
                self.ledger.observe_version(msg.weight_version)
                self.ledger.adopt(msg.groups)
                if msg.groups:
                    log.info("kept %d groups of a Batch whose pull was given up on", len(msg.groups))
            elif isinstance(msg, Error):
                log.warning("broker error: %s %s", msg.code, msg.message)

    async def _request(self, make: Callable[[str], object], timeout_s: float | None = None, key: str | None = None) -> object:
        """Send `make(request_id)` and await the reply, retrying with backoff; epoch changes are handled here."""
        timeout = timeout_s if timeout_s is not None else self.config.request_timeout_s
        last: BaseException | None = None
        for attempt in range(self.config.request_retries):
            rid = key or self._rid()
            fut: asyncio.Future[object] = asyncio.get_running_loop().create_future()
            self._waiters[rid] = fut
            try:
                await self._send(make(rid))
                reply = await asyncio.wait_for(fut, timeout)
            except MessageTooLargeError:  # retrying cannot help
                self._waiters.pop(rid, None)
                raise
            except TimeoutError as exc:
                last = exc
                self._waiters.pop(rid, None)
                log.warning("broker did not answer within %.1f s (attempt %d/%d)", timeout, attempt + 1, self.config.request_retries)
                await asyncio.sleep(min(0.1 * 2**attempt, 2.0))
                continue
            except Exception as exc:  # noqa: BLE001 - zmq.Again on a full socket, for example
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
                                    max_header_bytes=DEFAULT_LIMITS.max_header_bytes, protocol_minor=PROTOCOL_MINOR),
            key="hello",
        )
        welcome = _expect(reply, ClientWelcome, "client_welcome")
        self.epoch = welcome.epoch
        self._broker_limits = (welcome.max_msg_bytes, welcome.max_header_bytes)  # what the broker accepts
        self._broker_minor = settle_minor(welcome.protocol_minor)
        self._inline = inline_for(self._broker_minor, welcome.max_header_bytes)
        return welcome

    async def _on_new_epoch(self, epoch: str) -> None:
        """The broker restarted: hello again, re-announce the version, resubmit what was not delivered."""
        async with self._epoch_lock:
            if epoch == self.epoch:
                return
            prompts = self.ledger.to_resubmit()
            log.warning("broker restarted (epoch %s -> %s): resubmitting %d undelivered prompts", self.epoch, epoch, len(prompts))
            self.ledger.broker_restarted()
            self.epoch = epoch
            self.metrics.event("broker_restart_seen", {"client_id": self.client_id, "epoch": epoch})
            await self._hello()
            if self.version or self._publisher is not None:
                await self._set_version_request(self.version)
            for i in range(0, len(prompts), self.config.submit_chunk):
                self.ledger.resubmitted((await self._submit_chunk(tuple(prompts[i : i + self.config.submit_chunk])))[0])

    # ------------------------------------------------------------------ public API

    async def submit(self, prompts: Iterable[Prompt | Mapping[str, Any] | str | Sequence[int]], *, group_size: int = 1,
                     sampling: SamplingParams | Mapping[str, Any] | None = None, exact_weight_version: int | None = None,
                     policy: str | None = None) -> SubmitResult:
        """Submit prompts; returns the accepted ids and the rejected ones with reasons (nothing is silently lost).

        ``exact_weight_version``: every group is served only at that weight version (`Prompt.exact_weight_version`).
        ``policy``: every group is generated with the LoRA adapter of that name (`Prompt.policy`; None: whatever the
        pool serves, or each prompt's own).
        """
        items = [make_prompt(p, group_size=group_size, sampling=sampling) for p in prompts]
        if exact_weight_version is not None:
            items = [dataclasses.replace(p, exact_weight_version=exact_weight_version) for p in items]
        if policy is not None:
            items = [dataclasses.replace(p, policy=policy) for p in items]
        return await self._submit(items)

    async def _submit(self, items: Sequence[Prompt]) -> SubmitResult:
        if self._broker_minor < CONTRACT_MINOR and any(p.exact_weight_version != -1 for p in items):
            raise RejectedError("exact_weight_version", f"the broker speaks protocol minor {self._broker_minor}, which ignores "
                                f"exact_weight_version (it needs {CONTRACT_MINOR}): nothing was submitted")
        if self._broker_minor < POLICY_MINOR and any(p.policy is not None for p in items):
            raise RejectedError("policy", f"the broker speaks protocol minor {self._broker_minor}, which ignores Prompt.policy "
                                f"(it needs {POLICY_MINOR}) and would serve whatever adapter is on: nothing was submitted")
        result = SubmitResult(accepted=[], rejected={})
        valid = []
        for p in items:  # refused here, as every engine would refuse it (protocol.sampling): never sent
            problem = sampling_problem(p.sampling, p.group_size)
            if problem is None:
                valid.append(p)
            else:
                result.rejected[p.prompt_id] = f"invalid_sampling: {problem}"
                self.ledger.counters["rejected"] += 1
        items = valid
        for i in range(0, len(items), self.config.submit_chunk):
            chunk = tuple(items[i : i + self.config.submit_chunk])
            reply, resent = await self._submit_chunk(chunk)
            self.ledger.submitted(chunk, reply, result, resent=resent)
        return result

    async def _submit_chunk(self, chunk: tuple[Prompt, ...]) -> tuple[SubmitReply, bool]:
        """The broker's reply, and whether the chunk was sent more than once (an earlier reply lost or late)."""
        sends = 0

        def make(rid: str) -> Submit:
            nonlocal sends
            sends += 1
            return Submit(request_id=rid, prompts=chunk)

        reply = await self._request(make)
        return _expect(reply, SubmitReply, "submit_reply"), sends > 1

    async def _pull(self, max_groups: int, wait_s: float, acks: tuple[str, ...]) -> Batch:
        reply = await self._request(lambda rid: Pull(request_id=rid, max_groups=max_groups, wait_s=wait_s, ack=acks),
                                    timeout_s=wait_s + self.config.request_timeout_s)
        return _expect(reply, Batch, "batch")

    async def get_batch(self, n: int, max_staleness: int | None = None, timeout: float | None = None,  # noqa: ASYNC109
                        stale_policy: str | None = None, max_staleness_keep: int | None = None) -> RolloutBatch:
        """Wait for n whole DONE groups (and collect other terminal states meanwhile).

        `stale_policy` / `max_staleness_keep` override the client's config for the
        groups this call takes (see the module docstring). Raises `TimeoutError`
        when `timeout` passes first; groups received so far stay buffered for the
        next call (nothing is lost). Without a timeout, raises `UnfillableBatchError`
        as soon as n groups can no longer arrive (see the module docstring).
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if stale_policy is not None and stale_policy not in STALE_POLICIES:
            raise ValueError(f"stale_policy must be one of {STALE_POLICIES}, got {stale_policy!r}")
        if max_staleness_keep is not None and max_staleness_keep < 0:
            raise ValueError(f"max_staleness_keep must be >= 0, got {max_staleness_keep}")
        self._stale_bound = self.ledger.stale_bound(max_staleness, stale_policy, max_staleness_keep)
        t0 = time.monotonic()
        deadline = None if timeout is None else t0 + timeout
        dropped_before = self.ledger.counters["dropped_stale"]
        log_at = t0 + self.config.wait_log_s
        while True:
            # every buffered group is judged again at today's version and this call's bound
            await self._taken(self.ledger.recheck(max_staleness, stale_policy, max_staleness_keep))
            if self.ledger.ready >= n:
                break
            if timeout is None and self.config.raise_when_unfillable and self.ledger.ready + len(self.ledger.pending) < n:
                # this client's own prompts cannot fill it: only groups the broker holds still could
                held = await self._broker_holds()
                if self.ledger.ready + sum(held.values()) < n:
                    raise UnfillableBatchError(self._waiting_for(n, held, t0, dropped_before, "can never be filled"))
            if time.monotonic() >= log_at:
                log_at = time.monotonic() + self.config.wait_log_s
                with contextlib.suppress(RollpoolError):
                    log.warning("%s", self._waiting_for(n, await self._broker_holds(), t0, dropped_before, "is waiting"))
            wait = self.config.pull_wait_s
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"get_batch({n}) got {self.ledger.ready} groups within {timeout} s")
                wait = min(wait, left)
            stale = self.ledger.stale_acks()
            if stale:
                await self._send(Ack(prompt_ids=stale, dropped_stale=stale))
                self.ledger.acks_sent(stale=stale)
            acks = self.ledger.pull_acks()
            batch = await self._pull(n - self.ledger.ready, wait, acks)
            self.ledger.acks_sent(acks)  # the broker took them with the pull
            self.ledger.observe_version(batch.weight_version)
            await self._taken(self.ledger.take(batch.groups, max_staleness, stale_policy, max_staleness_keep))
        out, lags = self.ledger.deliver(n, started_at=t0, now=time.monotonic(), dropped_before=dropped_before)
        for lag in lags:
            self.metrics.observe("staleness", float(lag))
        return out

    async def take_ended(self, timeout: float = 0.0) -> list[GroupResult]:  # noqa: ASYNC109
        """The groups that ended other than DONE (FAILED, CANCELLED, DROPPED_STALE) received so far, without waiting
        for DONE ones (which `get_batch` returns them beside): a caller whose groups may all fail (an exact weight
        version gone) learns it at once. Pulls once, waiting up to `timeout` s, when none is buffered; DONE groups
        pulled meanwhile stay buffered for `get_batch`. Each group is returned once, here or by `get_batch`."""
        if not self.ledger.has_other():
            acks = self.ledger.pull_acks()
            batch = await self._pull(_ENDED_PULL_GROUPS, timeout, acks)
            self.ledger.acks_sent(acks)
            self.ledger.observe_version(batch.weight_version)
            await self._taken(self.ledger.adopt(batch.groups))
        return self.ledger.take_other()

    async def _broker_holds(self) -> dict[str, int]:
        """The groups the broker holds that may still reach a pull: queued, leased, done and not yet acknowledged."""
        counters = (await self.status())["counters"]
        return {k: int(counters.get(k, 0)) for k in ("queued", "leased", "held")}

    def _waiting_for(self, n: int, held: Mapping[str, int], t0: float, dropped_before: int, what: str) -> str:
        dropped = self.ledger.counters["dropped_stale"] - dropped_before
        stale = (f"; {dropped} groups dropped as stale during this call (a dropped group comes back only under "
                 "stale_policy 'regenerate')" if dropped else "")
        return (f"get_batch({n}) {what} after {time.monotonic() - t0:.1f} s: {self.ledger.ready} groups here, "
                f"{len(self.ledger.pending)} of this client's prompts pending; the broker holds {held['queued']} queued, "
                f"{held['leased']} leased, {held['held']} done and unacknowledged{stale}. Submit more prompts, or ask "
                f"for fewer groups")

    async def _taken(self, taken: TakeOutcome) -> None:
        """Report the groups one take or recheck dropped as stale, and submit their regenerations."""
        for pid, staleness in taken.dropped_stale:
            self.metrics.event("dropped_stale", {"prompt_id": pid, "staleness": staleness})
        if taken.not_regenerated:
            log.warning("stale_policy regenerate: %d stale groups were submitted before this client started "
                        "(their prompts are unknown here), dropped without regeneration: %s",
                        len(taken.not_regenerated), taken.not_regenerated[:5])
        if taken.regenerate:
            self.ledger.regenerated(await self._submit(taken.regenerate))

    async def set_version(self, version: int, *, adapter: AdapterSpec | None = None) -> None:
        """Tell the broker the trainer's version (admission control counts from it).

        `adapter`: the version is that LoRA adapter's (weights published outside this client); its name is the policy
        prompts may name from this version on. Without it, the adapter this client published or was told of last stays
        the one served (a whole-model version leaves it on)."""
        if adapter is not None and (self._adapter is None or adapter.name != self._adapter.name):
            self._adapter_since = version  # a new policy begins here; versions of the same name continue it
        if adapter is not None:
            self._adapter = adapter
        self.ledger.observe_version(version)
        await self._set_version_request(version)

    async def rebase_version(self, version: int) -> None:
        """The trainer resumed from a checkpoint at `version` (which may be older than the pool's): rebase the pool.

        The broker's version becomes `version` and its admission account restarts from it (as if the run had
        reached `version` in order); a new version epoch begins, and workers serving a version above
        `version` (weights of the abandoned run) get no work while a staleness bound is set, have their
        in-flight tasks cancelled and requeued (no attempt burned) and apply the next version published,
        lower or not. Then publish the checkpoint's weights (`publish_weights(model, version)`) and go on
        as usual. A publisher this client hosts that holds versions above `version` is closed (a fresh one
        starts, on new ports, with the next `publish_weights`); a publisher run elsewhere must be restarted
        likewise. Groups made on weights of the abandoned run (a trajectory's ``version_epoch`` earlier than this
        rebase and a sampled token above `version`) are never delivered as fresh: `get_batch` reports them in
        ``other`` (DROPPED_STALE, reason ``abandoned_run``), their prompts resubmitted under fresh ids with
        ``abandoned_policy="regenerate"``; groups made at or below `version` are delivered as they are.
        """
        if version < 0:
            raise ValueError(f"rebase_version needs a version >= 0, got {version}")
        if self._publisher is not None and self._publisher.latest_version > version:
            with contextlib.suppress(Exception):
                await self._publisher.close()
            self._publisher = None
        if self._adapter_since > version:  # that adapter's versions belong to the abandoned run (the broker forgets them too)
            self._adapter, self._adapter_since = None, -1
        reply = await self._request(lambda rid: SetVersion(request_id=rid, version=version, rebase=True))
        if isinstance(reply, Reply) and not reply.ok:
            raise RejectedError("rebase_version", reply.error or "refused")
        epoch = reply.data.get("version_epoch") if isinstance(reply, Reply) else None
        self.ledger.rebased(int(epoch) if isinstance(epoch, int) else -1, version)
        log.warning("pool rebased to version %d (version epoch %s)", version, epoch)

    async def _set_version_request(self, version: int) -> None:
        router = pub = None
        if self._publisher is not None:
            router, pub = self._publisher.router_endpoint, self._publisher.pub_endpoint
        reply = await self._request(lambda rid: SetVersion(request_id=rid, version=version, weight_endpoint=router, announce_endpoint=pub,
                                                           stale_bound=self._stale_bound, adapter=self._adapter,
                                                           adapter_since=self._adapter_since))
        if isinstance(reply, Reply) and not reply.ok:
            raise RejectedError("set_version", reply.error or "refused")

    @property
    def publisher(self) -> WeightPublisher | None:
        """The weight publisher this client hosts (made by the first `reserve_weights` or `publish_weights`)."""
        return self._publisher

    async def _hosted_publisher(self) -> WeightPublisher:
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
                pool=cfg.pool,
                weights=cfg.weights,
            )
            await self._publisher.start()
        return self._publisher

    async def reserve_weights(self, model_or_named_shapes: Any) -> int:
        """Allocate the hosted publisher's buffers for the model's layout now (page-locked on a GPU host: seconds per
        GB, and it blocks while it runs), so the first `publish_weights` is as quick as the later ones. Call it once
        at set-up, before the first step; returns the bytes reserved. Without it the first publish allocates them."""
        return (await self._hosted_publisher()).reserve(model_or_named_shapes)

    async def publish_weights(self, model_or_named_tensors: Any, version: int, *, adapter: Any = None) -> Any:
        """Publish a new weight version (hosting the publisher) and announce it to the broker.

        `adapter` (an `AdapterSpec`, `rollpool.weights.adapters.adapter_spec`): the version is a LoRA adapter and
        `model_or_named_tensors` its matrices as PEFT names them (docs/lora.md). An adapter whose base fingerprint is
        not the one this client requires of the pool's workers is refused here, naming both."""
        if adapter is not None and self.fingerprint and adapter.base_fingerprint and adapter.base_fingerprint != self.fingerprint:
            raise WeightsRefusedError(
                f"adapter version {version} applies to base {adapter.base_model or '?'} (fingerprint {adapter.base_fingerprint}), "
                f"the pool serves fingerprint {self.fingerprint}")
        publisher = await self._hosted_publisher()
        manifest = await publisher.publish(model_or_named_tensors, version, adapter=adapter)
        await self.set_version(version, adapter=adapter)
        return manifest

    async def status(self) -> dict[str, Any]:
        """The broker's counters, its workers' live state, the client's counters, ``publisher`` (the hosted publisher's
        last offer: ``offered``, ``why_not_cuda_ipc``, ``why_not_ring``, ``last_ring``, its GPU budget and what of it is used; once it exists), and ``versions``: per weight version,
        the recent converged ones (seconds from publish until every live worker served it, the slowest worker), the
        ones still converging and, under fleet activation, the recent rounds with their skew."""
        reply = _expect(await self._request(lambda rid: StatusRequest(request_id=rid)), StatusReply, "status_reply")
        counters = dict(reply.counters)
        out = {"epoch": reply.epoch, "counters": counters, "workers": dict(reply.workers),
               "client": dict(self.counters), "versions": counters.get("versions", {})}
        if self._publisher is not None:  # the hosted publisher's offer: which path, why not the same-GPU one, its GPU budget
            out["publisher"] = {**self._publisher.path_note, "gpu_budget_bytes": self._publisher.gpu_budget.budget,
                                "gpu_budget_used_bytes": self._publisher.gpu_budget.used}
        return out

    async def wait_for_version(self, version: int, fraction: float = 1.0, timeout: float | None = None,  # noqa: ASYNC109
                               poll_s: float = 0.1) -> dict[str, Any]:
        """Wait until at least `fraction` of the live workers serve weight `version` or a newer one.

        Returns ``{"version", "workers", "workers_at", "fraction", "waited_s"}``. Raises `WeightSyncError` at once
        when so many live workers gave `version` up (the broker shows each one's ``skipped_version``) that the
        fraction cannot be reached, `RejectedError` for a version the pool was never told of (publish it first),
        and `TimeoutError` after `timeout` seconds naming each worker's version. Reads `status()` every `poll_s`
        (one small request; the broker lists at most a bounded number of workers, so in a very large pool the
        fraction is of the listed ones).
        """
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        while True:
            st = await self.status()
            pool_version = st["counters"].get("version", -1)
            if isinstance(pool_version, int) and version > pool_version:
                raise RejectedError("wait_for_version", f"weight version {version} was not announced (the pool's version is "
                                    f"{pool_version}): publish it (publish_weights or set_version) before waiting for it")
            versions = {wid: (int(s.get("version", -1)), int(s.get("skipped_version", -1)), str(s.get("skipped_error") or ""))
                        for wid, s in st["workers"].items()}
            n = len(versions)
            need = max(1, math.ceil(fraction * n - 1e-9))
            at = sum(1 for v, _, _ in versions.values() if v >= version)
            if n and at >= need:
                return {"version": version, "workers": n, "workers_at": at, "fraction": at / n, "waited_s": loop.time() - t0}
            gave_up = {wid: err for wid, (v, skipped, err) in versions.items() if v < version <= skipped}
            if n and n - len(gave_up) < need:
                detail = "; ".join(f"{wid}: {err or 'no reason given'}" for wid, err in sorted(gave_up.items())[:8])
                raise WeightSyncError(f"weight version {version} cannot reach {fraction:.0%} of the {n} live workers: "
                                      f"{len(gave_up)} gave it up ({detail})")
            if timeout is not None and loop.time() - t0 >= timeout:
                seen = {wid: v for wid, (v, _, _) in sorted(versions.items())[:16]}
                raise TimeoutError(f"{at} of {n} live workers serve weight version {version} after {timeout} s (needed {need}); "
                                   f"workers' versions: {seen or 'none connected'}")
            await asyncio.sleep(poll_s)

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

    async def cancel(self, prompt_ids: Sequence[str]) -> dict[str, list[str]]:
        """Cancel live prompt groups: each reaches CANCELLED, reported once by a later `get_batch` in `other`.

        Returns ``{"cancelled": [...], "not_cancelled": [...]}`` (unknown or already terminal ids).
        """
        ids = tuple(prompt_ids)
        if not ids:
            return {"cancelled": [], "not_cancelled": []}
        reply = await self._request(lambda rid: CancelPrompts(request_id=rid, prompt_ids=ids))
        if not isinstance(reply, Reply) or not reply.ok:
            raise RejectedError("cancel_prompts", getattr(reply, "error", None) or "refused")
        data = dict(reply.data)
        return {"cancelled": list(data.get("cancelled", [])), "not_cancelled": list(data.get("not_cancelled", []))}

    def pending_ids(self) -> list[str]:
        """Ids of the prompts accepted and not yet delivered."""
        return list(self.ledger.pending)

    def pending(self) -> int:
        """Prompts accepted and not yet delivered."""
        return len(self.ledger.pending)


_ENDED_PULL_GROUPS = 256
"""Groups one `take_ended` pull asks for."""


def _expect(reply: object, kind: type[_R], name: str) -> _R:
    if not isinstance(reply, kind):
        raise ProtocolError("unexpected", f"expected {name}, got {type(reply).__name__}")
    return reply
