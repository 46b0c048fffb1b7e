"""The broker's state machine and lease bookkeeping: pure, no I/O, an injected clock.

Per prompt group::

    QUEUED --dispatch--> LEASED(worker, deadline, attempt)
      ^                    |  worker dead / deadline passed / nack / retryable error
      +----- attempt+1 ----+  (after `max_attempts` dispatches: FAILED)
    LEASED --result--> DONE          (held until the client acknowledges it)
    any live state --cancel--> CANCELLED
    terminal (DONE, FAILED, DROPPED_STALE, CANCELLED) --ack--> forgotten

A forgotten group's id stays in a bounded dedup window, so a late result or a
resubmission of it is recognised. Every method takes ``now`` from the caller's
clock (monotonic seconds); nothing here sleeps, reads a clock or touches a socket.

Guarantees this class keeps (and its tests check):

* every accepted prompt reaches exactly one terminal state, which is handed to
  `pull` exactly once (and again only after `client_reconnected`, until acknowledged);
* a worker is never given more sequences than its credit, and a group is
  never split;
* dispatch order is priority (higher first), then submission order; a group
  that fits no ready worker's credit is skipped rather than blocking others;
* with ``max_staleness`` set, ``accepted + running <= (v + eta + 1) * B`` after
  every dispatch (`rollpool.protocol.StalenessController`), and no group goes to
  a worker more than eta versions behind the newest announced version;
* a group whose prompt names a `min_weight_version` goes only to a worker whose
  reported weight version is at least that; other workers skip it (it keeps its
  place in the queue and does not block the groups behind it);
* a group whose prompt names an `exact_weight_version` v goes only to a worker serving v, and is delivered
  only when every sampled token is of v (otherwise it is handed back and tried again); when no live worker
  holds v and none can reach it, it fails at once with the reason (`_exact_verdict`), and a v the pool
  cannot serve is refused at submit;
* a group whose prompt names a `policy` (a LoRA adapter's name) is accepted only while the pool serves that
  adapter (the newest one announced, `set_policy`; otherwise refused at submit naming what is served), goes only to
  a worker at the version that adapter was first published at or newer, and is delivered only when every sampled
  token's version is one of that adapter's (its trajectories then carry `Trajectory.policy`); a queued group whose
  policy stops being served fails at once with the reason;
* fleet activation (``activation = "fleet"``): a worker's `ApplyRequest` says it has the version fetched and
  staged; when every live worker has (or at ``fleet_stage_deadline_s`` after the first did), every staged
  worker is granted at once (`fleet_version` moves), and from that moment no worker below `fleet_version` is
  given work: the ones switching are applying, the ones that had not staged are held out (counted) until
  they serve it;
* version convergence (`VersionConvergence`): per published version, when each live worker served it and
  how long until all did;
* a group whose prompt has images goes only to a worker that lists
  `Feature.IMAGES` (it reads them), skipped by the others the same way;
* the first complete result of a group wins; any later one is a duplicate;
* episode turns (`TurnRecords`) are kept only from the worker holding the group's current lease, per episode
  in turn order, within ``replay_max_group_bytes`` per group and ``replay_max_bytes`` in all; the next attempt's
  task carries them (`replay_for`), a turn a later attempt records again replaces the kept one and every turn
  after it (counted as ``tokens_regenerated``), and they are forgotten when the group reaches a terminal state
  or the pool is rebased.

Side effects the service must carry out (cancels to send, apply grants, metric
events) accumulate in `effects` and are drained by the caller.

Cost per message is O(1) in the number of workers and leases (dispatch is
O(groups leased) plus O(ready workers visited), the apply queue is a dict, the
held-task digest is kept incrementally); only timers (`expire`, once per tick)
and version bumps walk every worker.

Reconciliation groundwork (protocol minor 1): every lease carries a per-worker
dispatch sequence number (`Task.seq`) and, for workers that list
`Feature.HELD_DIGEST`, the XOR digest of its worker's leased task ids is kept
incrementally. `heartbeat` compares the worker's reported (count, digest) with
the leases at or below the sequence number it echoes, and asks for the full
list on a mismatch (`Effects.held_requests`); a full list is compared and the
differences are counted (`leases_unreported`, `held_unknown`) and kept on the
`WorkerInfo`. A worker that lists `Feature.RECONCILE` has them acted on
(it was lost on the wire): such a lease is requeued at once burning no attempt, so is one
above the echo not echoed two heartbeat intervals after dispatch, and credit is
set from the absolute free capacity less what was sent after the echo
(`leases_reconciled`, `credit_corrections`); an older worker's are recorded only.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollpool.broker.config import BrokerConfig
from rollpool.broker.convergence import FleetRound, VersionConvergence, percentile
from rollpool.broker.latency import LatencyLog
from rollpool.protocol.messages import (
    Feature,
    GroupResult,
    GroupState,
    InflightTask,
    Prompt,
    RecordedTurn,
    Rejection,
    Trajectory,
    WorkerState,
    held_digest,
    task_digest,
)
from rollpool.protocol.staleness import StalenessController, sampled_versions

__all__ = ["Phase", "Group", "WorkerInfo", "Effects", "BrokerState", "ResultOutcome", "task_id_of"]


class Phase:
    QUEUED = "queued"
    LEASED = "leased"
    DONE = GroupState.DONE
    FAILED = GroupState.FAILED
    DROPPED_STALE = GroupState.DROPPED_STALE
    CANCELLED = GroupState.CANCELLED
    TERMINAL = frozenset(GroupState.ALL)


class ResultOutcome:
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    UNKNOWN = "unknown"
    REQUEUED = "requeued"
    FAILED = "failed"
    DROPPED_STALE = "dropped_stale"


_POLICY_HISTORY = 256
"""Policies (adapter names) whose first versions the broker remembers to judge a result's tokens by."""
_MAX_SKIPPED_PER_FILL = 64
"""Groups too new for a worker that one fill looks past before giving up on that worker this round."""


def task_id_of(prompt_id: str, attempt: int) -> str:
    return f"{prompt_id}@{attempt}"


@dataclass(slots=True, eq=False)
class Group:
    prompt_id: str
    prompt: Prompt | None
    """None for a task adopted from a worker's hello whose prompt was not resubmitted (yet)."""
    size: int
    priority: int
    seq: int
    queued_at: float
    phase: str = Phase.QUEUED
    attempt: int = 0
    """The attempt number of the current (or next) dispatch; task ids are ``prompt_id@attempt``."""
    worker_id: str | None = None
    task_id: str = ""
    deadline: float = 0.0
    token: int = 0
    result: GroupResult | None = None
    delivered_to: str | None = None
    delivered_at: float = 0.0
    """When it was last sent to `delivered_to` (it is sent again `result_resend_s` later, until acknowledged)."""
    acked: bool = False
    last_worker: str = ""
    forgiven: int = 0
    """Attempts that do not count toward `max_attempts` (handed back by a worker, never sent)."""
    exempt: bool = False
    """Outside staleness admission and accounting (`Prompt.exempt_from_staleness`, e.g. evaluation)."""
    min_version: int = -1
    """`Prompt.min_weight_version`: only a worker at this weight version or newer may take the group."""
    exact_version: int = -1
    """`Prompt.exact_weight_version`: only a worker at exactly this weight version may take the group (-1: any)."""
    dispatch_seq: int = 0
    """`Task.seq` of the current lease (0: adopted from a hello, not numbered)."""
    dispatched_at: float = 0.0
    echo_due: float = 0.0
    """A `Feature.RECONCILE` worker's heartbeat read after this that does not echo the lease's `dispatch_seq`
    means the Task was lost: `2 x heartbeat_interval_s` after dispatch, moved on by broker stalls."""
    result_at: float = 0.0
    start_version: int = -1
    """The weight version of the worker when the current lease was made: no token of this attempt is older
    (early cancellation judges a lease by it)."""
    digest: int = -1
    """`task_digest(task_id)` of the current lease, when its worker keeps a held digest (-1: not computed)."""
    turns: dict[int, list[RecordedTurn]] | None = None
    """Episode turns recorded by this and earlier attempts, per sample index in turn order (None: none kept)."""
    turn_bytes: int = 0
    turns_before: dict[int, int] | None = None
    """Per sample index: how many turns earlier attempts had kept when the current lease began (a turn below it that
    this attempt records was sampled again: ``tokens_regenerated``)."""
    wire: Any = None
    """The result's trajectories as their received maps (`codec.carry_entry`), when every array in them travelled
    inline: a Batch to a client of minor 12 sends them as they came instead of encoding them again (the service's)."""


@dataclass(slots=True, eq=False)
class WorkerInfo:
    worker_id: str
    identity: bytes
    capacity: int
    credits: int
    last_seen: float
    version: int = -1
    state: str = WorkerState.READY
    fingerprint: str = ""
    engine: str = ""
    apply_modes: tuple[str, ...] = ()
    host: str = ""
    pid: int = 0
    tokens_total: int = 0
    joined_at: float = 0.0
    leases: dict[str, Group] = field(default_factory=dict)
    applying: bool = False
    apply_version: int = -1
    completed: int = 0
    features: frozenset[str] = frozenset()
    dispatch_seq: int = 0
    """The last `Task.seq` sent to this worker (numbers go on across its re-hellos within one epoch)."""
    digest: int = 0
    """XOR of `task_digest` over `leases` (kept only when the worker lists `Feature.HELD_DIGEST`)."""
    reported_seq: int = -1
    """From its last heartbeat: the highest `Task.seq` it had received (-1: never reported)."""
    reported_free: int = -1
    """From its last heartbeat: free capacity, absolute (-1: never reported)."""
    reported_held: int = -1
    held_mismatches: int = 0
    unreported: tuple[str, ...] = ()
    """Leases at or below `reported_seq` missing from its last full held list (requeued at once: lost on the wire)."""
    version_epoch: int = 0
    """The version epoch its reported `version` belongs to (`rebase`)."""
    skipped_version: int = -1
    """The newest weight version this worker gave up on for good (`ApplyDone.skipped`; -1: none)."""
    skipped_error: str = ""
    """Why, in the worker's words."""
    held_out: bool = False
    """Fleet activation: below the version the fleet switched to and not applying it (given no work until it serves it)."""

    def live_state(self, now: float) -> dict[str, Any]:
        return {
            "version": self.version,
            "state": WorkerState.APPLYING if self.applying else self.state,
            "credits": self.credits,
            "capacity": self.capacity,
            "inflight": len(self.leases),
            "engine": self.engine,
            "host": self.host,
            "pid": self.pid,
            "tokens_total": self.tokens_total,
            "completed": self.completed,
            "fingerprint": self.fingerprint,
            "last_seen_s_ago": round(now - self.last_seen, 3),
            "skipped_version": self.skipped_version,
            "skipped_error": self.skipped_error,
            "held_out": self.held_out,
        }


@dataclass
class Effects:
    """What the service must do after a state change."""

    cancels: list[tuple[str, str, str]] = field(default_factory=list)
    """(worker_id, task_id, reason)."""
    grants: list[tuple[str, int]] = field(default_factory=list)
    """(worker_id, version) apply grants to send."""
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    lost_workers: list[tuple[str, bytes]] = field(default_factory=list)
    """(worker_id, identity) of workers declared dead or gone (control replies from them will not come)."""
    held_requests: list[str] = field(default_factory=list)
    """Workers whose held digest disagreed: ask each for its full held list (`BrokerHeartbeat.send_held`)."""

    def clear(self) -> None:
        self.cancels.clear()
        self.grants.clear()
        self.events.clear()
        self.lost_workers.clear()
        self.held_requests.clear()

    def __bool__(self) -> bool:
        return bool(self.cancels or self.grants or self.events or self.lost_workers or self.held_requests)


