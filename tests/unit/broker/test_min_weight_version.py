"""`Prompt.min_weight_version`: the broker dispatches such a group only to a worker at that version or newer.

Pure state, injected clock (no sockets, no sleeping). A peer of the previous protocol minor (1.0, which
has no such field) is decoded by the new codec and served as before.
"""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np

from rollpool.broker.config import BrokerConfig
from rollpool.broker.state import BrokerState, Phase, WorkerInfo
from rollpool.protocol import InflightTask, Prompt, Submit, Trajectory, decode, encode


def _prompt(pid: str, min_version: int = -1, n: int = 1) -> Prompt:
    return Prompt(prompt_id=pid, input_ids=np.arange(3, dtype=np.int32), group_size=n, min_weight_version=min_version)


def _state() -> BrokerState:
    return BrokerState(BrokerConfig(heartbeat_interval_s=1.0, task_timeout_s=10.0))


def _join(s: BrokerState, wid: str, version: int, capacity: int = 4, now: float = 0.0) -> WorkerInfo:
    s.add_worker(worker_id=wid, identity=wid.encode(), capacity=capacity, credits=capacity, now=now, version=version)
    return s.workers[wid]


def _done(s: BrokerState, w: WorkerInfo, task_id: str, now: float) -> None:
    g = w.leases[task_id]
    z = np.zeros(2, dtype=np.int32)
    trajs = tuple(Trajectory(prompt_id=g.prompt_id, sample_index=i, input_ids=z, output_ids=z, output_logprobs=np.zeros(2, np.float32),
                             token_versions=np.full(2, w.version, np.int32), loss_mask=np.ones(2, np.uint8), finish_reason="stop")
                  for i in range(g.size))
    s.result(w, task_id=task_id, prompt_id=g.prompt_id, trajectories=trajs, error=None, retryable=True, now=now)


def test_a_worker_below_the_minimum_version_never_takes_the_group_and_the_queue_behind_it_moves() -> None:
    s = _state()
    old = _join(s, "old", version=0)
    s.submit([_prompt("sync", min_version=1), _prompt("plain")], 0.0)
    out = s.dispatch(0.0)
    # the plain group behind the too-new one is served; the too-new one stays queued
    assert [(w.worker_id, g.prompt_id) for w, g in out] == [("old", "plain")]
    assert s.groups["sync"].phase == Phase.QUEUED
    assert s.dispatch(1.0) == []  # asked again: still not given to the old worker
    s.check_invariants()
    # the old worker applies version 1 (reported by its heartbeat): now it may take it
    s.heartbeat(old, 2.0, version=1, state="ready", tokens_total=0)
    assert [(w.worker_id, g.prompt_id) for w, g in s.dispatch(2.0)] == [("old", "sync")]
    s.check_invariants()


def test_the_group_goes_to_the_worker_that_has_the_version_and_keeps_its_queue_place() -> None:
    s = _state()
    _join(s, "old", version=0, capacity=8)
    new = _join(s, "new", version=2, capacity=1)
    s.submit([_prompt("a", min_version=2), _prompt("b", min_version=2), _prompt("c")], 0.0)
    got = [(w.worker_id, g.prompt_id) for w, g in s.dispatch(0.0)]
    assert ("new", "a") in got and ("old", "c") in got and len(got) == 2
    assert s.groups["b"].phase == Phase.QUEUED  # 'new' has no credit left; 'old' is too old
    _done(s, new, "a@0", 1.0)
    s.credit(new, 1, 1.0)
    assert [(w.worker_id, g.prompt_id) for w, g in s.dispatch(1.0)] == [("new", "b")]
    s.check_invariants()


def test_an_applied_version_reported_by_apply_done_opens_dispatch() -> None:
    s = _state()
    w = _join(s, "w", version=0)
    s.submit([_prompt("p", min_version=1)], 0.0)
    assert s.dispatch(0.0) == []
    s.apply_request(w, 1)
    s.apply_done(w, 1, ok=True)
    assert [g.prompt_id for _, g in s.dispatch(0.5)] == ["p"]
    # a failed apply does not raise the worker's version: a group needing version 2 stays queued
    s.submit([_prompt("q", min_version=2)], 1.0)
    s.apply_request(w, 2)
    s.apply_done(w, 2, ok=False)
    assert s.dispatch(1.5) == []
    s.check_invariants()


def test_many_too_new_groups_do_not_starve_a_group_within_the_scan_bound() -> None:
    s = _state()
    _join(s, "old", version=0, capacity=4)
    s.submit([_prompt(f"new{i}", min_version=5) for i in range(10)] + [_prompt("plain")], 0.0)
    assert [g.prompt_id for _, g in s.dispatch(0.0)] == ["plain"]
    assert sum(1 for g in s.groups.values() if g.phase == Phase.QUEUED) == 10
    s.check_invariants()


def test_a_resubmitted_prompt_carries_its_minimum_into_the_merged_group() -> None:
    """After a broker restart a worker re-announces a task; it leaves; the client's resubmission (with a minimum) merges."""
    s = _state()
    s.add_worker(worker_id="gone", identity=b"gone", capacity=4, credits=4, now=0.0, version=0,
                 inflight=(InflightTask(task_id="p@0", prompt_id="p", group_size=1),))
    s.remove_worker("gone", 1.0, reason="dead")  # the adopted group is parked, waiting for its prompt
    _join(s, "old", version=0, now=1.0)
    accepted, _ = s.submit([_prompt("p", min_version=3)], 2.0)
    assert accepted == ["p"] and s.groups["p"].min_version == 3
    assert s.dispatch(2.0) == []  # the merged group keeps the minimum: the old worker does not get it
    _join(s, "new", version=3, now=3.0)
    assert [(w.worker_id, g.prompt_id) for w, g in s.dispatch(3.0)] == [("new", "p")]
    s.check_invariants()


def test_a_previous_minor_peer_without_the_field_is_served_by_any_worker() -> None:
    """A 1.0 client's submit (header minor 0, no min_weight_version) decodes with the default and dispatches as before."""
    frames = [bytes(memoryview(f)) for f in encode(Submit(request_id="r", prompts=(_prompt("old-peer"),)))]
    major, _minor, type_name, fields = msgpack.unpackb(frames[0])
    assert "min_weight_version" not in fields["prompts"][0]  # the default is left off the wire
    frames[0] = msgpack.packb([major, 0, type_name, fields], use_bin_type=True)
    msg = decode(frames)
    assert isinstance(msg, Submit) and msg.prompts[0].min_weight_version == -1
    s = _state()
    _join(s, "w", version=-1)  # a worker that never received weights
    s.submit(msg.prompts, 0.0)
    assert [g.prompt_id for _, g in s.dispatch(0.0)] == ["old-peer"]
    # and the new field travels: a 1.1 prompt with a minimum round-trips
    p = dataclasses.replace(_prompt("new-peer"), min_weight_version=7)
    back = decode([bytes(memoryview(f)) for f in encode(Submit(request_id="r", prompts=(p,)))])
    assert isinstance(back, Submit) and back.prompts[0].min_weight_version == 7
