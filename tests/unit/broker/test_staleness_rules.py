"""Staleness control in the broker's pure state (injected clock, no sockets): version-aware dispatch
(`fresh_dispatch_hold_s`), early cancellation of doomed leases (`cancel_stale_inflight`, judged by
each lease's start version against the trainer's bound) and wasted tokens by reason."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpool.broker.state import BrokerState, Phase, WorkerInfo
from tests.unit.broker.test_state import finish, group, join, make, prompt
from tests.unit.broker.test_state import ops as random_ops

B = 4  # samples per step; groups of 1 sample, so capacity counts groups


def window(eta: int = 1, **kw: object) -> BrokerState:
    return make(max_staleness=eta, batch_size=B, **kw)


def fill_window(s: BrokerState, w: WorkerInfo, now: float = 0.0) -> list[str]:
    """Lease everything the window admits to `w`; returns the task ids."""
    return [g.task_id for _, g in s.dispatch(now) if _ is w]


def deliver_batch(s: BrokerState, w: WorkerInfo, task_ids: list[str], now: float = 0.0) -> None:
    for tid in task_ids:
        assert finish(s, w, tid, now) == "accepted"
    s.ack([r.prompt_id for r in s.pull("c", 100)])


# ------------------------------------------------------------------ version-aware dispatch


def test_the_capacity_a_bump_opens_waits_for_a_fresh_worker_within_the_hold() -> None:
    s = window(fresh_dispatch_hold_s=5.0)
    behind = join(s, "behind", capacity=32, version=0)
    s.set_version(0, 0.0)
    s.submit([prompt(f"p{i}") for i in range(20)], 0.0)
    first = fill_window(s, behind)
    assert len(first) == 2 * B  # (v + eta + 1) B at v = 0
    deliver_batch(s, behind, first[:B], 1.0)  # the trainer took one batch...
    s.set_version(1, 2.0)  # ...and published version 1: B samples of capacity open
    assert s.held_for_fresh == B and s.hold_until == 7.0
    assert s.dispatch(3.0) == []  # the worker behind does not get them while the hold lasts
    fresh = join(s, "fresh", capacity=32, version=1, now=3.5)  # e.g. its apply of version 1 finished
    out = s.dispatch(4.0)
    assert [w.worker_id for w, _ in out] == ["fresh"] * B
    assert all(g.start_version == 1 for _, g in out)
    assert s.held_for_fresh == 0 and s.hold_until is None and s.counters["fresh_dispatched"] == B
    assert fresh.credits == 32 - B
    s.check_invariants()


def test_the_hold_expires_into_a_worker_behind_so_the_pool_never_idles_past_it() -> None:
    s = window(fresh_dispatch_hold_s=5.0)
    behind = join(s, "behind", capacity=32, version=0)
    s.set_version(0, 0.0)
    s.submit([prompt(f"p{i}") for i in range(20)], 0.0)
    deliver_batch(s, behind, fill_window(s, behind)[:B], 1.0)
    s.set_version(1, 2.0)
    assert s.dispatch(6.99) == []  # no worker on version 1 came
    out = s.dispatch(7.0)  # the hold is over: the worker within eta takes it, as without the rule
    assert len(out) == B and all(w is behind and g.start_version == 0 for w, g in out)
    assert s.counters["fresh_holds"] == 1 and s.counters["fresh_holds_expired"] == 1
    s.check_invariants()


def test_a_worker_behind_still_gets_capacity_beyond_the_reserve_and_no_hold_without_the_option() -> None:
    s = window(fresh_dispatch_hold_s=5.0)
    behind = join(s, "behind", capacity=32, version=0)
    s.set_version(0, 0.0)
    s.submit([prompt(f"p{i}") for i in range(20)], 0.0)
    first = fill_window(s, behind)
    s.nack(behind, first[-2:], 0.5, "handed back")  # two samples of old capacity free again
    deliver_batch(s, behind, first[:B], 1.0)
    s.set_version(1, 2.0)
    out = s.dispatch(2.0)
    assert len(out) == 2 and all(w is behind for w, _ in out)  # the old capacity, not the reserve
    assert s.held_for_fresh == B
    # the same steps without the option: the worker behind takes everything at once (today's rule)
    t = window()
    b2 = join(t, "behind", capacity=32, version=0)
    t.set_version(0, 0.0)
    t.submit([prompt(f"p{i}") for i in range(20)], 0.0)
    deliver_batch(t, b2, fill_window(t, b2)[:B], 1.0)
    t.set_version(1, 2.0)
    assert len(t.dispatch(2.0)) == B and t.hold_until is None


def test_exempt_prompts_are_not_held() -> None:
    s = window(fresh_dispatch_hold_s=5.0)
    behind = join(s, "behind", capacity=32, version=0)
    s.set_version(0, 0.0)
    s.submit([prompt(f"p{i}") for i in range(8)], 0.0)
    deliver_batch(s, behind, fill_window(s, behind)[:B], 1.0)
    s.set_version(1, 2.0)
    ev = prompt("eval")
    ev = type(ev)(**{**{f: getattr(ev, f) for f in ev.__dataclass_fields__}, "exempt_from_staleness": True})
    s.submit([ev], 2.0)
    assert [g.prompt_id for _, g in s.dispatch(2.0)] == ["eval"]


# ------------------------------------------------------------------ early cancellation


def leased_at(s: BrokerState, w: WorkerInfo, n: int, now: float) -> list[str]:
    s.credit(w, 64, now)
    out = s.dispatch(now)
    assert len(out) == n, len(out)
    return [g.task_id for _, g in out]


def test_a_doomed_lease_is_cancelled_at_the_bump_that_dooms_it_and_not_before() -> None:
    s = make(max_staleness=1, batch_size=100, cancel_stale_inflight=True)
    w = join(s, "w", capacity=8, version=0)
    s.set_version(0, 0.0)
    s.submit([prompt("old")], 0.0)
    (tid,) = leased_at(s, w, 1, 0.0)
    s.apply_done(w, 1, ok=True)  # the worker moves on; the lease keeps its start version 0
    s.set_version(1, 1.0)
    assert s.effects.cancels == [] and s.groups["old"].phase == Phase.LEASED  # staleness 1 <= eta: still consumable
    s.apply_done(w, 2, ok=True)
    s.set_version(2, 2.0)  # 2 - 0 > 1: no sample of it can be consumed within the bound
    assert s.effects.cancels == [("w", tid, "stale")]
    g = s.groups["old"]
    assert g.phase == Phase.QUEUED and g.attempt == 1 and g.attempt - g.forgiven == 0  # no attempt charged
    assert s.staleness.running == 0 and s.counters["doomed_cancelled"] == 1
    out = s.dispatch(3.0)
    assert [g.task_id for _, g in out] == ["old@1"] and out[0][1].start_version == 2
    late = s.result(w, task_id=tid, prompt_id="old", trajectories=group("old", 1), error=None, retryable=True, now=3.5)
    assert late == "duplicate" and s.counters["wasted_tokens_duplicate"] == 2
    s.check_invariants()


def test_the_lease_start_version_decides_not_the_workers_version() -> None:
    """Today's rule looked at the worker only: a lease started two versions back on a worker that has
    caught up since was left to run and be dropped on arrival."""
    s = make(max_staleness=1, batch_size=100, cancel_stale_inflight=True)
    w = join(s, "w", capacity=8, version=0)
    s.set_version(0, 0.0)
    s.submit([prompt("a")], 0.0)
    leased_at(s, w, 1, 0.0)
    for v in (1, 2):
        s.apply_done(w, v, ok=True)  # current at every bump
        s.set_version(v, float(v))
    assert len(s.effects.cancels) == 1 and s.counters["doomed_cancelled"] == 1


def test_the_keep_bound_moves_the_cancellation_point() -> None:
    s = make(max_staleness=1, batch_size=100, cancel_stale_inflight=True)
    s.set_trainer_bound(2)  # the trainer keeps up to 2 x eta
    w = join(s, "w", capacity=8, version=0)
    s.set_version(0, 0.0)
    s.submit([prompt("a")], 0.0)
    leased_at(s, w, 1, 0.0)
    for v in (1, 2):
        s.apply_done(w, v, ok=True)
        s.set_version(v, float(v))
    assert s.effects.cancels == []  # staleness 2 <= the keep bound
    s.apply_done(w, 3, ok=True)
    s.set_version(3, 3.0)
    assert len(s.effects.cancels) == 1
    # and the result-time drop uses the same bound: output of version 1 at version 3 is kept
    s.submit([prompt("b")], 3.0)
    assert leased_at(s, w, 2, 3.0) == ["a@1", "b@0"]
    out = s.result(w, task_id="b@0", prompt_id="b", trajectories=group("b", 1, version=1), error=None, retryable=True, now=3.5)
    assert out == "accepted"
    s.set_trainer_bound(-1)  # back to eta: the same output would be dropped on arrival
    out = s.result(w, task_id="a@1", prompt_id="a", trajectories=group("a", 1, version=1), error=None, retryable=True, now=3.5)
    assert out == "requeued" and s.counters["wasted_tokens_stale_drop"] == 2
    s.check_invariants()


def test_exempt_leases_are_never_cancelled_as_doomed() -> None:
    s = make(max_staleness=0, batch_size=100, cancel_stale_inflight=True)
    w = join(s, "w", capacity=8, version=0)
    s.set_version(0, 0.0)
    ev = prompt("eval")
    ev = type(ev)(**{**{f: getattr(ev, f) for f in ev.__dataclass_fields__}, "exempt_from_staleness": True})
    s.submit([ev], 0.0)
    leased_at(s, w, 1, 0.0)
    s.set_version(5, 1.0)
    assert s.effects.cancels == [] and s.groups["eval"].phase == Phase.LEASED


# ------------------------------------------------------------------ wasted tokens


def test_wasted_tokens_are_counted_by_reason_as_a_share_of_generated() -> None:
    s = make(max_staleness=1, batch_size=100, cancel_stale_inflight=True)
    w = join(s, "w", capacity=8, version=0)
    s.set_version(0, 0.0)
    s.submit([prompt(f"p{i}") for i in range(4)], 0.0)
    tids = leased_at(s, w, 4, 0.0)
    assert finish(s, w, tids[0]) == "accepted"  # 2 tokens, trained
    assert finish(s, w, tids[1]) == "accepted"  # 2 tokens, dropped as stale by the trainer
    (a, b) = s.pull("c", 10)
    s.ack([a.prompt_id, b.prompt_id], dropped_stale=[b.prompt_id])
    bad = s.result(w, task_id=tids[2], prompt_id="p2", trajectories=group("p1", 1), error=None, retryable=True, now=0.0)
    assert bad == "requeued"  # trajectories of another prompt: an invalid result (2 tokens, failure)
    assert s.result(w, task_id=tids[0], prompt_id="p0", trajectories=group("p0", 1), error=None, retryable=True,
                    now=0.0) == "duplicate"  # 2 tokens
    s.note_tokens_cancelled(w, 5)  # the worker aborted 5 tokens of cancelled tasks so far
    s.note_tokens_cancelled(w, 5)  # the same total again adds nothing
    c = s.counters
    assert c["generated_tokens"] == 2 + 2 + 2 + 2 + 5
    assert (c["wasted_tokens_stale_drop"], c["wasted_tokens_failure"], c["wasted_tokens_duplicate"], c["wasted_tokens_cancel"]) == (2, 2, 2, 5)
    shares = s.wasted_shares()
    assert shares["wasted_share"] == (2 + 2 + 2 + 5) / 13
    assert shares["wasted_share_cancel"] == 5 / 13
    snap = s.snapshot()
    assert snap["wasted_share_stale_drop"] == round(2 / 13, 6) and snap["generated_tokens"] == 13


def test_inserted_episode_tokens_are_not_counted_as_generated() -> None:
    s = make()
    w = join(s, "w", capacity=1)
    s.submit([prompt("e")], 0.0)
    (_, g), = s.dispatch(0.0)
    (t,) = group("e", 1)
    t = type(t)(**{**{f: getattr(t, f) for f in t.__dataclass_fields__}, "loss_mask": np.array([1, 0], np.uint8)})
    assert s.result(w, task_id=g.task_id, prompt_id="e", trajectories=(t,), error=None, retryable=True, now=0.0) == "accepted"
    assert s.counters["generated_tokens"] == 1


def test_a_restarted_worker_counts_its_cancelled_tokens_from_zero() -> None:
    s = make()
    w = join(s, "w")
    s.note_tokens_cancelled(w, 10)
    s.note_tokens_cancelled(w, 3)  # the process restarted: 3 new tokens, not -7
    s.note_tokens_cancelled(w, -1)  # not reported (an older worker): nothing
    assert s.counters["wasted_tokens_cancel"] == 13


# ------------------------------------------------------------------ every rule at once, random schedules


@settings(max_examples=100, deadline=None)
@given(ops=random_ops, eta=st.integers(0, 2), batch=st.integers(1, 8), keep=st.booleans())
def test_admission_and_the_bound_hold_with_the_hold_and_the_cancellation_on(ops: list[tuple[str, int]], eta: int, batch: int,
                                                                           keep: bool) -> None:
    s = make(max_staleness=eta, batch_size=batch, max_attempts=1000, max_handbacks=1000, cancel_stale_inflight=True,
             fresh_dispatch_hold_s=0.05)
    if keep:
        s.set_trainer_bound(2 * eta)
    bound = 2 * eta if keep else eta
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
            for x in list(s.workers.values())[: arg + 1]:  # only some workers catch up
                s.heartbeat(x, now, version=s.version, state="ready", tokens_total=0)
            # nothing left running that can no longer be consumed within the bound
            assert all(g.start_version >= s.version - bound for x in s.workers.values() for g in x.leases.values())
        elif op == "kill" and w is not None:
            s.remove_worker(wid, now, reason="dead")
            join(s, wid, capacity=6, now=now, version=max(s.version, 0))
        elif op == "credit" and w is not None:
            s.credit(w, 6, now)
        elif op == "drop":
            got = s.pull("c", 2)
            s.ack([g.prompt_id for g in got], dropped_stale=[g.prompt_id for g in got][: arg % 2])
        v = max(s.version, 0)
        assert s.staleness.accepted + s.staleness.running <= (v + eta + 1) * batch
        assert 0 <= s.held_for_fresh
        s.check_invariants()
    s.dispatch(now + 1.0)  # past every hold: nothing is reserved any more
    assert s.held_for_fresh == 0


def test_inserted_tokens_do_not_age_a_result_only_sampled_ones_do() -> None:
    # an episode's inserted tokens (loss mask 0: tool output, turn markers) carry a version but were not
    # sampled by it; the trainer judges staleness on sampled tokens only, and so must the broker
    from rollpool.protocol.messages import Trajectory

    s = make(max_staleness=1, batch_size=100, cancel_stale_inflight=True)
    w = join(s, "w", capacity=8, version=2)
    s.set_version(2, 0.0)
    s.submit([prompt("ep")], 0.0)
    (tid,) = leased_at(s, w, 1, 0.0)
    s.set_version(3, 1.0)  # within the bound for a lease that started at version 2
    z = np.zeros(3, dtype=np.int32)
    traj = Trajectory(prompt_id="ep", sample_index=0, input_ids=z, output_ids=z, output_logprobs=np.zeros(3, np.float32),
                      token_versions=np.array([0, 2, 2], np.int32), loss_mask=np.array([0, 1, 1], np.uint8), finish_reason="stop")
    out = s.result(w, task_id=tid, prompt_id="ep", trajectories=(traj,), error=None, retryable=True, now=2.0)
    assert out == "accepted" and s.groups["ep"].phase == Phase.DONE
    s.check_invariants()
