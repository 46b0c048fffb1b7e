"""A small pool on tcp loopback for the issue-20 reproductions: a real broker, real workers, real clients.

`Pool` makes what a test needs and closes all of it at teardown: an in-process
`Broker` (or a broker child process, for SIGSTOP), real `Worker`s on the sim
engine (or a named fake engine at the edge), `TrainerClient`s, raw scripted
peers from `tests/integration/broker/peers.py`, weight publishers, and a
`FaultyZmtpProxy` in front of any endpoint.

`config(cls, **kw)` builds a config from only the fields `cls` has: the tests
name the settings a fix is expected to add (for example the apply slot
deadline) so they pass once the fix lands, and still run today.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import pytest

from rollpool.broker import Broker, BrokerConfig
from rollpool.chaos.zmtp_proxy import FaultyZmtpProxy
from rollpool.protocol import SocketFactory
from rollpool.trainer_client.client import TrainerClient, TrainerClientConfig
from rollpool.workers.config import WorkerConfig
from rollpool.workers.engines.sim import SimEngine
from rollpool.workers.worker import Worker
from tests.integration.broker.peers import FakeClient, FakeWorker

T = TypeVar("T")

HB = 0.1


def config(cls: type[T], **kw: Any) -> T:
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in kw.items() if k in names})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_until(pred: Callable[[], bool], timeout_s: float, step_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        await asyncio.sleep(step_s)
    return pred()


def sim_engine(**kw: Any) -> SimEngine:
    opts: dict[str, Any] = dict(decode_s_per_token=0.002, length="fixed", length_median=4, capacity=4, vocab=300)
    opts.update(kw)
    return SimEngine(**opts)


class BrokerProcess:
    """``python -m rollpool.cli broker`` as a child, so that it can be stopped with SIGSTOP."""

    def __init__(self, args: list[str], log_path: str) -> None:
        self.worker_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.client_endpoint = f"tcp://127.0.0.1:{free_port()}"
        argv = [sys.executable, "-m", "rollpool.cli", "--log-level", "WARNING", "broker", "--worker-endpoint", self.worker_endpoint,
                "--client-endpoint", self.client_endpoint, *args]
        self.log_path = log_path
        with open(log_path, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait(5)


class Pool:
    def __init__(self, ctx: Any, tmp_path: Any) -> None:
        self.sockets = SocketFactory(ctx)
        self.tmp_path = tmp_path
        self.broker: Broker | None = None
        self._broker_task: asyncio.Task[None] | None = None
        self._closers: list[Callable[[], Any]] = []

    async def start_broker(self, **kw: Any) -> Broker:
        kw.setdefault("heartbeat_interval_s", HB)
        kw.setdefault("drain_timeout_s", 0.0)
        cfg = config(BrokerConfig, worker_endpoint="tcp://127.0.0.1:*", client_endpoint="tcp://127.0.0.1:*", **kw)
        self.broker = Broker(cfg, self.sockets)
        self._broker_task = asyncio.create_task(self.broker.run(), name="broker.run")
        await asyncio.wait_for(self.broker.ready.wait(), 5)
        return self.broker

    def broker_process(self, *args: str) -> BrokerProcess:
        bp = BrokerProcess(list(args), str(self.tmp_path / "broker.log"))
        self._closers.append(bp.stop)
        return bp

    async def proxy(self, name: str, upstream: str, seed: int = 0) -> FaultyZmtpProxy:
        px = await FaultyZmtpProxy(name, upstream, seed=seed).start()
        self._closers.append(px.close)
        return px

    async def worker(self, endpoint: str, worker_id: str, engine_factory: Callable[[], Any] | None = None,
                     subscriber_factory: Any = None, **kw: Any) -> Worker:
        opts: dict[str, Any] = dict(broker=endpoint, worker_id=worker_id, heartbeat_interval_s=HB, reconnect_backoff_s=0.1,
                                    reconnect_backoff_max_s=0.5, restart_backoff_s=0.05, restart_backoff_max_s=0.2,
                                    drain_timeout_s=0.2, send_timeout_s=1.0, fetch_timeout_s=2.0)
        opts.update(kw)
        w = Worker(config(WorkerConfig, **opts), self.sockets, engine_factory=engine_factory or sim_engine,
                   subscriber_factory=subscriber_factory)
        task = asyncio.create_task(w.run(), name=f"worker.{worker_id}")

        async def close() -> None:
            w.stop()
            try:
                await asyncio.wait_for(task, 5)
            except Exception:  # noqa: BLE001 - teardown: a hung worker is cancelled
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

        self._closers.append(close)
        return w

    async def fake_worker(self, endpoint: str, worker_id: str, **kw: Any) -> FakeWorker:
        kw.setdefault("heartbeat_interval_s", HB)
        fw = FakeWorker(self.sockets, endpoint, worker_id, **kw)
        self._closers.append(fw.close)
        return await fw.start()

    async def fake_client(self, endpoint: str, client_id: str = "trainer") -> FakeClient:
        fc = FakeClient(self.sockets, endpoint, client_id)
        self._closers.append(fc.close)
        return await fc.start()

    async def client(self, endpoint: str, **kw: Any) -> TrainerClient:
        opts: dict[str, Any] = dict(broker=endpoint, request_timeout_s=0.5, request_retries=5, pull_wait_s=0.5)
        opts.update(kw)
        c = TrainerClient(config=config(TrainerClientConfig, **opts), sockets=self.sockets)
        self._closers.append(lambda: asyncio.wait_for(c.close(), 5))
        await c.connect()
        return c

    async def publisher(self) -> Any:
        from rollpool.weights import WeightPublisher

        pub = WeightPublisher(self.sockets, router_endpoint="tcp://127.0.0.1:*", pub_endpoint="tcp://127.0.0.1:*")
        await pub.start()
        self._closers.append(pub.close)
        return pub

    async def close(self) -> None:
        for close in reversed(self._closers):
            with contextlib.suppress(Exception):
                result = close()
                if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                    await result
        if self.broker is not None and self._broker_task is not None:
            self.broker.stop()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._broker_task, 10)
        self.sockets.close()


@pytest.fixture
async def pool(zmq_ctx: Any, tmp_path: Any) -> AsyncIterator[Pool]:
    p = Pool(zmq_ctx, tmp_path)
    try:
        yield p
    finally:
        await p.close()
