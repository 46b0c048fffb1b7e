"""`PoolReader`: one consistent-enough snapshot of a pool's monitoring keys.

A snapshot is read with one SCAN over ``rollpool:{pool}:*`` and one pipelined
round trip for the values; it is a `PoolState`, whose ``to_dict()`` is the JSON
of ``rollpool status --json`` and of the exporter's ``/api/state``. A worker is
alive exactly while its hash exists (its TTL is three heartbeats). Reading
never writes. Redis errors propagate to the caller (a CLI reports them).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from rollpool.monitor.keys import DEFAULT_POOL, PoolKeys, decode_hash, decode_value, parse_bound

__all__ = ["PoolReader", "PoolState", "HistogramState", "EventRecord"]


@dataclass(frozen=True)
class HistogramState:
    """Non-cumulative buckets as ``(upper bound, count)`` sorted by bound, plus totals."""

    buckets: list[tuple[float, int]]
    count: int
    sum: float

    def cumulative(self) -> list[tuple[float, int]]:
        out: list[tuple[float, int]] = []
        running = 0
        for bound, n in self.buckets:
            running += n
            out.append((bound, running))
        return out


@dataclass(frozen=True)
class EventRecord:
    id: str
    ts: float
    kind: str
    src: str
    fields: dict[str, Any]


@dataclass(frozen=True)
class PoolState:
    pool: str
    time: float
    broker: dict[str, Any] | None
    workers: dict[str, dict[str, Any]]
    entities: dict[str, dict[str, dict[str, Any]]]  # relay / client / other kinds: kind -> id -> fields
    events: list[EventRecord]
    histograms: dict[str, HistogramState]
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    def worker_version_lag(self) -> dict[str, int]:
        """Broker version minus each worker's weight version (workers reporting one).

        None yet (left out) while either side has no version (-1: nothing published, or nothing applied):
        a lag of -1 before the first publish would read as a worker ahead of the trainer.
        """
        version = self.broker.get("version") if self.broker else None
        if not isinstance(version, int) or version < 0:
            return {}
        return {
            wid: version - int(w["weight_version"])
            for wid, w in self.workers.items()
            if isinstance(w.get("weight_version"), int) and int(w["weight_version"]) >= 0
        }

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["histograms"] = {
            name: {"buckets": [[_bound_json(b), n] for b, n in h.buckets], "count": h.count, "sum": h.sum}
            for name, h in self.histograms.items()
        }
        out["series"] = {name: [[t, v] for t, v in pts] for name, pts in self.series.items()}
        out["workers_alive"] = len(self.workers)
        out["version_lag"] = self.worker_version_lag()
        return out


def _bound_json(bound: float) -> float | str:
    return "+Inf" if bound == float("inf") else bound


class PoolReader:
    """``PoolReader(url, pool).snapshot()``; a thin, synchronous reader for CLIs and the exporter."""

    def __init__(self, url: str, pool: str = DEFAULT_POOL, *, socket_timeout_s: float = 2.0) -> None:
        import redis

        self.keys = PoolKeys(pool)
        self.pool = pool
        self._redis = redis.Redis.from_url(
            url, decode_responses=True, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s
        )

    def close(self) -> None:
        self._redis.close()

    def __enter__(self) -> PoolReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def snapshot(self, *, events: int = 50, series: bool = False, series_points: int = 600) -> PoolState:  # noqa: C901 - grandfathered: one branch per key kind of the layout
        prefix = self.keys.prefix
        keys = sorted(self._redis.scan_iter(match=prefix + "*", count=1000))
        pipe = self._redis.pipeline(transaction=False)
        plan: list[tuple[str, str]] = []  # (role, key) in pipeline order
        for key in keys:
            rest = key[len(prefix) :]
            if rest == "events":
                continue
            if rest == "broker":
                plan.append(("broker", key))
                pipe.hgetall(key)
            elif rest.startswith("hist:"):
                plan.append(("hist", key))
                pipe.hgetall(key)
            elif rest.startswith("series:"):
                if series:
                    plan.append(("series", key))
                    pipe.lrange(key, -series_points, -1)
            elif ":" in rest:
                plan.append(("entity", key))
                pipe.hgetall(key)
                plan.append(("ttl", key))
                pipe.pttl(key)
        if events > 0:
            pipe.xrevrange(self.keys.events, count=events)
        replies = pipe.execute()
        now = time.time()

        broker: dict[str, Any] | None = None
        workers: dict[str, dict[str, Any]] = {}
        entities: dict[str, dict[str, dict[str, Any]]] = {}
        histograms: dict[str, HistogramState] = {}
        series_out: dict[str, list[tuple[float, float]]] = {}
        last_entity: dict[str, Any] | None = None
        for (role, key), reply in zip(plan, replies, strict=False):
            rest = key[len(prefix) :]
            if role == "broker" and reply:
                broker = _with_age(decode_hash(reply), now)
            elif role == "hist" and reply:
                histograms[rest[len("hist:") :]] = _histogram(reply)
            elif role == "series":
                series_out[rest[len("series:") :]] = _samples(reply)
            elif role == "entity":
                last_entity = None
                if reply:  # an empty reply: the hash expired between SCAN and HGETALL
                    kind, _, entity_id = rest.partition(":")
                    last_entity = _with_age(decode_hash(reply), now)
                    if kind == "worker":
                        workers[entity_id] = last_entity
                    else:
                        entities.setdefault(kind, {})[entity_id] = last_entity
            elif role == "ttl" and last_entity is not None:
                last_entity["ttl_s"] = reply / 1000.0 if isinstance(reply, int) and reply >= 0 else None
        event_list = [_event(eid, raw) for eid, raw in reversed(replies[len(plan)])] if events > 0 else []
        return PoolState(
            pool=self.pool,
            time=now,
            broker=broker,
            workers=workers,
            entities=entities,
            events=event_list,
            histograms=histograms,
            series=series_out,
        )


def _with_age(fields: dict[str, Any], now: float) -> dict[str, Any]:
    updated = fields.get("updated_at")
    if isinstance(updated, int | float):
        fields["age_s"] = round(max(0.0, now - float(updated)), 3)
    return fields


def _histogram(raw: dict[str, str]) -> HistogramState:
    buckets = sorted((parse_bound(k[3:]), int(v)) for k, v in raw.items() if k.startswith("le:"))
    return HistogramState(buckets=buckets, count=int(raw.get("count", 0)), sum=float(raw.get("sum", 0.0)))


def _samples(raw: list[str]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for item in raw:
        ts, _, value = item.partition(" ")
        try:
            out.append((float(ts), float(value)))
        except ValueError:
            continue
    return out


def _event(event_id: str, raw: dict[str, str]) -> EventRecord:
    fields = {k: decode_value(k, v) for k, v in raw.items() if k not in ("kind", "ts", "src")}
    try:
        ts = float(raw.get("ts", ""))
    except ValueError:
        ts = int(event_id.split("-")[0]) / 1000.0
    return EventRecord(id=event_id, ts=ts, kind=raw.get("kind", "?"), src=raw.get("src", ""), fields=fields)
