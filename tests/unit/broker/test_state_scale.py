"""Minor-1 bookkeeping of the broker state: dispatch sequence numbers, the held-task digest, the
version-split ready sets, the apply queue and the broker-side latency log (no sockets, no sleeping)."""

from __future__ import annotations

import numpy as np
import pytest

from rollpool.broker.latency import LatencyLog
from rollpool.broker.state import BrokerState, WorkerInfo
from rollpool.protocol import FEATURES, Feature, held_digest, task_digest
from tests.unit.broker.test_state import finish, make, prompt


def join(s: BrokerState, wid: str, capacity: int = 4, now: float = 0.0, version: int = -1, features: tuple[str, ...] = FEATURES) -> WorkerInfo:
    s.add_worker(worker_id=wid, identity=wid.encode(), capacity=capacity, credits=capacity, now=now, version=version, features=features)
    return s.workers[wid]


def beat(s: BrokerState, w: WorkerInfo, now: float, *, seq: int, held: list[str], full: bool = False) -> None:
    s.heartbeat(w, now, version=w.version, state="ready", tokens_total=0, dispatch_seq=seq, free_capacity=w.capacity - len(held),
                held_count=len(held), held_digest=held_digest(held), held=held if full else None)


def test_dispatch_numbers_each_workers_tasks_from_one_and_keeps_counting() -> None:
    s = make()
    s.submit([prompt(f"p{i}") for i in range(6)], 0.0)
    a, b = join(s, "a", capacity=3), join(s, "b", capacity=3)
    out = s.dispatch(0.0)
    seqs = {w.worker_id: [g.dispatch_seq for x, g in out if x is w] for w in (a, b)}
    assert seqs == {"a": [1, 2, 3], "b": [1, 2, 3]}
    tid = next(iter(a.leases))
    finish(s, a, tid)
    s.credit(a, 1, 0.0)
    s.submit([prompt("p6")], 0.0)
    [(_, g)] = s.dispatch(0.0)
    assert g.dispatch_seq == 4  # numbers go on; never reused within the epoch
    s.check_invariants()


def test_a_consistent_heartbeat_asks_for_nothing_even_when_it_crosses_a_dispatch() -> None:
    s = make()
    s.submit([prompt(f"p{i}") for i in range(3)], 0.0)
    w = join(s, "w", capacity=4)
    s.dispatch(0.0)
    held = list(w.leases)
    # the worker had received tasks 1 and 2 when it beat; task 3 was still on its way
    beat(s, w, 0.5, seq=2, held=held[:2])
    assert s.effects.held_requests == [] and s.counters["held_mismatches"] == 0
    assert (w.reported_seq, w.reported_free, w.reported_held) == (2, 2, 2)
    beat(s, w, 1.0, seq=3, held=held)
    assert s.effects.held_requests == [] and s.counters["held_checks"] == 2
    s.check_invariants()


@pytest.mark.parametrize("reconcile", [False, True], ids=["minor4", "minor5"])
def test_a_lease_the_worker_does_not_hold_is_a_mismatch_and_the_full_list_names_it(reconcile: bool) -> None:
    s = make()
    s.submit([prompt(f"p{i}") for i in range(3)], 0.0)
    w = join(s, "w", capacity=4, features=FEATURES if reconcile else tuple(f for f in FEATURES if f != Feature.RECONCILE))
    s.dispatch(0.0)
    held = list(w.leases)
    lost = held[1]  # the worker never got it (or lost it)
    beat(s, w, 0.5, seq=3, held=[held[0], held[2]])
    assert s.effects.held_requests == ["w"] and s.counters["held_mismatches"] == 1
    beat(s, w, 1.0, seq=3, held=[held[0], held[2], "ghost@0"], full=True)
    assert w.unreported == (lost,)
    assert s.counters["leases_unreported"] == 1 and s.counters["held_unknown"] == 1
    if reconcile:  # whole heartbeats are reconciled: acted on at once, the lost lease is requeued burning no attempt
        assert lost not in w.leases and s.leased == 2 and s.counters["leases_reconciled"] == 1
    else:  # a worker of protocol 1.4 or older: recorded only
        assert lost in w.leases and s.leased == 3 and s.counters["leases_reconciled"] == 0
    s.check_invariants()


def test_the_digest_follows_every_way_a_lease_ends() -> None:
    s = make(max_attempts=10)
    s.submit([prompt(f"p{i}") for i in range(4)], 0.0)
    w = join(s, "w", capacity=4)
    s.dispatch(0.0)
    tids = list(w.leases)
    finish(s, w, tids[0])
    s.nack(w, [tids[1]], 0.0, reason="test")
    s.result(w, task_id=tids[2], prompt_id=w.leases[tids[2]].prompt_id, trajectories=(), error="boom", retryable=True, now=0.0)
    assert w.digest == task_digest(tids[3]) == held_digest(w.leases)
    s.credit(w, 3, 0.0)
    s.dispatch(0.0)  # the two requeued groups go out again under new task ids
    s.check_invariants()
    s.remove_worker("w", 1.0, reason="dead")
    s.check_invariants()


