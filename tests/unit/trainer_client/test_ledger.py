"""The trainer client's ledger, driven directly (no sockets, no sleeping, time passed in)."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import pathlib
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rollpool.trainer_client.ledger as ledger_module
from rollpool.protocol import GroupResult, GroupState, Prompt, Rejection, SamplingParams, SubmitReply, Trajectory
from rollpool.trainer_client.ledger import ClientLedger, Dedup, SubmitResult


def make(*, regenerate_stale: bool = False, dedup_window: int = 1000, **kw: Any) -> ClientLedger:
    ids = itertools.count()
    return ClientLedger(dedup_window=dedup_window, regenerate_stale=regenerate_stale, new_prompt_id=lambda: f"fresh-{next(ids)}", **kw)


def prompt(pid: str, n: int = 2, **kw: Any) -> Prompt:
    kw.setdefault("input_ids", np.arange(3, dtype=np.int32))
    return Prompt(prompt_id=pid, group_size=n, **kw)


def trajs(pid: str, n: int, version: int = 0, out: int = 2, metadata: dict[str, Any] | None = None,
          input_ids: np.ndarray | None = None) -> tuple[Trajectory, ...]:
    z = np.zeros(out, dtype=np.int32)
    return tuple(
        Trajectory(
            prompt_id=pid, sample_index=i, input_ids=np.zeros(3, np.int32) if input_ids is None else input_ids, output_ids=z,
            output_logprobs=np.zeros(out, np.float32), token_versions=np.full(out, version, np.int32),
            loss_mask=np.ones(out, np.uint8), finish_reason="stop", reward=float(i), metadata=dict(metadata or {}),
        )
        for i in range(n)
    )


def done(pid: str, n: int = 2, version: int = 0, **kw: Any) -> GroupResult:
    return GroupResult(prompt_id=pid, state=GroupState.DONE, trajectories=trajs(pid, n, version, **kw))


def accept(led: ClientLedger, *prompts: Prompt, rejected: tuple[Rejection, ...] = ()) -> SubmitResult:
    result = SubmitResult(accepted=[], rejected={})
    reply = SubmitReply(request_id="r", epoch="e", accepted=tuple(p.prompt_id for p in prompts if p.prompt_id not in
                                                                    {r.prompt_id for r in rejected}), rejected=rejected)
    led.submitted(prompts, reply, result)
    return result


def same_prompt_but_id(a: Prompt, b: Prompt) -> list[str]:
    """The fields (other than prompt_id) in which two prompts differ."""
    diff = []
    for f in dataclasses.fields(Prompt):
        if f.name == "prompt_id":
            continue
        x, y = getattr(a, f.name), getattr(b, f.name)
        equal = np.array_equal(x, y) if isinstance(x, np.ndarray) or isinstance(y, np.ndarray) else x == y
        if not equal:
            diff.append(f.name)
    return diff


def test_submit_keeps_accepted_prompts_whole_and_reports_rejections() -> None:
    led = make()
    a, b, c = prompt("a"), prompt("b"), prompt("c")
    led.pending["c"] = c  # submitted before: a retried submit the broker already had
    result = accept(led, a, b, c, rejected=(Rejection("b", "queue_full"), Rejection("c", "duplicate")))
    assert result.accepted == ["a", "c"] and result.rejected == {"b": "queue_full"}
    assert led.pending["a"] is a  # the very object, not a copy
    assert "b" not in led.pending
    assert (led.counters["submitted"], led.counters["rejected"]) == (2, 1)


def test_a_done_group_is_delivered_once_then_acknowledged_with_the_next_pull() -> None:
    led = make()
    accept(led, prompt("p"))
    out = led.take([done("p")], max_staleness=None)
    assert out.regenerate == [] and out.dropped_stale == [] and led.ready == 1
    assert led.pull_acks() == ()  # not acknowledged before it was returned
    batch, lags = led.deliver(1, started_at=0.0, now=1.0, dropped_before=0)
    assert [g.prompt_id for g in batch.groups] == ["p"] and len(batch.trajectories) == 2 and lags == [0, 0]
    assert led.pending == {} and led.ready == 0
    assert led.pull_acks() == ("p",)
    led.acks_sent(("p",))
    assert led.pull_acks() == ()
    # the broker redelivers it (e.g. our ack was lost): dropped, counted and acknowledged again, never returned twice
    led.take([done("p")], max_staleness=None)
    assert led.ready == 0 and led.counters["duplicates_dropped"] == 1 and led.pull_acks() == ("p",)
    assert (led.counters["groups_delivered"], led.counters["trajectories_delivered"]) == (1, 2)


def test_trajectories_already_seen_are_dropped_from_a_group() -> None:
    led = make()
    led.take([done("p", n=3)], None)
    led.deliver(1, started_at=0.0, now=0.0, dropped_before=0)
    # a second group (another prompt id) carries one trajectory id we delivered and one new one
    mixed = GroupResult(prompt_id="q", state=GroupState.DONE, trajectories=(trajs("p", 1)[0], trajs("q", 1)[0]))
    led.take([mixed], None)
    batch, _ = led.deliver(1, started_at=0.0, now=0.0, dropped_before=0)
    assert [t.trajectory_id for t in batch.trajectories] == ["q:0"]
    assert led.counters["duplicates_dropped"] == 1


def test_a_group_with_nothing_new_is_not_returned_but_released() -> None:
    led = make()
    led.take([done("p", n=2)], None)
    led.deliver(1, started_at=0.0, now=0.0, dropped_before=0)
    led.acks_sent(led.pull_acks())
    ghost = GroupResult(prompt_id="ghost", state=GroupState.DONE, trajectories=trajs("p", 2))
    led.take([ghost], None)
    assert led.ready == 0 and led.pull_acks() == ("ghost",)


@pytest.mark.parametrize("state,counter", [(GroupState.FAILED, "failed"), (GroupState.CANCELLED, "cancelled"),
                                           (GroupState.DROPPED_STALE, "dropped_stale")])
def test_other_terminal_states_are_handed_out_once_beside_the_next_batch(state: str, counter: str) -> None:
    led = make()
    accept(led, prompt("bad"), prompt("ok"))
    led.take([GroupResult(prompt_id="bad", state=state, reason="why"), done("ok")], None)
    assert led.counters[counter] == 1 and "bad" not in led.pending
    batch, _ = led.deliver(1, started_at=0.0, now=0.0, dropped_before=0)
    assert [g.prompt_id for g in batch.other] == ["bad"] and batch.other[0].reason == "why"
    assert set(led.pull_acks()) == {"ok", "bad"}
    led.take([GroupResult(prompt_id="bad", state=state)], None)  # redelivered
    led.take([done("ok2")], None)
    batch, _ = led.deliver(1, started_at=0.0, now=0.0, dropped_before=0)
    assert batch.other == []
    assert led.counters[counter] == 1 and led.counters["duplicates_dropped"] == 1


def test_stale_groups_are_dropped_counted_and_acknowledged_as_stale() -> None:
    led = make()
    accept(led, prompt("old"), prompt("new"))
    led.observe_version(5)
    out = led.take([done("old", version=1), done("new", version=4)], max_staleness=2)
    assert out.dropped_stale == [("old", 4)] and out.regenerate == []  # regenerate_stale is off
    assert led.counters["dropped_stale"] == 1 and led.ready == 1
    assert led.pending == {}  # both groups are terminal here
    assert led.stale_acks() == ("old",) and led.pull_acks() == ()
    led.acks_sent(stale=("old",))
    assert led.stale_acks() == ()
    batch, _ = led.deliver(1, started_at=0.0, now=0.0, dropped_before=0)
    assert [g.prompt_id for g in batch.groups] == ["new"] and batch.stats["rollout/dropped_stale"] == 1.0
    # without a bound nothing is judged stale
    led.take([done("ancient", version=0)], max_staleness=None)
    assert led.ready == 1


def test_regenerate_stale_resubmits_the_original_prompt_whole_under_a_fresh_id() -> None:
    """The F3 bug: the resubmission was rebuilt from the first trajectory (default sampling, no priority,
    no text or chat-template flag, no evaluation flag, the worker's metadata leaking in)."""
    led = make(regenerate_stale=True)
    sampling = SamplingParams(max_new_tokens=7, temperature=0.3, top_p=0.9, top_k=5, stop=("\n",), seed=11)
    by_ids = prompt("ids", n=2, sampling=sampling, priority=3, metadata={"answer": "42"}, exempt_from_staleness=True)
    by_text = Prompt(prompt_id="text", text="2+2?", apply_chat_template=True, group_size=2, sampling=sampling,
                     metadata={"answer": "4"})
    accept(led, by_ids, by_text)
    led.observe_version(3)
    worker_meta = {"answer": "42", "simulated": True, "reward_error": "x"}  # what a worker echoes, plus its own keys
    out = led.take([done("ids", version=0, metadata=worker_meta, input_ids=np.array([9, 9], np.int32)),
                    done("text", version=0, metadata=worker_meta, input_ids=np.array([5, 6, 7], np.int32))], max_staleness=1)
    assert [p.prompt_id for p in out.regenerate] == ["fresh-0", "fresh-1"]
    for original, again in zip((by_ids, by_text), out.regenerate, strict=True):
        assert same_prompt_but_id(original, again) == []
    assert out.regenerate[1].input_ids is None and out.regenerate[1].text == "2+2?"
    assert out.regenerate[0].metadata == {"answer": "42"}
    assert led.counters["dropped_stale"] == 2 and led.stale_acks() == ("ids", "text")
    # the regenerated prompts are submitted by the caller; once accepted they are pending like any other
    result = accept(led, *out.regenerate)
    led.regenerated(result)
    assert led.counters["regenerated_stale"] == 2 and list(led.pending) == ["fresh-0", "fresh-1"]


def test_regenerate_stale_without_the_original_prompt_drops_and_says_so() -> None:
    led = make(regenerate_stale=True)
    led.observe_version(3)
    out = led.take([done("from-an-earlier-process", version=0)], max_staleness=0)  # redelivered after a client restart
    assert out.regenerate == [] and out.not_regenerated == ["from-an-earlier-process"]
    assert led.counters["regenerate_skipped"] == 1 and led.counters["dropped_stale"] == 1
    assert led.stale_acks() == ("from-an-earlier-process",)


def test_to_resubmit_is_every_prompt_not_yet_terminal_exactly_as_submitted() -> None:
    led = make()
    ps = [prompt(f"p{i}", sampling=SamplingParams(max_new_tokens=i + 1)) for i in range(4)]
    accept(led, *ps)
    led.take([done("p1"), GroupResult(prompt_id="p2", state=GroupState.FAILED)], None)
    again = led.to_resubmit()
    assert [p.prompt_id for p in again] == ["p0", "p3"] and again[0] is ps[0] and again[1] is ps[3]
    led.resubmitted(SubmitReply(request_id="r", epoch="e2", accepted=("p0", "p3")))
    assert led.counters["resubmitted"] == 2


def test_versions_only_move_forward_and_staleness_counts_from_the_newest() -> None:
    led = make()
    led.observe_version(4)
    led.observe_version(2)
    assert led.version == 4
    led.take([done("p", version=1)], max_staleness=3)
    batch, lags = led.deliver(1, started_at=0.0, now=0.0, dropped_before=0)
    assert lags == [3, 3] and batch.stats["rollout/staleness_max"] == 3.0 and batch.stats["rollout/version"] == 4.0


def test_batch_stats_use_the_times_passed_in() -> None:
    led = make()
    accept(led, prompt("a"), prompt("b"), prompt("c"))
    led.take([done("a", out=5), done("b", out=5)], None)
    first, _ = led.deliver(1, started_at=10.0, now=12.0, dropped_before=0)
    assert first.stats["rollout/wait_s"] == 2.0
    assert first.stats["rollout/tokens"] == 10.0 and first.stats["rollout/tokens_per_s"] == 5.0  # over now - started_at
    assert first.stats["rollout/reward_mean"] == 0.5 and first.stats["rollout/pending_prompts"] == 1.0
    second, _ = led.deliver(1, started_at=14.0, now=14.5, dropped_before=0)
    assert second.stats["rollout/tokens_per_s"] == 10.0 / 2.5  # over the interval since the last batch
    with pytest.raises(ValueError, match="only 0 groups ready"):
        led.deliver(1, started_at=0.0, now=0.0, dropped_before=0)


def test_acks_added_while_a_pull_was_out_are_kept() -> None:
    led = make()
    for pid in ("a", "b"):
        led.take([done(pid)], None)
    led.deliver(2, started_at=0.0, now=0.0, dropped_before=0)
    carried = led.pull_acks()
    led.take([done("c")], None)
    led.deliver(1, started_at=0.0, now=0.0, dropped_before=0)  # e.g. a concurrent get_batch
    led.acks_sent(carried)
    assert led.pull_acks() == ("c",)
    led.acks_sent(carried)  # sent twice: nothing else is forgotten
    assert led.pull_acks() == ("c",)


def test_final_ack_carries_everything_owed() -> None:
    led = make()
    assert led.final_ack() is None
    led.observe_version(9)
    led.take([done("ok", version=9), done("stale", version=0)], max_staleness=1)
    led.deliver(1, started_at=0.0, now=0.0, dropped_before=0)
    ack = led.final_ack()
    assert ack is not None and ack.prompt_ids == ("ok", "stale") and ack.dropped_stale == ("stale",)
    led.acks_sent(ack.prompt_ids, ack.dropped_stale)
    assert led.final_ack() is None


def test_dedup_window_is_bounded_and_forgets_the_oldest() -> None:
    d = Dedup(2)
    assert d.add("a") and d.add("b") and not d.add("a")
    assert d.add("c") and len(d) == 2
    assert "a" not in d and "b" in d and "c" in d
    with pytest.raises(ValueError, match="capacity"):
        Dedup(0)
    led = make(dedup_window=1)
    led.take([done("p", n=1), done("q", n=1)], None)
    led.deliver(2, started_at=0.0, now=0.0, dropped_before=0)
    led.take([done("p", n=1)], None)  # forgotten: outside the window, it is taken again
    assert led.ready == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.sampled_from(["done", "failed", "stale"])), min_size=1, max_size=40))
