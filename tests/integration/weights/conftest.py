"""Fixtures for the weight channel: a socket factory and factories of publishers, subscribers and relays that close what they make."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

pytest.importorskip("torch")

from rollpool.protocol.sockets import SocketFactory
from rollpool.weights.memory import SHM_DIR
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


# --------------------------------------------------------------------------- the delta tests


@pytest.fixture(params=["network", "shm"])
def sub_path(request: pytest.FixtureRequest) -> str:
    if request.param == "shm" and not os.path.isdir(SHM_DIR):
        pytest.skip("no /dev/shm")
    return str(request.param)


@pytest.fixture
def deltas_made_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Deltas on, made "on the device" (`rollpool.weights.delta_device` on CPU tensors, the GPU budget raised to hold the
    base); a module asks for it with ``pytest.mark.usefixtures``."""
    from rollpool.weights import delta_device, publisher

    monkeypatch.setenv("ROLLPOOL_WEIGHT_DELTA", "1")
    monkeypatch.setattr(delta_device, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(publisher, "gpu_budget_bytes", lambda _cfg, _bucket_bytes: 1 << 34)