def test_a_minor0_worker_is_never_checked() -> None:
    s = make()
    s.submit([prompt("p0")], 0.0)
    w = join(s, "old", features=())
    s.dispatch(0.0)
    assert w.digest == 0
    s.heartbeat(w, 0.5, version=-1, state="ready", tokens_total=0)  # a minor-0 heartbeat: no dispatch_seq
    s.heartbeat(w, 0.6, version=-1, state="ready", tokens_total=0, dispatch_seq=1, held_count=0, held_digest=0)
    assert s.effects.held_requests == [] and s.counters["held_checks"] == 0
    assert Feature.HELD_DIGEST not in w.features


def test_current_workers_are_served_before_behind_ones_and_too_stale_ones_get_nothing() -> None:
    s = make(max_staleness=1)
    cur = join(s, "cur", capacity=1, version=0)
    behind = join(s, "behind", capacity=1, version=0)
    stale = join(s, "stale", capacity=1, version=0)
    s.set_version(2, 0.0)
    s.apply_done(cur, 2, ok=True)
    s.heartbeat(behind, 0.0, version=1, state="ready", tokens_total=0)
    s.submit([prompt(f"p{i}") for i in range(3)], 0.0)
    out = s.dispatch(0.0)
    assert [(w.worker_id, g.prompt_id) for w, g in out] == [("cur", "p0"), ("behind", "p1")]
    assert not stale.leases  # 2 versions behind with eta 1
    s.apply_done(stale, 2, ok=True)
    assert [w.worker_id for w, _ in s.dispatch(0.0)] == ["stale"]
    s.check_invariants()


def test_a_closed_admission_window_dispatches_nothing() -> None:
    s = make(max_staleness=0, batch_size=2)
    join(s, "w", capacity=8, version=0)
    s.set_version(0, 0.0)
    s.submit([prompt(f"p{i}") for i in range(4)], 0.0)
    assert len(s.dispatch(0.0)) == 2  # (v + eta + 1) * B = 2 samples
    assert s.dispatch(0.0) == []
    s.check_invariants()


def test_apply_slots_are_granted_in_request_order_and_a_repeat_request_keeps_its_place() -> None:
    s = make(max_applying=1)
    ws = [join(s, f"w{i}") for i in range(4)]
    for w in ws:
        s.apply_request(w, 1)
    s.apply_request(ws[2], 1)
    assert s.effects.grants == [("w0", 1)]
    for i in range(3):
        s.apply_done(ws[i], 1, ok=True)
    assert [wid for wid, _ in s.effects.grants] == ["w0", "w1", "w2", "w3"]
    s.remove_worker("w3", 0.0, reason="dead")
    assert s.applying == frozenset()


def test_delivered_groups_carry_their_broker_side_timestamps() -> None:
    s = make()
    s.submit([prompt("p0")], 1.0)
    w = join(s, "w")
    s.dispatch(2.0)
    finish(s, w, next(iter(w.leases)), now=3.5)
    [r] = s.pull("trainer", 10, now=4.0)
    assert r.prompt_id == "p0"
    assert s.latency.rows().tolist() == [[1.0, 2.0, 3.5, 4.0]]
    summary = s.snapshot()
    assert summary["latency_e2e_p99_ms"] == 3000.0 and summary["latency_handover_p50_ms"] == 500.0


def test_the_latency_log_is_a_bounded_ring() -> None:
    log = LatencyLog(capacity=3)
    for i in range(5):
        log.record(i, i + 1, i + 2, i + 3)
    assert log.count == 5
    assert log.rows()[:, 0].tolist() == [2.0, 3.0, 4.0]
    assert log.rows(last=2)[:, 0].tolist() == [3.0, 4.0]
    assert np.allclose(log.rows()[:, 3] - log.rows()[:, 0], 3.0)


def test_the_latency_summary_is_numpys_percentile_to_the_bit() -> None:
    rng = np.random.default_rng(7)
    for n in (1, 2, 3, 10, 101, 4096):
        log = LatencyLog(capacity=4096)
        t = np.cumsum(rng.exponential(0.01, size=(n, 4)), axis=1)
        for row in t:
            log.record(*row.tolist())
        got = log.summary()
        for name, a, b in (("e2e", 0, 3), ("queue", 0, 1), ("worker", 1, 2), ("handover", 2, 3)):
            d = (t[:, b] - t[:, a]) * 1000.0
            assert got[f"latency_{name}_p50_ms"] == round(float(np.percentile(d, 50)), 3)
            assert got[f"latency_{name}_p99_ms"] == round(float(np.percentile(d, 99)), 3)
