"""Named policies (`Prompt.policy`, a LoRA adapter's name) in the broker's pure state: refused at submit when not
served, dispatched only to a worker serving the adapter, delivered only when every sampled token is the adapter's
(and saying so), failed at once when the policy stops being served. An injected clock, no sockets."""

from __future__ import annotations

import numpy as np

from rollpool.broker.state import BrokerState, Phase, ResultOutcome
from rollpool.protocol import Prompt, Trajectory
from tests.unit.broker.test_contract_state import failed, join, make, plain, trajs


def named(pid: str, policy: str, n: int = 1) -> Prompt:
    return Prompt(prompt_id=pid, input_ids=np.arange(3, dtype=np.int32), group_size=n, policy=policy)


def announce(s: BrokerState, version: int, adapter: str | None = None, since: int = -1, base: str = "Qwen/Qwen3-8B") -> None:
    """What the broker's service does with a `SetVersion` (a version, and the adapter it says is served)."""
    s.set_version(version, 0.0)
    if adapter is not None:
        s.set_policy(adapter, since if since >= 0 else version, base, 0.0)


def deliver(s: BrokerState, pid: str, versions: list[int], n: int = 1, now: float = 1.0) -> str:
    g = s.groups[pid]
    w = s.workers[g.worker_id] if g.worker_id else None
    return s.result(w, task_id=g.task_id, prompt_id=pid, trajectories=trajs(pid, n, versions), error=None, retryable=True, now=now)


def test_a_policy_the_pool_does_not_serve_is_refused_at_submit_naming_it_and_what_is_served() -> None:
    s = make()
    announce(s, 0)
    join(s, "w", 0)
    acc, rej = s.submit([named("x", "math"), plain("p")], 0.0)
    assert acc == ["p"] and [(r.prompt_id, r.reason) for r in rej] == [("x", "policy_unavailable")]
    assert "'math'" in rej[0].detail and "no LoRA adapter was announced" in rej[0].detail
    announce(s, 1, "math")
    _, rej = s.submit([named("y", "code"), named("z", "Qwen/Qwen3-8B"), named("e", "")], 0.0)
    why = {r.prompt_id: r.detail for r in rej}
    assert set(why) == {"y", "z", "e"} and all(r.reason == "policy_unavailable" for r in rej)
    assert "'code' is not served" in why["y"] and "policy 'math' (a LoRA adapter, since version 1)" in why["y"]
    assert "base model that adapter 'math' applies to" in why["z"]
    assert "an adapter's name or None" in why["e"]
    announce(s, 2, "")  # an adapter published without a name: no prompt can name it
    _, rej = s.submit([named("u", "math")], 0.0)
    assert "the pool serves an unnamed LoRA adapter (since version 2; the trainer names it with AdapterSpec.name)" in rej[0].detail
    assert s.counters["policy_rejected"] == 5
    # the pool keeps serving: the plain prompt was dispatched and is delivered
    [(w, g)] = s.dispatch(0.0)
    assert g.prompt_id == "p"
    assert deliver(s, "p", [0, 0]) == ResultOutcome.ACCEPTED
    s.check_invariants()


def test_a_named_group_goes_only_to_a_worker_serving_the_adapter_and_its_trajectories_say_so() -> None:
    s = make()
    announce(s, 0)
    behind, serving = join(s, "behind", 0), join(s, "serving", 0)
    announce(s, 1, "math")  # adapter version 1: "serving" applies it, "behind" has not yet
    s.apply_done(serving, 1, ok=True, now=0.0)
    acc, rej = s.submit([named("m", "math"), plain("p")], 0.0)
    assert rej == [] and acc == ["m", "p"]
    got = {g.prompt_id: w.worker_id for w, g in s.dispatch(0.0)}
    assert got["m"] == "serving"
    assert deliver(s, "m", [1, 1, 1], n=1) == ResultOutcome.ACCEPTED
    done = {g.prompt_id: g for g in s.pull("c", 10, 1.0)}
    assert [t.policy for t in done["m"].trajectories] == ["math"]
    # a plain prompt's trajectories are not stamped (None: whatever the pool served)
    assert deliver(s, "p", [0, 0]) == ResultOutcome.ACCEPTED
    [res] = s.pull("c", 10, 1.0)
    assert [t.policy for t in res.trajectories] == [None]
    assert behind.version == 0
    s.check_invariants()


def test_versions_of_the_same_adapter_stay_one_policy_and_a_whole_model_version_leaves_it_on() -> None:
    s = make()
    announce(s, 0)
    w = join(s, "w", 0)
    announce(s, 1, "math")
    announce(s, 2, "math", since=1)  # trained on: the client says it began at 1
    s.set_version(3, 0.0)  # a whole-model version, the adapter stays on (the broker was told nothing new)
    s.apply_done(w, 3, ok=True, now=0.0)
    assert s.policy == "math" and s.policy_since == 1 and [s.policy_at(v) for v in range(4)] == [None, "math", "math", "math"]
    s.submit([named("m", "math")], 0.0)
    s.dispatch(0.0)
    # tokens of versions 1..3 are all the adapter's
    assert deliver(s, "m", [1, 2, 3]) == ResultOutcome.ACCEPTED
    [res] = s.pull("c", 10, 1.0)
    assert res.state == Phase.DONE and res.trajectories[0].policy == "math"