def test_any_redelivery_order_delivers_each_group_and_trajectory_once_and_acks_each(events: list[tuple[int, str]]) -> None:
    led = make(regenerate_stale=True)
    led.observe_version(5)
    accept(led, *(prompt(f"p{i}") for i in range(8)))
    delivered: list[str] = []
    acked: set[str] = set()

    def hand_out() -> None:
        batch, _ = led.deliver(led.ready, started_at=0.0, now=0.0, dropped_before=0)
        delivered.extend(t.trajectory_id for t in batch.trajectories)
        acks, stale = led.pull_acks(), led.stale_acks()
        acked.update(acks, stale)
        led.acks_sent(acks, stale)

    for i, kind in events:
        pid = f"p{i}"
        g = {"done": done(pid, version=5), "failed": GroupResult(prompt_id=pid, state=GroupState.FAILED),
             "stale": done(pid, version=0)}[kind]
        out = led.take([g], max_staleness=2)
        for p in out.regenerate:
            assert same_prompt_but_id(p, prompt(pid)) == []
        if led.ready:
            hand_out()
    hand_out()  # what is left (other terminal states go out beside a batch)
    seen = {f"p{i}" for i, _ in events}
    assert len(delivered) == len(set(delivered))  # each trajectory at most once
    assert acked == seen  # each group acknowledged, plain or as stale
    assert not seen & set(led.pending)  # each group seen is terminal here
    groups_returned = {d.split(":")[0] for d in delivered}
    assert led.counters["dropped_stale"] + led.counters["failed"] + len(groups_returned) == len(seen)
    assert led.counters["regenerated_stale"] == 0 and len(led.pending) == 8 - len(seen)


