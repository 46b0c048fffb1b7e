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
* every group `get_batch` returns is judged against the hard bound at the version
  and bound of that call (`recheck`), also one left buffered by an earlier call;
  a trajectory whose ``token_versions`` are shorter than its ``output_ids`` fails
  any bound (its staleness is unknown);
* a Batch that reaches no waiting request is kept (`adopt`), and a group the broker
  sends again while it is held here unreturned is dropped quietly (`resent_held`):
  it is acknowledged once, when returned;
* a group is delivered at most once (by `prompt_id`) and a trajectory at most once
  (by `trajectory_id`), each within a bounded window of ``dedup_window`` ids;
* every group taken is acknowledged exactly once to the broker: groups returned
  or already delivered through `pull_acks`, groups dropped as stale through
  `stale_acks` (so the broker releases their capacity); an ack leaves the ledger
  only when the caller says it was sent (`acks_sent`);
* the other terminal states (FAILED, CANCELLED, DROPPED_STALE from the broker, and
  the groups this ledger drops by the stale bound) are handed out once, beside the
  next batch, each with its prompt id and reason (`RolloutBatch.other`,
  `RolloutBatch.reports`): every prompt taken is told of exactly once, a
  regenerated one as DROPPED_STALE with ``regenerated_as`` naming its successor.

Runs (version epochs): after `rebased` (the trainer called ``rebase_version(v)``), a DONE group with a
trajectory made on weights of the abandoned run (its ``version_epoch`` earlier than the rebase and a sampled
token's version above v) is never delivered as fresh: it is dropped (DROPPED_STALE, reason ``abandoned_run``,
acknowledged as dropped_stale) or, with ``abandoned_policy="regenerate"``, its original prompt comes back under a
fresh id, as for a stale group. Tokens at or below v were made by the same weights in both runs. A trajectory
that does not say its epoch (-1: a worker older than protocol 1.15) is judged by staleness alone.

The stale policy (per ledger, or per `take`): a DONE group whose staleness
(``version - min(token_versions)`` over sampled tokens) is above ``max_staleness``
is ``drop``-ped (acknowledged as dropped_stale so the broker frees its capacity),
``regenerate``-d (dropped as above, and the ORIGINAL prompt comes back in
`TakeOutcome.regenerate` under a fresh id), or under ``keep`` delivered with its
staleness stated while it is at most ``max_staleness_keep`` (above that it is
dropped). Generated tokens that never reach the trainer are counted per reason
(``wasted_tokens_stale``, ``wasted_tokens_duplicate``) beside ``tokens_delivered``.
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
    sampled_versions,
    trajectory_staleness,
)

__all__ = ["ABANDONED_POLICIES", "ClientLedger", "Dedup", "PromptReport", "RolloutBatch", "STALE_POLICIES", "SubmitResult", "TakeOutcome",
           "TrainSample", "COUNTERS", "check_stale_policy", "sampled_staleness"]

ABANDONED_POLICIES = ("drop", "regenerate")
"""What happens to a DONE group made on weights of a run abandoned by a rebase (see the module docstring)."""

STALE_POLICIES = ("drop", "regenerate", "keep")
"""What happens to a DONE group staler than ``max_staleness`` (see the module docstring)."""

COUNTERS = (
    "submitted",
    "rejected",
    "resubmitted",
    "submit_resent_duplicates",
    "groups_delivered",
    "trajectories_delivered",
    "duplicates_dropped",
    "resent_held",
    "batches_adopted",
    "dropped_stale",
    "dropped_abandoned",
    "regenerated_stale",
    "regenerate_skipped",
    "failed",
    "cancelled",
    "broker_restarts",
    "kept_stale",
    "tokens_delivered",
    "wasted_tokens_stale",
    "wasted_tokens_duplicate",
)


def check_stale_policy(policy: str, max_staleness_keep: int | None) -> None:
    """Raise ValueError naming the argument when `policy` or `max_staleness_keep` is not allowed."""
    if policy not in STALE_POLICIES:
        raise ValueError(f"stale_policy must be one of {STALE_POLICIES}, got {policy!r}")
    if max_staleness_keep is not None and max_staleness_keep < 0:
        raise ValueError(f"max_staleness_keep must be >= 0, got {max_staleness_keep}")


