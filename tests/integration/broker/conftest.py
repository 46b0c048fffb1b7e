"""Fixtures: a running broker on real sockets (ipc or tcp loopback) and scripted peers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from rollpool.broker import Broker, BrokerConfig
from rollpool.protocol import MemoryMetricsSink, SocketFactory
from tests.integration.broker.peers import FakeClient, FakeWorker

FAST = {"heartbeat_interval_s": 0.05, "missed_heartbeats": 3, "drain_timeout_s": 0.0}


class Harness:
    """One broker, plus the peers a test makes (all closed at teardown)."""

    def __init__(self, broker: Broker, sockets: SocketFactory, metrics: MemoryMetricsSink) -> None:
        self.broker = broker
        self.sockets = sockets
        self.metrics = metrics
        self.peers: list[Any] = []

    async def worker(self, worker_id: str, **kw: Any) -> FakeWorker:
        kw.setdefault("heartbeat_interval_s", self.broker.config.heartbeat_interval_s)
        w = FakeWorker(self.sockets, self.broker.worker_endpoint, worker_id, **kw)
        self.peers.append(w)
        return await w.start()

    async def client(self, client_id: str = "trainer", hello: bool = True) -> FakeClient:
        c = FakeClient(self.sockets, self.broker.client_endpoint, client_id)
        self.peers.append(c)
        return await c.start(hello=hello)

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not predicate():
            if loop.time() > deadline:
                raise TimeoutError("condition not met")
            await asyncio.sleep(0.01)


@pytest.fixture(params=["ipc", "tcp"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def start_broker(
    zmq_ctx: Any, ipc_endpoint: Callable[[str], str], transport: str
) -> AsyncIterator[Callable[..., Awaitable[Harness]]]:
    running: list[tuple[Broker, asyncio.Task[None], Harness]] = []
    sockets = SocketFactory(zmq_ctx)

    async def start(**overrides: Any) -> Harness:
        if transport == "ipc":
            endpoints = {"worker_endpoint": ipc_endpoint("w"), "client_endpoint": ipc_endpoint("c")}
        else:
            endpoints = {"worker_endpoint": "tcp://127.0.0.1:*", "client_endpoint": "tcp://127.0.0.1:*"}
        config = BrokerConfig(**{**FAST, **endpoints, **overrides})
        metrics = MemoryMetricsSink()
        broker = Broker(config, sockets, metrics)
        task = asyncio.create_task(broker.run(), name="broker.run")
        await asyncio.wait_for(broker.ready.wait(), 5)
        h = Harness(broker, sockets, metrics)
        running.append((broker, task, h))
        return h

    yield start
    for broker, task, h in running:
        for peer in h.peers:
            await peer.close()
        broker.stop()
        await asyncio.wait_for(task, 10)
