"""The versioned-service contract in the broker's pure state: exact-version groups, version convergence and
fleet activation, driven with an injected clock (no sockets, no sleeping)."""

from __future__ import annotations

import numpy as np

from rollpool.broker.config import BrokerConfig
from rollpool.broker.convergence import percentile
from rollpool.broker.state import BrokerState, Phase, ResultOutcome, WorkerInfo
from rollpool.protocol import Prompt, Trajectory


def exact(pid: str, version: int, n: int = 1) -> Prompt:
    return Prompt(prompt_id=pid, input_ids=np.arange(3, dtype=np.int32), group_size=n, exact_weight_version=version)


def plain(pid: str) -> Prompt:
    return Prompt(prompt_id=pid, input_ids=np.arange(3, dtype=np.int32))


def trajs(pid: str, n: int, versions: list[int]) -> tuple[Trajectory, ...]:
    z = np.zeros(len(versions), dtype=np.int32)
    return tuple(Trajectory(prompt_id=pid, sample_index=i, input_ids=z, output_ids=z, output_logprobs=np.zeros(len(versions), np.float32),
                            token_versions=np.asarray(versions, np.int32), loss_mask=np.ones(len(versions), np.uint8), finish_reason="stop")
                 for i in range(n))


def make(**kw: object) -> BrokerState:
    return BrokerState(BrokerConfig(**{"heartbeat_interval_s": 1.0, "task_timeout_s": 10.0, **kw}))  # type: ignore[arg-type]


def join(s: BrokerState, wid: str, version: int, capacity: int = 4, now: float = 0.0) -> WorkerInfo:
    s.add_worker(worker_id=wid, identity=wid.encode(), capacity=capacity, credits=capacity, now=now, version=version)
    return s.workers[wid]


def beat(s: BrokerState, w: WorkerInfo, version: int, now: float) -> None:
    s.heartbeat(w, now, version=version, state="ready", tokens_total=0)


def failed(s: BrokerState) -> dict[str, str]:
    return {g.prompt_id: g.reason for g in s.pull("c", 100, 0.0) if g.state == Phase.FAILED}


# ------------------------------------------------------------------ exact versions


def test_an_exact_group_goes_only_to_a_worker_at_that_version_and_others_are_not_blocked() -> None:
    s = make()
    s.set_version(3, 0.0)
    old, new = join(s, "old", 2), join(s, "new", 3)
    acc, rej = s.submit([exact("e2", 2), plain("p"), exact("e3", 3)], 0.0)
    assert rej == [] and len(acc) == 3
    got = {g.prompt_id: w.worker_id for w, g in s.dispatch(0.0)}
    assert got == {"e2": "old", "e3": "new", "p": "new"} or got == {"e2": "old", "e3": "new", "p": "old"}
    assert old.leases and new.leases
    s.check_invariants()


def test_a_result_served_partly_at_another_version_is_not_delivered_and_retried_on_a_worker_still_there() -> None:
    s = make()
    s.set_version(2, 0.0)
    a, b = join(s, "a", 2, capacity=1), join(s, "b", 2, capacity=1)
    s.submit([exact("e", 2)], 0.0)
    [(w, g)] = s.dispatch(0.0)
    other = b if w is a else a
    # the worker applied version 3 mid-generation (interrupt mode): the tail of each sample is of version 3
    out = s.result(w, task_id=g.task_id, prompt_id="e", trajectories=trajs("e", 1, [2, 2, 3]), error=None, retryable=True, now=1.0)
    assert out == ResultOutcome.REQUEUED and s.counters["exact_off_version"] == 1
    assert s.pull("c", 10, 1.0) == []  # nothing delivered
    [(w2, g2)] = s.dispatch(1.0)
    assert w2 is other
    assert s.result(w2, task_id=g2.task_id, prompt_id="e", trajectories=trajs("e", 1, [2, 2, 2]), error=None, retryable=True, now=2.0) == "accepted"
    [res] = s.pull("c", 10, 2.0)
    assert res.state == Phase.DONE and all(int(t.token_versions.max()) == 2 for t in res.trajectories)
    s.check_invariants()


def test_exact_groups_fail_at_once_when_the_last_worker_at_their_version_moves_on() -> None:
    s = make()
    s.set_version(1, 0.0)
    w = join(s, "w", 1, capacity=1)
    s.submit([plain("busy"), exact("e1", 1), exact("e1b", 1)], 0.0)
    s.dispatch(0.0)  # the worker's one credit goes to "busy"; the exact groups wait in the queue
    s.set_version(2, 1.0)
    assert failed(s) == {}  # the worker still serves 1: they wait
    beat(s, w, 2, 2.0)  # it applied 2: nobody holds 1, and nobody fetches an older version
    reasons = failed(s)
    assert set(reasons) == {"e1", "e1b"} and all("no longer served" in r for r in reasons.values())
    assert s.counters["exact_failed"] == 2 and s.queued == 0
    s.check_invariants()