def test_the_ledger_is_pure() -> None:
    tree = ast.parse(pathlib.Path(ledger_module.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"asyncio", "zmq", "time", "socket", "threading", "os", "uuid", "random", "logging"}, imported
    assert {"rollpool", "numpy"} >= imported - {"__future__", "collections", "dataclasses"}, imported


# ---------------------------------------------------------------------- stale_policy


def test_keep_delivers_stale_groups_up_to_max_staleness_keep_with_their_staleness_stated() -> None:
    led = make()
    accept(led, *(prompt(p) for p in ("fresh", "kept", "too-old")))
    led.observe_version(6)
    out = led.take([done("fresh", version=6), done("kept", version=2), done("too-old", version=1)], max_staleness=2,
                   stale_policy="keep")  # max_staleness_keep defaults to 2 x max_staleness = 4
    assert out.dropped_stale == [("too-old", 5)] and out.regenerate == []
    batch, lags = led.deliver(2, started_at=0.0, now=0.0, dropped_before=0)
    assert [g.prompt_id for g in batch.groups] == ["fresh", "kept"] and lags == [0, 0, 4, 4]
    assert batch.kept_stale == 2 and led.counters["kept_stale"] == 2 and led.counters["dropped_stale"] == 1
    assert [(r.prompt_id, r.state, r.staleness) for r in batch.reports] == [
        ("fresh", GroupState.DONE, 0), ("kept", GroupState.DONE, 4), ("too-old", GroupState.DROPPED_STALE, 5)]
    assert "staleness 5 > 4" in batch.reports[2].reason
    # kept groups were trained on: acknowledged plainly; the one above the keep limit is released as stale
    assert led.pull_acks() == ("fresh", "kept") and led.stale_acks() == ("too-old",)
    led.take([done("k2", version=0)], max_staleness=2, stale_policy="keep", max_staleness_keep=6)  # explicit limit
    assert led.ready == 1


def test_regenerate_reports_the_old_prompt_once_as_dropped_stale_naming_its_successor_and_acks_it_once() -> None:
    led = make(stale_policy="regenerate")
    accept(led, prompt("old"), prompt("ok"))
    led.observe_version(4)
    out = led.take([done("old", version=0), done("ok", version=4)], max_staleness=1)
    assert [p.prompt_id for p in out.regenerate] == ["fresh-0"]
    led.acks_sent(stale=led.stale_acks())  # get_batch sends the stale ack before the next pull
    batch, _ = led.deliver(1, started_at=0.0, now=0.0, dropped_before=0)
    assert [(g.prompt_id, g.state, g.metadata["regenerated_as"]) for g in batch.other] == [("old", GroupState.DROPPED_STALE, "fresh-0")]
    assert [(r.prompt_id, r.regenerated_as) for r in batch.reports] == [("ok", None), ("old", "fresh-0")]
    # acknowledged once, as dropped_stale, never again as a plain ack (that would count it twice at the broker)
    assert led.pull_acks() == ("ok",) and led.stale_acks() == ()
    led.acks_sent(led.pull_acks())
    assert led.final_ack() is None


def test_the_policy_can_be_chosen_per_take_and_bad_ones_are_refused() -> None:
    led = make(stale_policy="keep", max_staleness_keep=10)
    accept(led, prompt("a"), prompt("b"))
    led.observe_version(5)
    out = led.take([done("a", version=0)], max_staleness=1, stale_policy="drop")
    assert out.dropped_stale == [("a", 5)]
    led.take([done("b", version=0)], max_staleness=1)  # the ledger's own: keep up to 10
    assert led.ready == 1
    with pytest.raises(ValueError, match="stale_policy must be one of"):
        led.take([], max_staleness=1, stale_policy="ignore")
    with pytest.raises(ValueError, match="max_staleness_keep must be >= 0"):
        make(stale_policy="keep", max_staleness_keep=-1)
    assert make(regenerate_stale=True).stale_policy == "regenerate"  # the deprecated spelling


def test_the_client_config_checks_the_policy_and_warns_on_the_deprecated_alias() -> None:
    from rollpool.protocol import ConfigError
    from rollpool.trainer_client import TrainerClientConfig

    with pytest.raises(ConfigError, match="stale_policy"):
        TrainerClientConfig(stale_policy="sometimes")
    with pytest.raises(ConfigError, match="max_staleness_keep"):
        TrainerClientConfig(max_staleness_keep=-2)
    with pytest.raises(ConfigError, match="contradicts"):
        TrainerClientConfig(regenerate_stale=True, stale_policy="keep")
    with pytest.warns(DeprecationWarning, match="stale_policy='regenerate'"):
        cfg = TrainerClientConfig(regenerate_stale=True)
    assert cfg.stale_policy == "regenerate"


def test_samples_expose_what_decoupled_ppo_needs_and_staleness_counts_sampled_tokens_only() -> None:
    led = make()
    led.observe_version(7)
    t = Trajectory(prompt_id="e", sample_index=0, input_ids=np.zeros(2, np.int32), output_ids=np.arange(4, dtype=np.int32),
                   output_logprobs=np.array([-0.1, 0.0, -0.3, -0.4], np.float32),
                   token_versions=np.array([6, 3, 6, 7], np.int32),  # the version-3 token was inserted (tool output)
                   loss_mask=np.array([1, 0, 1, 1], np.uint8), finish_reason="stop")
    led.take([GroupResult(prompt_id="e", state=GroupState.DONE, trajectories=(t,))], max_staleness=1)
    batch, lags = led.deliver(1, started_at=0.0, now=0.0, dropped_before=0)
    assert lags == [1]  # not 4: inserted tokens do not count
    (s,) = batch.samples()
    assert s.staleness == 1 and s.version == 7 and batch.staleness == {"e:0": 1}
    assert s.token_staleness.tolist() == [1, 4, 1, 0] and s.token_versions.tolist() == [6, 3, 6, 7]
    assert s.behaviour_logprobs is t.output_logprobs and s.loss_mask.tolist() == [1, 0, 1, 1]


def test_wasted_tokens_are_counted_per_reason() -> None:
    led = make()
    led.observe_version(3)
    led.take([done("ok", version=3, out=5), done("stale", version=0, out=7)], max_staleness=1)
    led.deliver(1, started_at=0.0, now=0.0, dropped_before=0)
    mixed = GroupResult(prompt_id="q", state=GroupState.DONE, trajectories=(trajs("ok", 1, 3, out=5)[0], trajs("q", 1, 3, out=3)[0]))
    led.take([mixed], max_staleness=1)  # one trajectory already delivered
    led.deliver(1, started_at=0.0, now=0.0, dropped_before=0)
    c = led.counters
    assert (c["tokens_delivered"], c["wasted_tokens_stale"], c["wasted_tokens_duplicate"]) == (13, 14, 5)
    assert led.wasted_token_shares() == pytest.approx({"stale_drop": 14 / 32, "duplicate": 5 / 32})


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["drop", "regenerate", "keep"]),
       st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["done", "failed", "stale", "very_stale"])), min_size=1, max_size=30))
