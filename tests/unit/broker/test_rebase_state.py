"""A rebase (checkpoint resume) in the broker's pure state, with an injected clock."""

from __future__ import annotations

import numpy as np

from rollpool.broker.config import BrokerConfig
from rollpool.broker.state import BrokerState, Phase
from rollpool.protocol import Prompt


def _state() -> BrokerState:
    s = BrokerState(BrokerConfig(heartbeat_interval_s=1.0, max_staleness=1, batch_size=2))
    for wid, version in (("old", 5), ("shared", 1)):
        s.add_worker(worker_id=wid, identity=wid.encode(), capacity=2, credits=2, now=0.0, version=version)
    s.set_version(5, 0.0)
    return s


def _submit(s: BrokerState, *pids: str) -> None:
    s.submit([Prompt(prompt_id=p, input_ids=np.arange(3, dtype=np.int32), group_size=1) for p in pids], 0.0)


def test_a_lower_version_is_not_taken_without_a_rebase() -> None:
    s = _state()
    assert s.set_version(3, 1.0) is False and s.version == 5


def test_a_rebase_restarts_version_and_admission_and_cancels_work_on_weights_of_the_abandoned_run() -> None:
    s = _state()
    _submit(s, "p1", "p2")
    out = s.dispatch(0.0)
    assert {w.worker_id for w, _ in out} == {"old"}  # "shared" (1) is more than eta behind 5
    s.staleness.accepted = 40  # samples the first trainer consumed
    info = s.rebase(1, epoch_id=1000, now=2.0)
    assert info == {"from": 5, "to": 1, "version_epoch": 1000, "cancelled": 2}
    assert (s.version, s.staleness.version, s.staleness.accepted, s.staleness.running) == (1, 1, 2, 0)
    assert s.workers["old"].version == -1 and s.workers["shared"].version == 1  # 1 <= 1: the same weights
    assert sorted(c[1] for c in s.effects.cancels) == sorted(g.task_id for _, g in out)
    assert all(g.phase == Phase.QUEUED and g.attempt - g.forgiven == 0 for _, g in out)  # requeued, no attempt burned
    assert {w.worker_id for w, _ in s.dispatch(2.0)} == {"shared"}  # only weights the new run shares get work
    s.effects.clear()
    # the abandoned-run worker's heartbeat, written before it saw the rebase, still counts as -1
    s.heartbeat(s.workers["old"], 3.0, version=5, state="ready", tokens_total=0, version_epoch=0)
    assert s.workers["old"].version == -1
    # once it saw the new epoch it reports -1, then applies version 1: current again
    s.heartbeat(s.workers["old"], 4.0, version=-1, state="ready", tokens_total=0, version_epoch=1000)
    s.apply_done(s.workers["old"], 1, ok=True)
    assert s.workers["old"].version == 1
    assert s.version_epoch == 1000 and s.counters["rebases"] == 1
    s.check_invariants()


def test_a_worker_that_joins_after_two_rebases_is_judged_by_the_lowest_one_since_its_epoch() -> None:
    s = _state()
    s.rebase(3, epoch_id=10, now=1.0)
    s.rebase(2, epoch_id=5, now=2.0)  # a clock that went back: the epoch still moves on
    assert s.version_epoch == 11
    s.add_worker(worker_id="late", identity=b"late", capacity=1, credits=1, now=3.0, version=3, version_epoch=0)
    assert s.workers["late"].version == -1  # 3 > min(3, 2)
    s.add_worker(worker_id="mid", identity=b"mid", capacity=1, credits=1, now=3.0, version=2, version_epoch=10)
    assert s.workers["mid"].version == 2  # only the rebase to 2 came after its epoch
    assert s.rebase_floor(0) == 2 and s.rebase_floor(10) == 2 and s.rebase_floor(11) == -1
