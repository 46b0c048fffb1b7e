"""The broker on real sockets (ipc and tcp loopback) with scripted peers."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import zmq

from rollpool import protocol as p
from tests.integration.broker.conftest import Harness
from tests.integration.broker.peers import make_prompt


async def test_credits_fifo_whole_groups_and_no_head_of_line_blocking(start_broker) -> None:  # type: ignore[no-untyped-def]
    h: Harness = await start_broker()
    c = await h.client()
    prompts = [make_prompt("big", group_size=8)] + [make_prompt(f"g{i}", group_size=3) for i in range(6)]
    reply = await c.submit(prompts)
    assert len(reply.accepted) == 7
    w = await h.worker("w", capacity=6, auto_complete=False)
    await h.wait_for(lambda: len(w.tasks) == 2)
    await asyncio.sleep(0.1)
    assert [t.prompt.prompt_id for t in w.tasks] == ["g0", "g1"]  # FIFO; "big" (8 > 6) skipped, not blocking
    assert w.max_inflight_samples <= 6
    w.auto_complete = True
    for tid in list(w.inflight):
        await w.complete(tid)
    await h.wait_for(lambda: len(w.tasks) == 6)
    assert [t.prompt.prompt_id for t in w.tasks] == [f"g{i}" for i in range(6)]
    big = await h.worker("big-worker", capacity=8)
    got = await c.collect(7)
    by_id = {g.prompt_id: g for g in got}
    assert by_id["big"].worker_id == "big-worker"
    for g in got:
        assert len(g.trajectories) == (8 if g.prompt_id == "big" else 3)
        assert {t.worker_id for t in g.trajectories} == {g.worker_id}  # one group, one worker
        assert sorted(t.sample_index for t in g.trajectories) == list(range(len(g.trajectories)))
    assert w.max_inflight_samples <= 6 and big.max_inflight_samples <= 8


async def test_vanished_worker_is_declared_dead_and_its_late_result_dropped(start_broker) -> None:  # type: ignore[no-untyped-def]
    h: Harness = await start_broker()
    c = await h.client()
    doomed = await h.worker("doomed", capacity=2, auto_complete=False)
    await c.submit([make_prompt("p", group_size=2)])
    await h.wait_for(lambda: len(doomed.tasks) == 1)
    task = doomed.tasks[0]
    await doomed.vanish()
    rescuer = await h.worker("rescuer", capacity=2)
    (group,) = await c.collect(1)
    assert group.worker_id == "rescuer" and group.state == "done" and group.attempts == 2
    assert rescuer.tasks[0].task_id == "p@1"
    # the dead worker comes back from the grave with its old result
    ghost = await h.worker("ghost", capacity=2, auto_complete=False)
    await ghost.send_result_for(task)
    await h.wait_for(lambda: h.broker.state.counters["duplicates"] == 1)
    assert (await c.pull(wait_s=0.2)).groups == ()
    status = await c.status()
    assert status.counters["workers_lost"] == 1 and status.counters["requeued"] == 1


async def test_thousand_prompts_with_random_deaths_and_rejoins(start_broker) -> None:  # type: ignore[no-untyped-def]
    h: Harness = await start_broker(max_attempts=50)
    rng = random.Random(1234)
    c = await h.client()
    workers = [await h.worker(f"w{i}", capacity=8, delay_s=0.002) for i in range(4)]
    ids = [f"p{i}" for i in range(1000)]
    for start in range(0, 1000, 100):
        reply = await c.submit([make_prompt(pid, group_size=rng.randint(1, 4)) for pid in ids[start : start + 100]])
        assert not reply.rejected
    delivered: list[p.GroupResult] = []
    pending_ack: list[str] = []
    generation = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while len(delivered) < 1000:
        assert loop.time() < deadline, f"only {len(delivered)} of 1000 terminal"
        batch = await c.pull(max_groups=200, wait_s=0.05, ack=pending_ack)
        pending_ack = [g.prompt_id for g in batch.groups]
        delivered.extend(batch.groups)
        if rng.random() < 0.3:
            i = rng.randrange(len(workers))
            victim = workers[i]
            if rng.random() < 0.5:
                await victim.vanish()  # crash: found by missed heartbeats
            else:
                await victim.goodbye()  # clean leave: hands its tasks back
            generation += 1
            workers[i] = await h.worker(f"w{i}-{generation}", capacity=8, delay_s=0.002)
    await c.ack(pending_ack)
    states = Counter(g.state for g in delivered)
    prompt_ids = Counter(g.prompt_id for g in delivered)
    assert set(prompt_ids) == set(ids) and max(prompt_ids.values()) == 1  # one terminal state each, told once
    traj_ids = Counter(t.trajectory_id for g in delivered for t in g.trajectories)
    assert max(traj_ids.values()) == 1
    assert states["done"] == 1000
    assert sum(len(g.trajectories) for g in delivered) == len(traj_ids)
    assert generation > 0
    await h.wait_for(lambda: h.broker.state.held == 0)
    h.broker.state.check_invariants()


async def test_full_queue_answers_with_an_explicit_rejection(start_broker) -> None:  # type: ignore[no-untyped-def]
    h: Harness = await start_broker(max_queued=50)
    c = await h.client()
    reply = await c.submit([make_prompt(f"p{i}") for i in range(80)])
    assert len(reply.accepted) == 50
    assert {r.reason for r in reply.rejected} == {"queue_full"} and len(reply.rejected) == 30
    for _ in range(5):  # pressure keeps being refused; memory does not grow
        again = await c.submit([make_prompt(f"x{_}-{i}") for i in range(100)])
        assert not again.accepted
    assert len(h.broker.state.groups) == 50
    await h.worker("w", capacity=50)
    assert len(await c.collect(50)) == 50
    assert len((await c.submit([make_prompt("after")])).accepted) == 1


async def test_rogue_peer_gets_errors_while_a_good_client_is_served(start_broker) -> None:  # type: ignore[no-untyped-def]
    h: Harness = await start_broker()
    c = await h.client()
    await h.worker("w", capacity=4)
    rogue = h.sockets.dealer(h.broker.client_endpoint, identity=b"rogue")
    rogue_w = h.sockets.dealer(h.broker.worker_endpoint, identity=b"rogue-w")
    garbage = [
        [b"\xc1\xc1not msgpack"],
        [b""],
        [p.encode(p.Credit(credits=1))[0][:-1]],
        [b"\x94\x01\x00\xa5bogus\x80"],
        [*p.encode(p.Ack(prompt_ids=("a",))), b"unreferenced frame"],
        p.encode(p.Task(task_id="t", prompt=make_prompt("t"))),  # a worker-bound type on the client port
    ]
    try:

        async def spam() -> None:
            for _ in range(20):
                for frames in garbage:
                    await rogue.send_multipart(frames)
                await rogue_w.send_multipart(garbage[0])
                await asyncio.sleep(0.005)

        spammer = asyncio.create_task(spam())
        await c.submit([make_prompt(f"p{i}") for i in range(50)])
        got = await c.collect(50)
        await spammer
        assert len(got) == 50
        errors = []
        while len(errors) < 20 and await rogue.poll(1000):
            errors.append(p.decode(await rogue.recv_multipart()))
        assert errors and all(isinstance(e, p.Error) for e in errors)
        assert {"malformed", "unexpected_type"} <= {e.code for e in errors}
        assert isinstance(p.decode(await rogue_w.recv_multipart()), p.Error)
        status = await c.status()
        assert status.counters["protocol_errors"] >= 100
    finally:
        rogue.close(linger=0)
        rogue_w.close(linger=0)


async def test_control_fan_out_status_and_version_endpoints(start_broker) -> None:  # type: ignore[no-untyped-def]
    h: Harness = await start_broker()
    c = await h.client()
    a, b = await h.worker("a"), await h.worker("b")
    reply = await c.control("flush_cache")
    assert reply.ok and set(reply.results) == {"a", "b"}
    r = await c.set_version(3, weight_endpoint="tcp://127.0.0.1:7000", announce_endpoint="tcp://127.0.0.1:7001")
    assert r.ok and r.data["version"] == 3 and r.epoch == h.broker.epoch
    await h.wait_for(lambda: any(isinstance(m, p.BrokerHeartbeat) and m.weight_version == 3 for m in a.received))
    hb = [m for m in a.received if isinstance(m, p.BrokerHeartbeat) and m.weight_version == 3][-1]
    assert hb.weight_endpoint == "tcp://127.0.0.1:7000" and hb.announce_endpoint == "tcp://127.0.0.1:7001"
    late = await h.worker("late")
    assert late.welcome is not None and late.welcome.weight_endpoint == "tcp://127.0.0.1:7000"
    assert late.welcome.weight_version == 3
    status = await c.status()
    assert status.counters["workers_alive"] == 3 and set(status.workers) == {"a", "b", "late"}
    for key in ("epoch", "version", "queued", "leased", "held", "dispatched", "completed", "requeued", "duplicates",
                "failed", "dropped_stale", "cancelled", "workers_alive", "protocol_errors"):
        assert key in status.counters
    await b.vanish()
    reply = await c.control("sleep", timeout_s=0.3)
    assert not reply.ok and reply.results["b"]["ok"] is False and reply.results["a"]["ok"] is True


async def test_broker_restart_adopts_reannounced_tasks_and_merges_resubmission(
    start_broker, zmq_ctx, transport  # type: ignore[no-untyped-def]
) -> None:
    h: Harness = await start_broker(worker_endpoint="tcp://127.0.0.1:*", client_endpoint="tcp://127.0.0.1:*")
    c = await h.client()
    w = await h.worker("w", capacity=2, auto_complete=False)
    await c.submit([make_prompt("p", group_size=2)])
    await h.wait_for(lambda: len(w.tasks) == 1)
    old_epoch = h.broker.epoch
    wep, cep = h.broker.worker_endpoint, h.broker.client_endpoint
    h.broker.stop()  # the broker goes away (its state with it) ...
    await h.wait_for(lambda: h.broker._w is None)
    h2: Harness = await start_broker(worker_endpoint=wep, client_endpoint=cep)  # ... and a new one takes its place
    assert h2.broker.epoch != old_epoch
    await h.wait_for(lambda: "w" in h2.broker.state.workers)  # the worker said hello again with its task
    assert h2.broker.state.counters["adopted"] == 1
    c2 = await h2.client()
    reply = await c2.submit([make_prompt("p", group_size=2)])  # the client resubmits what it did not get
    assert reply.accepted == ("p",) and reply.epoch == h2.broker.epoch
    await w.complete("p@0")
    (g,) = await c2.collect(1)
    assert g.prompt_id == "p" and len(g.trajectories) == 2
    assert h2.broker.state.counters["dispatched"] == 1  # merged, never dispatched twice
    await c.close()


async def test_stop_says_goodbye_to_workers_and_refuses_submits(start_broker) -> None:  # type: ignore[no-untyped-def]
    h: Harness = await start_broker()
    w = await h.worker("w")
    h.broker.stop()
    await h.wait_for(lambda: any(isinstance(m, p.Goodbye) for m in w.received))
    assert zmq is not None


async def test_coalesced_reads_lose_nothing_and_the_socket_is_read_again(start_broker) -> None:  # type: ignore[no-untyped-def]
    """`coalesce_s`: a socket read again within the window is put off to its end (its reader removed meanwhile);
    every message of the window is read then, and the socket keeps being read after it (reader back on)."""
    h: Harness = await start_broker(coalesce_s=0.05)  # a long window: many reads fall inside one
    workers = [await h.worker(f"w{i}", capacity=4) for i in range(3)]  # complete every task at once
    c = await h.client()
    replies = await asyncio.gather(*(c.submit([make_prompt(f"q{i}")]) for i in range(200)))  # one prompt per Submit, all at once
    assert sorted(pid for r in replies for pid in r.accepted) == sorted(f"q{i}" for i in range(200))
    got = await c.collect(200)
    assert sorted(g.prompt_id for g in got) == sorted(f"q{i}" for i in range(200))  # each once
    assert all(g.state == "done" for g in got)
    assert h.broker.coalesced_reads > 0  # the window was used
    assert h.broker.reads * 4 < h.broker.messages_in  # one read takes what both sockets hold, many messages
    reply = await c.submit([make_prompt("after")])  # read after the windows: the reader was put back
    assert reply.accepted == ("after",)
    assert [g.prompt_id for g in await c.collect(1)] == ["after"]
    st = await c.status()
    assert st.counters["duplicates"] == 0 and st.counters["completed"] == 201
    assert sum(len(w.tasks) for w in workers) == 201  # dispatched once each