def test_an_exact_group_whose_version_leaves_mid_generation_fails_after_its_off_version_result() -> None:
    s = make()
    s.set_version(1, 0.0)
    w = join(s, "w", 1, capacity=1)
    s.submit([exact("e", 1)], 0.0)
    [(_, g)] = s.dispatch(0.0)
    s.set_version(2, 1.0)
    beat(s, w, 2, 1.5)
    assert s.result(w, task_id=g.task_id, prompt_id="e", trajectories=trajs("e", 1, [1, 2]), error=None, retryable=True, now=2.0) == "failed"
    assert "exact_version_unavailable" in failed(s)["e"]
    s.check_invariants()


def test_bad_exact_versions_are_refused_at_submit_with_the_reason() -> None:
    s = make(max_staleness=1)
    s.set_version(2, 0.0)
    s.set_version(5, 0.0)  # versions 3 and 4 were never published
    join(s, "w", 5)
    _, rej = s.submit([exact("never", 3), exact("future", 8), exact("old", 2), exact("neg", -4),
                       Prompt(prompt_id="contra", text="x", min_weight_version=6, exact_weight_version=5)], 0.0)
    why = {r.prompt_id: r.detail for r in rej}
    assert {r.reason for r in rej} == {"exact_version_unavailable"}
    assert "never published" in why["never"]
    assert "ahead" in why["future"] and "eta 1" in why["future"]
    assert "staleness bound" in why["old"]
    assert ">= 0" in why["neg"] and "min_weight_version" in why["contra"]
    assert s.counters["exact_rejected"] == 5 and s.queued == 0
    acc, rej = s.submit([exact("next", 7), exact("now", 5)], 0.0)  # within eta + 1 ahead: waits for its publish
    assert rej == [] and acc == ["next", "now"]


def test_a_future_exact_version_waits_for_its_publish_then_is_served() -> None:
    s = make(max_staleness=1)
    s.set_version(0, 0.0)
    w = join(s, "w", 0)
    s.submit([exact("f", 1)], 0.0)
    assert s.dispatch(0.0) == []
    s.set_version(1, 1.0)
    assert s.dispatch(1.0) == []
    beat(s, w, 1, 2.0)
    [(_, g)] = s.dispatch(2.0)
    assert g.prompt_id == "f"


def test_an_exact_version_every_worker_gave_up_fails_the_waiting_groups_at_once() -> None:
    s = make()
    s.set_version(0, 0.0)
    a, b = join(s, "a", 0), join(s, "b", 0)
    s.set_version(1, 1.0)
    s.submit([exact("e", 1)], 1.0)
    s.apply_done(a, 1, ok=False, error="bad shape", skipped=True, now=2.0)
    assert failed(s) == {}
    s.apply_done(b, 1, ok=False, error="bad shape", skipped=True, now=2.1)
    assert "every live worker gave weight version 1 up" in failed(s)["e"]


# ------------------------------------------------------------------ convergence


def test_convergence_records_the_time_until_every_live_worker_serves_a_version_and_the_slowest() -> None:
    s = make()
    ws = [join(s, f"w{i}", 0) for i in range(3)]
    s.set_version(1, 10.0)
    beat(s, ws[0], 1, 10.5)
    beat(s, ws[2], 1, 11.0)
    assert s.convergence.records == type(s.convergence.records)() and s.snapshot()["convergence_open"] == 1
    s.remove_worker("w1", 11.5, "dead")  # a lost worker holds nobody back
    [rec] = s.convergence.records
    assert rec.version == 1 and rec.slowest_worker == "w2" and abs(rec.converged_s - 1.0) < 1e-9 and rec.workers == 2
    snap = s.snapshot()
    assert snap["convergence_last_version"] == 1 and snap["convergence_p50_s"] == 1.0 and snap["versions_converged"] == 1
    # a worker skipping straight to a newer version also serves the older one's successor
    s.set_version(2, 20.0)
    s.set_version(3, 20.5)
    for i, w in enumerate([ws[0], ws[2]]):
        beat(s, w, 3, 21.0 + i)
    assert [r.version for r in s.convergence.records] == [1, 2, 3]
    assert any(ev == "version_converged" and f["version"] == 3 for ev, f in s.effects.events)


def test_percentile_is_the_nearest_rank() -> None:
    assert percentile([], 0.5) == 0.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile(range(1, 101), 0.95) == 95.0


# ------------------------------------------------------------------ fleet activation