_COUNTERS = (
    "dispatched",
    "completed",
    "requeued",
    "duplicates",
    "failed",
    "dropped_stale",
    "cancelled",
    "submitted",
    "rejected",
    "acked",
    "redelivered",
    "workers_joined",
    "workers_lost",
    "leases_expired",
    "adopted",
    "orphans_dropped",
    "invalid_results",
    "unknown_results",
    "heartbeats",
    "held_checks",
    "held_mismatches",
    "held_lists",
    "leases_unreported",
    "held_unknown",
    "results_resent",
    "leases_reconciled",
    "credit_corrections",
    "rebases",
    "broker_stalls",
    "broker_stall_ms_total",
    "broker_stall_ms_max",
    "apply_slots_expired",
    "grants_resent",
    "versions_failed",
    "versions_skipped",
    # version-aware dispatch, early cancellation, wasted work
    "fresh_holds",
    "fresh_holds_expired",
    "fresh_dispatched",
    "doomed_cancelled",
    "generated_tokens",
    "wasted_tokens_stale_drop",
    "wasted_tokens_cancel",
    "wasted_tokens_failure",
    "wasted_tokens_duplicate",
    # the versioned-service contract: exact versions, convergence, fleet activation
    "exact_rejected",
    "exact_failed",
    "exact_off_version",
    # named policies (Prompt.policy)
    "policy_rejected",
    "policy_failed",
    "policy_off",
    "versions_converged",
    "fleet_activations",
    "fleet_deadline_activations",
    "fleet_holdouts",
    # the replay of redelivered episodes
    "replay_turns_kept",
    "replay_turns_refused",
    "replay_turns_ignored",
    "replay_turns_sent",
    "tokens_regenerated",
)

WASTE_REASONS = ("stale_drop", "cancel", "failure", "duplicate")
"""Why generated tokens never reached training (`wasted_tokens_{reason}` counters)."""


