"""The broker's limits on what one peer may make it hold, and the refusals they cause, counted.

Kept apart from the state machine and the service so the policy reads in one
place and the service changes by a few lines:

- `BROKER_LIMITS`: the decoding limits of both ports (a tighter value budget
  than the library default: the broker's largest legitimate headers, a
  512-prompt Submit or a 1,024-sample Result, hold well under 100,000 values).
- `PendingPulls`: the long-polls waiting for results, FIFO across peers, with
  O(1) add, remove and pop and at most `per_peer` waiting per peer identity
  (a flood of pulls from one client is answered with an error that names the
  limit instead of queueing without bound).
- `BoundedMap`: identity -> client id, least recently used evicted beyond a cap.
- `bound_inflight`: the tasks a hello re-announces, deduplicated and capped at
  the worker's capacity (the rest are refused), so a hello cannot make the
  broker adopt an unbounded number of groups after a restart.
- `Refusals`: counters by limit (``refused.limit.NAME``) merged into the
  broker's status counters, which `rollpool top` shows.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

from rollpool.protocol import InflightTask, Limits
from rollpool.protocol.roles import SERVER_SOCKETS

__all__ = [
    "BROKER_LIMITS",
    "WORKER_PORT_TYPES",
    "CLIENT_PORT_TYPES",
    "PendingPulls",
    "BoundedMap",
    "bound_inflight",
    "Refusals",
    "PULLS_PER_PEER",
    "MAX_CLIENT_IDENTITIES",
]

BROKER_LIMITS = Limits(max_header_objects=262_144)
WORKER_PORT_TYPES = SERVER_SOCKETS["broker.worker"].accepts
CLIENT_PORT_TYPES = SERVER_SOCKETS["broker.client"].accepts
PULLS_PER_PEER = 64
"""Long-polls one client identity may have waiting (a trainer needs one or two)."""
MAX_CLIENT_IDENTITIES = 4096

K = TypeVar("K")
V = TypeVar("V")


class Refusals:
    """Counts of refused input by the limit that refused it."""

    __slots__ = ("by_limit",)

    def __init__(self) -> None:
        self.by_limit: dict[str, int] = {}

    def count(self, limit: str | None) -> None:
        if limit:
            self.by_limit[limit] = self.by_limit.get(limit, 0) + 1

    def counters(self) -> dict[str, int]:
        return {f"refused.limit.{k}": v for k, v in self.by_limit.items()}


class PendingPulls:
    """Waiting long-polls: a deque's interface (append, popleft, remove, len, iter, clear), all O(1).

    Items are any objects with an ``identity`` attribute (the peer); `full`
    says whether that peer already has `per_peer` waiting.
    """

    def __init__(self, per_peer: int = PULLS_PER_PEER) -> None:
        self.per_peer = per_peer
        self._items: dict[int, Any] = {}  # insertion-ordered: FIFO across peers
        self._per_peer: dict[bytes, int] = {}

    def full(self, identity: bytes) -> bool:
        return self._per_peer.get(identity, 0) >= self.per_peer

    def append(self, pull: Any) -> None:
        key = id(pull)
        if key in self._items:
            return
        self._items[key] = pull
        ident = pull.identity
        self._per_peer[ident] = self._per_peer.get(ident, 0) + 1

    def _forget(self, pull: Any) -> None:
        ident = pull.identity
        n = self._per_peer.get(ident, 0) - 1
        if n > 0:
            self._per_peer[ident] = n
        else:
            self._per_peer.pop(ident, None)

    def remove(self, pull: Any) -> None:
        if self._items.pop(id(pull), None) is None:
            raise ValueError("not a pending pull")
        self._forget(pull)

    def popleft(self) -> Any:
        if not self._items:
            raise IndexError("pop from an empty PendingPulls")
        key = next(iter(self._items))
        pull = self._items.pop(key)
        self._forget(pull)
        return pull

    def clear(self) -> None:
        self._items.clear()
        self._per_peer.clear()

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._items.values()))

    @property
    def peers(self) -> int:
        return len(self._per_peer)


class BoundedMap(Generic[K, V]):
    """A dict that forgets its least recently set key beyond `cap` (``get``/``[]=``/``pop``/``in``/``len``)."""

    def __init__(self, cap: int = MAX_CLIENT_IDENTITIES) -> None:
        self.cap = cap
        self._d: OrderedDict[K, V] = OrderedDict()
        self.evicted = 0

    def __setitem__(self, key: K, value: V) -> None:
        d = self._d
        if key in d:
            d.move_to_end(key)
        d[key] = value
        while len(d) > self.cap:
            d.popitem(last=False)
            self.evicted += 1

    def __getitem__(self, key: K) -> V:
        return self._d[key]

    def get(self, key: K, default: V | None = None) -> V | None:
        return self._d.get(key, default)

    def pop(self, key: K, default: V | None = None) -> V | None:
        return self._d.pop(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._d

    def __len__(self) -> int:
        return len(self._d)


def bound_inflight(inflight: Sequence[InflightTask], capacity: int) -> tuple[list[InflightTask], list[str]]:
    """The re-announced tasks a hello may adopt (distinct prompts, at most `capacity` samples) and the refused ids."""
    keep: list[InflightTask] = []
    refused: list[str] = []
    seen_tasks: set[str] = set()
    seen_prompts: set[str] = set()
    samples = 0
    for t in inflight:
        if t.task_id in seen_tasks or t.prompt_id in seen_prompts or samples + max(t.group_size, 1) > capacity:
            refused.append(t.task_id)
            continue
        seen_tasks.add(t.task_id)
        seen_prompts.add(t.prompt_id)
        samples += max(t.group_size, 1)
        keep.append(t)
    return keep, refused
