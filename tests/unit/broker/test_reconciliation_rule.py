"""Issue 20: the reconciliation rule of DESIGN.md as a pure-state test (no sockets, an injected clock).

The rule: every task carries a per-worker dispatch sequence number; each
worker heartbeat echoes the highest one it received, the tasks it holds and
its free capacity (absolute). A lease at or below the echoed number that the
worker does not report is requeued at once; credit is the reported free
capacity less what was dispatched after the echoed number. So a heartbeat
that crosses a dispatch changes nothing.

Written against this proposed interface of `BrokerState` (the fix may name
things differently; then adjust this file, keeping the scenarios):

- `dispatch()` stamps each lease: ``Group.dispatch_seq`` (per worker, from 1,
  increasing), and ``WorkerInfo.dispatch_seq`` is the last one given;
- ``heartbeat(w, now, *, version, state, tokens_total, seen_dispatch_seq,
  inflight_task_ids, free_capacity)`` reconciles, counting
  ``leases_reconciled`` and ``credit_corrections``.

The fix names the heartbeat fields as the broker-scale wire has them: ``dispatch_seq``
(the echo), ``held`` (the worker's full held list) and ``free_capacity``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rollpool.broker.config import BrokerConfig
from rollpool.broker.state import BrokerState, Phase, WorkerInfo
from rollpool.protocol import Prompt


def _state() -> tuple[BrokerState, WorkerInfo]:
    s = BrokerState(BrokerConfig(heartbeat_interval_s=1.0, task_timeout_s=600.0))
    s.add_worker(worker_id="w", identity=b"w", capacity=2, credits=2, now=0.0)
    return s, s.workers["w"]


def _submit(s: BrokerState, *pids: str) -> None:
    s.submit([Prompt(prompt_id=p, input_ids=np.arange(3, dtype=np.int32), group_size=1) for p in pids], 0.0)


def _beat(s: BrokerState, w: WorkerInfo, now: float, seen: int, inflight: tuple[str, ...], free: int) -> None:
    kw: dict[str, Any] = dict(version=-1, state="ready", tokens_total=0, dispatch_seq=seen,
                              held=inflight, free_capacity=free)
    s.heartbeat(w, now, **kw)


def test_a_heartbeat_that_crosses_a_dispatch_changes_nothing() -> None:
    s, w = _state()
    _submit(s, "p1")
    ((_, g1),) = s.dispatch(0.0)
    # the worker's heartbeat is written now: it has seen nothing yet, holds nothing, has 2 free
    _submit(s, "p2")
    ((_, g2),) = s.dispatch(0.1)
    assert (g1.dispatch_seq, g2.dispatch_seq) == (1, 2)  # type: ignore[attr-defined]
    _beat(s, w, 0.2, seen=0, inflight=(), free=2)  # crossed both tasks on the wire
    assert g1.phase == g2.phase == Phase.LEASED and set(w.leases) == {g1.task_id, g2.task_id}
    assert w.credits == 0  # 2 free less the 2 dispatched after seq 0
    _beat(s, w, 0.3, seen=1, inflight=(g1.task_id,), free=1)  # saw task 1, task 2 still on the wire
    assert g2.phase == Phase.LEASED and w.credits == 0
    assert s.counters.get("leases_reconciled", 0) == 0 and s.counters.get("credit_corrections", 0) == 0
    s.check_invariants()


def test_a_lease_below_the_echo_that_the_worker_does_not_hold_is_requeued_at_once() -> None:
    s, w = _state()
    _submit(s, "p1", "p2")
    (_, g1), (_, g2) = s.dispatch(0.0)
    _beat(s, w, 0.5, seen=2, inflight=(g1.task_id,), free=1)  # task 2 was lost on the wire
    assert g2.phase == Phase.QUEUED and g2.task_id not in w.leases
    assert g2.attempt - g2.forgiven == 0  # the lost message was not the group's fault: no attempt burned
    assert s.counters["leases_reconciled"] == 1
    assert w.credits == 1  # the capacity the lost task held is back
    s.check_invariants()


def test_a_lost_credit_is_corrected_by_the_absolute_free_capacity() -> None:
    s, w = _state()
    _submit(s, "p1", "p2")
    (_, g1), (_, g2) = s.dispatch(0.0)
    for g in (g1, g2):
        s.result(w, task_id=g.task_id, prompt_id=g.prompt_id, trajectories=(), error="x", retryable=False, now=0.1)
    # both Credit(1) messages were lost: the broker still thinks the worker is full
    assert w.credits == 0
    _beat(s, w, 0.5, seen=2, inflight=(), free=2)
    assert w.credits == 2 and s.counters["credit_corrections"] == 1
    s.check_invariants()