def test_every_prompt_taken_is_reported_exactly_once_under_every_policy(policy: str, events: list[tuple[int, str]]) -> None:
    led = make(stale_policy=policy)
    led.observe_version(6)
    accept(led, *(prompt(f"p{i}") for i in range(6)))
    reports: list[str] = []
    plain: list[str] = []
    stale: list[str] = []

    def hand_out() -> None:
        stale.extend(led.stale_acks())
        led.acks_sent(stale=led.stale_acks())
        batch, _ = led.deliver(led.ready, started_at=0.0, now=0.0, dropped_before=0)
        reports.extend(r.prompt_id for r in batch.reports)
        plain.extend(led.pull_acks())
        led.acks_sent(led.pull_acks())

    for i, kind in events:
        pid = f"p{i}"
        g = {"done": done(pid, version=6), "failed": GroupResult(prompt_id=pid, state=GroupState.FAILED),
             "stale": done(pid, version=3), "very_stale": done(pid, version=0)}[kind]
        led.take([g], max_staleness=1, max_staleness_keep=3)
        if led.ready:
            hand_out()
    hand_out()
    seen = {f"p{i}" for i, _ in events}
    assert sorted(reports) == sorted(seen)  # each prompt told of exactly once
    # each acknowledged (a redelivery is acknowledged again), and never both plainly and as stale
    assert set(plain) | set(stale) == seen and not set(plain) & set(stale)


