"""The broker's state machine and leases, driven with an injected clock (no sockets, no sleeping)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpool.broker.config import BrokerConfig
from rollpool.broker.state import BrokerState, Phase, WorkerInfo
from rollpool.protocol import ConfigError, InflightTask, Prompt, Trajectory


def prompt(pid: str, n: int = 1, priority: int = 0) -> Prompt:
    return Prompt(prompt_id=pid, input_ids=np.arange(3, dtype=np.int32), group_size=n, priority=priority)


def group(pid: str, n: int, version: int = 0) -> tuple[Trajectory, ...]:
    z = np.zeros(2, dtype=np.int32)
    return tuple(
        Trajectory(
            prompt_id=pid, sample_index=i, input_ids=z, output_ids=z, output_logprobs=np.zeros(2, np.float32),
            token_versions=np.full(2, version, np.int32), loss_mask=np.ones(2, np.uint8), finish_reason="stop",
        )
        for i in range(n)
    )


def make(**kw: object) -> BrokerState:
    return BrokerState(BrokerConfig(**{"heartbeat_interval_s": 1.0, "task_timeout_s": 10.0, **kw}))  # type: ignore[arg-type]


def join(s: BrokerState, wid: str, capacity: int = 4, now: float = 0.0, version: int = -1) -> WorkerInfo:
    s.add_worker(worker_id=wid, identity=wid.encode(), capacity=capacity, credits=capacity, now=now, version=version)
    return s.workers[wid]


def finish(s: BrokerState, w: WorkerInfo, task_id: str, now: float = 0.0) -> str:
    g = w.leases[task_id]
    return s.result(w, task_id=task_id, prompt_id=g.prompt_id, trajectories=group(g.prompt_id, g.size), error=None, retryable=True, now=now)


def test_credits_bound_dispatch_and_groups_stay_whole() -> None:
    s = make()
    s.submit([prompt(f"p{i}", 3) for i in range(5)], 0.0)
    w = join(s, "w", capacity=7)
    out = s.dispatch(0.0)
    assert [g.prompt_id for _, g in out] == ["p0", "p1"]  # 6 of 7 credits; a third group of 3 does not fit
    assert w.credits == 1 and all(x is w for x, _ in out)
    assert s.dispatch(0.0) == []
    s.credit(w, 3, 0.0)
    assert [g.prompt_id for _, g in s.dispatch(0.0)] == ["p2"]
    s.check_invariants()


def test_fifo_with_priority_first() -> None:
    s = make()
    s.submit([prompt("a"), prompt("b"), prompt("urgent", priority=5), prompt("c")], 0.0)
    join(s, "w", capacity=10)
    assert [g.prompt_id for _, g in s.dispatch(0.0)] == ["urgent", "a", "b", "c"]


def test_a_group_no_worker_can_hold_does_not_block_the_queue() -> None:
    s = make()
    s.submit([prompt("big", 8), prompt("small1", 1), prompt("small2", 2)], 0.0)
    join(s, "w", capacity=4)
    assert [g.prompt_id for _, g in s.dispatch(0.0)] == ["small1", "small2"]
    assert s.groups["big"].phase == Phase.QUEUED
    join(s, "large", capacity=8)
    assert [g.prompt_id for _, g in s.dispatch(0.0)] == ["big"]


def test_deadline_requeues_whole_group_then_fails_after_max_attempts() -> None:
    s = make(max_attempts=2, task_timeout_s=5.0)
    s.submit([prompt("p", 2)], 0.0)
    w = join(s, "w")
    (_, g), = s.dispatch(0.0)
    assert g.task_id == "p@0"
    s.heartbeat(w, 2.5, version=-1, state="ready", tokens_total=0)
    s.expire(4.9)
    assert g.phase == Phase.LEASED
    s.heartbeat(w, 5.0, version=-1, state="ready", tokens_total=0)
    s.expire(5.1)
    assert g.phase == Phase.QUEUED and g.attempt == 1
    assert ("w", "p@0", "deadline") in s.effects.cancels
    s.credit(w, 2, 5.1)
    (_, g2), = s.dispatch(5.1)
    assert g2.task_id == "p@1"
    s.heartbeat(w, 8.0, version=-1, state="ready", tokens_total=0)
    s.heartbeat(w, 10.0, version=-1, state="ready", tokens_total=0)
    s.expire(10.2)
    assert g.phase == Phase.FAILED and s.counters["failed"] == 1
    assert [r.state for r in s.pull("c", 10)] == ["failed"]
    s.check_invariants()


def test_dead_worker_requeues_and_its_late_result_is_a_duplicate() -> None:
    s = make()
    s.submit([prompt("p", 2)], 0.0)
    dead = join(s, "dead")
    s.dispatch(0.0)
    alive = join(s, "alive", now=2.0)
    s.expire(2.9)
    assert "dead" in s.workers
    s.expire(3.1)  # 3 missed heartbeats of 1 s
    assert "dead" not in s.workers and s.counters["workers_lost"] == 1
    (w, g), = s.dispatch(3.1)
    assert w is alive and g.task_id == "p@1"
    late = s.result(dead, task_id="p@0", prompt_id="p", trajectories=group("p", 2), error=None, retryable=True, now=3.2)
    assert late == "duplicate"
    assert finish(s, alive, "p@1", 3.3) == "accepted"
    assert finish_again(s, alive) == "duplicate"
    assert [r.prompt_id for r in s.pull("c", 10)] == ["p"]
    assert s.pull("c", 10) == []
    s.check_invariants()


def finish_again(s: BrokerState, w: WorkerInfo) -> str:
    return s.result(w, task_id="p@1", prompt_id="p", trajectories=group("p", 2), error=None, retryable=True, now=4.0)


def test_ack_forgets_and_dedup_window_refuses_resubmission() -> None:
    s = make(dedup_window=2)
    w = join(s, "w", capacity=10)
    s.submit([prompt("a"), prompt("b"), prompt("c")], 0.0)
    for _, g in s.dispatch(0.0):
        finish(s, w, g.task_id)
    s.pull("c", 10)
    assert s.ack(["a", "b", "c"]) == 3
    assert s.held == 0 and not s.groups
    _, rejected = s.submit([prompt("c"), prompt("a")], 1.0)
    assert [r.reason for r in rejected] == ["duplicate"]  # "a" fell out of the window of 2
    s.check_invariants()


def test_unacked_results_are_redelivered_on_reconnect() -> None:
    s = make()
    w = join(s, "w", capacity=10)
    s.submit([prompt("a"), prompt("b")], 0.0)
    for _, g in s.dispatch(0.0):
        finish(s, w, g.task_id)
    assert len(s.pull("trainer", 10)) == 2
    s.ack(["a"])
    assert s.client_reconnected("trainer") == 1
    assert [r.prompt_id for r in s.pull("trainer", 10)] == ["b"]


def test_full_queue_rejects_and_bounds_memory() -> None:
    s = make(max_queued=10, max_group_size=4)
    accepted, rejected = s.submit([prompt(f"p{i}") for i in range(25)] + [prompt("huge", 5)], 0.0)
    assert len(accepted) == 10
    assert {r.reason for r in rejected} == {"queue_full", "group_too_large"}
    assert len(s.groups) == 10


def test_adopted_task_merges_with_resubmitted_prompt_first_result_wins() -> None:
    s = make()
    adopted, refused = s.add_worker(
        worker_id="w", identity=b"w", capacity=4, credits=2, now=0.0,
        inflight=[InflightTask(task_id="p@0", prompt_id="p", group_size=2)],
    )
    assert adopted == ["p@0"] and refused == []
    accepted, _ = s.submit([prompt("p", 2)], 0.1)  # the client resubmits after seeing the new epoch
    assert accepted == ["p"]
    assert s.dispatch(0.1) == []  # merged: not dispatched a second time
    w = s.workers["w"]
    assert finish(s, w, "p@0") == "accepted"
    assert [r.prompt_id for r in s.pull("c", 10)] == ["p"]
    s.check_invariants()


def test_adopted_tasks_whose_prompt_never_returns_are_forgotten_after_the_ttl() -> None:
    s = make(orphan_ttl_s=60.0, task_timeout_s=1000.0, heartbeat_interval_s=100.0)
    tasks = [InflightTask(task_id=f"{p}@0", prompt_id=p, group_size=2) for p in ("parked", "held", "running")]
    adopted, _ = s.add_worker(worker_id="w", identity=b"w", capacity=8, credits=0, now=0.0, inflight=tasks)
    assert len(adopted) == 3
    w = s.workers["w"]
    s.nack(w, ["parked@0"], 1.0, reason="engine restart")  # its lease ends: parked, waiting for the prompt
    assert finish(s, w, "held@0", now=2.0) == "accepted"  # finished: held until the prompt comes back
    assert s.staleness.accepted == 2
    s.expire(59.0)
    assert set(s.groups) == {"parked", "held", "running"} and s.counters["orphans_dropped"] == 0
    s.expire(61.0)
    assert set(s.groups) == {"running"} and s.counters["orphans_dropped"] == 2  # the leased one stays with its worker
    assert s.staleness.accepted == 0  # the capacity the dropped result held is released
    s.check_invariants()
    assert s.submit([prompt("held", 2)], 62.0)[1][0].reason == "duplicate"  # forgotten, not silently regenerated
    assert finish(s, w, "running@0", now=63.0) == "accepted"
    s.expire(64.0)
    assert "running" not in s.groups and s.counters["orphans_dropped"] == 3
    s.check_invariants()


def test_adopted_task_whose_prompt_returns_is_not_an_orphan() -> None:
    s = make(orphan_ttl_s=60.0)
    s.add_worker(worker_id="w", identity=b"w", capacity=4, credits=0, now=0.0,
                 inflight=[InflightTask(task_id="p@0", prompt_id="p", group_size=2)])
    s.submit([prompt("p", 2)], 1.0)
    s.expire(100.0)
    assert "p" in s.groups and s.counters["orphans_dropped"] == 0
    s.check_invariants()


def test_version_aware_choice_and_stale_workers_get_nothing() -> None:
    s = make(max_staleness=1, batch_size=100)
    old = join(s, "old", version=0)
    cur = join(s, "cur", version=3)
    s.set_version(3, 0.0)
    s.submit([prompt("a"), prompt("b")], 0.0)
    out = s.dispatch(0.0)
    assert {w.worker_id for w, _ in out} == {"cur"}
    assert old.credits == 4 and not old.leases and cur.credits == 2


def test_apply_slots_bounded_by_max_applying() -> None:
    s = make(max_applying=1)
    a, b = join(s, "a"), join(s, "b")
    s.apply_request(a, 1)
    s.apply_request(b, 1)
    assert s.effects.grants == [("a", 1)]
    s.submit([prompt("p")], 0.0)
    assert [w.worker_id for w, _ in s.dispatch(0.0)] == ["b"]  # never to a worker that is applying
    s.apply_done(a, 1, ok=True)
    assert s.effects.grants == [("a", 1), ("b", 1)] and a.version == 1


def test_cancel_is_terminal_and_told_once() -> None:
    s = make()
    w = join(s, "w", capacity=1)
    s.submit([prompt("x"), prompt("y")], 0.0)
    s.dispatch(0.0)
    cancelled, _ = s.cancel(["x", "y"], 0.0)
    assert cancelled == ["x", "y"] and ("w", "x@0", "cancelled") in s.effects.cancels
    assert finish_by_id(s, w, "x@0", "x") == "duplicate"
    assert sorted(r.state for r in s.pull("c", 10)) == ["cancelled", "cancelled"]
    s.check_invariants()


def finish_by_id(s: BrokerState, w: WorkerInfo, tid: str, pid: str) -> str:
    return s.result(w, task_id=tid, prompt_id=pid, trajectories=group(pid, 1), error=None, retryable=True, now=0.0)


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ConfigError, match="max_attempts"):
        BrokerConfig(max_attempts=0)
    with pytest.raises(ConfigError, match="max_staleness"):
        BrokerConfig(max_staleness=-1)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(1, 4)),
        st.tuples(st.just("dispatch"), st.just(0)),
        st.tuples(st.just("finish"), st.integers(0, 3)),
        st.tuples(st.just("nack"), st.integers(0, 3)),
        st.tuples(st.just("version"), st.integers(0, 2)),
        st.tuples(st.just("kill"), st.integers(0, 3)),
        st.tuples(st.just("credit"), st.integers(0, 3)),
        st.tuples(st.just("drop"), st.integers(0, 3)),
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, eta=st.integers(0, 2), batch=st.integers(1, 8))
def test_admission_keeps_the_staleness_rule_at_every_step(ops: list[tuple[str, int]], eta: int, batch: int) -> None:
    s = make(max_staleness=eta, batch_size=batch, max_attempts=1000)
    now = 0.0
    n = 0
    for i in range(4):
        join(s, f"w{i}", capacity=6)
    for op, arg in ops:
        now += 0.01
        wid = f"w{arg}"
        w = s.workers.get(wid)
        if op == "submit":
            n += 1
            s.submit([prompt(f"p{n}", arg)], now)
        elif op == "dispatch":
            s.dispatch(now)
        elif op == "finish" and w is not None and w.leases:
            tid = next(iter(w.leases))
            finish(s, w, tid, now)
            s.credit(w, 6, now)
        elif op == "nack" and w is not None and w.leases:
            s.nack(w, [next(iter(w.leases))], now, reason="test")
        elif op == "version":
            s.set_version(s.version + arg, now)
            for x in s.workers.values():
                s.heartbeat(x, now, version=s.version, state="ready", tokens_total=0)
        elif op == "kill" and w is not None:
            s.remove_worker(wid, now, reason="dead")
            join(s, wid, capacity=6, now=now, version=max(s.version, 0))
        elif op == "credit" and w is not None:
            s.credit(w, 6, now)
        elif op == "drop":
            got = s.pull("c", 2)
            s.ack([g.prompt_id for g in got], dropped_stale=[g.prompt_id for g in got][: arg % 2])
        v = max(s.version, 0)
        st_ = s.staleness
        assert st_.accepted + st_.running <= (v + eta + 1) * batch
        s.check_invariants()


def test_evaluation_prompts_bypass_staleness_admission_and_use_no_capacity() -> None:
    s = make(max_staleness=0, batch_size=2)  # capacity (0 + 0 + 1) * 2 = 2 samples
    w = join(s, "w", capacity=8, version=0)
    s.set_version(0, 0.0)
    s.submit([prompt("t1", 2), prompt("t2", 2)], 0.0)
    evals = [Prompt(prompt_id=f"e{i}", input_ids=np.arange(3, dtype=np.int32), exempt_from_staleness=True) for i in range(3)]
    s.submit(evals, 0.0)
    out = [g.prompt_id for _, g in s.dispatch(0.0)]
    assert out == ["t1", "e0", "e1", "e2"]  # t2 waits for the next version; evaluation does not
    for tid in ["t1@0", "e0@0", "e1@0", "e2@0"]:
        finish(s, w, tid)
    assert s.staleness.accepted == 2 and s.staleness.running == 0  # only the training group counts
    s.check_invariants()
    s.set_version(1, 0.0)
    s.apply_done(w, 1, ok=True)  # the worker applied version 1 (eta = 0: nothing goes to a worker behind)
    assert [g.prompt_id for _, g in s.dispatch(0.0)] == ["t2"]
def test_lease_deadlines_do_not_keep_finished_groups_alive() -> None:
    """Soak finding: every dispatched group stayed referenced until its deadline (task_timeout_s), acked or not."""
    s = make(task_timeout_s=600.0, dedup_window=100)
    w = join(s, "w", capacity=4)
    for i in range(5000):
        s.submit([prompt(f"p{i}", 2)], 0.0)
        for _, g in s.dispatch(0.0):
            assert finish(s, w, g.task_id) == "accepted"
            s.credit(w, 2, 0.0)
        for g in s.pull("trainer", 10):
            s.ack([g.prompt_id])
    assert s.counters["acked"] == 5000 and s.leased == 0 and not s.groups
    assert len(s._deadlines) == s.leased  # an ended lease leaves at once (not in batches of a thousand)
    s.check_invariants()


def test_a_group_handed_back_without_end_fails_instead_of_looping() -> None:
    s = make(max_attempts=2, max_handbacks=3)
    s.submit([prompt("p")], 0.0)
    w = join(s, "w")
    for i in range(4):
        (_, g), = s.dispatch(float(i))
        s.nack(w, [g.task_id], float(i), reason="engine restarting")
        s.credit(w, 1, float(i))
    assert s.groups["p"].phase == Phase.FAILED and "handed back 4 times" in (s.groups["p"].result.reason if s.groups["p"].result else "")
    assert s.dispatch(10.0) == []
    s.check_invariants()


def test_a_group_with_extra_segments_completes_by_distinct_sample_index() -> None:
    """An episode with a history rewrite delivers two segments of one sample: the group is whole, not invalid."""
    import dataclasses

    s = make()
    s.submit([prompt("p", 2)], 0.0)
    w = join(s, "w")
    s.dispatch(0.0)
    task_id = next(iter(w.leases))
    base = group("p", 2)
    segmented = (*base, dataclasses.replace(base[1], segment_index=1))
    s.result(w, task_id=task_id, prompt_id="p", trajectories=segmented, error=None, retryable=True, now=0.0)
    assert s.groups["p"].phase == Phase.DONE and s.counters["invalid_results"] == 0
    assert s.groups["p"].result is not None and len(s.groups["p"].result.trajectories) == 3
    s.check_invariants()


@pytest.mark.parametrize("case", ["missing_sample", "duplicate_segment"])
def test_a_group_missing_a_sample_or_repeating_a_segment_is_invalid(case: str) -> None:
    import dataclasses

    s = make(max_attempts=5)
    s.submit([prompt("p", 2)], 0.0)
    w = join(s, "w")
    s.dispatch(0.0)
    task_id = next(iter(w.leases))
    base = group("p", 2)
    bad = (base[0], dataclasses.replace(base[0], segment_index=1)) if case == "missing_sample" else (*base, base[1])
    s.result(w, task_id=task_id, prompt_id="p", trajectories=bad, error=None, retryable=True, now=0.0)
    assert s.counters["invalid_results"] == 1 and s.groups["p"].phase == Phase.QUEUED


def test_an_apply_slot_held_past_its_deadline_goes_to_the_next_worker() -> None:
    # before the deadline, a hung apply held the slot forever
    s = make(max_applying=1, apply_slot_deadline_s=2.0)
    a, b = join(s, "a"), join(s, "b")
    s.apply_request(a, 1, now=10.0)
    s.apply_request(b, 1, now=10.5)
    assert s.effects.grants == [("a", 1)]
    a.last_seen = b.last_seen = 12.0  # both keep heartbeating
    s.expire(11.9)
    assert s.applying == {"a"}
    s.expire(12.1)
    assert s.applying == {"b"} and s.effects.grants == [("a", 1), ("b", 1)] and not a.applying
    assert s.counters["apply_slots_expired"] == 1
    assert ("apply_slot_expired", {"worker_id": "a", "held_s": 2.1}) in s.effects.events
    s.apply_done(a, 1, ok=True)  # the late outcome of the expired slot frees nothing of b's
    assert s.applying == {"b"} and a.version == 1
    s.expire(14.0)  # b's slot counts from its own grant (at 12.1), not from its ask
    assert s.applying == {"b"}
    s.check_invariants()


def test_a_repeated_apply_request_from_the_slot_holder_is_granted_again() -> None:
    s = make(max_applying=1)
    a, b = join(s, "a"), join(s, "b")
    s.apply_request(a, 1, now=0.0)
    s.apply_request(b, 1, now=0.0)
    s.apply_request(a, 1, now=0.5)  # its grant was lost
    s.apply_request(b, 1, now=0.5)  # still waiting: nothing new
    assert s.effects.grants == [("a", 1), ("a", 1)]
    assert s.counters["grants_resent"] == 1


def test_a_failed_apply_is_counted_with_its_error() -> None:
    s = make()
    a = join(s, "a")
    s.apply_request(a, 2, now=0.0)
    s.apply_done(a, 2, ok=False, error="EngineError: unknown parameter names ['x']")
    assert s.counters["versions_failed"] == 1 and a.version < 2
    assert ("version_failed", {"worker_id": "a", "version": 2, "error": "EngineError: unknown parameter names ['x']"}) in s.effects.events


def test_a_version_a_worker_gave_up_is_shown_on_it_and_frees_only_its_wait_for_a_grant() -> None:
    s = make(max_applying=1)
    a, b = join(s, "a"), join(s, "b")
    s.apply_request(a, 3, now=0.0)  # a holds the one slot for 3
    s.apply_request(b, 3, now=0.0)  # b waits for it
    s.apply_done(a, 2, ok=False, error="fetch failed 3 times", skipped=True)  # a gives up an older version: its slot for 3 stays
    assert s.effects.grants == [("a", 3)] and a.skipped_version == 2
    s.apply_done(b, 3, ok=False, error="no apply grant for version 3 after 3 asks", skipped=True)
    s.apply_done(a, 3, ok=False, error="EngineError: q has shape (2,)")  # the serving engine's failure (not final)
    assert s.effects.grants == [("a", 3)]  # b stopped waiting: the freed slot went to nobody
    s.apply_done(a, 3, ok=False, error="EngineError: q has shape (2,) (restarted engine)", skipped=True)
    view = {w: s.workers[w].live_state(0.0) for w in ("a", "b")}
    assert view["a"]["skipped_version"] == 3 and view["a"]["skipped_error"].endswith("(restarted engine)")
    assert view["b"]["skipped_version"] == 3 and "no apply grant" in view["b"]["skipped_error"]
    assert s.counters["versions_skipped"] == 3 and s.counters["versions_failed"] == 1
    s.apply_done(a, 1, ok=False, error="old", skipped=True)  # an older report does not hide the newer one
    assert a.skipped_version == 3 and a.skipped_error.endswith("(restarted engine)")
    s.add_worker(worker_id="a", identity=b"a", capacity=4, credits=4, now=1.0, version=2)  # a re-hello of the same process
    assert s.workers["a"].skipped_version == 3
    s.add_worker(worker_id="a", identity=b"a2", capacity=4, credits=4, now=2.0, version=2, pid=4242)  # a new process: it tries again
    assert s.workers["a"].skipped_version == -1 and s.workers["a"].skipped_error == ""


def test_a_group_sent_and_not_acknowledged_is_sent_again_after_result_resend_s_until_acknowledged() -> None:
    # before the resend, a lost Batch left its groups counted as delivered until a new ClientHello
    s = make(result_resend_s=2.0)
    w = join(s, "w", capacity=4)
    s.submit([prompt("a"), prompt("b")], 0.0)
    for _, g in s.dispatch(0.0):
        finish(s, w, g.task_id, now=0.5)
    assert [r.prompt_id for r in s.pull("c", 1, now=1.0)] == ["a"]  # this Batch is lost
    assert not s.resend_due("c", 2.9)
    assert [r.prompt_id for r in s.pull("c", 1, now=2.9)] == ["b"]
    assert s.resend_due("c", 3.0)
    assert [r.prompt_id for r in s.pull("c", 1, now=3.0)] == ["a"]  # sent again, on top of nothing new
    assert s.pull("c", 5, now=4.0) == []  # a is not due again before 5.0, b before 4.9
    assert [r.prompt_id for r in s.pull("c", 5, now=5.0)] == ["b", "a"]
    s.ack(["a", "b"])
    assert not s.resend_due("c", 100.0) and s.pull("c", 5, now=100.0) == []
    assert s.counters["results_resent"] == 3
    s.check_invariants()


def test_a_broker_stall_is_not_worker_silence_and_burns_no_attempt() -> None:
    # liveness was judged on time: after a broker stall longer than dead-after every worker was declared dead
    s = make(task_timeout_s=10.0, apply_slot_deadline_s=5.0)  # dead after 3 x 1 s
    join(s, "w", capacity=4, now=0.0)
    v = join(s, "v", capacity=4, now=0.0)
    s.submit([prompt("p")], 0.0)
    ((_, g),) = s.dispatch(0.0)
    s.apply_request(v, 1, now=0.0)
    s.note_stall(20.0, now=20.5)  # the broker read nothing from 0.5 to 20.5
    assert s.expire(20.5) == ([], [])  # 0.5 s of silence read, not 20.5
    assert s.applying == {"v"} and g.phase == "leased" and g.attempt == 0 and s.counters["requeued"] == 0
    assert s.counters["broker_stalls"] == 1 and s.counters["broker_stall_ms_max"] == 20000
    assert ("broker_stall", {"stall_s": 20.0}) in s.effects.events
    dead, _ = s.expire(23.6)  # real silence still counts: 3.6 s after the stall, both are dead
    assert sorted(dead) == ["v", "w"] and s.counters["requeued"] == 1
    s.check_invariants()


@pytest.mark.parametrize("mask", [
    [1, 1, 0, 1], [0, 0, 0, 0], [1, 2, 0, 1], [255, 1], [1] * 600, [1, 0] * 300 + [3],
])
def test_sampled_tokens_is_the_loss_masks_sum(mask: list[int]) -> None:
    """The short-uint8-mask shortcut (counting 1 bytes) gives the numpy sum, also for masks that are not 0/1."""
    from rollpool.broker.state import _sampled_tokens

    def traj(m: np.ndarray) -> Trajectory:
        n = m.size
        z = np.zeros(n, np.int32)
        return Trajectory(prompt_id="p", sample_index=0, input_ids=z, output_ids=z, output_logprobs=np.zeros(n, np.float32),
                          token_versions=z, loss_mask=m, finish_reason="stop")

    m8 = np.frombuffer(bytes(mask), dtype=np.uint8)
    assert _sampled_tokens([traj(m8)]) == int(m8.sum())
    assert _sampled_tokens([traj(np.asarray(mask, dtype=np.int64))]) == sum(mask)
    assert _sampled_tokens([traj(m8), traj(m8)]) == 2 * int(m8.sum())
