"""The monitoring seam: every service reports through a `MetricsSink`.

A sink must never block or raise into the caller: rollout goes on whether or
not monitoring works. `NullMetricsSink` is the default; the Redis sink lives
in `rollpool.monitor`; `MemoryMetricsSink` records calls for tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

__all__ = ["MetricsSink", "NullMetricsSink", "MemoryMetricsSink"]


@runtime_checkable
class MetricsSink(Protocol):
    def publish_state(self, kind: str, key: str, fields: Mapping[str, Any], ttl_s: float | None = None) -> None:
        """Replace the live state of one entity (``kind`` ``worker``/``broker``/``relay``/``client``)."""

    def event(self, kind: str, fields: Mapping[str, Any]) -> None:
        """Append one event (worker joined or lost, task requeued, version applied, ...)."""

    def observe(self, name: str, value: float) -> None:
        """Add one sample to a histogram/time series (e.g. ``staleness``)."""

    def close(self) -> None:
        """Flush what is buffered (bounded time) and release resources."""


class NullMetricsSink:
    """Discards everything."""

    def publish_state(self, kind: str, key: str, fields: Mapping[str, Any], ttl_s: float | None = None) -> None:
        return None

    def event(self, kind: str, fields: Mapping[str, Any]) -> None:
        return None

    def observe(self, name: str, value: float) -> None:
        return None

    def close(self) -> None:
        return None


class MemoryMetricsSink:
    """Keeps everything in memory (a test double and a debugging aid)."""

    def __init__(self) -> None:
        self.states: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.observations: dict[str, list[float]] = {}
        self.closed = False

    def publish_state(self, kind: str, key: str, fields: Mapping[str, Any], ttl_s: float | None = None) -> None:
        self.states[(kind, key)] = dict(fields)

    def event(self, kind: str, fields: Mapping[str, Any]) -> None:
        self.events.append((kind, dict(fields)))

    def observe(self, name: str, value: float) -> None:
        self.observations.setdefault(name, []).append(value)

    def close(self) -> None:
        self.closed = True