def test_a_stale_dropped_group_redelivered_is_acknowledged_as_stale_again() -> None:
    """Bug (before the stale_policy rules): the redelivery of a group dropped as stale (its dropped_stale ack lost) was
    acknowledged plainly, so the broker kept counting its samples as accepted and its capacity was never freed."""
    led = make()
    led.observe_version(5)
    led.take([done("old", version=0)], max_staleness=1)
    led.acks_sent(stale=led.stale_acks())  # sent, and lost on the way
    led.take([done("old", version=0)], max_staleness=1)  # the broker redelivers it
    assert led.counters["duplicates_dropped"] == 1 and led.ready == 0
    assert led.stale_acks() == ("old",) and led.pull_acks() == ()


def test_segments_of_one_sample_are_distinct_trajectories_and_a_redelivery_drops_each_once() -> None:
    led = make()
    accept(led, prompt("p", 2))
    base = trajs("p", 2)
    seg = dataclasses.replace(base[1], segment_index=1)
    g = GroupResult(prompt_id="p", state=GroupState.DONE, trajectories=(*base, seg))
    led.take([g], None)
    batch, _ = led.deliver(1, started_at=0.0, now=0.0, dropped_before=0)
    assert [t.trajectory_id for t in batch.trajectories] == ["p:0", "p:1", "p:1:1"]
    # the same three inside another group (a re-run delivered twice): every one dropped, none returned again
    again = GroupResult(prompt_id="q", state=GroupState.DONE, trajectories=(*base, seg))
    led.take([again], None)
    assert led.ready == 0 and led.counters["duplicates_dropped"] == 3


