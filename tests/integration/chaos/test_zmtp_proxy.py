"""The fault-injecting ZMTP proxy (a fake link, `rollpool.chaos.zmtp_proxy`) against a real broker and publisher.

Every fault is checked from the far end: a dropped request gets no answer, a
duplicated one two, a reordered pair comes back swapped, a reset connection
is dialled again and served; the counts add up exactly (what arrived =
forwarded + duplicated) per message type and direction.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from rollpool.broker import Broker, BrokerConfig
from rollpool.chaos.zmtp_proxy import FaultRule, FaultyZmtpProxy, MessageFaults
from rollpool.protocol import Announce, SocketFactory, StatusReply, StatusRequest, decode, encode

pytestmark = pytest.mark.chaos


@pytest.fixture
async def broker(zmq_ctx: Any) -> AsyncIterator[Broker]:
    b = Broker(BrokerConfig(worker_endpoint="tcp://127.0.0.1:*", client_endpoint="tcp://127.0.0.1:*",
                            heartbeat_interval_s=0.2, drain_timeout_s=0), SocketFactory(zmq_ctx))
    task = asyncio.create_task(b.run())
    await asyncio.wait_for(b.ready.wait(), 5)
    yield b
    b.stop()
    await asyncio.wait_for(task, 10)


class RawClient:
    def __init__(self, sockets: SocketFactory, endpoint: str) -> None:
        self.sock = sockets.dealer(endpoint, identity=b"raw-client")

    async def ask(self, rid: str) -> None:
        await self.sock.send_multipart(encode(StatusRequest(request_id=rid)))

    async def replies(self, quiet_s: float = 0.25) -> list[str]:
        """Request ids of every reply until the line has been quiet for `quiet_s`."""
        out: list[str] = []
        while await self.sock.poll(int(quiet_s * 1000)):
            msg = decode(await self.sock.recv_multipart())
            assert isinstance(msg, StatusReply)
            out.append(msg.request_id)
        return out


@pytest.mark.parametrize("direction", ["up", "down"])
async def test_each_fault_in_each_direction_is_applied_and_counted(zmq_ctx: Any, broker: Broker, direction: str) -> None:
    proxy = await FaultyZmtpProxy("broker:client", broker.client_endpoint).start()
    client = RawClient(SocketFactory(zmq_ctx), proxy.endpoint)
    kind = "status_request" if direction == "up" else "status_reply"
    try:
        await client.ask("warm")
        assert await client.replies() == ["warm"]

        proxy.rules.append(FaultRule(kind, "drop", direction))
        await client.ask("lost")
        await client.ask("after-lost")
        assert await client.replies() == ["after-lost"]

        proxy.rules.append(FaultRule(kind, "duplicate", direction))
        await client.ask("twice")
        assert await client.replies() == ["twice", "twice"]

        proxy.rules.append(FaultRule(kind, "reorder", direction))
        await client.ask("first")
        await client.ask("second")
        assert await client.replies() == ["second", "first"]

        proxy.faults.delay_s = 0.1
        proxy.rules.append(FaultRule(kind, "delay", direction))
        await client.ask("late")
        await client.ask("behind-late")
        assert await client.replies() == ["late", "behind-late"]  # a delay keeps order (head of line)

        assert proxy.live_connections == 1
        assert proxy.reset() == 1
        for i in range(50):  # the DEALER dials again; requests sent while it is down may be lost
            await client.ask(f"after-reset-{i}")
            got = await client.replies(0.1)
            if got:
                break
        assert got and got[-1].startswith("after-reset"), got
        assert proxy.connections >= 2 and proxy.resets == 1

        by = proxy.report()["by_type"][direction][kind]
        assert (by["dropped"], by["duplicated"], by["reordered"], by["delayed"]) == (1, 1, 1, 1)
    finally:
        client.sock.close(linger=0)
        await proxy.close()


async def test_random_faults_add_up_exactly(zmq_ctx: Any, broker: Broker) -> None:
    proxy = await FaultyZmtpProxy("broker:client", broker.client_endpoint, seed=3).start()
    client = RawClient(SocketFactory(zmq_ctx), proxy.endpoint)
    try:
        await client.ask("warm")
        assert await client.replies() == ["warm"]
        proxy.faults = MessageFaults(drop=0.1, duplicate=0.1, delay=0.05, reorder=0.1, delay_s=0.002, reorder_hold_s=0.05)
        sent = 400
        for i in range(sent):
            await client.ask(f"r{i}")
            if i % 20 == 19:
                await asyncio.sleep(0.01)
        got = await client.replies(1.0)
        c = proxy.counts
        up = {a: c["up", "status_request", a] for a in ("forwarded", "dropped", "duplicated", "delayed", "reordered")}
        down = {a: c["down", "status_reply", a] for a in ("forwarded", "dropped", "duplicated", "delayed", "reordered")}
        assert all(n > 0 for n in up.values()) and all(n > 0 for n in down.values()), (up, down)
        assert up["forwarded"] + up["dropped"] == sent + 1  # every request met the proxy once
        assert down["forwarded"] + down["dropped"] == up["forwarded"] + up["duplicated"]  # the broker answered each copy
        assert len(got) == down["forwarded"] + down["duplicated"] - 1  # the warm-up reply was read before
        assert got != sorted(got, key=lambda r: int(r[1:]))  # something was reordered
    finally:
        client.sock.close(linger=0)
        await proxy.close()


async def test_pub_sub_announcements_are_faulted_too(zmq_ctx: Any) -> None:
    sockets = SocketFactory(zmq_ctx)
    pub = sockets.pub("tcp://127.0.0.1:*")
    proxy = await FaultyZmtpProxy("publisher:pub", pub.getsockopt_string(__import__("zmq").LAST_ENDPOINT)).start()
    sub = sockets.sub(proxy.endpoint)
    try:
        for _ in range(100):  # the subscription has to travel up first
            await pub.send_multipart(encode(Announce(version=0, publisher_id="p", total_bytes=0, num_buckets=0)))
            if await sub.poll(50):
                break
        while await sub.poll(100):
            await sub.recv_multipart()
        proxy.rules.append(FaultRule("announce", "drop", "down"))
        for v in (1, 2):
            await pub.send_multipart(encode(Announce(version=v, publisher_id="p", total_bytes=0, num_buckets=0)))
        assert await sub.poll(1000)
        got = [decode(await sub.recv_multipart()).version]
        assert not await sub.poll(200)
        assert got == [2]
        assert proxy.total("dropped", "down", "announce") == 1
    finally:
        sub.close(linger=0)
        pub.close(linger=0)
        await proxy.close()