def sampled_staleness(v_consume: int, t: Trajectory) -> int:
    """``v_consume - min(token_versions)`` over the sampled tokens (loss mask 1); all tokens when the
    mask is absent or masks everything; 0 for a trajectory without output tokens."""
    return trajectory_staleness(v_consume, sampled_versions(t.token_versions, t.loss_mask))


@dataclass(frozen=True)
class PromptReport:
    """How one prompt taken in this batch ended, as `get_batch` reports it."""

    prompt_id: str
    state: str
    """`GroupState.DONE`, FAILED, CANCELLED or DROPPED_STALE."""
    reason: str = ""
    staleness: int | None = None
    """The group's staleness when the trainer took it (DONE, and groups dropped by the stale bound)."""
    regenerated_as: str | None = None
    """The fresh prompt id its original prompt was resubmitted under (``stale_policy="regenerate"``)."""


@dataclass(frozen=True)
class TrainSample:
    """One trajectory with what a decoupled-PPO trainer needs beside it (AReaL-style off-policy correction).

    ``behaviour_logprobs`` are the logprobs of the policy that sampled each token (the
    trajectory's ``output_logprobs``); ``token_versions`` the version that produced each
    token; ``token_staleness`` = consumption version - token version, per token;
    ``staleness`` the trajectory's (oldest sampled token). The proximal policy of
    decoupled PPO is the trainer's own; the importance weight per token is
    ``exp(logp_proximal - behaviour_logprobs)``.
    """

    trajectory: Trajectory
    version: int
    """The trainer's version when the batch was handed out (v_consume)."""
    staleness: int

    @property
    def behaviour_logprobs(self) -> np.ndarray:
        return self.trajectory.output_logprobs

    @property
    def token_versions(self) -> np.ndarray:
        return self.trajectory.token_versions

    @property
    def token_staleness(self) -> np.ndarray:
        return (self.version - np.asarray(self.trajectory.token_versions, dtype=np.int64)).astype(np.int32)

    @property
    def loss_mask(self) -> np.ndarray:
        return self.trajectory.loss_mask


@dataclass
class SubmitResult:
    accepted: list[str]
    rejected: dict[str, str]
    """prompt_id -> reason (``duplicate``, ``invalid``, ``group_too_large``, ``queue_full``, ``exact_version_unavailable``, ...)."""
    details: dict[str, str] = field(default_factory=dict)
    """prompt_id -> the broker's explanation of its rejection, where it gave one."""


