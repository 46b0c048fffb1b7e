"""The Redis key layout of a pool, and how values are written into it (pure, no I/O).

Every key lives under ``rollpool:{pool}:``:

=====================================  ==========  ===========================================
key                                    type        what
=====================================  ==========  ===========================================
``worker:{worker_id}``                 hash + TTL  a worker's live state (TTL three heartbeats)
``relay:{relay_id}``, ``client:{id}``  hash + TTL  other entities' live state (same shape)
``broker``                             hash        the broker's counters and gauges
``events``                             stream      joins, losses, requeues, publishes, applies
``hist:{name}``                        hash        a histogram (``staleness``): bucket counts
``series:{name}``                      list        a short time series, ``"{unix_s} {value}"``
=====================================  ==========  ===========================================

Hash values are text: a ``str`` is stored as is, anything else as JSON (so
``redis-cli HGET`` shows ``idle`` or ``12``). `decode_value` reverses it; the
fields of `STRING_FIELDS` always stay text (an epoch of hex digits is not a
number). Histogram buckets are non-cumulative: field ``le:{bound}`` counts the
samples ``v`` with ``previous bound < v <= bound``; ``count`` and ``sum`` are the
totals.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

from rollpool.protocol.errors import ConfigError

__all__ = [
    "KEY_PREFIX",
    "DEFAULT_POOL",
    "DEFAULT_BOUNDS",
    "STRING_FIELDS",
    "PoolKeys",
    "encode_value",
    "decode_value",
    "decode_hash",
    "bucket_for",
    "format_bound",
    "parse_bound",
]

KEY_PREFIX = "rollpool"
DEFAULT_POOL = "default"
# Fits version lags (integers, mostly small) and short durations alike.
DEFAULT_BOUNDS: tuple[float, ...] = (0, 1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64, math.inf)
STRING_FIELDS = frozenset(
    {"epoch", "host", "engine", "model", "state", "worker_id", "worker", "kind", "src", "error", "message", "reason"}
)

_POOL_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_ID_RE = re.compile(r"^[^\s*?\[\]]{1,200}$")


class PoolKeys:
    """The key names of one pool (``PoolKeys("default").worker("w1")``)."""

    def __init__(self, pool: str = DEFAULT_POOL) -> None:
        if not _POOL_RE.match(pool):
            raise ConfigError(f"pool: {pool!r} must be 1-64 characters of letters, digits, '_', '.', '-'")
        self.pool = pool
        self.prefix = f"{KEY_PREFIX}:{pool}:"

    @property
    def broker(self) -> str:
        return self.prefix + "broker"

    @property
    def events(self) -> str:
        return self.prefix + "events"

    def worker(self, worker_id: str) -> str:
        return self.state("worker", worker_id)

    def state(self, kind: str, key: str) -> str:
        """The hash of one entity; the broker has a single hash whatever its key."""
        if kind == "broker":
            return self.broker
        return f"{self.prefix}{kind}:{key}"

    def state_pattern(self, kind: str) -> str:
        """A SCAN pattern for every entity hash of `kind`."""
        return f"{self.prefix}{kind}:*"

    def hist(self, name: str) -> str:
        return f"{self.prefix}hist:{name}"

    def series(self, name: str) -> str:
        return f"{self.prefix}series:{name}"

    def strip(self, key: str, middle: str) -> str:
        """``rollpool:p:worker:w1`` -> ``w1`` for ``middle="worker:"``."""
        return key[len(self.prefix) + len(middle) :]

    @staticmethod
    def valid_id(entity_id: str) -> bool:
        """Ids become key suffixes: no whitespace or glob characters (they would break SCAN patterns)."""
        return bool(_ID_RE.match(entity_id))


def encode_value(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    try:
        return json.dumps(value, separators=(",", ":"), default=str)
    except (TypeError, ValueError):
        return str(value)


def decode_value(field: str, raw: str) -> Any:
    if field in STRING_FIELDS or raw == "":
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def decode_hash(raw: dict[str, str]) -> dict[str, Any]:
    return {k: decode_value(k, v) for k, v in raw.items()}


def format_bound(bound: float) -> str:
    if math.isinf(bound):
        return "+Inf"
    return str(int(bound)) if float(bound).is_integer() else repr(float(bound))


def parse_bound(text: str) -> float:
    return math.inf if text == "+Inf" else float(text)


def bucket_for(value: float, bounds: Sequence[float]) -> str:
    """The ``le:`` field that counts `value` (the last bound, ``+Inf``, catches the rest)."""
    for bound in bounds:
        if value <= bound:
            return "le:" + format_bound(bound)
    return "le:+Inf"
