"""Protocol minor 1 on real sockets: a minor-0 worker keeps working unchanged; a minor-1 worker gets several
tasks per message, hands several results and their credit back in one, and is asked for its held list
when its heartbeat's digest disagrees with the broker's leases."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgpack
import zmq

from rollpool import protocol as p
from tests.integration.broker.conftest import Harness
from tests.integration.broker.peers import make_group, make_prompt

MINOR4_FEATURES = tuple(f for f in p.FEATURES if f != p.Feature.RECONCILE)
"""What a worker of protocol 1.3/1.4 lists: its heartbeats are recorded, not acted on."""


class RawWorker:
    """A worker on a bare DEALER that writes every header with protocol minor `minor` (0: the previous minor)."""

    def __init__(self, h: Harness, worker_id: str, *, minor: int, capacity: int, features: tuple[str, ...] = ()) -> None:
        self.sock = h.sockets.dealer(h.broker.worker_endpoint, identity=worker_id.encode())
        self.worker_id = worker_id
        self.minor = minor
        self.capacity = capacity
        self.features = features
        self.received: list[Any] = []

    def close(self) -> None:
        self.sock.close(linger=0)

    async def send(self, msg: Any) -> None:
        frames = p.encode(msg)
        major, _minor, kind, fields = msgpack.unpackb(frames[0])
        frames[0] = msgpack.packb([major, self.minor, kind, fields], use_bin_type=True)
        await self.sock.send_multipart(frames)

    async def recv(self, kind: type[Any], timeout_s: float = 5.0) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(f"no {kind.__name__}; got {[type(m).__name__ for m in self.received]}")
            if not await self.sock.poll(int(left * 1000), zmq.POLLIN):
                continue
            msg = p.decode(await self.sock.recv_multipart())
            self.received.append(msg)
            if type(msg) is kind:
                return msg

    async def hello(self) -> p.Welcome:
        await self.send(p.Hello(worker_id=self.worker_id, protocol_min=1, protocol_max=1, engine="raw", capacity=self.capacity,
                                credits=self.capacity, features=self.features))
        welcome: p.Welcome = await self.recv(p.Welcome)
        return welcome


async def test_a_minor0_worker_gets_single_tasks_and_its_result_credit_and_heartbeat_shapes_work(start_broker) -> None:  # type: ignore[no-untyped-def]
    h: Harness = await start_broker(heartbeat_interval_s=0.2)
    c = await h.client()
    w = RawWorker(h, "old", minor=0, capacity=3)
    try:
        welcome = await w.hello()
        assert set(welcome.features) == set(p.FEATURES)  # listed, but an old worker ignores the field
        await c.submit([make_prompt(f"q{i}") for i in range(6)])
        done = 0
        while done < 6:
            task = await w.recv(p.Task)
            assert task.seq >= 1  # numbered, and ignored by an old worker
            await w.send(p.WorkerHeartbeat(worker_id="old", inflight_task_ids=(task.task_id,), epoch=welcome.epoch))
            await w.send(p.Result(task_id=task.task_id, prompt_id=task.prompt.prompt_id, trajectories=make_group(task, "old")))
            await w.send(p.Credit(credits=1))
            done += 1
        got = await c.collect(6)
        assert sorted(g.prompt_id for g in got) == sorted(f"q{i}" for i in range(6))
        assert not any(type(m) is p.TaskBatch for m in w.received)  # never a message type it did not list
        status = (await c.status()).counters
        assert status["held_checks"] == 0 and status["protocol_errors"] == 0
    finally:
        w.close()


async def test_a_minor1_worker_gets_task_batches_returns_result_batches_and_is_asked_for_its_list(start_broker) -> None:  # type: ignore[no-untyped-def]
    h: Harness = await start_broker(heartbeat_interval_s=0.2)
    c = await h.client()
    w = RawWorker(h, "new", minor=1, capacity=4, features=MINOR4_FEATURES)
    try:
        welcome = await w.hello()
        await c.submit([make_prompt(f"q{i}") for i in range(4)])
        batch = await w.recv(p.TaskBatch)
        assert [t.seq for t in batch.tasks] == [1, 2, 3, 4]
        held = [t.task_id for t in batch.tasks]
        # a consistent heartbeat: nothing asked
        await w.send(p.WorkerHeartbeat(worker_id="new", epoch=welcome.epoch, dispatch_seq=4, free_capacity=0, held_count=4,
                                       held_digest=p.held_digest(held)))
        # one that leaves a task out: the broker asks for the full list, naming the last number it sent
        await w.send(p.WorkerHeartbeat(worker_id="new", epoch=welcome.epoch, dispatch_seq=4, free_capacity=1, held_count=3,
                                       held_digest=p.held_digest(held[:3])))
        ask = None
        while ask is None:
            hb = await w.recv(p.BrokerHeartbeat)
            ask = hb if hb.send_held else None
        assert ask.dispatch_seq == 4
        await w.send(p.WorkerHeartbeat(worker_id="new", epoch=welcome.epoch, dispatch_seq=4, free_capacity=1, held_count=3,
                                       held_digest=p.held_digest(held[:3]), inflight_task_ids=tuple(held[:3]), held_full=True))
        results = tuple(p.Result(task_id=t.task_id, prompt_id=t.prompt.prompt_id, trajectories=make_group(t, "new")) for t in batch.tasks)
        await w.send(p.ResultBatch(results=results, credits=4))
        got = await c.collect(4)
        assert sorted(g.prompt_id for g in got) == [f"q{i}" for i in range(4)]
        await c.submit([make_prompt("q4")])
        follow = await w.recv(p.Task)  # the batch's credit came back: one more task, number 5
        assert follow.seq == 5
        status = (await c.status()).counters
        assert status["held_mismatches"] == 1 and status["held_lists"] == 1 and status["leases_unreported"] == 1
        assert status["latency_e2e_p99_ms"] > 0
    finally:
        w.close()


async def test_a_minor5_worker_that_leaves_a_task_out_of_its_heartbeat_gets_it_again_with_its_credit(start_broker) -> None:  # type: ignore[no-untyped-def]
    """Feature.RECONCILE: a lease at or below the echo the worker does not hold is requeued at once (no attempt burned)
    and sent again; the credit the lost task held comes back from the absolute free capacity, with no Credit."""
    h: Harness = await start_broker(heartbeat_interval_s=0.2)
    c = await h.client()
    w = RawWorker(h, "rec", minor=p.PROTOCOL_MINOR, capacity=2, features=(p.Feature.RECONCILE,))
    try:
        welcome = await w.hello()
        assert welcome.dispatch_seq == 0 and p.Feature.RECONCILE in welcome.features
        await c.submit([make_prompt("q0"), make_prompt("q1")])
        t1, t2 = await w.recv(p.Task), await w.recv(p.Task)
        assert (t1.seq, t2.seq) == (1, 2)
        # task 2 "was lost": the worker saw up to 2 and holds task 1 only, one sequence free
        await w.send(p.WorkerHeartbeat(worker_id="rec", epoch=welcome.epoch, dispatch_seq=2, free_capacity=1, held_count=1,
                                       inflight_task_ids=(t1.task_id,), held_full=True))
        again = await w.recv(p.Task)
        assert again.prompt.prompt_id == t2.prompt.prompt_id and again.seq == 3 and again.task_id != t2.task_id
        for t in (t1, again):
            await w.send(p.Result(task_id=t.task_id, prompt_id=t.prompt.prompt_id, trajectories=make_group(t, "rec")))
        got = await c.collect(2)
        assert sorted(g.prompt_id for g in got) == ["q0", "q1"] and all(g.state == "done" for g in got)
        status = (await c.status()).counters
        assert status["leases_reconciled"] == 1 and status["credit_corrections"] >= 1 and status["requeued"] == 1
    finally:
        w.close()


async def test_a_heartbeat_that_queued_up_during_a_broker_stall_reconciles_nothing(start_broker) -> None:  # type: ignore[no-untyped-def]
    """A heartbeat written before the task arrived, read only after the broker stalled past the echo grace
    (2 x heartbeat_interval_s), is a heartbeat that crossed a dispatch: the stall is noted before it is read."""
    h: Harness = await start_broker(heartbeat_interval_s=0.2)
    c = await h.client()
    w = RawWorker(h, "st", minor=p.PROTOCOL_MINOR, capacity=1, features=(p.Feature.RECONCILE,))
    try:
        welcome = await w.hello()
        await c.submit([make_prompt("q0")])
        task = await w.recv(p.Task)
        await w.send(p.WorkerHeartbeat(worker_id="st", epoch=welcome.epoch, dispatch_seq=0, free_capacity=1, held_count=0, held_full=True))
        time.sleep(1.0)  # noqa: ASYNC251 - on purpose: the whole loop, the broker's included, stops reading (a GC pause)
        await w.send(p.WorkerHeartbeat(worker_id="st", epoch=welcome.epoch, dispatch_seq=1, free_capacity=0, held_count=1,
                                       inflight_task_ids=(task.task_id,), held_full=True))
        await w.send(p.Result(task_id=task.task_id, prompt_id="q0", trajectories=make_group(task, "st")))
        (got,) = await c.collect(1)
        assert got.state == "done" and got.attempts == 1
        status = (await c.status()).counters
        assert status["broker_stalls"] >= 1 and status["leases_reconciled"] == 0 and status["requeued"] == 0
    finally:
        w.close()


async def test_a_status_reply_stays_decodable_with_more_workers_than_a_map_may_hold(start_broker) -> None:  # type: ignore[no-untyped-def]
    h: Harness = await start_broker()
    broker = h.broker
    for i in range(p.DEFAULT_LIMITS.max_map_len + 10):  # bookkeeping only: no sockets needed for the view
        broker.state.add_worker(worker_id=f"w{i}", identity=f"w{i}".encode(), capacity=1, credits=1, now=broker.clock())
    reply = p.StatusReply(request_id="s", epoch=broker.epoch, counters=broker.counters(), workers=broker.workers_view())
    decoded = p.decode(p.encode(reply))
    assert decoded.counters["workers_alive"] == p.DEFAULT_LIMITS.max_map_len + 10
    assert len(decoded.workers) == decoded.counters["workers_listed"] < p.DEFAULT_LIMITS.max_map_len
    for i in range(p.DEFAULT_LIMITS.max_map_len + 10):  # leave no ghost workers for the teardown's goodbyes
        broker.state.remove_worker(f"w{i}", broker.clock(), reason="goodbye")


async def test_a_minor6_workers_failed_apply_is_not_taken_for_a_skip_and_a_minor7_skip_is_shown(start_broker) -> None:  # type: ignore[no-untyped-def]
    """Protocol 1.7 added ApplyDone.skipped; a 1.6 worker's failure (no such field) stays an ordinary failure."""
    h: Harness = await start_broker(heartbeat_interval_s=0.2)
    c = await h.client()
    old, new = RawWorker(h, "old", minor=6, capacity=1), RawWorker(h, "new", minor=7, capacity=1)
    try:
        await old.hello()
        await new.hello()
        await old.send(p.ApplyDone(version=3, ok=False, error="EngineError: shape"))
        await new.send(p.ApplyDone(version=3, ok=False, error="EngineError: shape (restarted engine)", skipped=True))
        for _ in range(100):
            workers = (await c.status()).workers
            if workers["new"]["skipped_version"] == 3:
                break
            await asyncio.sleep(0.05)
        assert workers["new"]["skipped_version"] == 3 and workers["new"]["skipped_error"] == "EngineError: shape (restarted engine)"
        assert workers["old"]["skipped_version"] == -1  # it may still apply it on a restarted engine: a waiting trainer keeps waiting
        counters = (await c.status()).counters
        assert counters["versions_failed"] == 1 and counters["versions_skipped"] == 1 and counters["protocol_errors"] == 0
    finally:
        old.close()
        new.close()
