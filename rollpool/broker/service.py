"""The broker service: two ROUTER sockets around `BrokerState`, on one asyncio loop.

The service only moves bytes: it decodes a message, calls the state machine,
and sends what the state says. It never blocks its loop: every send is
non-blocking (a peer whose queue is full, or who is gone, makes the send fail
at once, and the failure is handled, never waited out), and the sockets are
read by a reader callback that drains a bounded burst of messages per wake-up,
then dispatches and answers waiting pulls once per burst (which batches sends
naturally).

ZeroMQ signals readiness on an edge-triggered file descriptor, so after every
burst (and on every timer tick, as a safety net) both sockets' ``EVENTS`` are
checked again and a drain is scheduled for any socket with messages waiting.

Worker port: Hello -> Welcome (adopting re-announced tasks), Credit, Result,
ResultBatch, WorkerHeartbeat, Nack, Goodbye, ControlReply, ApplyRequest/ApplyDone, TurnRecords and TurnRecordBatch (episode turns kept for a re-run); the
broker sends Task (TaskBatch to a worker that lists it: one message per worker
per burst), Cancel, BrokerHeartbeat, Control, ApplyGrant, Goodbye. Fewer, larger
messages are the main saving: each send costs a wake-up of ZeroMQ's I/O thread.
Client port: ClientHello, Submit, Pull (long poll, with acks), Ack,
SetVersion, StatusRequest, Control (fan-out, replies gathered), CancelPrompts.
A malformed frame is answered with `Error`, counted and logged once per peer
per minute; the broker keeps serving everyone else.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from rollpool.broker import guard
from rollpool.broker.config import BrokerConfig
from rollpool.broker.state import BrokerState, Group, WorkerInfo
from rollpool.protocol import (
    DEFAULT_LIMITS,
    FEATURES,
    PROTOCOL_MAJOR,
    SUPPORTED_MAJORS,
    Ack,
    ApplyDone,
    ApplyGrant,
    ApplyRequest,
    Batch,
    BrokerHeartbeat,
    Cancel,
    CancelPrompts,
    ClientHello,
    ClientWelcome,
    Control,
    ControlReply,
    Credit,
    Error,
    Feature,
    Goodbye,
    Hello,
    Inline,
    Nack,
    ProtocolError,
    Pull,
    Reply,
    Result,
    ResultBatch,
    SetVersion,
    SocketFactory,
    StatusReply,
    StatusRequest,
    Submit,
    SubmitReply,
    Task,
    TaskBatch,
    TurnRecordBatch,
    TurnRecords,
    Welcome,
    WorkerHeartbeat,
    carry_entry,
    decode,
    encode,
    inline_for,
    negotiate_version,
    peek_type,
    settle_minor,
)
from rollpool.protocol.codec import check_size
from rollpool.protocol.errors import MessageTooLargeError
from rollpool.protocol.logs import RateLimitedLog
from rollpool.protocol.metrics import MetricsSink, NullMetricsSink

__all__ = ["Broker", "tune_gc"]

log = logging.getLogger(__name__)

_MAX_ERROR_TEXT = 300
_MAX_STATUS_WORKERS = DEFAULT_LIMITS.max_map_len - 96
"""Workers named in one StatusReply (the map must stay decodable under the default limits)."""
# plain ints: pyzmq's flag enums cost an enum operation per frame on the hot path
_NB = int(zmq.NOBLOCK)
_NB_MORE = int(zmq.NOBLOCK) | int(zmq.SNDMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


@dataclass(slots=True)
class _PendingPull:
    identity: bytes
    client_id: str
    request_id: str
    max_groups: int
    handle: asyncio.TimerHandle | None = None
    done: bool = False


@dataclass(slots=True)
class _PendingControl:
    identity: bytes
    request_id: str
    waiting: set[str]
    results: dict[str, Any] = field(default_factory=dict)
    handle: asyncio.TimerHandle | None = None


def tune_gc() -> None:
    """For a process that runs the broker and nothing else (`rollpool broker`): fewer, cheaper collections.

    Everything alive once the broker's modules are imported (the interpreter, numpy, pyzmq: some
    hundreds of thousands of objects) is frozen out of the collector, so a full collection walks only
    what the broker made since; and the young generation is collected every 10,000 net allocations
    instead of 700. The broker's per-message objects die by reference count, not by the collector
    (measured at 2,000 round trips/s: 126 young and 12 middle collections and one full one of 22 ms
    in 6.6 s before). Not called for a broker embedded in another program (its collector is its own).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 20)


def _sync_socket(sock: Any) -> zmq.Socket[Any]:
    """A plain (blocking-API) view of a socket: asyncio sockets are shadowed, not reopened."""
    import zmq.asyncio

    if isinstance(sock, zmq.asyncio.Socket):
        return zmq.Socket.shadow(sock.underlying)
    return sock  # type: ignore[no-any-return]


