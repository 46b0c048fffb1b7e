"""The worker's session with the broker: pure state, no I/O, an injected clock.

`WorkerSession` is to the worker what `rollpool.broker.state.BrokerState` is to the
broker. It holds the task ledger (each task's phase), the credits, the outbox of
results the broker has not received, the epoch and the hello schedule. Every method
takes ``now`` (monotonic seconds) from the caller and returns an `Effects`: the
messages to send, in order, and what to do to engine requests. Nothing here sleeps,
reads a clock, touches a socket or calls the engine; it imports only `rollpool.protocol`.

Rules this class keeps (and tests/unit/workers/test_session.py checks):

* credits: the broker is never told it may send more sequences than the engine has
  free. A task that would exceed them is handed back (``over_credit``). Credits come
  back (`Credit`) when generation ends, not when scoring ends. They come back only
  once the worker has been welcomed, and not while draining or restarting (the next
  hello states them afresh);
* each task yields exactly one message: a `Result`, a `Result` with ``error`` for a
  refused request, a `Nack`, or nothing when the broker cancelled it;
* engine failure: every generating task is handed back at once in one `Nack`. No
  credit is given while restarting. After the restart a hello announces the tasks
  still held (scoring ones, undelivered results);
* the outbox: a result finished while the worker is not welcomed waits, is announced
  in flight on the next hello and goes out after the welcome. A result the link could
  not send (`unsent`) goes back to the outbox and a hello is needed;
* hello: a new epoch, ``hello_required``, a Goodbye, a restarted engine or a broker
  silent for ``missed_heartbeats`` intervals each need one. It is sent at once, then
  again after a backoff that doubles up to ``reconnect_backoff_max_s`` until a
  Welcome answers;
* heartbeat: once welcomed it echoes the highest `Task.seq` received and states the free
  capacity (absolute) and what is held. To a broker that lists `Feature.HELD_DIGEST` the
  held tasks go as a count and a digest (its size does not grow with what is held), and
  the whole list goes at once when the broker asks (`BrokerHeartbeat.send_held`); to one
  that does not, the whole list goes every time;
* drain: after `stop` new tasks are handed back (``worker_draining``) and no credit
  is given. `hand_back_rest` ends what is left. `goodbye` hands back what could not
  be delivered and says Goodbye.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollpool.protocol import ADAPTER_GRANT_MINOR, PROTOCOL_MINOR, SUPPORTED_MAJORS, settle_minor
from rollpool.protocol.messages import (
    BrokerHeartbeat,
    Cancel,
    Credit,
    Error,
    Feature,
    Goodbye,
    Hello,
    InflightTask,
    Nack,
    Result,
    Task,
    TaskBatch,
    Trajectory,
    Welcome,
    WorkerHeartbeat,
    WorkerState,
    held_digest,
)

__all__ = ["Effects", "EngineFacts", "Outgoing", "Phase", "SessionConfig", "TaskEntry", "WorkerSession", "WorkerState"]

log = logging.getLogger(__name__)

Outgoing = Hello | WorkerHeartbeat | Credit | Nack | Result | Goodbye
"""What the session sends to the broker."""


class Phase:
    """A held task's phase. A task leaves the ledger when its message is decided."""

    GENERATING = "generating"
    """The engine runs it; its sequences use up credits."""
    SCORING = "scoring"
    """Generation ended (credits given back); trajectories are being built and scored."""