def test_a_result_with_a_token_made_without_the_adapter_is_not_delivered_and_tried_again() -> None:
    s = make()
    announce(s, 0)
    a = join(s, "a", 0, capacity=1)
    announce(s, 1, "math")
    s.apply_done(a, 1, ok=True, now=0.0)
    s.submit([named("m", "math")], 0.0)
    s.dispatch(0.0)
    # a sample that began on the base (version 0) is not the policy's, though the worker serves version 1
    assert deliver(s, "m", [0, 1]) == ResultOutcome.REQUEUED
    assert s.counters["policy_off"] == 1 and s.pull("c", 10, 1.0) == []
    s.credit(a, 1, 1.0)  # what the worker's result message gives back
    assert [g.prompt_id for _, g in s.dispatch(1.0)] == ["m"]
    assert deliver(s, "m", [1, 1], now=2.0) == ResultOutcome.ACCEPTED
    [res] = s.pull("c", 10, 2.0)
    assert res.trajectories[0].policy == "math"
    s.check_invariants()


def test_queued_groups_fail_at_once_when_their_adapter_is_replaced_and_running_ones_are_judged_by_their_tokens() -> None:
    s = make()
    announce(s, 0)
    w = join(s, "w", 0, capacity=2)
    announce(s, 1, "math")
    s.apply_done(w, 1, ok=True, now=0.0)
    s.submit([named("run1", "math"), named("run2", "math"), named("queued", "math"), plain("p")], 0.0)
    assert {g.prompt_id for _, g in s.dispatch(0.0)} == {"run1", "run2"}
    announce(s, 2, "code")  # another adapter: the pool serves "code" from version 2 on
    why = failed(s)
    assert set(why) == {"queued"} and why["queued"].startswith("policy_unavailable: policy 'math' is no longer served")
    assert "policy 'code' (a LoRA adapter, since version 2)" in why["queued"]
    # a running group whose tokens are all the old adapter's is that policy's: delivered
    assert deliver(s, "run1", [1, 1]) == ResultOutcome.ACCEPTED
    # one with a token of the new adapter is not, and cannot be tried again: failed, naming both
    assert deliver(s, "run2", [1, 2]) == ResultOutcome.FAILED
    ended = {g.prompt_id: g for g in s.pull("c", 10, 1.0)}
    assert ended["run1"].state == Phase.DONE and ended["run1"].trajectories[0].policy == "math"
    assert ended["run2"].state == Phase.FAILED and "a token of version 2, which is policy 'code'" in ended["run2"].reason
    # the plain prompt is served on
    s.apply_done(w, 2, ok=True, now=1.0)
    s.credit(w, 2, 1.0)
    assert [g.prompt_id for _, g in s.dispatch(1.0)] == ["p"]
    s.check_invariants()


def test_named_groups_fail_when_every_worker_gave_the_adapter_up() -> None:
    s = make()
    announce(s, 0)
    a, b = join(s, "a", 0), join(s, "b", 0)
    announce(s, 1, "math")
    s.submit([named("m", "math")], 0.0)
    assert s.dispatch(0.0) == []  # nobody serves version 1 yet: waits
    s.apply_done(a, 1, ok=False, error="rank 128 above max_lora_rank 64", skipped=True, now=0.0)
    assert failed(s) == {}  # b may still apply it
    s.apply_done(b, 1, ok=False, error="rank 128 above max_lora_rank 64", skipped=True, now=0.0)
    why = failed(s)
    assert set(why) == {"m"} and "given up by every live worker" in why["m"] and "max_lora_rank" in why["m"]
    s.check_invariants()


def test_a_rebase_below_an_adapter_forgets_it() -> None:
    s = make()
    announce(s, 0)
    join(s, "w", 0)
    announce(s, 1, "math")
    announce(s, 3, "code")
    s.submit([named("c", "code")], 0.0)
    s.rebase(2, 0, 0.0)  # back to version 2: "code" (first published at 3) belongs to the abandoned run
    assert s.policy == "math" and s.policy_since == 1
    assert failed(s)["c"].startswith("policy_unavailable: policy 'code' is no longer served after the rebase to version 2")


def test_trajectories_of_the_policy_keep_their_other_fields() -> None:
    s = make()
    announce(s, 0)
    w = join(s, "w", 0)
    announce(s, 1, "math")
    s.apply_done(w, 1, ok=True, now=0.0)
    s.submit([named("m", "math", n=2)], 0.0)
    [(_, g)] = s.dispatch(0.0)
    sent: tuple[Trajectory, ...] = trajs("m", 2, [1, 1])
    assert s.result(w, task_id=g.task_id, prompt_id="m", trajectories=sent, error=None, retryable=True, now=1.0) == "accepted"
    [res] = s.pull("c", 10, 1.0)
    for got, was in zip(res.trajectories, sent, strict=True):
        assert got.policy == "math" and got.sample_index == was.sample_index and np.array_equal(got.token_versions, was.token_versions)
