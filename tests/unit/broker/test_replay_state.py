"""Episode turns kept by the broker for the next attempt of a group (pure state, an injected clock)."""

from __future__ import annotations

import numpy as np

from rollpool.broker.state import BrokerState, Phase, WorkerInfo
from rollpool.protocol.messages import RecordedTurn
from tests.unit.broker.test_state import finish, join, make, prompt


def turn(sample: int, k: int, tokens: int = 4) -> RecordedTurn:
    return RecordedTurn(sample_index=sample, turn=k, request_digest=1000 * sample + k, output_ids=np.arange(tokens, dtype=np.int32),
                        logprobs=np.zeros(tokens, np.float32), token_versions=np.zeros(tokens, np.int32), finish_reason="stop")


def leased(s: BrokerState, w: WorkerInfo, n: int = 2) -> str:
    s.submit([prompt("p", n)], 0.0)
    ((_, g),) = s.dispatch(0.0)
    assert g.worker_id == w.worker_id
    return g.task_id


def test_turns_of_a_dead_worker_go_with_the_next_attempt_in_episode_and_turn_order() -> None:
    s = make()
    a = join(s, "a")
    tid = leased(s, a)
    assert s.record_turns(a, tid, "p", [turn(1, 0), turn(0, 0)], 0.5) == 2
    assert s.record_turns(a, tid, "p", [turn(0, 1)], 0.6) == 1
    s.remove_worker("a", 1.0, reason="dead")
    b = join(s, "b", now=1.0)
    ((_, g),) = s.dispatch(1.0)
    replay = s.replay_for(g)
    assert [(t.sample_index, t.turn, t.attempt) for t in replay] == [(0, 0, 0), (0, 1, 0), (1, 0, 0)]
    assert g.task_id != tid and g.worker_id == "b"
    # the re-run replays sample 0's turns and goes on at turn 2; sample 1 diverges at turn 0
    assert s.record_turns(b, g.task_id, "p", [turn(0, 2, tokens=3), turn(1, 0, tokens=5)], 1.5) == 2
    assert s.counters["tokens_regenerated"] == 5  # only the turn an earlier attempt had finished and this one sampled again
    assert [t.turn for t in g.turns[0]] == [0, 1, 2] and [t.attempt for t in g.turns[1]] == [1]  # type: ignore[index]
    s.check_invariants()
    assert finish(s, b, g.task_id, 2.0) == "accepted"
    assert g.turns is None and s.replay_bytes == 0  # forgotten at the terminal state
    s.check_invariants()


def test_turns_from_anyone_but_the_current_lease_holder_are_ignored() -> None:
    s = make()
    a = join(s, "a")
    tid = leased(s, a)
    other = join(s, "other")
    assert s.record_turns(other, tid, "p", [turn(0, 0)], 0.1) == 0  # not its lease
    assert s.record_turns(a, "p@7", "p", [turn(0, 0)], 0.1) == 0  # not the current attempt
    assert s.record_turns(a, tid, "nope", [turn(0, 0)], 0.1) == 0  # no such group
    assert s.record_turns(a, tid, "p", [turn(5, 0)], 0.1) == 0  # no such episode in a group of 2
    assert s.record_turns(a, tid, "p", [turn(0, 1)], 0.1) == 0  # a gap: turn 0 was never kept
    assert s.counters["replay_turns_ignored"] == 4 and s.counters["replay_turns_refused"] == 1
    s.remove_worker("a", 1.0, reason="dead")
    assert s.record_turns(a, tid, "p", [turn(0, 0)], 1.1) == 0  # a worker declared dead, still talking
    assert not any((s.groups["p"].turns or {}).values()) and s.replay_bytes == 0
    s.check_invariants()


def test_turns_past_the_group_bound_are_not_kept_and_the_ones_after_them_neither() -> None:
    one = 128 + 4 * 4 * 3  # a turn of 4 tokens: three arrays of 4 x 4 bytes and the fixed share
    s = make(replay_max_group_bytes=2 * one)
    a = join(s, "a")
    tid = leased(s, a)
    assert s.record_turns(a, tid, "p", [turn(0, 0), turn(0, 1), turn(0, 2), turn(0, 3)], 0.1) == 2
    assert s.counters["replay_turns_kept"] == 2 and s.counters["replay_turns_refused"] == 2
    assert s.replay_bytes == 2 * one
    s.check_invariants()


def test_the_pool_wide_bound_holds_across_groups() -> None:
    one = 128 + 4 * 4 * 3
    s = make(replay_max_bytes=2 * one + one // 2)
    a = join(s, "a", capacity=8)
    s.submit([prompt("p", 1), prompt("q", 1)], 0.0)
    leases = {g.prompt_id: g.task_id for _, g in s.dispatch(0.0)}
    assert s.record_turns(a, leases["p"], "p", [turn(0, 0), turn(0, 1)], 0.1) == 2
    assert s.record_turns(a, leases["q"], "q", [turn(0, 0)], 0.1) == 0  # within its group's bound, past the pool's
    assert s.replay_bytes == 2 * one
    s.check_invariants()


def test_a_rebase_and_a_cancel_forget_the_turns() -> None:
    s = make()
    a = join(s, "a", capacity=8, version=5)
    s.set_version(5, 0.0)
    s.submit([prompt("p", 1), prompt("q", 1)], 0.0)
    leases = {g.prompt_id: g.task_id for _, g in s.dispatch(0.0)}
    s.record_turns(a, leases["p"], "p", [turn(0, 0)], 0.1)
    s.record_turns(a, leases["q"], "q", [turn(0, 0)], 0.1)
    s.cancel(["q"], 0.2)
    assert s.groups["q"].phase == Phase.CANCELLED and s.groups["q"].turns is None
    s.rebase(2, 1, 0.3)  # the worker's version 5 belonged to the abandoned run: its lease is requeued, its turns void
    assert s.groups["p"].phase == Phase.QUEUED and s.groups["p"].turns is None and s.replay_bytes == 0
    s.check_invariants()


def test_a_lease_sent_older_turns_is_judged_by_their_oldest_version() -> None:
    s = make()
    a = join(s, "a", version=3)
    tid = leased(s, a)
    t = turn(0, 0)
    t.token_versions[:] = 3
    s.record_turns(a, tid, "p", [t], 0.1)
    s.remove_worker("a", 1.0, reason="dead")
    join(s, "b", now=1.0, version=6)
    ((_, g),) = s.dispatch(1.0)
    assert g.start_version == 6
    s.replay_for(g)
    assert g.start_version == 3  # no token of this attempt is older than what early cancellation judges it by
