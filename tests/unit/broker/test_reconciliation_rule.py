"""The reconciliation rule of DESIGN.md as a pure-state test (no sockets, an injected clock).

The rule: every task carries a per-worker dispatch sequence number; each
worker heartbeat echoes the highest one it received, the tasks it holds and
its free capacity (absolute). A lease at or below the echoed number that the
worker does not report is requeued at once; credit is the reported free
capacity less what was dispatched after the echoed number. So a heartbeat
that crosses a dispatch changes nothing.

`dispatch()` stamps each lease with ``Group.dispatch_seq`` (per worker, from 1,
increasing; ``WorkerInfo.dispatch_seq`` is the last one given) and
``heartbeat(w, now, *, ..., dispatch_seq, held, free_capacity)`` reconciles, counting
``leases_reconciled`` and ``credit_corrections``, for a worker that lists
``Feature.RECONCILE`` (protocol 1.5); an older worker's heartbeat is recorded only.
Time is the ``now`` passed in (an injected clock).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rollpool.broker.config import BrokerConfig
from rollpool.broker.state import BrokerState, Phase, WorkerInfo
from rollpool.protocol import Feature, InflightTask, Prompt


def _state(features: tuple[str, ...] = (Feature.RECONCILE,)) -> tuple[BrokerState, WorkerInfo]:
    s = BrokerState(BrokerConfig(heartbeat_interval_s=1.0, task_timeout_s=600.0))
    s.add_worker(worker_id="w", identity=b"w", capacity=2, credits=2, now=0.0, features=features)
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


def test_a_heartbeat_that_crosses_a_dispatch_later_in_time_changes_nothing() -> None:
    """The echo is below the new task's number: whatever the clock says (within the echo grace), nothing moves."""
    s, w = _state()
    _submit(s, "p1")
    ((_, g1),) = s.dispatch(0.0)
    _beat(s, w, 1.0, seen=1, inflight=(g1.task_id,), free=1)
    _submit(s, "p2")
    ((_, g2),) = s.dispatch(1.0)  # task 2 leaves at t=1.0
    leases, credits = set(w.leases), w.credits
    for t in (1.0, 1.5, 2.0, 2.9):  # heartbeats written before task 2 arrived, read up to 1.9 s after it left
        _beat(s, w, t, seen=1, inflight=(g1.task_id,), free=1)
    assert g2.phase == Phase.LEASED and g2.attempt == 0
    assert set(w.leases) == leases and w.credits == credits == 0  # 1 free less task 2, sent after the echo
    assert s.counters["leases_reconciled"] == s.counters["credit_corrections"] == s.counters["requeued"] == 0
    s.check_invariants()


def test_a_task_above_the_echo_not_echoed_two_intervals_after_dispatch_is_requeued() -> None:
    s, w = _state()
    _submit(s, "p1")
    ((_, g1),) = s.dispatch(0.0)  # the only task; it is lost on the wire, so no later echo ever names it
    _beat(s, w, 1.9, seen=0, inflight=(), free=2)
    assert g1.phase == Phase.LEASED
    _beat(s, w, 2.1, seen=0, inflight=(), free=2)  # 2 x heartbeat_interval_s after dispatch
    assert g1.phase == Phase.QUEUED and g1.attempt - g1.forgiven == 0
    assert s.counters["leases_reconciled"] == 1 and w.credits == 2
    s.check_invariants()


def test_a_broker_stall_moves_the_echo_grace_on() -> None:
    """Heartbeats that queued up while the broker was stopped may predate the task's arrival."""
    s, w = _state()
    _submit(s, "p1")
    ((_, g1),) = s.dispatch(0.0)
    s.note_stall(5.0, 5.2)  # stopped from t=0.2 to t=5.2
    _beat(s, w, 5.2, seen=0, inflight=(), free=2)  # written at t=0.1, before task 1 arrived
    assert g1.phase == Phase.LEASED and s.counters.get("leases_reconciled", 0) == 0
    _beat(s, w, 7.3, seen=0, inflight=(), free=2)  # still not echoed 2 intervals of reading later
    assert g1.phase == Phase.QUEUED and s.counters["leases_reconciled"] == 1
    s.check_invariants()


def test_a_worker_without_the_feature_has_its_heartbeats_recorded_only() -> None:
    """Wire evolution: a worker of protocol 1.4 or older keeps today's behaviour."""
    s, w = _state(features=())
    _submit(s, "p1", "p2")
    (_, g1), (_, g2) = s.dispatch(0.0)
    _beat(s, w, 5.0, seen=2, inflight=(g1.task_id,), free=2)
    assert g1.phase == g2.phase == Phase.LEASED and w.credits == 0
    assert w.unreported == (g2.task_id,) and s.counters["leases_unreported"] == 1
    assert s.counters.get("leases_reconciled", 0) == 0 and s.counters.get("credit_corrections", 0) == 0
    s.check_invariants()


def test_numbering_goes_on_across_a_re_hello_and_leases_it_keeps_are_judged_by_the_held_list() -> None:
    s, w = _state()
    _submit(s, "p1", "p2")
    (_, g1), (_, g2) = s.dispatch(0.0)
    # the worker reconnects announcing task 1 only (task 2 never reached it): the welcome names seq 2
    s.add_worker(worker_id="w", identity=b"w2", capacity=2, credits=1, now=1.0, features=(Feature.RECONCILE,),
                 inflight=(InflightTask(task_id=g1.task_id, prompt_id="p1", group_size=1, attempt=0),))
    assert w.dispatch_seq == 2 and g1.dispatch_seq == 1
    ((_, g3),) = s.dispatch(1.0)  # p2 again, number 3
    assert g3.prompt_id == "p2" and g3.dispatch_seq == 3
    _beat(s, w, 1.5, seen=2, inflight=(g1.task_id,), free=1)  # written after the welcome, before task 3 came
    assert g1.phase == g3.phase == Phase.LEASED and w.credits == 0
    assert s.counters.get("leases_reconciled", 0) == 0
    s.check_invariants()
