"""The trainer client's ledger: what was submitted, delivered and acknowledged. Pure, no I/O.

`TrainerClient` (client.py) moves bytes; this class decides. It holds no socket,
no event loop and reads no clock: every method that needs the time takes ``now``
(monotonic seconds) from the caller, and what must be sent comes back as data
(the acks to carry, the prompts to submit again). So each rule below is tested
without sockets or sleeping (tests/unit/trainer_client/test_ledger.py).

Guarantees this class keeps:

* every accepted `Prompt` is kept whole in `pending` until its group reaches a
  terminal state here (returned, FAILED, CANCELLED, DROPPED_STALE, or dropped by
  the hard staleness bound), so a broker restart can resubmit it exactly as it
  was given, and a regeneration resubmits the ORIGINAL prompt (sampling,
  priority, text and chat-template flag, evaluation flag and the trainer's own
  metadata) under a fresh id, never one rebuilt from a trajectory;
* a group is delivered at most once (by `prompt_id`) and a trajectory at most once
  (by `trajectory_id`), each within a bounded window of ``dedup_window`` ids;
* every group taken is acknowledged exactly once to the broker: groups returned
  or already delivered through `pull_acks`, groups dropped as stale through
  `stale_acks` (so the broker releases their capacity); an ack leaves the ledger
  only when the caller says it was sent (`acks_sent`);
* the other terminal states (FAILED, CANCELLED, DROPPED_STALE from the broker) are
  handed out once, beside the next batch.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from rollpool.protocol import (
    Ack,
    GroupResult,
    GroupState,
    Prompt,
    SubmitReply,
    Trajectory,
    trajectory_staleness,
)

__all__ = ["ClientLedger", "Dedup", "RolloutBatch", "SubmitResult", "TakeOutcome", "COUNTERS"]

COUNTERS = (
    "submitted",
    "rejected",
    "resubmitted",
    "groups_delivered",
    "trajectories_delivered",
    "duplicates_dropped",
    "dropped_stale",
    "regenerated_stale",
    "regenerate_skipped",
    "failed",
    "cancelled",
    "broker_restarts",
)


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


@dataclass
class TakeOutcome:
    """What the caller must do after `ClientLedger.take`."""

    regenerate: list[Prompt] = field(default_factory=list)
    """Original prompts of groups dropped as too stale, under fresh ids: submit them."""
    dropped_stale: list[tuple[str, int]] = field(default_factory=list)
    """(prompt_id, staleness) of each group dropped by the hard bound (a metrics event each)."""
    not_regenerated: list[str] = field(default_factory=list)
    """Stale groups whose prompt this ledger never held (submitted by an earlier process
    with the same client id): dropped, not resubmitted."""


class Dedup:
    """A bounded set that forgets the oldest ids first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
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

    def __len__(self) -> int:
        return len(self._ids)


