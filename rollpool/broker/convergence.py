"""Version convergence and fleet activation skew: pure bookkeeping, no I/O, the caller's clock.

`VersionConvergence` follows every published weight version from its publish (`published`) until
every live worker serves it or a newer one: then the version has *converged*, and its record says
how long that took from the publish, which worker was the slowest and when each live worker got
there (`worker_at`, called whenever a worker's served version moves). A worker that leaves (`lost`)
no longer holds a version back; a worker that joins does, until it catches up. "Serves v or a
newer one" is the rule because workers fetch the newest version: one that skips v for v+1 serves
v's successor, and v converges when the last worker is past it.

`FleetRound` (fleet activation, ``BrokerConfig.activation = "fleet"``) records one activation: the
workers told to switch together and when each reported its switch done (`ApplyDone` as the broker
read it). Its skew is the last switch minus the first, in broker time: an upper bound of the true
skew by the spread of the workers' one-way delays.

Memory is bounded: at most `keep` versions are followed (the oldest open one is dropped as
superseded past that), and the figures keep the last `keep` convergence times and skews.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ConvergenceRecord", "FleetRound", "VersionConvergence", "percentile"]

MAX_LISTED_WORKERS = 16
"""Workers named per version in a record's ``applied_s`` (the slowest first): a status reply stays small in a large pool."""


def percentile(values: Iterable[float], q: float) -> float:
    """The q-quantile (0..1) by the nearest-rank rule; 0.0 for no values."""
    xs = sorted(values)
    if not xs:
        return 0.0
    rank = max(1, min(len(xs), math.ceil(q * len(xs))))
    return float(xs[rank - 1])


@dataclass(slots=True)
class _Open:
    version: int
    published_at: float
    applied: dict[str, float] = field(default_factory=dict)
    """Live worker id -> when the broker first saw it serve this version or a newer one (a worker that leaves is
    taken out, so the version has converged when this holds every live worker: a count, not a scan)."""


@dataclass(frozen=True, slots=True)
class ConvergenceRecord:
    version: int
    published_at: float
    converged_s: float
    """From the publish until every live worker served it (or newer)."""
    slowest_worker: str
    workers: int
    applied_s: tuple[tuple[str, float], ...]
    """(worker id, seconds after the publish) of the slowest `MAX_LISTED_WORKERS` workers, slowest first."""

    def as_dict(self) -> dict[str, Any]:
        return {"version": self.version, "converged_s": round(self.converged_s, 6), "slowest_worker": self.slowest_worker,
                "workers": self.workers, "applied_s": {w: round(s, 6) for w, s in self.applied_s}}


class VersionConvergence:
    """Per published version: when each live worker served it, and when all of them did."""

    def __init__(self, keep: int = 64) -> None:
        self.keep = keep
        self._open: dict[int, _Open] = {}
        self.records: deque[ConvergenceRecord] = deque(maxlen=keep)
        self.published_versions: deque[int] = deque(maxlen=4 * keep)
        """Versions announced, oldest first (bounded): tells a version never published from one evicted."""
        self.superseded = 0
        """Versions dropped before converging because more than `keep` were open."""

    def published(self, version: int, now: float, workers: Mapping[str, int]) -> None:
        """The trainer announced `version`; `workers` maps each live worker to the version it serves."""
        self.published_versions.append(version)
        o = _Open(version, now)
        for wid, v in workers.items():
            if v >= version:
                o.applied[wid] = now
        self._open[version] = o
        while len(self._open) > self.keep:
            del self._open[min(self._open)]
            self.superseded += 1

    def was_published(self, version: int) -> bool | None:
        """True / False when `version` is within the remembered history, None when it is older than that."""
        if not self.published_versions or version < self.published_versions[0]:
            return None
        return version in self.published_versions

    def worker_at(self, worker_id: str, version: int, now: float) -> None:
        """A worker serves `version` now (a heartbeat, an ApplyDone or a hello said so)."""
        for v, o in self._open.items():
            if v <= version and worker_id not in o.applied:
                o.applied[worker_id] = now

    def lost(self, worker_id: str) -> None:
        """A worker left: it no longer holds any version back."""
        for o in self._open.values():
            o.applied.pop(worker_id, None)

    def check(self, live: int) -> list[ConvergenceRecord]:
        """Versions all `live` live workers now serve (or are past): closed, and returned oldest first.

        O(versions open) per call: `applied` holds live workers only (`lost` takes the others out)."""
        if live <= 0 or not self._open:
            return []
        done: list[ConvergenceRecord] = []
        for v in sorted(self._open):
            o = self._open[v]
            if len(o.applied) < live:
                continue
            times = sorted(((t - o.published_at, wid) for wid, t in o.applied.items()), reverse=True)
            rec = ConvergenceRecord(version=v, published_at=o.published_at, converged_s=max(0.0, times[0][0]),
                                    slowest_worker=times[0][1], workers=len(times),
                                    applied_s=tuple((wid, max(0.0, s)) for s, wid in times[:MAX_LISTED_WORKERS]))
            del self._open[v]
            self.records.append(rec)
            done.append(rec)
        return done

    def reset(self) -> None:
        """A rebase: every version followed so far belongs to an abandoned run."""
        self._open.clear()
        self.published_versions.clear()

    def pending(self, live: Iterable[str]) -> list[dict[str, Any]]:
        """Versions not converged yet: how many live workers serve each, and who does not."""
        ids = list(live)
        out = []
        for v in sorted(self._open):
            o = self._open[v]
            missing = [wid for wid in ids if wid not in o.applied]
            out.append({"version": v, "workers_at": len(ids) - len(missing), "workers": len(ids), "waiting_for": missing[:MAX_LISTED_WORKERS]})
        return out

    def figures(self) -> dict[str, Any]:
        """Flat numbers for the broker's status hash (p50/p95 over the recent converged versions)."""
        secs = [r.converged_s for r in self.records]
        last = self.records[-1] if self.records else None
        return {
            "convergence_versions": len(secs),
            "convergence_last_version": last.version if last else -1,
            "convergence_last_s": round(last.converged_s, 6) if last else 0.0,
            "convergence_slowest_worker": last.slowest_worker if last else "",
            "convergence_p50_s": round(percentile(secs, 0.5), 6),
            "convergence_p95_s": round(percentile(secs, 0.95), 6),
            "convergence_open": len(self._open),
        }


@dataclass(slots=True)
class FleetRound:
    """One fleet activation: who was told to switch to which version, and when each reported the switch done."""

    version: int
    activated_at: float
    workers: dict[str, int]
    """worker id -> the version it was told to switch to (its staged one: `version` or newer)."""
    done_at: dict[str, float] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    held_out: tuple[str, ...] = ()
    """Live workers that had not staged it by the deadline (out of dispatch until they serve it)."""

    def finished(self) -> bool:
        return all(w in self.done_at or w in self.failed for w in self.workers)

    def skew_ms(self) -> float:
        """The last switch minus the first, among the workers that switched (0.0 for fewer than two)."""
        if len(self.done_at) < 2:
            return 0.0
        return (max(self.done_at.values()) - min(self.done_at.values())) * 1000.0

    def as_dict(self) -> dict[str, Any]:
        return {"version": self.version, "workers": len(self.workers), "switched": len(self.done_at), "failed": len(self.failed),
                "held_out": list(self.held_out[:MAX_LISTED_WORKERS]), "skew_ms": round(self.skew_ms(), 3),
                "switch_s": round(max(self.done_at.values()) - self.activated_at, 6) if self.done_at else 0.0}