class BrokerState:
    """The whole broker state; the asyncio service around it only moves bytes."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.staleness = StalenessController(batch_size=config.batch_size, eta=config.max_staleness)
        self.version = -1
        """Newest weight version the trainer announced (-1: none)."""
        self.version_epoch = 0
        """Moves on at each rebase (`rebase`; 0: never rebased)."""
        self._rebases: deque[tuple[int, int]] = deque(maxlen=64)
        """(version_epoch, version) of the recent rebases, oldest first."""
        self.groups: dict[str, Group] = {}
        self.workers: dict[str, WorkerInfo] = {}
        self.effects = Effects()
        self.counters: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self.required_fingerprint = ""
        # queue: one heap per group size, entries (-priority, seq, token, group)
        self._queues: dict[int, list[tuple[int, int, int, Group]]] = {}
        self._sizes: list[int] = []
        self._exempt_queues: dict[int, list[tuple[int, int, int, Group]]] = {}
        self._exempt_sizes: list[int] = []
        self._seq = 0
        self.queued = 0
        self.parked = 0
        """Adopted groups that lost their lease before their prompt was resubmitted."""
        self.leased = 0
        self.held = 0
        """Terminal groups not yet acknowledged."""
        self._ready: dict[str, WorkerInfo] = {}
        """Workers that may take work now (credit, ready, not applying, fingerprint ok) on the newest version."""
        self._ready_behind: dict[str, WorkerInfo] = {}
        """Likewise, but behind the newest version and within eta of it (served after `_ready`)."""
        self.latency = LatencyLog(config.latency_samples)
        """Broker-side timestamps of the groups delivered (queued, dispatched, result in, delivered)."""
        self._deadlines: dict[str, tuple[float, Group]] = {}
        """Leases by task id -> (deadline, group), in the order they were made, which is deadline order (every
        lease gets the same `task_timeout_s`; a stall moves them all alike). An entry leaves when its lease
        ends, so a finished group is not kept alive here until its deadline, nor freed with a thousand others
        in one go (a deque of every lease, filtered once per thousand, was 4 us per round trip at 2,600/s)."""
        self._results: deque[Group] = deque()
        """Terminal groups not yet handed to a client, in completion order."""
        self._delivered: dict[str, dict[str, Group]] = {}
        self._forgotten: set[str] = set()
        self._orphans: dict[str, float] = {}
        """Groups adopted from a worker's hello whose prompt was not resubmitted yet: prompt id -> adopted at."""
        self._forgotten_order: deque[str] = deque()
        self._applying: set[str] = set()
        self._apply_since: dict[str, float] = {}
        """worker_id -> when its apply slot was granted (`apply_slot_deadline_s` counts from it)."""
        self._now = 0.0
        """The newest time a caller passed in (apply slots granted without a time of their own take it)."""
        self._apply_waiting: dict[str, int] = {}
        """Workers waiting for an apply slot -> version, in request order."""
        # version-aware dispatch: the capacity the last bump opened, held for workers on it
        self._hold_reserved = 0
        """Samples of admission capacity only a worker at `_hold_version` or newer may take (0: no hold)."""
        self._hold_version = -1
        self._hold_until = 0.0
        self.trainer_bound = -1
        """The staleness above which the trainer will not train a group (`SetVersion.stale_bound`; -1: not
        stated, eta is used). Early cancellation and the result-time drop judge by it."""
        self._tokens_cancelled_seen: dict[str, int] = {}
        """Per worker: the cumulative `WorkerHeartbeat.tokens_cancelled` last counted."""
        self._exact: dict[int, list[tuple[int, int, int, Group]]] = {}
        """Queued groups that name an exact weight version: one heap per version (entries as in `_queues`)."""
        self.convergence = VersionConvergence()
        self._fleet = config.activation == "fleet"
        self.fleet_version = -1
        """Fleet activation: the newest version the fleet was told to switch to (-1: none yet in this version epoch)."""
        self._fleet_since: float | None = None
        """When the first worker staged a version above `fleet_version` (the stage deadline counts from it)."""
        self.fleet_rounds: deque[FleetRound] = deque(maxlen=64)
        self._skews_ms: deque[float] = deque(maxlen=256)
        self.replay_bytes = 0
        """Bytes of episode turns kept for every group together (`replay_max_bytes`)."""
        self.policy: str | None = None
        """The LoRA adapter (its name) the pool serves now, as the trainer announced it (`SetVersion.adapter`; None:
        none announced, the base model is served)."""
        self.policy_since = -1
        """The first version `policy` was published at (its tokens from there on are that policy's)."""
        self.policy_base = ""
        """The base model `policy` applies to (`AdapterSpec.base_model`), for refusals that name it."""
        self._policies: list[tuple[int, str]] = []
        """(first version, adapter name) of the policies announced, ascending, the newest `_POLICY_HISTORY`."""
        self._named: dict[str, Group] = {}
        """Live groups whose prompt names a policy (a policy change fails the queued ones naming another)."""

    # ------------------------------------------------------------------ workers

    def add_worker(
        self,
        *,
        worker_id: str,
        identity: bytes,
        capacity: int,
        credits: int,
        now: float,
        version: int = -1,
        inflight: Sequence[InflightTask] = (),
        fingerprint: str = "",
        engine: str = "",
        apply_modes: tuple[str, ...] = (),
        host: str = "",
        pid: int = 0,
        features: Iterable[str] = (),
        version_epoch: int = 0,
    ) -> tuple[list[str], list[str]]:
        """A worker said hello; returns (adopted task ids, refused task ids).

        A known worker id saying hello again (it reconnected, or saw a new
        epoch) keeps the leases it re-announces; leases it no longer names are
        requeued. A re-announced task unknown to this broker (a broker restart)
        is adopted as LEASED to the worker; one whose prompt was resubmitted and
        is still queued merges with it; one already done or leased elsewhere is refused.
        """
        announced = {t.task_id: t for t in inflight}
        old = self.workers.get(worker_id)
        if old is not None:
            for tid, g in list(old.leases.items()):
                if tid not in announced:
                    self._end_lease(g, old)
                    self._requeue(g, now, reason="worker_restarted")
            self._unready(worker_id)
            self._release_apply(worker_id)
            w = old
            w.identity = identity
            w.capacity = capacity
            if (old.host, old.pid) != (host, pid):  # another process under this id: it will try every version afresh
                w.skipped_version, w.skipped_error = -1, ""
        else:
            w = WorkerInfo(worker_id=worker_id, identity=identity, capacity=capacity, credits=0, last_seen=now, joined_at=now)
            self.workers[worker_id] = w
            self.counters["workers_joined"] += 1
            self.effects.events.append(("worker_joined", {"worker_id": worker_id, "host": host, "engine": engine}))
        w.credits = max(0, min(credits, capacity, self.config.max_worker_credits))
        w.last_seen = now
        w.version = self._valid_version(version, version_epoch)
        w.version_epoch = version_epoch
        w.fingerprint = fingerprint
        w.engine = engine
        w.apply_modes = apply_modes
        w.host = host
        w.pid = pid
        w.state = WorkerState.READY
        w.applying = False
        w.features = frozenset(features)
        w.digest = 0
        if Feature.HELD_DIGEST in w.features:
            for tid in w.leases:
                w.digest ^= task_digest(tid)
        w.reported_seq = w.reported_free = w.reported_held = -1
        adopted: list[str] = []
        refused: list[str] = []
        for t in inflight:
            if self._adopt(w, t, now):
                adopted.append(t.task_id)
            else:
                refused.append(t.task_id)
        self._refresh(w)
        self._version_moved(w, now)
        return adopted, refused

    def _adopt(self, w: WorkerInfo, t: InflightTask, now: float) -> bool:
        g = self.groups.get(t.prompt_id)
        if g is None:
            if t.prompt_id in self._forgotten or not 1 <= t.group_size <= self.config.max_group_size:
                return False
            g = Group(prompt_id=t.prompt_id, prompt=None, size=t.group_size, priority=0, seq=self._next_seq(), queued_at=now)
            g.phase = Phase.QUEUED
            self.groups[t.prompt_id] = g
            self._orphans[t.prompt_id] = now
            self.parked += 1  # counted as parked until leased below
            self._lease(g, w, now, attempt=t.attempt, task_id=t.task_id, adopting=True)
            self.counters["adopted"] += 1
            return True
        if g.phase == Phase.LEASED:
            return g.worker_id == w.worker_id and g.task_id == t.task_id and t.task_id in w.leases
        if g.phase != Phase.QUEUED or g.size != t.group_size:
            return False
        # the prompt was resubmitted and waits in the queue (or is parked): merge
        if g.prompt is None:
            self.parked -= 1
        else:
            self.queued -= 1
        self.parked += 1  # _lease takes it from `parked` when adopting
        self._lease(g, w, now, attempt=max(g.attempt, t.attempt), task_id=t.task_id, adopting=True)
        self.counters["adopted"] += 1
        return True

    def remove_worker(self, worker_id: str, now: float, reason: str) -> list[str]:
        """The worker left (goodbye) or was declared dead; its groups return to the queue."""
        self._now = max(self._now, now)
        w = self.workers.pop(worker_id, None)
        if w is None:
            return []
        self._unready(worker_id)
        requeued: list[str] = []
        for g in list(w.leases.values()):
            self._end_lease(g, w)
            self._requeue(g, now, reason=f"worker {worker_id} {reason}", counted=reason != "goodbye")
            requeued.append(g.prompt_id)
        self._release_apply(worker_id)
        self.effects.lost_workers.append((worker_id, w.identity))
        if reason != "goodbye":
            self.counters["workers_lost"] += 1
        self.effects.events.append(("worker_lost", {"worker_id": worker_id, "reason": reason, "requeued": len(requeued)}))
        for r in self.fleet_rounds:
            if worker_id in r.workers and worker_id not in r.done_at:
                r.failed.add(worker_id)
        self.convergence.lost(worker_id)
        self._versions_changed(now)
        return requeued

    def touch(self, w: WorkerInfo, now: float) -> None:
        w.last_seen = now

    def heartbeat(
        self,
        w: WorkerInfo,
        now: float,
        *,
        version: int,
        state: str,
        tokens_total: int,
        dispatch_seq: int = -1,
        free_capacity: int = -1,
        held_count: int = -1,
        held_digest: int = 0,
        held: Sequence[str] | None = None,
        version_epoch: int = 0,
    ) -> None:
        """A heartbeat: liveness, version and state; with minor-1 fields, what the worker holds.

        `held` is the worker's complete held list (`WorkerHeartbeat.held_full`), else None.
        Only leases at or below the echoed `dispatch_seq` are compared: a task sent after it
        may still be on its way, so a heartbeat that crosses a dispatch is never a mismatch.
        """
        w.last_seen = now
        w.tokens_total = tokens_total
        self.counters["heartbeats"] += 1
        if self.version_epoch and version_epoch != w.version_epoch:
            # the pool was rebased: versions are compared within one version epoch only
            w.version_epoch = version_epoch
            w.version = self._valid_version(version, version_epoch)
            w.state = state
            self._refresh(w)
            self._version_moved(w, now)
        elif version != w.version or state != w.state:
            before = w.version
            w.version = max(w.version, self._valid_version(version, version_epoch) if self.version_epoch else version)
            w.state = state
            self._refresh(w)
            if w.version != before:
                self._version_moved(w, now, before)
        if dispatch_seq < 0:
            return
        w.reported_seq = dispatch_seq
        w.reported_free = free_capacity
        w.reported_held = held_count
        reconcile = Feature.RECONCILE in w.features
        if held is not None:
            self._compare_held(w, dispatch_seq, held, now, act=reconcile)
        elif held_count >= 0 and Feature.HELD_DIGEST in w.features:
            self.counters["held_checks"] += 1
            count, digest = len(w.leases), w.digest
            for tid, g in reversed(w.leases.items()):  # newest first: the ones sent after the echo
                if g.dispatch_seq <= dispatch_seq:
                    break
                count -= 1
                digest ^= task_digest(tid)
            if (count, digest) != (held_count, held_digest):
                w.held_mismatches += 1
                self.counters["held_mismatches"] += 1
                self.effects.held_requests.append(w.worker_id)
        if not reconcile:
            return  # an older worker's heartbeat is recorded, not acted on (its fields may be partial)
        self._reconcile_unechoed(w, dispatch_seq, now)
        if free_capacity >= 0:
            self._correct_credit(w, dispatch_seq, free_capacity)

    def _reconcile_unechoed(self, w: WorkerInfo, dispatch_seq: int, now: float) -> None:
        """A task above the echo still not echoed `2 x heartbeat_interval_s` after dispatch never reached the
        worker (one connection keeps order: a heartbeat written after the task arrived echoes it): requeued
        at once, burning no attempt. The due time moves on with a broker stall (`note_stall`): heartbeats
        that queued up while the broker was not reading may predate the task's arrival."""
        lost = []
        for g in reversed(w.leases.values()):  # newest first: the ones above the echo
            if g.dispatch_seq <= dispatch_seq:
                break
            if now > g.echo_due:
                lost.append(g)
        for g in lost:
            self._reconciled(w, g, now, why="not echoed")

    def _reconciled(self, w: WorkerInfo, g: Group, now: float, why: str) -> None:
        tid = g.task_id
        self._end_lease(g, w)
        self._requeue(g, now, reason=f"lease reconciled: {why}", counted=False)
        self.counters["leases_reconciled"] += 1
        self.effects.events.append(("lease_reconciled", {"worker_id": w.worker_id, "task_id": tid, "why": why}))

    def _compare_held(self, w: WorkerInfo, dispatch_seq: int, held: Sequence[str], now: float, act: bool) -> None:
        self.counters["held_lists"] += 1
        listed = set(held)
        w.unreported = tuple(tid for tid, g in w.leases.items() if g.dispatch_seq <= dispatch_seq and tid not in listed)
        unknown = sum(1 for tid in listed if tid not in w.leases)
        self.counters["leases_unreported"] += len(w.unreported)
        self.counters["held_unknown"] += unknown
        if w.unreported or unknown:
            self.effects.events.append(
                ("held_disagrees", {"worker_id": w.worker_id, "unreported": len(w.unreported), "unknown": unknown, "dispatch_seq": dispatch_seq})
            )
        if not act:
            return  # recorded only (a worker without Feature.RECONCILE)
        # a lease at or below the echo that the worker does not hold was lost on the wire (the Task,
        # or its Result): requeued at once, burning no attempt (the loss was not the group's fault)
        for tid in w.unreported:
            g = w.leases.get(tid)
            if g is not None:
                self._reconciled(w, g, now, why="not held")

    def _correct_credit(self, w: WorkerInfo, dispatch_seq: int, free_capacity: int) -> None:
        """Credit is absolute: the free capacity the worker reports less what was dispatched after its echo."""
        after = 0
        for g in reversed(w.leases.values()):  # newest first: the ones sent after the echo
            if g.dispatch_seq <= dispatch_seq:
                break
            after += g.size
        credits = max(0, min(free_capacity - after, w.capacity, self.config.max_worker_credits))
        if credits != w.credits:
            self.counters["credit_corrections"] += 1
            w.credits = credits
            self._refresh(w)

    def credit(self, w: WorkerInfo, n: int, now: float) -> None:
        w.last_seen = now
        if n > 0:
            w.credits = min(w.credits + n, w.capacity, self.config.max_worker_credits)
            if w.credits > 0 and w.worker_id not in self._ready and w.worker_id not in self._ready_behind:
                self._refresh(w)

    def set_required_fingerprint(self, fingerprint: str) -> None:
        self.required_fingerprint = fingerprint
        for w in self.workers.values():
            self._refresh(w)

    def _dispatchable(self, w: WorkerInfo) -> bool:
        w.held_out = self._fleet and not w.applying and w.version < self.fleet_version
        return (
            w.credits > 0
            and not w.applying
            and not w.held_out
            and w.state == WorkerState.READY
            and (not self.required_fingerprint or not w.fingerprint or w.fingerprint == self.required_fingerprint)
        )

    def _refresh(self, w: WorkerInfo) -> None:
        wid = w.worker_id
        if not self._dispatchable(w):
            self._unready(wid)
            return
        v = self.version
        if w.version >= v:
            self._ready_behind.pop(wid, None)
            if wid not in self._ready:
                self._ready[wid] = w
            return
        self._ready.pop(wid, None)
        eta = self.config.max_staleness
        if eta is None or w.version >= v - eta:
            if wid not in self._ready_behind:
                self._ready_behind[wid] = w
        else:
            self._ready_behind.pop(wid, None)  # more than eta behind: gets nothing

    def _unready(self, worker_id: str) -> None:
        self._ready.pop(worker_id, None)
        self._ready_behind.pop(worker_id, None)

    # ------------------------------------------------------------------ submit and queue

    def submit(self, prompts: Iterable[Prompt], now: float, *, stopping: bool = False) -> tuple[list[str], list[Rejection]]:
        accepted: list[str] = []
        rejected: list[Rejection] = []
        cfg = self.config
        for p in prompts:
            pid = p.prompt_id
            reason = detail = ""
            if stopping:
                reason, detail = "stopping", "the broker is shutting down"
            elif not pid or not isinstance(pid, str):
                reason, detail = "invalid", "prompt_id must be a non-empty string"
            elif p.group_size < 1:
                reason, detail = "invalid", f"group_size must be >= 1, got {p.group_size}"
            elif p.group_size > cfg.max_group_size:
                reason, detail = "group_too_large", f"group_size {p.group_size} > max_group_size {cfg.max_group_size}"
            elif p.input_ids is None and p.text is None:
                reason, detail = "invalid", "a prompt needs input_ids or text"
            elif pid in self._forgotten:
                reason, detail = "duplicate", "this prompt id was already delivered"
            elif refused := self._serving_refusal(p):
                reason, detail = refused
            else:
                g = self.groups.get(pid)
                if g is not None:
                    if g.prompt is None and g.size == p.group_size:
                        self._merge_resubmitted(g, p)
                        accepted.append(pid)
                        continue
                    reason, detail = "duplicate", f"prompt id is live ({g.phase})"
                elif self.queued + self.parked >= cfg.max_queued:
                    reason, detail = "queue_full", f"{self.queued} groups queued (max_queued {cfg.max_queued})"
            if reason:
                rejected.append(Rejection(prompt_id=pid if isinstance(pid, str) else "", reason=reason, detail=detail))
                continue
            g = self._new_group(p, now)
            self.queued += 1
            self._push(g)
            accepted.append(pid)
        self.counters["submitted"] += len(accepted)
        self.counters["rejected"] += len(rejected)
        return accepted, rejected

    def _new_group(self, p: Prompt, now: float) -> Group:
        g = Group(prompt_id=p.prompt_id, prompt=p, size=p.group_size, priority=p.priority, seq=self._next_seq(), queued_at=now,
                  exempt=p.exempt_from_staleness, min_version=self._min_version(p), exact_version=p.exact_weight_version)
        self.groups[p.prompt_id] = g
        if p.policy is not None:
            self._named[p.prompt_id] = g
        return g

    def _serving_refusal(self, p: Prompt) -> tuple[str, str] | None:
        """(reason, detail) when the pool cannot serve the exact version or the policy `p` names; None when it can."""
        if p.exact_weight_version != -1 and (why := self._exact_refusal(p)):
            self.counters["exact_rejected"] += 1
            return "exact_version_unavailable", why
        if p.policy is not None and (why := self._policy_refusal(p)):
            self.counters["policy_rejected"] += 1
            return "policy_unavailable", why
        return None

    def _merge_resubmitted(self, g: Group, p: Prompt) -> None:
        """A resubmitted prompt meets the task a worker re-announced: one group, first result wins."""
        self._orphans.pop(g.prompt_id, None)
        g.prompt = p
        g.priority = p.priority
        g.min_version = self._min_version(p)
        g.exact_version = p.exact_weight_version
        if p.policy is not None:
            self._named[g.prompt_id] = g
        if g.phase == Phase.QUEUED:  # parked: its adopted lease ended before the prompt came back
            self.parked -= 1
            self.queued += 1
            self._push(g)
        elif g.phase in Phase.TERMINAL and g.result is not None and g.delivered_to is None:
            # finished while waiting for its prompt: becomes deliverable now
            g.result = _with_metadata(g.result, p)
            self._results.append(g)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _push(self, g: Group) -> None:
        g.token += 1
        if g.exact_version >= 0:
            # its own lane per version: only a worker at that version looks at it, nobody else skips past it
            heapq.heappush(self._exact.setdefault(g.exact_version, []), (-g.priority, g.seq, g.token, g))
            return
        queues = self._exempt_queues if g.exempt else self._queues
        heap = queues.get(g.size)
        if heap is None:
            heap = queues[g.size] = []
            if g.exempt:
                self._exempt_sizes = sorted(queues)
            else:
                self._sizes = sorted(queues)
        heapq.heappush(heap, (-g.priority, g.seq, g.token, g))

    def _pop_fitting(self, limit: int, exempt_limit: int | None = None, version: int | None = None) -> Group | None:
        """The first group (priority, then submission order) of at most `limit` samples.

        Groups exempt from staleness admission only need to fit `exempt_limit` (the worker's credit).
        With `version`, the groups that name exactly that weight version compete too (the head of
        their lane only: a head too large for this worker waits for a roomier one at that version).
        """
        best: list[tuple[int, int, int, Group]] | None = None
        best_key: tuple[int, int] = (0, 0)
        lanes = ((self._queues, self._sizes, limit), (self._exempt_queues, self._exempt_sizes, limit if exempt_limit is None else exempt_limit))
        for queues, sizes, lane_limit in lanes:
            for size in sizes:
                if size > lane_limit:
                    break
                heap = queues[size]
                while heap:
                    _, _, token, g = head = heap[0]
                    if g.phase == Phase.QUEUED and token == g.token:
                        break
                    heapq.heappop(heap)
                else:
                    continue
                key = (head[0], head[1])
                if best is None or key < best_key:
                    best, best_key = heap, key
        exact = self._exact.get(version) if version is not None and version >= 0 else None
        if exact:
            while exact and not (exact[0][3].phase == Phase.QUEUED and exact[0][2] == exact[0][3].token):
                heapq.heappop(exact)
            if exact:
                head = exact[0]
                g = head[3]
                fits = g.size <= (limit if not g.exempt or exempt_limit is None else exempt_limit)
                if fits and (best is None or (head[0], head[1]) < best_key):
                    best = exact
            else:
                del self._exact[version]  # type: ignore[arg-type]
        if best is None:
            return None
        return heapq.heappop(best)[3]

    # ------------------------------------------------------------------ dispatch

    def has_work(self) -> bool:
        return self.queued > 0 and bool(self._ready or self._ready_behind)

    def dispatch(self, now: float) -> list[tuple[WorkerInfo, Group]]:
        """Lease queued groups to ready workers; returns (worker, group) pairs to send as tasks.

        Workers with the newest weights are served first; a worker more than
        eta versions behind gets nothing. When the admission window is closed to
        every queued group, nothing is visited (no scan of all ready workers per
        message while the staleness bound holds dispatch back).
        """
        out: list[tuple[WorkerInfo, Group]] = []
        if self._hold_reserved:
            self._check_hold(now)
        if not self.queued or not (self._ready or self._ready_behind):
            return out
        cap = self.staleness.capacity()
        if cap is not None and self._hold_reserved and not self._ready:
            cap -= self._hold_reserved  # only workers behind are ready: the held capacity waits for a fresh one
        if cap is not None and not self._exempt_sizes and not self._exact and (not self._sizes or cap < self._sizes[0]):
            return out
        for ready in (self._ready, self._ready_behind):
            served: list[WorkerInfo] = []
            for w in ready.values():
                if self._fill(w, now, out):
                    served.append(w)
                if not self.queued:
                    break
            for w in served:
                # round robin: a served worker goes to the back of the ready order
                ready.pop(w.worker_id, None)
                if w.credits > 0:
                    ready[w.worker_id] = w
            if not self.queued:
                break
        return out

    def _fill(self, w: WorkerInfo, now: float, out: list[tuple[WorkerInfo, Group]]) -> bool:
        served = False
        room = self.config.max_held - self.leased - self.held
        too_new: list[Group] = []
        behind_hold = self._hold_reserved > 0 and w.version < self._hold_version
        while w.credits > 0 and self.queued and room > 0:
            limit = w.credits
            cap = self.staleness.capacity()
            if cap is not None and behind_hold:
                cap = max(0, cap - self._hold_reserved)  # version-aware dispatch: not the capacity held for fresh workers
            if cap is not None and cap < limit:
                limit = cap
            g = self._pop_fitting(limit, w.credits, w.version if self._exact else None)
            if g is None:
                break
            if g.min_version > w.version or (g.prompt is not None and g.prompt.images and Feature.IMAGES not in w.features):
                # asks for newer weights than this worker has, or shows images it would drop: skipped for it,
                # not blocking the queue
                too_new.append(g)
                if len(too_new) >= _MAX_SKIPPED_PER_FILL:
                    break
                continue
            self.queued -= 1
            self._lease(g, w, now, attempt=g.attempt, task_id=task_id_of(g.prompt_id, g.attempt))
            if self._hold_reserved and not g.exempt and not behind_hold:
                self._hold_reserved = max(0, self._hold_reserved - g.size)
                self.counters["fresh_dispatched"] += 1
            out.append((w, g))
            served = True
            room -= 1
        for g in too_new:
            self._push(g)  # same priority and sequence number: its place in the queue is kept
        return served

    def _lease(self, g: Group, w: WorkerInfo, now: float, *, attempt: int, task_id: str, adopting: bool = False) -> None:
        if adopting:
            self.parked -= 1
        else:
            w.credits -= g.size
        g.phase = Phase.LEASED
        g.attempt = attempt
        g.worker_id = w.worker_id
        g.last_worker = w.worker_id
        g.task_id = task_id
        g.deadline = now + self.config.task_timeout_s
        if adopting:
            g.dispatch_seq = 0
        else:
            w.dispatch_seq += 1
            g.dispatch_seq = w.dispatch_seq
        g.dispatched_at = now
        g.echo_due = now + 2 * self.config.heartbeat_interval_s
        g.start_version = w.version
        g.turns_before = {i: len(per) for i, per in g.turns.items()} if g.turns else None
        w.leases[task_id] = g
        if Feature.HELD_DIGEST in w.features:
            g.digest = task_digest(task_id)  # kept for the lease's end: one hash per lease, not two
            w.digest ^= g.digest
        else:
            g.digest = -1
        self.leased += 1
        if not g.exempt:
            self.staleness.on_dispatch(g.size)
        self._deadlines.pop(task_id, None)  # (task ids are unique per attempt: never there; kept last if it were)
        self._deadlines[task_id] = (g.deadline, g)
        self.counters["dispatched"] += 1

    def _end_lease(self, g: Group, w: WorkerInfo | None) -> None:
        if w is None and g.worker_id is not None:
            w = self.workers.get(g.worker_id)
        entry = self._deadlines.get(g.task_id)
        if entry is not None and entry[1] is g:
            del self._deadlines[g.task_id]
        if w is not None and (held := w.leases.pop(g.task_id, None)) is not None and Feature.HELD_DIGEST in w.features:
            w.digest ^= held.digest if held is g and g.digest >= 0 else task_digest(g.task_id)
        g.worker_id = None
        self.leased -= 1
        if not g.exempt:
            self.staleness.on_requeue(g.size)

    def _requeue(self, g: Group, now: float, reason: str, exhausted: str = Phase.FAILED, counted: bool = True) -> None:
        """A lease ended without a result: back to the queue whole, or FAILED when attempts are used up.

        The attempt number always moves on (task ids stay unique); a hand-back
        (`counted=False`) does not use up one of the `max_attempts`.
        """
        g.attempt += 1
        if not counted:
            g.forgiven += 1
            if g.forgiven > self.config.max_handbacks:  # a worker that keeps handing one group back must not loop forever
                reason = f"{reason}; handed back {g.forgiven} times"
                self._terminal(g, exhausted, reason)
                self.effects.events.append(("task_failed", {"prompt_id": g.prompt_id, "reason": reason, "attempts": g.attempt}))
                return
        if g.attempt - g.forgiven >= self.config.max_attempts:
            self._terminal(g, exhausted, f"{reason}; gave up after {g.attempt} attempts")
            self.effects.events.append(("task_failed", {"prompt_id": g.prompt_id, "reason": reason, "attempts": g.attempt}))
            return
        g.phase = Phase.QUEUED
        self.counters["requeued"] += 1
        self.effects.events.append(("task_requeued", {"prompt_id": g.prompt_id, "reason": reason, "attempt": g.attempt}))
        if g.prompt is None:
            self.parked += 1  # adopted, prompt not resubmitted yet: wait for it
        else:
            self.queued += 1
            self._push(g)

    def _terminal(self, g: Group, phase: str, reason: str = "", trajectories: tuple[Trajectory, ...] = ()) -> None:
        g.phase = phase
        g.worker_id = None
        self._named.pop(g.prompt_id, None)
        self._forget_turns(g)
        metadata = g.prompt.metadata if g.prompt is not None else {}
        g.result = GroupResult(
            prompt_id=g.prompt_id,
            state=phase,
            trajectories=trajectories,
            reason=reason,
            attempts=g.attempt + (1 if phase == Phase.DONE else 0),
            worker_id=g.last_worker,
            metadata=metadata,
        )
        self.held += 1
        self.counters[phase if phase != Phase.DONE else "completed"] += 1
        if g.prompt is not None:
            self._results.append(g)

    # ------------------------------------------------------------------ results

    def result(
        self,
        w: WorkerInfo | None,
        *,
        task_id: str,
        prompt_id: str,
        trajectories: tuple[Trajectory, ...],
        error: str | None,
        retryable: bool,
        now: float,
    ) -> str:
        """A worker handed in a group (or an error for it). The first complete result wins."""
        if w is not None:
            w.last_seen = now
        tokens = _sampled_tokens(trajectories)
        self.counters["generated_tokens"] += tokens
        g = self.groups.get(prompt_id)
        if g is None:
            self.counters["wasted_tokens_duplicate"] += tokens  # nobody waits for it (delivered, or forgotten)
            if prompt_id in self._forgotten:
                self.counters["duplicates"] += 1
                return ResultOutcome.DUPLICATE
            self.counters["unknown_results"] += 1
            return ResultOutcome.UNKNOWN
        if g.phase in Phase.TERMINAL or g.phase != Phase.LEASED or g.task_id != task_id:
            # terminal already, or an earlier attempt (its worker was declared dead, its deadline
            # passed, or it was handed back): the group is someone else's now
            self.counters["duplicates"] += 1
            self.counters["wasted_tokens_duplicate"] += tokens
            return ResultOutcome.DUPLICATE
        g.result_at = now
        if error is None and not _complete(trajectories, prompt_id, g.size):
            self.counters["invalid_results"] += 1
            error, retryable = f"invalid result: expected {g.size} trajectories of {prompt_id}", True
        if error is not None:
            self.counters["wasted_tokens_failure"] += tokens
        self._end_lease(g, w)
        if error is not None:
            if retryable:
                self._requeue(g, now, reason=f"error: {error}")
                return ResultOutcome.REQUEUED if g.phase == Phase.QUEUED else ResultOutcome.FAILED
            self._terminal(g, Phase.FAILED, f"error: {error}")
            self.effects.events.append(("task_failed", {"prompt_id": prompt_id, "reason": error, "attempts": g.attempt + 1}))
            return ResultOutcome.FAILED
        outcome, trajectories = self._off_contract(g, trajectories, tokens, now)
        if outcome is not None:
            return outcome
        if (outcome := self._stale_output(g, trajectories, tokens, now)) is not None:
            return outcome
        if w is not None:
            w.completed += 1
            g.last_worker = w.worker_id
        if not g.exempt:
            self.staleness.accepted += g.size
        self._terminal(g, Phase.DONE, trajectories=trajectories)
        return ResultOutcome.ACCEPTED

    def _stale_output(self, g: Group, trajectories: tuple[Trajectory, ...], tokens: int, now: float) -> str | None:
        """With `cancel_stale_inflight`, output staler than the trainer's bound is dropped on arrival (None: kept)."""
        bound = self.cancel_bound()
        if self.config.cancel_stale_inflight and bound is not None and self.config.max_staleness is not None and self.version >= 0 and not g.exempt:
            oldest = min((int(sampled_versions(t.token_versions, t.loss_mask).min()) for t in trajectories if t.token_versions.size),
                         default=self.version)  # sampled tokens only, as the trainer judges it
            if oldest < self.version - bound:
                self.counters["wasted_tokens_stale_drop"] += tokens
                self._requeue(g, now, reason=f"stale output (version {oldest})", exhausted=Phase.DROPPED_STALE)
                return ResultOutcome.REQUEUED if g.phase == Phase.QUEUED else ResultOutcome.DROPPED_STALE
        return None

    def _off_exact(self, g: Group, trajectories: tuple[Trajectory, ...], tokens: int, now: float) -> str | None:
        """A result of an exact-version group served (partly) at another version (its worker applied a newer one
        mid-generation): handed back, not delivered; tried again on a worker still at the version, or failed at
        once when none is left. None: not an exact-version group, or every sampled token is of its version."""
        off = _off_version(trajectories, g.exact_version) if g.exact_version >= 0 else None
        if off is None:
            return None
        self.counters["exact_off_version"] += 1
        self.counters["wasted_tokens_failure"] += tokens
        self._requeue(g, now, reason=f"served at weight version {off}, not the exact version {g.exact_version}", counted=False)
        if g.phase == Phase.QUEUED:
            self._check_exact(now, only=g.exact_version)
        return ResultOutcome.REQUEUED if g.phase == Phase.QUEUED else ResultOutcome.FAILED

    def _off_contract(self, g: Group, trajectories: tuple[Trajectory, ...], tokens: int,
                      now: float) -> tuple[str | None, tuple[Trajectory, ...]]:
        """A result judged by its group's exact version and policy: (the outcome, ()) when it is not delivered, else (None,
        the trajectories to deliver)."""
        if (outcome := self._off_exact(g, trajectories, tokens, now)) is not None:
            return outcome, ()
        if g.prompt is not None and g.prompt.policy is not None:
            return self._off_policy(g, g.prompt.policy, trajectories, tokens, now)
        return None, trajectories

    def _off_policy(self, g: Group, policy: str, trajectories: tuple[Trajectory, ...], tokens: int,
                    now: float) -> tuple[str | None, tuple[Trajectory, ...]]:
        """A result of a group naming `policy` with a sampled token of a version that is another policy's: handed back
        while the pool still serves `policy` (tried again on a worker serving it), failed with the reason once it does
        not: (the outcome, ()). (None, the trajectories saying `policy`): every sampled token is of `policy`'s versions."""
        off = next(((v, other) for t in trajectories for v in np.unique(sampled_versions(t.token_versions, t.loss_mask)).tolist()
                    if (other := self.policy_at(int(v))) != policy), None)
        if off is None:
            return None, tuple(dataclasses.replace(t, policy=policy) for t in trajectories)
        v, other = off
        self.counters["policy_off"] += 1
        self.counters["wasted_tokens_failure"] += tokens
        ran = f"a token of version {v}, which is {'the base model' if other is None else f'policy {other!r}'}"
        if policy == self.policy:
            self._requeue(g, now, reason=f"served partly under another policy than {policy!r} ({ran})", counted=False)
            return (ResultOutcome.REQUEUED if g.phase == Phase.QUEUED else ResultOutcome.FAILED), ()
        why = f"policy {policy!r} stopped being served while the group ran ({ran}); {self._served()}"
        self.counters["policy_failed"] += 1
        self._terminal(g, Phase.FAILED, f"policy_unavailable: {why}")
        self.effects.events.append(("task_failed", {"prompt_id": g.prompt_id, "reason": why, "attempts": g.attempt + 1}))
        return ResultOutcome.FAILED, ()

    # ------------------------------------------------------------------ named policies (LoRA adapters)

    def set_policy(self, name: str, since: int, base_model: str, now: float) -> None:
        """The trainer says the pool serves the LoRA adapter `name` from this version on, first published at `since`
        (`SetVersion.adapter`, `adapter_since`). A new name replaces the old one (one adapter is served at a time):
        queued groups naming another policy fail at once with the reason; leased ones are judged by their tokens."""
        since = since if since >= 0 else max(self.version, 0)
        if self._policies and self._policies[-1][1] == name and self._policies[-1][0] <= since:
            since = self._policies[-1][0]  # the same adapter trained on: its versions stay one policy
        else:
            while self._policies and self._policies[-1][0] >= since:
                self._policies.pop()
            self._policies.append((since, name))
            del self._policies[:-_POLICY_HISTORY]
        changed = name != self.policy
        self.policy, self.policy_since, self.policy_base = name, since, base_model
        if changed:
            self.effects.events.append(("policy_changed", {"policy": name, "since": since}))
            self._fail_named(lambda g: g.prompt is not None and g.prompt.policy != name,
                             lambda g: f"policy {g.prompt.policy if g.prompt else None!r} is no longer served: {self._served()}")

    def _fail_named(self, doomed: Callable[[Group], bool], why: Callable[[Group], str]) -> None:
        """Fail at once every queued group naming a policy that `doomed` picks, with the reason `why` gives."""
        for g in [g for g in self._named.values() if g.phase == Phase.QUEUED and doomed(g)]:
            reason = why(g)
            self.queued -= 1  # its queue entry is skipped once the group is terminal
            self.counters["policy_failed"] += 1
            self._terminal(g, Phase.FAILED, f"policy_unavailable: {reason}")
            self.effects.events.append(("task_failed", {"prompt_id": g.prompt_id, "reason": reason, "attempts": g.attempt}))

    def _check_policy_reachable(self) -> None:
        """Fail the queued groups of the served policy when every live worker gave up the newest version while below the
        version the policy began at (its adapter was refused everywhere): none will ever take them."""
        since = self.policy_since
        if not self.workers or not all(w.version < since and w.skipped_version >= max(since, self.version) for w in self.workers.values()):
            return
        errors = "; ".join(f"{w.worker_id}: {w.skipped_error or 'no reason given'}" for w in list(self.workers.values())[:4])
        self._fail_named(lambda g: g.prompt is not None and g.prompt.policy == self.policy,
                         lambda g: f"policy {self.policy!r} (since version {since}) was given up by every live worker ({errors})")

    def _policies_rebased(self, version: int) -> None:
        """A rebase to `version` abandons the policies first published above it: the one on at `version` is served."""
        if not self._policies or self._policies[-1][0] <= version:
            return
        while self._policies and self._policies[-1][0] > version:
            self._policies.pop()
        self.policy, self.policy_since = (self._policies[-1][1], self._policies[-1][0]) if self._policies else (None, -1)
        self._fail_named(lambda g: g.prompt is not None and g.prompt.policy != self.policy,
                         lambda g: f"policy {g.prompt.policy if g.prompt else None!r} is no longer served after the rebase to "
                                   f"version {version}: {self._served()}")

    def policy_at(self, version: int) -> str | None:
        """The policy (adapter name) tokens of weight `version` were made under (None: the base model, no adapter)."""
        i = bisect.bisect_right(self._policies, version, key=lambda e: e[0])
        return self._policies[i - 1][1] if i else None

    def _served(self) -> str:
        if self.policy is None:
            return "the pool serves its base model (no LoRA adapter was announced to it)"
        if not self.policy:
            return (f"the pool serves an unnamed LoRA adapter (since version {self.policy_since}; the trainer names it with "
                    "AdapterSpec.name)")
        return f"the pool serves policy {self.policy!r} (a LoRA adapter, since version {self.policy_since})"

    def _policy_refusal(self, p: Prompt) -> str:
        """Why a prompt naming a policy cannot be accepted now ("" when it can)."""
        name = p.policy
        if not isinstance(name, str) or not name:
            return f"policy must be an adapter's name or None (whatever the pool serves), got {name!r}"
        if name == self.policy:
            v = p.exact_weight_version
            if v >= 0 and (at := self.policy_at(v) if v <= self.version else self.policy) != name:
                return f"exact_weight_version {v} is {'the base model' if at is None else f'policy {at!r}'}, not policy {name!r}"
            return ""
        if self.policy is not None and name == self.policy_base:
            return (f"policy {name!r} is the base model that adapter {self.policy!r} applies to, and every version since "
                    f"{self.policy_since} serves it with the adapter on (a whole-model version leaves it on); "
                    f"leave Prompt.policy None, or name {self.policy!r}")
        return f"policy {name!r} is not served: {self._served()}"

    def _min_version(self, p: Prompt) -> int:
        """The version a worker needs to take `p`: its own minimum, and for a named policy the one it began at."""
        if p.policy is not None and p.policy == self.policy:
            return max(p.min_weight_version, self.policy_since)
        return p.min_weight_version

    # ------------------------------------------------------------------ episode turns (replay)

    def record_turns(self, w: WorkerInfo | None, task_id: str, prompt_id: str, turns: Sequence[RecordedTurn], now: float) -> int:
        """Keep finished episode turns of the lease `task_id` (see the module docstring); returns how many were kept.

        A turn from any lease but the group's current one (an earlier attempt, a worker declared dead, a group
        already done) is ignored; so is one that would leave a gap in its episode's turns."""
        g = self.groups.get(prompt_id)
        if w is not None:
            w.last_seen = now
        if g is None or g.phase != Phase.LEASED or g.task_id != task_id or w is None or g.worker_id != w.worker_id:
            self.counters["replay_turns_ignored"] += len(turns)
            return 0
        return sum(self._keep_turn(g, t) for t in turns)

    def _keep_turn(self, g: Group, t: RecordedTurn) -> bool:
        if g.turns is None:
            g.turns = {}
        if not 0 <= t.sample_index < g.size:
            self.counters["replay_turns_ignored"] += 1
            return False
        per = g.turns.setdefault(t.sample_index, [])
        if g.turns_before is not None and t.turn < g.turns_before.get(t.sample_index, 0):
            # an earlier attempt had finished this turn: sampled again (its request differed, or the worker does not replay)
            self.counters["tokens_regenerated"] += len(t.output_ids)
        if t.turn < len(per):
            freed = sum(_turn_bytes(old) for old in per[t.turn:])
            del per[t.turn:]  # the turns after it followed from the old one
            g.turn_bytes -= freed
            self.replay_bytes -= freed
        elif t.turn > len(per):  # an earlier turn was not kept (a bound, a message lost): the record has a gap
            self.counters["replay_turns_refused"] += 1
            return False
        size = _turn_bytes(t)
        if g.turn_bytes + size > self.config.replay_max_group_bytes or self.replay_bytes + size > self.config.replay_max_bytes:
            self.counters["replay_turns_refused"] += 1
            return False
        # a turn of attempt 0 (every first attempt; a worker sends 0) is kept as it came: a copy per turn was 7% of
        # the broker's CPU in an episode run
        per.append(t if t.attempt == g.attempt else dataclasses.replace(t, attempt=g.attempt))
        g.turn_bytes += size
        self.replay_bytes += size
        self.counters["replay_turns_kept"] += 1
        return True

    def replay_for(self, g: Group) -> tuple[RecordedTurn, ...]:
        """The turns kept for `g`, to send with its task (episode by episode, in turn order); counted as sent."""
        if not g.turns:
            return ()
        out = tuple(t for i in sorted(g.turns) for t in g.turns[i])
        self.counters["replay_turns_sent"] += len(out)
        oldest = min((int(t.token_versions.min()) for t in out if t.token_versions.size), default=g.start_version)
        if 0 <= oldest < g.start_version:
            g.start_version = oldest  # served turns keep their versions: early cancellation judges the lease by the oldest
        return out

    def _forget_turns(self, g: Group) -> None:
        if g.turns is not None:
            self.replay_bytes -= g.turn_bytes
            g.turns, g.turn_bytes, g.turns_before = None, 0, None

    def nack(self, w: WorkerInfo, task_ids: Iterable[str], now: float, reason: str) -> list[str]:
        """The worker hands tasks back: requeued now, attempt + 1."""
        w.last_seen = now
        out: list[str] = []
        for tid in task_ids:
            g = w.leases.get(tid)
            if g is None:
                continue
            self._end_lease(g, w)
            self._requeue(g, now, reason=f"nack: {reason}" if reason else "nack", counted=False)
            out.append(g.prompt_id)
        return out

    # ------------------------------------------------------------------ time

    def note_stall(self, stall_s: float, now: float) -> None:
        """The broker read nothing for `stall_s` (GC, SIGSTOP, a slow disk): that time is not worker silence.

        Every worker's silence, every lease deadline and every apply slot's age is moved
        on by the stall, so the stall alone declares nobody dead, requeues nothing and
        burns no attempt; liveness is judged on heartbeats read, not on time passed
        while not reading.
        """
        if stall_s <= 0:
            return
        for w in self.workers.values():
            w.last_seen = min(now, w.last_seen + stall_s)
        for g in self.groups.values():
            if g.phase == Phase.LEASED:
                g.deadline += stall_s
                g.echo_due += stall_s
        self._deadlines = {tid: (d + stall_s, g) for tid, (d, g) in self._deadlines.items()}
        for wid in self._apply_since:
            self._apply_since[wid] += stall_s
        ms = int(stall_s * 1000)
        self.counters["broker_stalls"] += 1
        self.counters["broker_stall_ms_total"] += ms
        self.counters["broker_stall_ms_max"] = max(self.counters["broker_stall_ms_max"], ms)
        self.effects.events.append(("broker_stall", {"stall_s": round(stall_s, 3)}))

    def expire(self, now: float) -> tuple[list[str], list[str]]:
        """Declare silent workers dead and end overdue leases; returns (dead worker ids, requeued prompt ids)."""
        dead = [wid for wid, w in self.workers.items() if now - w.last_seen > self.config.dead_after_s]
        requeued: list[str] = []
        for wid in dead:
            requeued += self.remove_worker(wid, now, reason="dead")
        dl = self._deadlines
        while dl:
            tid = next(iter(dl))  # the oldest lease: the earliest deadline
            d, g = dl[tid]
            if d > now:
                break
            del dl[tid]
            if g.phase == Phase.LEASED and g.task_id == tid:
                holder = g.worker_id
                self._end_lease(g, None)
                self.counters["leases_expired"] += 1
                if holder is not None:
                    self.effects.cancels.append((holder, tid, "deadline"))
                self._requeue(g, now, reason="deadline passed")
                requeued.append(g.prompt_id)
        self._expire_orphans(now)
        self._expire_apply_slots(now)
        if self._fleet_since is not None:
            self._fleet_check(now)
        if requeued and self._exact:
            self._check_exact(now)  # a lease that ran out may have been the last chance at its version
        return dead, requeued

    def _expire_orphans(self, now: float) -> None:
        """Forget adopted groups whose prompt never came back within `orphan_ttl_s` (the trainer that sent it is gone).

        A group still leased is left to its worker (its result, if the prompt
        never comes, is held until the next look); a parked one, or a finished
        one held for its prompt, is dropped: its id joins the dedup window, so
        a late result or resubmission of it is a duplicate, and the capacity it
        held is released.
        """
        ttl = self.config.orphan_ttl_s
        for pid, since in list(self._orphans.items()):
            if now - since < ttl:
                continue
            g = self.groups.get(pid)
            if g is None or g.prompt is not None:
                self._orphans.pop(pid, None)
                continue
            if g.phase == Phase.LEASED:
                continue
            del self._orphans[pid]
            if g.phase == Phase.QUEUED:
                self.parked -= 1
            else:  # terminal, held for its prompt
                self.held -= 1
                if g.result is not None:
                    self._waste("failure", g.result.trajectories)
                if g.phase == Phase.DONE and not g.exempt:
                    self.staleness.on_drop(g.size)
            self._forget_turns(g)
            del self.groups[pid]
            self._remember(pid)
            self.counters["orphans_dropped"] += 1
            self.effects.events.append(("orphan_dropped", {"prompt_id": pid, "adopted_s_ago": round(now - since, 1)}))

    # ------------------------------------------------------------------ client side

    def pull(self, client_id: str, max_groups: int, now: float | None = None) -> list[GroupResult]:
        """Up to `max_groups` terminal groups for `client_id`; with `now`, each DONE one's timestamps go to
        `latency`, and (on top, at most `max_groups`) the groups sent to it `result_resend_s` ago and not
        acknowledged are sent again (a lost Batch)."""
        out: list[GroupResult] = []
        q = self._results
        mine = self._delivered.get(client_id)
        record = self.latency.record if now is not None else None
        if now is not None and mine:
            out += self._resend_due(mine, max_groups, now)
        fresh = 0
        while q and fresh < max_groups:
            g = q.popleft()
            if g.acked or g.delivered_to is not None or g.result is None:
                continue
            g.delivered_to = client_id
            g.delivered_at = self._now if now is None else now
            if mine is None:
                mine = self._delivered[client_id] = {}
            mine[g.prompt_id] = g
            out.append(g.result)
            if record is not None and g.phase == Phase.DONE:
                record(g.queued_at, g.dispatched_at, g.result_at, now)  # type: ignore[arg-type]
            fresh += 1
        return out

    def resend_due(self, client_id: str, now: float) -> bool:
        """Whether a pull from this client now would carry a group sent again."""
        mine = self._delivered.get(client_id)
        if not mine:
            return False
        first = next(iter(mine.values()))
        return now - first.delivered_at >= self.config.result_resend_s

    def _resend_due(self, mine: dict[str, Group], limit: int, now: float) -> list[GroupResult]:
        # `mine` is in the order of sending: the groups due are at its front; each one sent moves to the back
        due: list[Group] = []
        for g in mine.values():
            if len(due) >= limit or now - g.delivered_at < self.config.result_resend_s:
                break
            due.append(g)
        for g in due:
            del mine[g.prompt_id]
            g.delivered_at = now
            mine[g.prompt_id] = g
        self.counters["results_resent"] += len(due)
        return [g.result for g in due if g.result is not None]

    def has_results(self) -> bool:
        return bool(self._results)

    def ack(self, prompt_ids: Iterable[str], dropped_stale: Iterable[str] = ()) -> int:
        """Forget acknowledged terminal groups (their ids stay in the dedup window)."""
        n = 0
        for pid in dropped_stale:
            g = self.groups.get(pid)
            if g is not None and g.phase == Phase.DONE and not g.acked:
                if not g.exempt:
                    self.staleness.on_drop(g.size)
                if g.result is not None:
                    self._waste("stale_drop", g.result.trajectories)
        for pid in prompt_ids:
            g = self.groups.get(pid)
            if g is None or g.phase not in Phase.TERMINAL or g.acked:
                continue
            g.acked = True
            del self.groups[pid]
            if g.delivered_to is not None:
                mine = self._delivered.get(g.delivered_to)
                if mine is not None:
                    mine.pop(pid, None)
                    if not mine:  # bounded per-client state: no empty map per client id ever served
                        del self._delivered[g.delivered_to]
            self.held -= 1
            self._remember(pid)
            n += 1
        self.counters["acked"] += n
        return n

    def client_reconnected(self, client_id: str) -> int:
        """Groups sent to this client but not acknowledged are made ready again, first in line."""
        mine = self._delivered.pop(client_id, None)
        if not mine:
            return 0
        groups = sorted(mine.values(), key=lambda g: g.seq, reverse=True)
        for g in groups:
            g.delivered_to = None
            self._results.appendleft(g)
        self.counters["redelivered"] += len(groups)
        return len(groups)

    def _remember(self, pid: str) -> None:
        self._forgotten.add(pid)
        self._forgotten_order.append(pid)
        if len(self._forgotten_order) > self.config.dedup_window:
            self._forgotten.discard(self._forgotten_order.popleft())

    def cancel(self, prompt_ids: Iterable[str], now: float) -> tuple[list[str], list[str]]:
        """Cancel live groups; returns (cancelled ids, ids unknown or already terminal)."""
        cancelled: list[str] = []
        other: list[str] = []
        for pid in prompt_ids:
            g = self.groups.get(pid)
            if g is None or g.phase in Phase.TERMINAL:
                other.append(pid)
                continue
            if g.phase == Phase.LEASED:
                if g.worker_id is not None:
                    self.effects.cancels.append((g.worker_id, g.task_id, "cancelled"))
                self._end_lease(g, None)
            elif g.prompt is None:
                self.parked -= 1
            else:
                self.queued -= 1
            self._terminal(g, Phase.CANCELLED, "cancelled by the client")
            cancelled.append(pid)
        return cancelled, other

    # ------------------------------------------------------------------ versions and apply slots

    def _valid_version(self, version: int, epoch: int) -> int:
        """`version` as reported by a worker in version epoch `epoch`: itself, or -1 when a rebase since that
        epoch went back below it (the worker serves weights of an abandoned run)."""
        if epoch >= self.version_epoch:
            return version
        floor = self.rebase_floor(epoch)
        return version if version <= floor else -1

    def rebase_floor(self, since_epoch: int) -> int:
        """The lowest version a rebase after `since_epoch` went back to (-1: none since, nothing to forget)."""
        floors = [v for e, v in self._rebases if e > since_epoch]
        if not floors:
            return -1
        if len(floors) == len(self._rebases) and self._rebases.maxlen == len(self._rebases):
            return -2  # older than the rebases remembered: forget whatever it serves (-2 is below every version)
        return min(floors)

    def rebase(self, version: int, epoch_id: int, now: float) -> dict[str, int]:
        """The trainer resumed from a checkpoint at `version` (`SetVersion.rebase`): the pool's version becomes
        `version` even if lower, and admission restarts from it.

        A new version epoch begins (`epoch_id`, or the next number if that is not larger). The staleness
        account is rebuilt as if the run had reached `version` in order: ``accepted`` is the ``version x B``
        samples the trainer consumed to get there plus what is held for it now; ``running`` stays. Workers
        serving a version above `version` serve an abandoned run: they count as version -1 (behind
        everything) until they apply a version of the new epoch, and their in-flight tasks are cancelled and
        requeued, burning no attempt. Results already made are delivered as they are (their
        ``token_versions`` say which weights made them).
        """
        if version < 0:
            raise ValueError(f"a rebase needs a version >= 0, got {version}")
        self._now = max(self._now, now)
        old = self.version
        self.version_epoch = max(self.version_epoch + 1, epoch_id)
        self._rebases.append((self.version_epoch, version))
        self.version = version
        st = self.staleness
        st.version = version
        held = sum(g.size for g in self.groups.values() if g.phase == Phase.DONE and not g.exempt)
        st.accepted = version * st.batch_size + held
        cancelled = 0
        for w in self.workers.values():
            if w.version > version:
                w.version = -1
                for g in list(w.leases.values()):
                    self.effects.cancels.append((w.worker_id, g.task_id, "rebased"))
                    self._end_lease(g, w)
                    self._requeue(g, now, reason=f"worker weights of an abandoned run (rebased to {version})", counted=False)
                    cancelled += 1
            self._refresh(w)
        self._hold_reserved = 0  # a hold for a version of the abandoned run is void
        self._policies_rebased(version)
        for g in self.groups.values():
            self._forget_turns(g)  # turns sampled on the abandoned run's weights are never served again
        self.convergence.reset()
        self.convergence.published(version, now, {wid: w.version for wid, w in self.workers.items()})
        self.fleet_version = -1  # versions of the new epoch start over
        self._fleet_since = None
        for w in self.workers.values():
            self._refresh(w)
        self._versions_changed(now)
        self.counters["rebases"] += 1
        info = {"from": old, "to": version, "version_epoch": self.version_epoch, "cancelled": cancelled}
        self.effects.events.append(("version_rebased", dict(info)))
        return info

    def set_version(self, version: int, now: float) -> bool:
        """The trainer announced `version`; returns whether it is newer (a lower one changes nothing:
        the service refuses it, see `rebase`)."""
        if version <= self.version:
            return False
        cap_before = self.staleness.capacity()
        self.version = version
        self.staleness.set_version(version)
        for w in self.workers.values():  # once per version: who is current, behind, too far behind
            self._refresh(w)
        self.convergence.published(version, now, {wid: w.version for wid, w in self.workers.items()})
        if self.config.cancel_stale_inflight and self.config.max_staleness is not None:
            self._cancel_doomed(version, now)
        self._open_hold(version, cap_before, now)
        if self._exact:
            self._check_exact(now)  # after the cancellations: a group they requeued may have no server left
        return True

    # ------------------------------------------------------------------ version-aware dispatch

    def _open_hold(self, version: int, cap_before: int | None, now: float) -> None:
        """Hold the capacity this bump opened (and what its cancellations released) for workers on `version`.

        For at most `fresh_dispatch_hold_s`: a worker behind may take only the capacity beyond the
        reserve, a worker at `version` or newer takes the reserve first; the hold ends when the reserve
        is taken or the time is up (`_check_hold`, run by every `dispatch`), so the pool idles at most
        the hold. Exempt and `min_weight_version` groups keep their own rules (exempt ones use no capacity).
        """
        hold_s = self.config.fresh_dispatch_hold_s
        cap_after = self.staleness.capacity()
        if hold_s <= 0 or cap_before is None or cap_after is None:
            return
        opened = cap_after - cap_before
        if opened <= 0:
            return
        self._hold_reserved += opened  # what an earlier hold still reserved now waits for this version's workers
        self._hold_version = version
        self._hold_until = now + hold_s
        self.counters["fresh_holds"] += 1

    def _check_hold(self, now: float) -> None:
        if self._hold_reserved and now >= self._hold_until:
            self._hold_reserved = 0
            self.counters["fresh_holds_expired"] += 1
            self.effects.events.append(("fresh_hold_expired", {"version": self._hold_version}))

    @property
    def hold_until(self) -> float | None:
        """When the capacity held for fresh workers is released to any worker (None: no hold)."""
        return self._hold_until if self._hold_reserved else None

    @property
    def held_for_fresh(self) -> int:
        """Samples of admission capacity held for workers on the newest version now."""
        return self._hold_reserved

    # ------------------------------------------------------------------ early cancellation

    def set_trainer_bound(self, stale_bound: int) -> None:
        """The trainer's stated bound (`SetVersion.stale_bound`): it trains nothing staler (-1: not stated, eta)."""
        self.trainer_bound = stale_bound if stale_bound >= 0 else -1

    def cancel_bound(self) -> int | None:
        """The staleness above which a group will not be trained: the trainer's stated bound, else eta."""
        if self.trainer_bound >= 0:
            return self.trainer_bound
        return self.config.max_staleness

    def _cancel_doomed(self, version: int, now: float) -> None:
        """Cancel every lease that can no longer be consumed within the bound, at the bump that makes it certain.

        A lease's oldest token is at most its start version and the trainer's version only grows, so
        once ``start_version < version - bound`` every sample of it would arrive staler than the bound.
        Its worker is told (a cancel; it aborts the samples, or the episodes), the lease ends
        (`running` and its slots released) and the group is queued again at once under the same
        prompt id, not charged an attempt (a hand-back; `max_handbacks` of them end it DROPPED_STALE).
        """
        bound = self.cancel_bound()
        if bound is None:
            return
        limit = version - bound
        for w in self.workers.values():
            for g in [g for g in w.leases.values() if not g.exempt and g.start_version < limit]:
                self.effects.cancels.append((w.worker_id, g.task_id, "stale"))
                self._end_lease(g, w)
                self.counters["doomed_cancelled"] += 1
                self._requeue(g, now, reason=f"started at version {g.start_version}, more than {bound} behind {version}",
                              exhausted=Phase.DROPPED_STALE, counted=False)

    # ------------------------------------------------------------------ wasted work

    def note_tokens_cancelled(self, w: WorkerInfo, tokens_cancelled: int) -> None:
        """A worker's cumulative count of tokens generated for tasks cancelled before their result
        (`WorkerHeartbeat.tokens_cancelled`; -1: not reported): the increase is wasted (reason cancel)."""
        if tokens_cancelled < 0:
            return
        last = self._tokens_cancelled_seen.get(w.worker_id, 0)
        delta = tokens_cancelled - last if tokens_cancelled >= last else tokens_cancelled  # a restarted worker counts from 0
        self._tokens_cancelled_seen[w.worker_id] = tokens_cancelled
        if delta > 0:
            self.counters["generated_tokens"] += delta
            self.counters["wasted_tokens_cancel"] += delta

    def _waste(self, reason: str, trajectories: Iterable[Trajectory]) -> None:
        self.counters[f"wasted_tokens_{reason}"] += _sampled_tokens(trajectories)

    def wasted_shares(self) -> dict[str, float]:
        """Generated tokens never delivered to training, as a share of all generated, per reason and in all."""
        c = self.counters
        gen = max(1, c["generated_tokens"])
        shares = {f"wasted_share_{r}": c[f"wasted_tokens_{r}"] / gen for r in WASTE_REASONS}
        shares["wasted_share"] = sum(c[f"wasted_tokens_{r}"] for r in WASTE_REASONS) / gen
        return shares

    def apply_request(self, w: WorkerInfo, version: int, now: float = 0.0) -> None:
        """A worker asks for an apply slot. A repeated ask from the slot's holder is answered with the
        grant again (the first may have been lost); a repeated ask while waiting changes nothing."""
        wid = w.worker_id
        self._now = max(self._now, now)
        if wid in self._applying:
            self.counters["grants_resent"] += 1
            w.apply_version = version
            self.effects.grants.append((wid, version))
            return
        if wid in self._apply_waiting:
            return
        self._apply_waiting[wid] = version
        if self._fleet:
            self._fleet_staged(w, version, now)
            return
        self._grant_apply()

    def apply_done(self, w: WorkerInfo, version: int, ok: bool, error: str | None = None, skipped: bool = False,
                   now: float | None = None) -> None:
        """The outcome of a worker's apply. ``skipped``: the worker gave `version` up for good (after its own
        retries, a restarted engine included); recorded on the worker (`live_state`) so a trainer waiting for
        that version can fail at once, and no apply slot it holds for another version is touched."""
        if skipped:
            self.counters["versions_skipped"] += 1
            # no event here: the worker's own `version_skipped` event carries the reason to the events stream
            if version > w.skipped_version:
                w.skipped_version, w.skipped_error = version, (error or "")[:2000]
            if self._apply_waiting.get(w.worker_id, version + 1) <= version:  # it gave up waiting for a grant
                self._apply_waiting.pop(w.worker_id)
                self._grant_apply()
            self._versions_changed(self._now if now is None else now)
            return
        at = self._now if now is None else now
        self._now = max(self._now, at)
        before = w.version
        if ok:
            w.version = max(w.version, self._valid_version(version, w.version_epoch) if self.version_epoch else version)
        else:
            self.counters["versions_failed"] += 1
            self.effects.events.append(("version_failed", {"worker_id": w.worker_id, "version": version, "error": error or ""}))
        self._fleet_switched(w.worker_id, ok, at)
        self._release_apply(w.worker_id)
        self._refresh(w)
        self._version_moved(w, at, before)

    def _expire_apply_slots(self, now: float) -> None:
        """Free the slots held past `apply_slot_deadline_s` (a hung apply); the next worker waiting gets one."""
        self._now = max(self._now, now)
        limit = self.config.apply_slot_deadline_s
        for wid, since in list(self._apply_since.items()):
            if now - since <= limit:
                continue
            self.counters["apply_slots_expired"] += 1
            self.effects.events.append(("apply_slot_expired", {"worker_id": wid, "held_s": round(now - since, 3)}))
            self._release_apply(wid)
            w = self.workers.get(wid)
            if w is not None:
                self._refresh(w)

    def _release_apply(self, worker_id: str) -> None:
        self._apply_since.pop(worker_id, None)
        if worker_id in self._applying:
            self._applying.discard(worker_id)
            self.effects.events.append(("apply_done", {"worker_id": worker_id}))
            w = self.workers.get(worker_id)
            if w is not None:
                w.applying = False
        self._apply_waiting.pop(worker_id, None)
        self._grant_apply()

    def _grant_apply(self) -> None:
        if self._fleet:
            return  # fleet activation grants in `_fleet_check`, all staged workers at once
        while self._apply_waiting and len(self._applying) < self.config.max_applying:
            wid = next(iter(self._apply_waiting))
            version = self._apply_waiting.pop(wid)
            w = self.workers.get(wid)
            if w is not None:
                self._grant(w, version)

    def _grant(self, w: WorkerInfo, version: int) -> None:
        """Worker `w` may apply `version` now (it holds an apply slot until its ApplyDone)."""
        self._applying.add(w.worker_id)
        self._apply_since[w.worker_id] = self._now
        w.applying = True
        w.apply_version = version
        self._unready(w.worker_id)
        self.effects.grants.append((w.worker_id, version))
        self.effects.events.append(("apply_granted", {"worker_id": w.worker_id, "version": version}))

    @property
    def applying(self) -> frozenset[str]:
        return frozenset(self._applying)

    # ------------------------------------------------------------------ the versioned-service contract

    def _version_moved(self, w: WorkerInfo, now: float, before: int | None = None) -> None:
        """`w` serves another version now (a hello, a heartbeat, an ApplyDone); it served `before` (None: unknown)."""
        if w.version >= 0:
            self.convergence.worker_at(w.worker_id, w.version, now)
        # exact-version groups can lose their last server only when a worker leaves their version
        self._versions_changed(now, exact=before is None or before in self._exact)

    def _versions_changed(self, now: float, exact: bool = True) -> None:
        """Who serves what changed (a worker moved, joined, left or gave a version up): versions that converged are
        recorded, a fleet round that can go ahead goes, and exact-version groups nobody can serve any more fail."""
        for rec in self.convergence.check(len(self.workers)):
            self.counters["versions_converged"] += 1
            self.effects.events.append(("version_converged", rec.as_dict()))
        if self._fleet_since is not None:
            self._fleet_check(now)
        if exact and self._exact:
            self._check_exact(now)
        if self._named and self.policy is not None:
            self._check_policy_reachable()

    def _exact_refusal(self, p: Prompt) -> str:
        """Why a prompt naming an exact weight version cannot be accepted now ("" when it can)."""
        v = p.exact_weight_version
        if v < 0:
            return f"exact_weight_version must be >= 0 (or -1: any version), got {v}"
        if p.min_weight_version > v:
            return f"min_weight_version {p.min_weight_version} is above exact_weight_version {v}: no worker can serve both"
        eta = self.config.max_staleness
        ahead = (eta if eta is not None else 0) + 1
        if v > self.version + ahead:
            return (f"weight version {v} is {v - self.version} versions ahead of the pool's version {self.version}, beyond what "
                    f"the staleness bound lets the trainer publish before consuming it (at most {ahead} ahead, eta "
                    f"{'unset' if eta is None else eta})")
        return self._exact_verdict(v)

    def _exact_verdict(self, v: int) -> str:
        """Why no live worker holds weight version `v` and none can come to ("" while one does or may)."""
        if v < self.version and self.convergence.was_published(v) is False:
            return f"weight version {v} was never published (the pool's version is {self.version})"
        eta = self.config.max_staleness
        if eta is not None and self.version >= 0 and v < self.version - eta:
            return f"weight version {v} is more than the staleness bound ({eta}) behind the pool's version {self.version}"
        for w in self.workers.values():
            if w.version == v and not w.held_out:
                return ""  # serves it now
            if w.applying and w.apply_version == v or self._apply_waiting.get(w.worker_id) == v:
                return ""  # about to serve it
        if v > self.version:
            return ""  # not published yet (within the bound checked at submit): waits for it
        if v < self.version:
            return (f"weight version {v} is no longer served: no live worker holds it, and workers fetch only the newest "
                    f"version ({self.version})")
        if self.workers and all(w.skipped_version >= v and w.version < v for w in self.workers.values()):
            errors = "; ".join(f"{w.worker_id}: {w.skipped_error or 'no reason given'}" for w in list(self.workers.values())[:4])
            return f"every live worker gave weight version {v} up ({errors})"
        return ""  # the newest version: live workers are fetching it, or one may join and fetch it

    def _check_exact(self, now: float, only: int | None = None) -> None:
        """Fail at once every queued group whose exact version no live worker holds or can reach."""
        for v in [only] if only is not None else list(self._exact):
            heap = self._exact.get(v)
            if not heap:
                self._exact.pop(v, None)
                continue
            why = self._exact_verdict(v)
            if not why:
                continue
            del self._exact[v]
            for _, _, token, g in heap:
                if g.phase != Phase.QUEUED or token != g.token:
                    continue
                self.queued -= 1
                self.counters["exact_failed"] += 1
                self._terminal(g, Phase.FAILED, f"exact_version_unavailable: {why}")
                self.effects.events.append(("task_failed", {"prompt_id": g.prompt_id, "reason": why, "attempts": g.attempt}))

    def _fleet_staged(self, w: WorkerInfo, version: int, now: float) -> None:
        """Fleet activation: `w` has `version` fetched and staged (its ApplyRequest)."""
        if version <= self.fleet_version:
            self._fleet_grant({w.worker_id: version}, now)  # catching up to what the fleet already switched to: at once
            return
        if self._fleet_since is None:
            self._fleet_since = now
        self._fleet_check(now)

    def _fleet_check(self, now: float) -> None:
        """Activate the staged workers together when every live worker has staged (or serves) a version above
        `fleet_version`, or when the stage deadline has passed since the first one did."""
        waiting = {wid: v for wid, v in self._apply_waiting.items() if v > self.fleet_version and wid in self.workers}
        if not waiting:
            self._fleet_since = None
            return
        reach = [max(w.version, waiting.get(wid, -1), w.apply_version if w.applying else -1) for wid, w in self.workers.items()]
        target = min(waiting.values())
        if min(reach) >= target:  # every live worker serves or has staged `target` (or newer)
            self._fleet_activate(target, waiting, now, held_out=())
            return
        if self._fleet_since is not None and now - self._fleet_since >= self.config.fleet_stage_deadline_s:
            late = tuple(wid for wid, w in self.workers.items()
                         if max(w.version, waiting.get(wid, -1), w.apply_version if w.applying else -1) < target)
            self.counters["fleet_deadline_activations"] += 1
            self.counters["fleet_holdouts"] += len(late)
            for wid in late:
                self.effects.events.append(("fleet_holdout", {"worker_id": wid, "version": target,
                                                              "serves": self.workers[wid].version}))
            self._fleet_activate(target, waiting, now, held_out=late)

    def _fleet_activate(self, target: int, waiting: dict[str, int], now: float, held_out: tuple[str, ...]) -> None:
        self.fleet_version = target
        self._fleet_since = None
        self.counters["fleet_activations"] += 1
        self.fleet_rounds.append(FleetRound(version=target, activated_at=now, workers=dict(waiting), held_out=held_out))
        self.effects.events.append(("fleet_activate", {"version": target, "workers": len(waiting), "held_out": len(held_out)}))
        self._fleet_grant(waiting, now)
        for w in self.workers.values():  # the ones below `target` not switching now are held out from this moment
            self._refresh(w)

    def _fleet_grant(self, grants: dict[str, int], now: float) -> None:
        self._now = max(self._now, now)
        for wid, version in grants.items():
            w = self.workers.get(wid)
            self._apply_waiting.pop(wid, None)
            if w is not None:
                self._grant(w, version)

    def _fleet_switched(self, worker_id: str, ok: bool, now: float) -> None:
        """An activated worker reported its switch (ApplyDone): its time goes into the round's skew."""
        for r in reversed(self.fleet_rounds):
            if worker_id in r.workers and worker_id not in r.done_at and worker_id not in r.failed:
                if ok:
                    r.done_at[worker_id] = now
                else:
                    r.failed.add(worker_id)
                if r.finished():
                    self._skews_ms.append(r.skew_ms())
                    self.effects.events.append(("fleet_switched", r.as_dict()))
                return

    # ------------------------------------------------------------------ status

    def snapshot(self) -> dict[str, Any]:
        c: dict[str, Any] = dict(self.counters)
        c.update(
            version=self.version,
            version_epoch=self.version_epoch,
            queued=self.queued + self.parked,
            leased=self.leased,
            held=self.held,
            workers_alive=len(self.workers),
            ready_results=len(self._results),
            accepted_samples=self.staleness.accepted,
            running_samples=self.staleness.running,
            applying=len(self._applying),
        )
        c.update(self.latency.summary())
        c.update({k: round(v, 6) for k, v in self.wasted_shares().items()})
        c["held_for_fresh"] = self._hold_reserved
        c["replay_bytes"] = self.replay_bytes
        lost = self.counters["workers_lost"]
        c["tokens_regenerated_per_worker_lost"] = round(self.counters["tokens_regenerated"] / lost, 1) if lost else 0.0
        c.update(self.convergence.figures())
        c["activation"] = self.config.activation
        if self.policy is not None:
            c["policy"] = self.policy
            c["policy_since"] = self.policy_since
        if self._fleet:
            c["fleet_version"] = self.fleet_version
            c["fleet_held_out"] = sum(1 for w in self.workers.values() if w.held_out)
            c["fleet_activation_skew_last_ms"] = round(self._skews_ms[-1], 3) if self._skews_ms else 0.0
            c["fleet_activation_skew_p50_ms"] = round(percentile(self._skews_ms, 0.5), 3)
            c["fleet_activation_skew_p95_ms"] = round(percentile(self._skews_ms, 0.95), 3)
        return c

    def versions_view(self) -> dict[str, Any]:
        """Per version, for `status()`: the recent converged versions, the ones still converging, the fleet rounds."""
        out: dict[str, Any] = {
            "converged": [r.as_dict() for r in list(self.convergence.records)[-8:]],
            "converging": self.convergence.pending(self.workers)[-8:],
        }
        if self._fleet:
            out["fleet_rounds"] = [r.as_dict() for r in list(self.fleet_rounds)[-8:]]
        return out

    def check_invariants(self) -> None:
        """Recount everything from scratch and compare (for tests)."""
        phases = [g.phase for g in self.groups.values()]
        queued = sum(1 for g in self.groups.values() if g.phase == Phase.QUEUED and g.prompt is not None)
        parked = sum(1 for g in self.groups.values() if g.phase == Phase.QUEUED and g.prompt is None)
        leased = phases.count(Phase.LEASED)
        held = sum(1 for p in phases if p in Phase.TERMINAL)
        assert (queued, parked, leased, held) == (self.queued, self.parked, self.leased, self.held), (
            (queued, parked, leased, held),
            (self.queued, self.parked, self.leased, self.held),
        )
        running = sum(g.size for g in self.groups.values() if g.phase == Phase.LEASED and not g.exempt)
        assert running == self.staleness.running, (running, self.staleness.running)
        lease_groups = [g for g in self.groups.values() if g.phase == Phase.LEASED]
        assert all(self._deadlines[g.task_id][1] is g for g in lease_groups)
        assert len(self._deadlines) == len(lease_groups), (len(self._deadlines), len(lease_groups))  # an ended lease has left
        for w in self.workers.values():
            assert w.credits >= 0
            for tid, g in w.leases.items():
                assert g.phase == Phase.LEASED and g.worker_id == w.worker_id and g.task_id == tid
            if Feature.HELD_DIGEST in w.features:
                assert w.digest == held_digest(w.leases), (w.worker_id, w.digest)
            assert self._ready.get(w.worker_id, w) is w and self._ready_behind.get(w.worker_id, w) is w
            assert not (w.worker_id in self._ready and w.worker_id in self._ready_behind)
        kept = sum(g.turn_bytes for g in self.groups.values())
        assert kept == self.replay_bytes, (kept, self.replay_bytes)
        assert all(g.turns is None for g in self.groups.values() if g.phase in Phase.TERMINAL)