class ClientLedger:
    """The trainer client's whole state apart from the connection (see the module docstring)."""

    def __init__(self, *, dedup_window: int, regenerate_stale: bool, new_prompt_id: Callable[[], str]) -> None:
        self.regenerate_stale = regenerate_stale
        self._new_prompt_id = new_prompt_id
        self.version = 0
        """The trainer's weight version as far as this client knows (its own or the broker's, the newer)."""
        self.pending: dict[str, Prompt] = {}
        """Accepted prompts whose group is not yet terminal here, whole, in submission order."""
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._to_ack: list[str] = []
        self._to_ack_stale: list[str] = []
        self._delivered = Dedup(dedup_window)
        self._traj_seen = Dedup(dedup_window)
        self._ready: deque[GroupResult] = deque()
        self._other: list[GroupResult] = []
        self._last_batch_at: float | None = None

    # ------------------------------------------------------------------ submissions

    def submitted(self, chunk: Sequence[Prompt], reply: SubmitReply, result: SubmitResult) -> None:
        """Record the broker's answer to one submit of `chunk` into `result` (and the counters)."""
        by_id = {p.prompt_id: p for p in chunk}
        accepted = rejected = 0
        for pid in reply.accepted:
            if pid in by_id:
                self.pending[pid] = by_id[pid]
                result.accepted.append(pid)
                accepted += 1
        for rej in reply.rejected:
            if rej.reason == "duplicate" and rej.prompt_id in self.pending:
                result.accepted.append(rej.prompt_id)  # a retried submit the broker already had
                accepted += 1
                continue
            result.rejected[rej.prompt_id] = rej.reason
            rejected += 1
        self.counters["submitted"] += accepted
        self.counters["rejected"] += rejected

    def to_resubmit(self) -> list[Prompt]:
        """After a broker restart: every prompt not yet terminal, exactly as submitted."""
        return list(self.pending.values())

    def resubmitted(self, reply: SubmitReply) -> None:
        self.counters["resubmitted"] += len(reply.accepted)

    def regenerated(self, result: SubmitResult) -> None:
        """Count the regenerated prompts the broker accepted (the rejected ones count as ``rejected``)."""
        self.counters["regenerated_stale"] += len(result.accepted)

    def broker_restarted(self) -> None:
        self.counters["broker_restarts"] += 1

    # ------------------------------------------------------------------ versions

    def observe_version(self, version: int) -> None:
        """A version announced by the trainer or reported by the broker; the newest wins."""
        if version > self.version:
            self.version = version

    # ------------------------------------------------------------------ results

    @property
    def ready(self) -> int:
        """DONE groups taken and not yet handed out."""
        return len(self._ready)

    def take(self, groups: Iterable[GroupResult], max_staleness: int | None) -> TakeOutcome:
        """File the groups of one pull: deduplicate, judge staleness, queue for delivery."""
        out = TakeOutcome()
        for g in groups:
            self._take_one(g, max_staleness, out)
        return out

    def _take_one(self, g: GroupResult, max_staleness: int | None, out: TakeOutcome) -> None:
        if g.prompt_id in self._delivered:
            self.counters["duplicates_dropped"] += 1
            self._to_ack.append(g.prompt_id)  # the broker redelivered something we already returned
            return
        original = self.pending.pop(g.prompt_id, None)  # the group is terminal from here on
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
                out.dropped_stale.append((g.prompt_id, staleness))
                if self.regenerate_stale:
                    if original is not None:
                        out.regenerate.append(dataclasses.replace(original, prompt_id=self._new_prompt_id()))
                    else:
                        self.counters["regenerate_skipped"] += 1
                        out.not_regenerated.append(g.prompt_id)
                return
        self._delivered.add(g.prompt_id)
        if not fresh:
            self._to_ack.append(g.prompt_id)  # nothing new in it: release it at once
            return
        if len(fresh) != len(g.trajectories):
            g = dataclasses.replace(g, trajectories=tuple(fresh))
        self._ready.append(g)

    def deliver(self, n: int, *, started_at: float, now: float, dropped_before: int) -> tuple[RolloutBatch, list[int]]:
        """Hand out n ready groups and the other terminal states; they are acknowledged with the next pull.

        `started_at` is when the caller's `get_batch` began, `dropped_before` the
        ``dropped_stale`` counter then. Returns the batch and the staleness of each
        trajectory in it (for a metrics histogram).
        """
        if n > len(self._ready):
            raise ValueError(f"deliver({n}) with only {len(self._ready)} groups ready")
        groups = [self._ready.popleft() for _ in range(n)]
        other, self._other = self._other, []
        self._to_ack.extend(g.prompt_id for g in groups)
        self._to_ack.extend(g.prompt_id for g in other)
        trajs = [t for g in groups for t in g.trajectories]
        tokens = sum(len(t.output_ids) for t in trajs)
        lags = [trajectory_staleness(self.version, t.token_versions) for t in trajs if len(t.token_versions)]
        interval = now - self._last_batch_at if self._last_batch_at is not None else now - started_at
        self._last_batch_at = now
        self.counters["groups_delivered"] += len(groups)
        self.counters["trajectories_delivered"] += len(trajs)
        rewards = [t.reward for t in trajs if t.reward is not None]
        stats = {
            "rollout/version": float(self.version),
            "rollout/groups": float(len(groups)),
            "rollout/samples": float(len(trajs)),
            "rollout/tokens": float(tokens),
            "rollout/wait_s": now - started_at,
            "rollout/tokens_per_s": tokens / interval if interval > 0 else 0.0,
            "rollout/staleness_mean": float(np.mean(lags)) if lags else 0.0,
            "rollout/staleness_max": float(max(lags)) if lags else 0.0,
            "rollout/dropped_stale": float(self.counters["dropped_stale"] - dropped_before),
            "rollout/reward_mean": float(np.mean(rewards)) if rewards else float("nan"),
            "rollout/pending_prompts": float(len(self.pending)),
        }
        return RolloutBatch(groups=groups, other=other, stats=stats), lags

    # ------------------------------------------------------------------ acknowledgements

    def pull_acks(self) -> tuple[str, ...]:
        """Groups to acknowledge on the next pull (returned ones, and redeliveries of them)."""
        return tuple(self._to_ack)

    def stale_acks(self) -> tuple[str, ...]:
        """Groups dropped by the hard staleness bound, to acknowledge as ``dropped_stale``."""
        return tuple(self._to_ack_stale)

    def acks_sent(self, acks: Sequence[str] = (), stale: Sequence[str] = ()) -> None:
        """The broker took these acks (read from `pull_acks()` / `stale_acks()` before sending).

        Each id sent leaves its list once; ids added meanwhile (or taken by a
        concurrent pull) are kept, so nothing owed is forgotten.
        """
        self._to_ack = _without(self._to_ack, acks)
        self._to_ack_stale = _without(self._to_ack_stale, stale)

    def final_ack(self) -> Ack | None:
        """At close: one Ack of everything still owed, or None (call `acks_sent` once it went out)."""
        if not self._to_ack and not self._to_ack_stale:
            return None
        stale = tuple(self._to_ack_stale)
        return Ack(prompt_ids=tuple(self._to_ack) + stale, dropped_stale=stale)


def _without(owed: list[str], sent: Sequence[str]) -> list[str]:
    """`owed` less one occurrence of each id in `sent`, order kept."""
    if not sent:
        return owed
    left = Counter(sent)
    out: list[str] = []
    for pid in owed:
        if left[pid] > 0:
            left[pid] -= 1
        else:
            out.append(pid)
    return out
