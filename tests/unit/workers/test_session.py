"""The worker's session, driven with an injected clock: no sockets, no sleeping, no engine."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpool.protocol.messages import (
    ApplyGrant,
    BrokerHeartbeat,
    Cancel,
    Control,
    Credit,
    Error,
    Feature,
    Goodbye,
    Hello,
    Nack,
    Prompt,
    Result,
    Task,
    Trajectory,
    Welcome,
    WorkerHeartbeat,
    held_digest,
)
from rollpool.workers.session import Effects, EngineFacts, Outgoing, SessionConfig, WorkerSession, WorkerState

FACTS = EngineFacts(name="sim", capacity=4, apply_modes=("interrupt",), fingerprint="fp", weight_version=0, info={"name": "sim"})


def make(capacity_limit: int = 0, **kw: object) -> WorkerSession:
    options: dict[str, object] = {"heartbeat_interval_s": 1.0, "missed_heartbeats": 3, "reconnect_backoff_s": 1.0, "reconnect_backoff_max_s": 8.0}
    options.update(kw)
    return WorkerSession(SessionConfig(worker_id="w1", capacity_limit=capacity_limit, host="h", pid=7, **options))  # type: ignore[arg-type]


def task(i: int, n: int = 2, attempt: int = 0) -> Task:
    prompt = Prompt(prompt_id=f"p{i}", input_ids=np.arange(3, dtype=np.int32), group_size=n)
    return Task(task_id=f"p{i}@{attempt}", prompt=prompt, attempt=attempt)


def trajs(i: int, n: int = 2, tokens: int = 3, attempt: int = 0) -> list[Trajectory]:
    z = np.zeros(tokens, dtype=np.int32)
    return [
        Trajectory(prompt_id=f"p{i}", sample_index=k, input_ids=z, output_ids=z, output_logprobs=np.zeros(tokens, np.float32),
                   token_versions=z, loss_mask=np.ones(tokens, np.uint8), finish_reason="stop", attempt=attempt)
        for k in range(n)
    ]


def welcome(epoch: str = "e1", **kw: object) -> Welcome:
    return Welcome(epoch=epoch, protocol=1, heartbeat_interval_s=1.0, **kw)  # type: ignore[arg-type]


def of(eff: Effects | None, kind: type[Outgoing]) -> list[Outgoing]:
    assert eff is not None
    return [m for m in eff.send if isinstance(m, kind)]


def started(now: float = 0.0, **kw: object) -> WorkerSession:
    """A session whose engine started and whose hello was welcomed at `now`."""
    s = make(**kw)  # type: ignore[arg-type]
    s.engine_started(now, FACTS)
    s.handle(now, welcome())
    return s


def run_to_result(s: WorkerSession, i: int, now: float = 0.0, n: int = 2) -> Effects:
    eff = s.handle(now, task(i, n))
    assert eff is not None and [t.task_id for t in eff.start] == [f"p{i}@0"]
    s.generation_finished(now, f"p{i}@0")
    return s.task_finished(now, f"p{i}@0", trajs(i, n))


# ---------------------------------------------------------------- hello and the epoch


def test_first_start_says_hello_with_capacity_credits_and_engine_facts() -> None:
    s = make(capacity_limit=3)
    assert s.state == WorkerState.STARTING and s.poll(0.0).send == []  # no engine, no hello
    eff = s.engine_started(5.0, FACTS)
    (hello,) = of(eff, Hello)
    assert isinstance(hello, Hello)
    assert (hello.worker_id, hello.capacity, hello.credits, hello.weight_version) == ("w1", 3, 3, 0)
    assert (hello.engine, hello.fingerprint, hello.apply_modes, hello.host, hello.pid) == ("sim", "fp", ("interrupt",), "h", 7)
    assert s.heartbeat(5.0) is None  # no heartbeats before a broker welcomed us


def test_hello_is_retried_with_a_doubling_backoff_until_a_welcome() -> None:
    s = make()
    s.engine_started(0.0, FACTS)
    sent_at = [0.0]
    for now in np.arange(0.25, 40.0, 0.25):
        if of(s.poll(float(now)), Hello):
            sent_at.append(float(now))
    assert sent_at == [0.0, 1.0, 3.0, 7.0, 15.0, 23.0, 31.0, 39.0]  # gaps 1, 2, 4, 8, then capped at 8
    assert s.hellos_sent == len(sent_at)
    s.handle(39.5, welcome())
    assert s.welcomed and s.state == WorkerState.READY and s.poll(39.5).send == []
    # a later need starts from the first backoff again
    eff = s.handle(40.0, Error(code="hello_required", message="say hello first"))
    assert of(eff, Hello) and s.next_poll_at == 41.0


def test_a_new_epoch_on_a_heartbeat_brings_one_hello_not_one_per_message() -> None:
    s = started()
    first = s.handle(1.0, BrokerHeartbeat(epoch="e2"))
    assert len(of(first, Hello)) == 1 and not s.welcomed
    assert of(s.handle(1.1, BrokerHeartbeat(epoch="e2")), Hello) == []  # one pending hello; its backoff goes on
    assert of(s.handle(1.2, Error(code="hello_required", message="")), Hello) == []
    assert of(s.handle(1.3, Goodbye(reason="restart")), Hello) == []
    s.handle(1.5, welcome("e2"))
    assert s.epoch == "e2" and s.welcomed


def test_a_silent_broker_brings_a_hello_after_missed_heartbeats() -> None:
    s = started(0.0)
    s.handle(10.0, BrokerHeartbeat(epoch="e1"))
    assert s.next_poll_at == 13.0
    assert s.poll(12.9).send == []
    assert of(s.poll(13.1), Hello) and not s.welcomed
    beat = s.heartbeat(13.2)  # heartbeats go on while the re-hello is pending, so the broker keeps us
    assert isinstance(beat, WorkerHeartbeat) and beat.epoch == "e1"


def test_welcome_and_heartbeats_name_the_weights() -> None:
    s = make()
    s.engine_started(0.0, FACTS)
    eff = s.handle(0.0, welcome(weight_version=3, weight_endpoint="tcp://pub:1", announce_endpoint="tcp://pub:2"))
    assert eff is not None and eff.weights == (3, "tcp://pub:1", "tcp://pub:2")
    eff = s.handle(1.0, BrokerHeartbeat(epoch="e1", weight_version=4, weight_endpoint="tcp://pub:1"))
    assert eff is not None and eff.weights == (4, "tcp://pub:1", None)


def test_messages_that_are_not_the_sessions_are_left_to_the_worker() -> None:
    s = started()
    assert s.handle(0.0, ApplyGrant(version=1)) is None
    assert s.handle(0.0, Control(request_id="r", op="sleep")) is None


# ---------------------------------------------------------------- credits


def test_credits_never_exceed_free_capacity_and_come_back_when_generation_ends() -> None:
    s = started()
    assert s.free_credits() == 4
    assert of(s.handle(0.0, task(1, n=3)), Nack) == []
    assert s.free_credits() == 1
    (nack,) = of(s.handle(0.0, task(2, n=2)), Nack)
    assert isinstance(nack, Nack) and nack.task_ids == ("p2@0",) and nack.reason == "over_credit"
    assert s.engine_seqs() == 3
    eff = s.generation_finished(1.0, "p1@0")
    assert of(eff, Credit) == [Credit(credits=3)] and s.free_credits() == 4  # scoring runs off the engine's credits
    assert s.inflight_task_ids() == ("p1@0",)  # still held until its result is decided
    (result,) = of(s.task_finished(2.0, "p1@0", trajs(1, 3)), Result)
    assert isinstance(result, Result) and result.task_id == "p1@0" and len(result.trajectories) == 3
    assert s.inflight_task_ids() == () and s.tokens_total == 9


def test_a_task_already_held_is_not_started_twice() -> None:
    s = started()
    s.handle(0.0, task(1))
    eff = s.handle(0.5, task(1))
    assert eff is not None and not eff and s.engine_seqs() == 2


def test_no_credit_before_the_first_welcome() -> None:
    s = make()
    s.engine_started(0.0, FACTS)
    s.on_task(0.0, task(1))  # a task can only come from a broker, but the ledger does not rely on it
    assert of(s.generation_finished(0.0, "p1@0"), Credit) == []


def test_a_refused_request_is_one_non_retryable_result_and_its_credits_come_back() -> None:
    s = started()
    s.handle(0.0, task(1))
    eff = s.task_refused(0.0, "p1@0", "top_p must be in (0, 1]")
    assert of(eff, Credit) == [Credit(credits=2)]
    (result,) = of(eff, Result)
    assert isinstance(result, Result) and result.retryable is False and result.error == "invalid: top_p must be in (0, 1]"
    assert s.tasks == {}
    assert not s.task_refused(0.0, "p1@0", "again")  # once


# ---------------------------------------------------------------- engine restart


def test_engine_failure_hands_back_generating_tasks_at_once_and_keeps_scoring_ones() -> None:
    s = started()
    s.handle(0.0, task(1, n=1))
    s.handle(0.0, task(2, n=2))
    s.handle(0.0, task(3, n=1))
    s.generation_finished(0.5, "p3@0")  # scoring
    eff = s.engine_failed(1.0, "EngineError: boom")
    (nack,) = of(eff, Nack)
    assert isinstance(nack, Nack) and nack.task_ids == ("p1@0", "p2@0") and nack.reason == "engine_failed: EngineError: boom"
    assert sorted(eff.stop_runners) == ["p1@0", "p2@0"]
    assert s.state == WorkerState.RESTARTING and s.free_credits() == 0
    assert not s.engine_failed(1.1, "again")  # one failure, one hand-back
    # while restarting: new tasks are handed back, no hello goes out, heartbeats say so
    (nack,) = of(s.handle(1.2, task(4)), Nack)
    assert isinstance(nack, Nack) and nack.reason == "engine_restarting"
    beat = s.heartbeat(1.3)
    assert beat is not None and beat.state == "restarting" and beat.inflight_task_ids == ("p3@0",)
    # the scoring task still yields its result
    assert of(s.task_finished(1.4, "p3@0", trajs(3, 1)), Result)
    # restarted: a hello at once, full credits, nothing left in flight
    (hello,) = of(s.engine_started(2.0, FACTS), Hello)
    assert isinstance(hello, Hello) and hello.credits == 4 and hello.inflight == ()
    assert s.state == WorkerState.READY


def test_the_hello_after_a_restart_announces_what_is_still_held() -> None:
    s = started()
    s.handle(0.0, task(1, n=2))
    s.generation_finished(0.1, "p1@0")
    s.engine_failed(0.2, "boom")
    assert of(s.handle(0.25, BrokerHeartbeat(epoch="e2")), Hello) == []  # no hello for an engine being replaced
    assert s.poll(5.0).send == []
    (hello,) = of(s.engine_started(0.3, FACTS), Hello)
    assert isinstance(hello, Hello)
    assert [(t.task_id, t.group_size) for t in hello.inflight] == [("p1@0", 2)] and hello.credits == 4
    s.handle(0.4, welcome("e2", adopted=("p1@0",)))
    assert of(s.task_finished(0.5, "p1@0", trajs(1)), Result)


# ---------------------------------------------------------------- outbox and re-hello


def test_results_wait_in_the_outbox_are_announced_on_the_hello_and_go_out_after_the_welcome() -> None:
    s = started()
    s.handle(0.0, task(1))
    s.handle(1.0, BrokerHeartbeat(epoch="e2"))  # broker restarted: a hello is pending
    s.generation_finished(1.1, "p1@0")
    assert s.task_finished(1.2, "p1@0", trajs(1)).send == []  # not welcomed: it waits
    assert [r.task_id for r in s.outbox] == ["p1@0"]
    (hello,) = of(s.poll(2.0), Hello)  # the retry
    assert isinstance(hello, Hello) and [(t.task_id, t.group_size) for t in hello.inflight] == [("p1@0", 2)]
    eff = s.handle(2.1, welcome("e2", adopted=("p1@0",)))
    assert [m.task_id for m in of(eff, Result)] == ["p1@0"] and not s.outbox  # type: ignore[union-attr]


def test_a_welcome_that_refuses_a_task_aborts_it_and_drops_its_result() -> None:
    s = started()
    s.handle(0.0, task(1))
    s.handle(0.0, task(2))
    s.handle(1.0, BrokerHeartbeat(epoch="e2"))
    s.generation_finished(1.1, "p2@0")
    s.task_finished(1.2, "p2@0", trajs(2))
    eff = s.handle(2.0, welcome("e2", refused=("p1@0", "p2@0")))
    assert eff is not None and eff.abort == ["p1@0"] and of(eff, Result) == []
    assert s.tasks == {} and not s.outbox
    assert of(s.generation_finished(2.1, "p1@0"), Credit) == []  # the aborted generation ends quietly


def test_a_result_the_link_could_not_send_goes_back_to_the_outbox_and_a_hello_follows() -> None:
    s = started()
    (result,) = of(run_to_result(s, 1, 0.0), Result)
    assert isinstance(result, Result)
    s.unsent(1.0, [result])
    assert list(s.outbox) == [result] and not s.welcomed
    assert s.poll(1.5).send == []
    (hello,) = of(s.poll(2.0), Hello)
    assert isinstance(hello, Hello) and [t.task_id for t in hello.inflight] == ["p1@0"]
    assert of(s.handle(2.1, welcome()), Result) == [result]


# ---------------------------------------------------------------- cancel


def test_a_cancelled_generating_task_is_aborted_gives_its_credits_back_and_no_result() -> None:
    s = started()
    s.handle(0.0, task(1))
    eff = s.handle(0.1, Cancel(task_ids=("p1@0",)))
    assert eff is not None and eff.abort == ["p1@0"] and eff.send == []
    assert not s.wants_result("p1@0")
    assert of(s.generation_finished(0.2, "p1@0"), Credit) == [Credit(credits=2)]
    assert s.tasks == {} and s.task_finished(0.3, "p1@0", trajs(1)).send == []


def test_a_cancelled_scoring_task_stops_its_runner_and_an_outbox_result_is_dropped() -> None:
    s = started()
    s.handle(0.0, task(1))
    s.generation_finished(0.1, "p1@0")
    eff = s.handle(0.2, Cancel(task_ids=("p1@0",)))
    assert eff is not None and eff.stop_runners == ["p1@0"] and eff.abort == [] and s.tasks == {}
    assert s.task_finished(0.3, "p1@0", trajs(1)).send == []
    # a result waiting in the outbox
    s.handle(1.0, task(2))
    s.handle(1.0, BrokerHeartbeat(epoch="e2"))
    s.generation_finished(1.1, "p2@0")
    s.task_finished(1.2, "p2@0", trajs(2))
    s.handle(1.3, Cancel(task_ids=("p2@0",)))
    assert not s.outbox


# ---------------------------------------------------------------- drain


def test_drain_refuses_new_work_gives_no_credit_hands_back_the_rest_and_says_goodbye() -> None:
    s = started()
    s.handle(0.0, task(1, n=1))
    s.handle(0.0, task(2, n=1))
    s.handle(0.0, task(3, n=1))
    s.generation_finished(0.1, "p3@0")  # scoring when the drain ends
    s.stop(1.0)
    assert s.state == WorkerState.DRAINING and s.free_credits() == 0
    (nack,) = of(s.handle(1.1, task(4)), Nack)
    assert isinstance(nack, Nack) and nack.reason == "worker_draining"
    eff = s.generation_finished(1.2, "p1@0")
    assert of(eff, Credit) == []  # no more work wanted
    assert of(s.task_finished(1.3, "p1@0", trajs(1, 1)), Result)  # finished within the drain: delivered
    eff = s.hand_back_rest(2.0)
    assert sorted(eff.stop_runners) == ["p2@0", "p3@0"] and s.tasks == {}
    eff = s.goodbye(2.1)
    assert [type(m) for m in eff.send] == [Nack, Goodbye]
    assert eff.send[0] == Nack(task_ids=("p2@0", "p3@0"), reason="worker_shutdown")
    assert s.state == WorkerState.STOPPED and s.heartbeat(2.2) is None and s.poll(100.0).send == []


def test_drain_delivers_the_outbox_and_hands_back_what_the_link_could_not_send() -> None:
    s = started()
    s.handle(0.0, task(1))
    s.handle(0.0, task(2))
    s.handle(1.0, BrokerHeartbeat(epoch="e2"))
    for i in (1, 2):
        s.generation_finished(1.1, f"p{i}@0")
        s.task_finished(1.2, f"p{i}@0", trajs(i))
    s.stop(2.0)
    eff = s.hand_back_rest(3.0)
    results = of(eff, Result)
    assert [r.task_id for r in results] == ["p1@0", "p2@0"]  # type: ignore[union-attr]
    s.unsent(3.1, results[1:])  # type: ignore[arg-type]
    assert s.goodbye(3.2).send == [Nack(task_ids=("p2@0",), reason="worker_shutdown"), Goodbye(reason="shutdown")]


def test_drain_without_a_broker_hands_back_everything_and_says_no_goodbye() -> None:
    s = make()
    s.stop(0.5)  # before its engine started: it never said hello
    assert s.hand_back_rest(1.0).send == []
    assert s.goodbye(1.1).send == []


def test_a_worker_stopped_between_its_hello_and_the_welcome_says_goodbye() -> None:
    """The broker registers a worker on its hello (and may dispatch to its credits) before the welcome arrives: a
    worker stopped in between says Goodbye, so its groups go back to the queue now, not after missed heartbeats."""
    s = make()
    assert of(s.engine_started(0.0, FACTS), Hello)  # the hello is out; no welcome yet
    s.stop(1.0)
    assert s.hand_back_rest(1.0).send == []
    assert s.goodbye(1.1).send == [Goodbye(reason="shutdown")]


# ---------------------------------------------------------------- one message per task, whatever happens


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["task", "gen", "score", "refuse", "cancel", "fail", "restart", "epoch", "welcome", "unsent"]),
                          st.integers(0, 5), st.integers(1, 3)), max_size=60))
def test_every_task_ends_in_exactly_one_message_and_credits_stay_within_capacity(ops: list[tuple[str, int, int]]) -> None:  # noqa: C901 - grandfathered: one branch per operation of the property test
    s = started()
    sent: list[Outgoing] = []
    received: list[str] = []
    now = 0.0

    def do(eff: Effects | None) -> None:
        if eff is not None:
            sent.extend(eff.send)

    for op, i, n in ops:
        now += 0.1
        tid = f"p{i}@0"
        if op == "task" and tid not in received:
            received.append(tid)
            do(s.handle(now, task(i, n)))
        elif op == "gen":
            do(s.generation_finished(now, tid))
        elif op == "score" and tid in s.tasks and s.tasks[tid].phase == "scoring":
            do(s.task_finished(now, tid, trajs(i, s.tasks[tid].seqs)))
        elif op == "refuse" and tid in s.tasks and s.tasks[tid].phase == "generating":
            do(s.task_refused(now, tid, "no"))
        elif op == "cancel":
            do(s.on_cancel(now, [tid]))
        elif op == "fail":
            do(s.engine_failed(now, "boom"))
        elif op == "restart" and s.restarting:
            do(s.engine_started(now, FACTS))
        elif op == "epoch":
            do(s.handle(now, BrokerHeartbeat(epoch=f"e{i}")))
        elif op == "welcome":
            do(s.handle(now, welcome(s.epoch or "e1")))
        elif op == "unsent":
            results = [m for m in sent if isinstance(m, Result)][-1:]
            if results and results[0] not in s.outbox:
                sent.remove(results[0])
                s.unsent(now, results)
        assert 0 <= s.engine_seqs() <= s.capacity
        assert s.free_credits() == (0 if s.restarting else s.capacity - s.engine_seqs())
    # end the run: let everything held finish, deliver, drain
    s.stop(now)
    if s.restarting:
        s.engine_started(now, FACTS)
    do(s.handle(now, welcome(s.epoch or "e1")))
    do(s.hand_back_rest(now))
    do(s.goodbye(now))
    cancelled = {tid for op, i, _ in ops if op == "cancel" for tid in [f"p{i}@0"]}
    ends: dict[str, int] = {}
    for m in sent:
        ids = (m.task_id,) if isinstance(m, Result) else m.task_ids if isinstance(m, Nack) else ()
        for tid in ids:
            ends[tid] = ends.get(tid, 0) + 1
    assert all(c == 1 for c in ends.values()), ends  # never two messages for one task
    for tid in received:
        assert ends.get(tid, 0) == 1 or tid in cancelled, (tid, ends)  # exactly one unless the broker cancelled it


# ---------------------------------------------------------------- whole heartbeats and rebases


def test_once_welcomed_a_heartbeat_echoes_the_numbering_the_welcome_names_and_is_whole() -> None:
    s = make()
    hello = s.engine_started(0.0, FACTS).send[0]
    assert isinstance(hello, Hello) and Feature.RECONCILE in hello.features
    hb = s.heartbeat(0.5)
    assert hb is None  # no epoch yet
    s.handle(1.0, welcome(dispatch_seq=41))
    s.handle(1.1, Task(task_id="p1@0", prompt=task(1).prompt, attempt=0, seq=42))
    hb = s.heartbeat(1.2)
    assert hb is not None and (hb.dispatch_seq, hb.held_full, hb.inflight_task_ids, hb.free_capacity) == (42, True, ("p1@0",), 2)
    s.handle(1.3, Error(code="hello_required", message="say hello first"))  # the broker lost us: a hello is due
    hb = s.heartbeat(1.4)  # so the next heartbeat says nothing of what is held
    assert hb is not None and hb.dispatch_seq == -1 and not hb.held_full


def test_to_a_broker_that_checks_digests_a_heartbeat_holds_a_count_and_a_digest_and_the_list_goes_when_asked() -> None:
    # a heartbeat's size must not grow with what the worker holds; the broker asks for the list on a mismatch
    s = make(capacity_limit=8)
    hello = s.engine_started(0.0, FACTS).send[0]
    assert isinstance(hello, Hello) and Feature.HELD_DIGEST in hello.features
    s.handle(1.0, welcome(dispatch_seq=0, features=(Feature.HELD_DIGEST, Feature.RECONCILE)))
    for i in range(3):
        s.handle(1.1, Task(task_id=f"p{i}@0", prompt=task(i, n=1).prompt, attempt=0, seq=i + 1))
    hb = s.heartbeat(1.2)
    assert hb is not None and hb.inflight_task_ids == () and not hb.held_full
    assert (hb.held_count, hb.held_digest, hb.dispatch_seq) == (3, held_digest(["p0@0", "p1@0", "p2@0"]), 3)
    eff = s.handle(1.3, BrokerHeartbeat(epoch="e1", send_held=True, dispatch_seq=3))
    beats = of(eff, WorkerHeartbeat)
    assert len(beats) == 1  # at once, not a heartbeat interval later
    full = beats[0]
    assert isinstance(full, WorkerHeartbeat) and full.held_full and set(full.inflight_task_ids) == {"p0@0", "p1@0", "p2@0"}
    assert s.held_lists_sent == 1
    hb = s.heartbeat(2.2)  # and the next periodic one is a digest again
    assert hb is not None and hb.inflight_task_ids == () and hb.held_count == 3


def test_credits_sent_with_a_result_travel_in_it_to_a_broker_that_reads_them() -> None:
    s = make()
    s.engine_started(0.0, FACTS)
    s.handle(0.0, welcome(features=(Feature.RESULT_CREDITS,)))
    s.handle(0.1, task(1))
    eff = s.generation_finished(0.2, "p1@0").merge(s.task_finished(0.2, "p1@0", trajs(1)))
    (msg,) = s.fold_credits(eff).send
    assert isinstance(msg, Result) and msg.task_id == "p1@0" and msg.credits == 2
    # a broker that does not read Result.credits gets the two messages
    s2 = started()
    s2.handle(0.1, task(1))
    eff = s2.fold_credits(s2.generation_finished(0.2, "p1@0").merge(s2.task_finished(0.2, "p1@0", trajs(1))))
    assert [type(m) for m in eff.send] == [Credit, Result] and of(eff, Result)[0].credits == 0  # type: ignore[attr-defined]


def test_a_cancelled_task_whose_abort_is_under_way_is_not_reported_held() -> None:
    # the broker ended its lease with the Cancel: reporting it would make every heartbeat disagree with the digest
    s = make(capacity_limit=8)
    s.engine_started(0.0, FACTS)
    s.handle(1.0, welcome(dispatch_seq=0, features=(Feature.HELD_DIGEST, Feature.RECONCILE)))
    s.handle(1.1, Task(task_id="p0@0", prompt=task(0, n=1).prompt, attempt=0, seq=1))
    s.handle(1.1, Task(task_id="p1@0", prompt=task(1, n=1).prompt, attempt=0, seq=2))
    s.handle(1.2, Cancel(task_ids=("p0@0",)))
    assert "p0@0" in s.tasks  # still generating: its credits come back when the abort ends
    hb = s.heartbeat(1.3)
    assert hb is not None and (hb.held_count, hb.held_digest) == (1, held_digest(["p1@0"]))
    full = s.heartbeat(1.3, full=True)
    assert full is not None and full.inflight_task_ids == ("p1@0",)


def test_to_a_broker_that_does_not_check_digests_every_heartbeat_holds_the_whole_list() -> None:
    s = started()  # its welcome lists no features
    s.handle(1.0, task(1))
    hb = s.heartbeat(1.1)
    assert hb is not None and hb.held_full and hb.inflight_task_ids == ("p1@0",) and hb.held_count == 1
    eff = s.handle(1.2, BrokerHeartbeat(epoch="other", send_held=True))  # another epoch's request is not answered
    assert eff is not None and of(eff, WorkerHeartbeat) == []


def test_a_rebase_below_the_served_version_forgets_it_and_one_above_keeps_it() -> None:
    s = started()
    s.apply_finished(0.0, 5)
    eff = s.handle(1.0, BrokerHeartbeat(epoch="e1", weight_version=5, version_epoch=0))
    assert eff is not None and eff.rebase is None and s.version == 5
    eff = s.handle(2.0, BrokerHeartbeat(epoch="e1", weight_version=2, version_epoch=100, rebase_version=2))
    assert eff is not None and eff.rebase == 2 and s.version == -1 and s.version_epoch == 100
    hb = s.heartbeat(2.1)
    assert hb is not None and (hb.weight_version, hb.version_epoch) == (-1, 100)
    assert s.handle(3.0, BrokerHeartbeat(epoch="e1", weight_version=2, version_epoch=100, rebase_version=2)).rebase is None  # type: ignore[union-attr]
    s.apply_finished(3.5, 2)
    eff = s.handle(4.0, BrokerHeartbeat(epoch="e1", weight_version=3, version_epoch=200, rebase_version=4))
    assert eff is not None and eff.rebase is None and s.version == 2 and s.version_epoch == 200  # 2 <= 4: shared history
    eff = s.handle(5.0, BrokerHeartbeat(epoch="e1", weight_version=3, version_epoch=0))  # a broker restarted: nothing to forget
    assert eff is not None and eff.rebase is None and s.version_epoch == 200


def test_every_trajectory_says_which_run_s_weights_made_it() -> None:
    """The epoch of the weights, not of the pool: after a rebase below the served version, what the engine still makes
    on those weights is the abandoned run's; after a rebase at or above it, the weights belong to the new run too."""
    def stamped(s: WorkerSession, i: int, now: float) -> set[int]:
        (result,) = of(run_to_result(s, i, now), Result)
        return {t.version_epoch for t in result.trajectories}

    s = started()
    s.apply_finished(0.0, 5)
    assert stamped(s, 1, 0.5) == {0}
    s.handle(1.0, BrokerHeartbeat(epoch="e1", weight_version=2, version_epoch=100, rebase_version=2))
    assert stamped(s, 2, 1.5) == {0}  # version 5 is still in the engine: the abandoned run's
    s.apply_finished(2.0, 2)
    assert stamped(s, 3, 2.5) == {100}
    s.handle(3.0, BrokerHeartbeat(epoch="e1", weight_version=3, version_epoch=200, rebase_version=4))
    assert stamped(s, 4, 3.5) == {200}  # 2 <= 4: the same weights in the new run


def test_a_cancelled_task_s_discarded_tokens_travel_on_the_heartbeat() -> None:
    s = started()
    s.handle(0.0, task(1))
    s.on_cancel(0.0, ["p1@0"])
    s.generation_finished(0.1, "p1@0")
    s.output_discarded(7)
    hb = s.heartbeat(0.2)
    assert hb is not None and hb.tokens_cancelled == 7