_U8 = np.dtype(np.uint8)


def _turn_bytes(t: RecordedTurn) -> int:
    """What one kept turn costs the broker, roughly: its arrays, its text and a fixed share for the rest."""
    size = 128 + t.output_ids.nbytes + t.logprobs.nbytes + t.token_versions.nbytes + len(t.output_text or "")
    if t.top_ids is not None:
        size += t.top_ids.nbytes
    if t.top_logprobs is not None:
        size += t.top_logprobs.nbytes
    return size


def _sampled_tokens(trajectories: Iterable[Trajectory]) -> int:
    """Tokens the model sampled (the loss mask's sum; every output token when there is no mask)."""
    n = 0
    for t in trajectories:
        mask = t.loss_mask
        if mask is None or mask.size != t.output_ids.size:
            n += int(t.output_ids.size)
            continue
        if mask.dtype is _U8 and mask.size <= 512:
            # a short mask of 0s and 1s (what workers send) sums to its count of 1 bytes: two bytes.count
            # calls cost a fifth of a numpy reduction here (whose argument parsing and casting set-up dominate
            # at this size; from about 1,000 tokens on the reduction is the faster)
            b = mask.tobytes()
            ones = b.count(1)
            if ones + b.count(0) == len(b):
                n += ones
                continue
        # np.add.reduce is what ndarray.sum calls, without numpy's Python-level wrapper
        n += int(np.add.reduce(mask))
    return n


