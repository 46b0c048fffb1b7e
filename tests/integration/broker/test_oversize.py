"""Oversize messages: the sender refuses with an error naming the limit; the receiver counts the drops.

A real broker, the real asyncio `TrainerClient`, tcp loopback. libzmq drops a
message part over the receiver's MAXMSGSIZE together with the connection and
reports nothing, so today a 68 MiB Submit ends in `BrokerUnavailableError`
after its retries and nobody logs why.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq.asyncio

from rollpool import protocol as p
from rollpool.broker import Broker, BrokerConfig
from rollpool.protocol import ProtocolError, SocketFactory
from rollpool.protocol.sockets import SocketOptions
from rollpool.trainer_client import TrainerClient, TrainerClientConfig

MiB = 1024 * 1024


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    ctx = zmq.asyncio.Context()
    sockets = SocketFactory(ctx, SocketOptions(monitor_disconnects=True))
    b = Broker(BrokerConfig(worker_endpoint="tcp://127.0.0.1:*", client_endpoint="tcp://127.0.0.1:*", heartbeat_interval_s=0.2), sockets)
    task = asyncio.create_task(b.run())
    await asyncio.wait_for(b.ready.wait(), 5)
    try:
        yield b
    finally:
        b.stop()
        await asyncio.wait_for(task, 10)
        sockets.close()
        ctx.destroy(linger=0)


async def test_a_68_mib_submit_is_refused_by_the_sender_naming_the_limit(broker: Broker) -> None:
    cfg = TrainerClientConfig(broker=broker.client_endpoint, request_timeout_s=1.0, request_retries=2)
    huge = p.Prompt(prompt_id="huge", input_ids=np.zeros(17 * MiB, np.int32), group_size=1)  # 68 MiB of token ids
    async with TrainerClient(config=cfg) as client:
        with pytest.raises(ProtocolError) as info:
            await client.submit([huge])
        assert info.value.code == "oversize" and info.value.limit == "max_msg_bytes", repr(info.value)
        assert "max_msg_bytes of 67108864 bytes" in str(info.value)
        ok = await client.submit(["a small prompt"])  # the client and the broker are fine afterwards
        assert len(ok.accepted) == 1


async def test_the_receiver_counts_the_disconnects_maxmsgsize_causes(broker: Broker) -> None:
    ctx = zmq.asyncio.Context()
    sock = SocketFactory(ctx).dealer(broker.client_endpoint, identity=b"raw")
    try:
        await sock.send_multipart([msgpack.packb([1, 0, "status_request", {"request_id": "a"}]), b"\x00" * (65 * MiB)])
        deadline = time.monotonic() + 10
        while broker.counters().get("disconnects.broker.client", 0) < 1:
            assert time.monotonic() < deadline, f"no disconnect counted: {broker.counters()}"
            await asyncio.sleep(0.05)
    finally:
        sock.close(linger=0)
        ctx.destroy(linger=0)


async def test_a_previous_minor_client_gets_the_limits_and_is_served(broker: Broker) -> None:
    """A minor-0 peer (no limit fields in its hello) against this broker: served, the new fields ignored."""
    ctx = zmq.asyncio.Context()
    sock: Any = SocketFactory(ctx).dealer(broker.client_endpoint, identity=b"old")
    try:
        await sock.send_multipart([msgpack.packb([1, 0, "client_hello", {"client_id": "old", "protocol_min": 1, "protocol_max": 1}])])
        welcome = p.decode(await asyncio.wait_for(sock.recv_multipart(), 5))
        assert isinstance(welcome, p.ClientWelcome) and welcome.max_msg_bytes == 64 * MiB
        header = msgpack.unpackb(p.encode(welcome)[0])
        assert header[1] == p.PROTOCOL_MINOR >= 1
    finally:
        sock.close(linger=0)
        ctx.destroy(linger=0)


def monitors() -> list[threading.Thread]:
    """The socket monitor threads alive now."""
    return [t for t in threading.enumerate() if t.name == "rollpool-socket-monitor"]


async def test_the_disconnect_monitor_leaves_when_its_sockets_close_and_comes_back_for_new_ones() -> None:
    """The monitor thread of a factory nobody closes must not outlive its sockets.

    An empty zmq Poller returns at once, so a monitor thread whose watched sockets were all closed
    spun forever holding the GIL: one per broker whose factory was not closed, which made the broker's
    in-process tests 25x slower and lost their 0.05 s-heartbeat workers (why the monitor had been made opt-in).
    """
    before = set(monitors())
    ctx = zmq.asyncio.Context()
    sockets = SocketFactory(ctx, SocketOptions(monitor_disconnects=True))
    try:
        router = sockets.router("tcp://127.0.0.1:*")
        sockets.watch(router, "first")
        mine = [t for t in monitors() if t not in before]
        assert len(mine) == 1
        router.close(linger=0)
        mine[0].join(timeout=10)
        assert not mine[0].is_alive(), "the monitor thread outlived every socket it watched"
        # watched again: a new thread, and it counts
        again = sockets.router("tcp://127.0.0.1:*")
        sockets.watch(again, "second")
        endpoint = again.getsockopt(zmq.LAST_ENDPOINT).decode()
        peer = SocketFactory(ctx).dealer(endpoint, identity=b"p")
        await peer.send_multipart([b"x"])
        await again.recv_multipart()
        peer.close(linger=0)
        deadline = time.monotonic() + 10
        while sockets.counters().get("disconnects.second", 0) < 1:
            assert time.monotonic() < deadline, sockets.counters()
            await asyncio.sleep(0.05)
        again.close(linger=0)
    finally:
        sockets.close()
        ctx.destroy(linger=0)


async def test_the_disconnect_monitor_waits_without_waking_and_is_woken_for_a_new_socket_and_for_close(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The monitor thread waits on its sockets without a timeout (it woke ten times a second, forever, in every process
    with a watched socket): idle, it does not wake; a socket watched while it waits is still counted; `close` ends it."""
    waits: list[object] = []
    poll = zmq.Poller.poll

    def counted(self: zmq.Poller, timeout: int | None = None) -> list[tuple[object, int]]:
        waits.append(timeout)
        return poll(self, timeout)

    monkeypatch.setattr(zmq.Poller, "poll", counted)

    before = set(monitors())
    ctx = zmq.asyncio.Context()
    sockets = SocketFactory(ctx, SocketOptions(monitor_disconnects=True))
    try:
        first = sockets.router("tcp://127.0.0.1:*")
        sockets.watch(first, "first")
        (thread,) = [t for t in monitors() if t not in before]
        await asyncio.sleep(0.05)
        n = len(waits)
        await asyncio.sleep(0.5)  # idle, waiting on `first` alone
        assert len(waits) == n, f"the idle monitor thread woke {len(waits) - n} times in 0.5 s"
        second = sockets.router("tcp://127.0.0.1:*")
        sockets.watch(second, "second")  # the waiting thread is woken to take it
        endpoint = second.getsockopt(zmq.LAST_ENDPOINT).decode()
        peer = SocketFactory(ctx).dealer(endpoint, identity=b"p")
        await peer.send_multipart([b"x"])
        await second.recv_multipart()
        peer.close(linger=0)
        deadline = time.monotonic() + 10
        while sockets.counters().get("disconnects.second", 0) < 1:
            assert time.monotonic() < deadline, sockets.counters()
            await asyncio.sleep(0.05)
        t0 = time.monotonic()
        sockets.close()  # first and second still open: the thread waits on them, and close wakes it
        assert not thread.is_alive() and time.monotonic() - t0 < 1.0
        first.close(linger=0)
        second.close(linger=0)
    finally:
        sockets.close()
        ctx.destroy(linger=0)
