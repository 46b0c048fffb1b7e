"""Protocol minor 1 on real sockets: a minor-0 worker keeps working unchanged; a minor-1 worker gets several
tasks per message, hands several results and their credit back in one, and is asked for its held list
when its heartbeat's digest disagrees with the broker's leases."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import zmq

from rollpool import protocol as p
from tests.integration.broker.conftest import Harness
from tests.integration.broker.peers import make_group, make_prompt


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
    w = RawWorker(h, "new", minor=1, capacity=4, features=p.FEATURES)
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


async def test_minor4_peers_without_the_minor5_fields_work_unchanged(start_broker) -> None:  # type: ignore[no-untyped-def]
    """Protocol minor 5 (issue 24) adds SetVersion.stale_bound and WorkerHeartbeat.tokens_cancelled: a minor-4
    client and worker, whose messages lack them, are served as before (eta bounds the cancellation, nothing counted)."""
    h: Harness = await start_broker(heartbeat_interval_s=0.2, max_staleness=1, cancel_stale_inflight=True)
    w = RawWorker(h, "m4", minor=4, capacity=2)

    def minor4(msg: Any, drop: str) -> list[bytes]:
        frames = p.encode(msg)
        major, _minor, kind, fields = msgpack.unpackb(frames[0])
        fields.pop(drop, None)
        frames[0] = msgpack.packb([major, 4, kind, fields], use_bin_type=True)
        return frames

    client = h.sockets.dealer(h.broker.client_endpoint, identity=b"m4-client")
    try:
        welcome = await w.hello()
        await client.send_multipart(minor4(p.ClientHello(client_id="m4", protocol_min=1, protocol_max=1), "max_msg_bytes"))
        assert type(p.decode(await asyncio.wait_for(client.recv_multipart(), 5))) is p.ClientWelcome
        await client.send_multipart(minor4(p.SetVersion(request_id="v", version=3), "stale_bound"))
        reply = p.decode(await asyncio.wait_for(client.recv_multipart(), 5))
        assert type(reply) is p.Reply and reply.ok and h.broker.state.version == 3 and h.broker.state.trainer_bound == -1
        await w.sock.send_multipart(minor4(p.WorkerHeartbeat(worker_id="m4", weight_version=3, epoch=welcome.epoch), "tokens_cancelled"))
        await asyncio.sleep(0.3)
        st = h.broker.state
        assert st.workers["m4"].version == 3 and st.counters["wasted_tokens_cancel"] == 0 and h.broker.protocol_errors == 0
    finally:
        client.close(linger=0)
        w.close()