def test_fleet_activation_grants_every_staged_worker_together_once_all_have_staged() -> None:
    s = make(activation="fleet", max_applying=1)
    ws = [join(s, f"w{i}", 0) for i in range(4)]
    s.set_version(1, 0.0)
    for i, w in enumerate(ws[:3]):
        s.apply_request(w, 1, 0.1 * i)
    assert s.effects.grants == [] and s.fleet_version == -1  # one worker has not staged it: nobody switches
    s.submit([plain(f"p{i}") for i in range(4)], 0.3)
    assert len(s.dispatch(0.3)) == 4  # they keep serving the old version meanwhile
    s.apply_request(ws[3], 1, 0.4)
    assert sorted(s.effects.grants) == [(f"w{i}", 1) for i in range(4)]  # all at once, max_applying notwithstanding
    assert s.fleet_version == 1
    s.submit([plain("late")], 0.5)
    for w in ws:
        s.credit(w, 4, 0.5)
    assert s.dispatch(0.5) == []  # no task starts on the old version after the activation
    for i, w in enumerate(ws):
        s.apply_done(w, 1, ok=True, now=0.6 + 0.01 * i)
    [r] = s.fleet_rounds
    assert r.finished() and abs(r.skew_ms() - 30.0) < 1e-6
    assert s.snapshot()["fleet_activation_skew_p95_ms"] == 30.0
    assert [g.prompt_id for _, g in s.dispatch(0.7)] == ["late"]
    s.check_invariants()


def test_a_worker_that_never_stages_is_held_out_at_the_deadline_and_counted_until_it_catches_up() -> None:
    s = make(activation="fleet", fleet_stage_deadline_s=5.0, missed_heartbeats=100)
    ws = [join(s, f"w{i}", 0) for i in range(3)]
    s.set_version(1, 0.0)
    s.apply_request(ws[0], 1, 1.0)
    s.apply_request(ws[1], 1, 1.2)
    s.expire(5.9)
    assert s.effects.grants == []  # the deadline counts from the first stage (1.0)
    s.expire(6.0)
    assert sorted(s.effects.grants) == [("w0", 1), ("w1", 1)]
    assert s.counters["fleet_holdouts"] == 1 and s.counters["fleet_deadline_activations"] == 1
    assert any(ev == "fleet_holdout" and f["worker_id"] == "w2" for ev, f in s.effects.events)
    s.effects.clear()
    s.submit([plain("p")], 6.1)
    assert s.dispatch(6.1) == []  # w2 still serves 0: held out; the others are switching
    assert ws[2].held_out and s.snapshot()["fleet_held_out"] == 1
    assert s.workers["w2"].live_state(6.1)["held_out"] is True
    s.apply_done(ws[0], 1, ok=True, now=6.2)
    assert [w.worker_id for w, _ in s.dispatch(6.2)] == ["w0"]
    s.apply_request(ws[2], 1, 7.0)  # it staged at last: switched at once, no round to wait for
    assert s.effects.grants == [("w2", 1)]
    s.apply_done(ws[2], 1, ok=True, now=7.1)
    assert not ws[2].held_out and s.snapshot()["fleet_held_out"] == 0
    s.check_invariants()


def test_a_lost_worker_does_not_hold_a_fleet_round_back() -> None:
    s = make(activation="fleet")
    ws = [join(s, f"w{i}", 0) for i in range(3)]
    s.set_version(1, 0.0)
    s.apply_request(ws[0], 1, 0.1)
    s.apply_request(ws[1], 1, 0.2)
    s.remove_worker("w2", 0.3, "dead")
    assert sorted(s.effects.grants) == [("w0", 1), ("w1", 1)] and s.counters["fleet_holdouts"] == 0


def test_rolling_activation_is_unchanged_one_slot_at_a_time() -> None:
    s = make(max_applying=1)
    ws = [join(s, f"w{i}", 0) for i in range(2)]
    s.set_version(1, 0.0)
    s.apply_request(ws[0], 1, 0.1)
    s.apply_request(ws[1], 1, 0.2)
    assert s.effects.grants == [("w0", 1)]
    assert "fleet_version" not in s.snapshot() and s.snapshot()["activation"] == "rolling"


def test_an_exact_group_whose_lease_runs_out_after_its_version_left_fails_at_once() -> None:
    s = make(missed_heartbeats=100)
    s.set_version(1, 0.0)
    a, b = join(s, "a", 1, capacity=1), join(s, "b", 1, capacity=1)
    s.submit([exact("e", 1)], 0.0)
    [(w, _)] = s.dispatch(0.0)
    other = b if w is a else a
    s.set_version(2, 1.0)
    beat(s, other, 2, 2.0)  # the other worker moved on; the lease's worker goes silent on its task, still at 1
    beat(s, w, 2, 3.0)  # ... and moves on too, the lease still open
    assert failed(s) == {}
    s.expire(11.0)  # the task's deadline (10 s): requeued, and nobody serves version 1 any more
    assert "no longer served" in failed(s)["e"]
    s.check_invariants()