def test_recheck_drops_ready_groups_the_version_has_moved_past_and_regenerates_them_whole() -> None:
    # the hard staleness bound was skipped for a group taken by a timed-out get_batch; now it is judged again before
    # it is returned
    led = make(stale_policy="regenerate")
    p = prompt("a", priority=3)
    accept(led, p, prompt("b"))
    led.take([done("a", version=0), done("b", version=4)], max_staleness=1)
    assert led.ready == 2
    led.observe_version(5)
    out = led.recheck(max_staleness=1)
    assert led.ready == 1 and [pid for pid, _ in out.dropped_stale] == ["a"]
    assert [same_prompt_but_id(p, again) for again in out.regenerate] == [[]]
    assert led.stale_acks() == ("a",)
    batch, _ = led.deliver(1, started_at=0.0, now=1.0, dropped_before=0)
    assert [g.prompt_id for g in batch.groups] == ["b"]
    assert [(r.prompt_id, r.state) for r in batch.reports] == [("b", GroupState.DONE), ("a", GroupState.DROPPED_STALE)]
    assert led.recheck(max_staleness=1).dropped_stale == []  # nothing judged twice
    assert led.pull_acks() == ("b",)


def test_a_trajectory_with_fewer_token_versions_than_tokens_fails_any_bound() -> None:
    led = make(stale_policy="keep")
    accept(led, prompt("a"), prompt("b"))
    short = tuple(dataclasses.replace(t, token_versions=np.zeros(0, np.int32)) for t in trajs("a", 2))
    out = led.take([GroupResult(prompt_id="a", state=GroupState.DONE, trajectories=short)], max_staleness=1)
    assert led.ready == 0 and [pid for pid, _ in out.dropped_stale] == ["a"]
    led.take([GroupResult(prompt_id="b", state=GroupState.DONE, trajectories=tuple(
        dataclasses.replace(t, prompt_id="b", token_versions=np.zeros(0, np.int32)) for t in trajs("b", 1)))],
        max_staleness=None)
    assert led.ready == 1  # without a bound there is nothing to check
    assert led.recheck(max_staleness=1).dropped_stale[0][0] == "b"
    assert led.stale_acks() == ("a", "b")