def _complete(trajectories: tuple[Trajectory, ...], prompt_id: str, size: int) -> bool:
    """Every sample of the group, each ``(sample_index, segment_index)`` once (an episode's rewrite adds segments)."""
    samples: set[int] = set()
    segments: set[tuple[int, int]] = set()
    for t in trajectories:
        if t.prompt_id != prompt_id or not 0 <= t.sample_index < size:
            return False
        key = (t.sample_index, t.segment_index)
        if key in segments:
            return False
        segments.add(key)
        samples.add(t.sample_index)
    return len(samples) == size


def _off_version(trajectories: Iterable[Trajectory], version: int) -> int | None:
    """A sampled token's version other than `version` (None: every sampled token is of `version`)."""
    for t in trajectories:
        if not t.token_versions.size:
            continue
        sampled = sampled_versions(t.token_versions, t.loss_mask)
        lo, hi = int(sampled.min()), int(sampled.max())
        if lo != version:
            return lo
        if hi != version:
            return hi
    return None


def _with_metadata(result: GroupResult, p: Prompt) -> GroupResult:
    return GroupResult(
        prompt_id=result.prompt_id,
        state=result.state,
        trajectories=result.trajectories,
        reason=result.reason,
        attempts=result.attempts,
        worker_id=result.worker_id,
        metadata=p.metadata,
    )