@dataclass
class RolloutBatch:
    """What `get_batch` returns."""

    groups: list[GroupResult]
    """n whole DONE groups (each with all its trajectories)."""
    other: list[GroupResult]
    """Groups that ended otherwise since the last batch: FAILED, CANCELLED and DROPPED_STALE from the
    broker, and the groups the stale bound dropped here (state DROPPED_STALE, no trajectories, the
    reason and ``metadata["staleness"]`` / ``metadata["regenerated_as"]`` set)."""
    stats: dict[str, float]
    """Lag, staleness and throughput figures, ready for wandb or TensorBoard."""
    version: int = 0
    """The trainer's version when this batch was handed out (staleness counts from it)."""
    reports: list[PromptReport] = field(default_factory=list)
    """One per prompt in `groups` and `other`, in that order: prompt id, state, reason, staleness."""
    staleness: dict[str, int] = field(default_factory=dict)
    """trajectory_id -> staleness at `version`, for every trajectory in `groups`."""

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]

    def samples(self) -> list[TrainSample]:
        """Every trajectory of `groups` with its behaviour logprobs, per-token versions and staleness."""
        return [TrainSample(t, self.version, self.staleness.get(t.trajectory_id, sampled_staleness(self.version, t)))
                for t in self.trajectories]

    @property
    def kept_stale(self) -> int:
        """Trajectories delivered staler than the bound (``stale_policy="keep"``)."""
        return int(self.stats.get("rollout/kept_stale", 0.0))


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

    def __init__(self, *, dedup_window: int, new_prompt_id: Callable[[], str], stale_policy: str = "drop",
                 max_staleness_keep: int | None = None, regenerate_stale: bool = False, abandoned_policy: str = "drop") -> None:
        if regenerate_stale:  # the deprecated spelling of stale_policy="regenerate"
            stale_policy = "regenerate"
        check_stale_policy(stale_policy, max_staleness_keep)
        if abandoned_policy not in ABANDONED_POLICIES:
            raise ValueError(f"abandoned_policy must be one of {ABANDONED_POLICIES}, got {abandoned_policy!r}")
        self.stale_policy = stale_policy
        self.abandoned_policy = abandoned_policy
        self.rebases: list[tuple[int, int]] = []
        """(version epoch, version) of each rebase this client made, oldest first."""
        self.max_staleness_keep = max_staleness_keep
        """Under ``keep``: the most staleness delivered (None: twice ``max_staleness``)."""
        self._new_prompt_id = new_prompt_id
        self.version = 0
        """The trainer's weight version as far as this client knows (its own or the broker's, the newer)."""
        self.pending: dict[str, Prompt] = {}
        """Accepted prompts whose group is not yet terminal here, whole, in submission order."""
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._to_ack: list[str] = []
        self._to_ack_stale: list[str] = []
        self._delivered = Dedup(dedup_window)
        self._stale_ids = Dedup(dedup_window)
        """Groups dropped here as too stale (their redeliveries are acknowledged as stale again)."""
        self._traj_seen = Dedup(dedup_window)
        self._ready: deque[GroupResult] = deque()
        self._other: list[GroupResult] = []
        self._staleness: dict[str, int] = {}
        """prompt_id -> staleness of each ready group (judged when taken)."""
        self._dropped_here: set[str] = set()
        """Groups in `_other` that the stale bound dropped here (acknowledged as stale, not again)."""
        self._kept_stale: dict[str, int] = {}
        """prompt_id -> trajectories delivered above the bound, for ready groups."""
        self._originals: dict[str, Prompt | None] = {}
        """prompt_id -> the original prompt of each ready group (for a regeneration when `recheck` drops it)."""
        self._last_batch_at: float | None = None

    @property
    def regenerate_stale(self) -> bool:
        """Deprecated: ``stale_policy == "regenerate"``."""
        return self.stale_policy == "regenerate"

    # ------------------------------------------------------------------ submissions

    def submitted(self, chunk: Sequence[Prompt], reply: SubmitReply, result: SubmitResult, *, resent: bool = False) -> None:
        """Record the broker's answer to one submit of `chunk` into `result` (and the counters).

        `resent`: the chunk went out more than once (the reply to an earlier send was lost or late). The
        broker then answers ``duplicate`` for the prompts that earlier send delivered: they are this
        client's own, accepted and pending (before, they were reported rejected and never waited for)."""
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
            if rej.reason == "duplicate" and resent and rej.prompt_id in by_id:
                self.pending[rej.prompt_id] = by_id[rej.prompt_id]  # taken by the send whose reply was lost
                result.accepted.append(rej.prompt_id)
                self.counters["submit_resent_duplicates"] += 1
                accepted += 1
                continue
            result.rejected[rej.prompt_id] = rej.reason
            if rej.detail:
                result.details[rej.prompt_id] = rej.detail
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

    def rebased(self, version_epoch: int, version: int) -> None:
        """The pool was rebased to `version`, starting `version_epoch`: the trainer's version goes back to it, and
        groups made on weights above it in an earlier epoch are of the abandoned run."""
        self.version = version  # versions are newest-wins otherwise: the one place they go back
        self.rebases.append((version_epoch, version))

    def abandoned_floor(self, t: Trajectory) -> int | None:
        """The version of the rebase that abandoned the weights which made `t`, or None (its run goes on, or unknown)."""
        if t.version_epoch < 0:
            return None
        floors = [v for epoch, v in self.rebases if epoch > t.version_epoch]
        if not floors:
            return None
        sampled = sampled_versions(t.token_versions, t.loss_mask)
        floor = min(floors)
        return floor if len(sampled) and int(np.max(sampled)) > floor else None

    def observe_version(self, version: int) -> None:
        """A version announced by the trainer or reported by the broker; the newest wins."""
        if version > self.version:
            self.version = version

    # ------------------------------------------------------------------ results

    @property
    def ready(self) -> int:
        """DONE groups taken and not yet handed out."""
        return len(self._ready)

    def take(self, groups: Iterable[GroupResult], max_staleness: int | None, stale_policy: str | None = None,
             max_staleness_keep: int | None = None) -> TakeOutcome:
        """File the groups of one pull: deduplicate, judge staleness, queue for delivery.

        `stale_policy` and `max_staleness_keep` override the ledger's own for these groups.
        """
        policy, keep_limit = self._policy(stale_policy, max_staleness_keep, max_staleness)
        out = TakeOutcome()
        for g in groups:
            self._take_one(g, max_staleness, policy, keep_limit, out)
        return out

    def _take_one(self, g: GroupResult, max_staleness: int | None, policy: str, keep_limit: int | None,
                  out: TakeOutcome) -> None:
        if g.prompt_id in self._originals:
            # sent again by the broker (it resends what is not acknowledged) while still held here, not yet
            # returned: it is acknowledged once, when returned
            self.counters["resent_held"] += 1
            return
        if g.prompt_id in self._delivered:
            self.counters["duplicates_dropped"] += 1
            # the broker redelivered something we already returned or dropped (our ack was lost): acknowledge it
            # again the same way, so a group dropped as stale still releases its capacity
            (self._to_ack_stale if g.prompt_id in self._stale_ids else self._to_ack).append(g.prompt_id)
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
            self.counters["wasted_tokens_duplicate"] += sum(len(t.output_ids) for t in g.trajectories) - sum(
                len(t.output_ids) for t in fresh)
        if not fresh:
            self._delivered.add(g.prompt_id)
            self._to_ack.append(g.prompt_id)  # nothing new in it: release it at once
            return
        if len(fresh) != len(g.trajectories):
            g = dataclasses.replace(g, trajectories=tuple(fresh))
        if self._judge(g, original, max_staleness, policy, keep_limit, out):
            self._delivered.add(g.prompt_id)
            self._originals[g.prompt_id] = original
            self._ready.append(g)

    def adopt(self, groups: Iterable[GroupResult]) -> TakeOutcome:
        """File the groups of a Batch that reached no waiting request (a pull given up on, a cancelled
        `get_batch`): kept, not discarded; the bound is judged when a `get_batch` returns them (`recheck`)."""
        self.counters["batches_adopted"] += 1
        return self.take(groups, None)

    def _judge(self, g: GroupResult, original: Prompt | None, max_staleness: int | None, policy: str,
               keep_limit: int | None, out: TakeOutcome) -> bool:
        """Judge one DONE group against the hard bound at the current version: True to keep it ready.

        A trajectory whose ``token_versions`` do not cover its ``output_ids`` has an
        unknown staleness: under a bound it fails it (whatever the policy).
        """
        if self.rebases and self._drop_abandoned(g, original, out):
            return False
        lags = [sampled_staleness(self.version, t) for t in g.trajectories]
        staleness = max(lags, default=0)
        unknown = sum(1 for t in g.trajectories if len(t.token_versions) < len(t.output_ids))
        kept = 0
        if max_staleness is not None and (unknown or staleness > max_staleness):
            if not unknown and policy == "keep" and keep_limit is not None and staleness <= keep_limit:
                kept = sum(1 for lag in lags if lag > max_staleness)
            else:
                self._drop_stale(g, original, staleness, max_staleness, keep_limit if policy == "keep" else None,
                                 policy, g.trajectories, out, unknown=unknown)
                return False
        self._staleness[g.prompt_id] = staleness
        self._kept_stale.pop(g.prompt_id, None)
        if kept:
            self._kept_stale[g.prompt_id] = kept
        return True

    def recheck(self, max_staleness: int | None, stale_policy: str | None = None,
                max_staleness_keep: int | None = None) -> TakeOutcome:
        """Judge every ready group again at the current version and this call's bound (before delivering).

        Groups taken by an earlier (timed-out) `get_batch` were judged at the version
        and bound of that call; the version may have moved since. Those now over
        the bound are dropped (or regenerated) exactly as in `take`.
        """
        policy, keep_limit = self._policy(stale_policy, max_staleness_keep, max_staleness)
        out = TakeOutcome()
        ready, self._ready = self._ready, deque()
        for g in ready:
            original = self._originals.get(g.prompt_id)
            if self._judge(g, original, max_staleness, policy, keep_limit, out):
                self._ready.append(g)
            else:
                self._originals.pop(g.prompt_id, None)
                self._staleness.pop(g.prompt_id, None)
                self._kept_stale.pop(g.prompt_id, None)
        return out

    def stale_bound(self, max_staleness: int | None, stale_policy: str | None = None, max_staleness_keep: int | None = None) -> int:
        """The staleness above which a group will not be trained under these arguments (-1: no bound):
        what the broker is told with each version (`SetVersion.stale_bound`), so it cancels what is doomed."""
        if max_staleness is None:
            return -1
        policy, keep_limit = self._policy(stale_policy, max_staleness_keep, max_staleness)
        if policy == "keep":
            return -1 if keep_limit is None else keep_limit
        return max_staleness

    def _policy(self, stale_policy: str | None, max_staleness_keep: int | None,
                max_staleness: int | None) -> tuple[str, int | None]:
        policy = self.stale_policy if stale_policy is None else stale_policy
        keep_limit = self.max_staleness_keep if max_staleness_keep is None else max_staleness_keep
        check_stale_policy(policy, keep_limit)
        if policy == "keep" and keep_limit is None and max_staleness is not None:
            keep_limit = 2 * max_staleness
        return policy, keep_limit

    def _regenerate(self, g: GroupResult, original: Prompt | None, out: TakeOutcome, meta: dict[str, object]) -> str:
        """The original prompt under a fresh id into `out.regenerate`; what to add to the drop's reason."""
        if original is None:
            self.counters["regenerate_skipped"] += 1
            out.not_regenerated.append(g.prompt_id)
            return ", not regenerated (prompt unknown to this client)"
        again = dataclasses.replace(original, prompt_id=self._new_prompt_id())
        out.regenerate.append(again)
        meta["regenerated_as"] = again.prompt_id
        return f", regenerated as {again.prompt_id}"

    def _drop_abandoned(self, g: GroupResult, original: Prompt | None, out: TakeOutcome) -> bool:
        """Drop (or regenerate) a group made on weights of an abandoned run; False when it was not."""
        floors = [(t, f) for t in g.trajectories if (f := self.abandoned_floor(t)) is not None]
        if not floors:
            return False
        t, floor = floors[0]
        top = int(np.max(sampled_versions(t.token_versions, t.loss_mask)))
        reason = (f"abandoned_run: made on version {top} of version epoch {t.version_epoch}, a run rebased to version "
                  f"{floor} since")
        meta: dict[str, object] = {"abandoned_run": True, "version_epoch": t.version_epoch}
        self._delivered.add(g.prompt_id)
        self._stale_ids.add(g.prompt_id)  # acknowledged as dropped_stale: the broker frees its capacity
        self.counters["dropped_abandoned"] += 1
        self.counters["wasted_tokens_stale"] += sum(len(x.output_ids) for x in g.trajectories)
        self._to_ack_stale.append(g.prompt_id)
        if self.abandoned_policy == "regenerate":
            reason += self._regenerate(g, original, out, meta)
        self._dropped_here.add(g.prompt_id)
        self._other.append(GroupResult(prompt_id=g.prompt_id, state=GroupState.DROPPED_STALE, reason=reason,
                                       attempts=g.attempts, worker_id=g.worker_id, metadata=meta))
        return True

    def _drop_stale(self, g: GroupResult, original: Prompt | None, staleness: int, max_staleness: int,
                    keep_limit: int | None, policy: str, fresh: Sequence[Trajectory], out: TakeOutcome,
                    unknown: int = 0) -> None:
        self._delivered.add(g.prompt_id)
        self._stale_ids.add(g.prompt_id)
        self.counters["dropped_stale"] += 1
        self.counters["wasted_tokens_stale"] += sum(len(t.output_ids) for t in fresh)
        self._to_ack_stale.append(g.prompt_id)
        out.dropped_stale.append((g.prompt_id, staleness))
        bound = max_staleness if keep_limit is None else keep_limit
        meta: dict[str, object] = {"staleness": staleness}
        if unknown:
            reason = (f"staleness unknown: {unknown} trajectories have fewer token_versions than output tokens "
                      f"(bound {max_staleness})")
            meta["staleness_unknown"] = unknown
        else:
            reason = f"staleness {staleness} > {bound}" + (" (max_staleness_keep)" if keep_limit is not None else "")
        if policy == "regenerate":
            reason += self._regenerate(g, original, out, meta)
        self._dropped_here.add(g.prompt_id)
        self._other.append(GroupResult(prompt_id=g.prompt_id, state=GroupState.DROPPED_STALE, reason=reason,
                                       attempts=g.attempts, worker_id=g.worker_id, metadata=meta))

    def deliver(self, n: int, *, started_at: float, now: float, dropped_before: int) -> tuple[RolloutBatch, list[int]]:
        """Hand out n ready groups and the other terminal states; they are acknowledged with the next pull.

        `started_at` is when the caller's `get_batch` began, `dropped_before` the
        ``dropped_stale`` counter then. Returns the batch and the staleness of each
        trajectory in it (for a metrics histogram).
        """
        if n > len(self._ready):
            raise ValueError(f"deliver({n}) with only {len(self._ready)} groups ready")
        groups = [self._ready.popleft() for _ in range(n)]
        for g in groups:
            self._originals.pop(g.prompt_id, None)
        other, self._other = self._other, []
        self._to_ack.extend(g.prompt_id for g in groups)
        # groups dropped here by the stale bound are acknowledged as dropped_stale (stale_acks), not again
        self._to_ack.extend(g.prompt_id for g in other if g.prompt_id not in self._dropped_here)
        self._dropped_here.difference_update(g.prompt_id for g in other)
        trajs = [t for g in groups for t in g.trajectories]
        tokens = sum(len(t.output_ids) for t in trajs)
        per_traj = {t.trajectory_id: sampled_staleness(self.version, t) for t in trajs}
        lags = [per_traj[t.trajectory_id] for t in trajs if len(t.token_versions)]
        kept = sum(self._kept_stale.pop(g.prompt_id, 0) for g in groups)
        reports = [PromptReport(g.prompt_id, g.state, g.reason, self._staleness.pop(g.prompt_id, None)) for g in groups]
        reports += [PromptReport(g.prompt_id, g.state, g.reason, _int_or_none(g.metadata.get("staleness")),
                                 _str_or_none(g.metadata.get("regenerated_as"))) for g in other]
        interval = now - self._last_batch_at if self._last_batch_at is not None else now - started_at
        self._last_batch_at = now
        self.counters["groups_delivered"] += len(groups)
        self.counters["trajectories_delivered"] += len(trajs)
        self.counters["tokens_delivered"] += tokens
        self.counters["kept_stale"] += kept
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
            "rollout/kept_stale": float(kept),
            "rollout/other_groups": float(len(other)),
        }
        batch = RolloutBatch(groups=groups, other=other, stats=stats, version=self.version, reports=reports,
                             staleness=per_traj)
        return batch, lags

    def has_other(self) -> bool:
        return bool(self._other)

    def take_other(self) -> list[GroupResult]:
        """Hand out the other terminal states buffered (FAILED, CANCELLED, DROPPED_STALE) without waiting for DONE
        groups; acknowledged with the next pull, as `deliver`'s are."""
        other, self._other = self._other, []
        self._to_ack.extend(g.prompt_id for g in other if g.prompt_id not in self._dropped_here)
        self._dropped_here.difference_update(g.prompt_id for g in other)
        return other

    def wasted_token_shares(self) -> dict[str, float]:
        """Generated tokens this client saw that never reached the trainer, as shares of all it saw, per reason.

        Only what reaches the client: tokens of groups the broker cancelled or failed never
        arrive (the broker counts those).
        """
        seen = self.counters["tokens_delivered"] + self.counters["wasted_tokens_stale"] + self.counters["wasted_tokens_duplicate"]
        if seen == 0:
            return {"stale_drop": 0.0, "duplicate": 0.0}
        return {"stale_drop": self.counters["wasted_tokens_stale"] / seen,
                "duplicate": self.counters["wasted_tokens_duplicate"] / seen}

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


def _int_or_none(x: object) -> int | None:
    return int(x) if isinstance(x, int) else None


def _str_or_none(x: object) -> str | None:
    return x if isinstance(x, str) else None


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
