"""Fixtures for the weight channel: a socket factory and factories of publishers, subscribers and relays that close what they make."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

pytest.importorskip("torch")

from rollpool.protocol.sockets import SocketFactory
from rollpool.weights.publisher import WeightPublisher
from rollpool.weights.relay import Relay
from rollpool.weights.subscriber import WeightSubscriber


@pytest.fixture
def sockets(zmq_ctx: Any) -> SocketFactory:
    return SocketFactory(zmq_ctx)


@pytest.fixture
async def make_publisher(sockets: SocketFactory) -> AsyncIterator[Callable[..., Any]]:
    made: list[WeightPublisher] = []

    async def make(**kw: Any) -> WeightPublisher:
        kw.setdefault("bucket_bytes", 256 * 1024)
        kw.setdefault("chunk_bytes", 64 * 1024)
        kw.setdefault("announce_interval_s", 0.1)
        pub = WeightPublisher(sockets, **kw)
        await pub.start()
        made.append(pub)
        return pub

    yield make
    for pub in made:
        await pub.close()


@pytest.fixture
async def make_subscriber(sockets: SocketFactory) -> AsyncIterator[Callable[..., Any]]:
    made: list[WeightSubscriber] = []

    def make(router: str | None = None, pub: str | None = None, **kw: Any) -> WeightSubscriber:
        kw.setdefault("fetch_timeout_s", 2.0)
        kw.setdefault("window_chunks", 4)
        kw.setdefault("path", "network")  # the same-host tests (test_shm.py) ask for "auto"/"shm" themselves
        sub = WeightSubscriber(sockets, **kw)
        if router is not None:
            sub.connect(router, pub)
        made.append(sub)
        return sub

    yield make
    for sub in made:
        await sub.aclose()


@pytest.fixture
async def make_relay(sockets: SocketFactory) -> AsyncIterator[Callable[..., Any]]:
    import asyncio

    made: list[tuple[Relay, asyncio.Task[None]]] = []

    async def make(**kw: Any) -> Relay:
        kw.setdefault("announce_interval_s", 0.1)
        kw.setdefault("poll_interval_s", 0.2)
        kw.setdefault("fetch_timeout_s", 2.0)
        relay = Relay(sockets, **kw)
        await relay.start()
        made.append((relay, asyncio.create_task(relay.run())))
        return relay

    yield make
    for relay, task in made:
        relay.stop()
        await asyncio.wait_for(task, 5)