def test_a_batch_for_an_abandoned_pull_is_kept_and_a_resend_of_a_held_group_is_acked_once() -> None:
    # before this, a Batch reaching no waiting request was discarded
    led = make()
    accept(led, prompt("a"))
    led.adopt([done("a", version=0)])
    assert led.ready == 1 and led.pull_acks() == () and led.counters["batches_adopted"] == 1
    led.take([done("a", version=0)], max_staleness=None)  # the broker sends it again: still held here
    assert led.ready == 1 and led.pull_acks() == () and led.counters["resent_held"] == 1
    batch, _ = led.deliver(1, started_at=0.0, now=1.0, dropped_before=0)
    assert [g.prompt_id for g in batch.groups] == ["a"] and led.pull_acks() == ("a",)
    led.take([done("a", version=0)], max_staleness=None)  # after it was returned: a duplicate, acked again
    assert led.ready == 0 and led.counters["duplicates_dropped"] == 1


def test_the_bound_told_to_the_broker_is_the_policy_s() -> None:
    led = make()
    assert led.stale_bound(None) == -1  # no hard bound: nothing is doomed
    assert led.stale_bound(2) == 2 and led.stale_bound(2, "regenerate") == 2
    assert led.stale_bound(2, "keep") == 4 and led.stale_bound(2, "keep", 3) == 3
    assert make(stale_policy="keep", max_staleness_keep=5).stale_bound(1) == 5