class Broker:
    """``Broker(config, sockets, metrics, clock)``; ``await broker.run()``; ``broker.stop()``."""

    def __init__(
        self,
        config: BrokerConfig,
        sockets: SocketFactory,
        metrics: MetricsSink | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.sockets = sockets
        self.metrics: MetricsSink = metrics if metrics is not None else NullMetricsSink()
        self.clock = clock
        self.epoch = secrets.token_hex(8)
        self.state = BrokerState(config)
        self.protocol_errors = 0
        self.send_failures = 0
        self.worker_endpoint = config.worker_endpoint
        self.client_endpoint = config.client_endpoint
        self.ready = asyncio.Event()
        """Set once both sockets are bound (`worker_endpoint`/`client_endpoint` are then the bound addresses)."""
        self.weight_endpoint: str | None = None
        self.announce_endpoint: str | None = None
        # fleet activation switches the workers together on their apply asks, so there an adapter version asks too
        self._welcome_features = FEATURES if config.activation != "fleet" else tuple(
            f for f in FEATURES if f != Feature.ADAPTER_NO_GRANT)
        """The features each Welcome lists (`Feature.ADAPTER_NO_GRANT` only where the activation mode allows it)."""
        self._stop = asyncio.Event()
        self._stopping = False
        self._wsock: Any = None
        self._csock: Any = None
        self._w: zmq.Socket[Any] | None = None
        self._c: zmq.Socket[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._now = clock()
        self._by_identity: dict[bytes, WorkerInfo] = {}
        self._clients: guard.BoundedMap[bytes, str] = guard.BoundedMap()
        self._pulls = guard.PendingPulls()
        self.refusals = guard.Refusals()
        self._peer_limits: guard.BoundedMap[str | bytes, tuple[int, int]] = guard.BoundedMap(65_536)
        """What each peer said it accepts (max_msg_bytes, max_header_bytes): worker id or client identity."""
        self._peer_inline: guard.BoundedMap[str | bytes, Inline] = guard.BoundedMap(65_536)
        """The inline policy of each peer that settled on minor 12 or later (`inline_for`), by worker id or client
        identity; a peer not here (minor 11 or older) gets every array in a frame."""
        self._controls: dict[str, _PendingControl] = {}
        self._control_seq = 0
        self._scheduled = {"w": False, "c": False}
        self._read_at = {"w": float("-inf"), "c": float("-inf")}
        """When each socket was last read (`coalesce_s`)."""
        self._fds: dict[str, int] = {}
        self.coalesced_reads = 0
        """Reads put off to the end of a coalescing window (counter `coalesced_reads`)."""
        self.reads = 0
        """Socket reads (wake-ups that read a socket; counter `reads`)."""
        self.messages_in = 0
        self.messages_out = 0
        self.frames_in = 0
        self.frames_out = 0
        """ZeroMQ frames read and sent, the ROUTER's identity frame included (counters `frames_in`, `frames_out`)."""
        """Messages read and sent (counters `messages_in`, `messages_out`: with `reads` and `completed`, the
        messages and reads per round trip the bench reports)."""
        self._deferred = {"w": False, "c": False}
        """A socket whose read waits for the rest of its coalescing window (its reader is removed meanwhile)."""
        self._tick = min(self.config.heartbeat_interval_s / 4, 0.25)
        """The lease loop's period."""
        self._stall_after = self._tick + max(self._tick, 0.1)
        """A lease-loop tick this much after the last one means the broker stalled (`_stalled`)."""
        self._tick_at = clock()
        self._rate_log = RateLimitedLog(log)
        self._outbox: list[tuple[bytes, list[Any]]] = []
        """Client replies of the current burst, sent back to back at its end (fewer I/O-thread wake-ups)."""
        self._wall_offset = time.time() - clock()

    # ------------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        """Stop intake now; `run()` drains until `drain_timeout_s`, says goodbye to workers and returns."""
        self._stopping = True
        self._stop.set()

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._open()
        self._tick_at = self.clock()
        try:
            async with asyncio.TaskGroup() as tg:
                loops = [
                    tg.create_task(self._heartbeat_loop(), name="_heartbeat_loop"),
                    tg.create_task(self._lease_loop(), name="_lease_loop"),
                ]
                await self._stop.wait()
                await self._drain()
                for t in loops:
                    t.cancel()
        finally:
            self._close()

    def _open(self) -> None:
        assert self._loop is not None
        self._wsock = self.sockets.router(self.config.worker_endpoint, serves="broker.worker")
        self._csock = self.sockets.router(self.config.client_endpoint, serves="broker.client")
        self._w = _sync_socket(self._wsock)
        self._c = _sync_socket(self._csock)
        self.sockets.watch(self._wsock, "broker.worker")
        self.sockets.watch(self._csock, "broker.client")
        self.worker_endpoint = self._w.getsockopt_string(zmq.LAST_ENDPOINT)
        self.client_endpoint = self._c.getsockopt_string(zmq.LAST_ENDPOINT)
        self._fds = {"w": int(self._w.getsockopt(zmq.FD)), "c": int(self._c.getsockopt(zmq.FD))}
        self._loop.add_reader(self._fds["w"], self._on_readable, "w")
        self._loop.add_reader(self._fds["c"], self._on_readable, "c")
        self.ready.set()
        log.info(
            "broker %s listening: workers %s, clients %s", self.epoch, self.worker_endpoint, self.client_endpoint,
            extra={"pool": self.config.pool},
        )
        self._recheck()

    def _close(self) -> None:
        loop = self._loop
        for sync, sock in ((self._w, self._wsock), (self._c, self._csock)):
            if sync is None:
                continue
            if loop is not None:
                try:
                    loop.remove_reader(int(sync.getsockopt(zmq.FD)))
                except (zmq.ZMQError, ValueError, OSError):
                    pass
            for pull in self._pulls:
                if pull.handle is not None:
                    pull.handle.cancel()
            for ctl in self._controls.values():
                if ctl.handle is not None:
                    ctl.handle.cancel()
            sock.close(linger=0)
        self._w = self._c = None
        self._pulls.clear()
        self._controls.clear()

    async def _drain(self) -> None:
        """Intake is stopped: results may still come in and be pulled until the deadline."""
        deadline = self.clock() + self.config.drain_timeout_s
        while self.clock() < deadline and (self.state.leased or self.state.held):  # noqa: ASYNC110 (a bounded poll of state, not an event)
            await asyncio.sleep(min(0.05, self.config.heartbeat_interval_s))
        frames = encode(Goodbye(reason="broker_stopping"))
        for w in list(self.state.workers.values()):
            self._send(self._w, w.identity, frames)
        empty_for = list(self._pulls)
        self._pulls.clear()
        for pull in empty_for:
            if pull.handle is not None:
                pull.handle.cancel()
            self._send(self._c, pull.identity, encode(Batch(request_id=pull.request_id, epoch=self.epoch, weight_version=self.state.version)))
        log.info("broker %s stopped (%d leased, %d held handed back)", self.epoch, self.state.leased, self.state.held)

    # ------------------------------------------------------------------ socket plumbing

    def _on_readable(self, which: str, force: bool = False) -> None:
        self._scheduled[which] = False
        sock = self._w if which == "w" else self._c
        if sock is None or (self._deferred[which] and not force):
            return
        now = self.clock()
        coalesce = self.config.coalesce_s
        if coalesce > 0 and not force and now - self._read_at[which] < coalesce:
            # read again too soon: wait for the rest of the window (its reader off, so the loop does not wake
            # for every message meanwhile), then read everything that came together
            assert self._loop is not None
            self._deferred[which] = True
            self.coalesced_reads += 1
            self._loop.remove_reader(self._fds[which])
            self._loop.call_later(coalesce - (now - self._read_at[which]), self._on_deferred, which)
            return
        self._read_at[which] = now
        handle = self._on_worker_frames if which == "w" else self._on_client_frames
        self._now = now
        if now - self._tick_at > self._stall_after:
            # the lease loop has not ticked for too long: a stall, noted before anything queued is read
            # (a heartbeat that waited in the socket must not be judged by the time the broker was not reading)
            self._stalled(now)
        burst = self.config.burst_messages
        recv = super(zmq.Socket, sock).recv  # the Cython method, without the sugar layer's per-call overhead
        self.reads += 1
        n = nf = 0
        for _ in range(burst):
            # frames as zmq.Frame (no copy; `more` is a C field, where getsockopt(RCVMORE) costs an enum
            # conversion per frame); the decoder reads them through the buffer protocol
            try:
                # the peer's identity, copied: a dict key (a ROUTER socket puts it before every message, so
                # at least one frame follows)
                frames: list[Any] = [recv(_NB, True)]
            except zmq.Again:
                break
            n += 1
            f = recv(_NB, False)
            frames.append(f)
            while f.more:
                f = recv(_NB, False)
                frames.append(f)
            nf += len(frames)
            try:
                handle(frames)
            except Exception:  # a bug in one handler must not take the broker down
                log.exception("broker: error while handling a message")
        self.messages_in += n
        self.frames_in += nf
        self._after_burst()
        self._recheck()

    def _on_deferred(self, which: str) -> None:
        """The end of a socket's coalescing window: its reader back on, and everything that came meanwhile read."""
        self._deferred[which] = False
        sock = self._w if which == "w" else self._c
        if sock is None or self._loop is None:
            return
        self._loop.add_reader(self._fds[which], self._on_readable, which)
        self._on_readable(which, force=True)

    def _drain_workers(self, max_bursts: int = 64) -> None:
        """Read what the worker socket queued up (after a stall), before leases are judged."""
        for _ in range(max_bursts):
            sock = self._w
            if sock is None or not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                break
            self._on_readable("w", force=True)

    def _recheck(self) -> None:
        loop = self._loop
        if loop is None:
            return
        for which, sock in (("w", self._w), ("c", self._c)):
            # the Cython getter with plain ints: the sugar layer's enum conversions cost as much as the call
            if (sock is not None and not self._scheduled[which] and not self._deferred[which]
                    and int(super(zmq.Socket, sock).get(_EVENTS)) & _POLLIN):
                self._scheduled[which] = True
                loop.call_soon(self._on_readable, which)

    def _send(self, sock: zmq.Socket[Any] | None, identity: bytes, frames: list[Any]) -> bool:
        if sock is None:
            return False
        send = super(zmq.Socket, sock).send  # the Cython method, without the sugar layer's per-call overhead
        try:
            send(identity, _NB_MORE)
            for i in range(len(frames) - 1):
                send(frames[i], _NB_MORE)  # copying small frames is cheaper than tracking them
            send(frames[-1], _NB)
            self.messages_out += 1
            self.frames_out += len(frames) + 1
            return True
        except zmq.Again:
            self.send_failures += 1
            self._rate_log.warning("send:" + identity.hex(), "broker: peer %s is not reading (queue full); message dropped", identity.hex())
        except zmq.ZMQError as exc:
            self.send_failures += 1
            log.debug("broker: cannot send to peer %s: %s", identity.hex(), exc)
        return False

    def _protocol_error(self, sock: zmq.Socket[Any] | None, identity: bytes, exc: ProtocolError, frames: list[bytes]) -> None:
        self.protocol_errors += 1
        self.refusals.count(exc.limit)
        self._rate_log.warning("proto:" + identity.hex(), "broker: malformed message from %s: %s", identity.hex(), exc)
        ref = peek_type(frames[1:]) if len(frames) > 1 else None
        self._send(sock, identity, encode(Error(code=exc.code, message=str(exc)[:_MAX_ERROR_TEXT], ref_type=ref)))

    def _after_burst(self) -> None:
        st = self.state
        if self._outbox:
            out, self._outbox = self._outbox, []
            for identity, frames in out:
                self._send(self._c, identity, frames)
        if not self._stopping and st.has_work():
            self._send_tasks(st.dispatch(self._now))
        if self._pulls and st.has_results():
            self._serve_pulls()
        self._flush_effects()

    def _send_tasks(self, pairs: list[tuple[WorkerInfo, Group]]) -> None:
        if not pairs:
            return
        cfg = self.config
        eta = cfg.max_staleness
        min_version = self.state.version - eta if (eta is not None and self.state.version >= 0) else -1
        by_worker: dict[str, tuple[WorkerInfo, list[Group]]] = {}
        for w, g in pairs:
            entry = by_worker.get(w.worker_id)
            if entry is None:
                by_worker[w.worker_id] = (w, [g])
            else:
                entry[1].append(g)
        inline = self._peer_inline
        for w, groups in by_worker.values():
            tasks = [
                Task(
                    task_id=g.task_id,
                    prompt=g.prompt,  # type: ignore[arg-type]  # dispatch leases only groups with a prompt
                    attempt=g.attempt,
                    deadline_s=cfg.task_timeout_s,
                    queued_at=g.queued_at + self._wall_offset,
                    min_version=min_version,
                    seq=g.dispatch_seq,
                    replay=self.state.replay_for(g) if g.turns and Feature.REPLAY in w.features else (),
                )
                for g in groups
            ]
            if len(tasks) > 1 and Feature.TASK_BATCH in w.features:
                # encoded once, as the batch: a batch within the worker's limits has every task within them
                # (no frame larger, no header longer), so tasks are encoded one by one only when it is not
                batch = encode(TaskBatch(tasks=tuple(tasks)), inline.get(w.worker_id))
                if self._refuse_oversize(w.worker_id, batch, "task_batch") is False and self._send(self._w, w.identity, batch):
                    continue
                failed = self._send_one_by_one(w, groups, tasks)  # a batch over the worker's limit (or not sent) goes task by task
            else:
                failed = self._send_one_by_one(w, groups, tasks)
            if failed:
                # it never left: hand the groups straight back (not the worker's fault, no attempt used)
                self.state.nack(w, [g.task_id for g in failed], self._now, reason="send failed")
        t_sent = self.clock()
        for _w, g in pairs:
            g.dispatched_at = t_sent

    def _send_one_by_one(self, w: WorkerInfo, groups: list[Group], tasks: list[Task]) -> list[Group]:
        """Send each task alone; returns the groups whose task could not be sent (an oversize one is failed with the reason)."""
        failed: list[Group] = []
        inline = self._peer_inline.get(w.worker_id)
        for g, t in zip(groups, tasks, strict=True):
            frames = encode(t, inline)
            if t.replay and self._over_limits(w.worker_id, frames):  # the turns are a saving, not a need: the task goes without
                t = dataclasses.replace(t, replay=())
                frames = encode(t, inline)
            if self._refuse_oversize(w.worker_id, frames, "task", g):  # roles: failed with the reason, counted
                continue
            if not self._send(self._w, w.identity, frames):
                failed.append(g)
        return failed

    def _set_inline(self, peer: str | bytes, minor: int, max_header_bytes: int) -> None:
        """Settle how arrays travel to `peer` (a worker id or a client identity) from the minor of its hello."""
        policy = inline_for(minor, max_header_bytes, self.config.inline_max_bytes)
        if policy is None:
            self._peer_inline.pop(peer)
        else:
            self._peer_inline[peer] = policy

    def _over_limits(self, peer: str | bytes, frames: list[Any]) -> bool:
        max_msg, max_header = self._peer_limits.get(peer) or (0, 0)
        try:
            check_size(frames, max_msg, "task", max_header)
        except MessageTooLargeError:
            return True
        return False

    def _refuse_oversize(self, peer: str | bytes, frames: list[Any], what: str, g: Group | None = None) -> bool:
        """True if `frames` are over what `peer` said it accepts: counted, and the group failed with the reason."""
        try:
            max_msg, max_header = self._peer_limits.get(peer) or (0, 0)
            check_size(frames, max_msg, what, max_header)
            return False
        except MessageTooLargeError as exc:
            self.refusals.count(exc.limit)
            self._rate_log.warning("oversize:" + what, "broker: %s", exc)
            if g is not None:
                w = self.state.workers.get(peer) if isinstance(peer, str) else None
                self.state.result(w, task_id=g.task_id, prompt_id=g.prompt_id, trajectories=(), error=str(exc), retryable=False, now=self._now)
            return True

    def _flush_effects(self) -> None:  # noqa: C901 - grandfathered: one branch per effect kind, inline on the broker's hot path
        fx = self.state.effects
        if not fx:
            return
        workers = self.state.workers
        by_worker: dict[str, list[str]] = {}
        reasons: dict[str, str] = {}
        for wid, tid, reason in fx.cancels:
            by_worker.setdefault(wid, []).append(tid)
            reasons[wid] = reason
        for wid, tids in by_worker.items():
            cw = workers.get(wid)
            if cw is not None:
                self._send(self._w, cw.identity, encode(Cancel(task_ids=tuple(tids), reason=reasons[wid])))
        for wid, version in fx.grants:
            gw = workers.get(wid)
            if gw is not None:
                self._send(self._w, gw.identity, encode(ApplyGrant(version=version)))
        for wid in fx.held_requests:
            hw = workers.get(wid)
            if hw is not None:
                self._send(
                    self._w, hw.identity,
                    encode(BrokerHeartbeat(epoch=self.epoch, weight_version=self.state.version, weight_endpoint=self.weight_endpoint,
                                           announce_endpoint=self.announce_endpoint, send_held=True, dispatch_seq=hw.dispatch_seq,
                                           version_epoch=self.state.version_epoch, rebase_version=self._rebase_version())),
                )
        for wid, ident in fx.lost_workers:
            x = self._by_identity.get(ident)
            if x is not None and x.worker_id == wid and workers.get(wid) is not x:
                del self._by_identity[ident]
            for req, ctl in list(self._controls.items()):
                if wid in ctl.waiting:
                    ctl.waiting.discard(wid)
                    ctl.results[wid] = {"ok": False, "error": "worker_lost"}
                    if not ctl.waiting:
                        self._finish_control(req)
        for kind, fields in fx.events:
            if kind in ("worker_lost", "task_failed"):
                log.warning("broker: %s %s", kind, fields, extra={"pool": self.config.pool})
            try:
                self.metrics.event(kind, fields)
            except Exception:  # a sink must never hurt the broker
                log.debug("metrics sink failed", exc_info=True)
        fx.clear()

    # ------------------------------------------------------------------ worker port

    def _on_worker_frames(self, frames: list[bytes]) -> None:  # noqa: C901 - grandfathered: one branch per message type, inline on the broker's hot path
        identity = frames[0]
        fields: list[Any] = []  # the header's field map: a result's trajectories can go on as received (carry_entry)
        try:
            msg = decode(frames[1:], guard.BROKER_LIMITS, guard.WORKER_PORT_TYPES, fields)
        except ProtocolError as exc:
            self._protocol_error(self._w, identity, exc, frames)
            return
        w = self._by_identity.get(identity)
        kind = type(msg)
        st = self.state
        now = self._now
        if kind is Credit:
            if w is not None:
                st.credit(w, msg.credits, now)
                return
        elif kind is Result:
            self._on_result(w, identity, msg, fields[0])
            if msg.credits and w is not None:
                st.credit(w, msg.credits, now)
            return
        elif kind is ResultBatch:
            raws = fields[0].get("results")
            for i, r in enumerate(msg.results):
                self._on_result(w, identity, r, raws[i])
                if r.credits and w is not None:
                    st.credit(w, r.credits, now)
            if msg.credits and w is not None:
                st.credit(w, msg.credits, now)
            return
        elif kind is Hello:
            self._on_hello(identity, msg)
            return
        elif kind is Goodbye:
            if w is not None:
                st.nack(w, msg.task_ids, now, reason="goodbye")
                st.remove_worker(w.worker_id, now, reason="goodbye")
                self._by_identity.pop(identity, None)
            return
        if w is None:
            self._send(self._w, identity, encode(Error(code="hello_required", message="say hello first", ref_type=getattr(kind, "TYPE", None))))
            return
        if kind is WorkerHeartbeat:
            # what a heartbeat says it holds is read only when written in this epoch (an older one
            # may predate the hello that set this worker's numbering)
            here = msg.epoch == self.epoch
            st.heartbeat(
                w, now, version=msg.weight_version, state=msg.state, tokens_total=msg.tokens_total,
                dispatch_seq=msg.dispatch_seq if here else -1, free_capacity=msg.free_capacity, held_count=msg.held_count,
                held_digest=msg.held_digest, held=msg.inflight_task_ids if msg.held_full else None,
                version_epoch=msg.version_epoch,
            )
            st.note_tokens_cancelled(w, msg.tokens_cancelled)
        elif kind is Nack:
            st.nack(w, msg.task_ids, now, reason=msg.reason)
        elif kind is TurnRecords:
            st.record_turns(w, msg.task_id, msg.prompt_id, msg.turns, now)
        elif kind is TurnRecordBatch:
            for records in msg.records:
                st.record_turns(w, records.task_id, records.prompt_id, records.turns, now)
        elif kind is ControlReply:
            st.touch(w, now)
            self._on_control_reply(w, msg)
        elif kind is ApplyRequest:
            st.touch(w, now)
            st.apply_request(w, msg.version, now)
        elif kind is ApplyDone:
            st.touch(w, now)
            # read now, not at the burst's start: a fleet activation's skew is measured from these
            st.apply_done(w, msg.version, msg.ok, msg.error, skipped=msg.skipped, now=self.clock())
        else:
            self.protocol_errors += 1
            self._send(self._w, identity, encode(Error(code="unexpected_type", message=f"{kind.TYPE} is not a worker message", ref_type=kind.TYPE)))

    def _on_result(self, w: WorkerInfo | None, identity: bytes, msg: Result, raw: Any = None) -> None:
        outcome = self.state.result(
            w, task_id=msg.task_id, prompt_id=msg.prompt_id, trajectories=msg.trajectories,
            error=msg.error, retryable=msg.retryable, now=self._now,
        )
        if outcome == "accepted":
            if raw is not None and msg.trajectories and (g := self.state.groups.get(msg.prompt_id)) is not None:
                g.wire = carry_entry(msg.trajectories, raw.get("trajectories"))
        elif outcome != "requeued":
            log.debug("broker: result for %s from %s: %s", msg.task_id, w.worker_id if w else identity.hex(), outcome)

    def _on_hello(self, identity: bytes, msg: Hello) -> None:
        proto = negotiate_version(msg.protocol_min, msg.protocol_max)
        error = None
        if proto is None:
            error = ("version", f"no common protocol version: worker speaks {msg.protocol_min}..{msg.protocol_max}, broker {list(SUPPORTED_MAJORS)}")
        elif not msg.worker_id:
            error = ("invalid", "worker_id must not be empty")
        elif msg.capacity < 1:
            error = ("invalid", f"capacity must be >= 1, got {msg.capacity}")
        elif msg.pool != self.config.pool:
            error = ("wrong_pool", f"this broker serves pool {self.config.pool!r}, not {msg.pool!r}")
        elif self._stopping:
            error = ("stopping", "the broker is shutting down")
        if error is not None:
            self.protocol_errors += error[0] != "stopping"
            self._send(self._w, identity, encode(Error(code=error[0], message=error[1], ref_type="hello")))
            return
        self._peer_limits[msg.worker_id] = (msg.max_msg_bytes, msg.max_header_bytes)
        minor = settle_minor(msg.protocol_minor)
        self._set_inline(msg.worker_id, minor, msg.max_header_bytes)
        old = self.state.workers.get(msg.worker_id)
        if old is not None and old.identity != identity:
            self._by_identity.pop(old.identity, None)
        inflight, over = guard.bound_inflight(msg.inflight, min(msg.capacity, self.config.max_worker_credits))
        if over:
            self.refusals.count("inflight_per_hello")
        adopted, refused = self.state.add_worker(
            worker_id=msg.worker_id, identity=identity, capacity=msg.capacity, credits=msg.credits,
            now=self._now, version=msg.weight_version, inflight=inflight, fingerprint=msg.fingerprint,
            engine=msg.engine, apply_modes=msg.apply_modes, host=msg.host, pid=msg.pid, features=msg.features,
            version_epoch=msg.version_epoch,
        )
        self._by_identity[identity] = self.state.workers[msg.worker_id]
        self._send(
            self._w,
            identity,
            encode(
                Welcome(
                    epoch=self.epoch, protocol=proto or PROTOCOL_MAJOR, heartbeat_interval_s=self.config.heartbeat_interval_s,
                    weight_version=self.state.version, weight_endpoint=self.weight_endpoint,
                    announce_endpoint=self.announce_endpoint, adopted=tuple(adopted), refused=tuple(refused + over),
                    max_msg_bytes=self.sockets.options.max_msg_bytes, max_header_bytes=guard.BROKER_LIMITS.max_header_bytes,
                    features=self._welcome_features, dispatch_seq=self.state.workers[msg.worker_id].dispatch_seq,
                    version_epoch=self.state.version_epoch, rebase_version=self.state.rebase_floor(msg.version_epoch),
                    protocol_minor=minor,
                )
            ),
        )
        log.info("broker: worker %s joined (capacity %d, version %d, adopted %d)", msg.worker_id, msg.capacity, msg.weight_version, len(adopted), extra={"worker_id": msg.worker_id})

    # ------------------------------------------------------------------ client port

    def _on_client_frames(self, frames: list[bytes]) -> None:  # noqa: C901 - grandfathered: one branch per message type, inline on the broker's hot path
        identity = frames[0]
        try:
            msg = decode(frames[1:], guard.BROKER_LIMITS, guard.CLIENT_PORT_TYPES)
        except ProtocolError as exc:
            self._protocol_error(self._c, identity, exc, frames)
            return
        kind = type(msg)
        st = self.state
        if kind is Pull:
            if msg.ack:
                st.ack(msg.ack)
            client_id = self._clients.get(identity) or identity.hex()
            max_groups = max(1, min(msg.max_groups, self.config.max_pull_groups))
            pull = _PendingPull(identity, client_id, msg.request_id, max_groups)
            if ((st.has_results() and not self._pulls) or msg.wait_s <= 0 or self._stopping
                    or st.resend_due(client_id, self._now)):
                self._answer_pull(pull)
            elif self._pulls.full(identity):
                self.refusals.count("pulls_per_peer")
                self._send(self._c, identity, encode(Error(code="limit", message=f"{self._pulls.per_peer} pulls are already waiting for this peer (limit pulls_per_peer)", request_id=msg.request_id, ref_type="pull")))
            else:
                assert self._loop is not None
                wait = min(msg.wait_s, self.config.max_pull_wait_s)
                pull.handle = self._loop.call_later(wait, self._pull_timeout, pull)
                self._pulls.append(pull)
        elif kind is Submit:
            accepted, rejected = st.submit(msg.prompts, self._now, stopping=self._stopping)
            self._outbox.append((identity, encode(SubmitReply(request_id=msg.request_id, epoch=self.epoch, accepted=tuple(accepted), rejected=tuple(rejected)))))
        elif kind is Ack:
            st.ack(msg.prompt_ids, msg.dropped_stale)
        elif kind is ClientHello:
            proto = negotiate_version(msg.protocol_min, msg.protocol_max)
            if proto is None:
                self._send(self._c, identity, encode(Error(code="version", message=f"no common protocol version (broker speaks {list(SUPPORTED_MAJORS)})", ref_type="client_hello")))
                return
            self._clients[identity] = msg.client_id
            self._peer_limits[identity] = (msg.max_msg_bytes, msg.max_header_bytes)
            minor = settle_minor(msg.protocol_minor)
            self._set_inline(identity, minor, msg.max_header_bytes)
            if msg.fingerprint:
                st.set_required_fingerprint(msg.fingerprint)
            redelivered = st.client_reconnected(msg.client_id)
            self._send(self._c, identity, encode(ClientWelcome(
                epoch=self.epoch, protocol=proto, weight_version=st.version, redelivered=redelivered,
                max_msg_bytes=self.sockets.options.max_msg_bytes, max_header_bytes=guard.BROKER_LIMITS.max_header_bytes,
                protocol_minor=minor)))
        elif kind is SetVersion:
            self._on_set_version(identity, msg)
        elif kind is StatusRequest:
            self._send(self._c, identity, encode(StatusReply(request_id=msg.request_id, epoch=self.epoch, counters=self.counters(), workers=self.workers_view())))
        elif kind is Control:
            self._on_control(identity, msg)
        elif kind is CancelPrompts:
            cancelled, other = st.cancel(msg.prompt_ids, self._now)
            self._send(self._c, identity, encode(Reply(request_id=msg.request_id, ok=True, epoch=self.epoch, data={"cancelled": cancelled, "not_cancelled": other})))
        else:
            self.protocol_errors += 1
            self._send(self._c, identity, encode(Error(code="unexpected_type", message=f"{kind.TYPE} is not a client message", request_id=getattr(msg, "request_id", None), ref_type=kind.TYPE)))

    def _answer_pull(self, pull: _PendingPull) -> None:
        pull.done = True
        if pull.handle is not None:
            pull.handle.cancel()
        st = self.state
        groups = st.pull(pull.client_id, pull.max_groups, now=self.clock())
        inline = self._peer_inline.get(pull.identity) if groups else None
        carry: dict[int, Any] | None = None
        if inline is not None:  # trajectories received with every array inline go on as they came
            for gr in groups:
                g = st.groups.get(gr.prompt_id)
                if g is not None and g.wire is not None and g.wire[0] is gr.trajectories:
                    if carry is None:
                        carry = {}
                    carry[id(gr.trajectories)] = g.wire
        frames = encode(Batch(request_id=pull.request_id, epoch=self.epoch, groups=tuple(groups), weight_version=st.version),
                        inline, carry)
        if groups and self._refuse_oversize(pull.identity, frames, f"batch of {len(groups)} groups"):
            frames = encode(Error(code="oversize", message=f"a batch of {len(groups)} groups is over this client's limits: pull fewer groups", request_id=pull.request_id, ref_type="pull"))
            self.state.client_reconnected(pull.client_id)  # not delivered: ready again for a smaller pull
            groups = []
        if not self._send(self._c, pull.identity, frames) and groups:
            self.state.client_reconnected(pull.client_id)  # not delivered after all: make them ready again

    def _serve_pulls(self) -> None:
        st = self.state
        while self._pulls and st.has_results():
            pull = self._pulls.popleft()
            if not pull.done:
                self._answer_pull(pull)

    def _pull_timeout(self, pull: _PendingPull) -> None:
        if pull.done:
            return
        try:
            self._pulls.remove(pull)
        except ValueError:
            pass
        self._now = self.clock()
        self._answer_pull(pull)
        self._recheck()

    def _on_set_version(self, identity: bytes, msg: SetVersion) -> None:
        st = self.state
        st.set_trainer_bound(msg.stale_bound)  # before the bump: its cancellations judge by it
        if msg.rebase:
            if msg.version < 0:
                self._send(self._c, identity, encode(Reply(request_id=msg.request_id, ok=False, epoch=self.epoch,
                                                           error=f"a rebase needs a version >= 0, got {msg.version}")))
                return
            info = st.rebase(msg.version, int(time.time() * 1000), self._now)
            log.warning("broker: version rebased %d -> %d (version epoch %d, %d in-flight tasks cancelled)", info["from"], info["to"],
                        info["version_epoch"], info["cancelled"], extra={"version": msg.version})
            newer = True
        elif msg.version < st.version:
            # versions only move forward: a trainer that resumed from an older checkpoint must say so
            self._send(self._c, identity, encode(Reply(
                request_id=msg.request_id, ok=False, epoch=self.epoch, data={"version": st.version},
                error=(f"version {msg.version} is older than the pool's version {st.version}; a trainer resuming from a "
                       f"checkpoint rebases the pool first (TrainerClient.rebase_version({msg.version}))"))))
            return
        else:
            newer = st.set_version(msg.version, self._now)
        if msg.adapter is not None:  # the LoRA adapter (policy) served from this version on
            st.set_policy(msg.adapter.name, msg.adapter_since if msg.adapter_since >= 0 else msg.version, msg.adapter.base_model, self._now)
        if msg.weight_endpoint:
            self.weight_endpoint = msg.weight_endpoint
        if msg.announce_endpoint:
            self.announce_endpoint = msg.announce_endpoint
        if newer and not msg.rebase:
            st.effects.events.append(("version_announced", {"version": msg.version}))
            log.info("broker: version %d announced", msg.version, extra={"version": msg.version})
        self._send(self._c, identity, encode(Reply(request_id=msg.request_id, ok=True, epoch=self.epoch,
                                                   data={"version": st.version, "version_epoch": st.version_epoch})))
        if newer or msg.weight_endpoint or msg.announce_endpoint:
            self._broadcast_heartbeat()

    def _on_control(self, identity: bytes, msg: Control) -> None:
        self._control_seq += 1
        req = f"ctl-{self._control_seq}"
        workers = list(self.state.workers.values())
        ctl = _PendingControl(identity=identity, request_id=msg.request_id, waiting={w.worker_id for w in workers})
        self._controls[req] = ctl
        frames = encode(Control(request_id=req, op=msg.op, tags=msg.tags, args=msg.args, timeout_s=msg.timeout_s))
        for w in workers:
            if not self._send(self._w, w.identity, frames):
                ctl.waiting.discard(w.worker_id)
                ctl.results[w.worker_id] = {"ok": False, "error": "unreachable"}
        if not ctl.waiting:
            self._finish_control(req)
            return
        assert self._loop is not None
        timeout = min(max(msg.timeout_s, 0.001), self.config.control_timeout_s)
        ctl.handle = self._loop.call_later(timeout, self._control_timeout, req)

    def _on_control_reply(self, w: WorkerInfo, msg: ControlReply) -> None:
        ctl = self._controls.get(msg.request_id)
        if ctl is None or w.worker_id not in ctl.waiting:
            return
        ctl.waiting.discard(w.worker_id)
        ctl.results[w.worker_id] = {"ok": msg.ok, "error": msg.error, **msg.results}
        if not ctl.waiting:
            self._finish_control(msg.request_id)

    def _control_timeout(self, req: str) -> None:
        ctl = self._controls.get(req)
        if ctl is None:
            return
        for wid in ctl.waiting:
            ctl.results[wid] = {"ok": False, "error": "timeout"}
        ctl.waiting.clear()
        self._finish_control(req)
        self._recheck()

    def _finish_control(self, req: str) -> None:
        ctl = self._controls.pop(req)
        if ctl.handle is not None:
            ctl.handle.cancel()
        ok = all(r.get("ok") for r in ctl.results.values())
        failed = sorted(wid for wid, r in ctl.results.items() if not r.get("ok"))
        error = None if ok else f"{len(failed)} of {len(ctl.results)} workers failed: {', '.join(failed[:8])}"
        self._send(self._c, ctl.identity, encode(ControlReply(request_id=ctl.request_id, ok=ok, error=error, results=ctl.results, epoch=self.epoch)))

    # ------------------------------------------------------------------ timers

    def _rebase_version(self) -> int:
        """For heartbeats: the version the last rebase went back to (-1: never rebased)."""
        st = self.state
        return st.rebase_floor(st.version_epoch - 1) if st.version_epoch else -1

    def _broadcast_heartbeat(self) -> None:
        frames = encode(
            BrokerHeartbeat(epoch=self.epoch, weight_version=self.state.version, weight_endpoint=self.weight_endpoint, announce_endpoint=self.announce_endpoint,
                            version_epoch=self.state.version_epoch, rebase_version=self._rebase_version())
        )
        for w in list(self.state.workers.values()):
            self._send(self._w, w.identity, frames)

    async def _heartbeat_loop(self) -> None:
        interval = self.config.heartbeat_interval_s
        while True:
            self._broadcast_heartbeat()
            if type(self.metrics) is not NullMetricsSink:  # the counters' snapshot is most of an idle broker's beat
                try:
                    self.metrics.publish_state("broker", "broker", self.counters())
                except Exception:
                    log.debug("metrics sink failed", exc_info=True)
            self._recheck()
            await asyncio.sleep(interval)

    async def _lease_loop(self) -> None:
        while True:
            await asyncio.sleep(self._tick)
            self._now = self.clock()
            if self._now - self._tick_at > self._stall_after:
                self._stalled(self._now)
            self._tick_at = self._now
            dead, requeued = self.state.expire(self._now)
            for wid in dead:
                log.warning("broker: worker %s declared dead (silent %.2f s)", wid, self.config.dead_after_s, extra={"worker_id": wid})
            if requeued:
                log.info("broker: %d groups requeued", len(requeued))
            self._after_burst()
            self._recheck()

    def _stalled(self, now: float) -> None:
        """A tick far later than asked means the broker read nothing meanwhile (GC, SIGSTOP, slow disk):
        that time is not worker silence. Noted (by whichever runs first after it, the lease loop or a
        socket callback), then what the worker socket queued up is read before anyone is judged."""
        late = now - self._tick_at - self._tick
        self._tick_at = now
        log.warning("broker: stalled %.2f s (not reading); not counted as worker silence", late)
        self.state.note_stall(late, now)
        self._drain_workers()

    # ------------------------------------------------------------------ status

    def counters(self) -> dict[str, Any]:
        c = self.state.snapshot()
        c["epoch"] = self.epoch
        c["protocol_errors"] = self.protocol_errors
        c["send_failures"] = self.send_failures
        c["pending_pulls"] = len(self._pulls)
        c["coalesced_reads"] = self.coalesced_reads
        c["reads"] = self.reads
        c["messages_in"] = self.messages_in
        c["messages_out"] = self.messages_out
        c["frames_in"] = self.frames_in
        c["frames_out"] = self.frames_out
        c.update(self.refusals.counters())
        c.update(self.sockets.counters())
        c["workers_listed"] = min(len(self.state.workers), _MAX_STATUS_WORKERS)
        c["versions"] = self.state.versions_view()
        return c

    def workers_view(self) -> dict[str, Any]:
        """Live state per worker, for `StatusReply.workers`: at most `_MAX_STATUS_WORKERS` of them.

        A peer decodes maps of at most `DEFAULT_LIMITS.max_map_len` entries, so a reply naming every
        worker of a 10,000-worker pool could not be read by any client; the counters still say
        `workers_alive`, and `workers_listed` says how many the map holds.
        """
        now = self.clock()
        return {wid: w.live_state(now) for wid, w in itertools.islice(self.state.workers.items(), _MAX_STATUS_WORKERS)}
