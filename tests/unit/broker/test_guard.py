"""The broker's per-peer bookkeeping (rollpool.broker.guard), without sockets."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from rollpool.broker.guard import BoundedMap, PendingPulls, bound_inflight
from rollpool.protocol import InflightTask


@dataclass(eq=False)
class _Pull:
    identity: bytes
    n: int


def test_pending_pulls_fifo_across_peers_with_a_cap_per_peer() -> None:
    q = PendingPulls(per_peer=2)
    a1, a2, b1 = _Pull(b"a", 1), _Pull(b"a", 2), _Pull(b"b", 1)
    for x in (a1, b1, a2):
        q.append(x)
    assert q.full(b"a") and not q.full(b"b") and len(q) == 3 and q.peers == 2
    q.remove(b1)
    assert [x.n for x in q] == [1, 2] and not q.full(b"b")
    with pytest.raises(ValueError):
        q.remove(b1)
    assert q.popleft() is a1 and not q.full(b"a")
    assert q.popleft() is a2 and not q and q.peers == 0
    with pytest.raises(IndexError):
        q.popleft()


def test_pending_pulls_removal_does_not_scan() -> None:
    """24,000 waiting pulls removed from the middle: each removal is a dict pop, not a list scan."""
    q = PendingPulls(per_peer=1)
    pulls = [_Pull(f"p{i}".encode(), i) for i in range(24_000)]
    for x in pulls:
        q.append(x)
    for x in pulls[::-1]:  # the worst order for a deque.remove (each at the far end)
        q.remove(x)
    assert len(q) == 0 and q.peers == 0


def test_bounded_map_forgets_the_least_recently_set() -> None:
    m: BoundedMap[str, int] = BoundedMap(cap=3)
    for i in range(5):
        m[f"k{i}"] = i
    assert len(m) == 3 and "k0" not in m and m.get("k4") == 4 and m.evicted == 2
    m["k2"] = 20  # refreshed: now the newest
    m["k5"] = 5
    assert "k3" not in m and m["k2"] == 20


def test_bound_inflight_dedups_and_caps_at_capacity() -> None:
    ts = [InflightTask(task_id="t1", prompt_id="p1", group_size=2), InflightTask(task_id="t1", prompt_id="p1", group_size=2),
          InflightTask(task_id="t2", prompt_id="p1", group_size=2), InflightTask(task_id="t3", prompt_id="p3", group_size=2),
          InflightTask(task_id="t4", prompt_id="p4", group_size=1)]
    keep, refused = bound_inflight(ts, capacity=4)
    assert [t.task_id for t in keep] == ["t1", "t3"] and refused == ["t1", "t2", "t4"]


def test_per_client_delivery_maps_do_not_outlive_their_groups() -> None:
    """200 client ids each given a group and acknowledging it leave no per-client entry behind."""
    from tests.unit.broker.test_state import finish, join, make, prompt

    s = make()
    w = join(s, "w", capacity=1)
    for i in range(200):
        s.submit([prompt(f"p{i}")], 0.0)
        ((_, g),) = s.dispatch(0.0)
        finish(s, w, g.task_id)
        s.credit(w, 1, 0.0)
        (got,) = s.pull(f"client-{i}", 1)
        s.ack([got.prompt_id])
    assert s._delivered == {}