@dataclass(frozen=True, slots=True)
class SessionConfig:
    """The part of `WorkerConfig` the session needs (the session does not import the worker's modules)."""

    worker_id: str
    pool: str = "default"
    capacity_limit: int = 0
    """Most sequences at once; 0 = the engine's capacity."""
    heartbeat_interval_s: float = 1.0
    missed_heartbeats: int = 3
    reconnect_backoff_s: float = 1.0
    reconnect_backoff_max_s: float = 30.0
    host: str = ""
    pid: int = 0
    max_msg_bytes: int = 0
    """This worker's MAXMSGSIZE, announced in its hello (the broker refuses larger tasks for it); 0: not said."""
    max_header_bytes: int = 0
    """The largest header this worker decodes, announced in its hello; 0: not said."""


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the session needs to know about a started engine (from `EngineInfo`)."""

    name: str
    capacity: int
    apply_modes: tuple[str, ...] = ()
    fingerprint: str = ""
    weight_version: int = -1
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class TaskEntry:
    task: Task
    received_at: float
    phase: str = Phase.GENERATING
    cancelled: bool = False

    @property
    def seqs(self) -> int:
        return self.task.prompt.group_size


@dataclass
class Effects:
    """What the worker must do after a session call, in this order."""

    send: list[Outgoing] = field(default_factory=list)
    """Messages for the broker, in order."""
    start: list[Task] = field(default_factory=list)
    """Tasks to run on the engine."""
    abort: list[str] = field(default_factory=list)
    """Engine requests (task ids) to abort; their generation then ends early."""
    stop_runners: list[str] = field(default_factory=list)
    """Task runners to cancel (handed back, or cancelled while scoring)."""
    weights: tuple[int, str | None, str | None] | None = None
    """(version, weight endpoint, announce endpoint) the broker named."""
    rebase: int | None = None
    """The pool was rebased to this version (`SetVersion.rebase`): weights above it are of an abandoned run;
    forget them before following `weights` (carried out before it)."""

    def __bool__(self) -> bool:
        return bool(self.send or self.start or self.abort or self.stop_runners or self.weights is not None or self.rebase is not None)

    def merge(self, other: Effects) -> Effects:
        self.send += other.send
        self.start += other.start
        self.abort += other.abort
        self.stop_runners += other.stop_runners
        if other.weights is not None:
            self.weights = other.weights
        if other.rebase is not None:
            self.rebase = other.rebase if self.rebase is None else min(self.rebase, other.rebase)
        return self


class WorkerSession:
    """The worker's whole session state; the worker around it only moves bytes and runs the engine."""

    def __init__(self, config: SessionConfig) -> None:
        self.config = config
        self.worker_id = config.worker_id
        self.tasks: dict[str, TaskEntry] = {}
        self.outbox: deque[Result] = deque()
        self.epoch = ""
        """The broker epoch of the last Welcome ("" before the first)."""
        self.welcomed = False
        """A Welcome answered the last hello, and nothing since asked for a new one."""
        self.broker_features: frozenset[str] = frozenset()
        """The optional wire features the last Welcome listed (`Feature`)."""
        self.broker_minor = 0
        """The protocol minor settled with the broker in the last Welcome (0: before it, or a broker of minor 11 or older)."""
        self.held_lists_sent = 0
        """Heartbeats that carried the whole held list because the broker asked (`BrokerHeartbeat.send_held`)."""
        self.seen_seq = 0
        """The highest `Task.seq` received since the last welcome, from its `dispatch_seq` on (echoed in heartbeats)."""
        self.version = -1
        """The weight version the engine serves."""
        self.version_epoch = 0
        """The pool's version epoch `version` belongs to (the newest `version_epoch` the broker named)."""
        self.weights_epoch = 0
        """The version epoch of the weights the engine holds: the epoch a version was applied in, moved on by a
        rebase only when the version is at or below the rebase's (shared history); stamped on every trajectory."""
        self.capacity = 0
        self.engine: EngineFacts | None = None
        self.restarting = False
        self.applying = False
        self.sleeping = False
        self.stopping = False
        self.stopped = False
        self.hellos_sent = 0
        self.tokens_total = 0
        self.tokens_cancelled = 0
        """Tokens generated for tasks cancelled before their result (`WorkerHeartbeat.tokens_cancelled`)."""
        self._token_window: deque[tuple[float, int]] = deque(maxlen=256)
        self._last_broker_msg_at = 0.0
        self._next_hello_at = 0.0
        self._hello_backoff_s = config.reconnect_backoff_s
        self._handed_at_shutdown: list[str] = []

    # ------------------------------------------------------------------ views

    @property
    def state(self) -> str:
        if self.stopped:
            return WorkerState.STOPPED
        if self.restarting:
            return WorkerState.RESTARTING
        if self.engine is None:
            return WorkerState.STARTING
        if self.applying:
            return WorkerState.APPLYING
        if self.stopping:
            return WorkerState.DRAINING
        if self.sleeping:
            return WorkerState.SLEEPING
        return WorkerState.READY

    def engine_seqs(self) -> int:
        """Sequences the engine runs for held tasks."""
        return sum(e.seqs for e in self.tasks.values() if e.phase == Phase.GENERATING)

    def free_credits(self) -> int:
        if self.stopping or self.restarting or self.stopped or self.engine is None:
            return 0
        return max(0, self.capacity - self.engine_seqs())

    def inflight_task_ids(self) -> tuple[str, ...]:
        return tuple(self.tasks)

    def wants_result(self, task_id: str) -> bool:
        """The task is held and not cancelled: its trajectories are worth building."""
        entry = self.tasks.get(task_id)
        return entry is not None and not entry.cancelled

    def tokens_per_s(self, now: float, window_s: float = 10.0) -> float:
        recent = [(t, n) for t, n in self._token_window if now - t <= window_s]
        if not recent:
            return 0.0
        span = max(now - recent[0][0], self.config.heartbeat_interval_s)
        return sum(n for _, n in recent) / span

    @property
    def next_poll_at(self) -> float:
        """When `poll` has something to decide next (a hello retry, or the silence check)."""
        if self.stopped:
            return math.inf
        if not self.welcomed:
            return self._next_hello_at if self._can_hello() else math.inf
        return self._last_broker_msg_at + self._silence_limit_s()

    # ------------------------------------------------------------------ engine

    def engine_started(self, now: float, facts: EngineFacts) -> Effects:
        """The engine (first or restarted) serves: a hello, sent now (a new engine, new capacity and credits)."""
        self.engine = facts
        limit = self.config.capacity_limit
        self.capacity = min(limit, facts.capacity) if limit else facts.capacity
        if self.version < 0:
            self.version = facts.weight_version
        self.restarting = False
        self.welcomed = False
        self._hello_backoff_s = self.config.reconnect_backoff_s
        self._next_hello_at = now
        return self.poll(now)

    def engine_failed(self, now: float, reason: str) -> Effects:
        """Hand back every generating task at once (one Nack); no credits until the restart's hello."""
        eff = Effects()
        if self.restarting:
            return eff
        self.restarting = True
        handed = [tid for tid, e in self.tasks.items() if e.phase == Phase.GENERATING]
        for tid in handed:
            del self.tasks[tid]
        if handed:
            eff.send.append(Nack(task_ids=tuple(handed), reason=f"engine_failed: {reason}"))
            eff.stop_runners += handed
        return eff

    def adapters_need_grant(self) -> bool:
        """Whether an adapter version asks for an apply slot: unless the broker said it needs none
        (`Feature.ADAPTER_NO_GRANT`, minor `ADAPTER_GRANT_MINOR` on), as every version did before."""
        return not (Feature.ADAPTER_NO_GRANT in self.broker_features and self.broker_minor >= ADAPTER_GRANT_MINOR)

    def apply_started(self, now: float) -> None:
        self.applying = True

    def apply_finished(self, now: float, version: int | None) -> None:
        """An apply ended; `version` is the one now served (None: it failed)."""
        self.applying = False
        if version is not None:
            self.version = version
            self.weights_epoch = self.version_epoch

    def set_sleeping(self, now: float, sleeping: bool) -> None:
        self.sleeping = sleeping

    # ------------------------------------------------------------------ broker messages

    def handle(self, now: float, msg: object) -> Effects | None:
        """One message from the broker; None when it is not the session's (ApplyGrant, Control)."""
        self._last_broker_msg_at = now
        if isinstance(msg, Task):
            return self.on_task(now, msg)
        if isinstance(msg, TaskBatch):
            # (Feature.TASK_BATCH) exactly as the tasks sent one by one, in this order
            eff = Effects()
            for task in msg.tasks:
                eff.merge(self.on_task(now, task))
            return eff
        if isinstance(msg, Welcome):
            return self.on_welcome(now, msg)
        if isinstance(msg, BrokerHeartbeat):
            return self.on_broker_heartbeat(now, msg)
        if isinstance(msg, Cancel):
            return self.on_cancel(now, msg.task_ids)
        if isinstance(msg, Error):
            log.warning("broker error %s: %s", msg.code, msg.message, extra={"worker": self.worker_id})
            return self._need_hello(now) if msg.code == "hello_required" else Effects()
        if isinstance(msg, Goodbye):
            log.warning("broker said goodbye (%s)", msg.reason, extra={"worker": self.worker_id})
            return self._need_hello(now)
        return None

    def on_welcome(self, now: float, msg: Welcome) -> Effects:
        if self.epoch and msg.epoch != self.epoch:
            log.warning("broker epoch changed %s -> %s", self.epoch, msg.epoch, extra={"worker": self.worker_id})
        self.epoch = msg.epoch
        self.welcomed = True
        self.broker_features = frozenset(msg.features)
        self.broker_minor = settle_minor(msg.protocol_minor)
        self.seen_seq = msg.dispatch_seq  # where the broker's numbering of this worker's tasks stands
        self._hello_backoff_s = self.config.reconnect_backoff_s
        eff = Effects(weights=(msg.weight_version, msg.weight_endpoint, msg.announce_endpoint))
        eff.rebase = self._note_version_epoch(msg.version_epoch, msg.rebase_version)
        refused = set(msg.refused)
        for tid in msg.refused:
            entry = self.tasks.pop(tid, None)
            if entry is not None and entry.phase == Phase.GENERATING:
                eff.abort.append(tid)
            elif entry is not None:
                eff.stop_runners.append(tid)
        kept = [r for r in self.outbox if r.task_id not in refused]
        self.outbox.clear()
        eff.send += kept
        return eff

    def on_task(self, now: float, task: Task) -> Effects:
        eff = Effects()
        self.seen_seq = max(self.seen_seq, task.seq)
        if task.task_id in self.tasks:
            return eff  # already held (re-sent after a re-hello)
        reason = None
        if self.stopping or self.stopped:
            reason = "worker_draining"
        elif self.restarting or self.engine is None:
            reason = "engine_restarting"
        elif self.engine_seqs() + task.prompt.group_size > self.capacity:
            reason = "over_credit"
        if reason is not None:
            log.info("handing back task %s: %s", task.task_id, reason, extra={"worker": self.worker_id})
            eff.send.append(Nack(task_ids=(task.task_id,), reason=reason))
            return eff
        self.tasks[task.task_id] = TaskEntry(task, now)
        eff.start.append(task)
        return eff

    def on_broker_heartbeat(self, now: float, msg: BrokerHeartbeat) -> Effects:
        eff = Effects()
        if self.welcomed and msg.epoch != self.epoch:
            log.warning("broker heartbeat from new epoch %s; saying hello again", msg.epoch, extra={"worker": self.worker_id})
            eff = self._need_hello(now)
        eff.weights = (msg.weight_version, msg.weight_endpoint, msg.announce_endpoint)
        eff.rebase = self._note_version_epoch(msg.version_epoch, msg.rebase_version)
        if msg.send_held and self.welcomed and msg.epoch == self.epoch:
            # our held digest disagreed with the broker's leases: the whole list now, not a heartbeat later
            beat = self.heartbeat(now, full=True)
            if beat is not None:
                self.held_lists_sent += 1
                eff.send.append(beat)
        return eff

    def _note_version_epoch(self, epoch: int, rebase_version: int) -> int | None:
        """A newer version epoch: the pool was rebased to `rebase_version`. A served version above it is of an
        abandoned run: forgotten (-1), so whatever version comes next is applied, lower or not."""
        if epoch <= self.version_epoch:
            return None  # the same epoch, or a broker that restarted without the rebase: nothing to forget
        self.version_epoch = epoch
        if rebase_version < -1 or (rebase_version >= 0 and self.version > rebase_version):
            # the engine keeps those weights until the next apply: what it makes now is the abandoned run's
            # (weights_epoch stays), so the trainer can tell
            log.warning("the pool was rebased to version %d: forgetting version %d (an abandoned run)", rebase_version, self.version,
                        extra={"worker": self.worker_id})
            self.version = -1
            return rebase_version
        self.weights_epoch = epoch  # at or below the rebase: the same weights in the new run
        return None

    def on_cancel(self, now: float, task_ids: Iterable[str]) -> Effects:
        """Cancelled tasks give no result. A generating one is aborted (its credits come back when it ends);
        a scoring one is dropped now; an undelivered result is dropped from the outbox."""
        eff = Effects()
        gone: set[str] = set()
        for tid in task_ids:
            entry = self.tasks.get(tid)
            if entry is None:
                gone.add(tid)
                continue
            entry.cancelled = True
            if entry.phase == Phase.GENERATING:
                eff.abort.append(tid)
            else:
                del self.tasks[tid]
                eff.stop_runners.append(tid)
        if gone and self.outbox:
            self.outbox = deque(r for r in self.outbox if r.task_id not in gone)
        return eff

    # ------------------------------------------------------------------ task lifecycle

    def generation_finished(self, now: float, task_id: str) -> Effects:
        """The engine returned the task's samples: its credits come back."""
        eff = Effects()
        entry = self.tasks.get(task_id)
        if entry is None or entry.phase != Phase.GENERATING:
            return eff
        entry.phase = Phase.SCORING
        eff.send += self._credit(entry.seqs)
        if entry.cancelled:
            del self.tasks[task_id]
        return eff

    def output_discarded(self, tokens: int) -> None:
        """The engine returned a cancelled task's partial output: its tokens were generated for nothing."""
        self.tokens_cancelled += max(0, tokens)

    def task_refused(self, now: float, task_id: str, reason: str) -> Effects:
        """The engine refused the request: a non-retryable error result, and its credits back."""
        entry = self.tasks.get(task_id)
        if entry is None:
            return Effects()
        eff = self.generation_finished(now, task_id)
        self.tasks.pop(task_id, None)
        if entry.cancelled:
            return eff
        prompt_id = entry.task.prompt.prompt_id
        return eff.merge(self._deliver(Result(task_id=task_id, prompt_id=prompt_id, error=f"invalid: {reason}", retryable=False)))

    def task_finished(self, now: float, task_id: str, trajectories: Sequence[Trajectory]) -> Effects:
        """The task's trajectories are built and scored: one Result (now, or from the outbox later)."""
        entry = self.tasks.pop(task_id, None)
        if entry is None or entry.cancelled:
            return Effects()
        n_out = sum(len(t.output_ids) for t in trajectories)
        self.tokens_total += n_out
        self._token_window.append((now, n_out))
        stamped = tuple(dataclasses.replace(t, version_epoch=self.weights_epoch) for t in trajectories)
        result = Result(task_id=task_id, prompt_id=entry.task.prompt.prompt_id, trajectories=stamped)
        return self._deliver(result)

    def unsent(self, now: float, results: Iterable[Result]) -> Effects:
        """The link could not send these results: back to the outbox, and a hello is needed."""
        for r in reversed(list(results)):
            self.outbox.appendleft(r)
        if self.welcomed:
            self.welcomed = False
            self._hello_backoff_s = self.config.reconnect_backoff_s
            self._next_hello_at = now + self._hello_backoff_s
        return Effects()

    # ------------------------------------------------------------------ timers

    def poll(self, now: float) -> Effects:
        """A hello when one is due (retry with backoff), or when the broker fell silent."""
        if self.stopped:
            return Effects()
        if self.welcomed and now - self._last_broker_msg_at > self._silence_limit_s():
            log.warning("broker silent for %.1fs; saying hello again", now - self._last_broker_msg_at, extra={"worker": self.worker_id})
            return self._need_hello(now)
        if not self.welcomed and self._can_hello() and now >= self._next_hello_at:
            return Effects(send=[self._hello(now)])
        return Effects()

    def heartbeat(self, now: float, full: bool = False) -> WorkerHeartbeat | None:
        """The periodic heartbeat; also while a re-hello is pending, so the broker keeps the worker alive.

        `full`: the whole held list even to a broker that checks digests (it asked for it).
        """
        if not self.epoch or self.stopped:
            return None
        if not self.welcomed:
            # a hello is pending: liveness only. What this worker holds is described against the numbering
            # of the welcome to come (a heartbeat written now may be read after the broker took the hello)
            return WorkerHeartbeat(worker_id=self.worker_id, inflight_task_ids=self.inflight_task_ids(), weight_version=self.version,
                                   state=self.state, tokens_total=self.tokens_total, epoch=self.epoch, version_epoch=self.version_epoch)
        # a cancelled task still generating (its abort under way) is not held: the broker ended its lease with the
        # Cancel, and listing it would make every heartbeat until the abort ends disagree with the broker's digest
        held = tuple(tid for tid, e in self.tasks.items() if not e.cancelled) + tuple(r.task_id for r in self.outbox if r.task_id not in self.tasks)
        # reconciliation (Feature.RECONCILE): the echo of the highest Task.seq received, what is held and
        # the free capacity (absolute), so a lost Task, Result or Credit is repaired by the next heartbeat. At scale,
        # to a broker that checks digests (Feature.HELD_DIGEST) the held tasks go as a count and a digest; a
        # mismatch makes it ask for the whole list (`on_broker_heartbeat`)
        whole = full or Feature.HELD_DIGEST not in self.broker_features
        return WorkerHeartbeat(
            worker_id=self.worker_id,
            inflight_task_ids=held if whole else (),
            weight_version=self.version,
            state=self.state,
            tokens_total=self.tokens_total,
            epoch=self.epoch,
            dispatch_seq=self.seen_seq,
            free_capacity=self.free_credits(),
            held_count=len(held),
            held_digest=0 if whole else held_digest(held),
            held_full=whole,
            version_epoch=self.version_epoch,
            tokens_cancelled=self.tokens_cancelled,
        )

    # ------------------------------------------------------------------ drain

    def stop(self, now: float) -> None:
        """Stop intake: new tasks are handed back, no more credits."""
        self.stopping = True

    def hand_back_rest(self, now: float) -> Effects:
        """The drain deadline passed: end every held task, deliver the outbox if there is a broker."""
        eff = Effects()
        rest = list(self.tasks)
        self.tasks.clear()
        eff.stop_runners += rest
        self._handed_at_shutdown = rest
        if self.epoch:
            eff.send += self.outbox
            self.outbox.clear()
        return eff

    def goodbye(self, now: float) -> Effects:
        """Hand back what was not delivered (one Nack) and say Goodbye to a broker that welcomed us, or that our hello
        may have reached (it registers a worker on the hello and dispatches to its credits before the welcome arrives:
        without the Goodbye it would wait for missed heartbeats; a broker that never had the hello ignores it)."""
        eff = Effects()
        handed = self._handed_at_shutdown + [r.task_id for r in self.outbox]
        self._handed_at_shutdown = []
        self.outbox.clear()
        if handed:
            eff.send.append(Nack(task_ids=tuple(handed), reason="worker_shutdown"))
        if self.epoch or self.hellos_sent:
            eff.send.append(Goodbye(reason="shutdown"))
        self.stopped = True
        return eff

    # ------------------------------------------------------------------ internals

    def _silence_limit_s(self) -> float:
        return self.config.missed_heartbeats * self.config.heartbeat_interval_s

    def _can_hello(self) -> bool:
        return self.engine is not None and not self.restarting and not self.stopped

    def _need_hello(self, now: float) -> Effects:
        """Something asks for a new hello: send one now, unless one is already pending (its backoff goes on)."""
        if not self.welcomed:
            return Effects()
        self.welcomed = False
        self._hello_backoff_s = self.config.reconnect_backoff_s
        self._next_hello_at = now
        return self.poll(now)

    def _hello(self, now: float) -> Hello:
        facts = self.engine
        assert facts is not None
        self.hellos_sent += 1
        self._next_hello_at = now + self._hello_backoff_s
        self._hello_backoff_s = min(self._hello_backoff_s * 2, self.config.reconnect_backoff_max_s)
        inflight = [
            InflightTask(task_id=tid, prompt_id=e.task.prompt.prompt_id, group_size=e.seqs, attempt=e.task.attempt)
            for tid, e in self.tasks.items()
        ]
        inflight += [
            InflightTask(
                task_id=r.task_id,
                prompt_id=r.prompt_id,
                group_size=len(r.trajectories),
                attempt=r.trajectories[0].attempt if r.trajectories else 0,
            )
            for r in self.outbox
        ]
        return Hello(
            worker_id=self.worker_id,
            protocol_min=min(SUPPORTED_MAJORS),
            protocol_max=max(SUPPORTED_MAJORS),
            engine=facts.name,
            capacity=self.capacity,
            credits=self.free_credits(),
            weight_version=self.version,
            apply_modes=facts.apply_modes,
            fingerprint=facts.fingerprint,
            inflight=tuple(inflight),
            engine_info=dict(facts.info),
            host=self.config.host,
            pid=self.config.pid,
            pool=self.config.pool,
            features=(Feature.TASK_BATCH, Feature.HELD_DIGEST, Feature.RECONCILE, Feature.IMAGES, Feature.REPLAY),
            version_epoch=self.version_epoch,
            protocol_minor=PROTOCOL_MINOR,
            max_msg_bytes=self.config.max_msg_bytes,
            max_header_bytes=self.config.max_header_bytes,
        )

    def fold_credits(self, eff: Effects) -> Effects:
        """(Feature.RESULT_CREDITS) Credits sent together with one Result travel in it (`Result.credits`): one message
        where there were two. For a task whose result is built as soon as its generation ends (no reward function
        on the worker). Unchanged for a broker that does not list the feature."""
        if Feature.RESULT_CREDITS not in self.broker_features:
            return eff
        results = [m for m in eff.send if isinstance(m, Result)]
        credits = sum(m.credits for m in eff.send if isinstance(m, Credit))
        if len(results) != 1 or not credits or any(not isinstance(m, (Credit, Result)) for m in eff.send):
            return eff
        eff.send = [dataclasses.replace(results[0], credits=results[0].credits + credits)]
        return eff

    def _credit(self, seqs: int) -> list[Outgoing]:
        if self.stopping or self.restarting or not self.epoch:
            return []  # no more work wanted, or the next hello states the credits afresh
        return [Credit(credits=seqs)]

    def _deliver(self, result: Result) -> Effects:
        if self.welcomed:
            return Effects(send=[result])
        self.outbox.append(result)
        return Effects()