async def test_minor7_peers_without_the_minor8_fields_work_unchanged(start_broker) -> None:  # type: ignore[no-untyped-def]
    """Protocol minor 8 (staleness control) adds SetVersion.stale_bound and WorkerHeartbeat.tokens_cancelled: a minor-7
    client and worker, whose messages lack them, are served as before (eta bounds the cancellation, nothing counted)."""
    h: Harness = await start_broker(heartbeat_interval_s=0.2, max_staleness=1, cancel_stale_inflight=True)
    w = RawWorker(h, "m7", minor=7, capacity=2)

    def minor7(msg: Any, drop: str) -> list[bytes]:
        frames = p.encode(msg)
        major, _minor, kind, fields = msgpack.unpackb(frames[0])
        fields.pop(drop, None)
        frames[0] = msgpack.packb([major, 7, kind, fields], use_bin_type=True)
        return frames

    client = h.sockets.dealer(h.broker.client_endpoint, identity=b"m7-client")
    try:
        welcome = await w.hello()
        await client.send_multipart(minor7(p.ClientHello(client_id="m7", protocol_min=1, protocol_max=1), "max_msg_bytes"))
        assert type(p.decode(await asyncio.wait_for(client.recv_multipart(), 5))) is p.ClientWelcome
        await client.send_multipart(minor7(p.SetVersion(request_id="v", version=3), "stale_bound"))
        reply = p.decode(await asyncio.wait_for(client.recv_multipart(), 5))
        assert type(reply) is p.Reply and reply.ok and h.broker.state.version == 3 and h.broker.state.trainer_bound == -1
        await w.sock.send_multipart(minor7(p.WorkerHeartbeat(worker_id="m7", weight_version=3, epoch=welcome.epoch), "tokens_cancelled"))
        await asyncio.sleep(0.3)
        st = h.broker.state
        assert st.workers["m7"].version == 3 and st.counters["wasted_tokens_cancel"] == 0 and h.broker.protocol_errors == 0
    finally:
        client.close(linger=0)
        w.close()