def test_a_resent_submit_takes_the_duplicates_of_its_own_lost_send_as_accepted() -> None:
    # seen in the issue-20 chaos run: a Submit's reply was lost, the client sent the chunk again and the
    # broker answered "duplicate" for the prompts the first send had delivered; the client reported its
    # own prompts rejected and never waited for their groups
    led = make()
    a, b = prompt("a"), prompt("b")
    result = SubmitResult(accepted=[], rejected={})
    reply = SubmitReply(request_id="r2", epoch="e", accepted=("b",), rejected=(Rejection(prompt_id="a", reason="duplicate"),))
    led.submitted((a, b), reply, result, resent=True)
    assert sorted(result.accepted) == ["a", "b"] and result.rejected == {}
    assert set(led.pending) == {"a", "b"} and led.counters["submit_resent_duplicates"] == 1
    # a first send's duplicate is the caller's own mistake: still rejected
    result = SubmitResult(accepted=[], rejected={})
    led.submitted((prompt("c"),), SubmitReply(request_id="r3", epoch="e", accepted=(),
                                             rejected=(Rejection(prompt_id="c", reason="duplicate"),)), result)
    assert result.rejected == {"c": "duplicate"} and "c" not in led.pending


def _epoch(g: GroupResult, epoch: int) -> GroupResult:
    return dataclasses.replace(g, trajectories=tuple(dataclasses.replace(t, version_epoch=epoch) for t in g.trajectories))


def test_after_a_rebase_groups_made_on_the_abandoned_run_are_never_delivered_as_fresh() -> None:
    """Rebased from version 5 to 2 (epoch 0 -> 7): what epoch 0 made above version 2 was made by weights the new
    run never had; at or below 2 the weights are the same in both runs. An epoch the trajectory does not state
    (-1, an older worker) is judged by staleness alone."""
    led = make()
    accept(led, *(prompt(p) for p in ("abandoned", "shared", "new-run", "unstated")))
    led.observe_version(5)
    led.rebased(7, 2)
    assert led.version == 2
    out = led.take([_epoch(done("abandoned", version=5), 0), _epoch(done("shared", version=2), 0),
                    _epoch(done("new-run", version=3), 7), done("unstated", version=5)], max_staleness=None)
    assert out.regenerate == [] and led.ready == 3
    assert led.counters["dropped_abandoned"] == 1 and led.stale_acks() == ("abandoned",)  # frees its capacity at the broker
    batch, _ = led.deliver(3, started_at=0.0, now=0.0, dropped_before=0)
    assert [g.prompt_id for g in batch.groups] == ["shared", "new-run", "unstated"]
    (other,) = batch.other
    assert other.state == GroupState.DROPPED_STALE and other.trajectories == ()
    assert other.reason.startswith("abandoned_run: made on version 5 of version epoch 0") and other.metadata["abandoned_run"]
    assert [(r.prompt_id, r.state) for r in batch.reports][-1] == ("abandoned", GroupState.DROPPED_STALE)


def test_abandoned_groups_can_be_regenerated_and_a_ready_group_is_judged_again_after_the_rebase() -> None:
    led = make(abandoned_policy="regenerate")
    original = prompt("held", sampling=SamplingParams(max_new_tokens=9, seed=4))
    accept(led, original)
    led.observe_version(5)
    led.take([_epoch(done("held", version=5), 0)], max_staleness=None)  # taken before the rebase, not yet returned
    assert led.ready == 1
    led.rebased(1, 2)
    out = led.recheck(None)
    assert led.ready == 0 and [p.prompt_id for p in out.regenerate] == ["fresh-0"]
    assert same_prompt_but_id(original, out.regenerate[0]) == []
    with pytest.raises(ValueError, match="abandoned_policy"):
        make(abandoned_policy="keep")
