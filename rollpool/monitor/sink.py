"""`RedisMetricsSink`: the `MetricsSink` that writes a pool's live state to Redis.

Guarantees to the caller (a service's event loop or any thread):

* ``publish_state``, ``event`` and ``observe`` never block on the network and
  never raise: each takes a lock for a few microseconds and appends to a bounded
  buffer. When the buffer is full the oldest entry is dropped and counted
  (``stats()["dropped"]``).
* One writer thread owns the Redis connection. It drains the buffer into a
  batch, coalescing as it goes (only the newest state per entity is kept,
  histogram samples become per-bucket increments, time-series samples are
  throttled to one per ``series_interval_s`` per series), and writes the batch
  in one MULTI/EXEC round trip at most every ``flush_interval_s``.
* Redis down: the batch is kept (bounded: one state per entity, the bucket
  increments, the newest ``max_buffered`` events and samples) and the writer
  retries with exponential backoff up to ``max_backoff_s``; when Redis returns,
  the kept batch is written and reporting resumes. A batch whose EXEC reply was
  lost may be written twice (monitoring is at-least-once).
* ``close()`` makes one last flush attempt, bounded by ``close_timeout_s``.

The key layout is `rollpool.monitor.keys.PoolKeys`.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollpool.monitor.keys import DEFAULT_BOUNDS, DEFAULT_POOL, PoolKeys, bucket_for, encode_value
from rollpool.protocol.metrics import MetricsSink, NullMetricsSink

__all__ = [
    "RedisMetricsSink",
    "sink_from_url",
    "sink_from_args",
    "add_redis_arguments",
    "redis_url_from",
    "pool_from",
    "REDIS_URL_ENV",
    "POOL_ENV",
]

log = logging.getLogger(__name__)

REDIS_URL_ENV = "ROLLPOOL_REDIS_URL"
POOL_ENV = "ROLLPOOL_POOL"

_STATE = 0
_EVENT = 1
_OBSERVE = 2


@dataclass
class _SeriesAccumulator:
    total: float = 0.0
    count: int = 0
    max: float = -math.inf


@dataclass
class _Batch:
    """What one flush writes; survives failed flushes (bounded by construction)."""

    states: dict[str, tuple[dict[str, str], float | None]] = field(default_factory=dict)
    events: deque[dict[str, str]] = field(default_factory=deque)
    hist: dict[str, dict[str, int]] = field(default_factory=dict)
    hist_sum: dict[str, float] = field(default_factory=dict)
    samples: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    def empty(self) -> bool:
        return not (self.states or self.events or self.hist or self.samples)


class RedisMetricsSink:
    """``RedisMetricsSink(url, pool="default", source="broker")``; see the module docstring."""

    def __init__(
        self,
        url: str,
        pool: str = DEFAULT_POOL,
        *,
        source: str | None = None,
        max_buffered: int = 10_000,
        flush_interval_s: float = 0.25,
        events_maxlen: int = 10_000,
        series_len: int = 600,
        series_interval_s: float = 1.0,
        series_ttl_s: float = 3600.0,
        histogram_bounds: Mapping[str, Sequence[float]] | None = None,
        socket_timeout_s: float = 2.0,
        min_backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
        close_timeout_s: float = 2.0,
        start: bool = True,
    ) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.keys = PoolKeys(pool)
        self.pool = pool
        self.source = source or f"pid-{os.getpid()}"
        self.max_buffered = max(1, max_buffered)
        self.flush_interval_s = flush_interval_s
        self.events_maxlen = events_maxlen
        self.series_len = series_len
        self.series_interval_s = series_interval_s
        self.series_ttl_s = series_ttl_s
        self.histogram_bounds = {k: tuple(sorted({*v, math.inf})) for k, v in (histogram_bounds or {}).items()}
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self.close_timeout_s = close_timeout_s
        # Backoff is ours (below); redis-py's own retries would stall the writer.
        self._redis = redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        self._redis_errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._lock = threading.Lock()
        self._buffer: deque[tuple[int, str, Any, Any, float]] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._batch = _Batch()
        self._series_last: dict[str, float] = {}
        self._obs_acc: dict[str, _SeriesAccumulator] = {}
        self._hist_seen: set[str] = set()
        self._obs_window_start = time.time()
        self._stats = {
            "enqueued": 0,
            "dropped": 0,
            "dropped_in_batch": 0,
            "flushes": 0,
            "failed_flushes": 0,
            "errors": 0,
        }
        self.connected = False
        self._written_upto = 0  # the enqueued count that the last successful flush covered
        self._thread = threading.Thread(target=self._writer_loop, name=f"rollpool-metrics-{pool}", daemon=True)
        if start:
            self._thread.start()

    # ---- the MetricsSink API (called by services: never blocks, never raises) ----

    def publish_state(self, kind: str, key: str, fields: Mapping[str, Any], ttl_s: float | None = None) -> None:
        try:
            self._put((_STATE, kind, key, (dict(fields), ttl_s), time.time()))
        except Exception:  # noqa: BLE001 - the MetricsSink contract: never raises into the caller (counted)
            self._stats["errors"] += 1

    def event(self, kind: str, fields: Mapping[str, Any]) -> None:
        try:
            self._put((_EVENT, kind, "", dict(fields), time.time()))
        except Exception:  # noqa: BLE001 - the MetricsSink contract: never raises into the caller (counted)
            self._stats["errors"] += 1

    def observe(self, name: str, value: float) -> None:
        try:
            self._put((_OBSERVE, name, "", float(value), time.time()))
        except Exception:  # noqa: BLE001 - the MetricsSink contract: never raises into the caller (counted)
            self._stats["errors"] += 1

    def close(self) -> None:
        """Stop the writer after one last flush attempt (bounded by ``close_timeout_s``)."""
        try:
            self._stop.set()
            self._wake.set()
            if self._thread.is_alive():
                self._thread.join(self.close_timeout_s)
            if self._thread.is_alive():
                log.warning("metrics writer for pool %s did not finish within %.1f s", self.pool, self.close_timeout_s)
            else:
                self._redis.close()
        except Exception:
            log.debug("closing the metrics sink failed", exc_info=True)

    # ---- introspection ----

    def stats(self) -> dict[str, int | bool]:
        """Counters: enqueued, dropped (buffer full), flushes, failed_flushes, errors, buffered, connected."""
        with self._lock:
            out: dict[str, int | bool] = dict(self._stats)
            out["buffered"] = len(self._buffer)
        out["connected"] = self.connected
        return out

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything enqueued so far is written (tests, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout_s
        target = self._stats["enqueued"]
        while time.monotonic() < deadline:
            with self._lock:
                idle = not self._buffer and self._written_upto >= target
            if idle:
                return True
            self._wake.set()
            time.sleep(0.01)
        return False

    # ---- internals ----

    def _put(self, item: tuple[int, str, Any, Any, float]) -> None:
        with self._lock:
            if len(self._buffer) >= self.max_buffered:
                self._buffer.popleft()
                self._stats["dropped"] += 1
            self._buffer.append(item)
            self._stats["enqueued"] += 1
        self._wake.set()

    def _drain(self) -> int:
        """Move the buffer into the batch; returns the enqueued count it covers."""
        with self._lock:
            items = list(self._buffer)
            self._buffer.clear()
            upto = self._stats["enqueued"]
        for item in items:
            try:
                self._add(item)
            except Exception:
                self._stats["errors"] += 1
                log.debug("metrics item %r could not be encoded", item[:3], exc_info=True)
        self._roll_observation_window(time.time())
        return upto

    def _add(self, item: tuple[int, str, Any, Any, float]) -> None:
        op, name, key, payload, ts = item
        batch = self._batch
        if op == _STATE:
            fields, ttl_s = payload
            if not PoolKeys.valid_id(name) or ":" in name or (name != "broker" and not PoolKeys.valid_id(key)):
                raise ValueError(f"invalid state kind {name!r} or id {key!r}")
            encoded = {str(k): encode_value(v) for k, v in fields.items()}
            encoded.setdefault("updated_at", encode_value(round(ts, 3)))
            state_key = self.keys.state(name, key)
            batch.states[state_key] = (encoded, ttl_s)
            self._sample_state(name, key, fields, ts)
        elif op == _EVENT:
            entry = {str(k): encode_value(v) for k, v in payload.items()}
            entry["kind"] = name
            entry.setdefault("ts", encode_value(round(ts, 3)))
            entry.setdefault("src", self.source)
            batch.events.append(entry)
            while len(batch.events) > self.max_buffered:
                batch.events.popleft()
                self._stats["dropped_in_batch"] += 1
        elif op == _OBSERVE:
            value = float(payload)
            if math.isnan(value):
                return
            bounds = self.histogram_bounds.get(name, DEFAULT_BOUNDS)
            counts = batch.hist.setdefault(name, {})
            if name not in self._hist_seen:
                # Every bucket exists from the first write on, so scrapes always see the same bucket set.
                self._hist_seen.add(name)
                for bound in bounds:
                    counts.setdefault(bucket_for(bound, bounds), 0)
            bucket = bucket_for(value, bounds)
            counts[bucket] = counts.get(bucket, 0) + 1
            counts["count"] = counts.get("count", 0) + 1
            batch.hist_sum[name] = batch.hist_sum.get(name, 0.0) + value
            acc = self._obs_acc.setdefault(name, _SeriesAccumulator())
            acc.total += value
            acc.count += 1
            acc.max = max(acc.max, value)

    def _add_sample(self, series: str, ts: float, value: float) -> None:
        samples = self._batch.samples.setdefault(series, [])
        samples.append((ts, value))
        if len(samples) > self.series_len:
            del samples[: len(samples) - self.series_len]

    def _sample_state(self, kind: str, key: str, fields: Mapping[str, Any], ts: float) -> None:
        """Numeric fields of a state become time-series samples, at most one per interval per entity."""
        entity = "broker" if kind == "broker" else f"{kind}:{key}"
        last = self._series_last.get(entity)
        if last is not None and ts - last < self.series_interval_s:
            return
        self._series_last[entity] = ts
        for fname, value in fields.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or fname in ("pid", "last_seen"):
                continue
            self._add_sample(f"{entity}:{fname}", ts, float(value))

    def _roll_observation_window(self, now: float) -> None:
        """Observations become ``obs:{name}`` (mean) and ``obs:{name}:max`` samples once per interval."""
        if now - self._obs_window_start < self.series_interval_s:
            return
        self._obs_window_start = now
        for name, acc in self._obs_acc.items():
            if acc.count:
                self._add_sample(f"obs:{name}", now, acc.total / acc.count)
                self._add_sample(f"obs:{name}:max", now, acc.max)
        self._obs_acc.clear()

    def _write(self, batch: _Batch) -> None:
        pipe = self._redis.pipeline(transaction=True)
        for key, (fields, ttl_s) in batch.states.items():
            pipe.delete(key)
            if fields:
                pipe.hset(key, mapping=fields)  # type: ignore[arg-type]
                if ttl_s is not None and ttl_s > 0:
                    pipe.pexpire(key, max(1, int(ttl_s * 1000)))
        for entry in batch.events:
            pipe.xadd(self.keys.events, entry, maxlen=self.events_maxlen, approximate=True)  # type: ignore[arg-type]
        for name, counts in batch.hist.items():
            hkey = self.keys.hist(name)
            for bucket, n in counts.items():
                pipe.hincrby(hkey, bucket, n)
            pipe.hincrbyfloat(hkey, "sum", batch.hist_sum.get(name, 0.0))
        series_ttl_ms = max(1, int(self.series_ttl_s * 1000))
        for series, samples in batch.samples.items():
            skey = self.keys.series(series)
            pipe.rpush(skey, *(f"{ts:.3f} {value!r}" for ts, value in samples))
            pipe.ltrim(skey, -self.series_len, -1)
            pipe.pexpire(skey, series_ttl_ms)
        pipe.execute()

    def _writer_loop(self) -> None:
        backoff_s = self.min_backoff_s
        while True:
            stopping = self._stop.is_set()
            upto = self._drain()
            if self._batch.empty():
                self._written_upto = upto
                if stopping:
                    return
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            try:
                self._write(self._batch)
            except self._redis_errors as exc:
                self._stats["failed_flushes"] += 1
                if self.connected or self._stats["failed_flushes"] == 1:
                    log.warning("metrics: redis unavailable (%s); buffering and retrying with backoff", exc)
                self.connected = False
                if stopping:
                    return
                self._stop.wait(backoff_s * (0.5 + random.random()))
                backoff_s = min(self.max_backoff_s, backoff_s * 2)
                continue
            except Exception:
                # A bug or a bad value, not an outage: drop this batch rather than loop on it.
                self._stats["errors"] += 1
                log.exception("metrics: dropping a batch that could not be written")
            else:
                if not self.connected and self._stats["failed_flushes"]:
                    log.info("metrics: redis reachable again, reporting resumed")
                self.connected = True
                self._stats["flushes"] += 1
            self._batch = _Batch()
            self._written_upto = upto
            backoff_s = self.min_backoff_s
            if stopping:
                return
            # Batching: let calls accumulate for a flush interval before the next round trip.
            self._stop.wait(self.flush_interval_s)


def sink_from_url(url: str | None, pool: str = DEFAULT_POOL, **options: Any) -> MetricsSink:
    """A `RedisMetricsSink` for `url`, or a `NullMetricsSink` when `url` is None or empty."""
    if not url:
        return NullMetricsSink()
    return RedisMetricsSink(url, pool, **options)


def add_redis_arguments(parser: argparse.ArgumentParser, *, pool: bool = True) -> None:
    """``--redis-url`` (env ROLLPOOL_REDIS_URL) and, unless the service's config has it, ``--pool``."""
    parser.add_argument(
        "--redis-url",
        default=None,
        help=f"Redis URL for monitoring, e.g. redis://127.0.0.1:6379/0 (env {REDIS_URL_ENV}; none: no monitoring)",
    )
    if pool:
        parser.add_argument("--pool", default=None, help=f"pool name, the key prefix rollpool:{{pool}}: (env {POOL_ENV}; default {DEFAULT_POOL})")


def redis_url_from(args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """The flag, else ``$ROLLPOOL_REDIS_URL``, else None."""
    env = os.environ if environ is None else environ
    return getattr(args, "redis_url", None) or env.get(REDIS_URL_ENV) or None


def pool_from(args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The flag, else ``$ROLLPOOL_POOL``, else ``default``."""
    env = os.environ if environ is None else environ
    return getattr(args, "pool", None) or env.get(POOL_ENV) or DEFAULT_POOL


def sink_from_args(args: argparse.Namespace, **options: Any) -> MetricsSink:
    """`sink_from_url` with the URL and pool of `add_redis_arguments` flags or the environment."""
    return sink_from_url(redis_url_from(args), pool_from(args), **options)
