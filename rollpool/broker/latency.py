"""Broker-side latency of every delivered group, from the broker's own clock: pure, bounded.

For each group handed to a client the broker keeps four timestamps (seconds of
its monotonic clock): ``queued`` (the Submit was read), ``dispatched`` (its Task
left the broker), ``result_in`` (the worker's Result was read) and ``delivered``
(the Batch that carries it left the broker). Queue wait is ``dispatched -
queued``, the worker's share ``result_in - dispatched``, hand-over ``delivered -
result_in``. Only the last `capacity` deliveries are kept (a ring), so memory is
fixed whatever the rate.

What these timestamps cannot see: time a message waits in the kernel or in
ZeroMQ's queues before the broker reads it (a broker that falls behind shows
its backlog there first), which is why the benchmark reports the load
generator's own submit-to-batch latency beside them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["LatencyLog", "STAGES"]

STAGES = ("queued", "dispatched", "result_in", "delivered")


class LatencyLog:
    """A ring of (queued, dispatched, result_in, delivered) rows."""

    __slots__ = ("capacity", "_rows", "_flat", "_n")

    def __init__(self, capacity: int = 65_536) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._rows = np.zeros((capacity, 4), dtype=np.float64)
        self._flat = self._rows.data.cast("B").cast("d")
        """The same memory as one flat run of doubles: four item stores per row, where a row view of
        `_rows` and four numpy item assignments cost about four times as much (one row per delivery)."""
        self._n = 0

    def record(self, queued: float, dispatched: float, result_in: float, delivered: float) -> None:
        i = (self._n % self.capacity) * 4
        flat = self._flat
        flat[i] = queued
        flat[i + 1] = dispatched
        flat[i + 2] = result_in
        flat[i + 3] = delivered
        self._n += 1

    @property
    def count(self) -> int:
        """Deliveries recorded since start (also those the ring no longer holds)."""
        return self._n

    def rows(self, last: int | None = None) -> np.ndarray[Any, np.dtype[np.float64]]:
        """The kept rows, oldest first (at most `last` of the newest)."""
        n = min(self._n, self.capacity)
        if last is not None:
            n = min(n, last)
        if n == 0:
            return np.zeros((0, 4), dtype=np.float64)
        end = self._n % self.capacity
        idx = (np.arange(end - n, end)) % self.capacity
        return self._rows[idx]

    def summary(self, last: int = 4096) -> dict[str, float]:
        """p50/p99 in ms of the newest `last` deliveries: end to end, queue wait, worker, hand-over."""
        r = self.rows(last)
        if not len(r):
            return {}
        out: dict[str, float] = {}
        for name, a, b in (("e2e", 0, 3), ("queue", 0, 1), ("worker", 1, 2), ("handover", 2, 3)):
            d = np.sort((r[:, b] - r[:, a]) * 1000.0).tolist()
            out[f"latency_{name}_p50_ms"] = round(_percentile(d, 50), 3)
            out[f"latency_{name}_p99_ms"] = round(_percentile(d, 99), 3)
        return out


def _percentile(ordered: list[float], q: float) -> float:
    """``np.percentile(values, q)`` (its default, linear method) of `ordered`, the values sorted, to the last bit.

    The counters call this every heartbeat; `np.percentile` partitions by way of `np.unique`, whose first call
    imports `numpy.ma` (a tenth of a second of the broker's loop, once, at the first status after a delivery)."""
    at = (len(ordered) - 1) * (q / 100)
    lo = math.floor(at)
    hi = min(lo + 1, len(ordered) - 1)
    a, b, t = ordered[lo], ordered[hi], at - lo
    diff = b - a
    return b - diff * (1 - t) if t >= 0.5 else a + diff * t  # numpy's `_lerp`: exact at both ends
