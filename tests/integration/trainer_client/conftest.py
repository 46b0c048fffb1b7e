"""Fixtures for client tests.

`pool_factory`: real processes, a broker (restartable on the same endpoints) and sim workers, for the
`SyncTrainerClient` and `RolloutPool` tests. `inproc_pool`: a real `Broker` on real ipc sockets in the
test's own event loop, scripted workers (`tests/integration/broker/peers.py`) and asyncio `TrainerClient`s,
for tests that need to see both ends (what the broker holds, what a worker was sent).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from rollpool.broker import Broker, BrokerConfig
from rollpool.protocol import SocketFactory
from rollpool.trainer_client import TrainerClient, TrainerClientConfig
from tests.integration.broker.peers import FakeWorker


@dataclass
class Pool:
    dir: str
    worker_ep: str
    client_ep: str
    broker_args: list[str] = field(default_factory=list)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def _start(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(os.path.join(self.dir, f"{name}.log"), "ab")  # the child owns it
        proc = subprocess.Popen([sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def start_broker(self) -> None:
        self._start("broker", ["rollpool.broker", "--worker-endpoint", self.worker_ep, "--client-endpoint", self.client_ep,
                               "--heartbeat-interval-s", "0.2", "--log-level", "INFO", *self.broker_args])

    def kill_broker(self) -> None:
        proc = self.procs["broker"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def start_sim_workers(self, count: int = 4, options: str = "decode_s_per_token=0.0005,length_median=8,capacity=16") -> None:
        self._start("workers", ["rollpool.workers", "--broker", self.worker_ep, "--engine", "sim", "--count", str(count),
                                "--worker-id", "sim", "--heartbeat-interval-s", "0.2", "--engine-options", options,
                                "--log-level", "INFO"])

    def start_hf_worker(self, model: str, worker_id: str = "hf0") -> None:
        self._start(worker_id, ["rollpool.workers", "--broker", self.worker_ep, "--engine", "hf", "--model", model,
                                "--worker-id", worker_id, "--heartbeat-interval-s", "0.2", "--log-level", "INFO"])

    def stop(self) -> None:
        # workers first (they say goodbye to a live broker), then the broker
        for name in sorted(self.procs, key=lambda n: n == "broker"):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)

    def logs(self) -> str:
        out = []
        for name in self.procs:
            path = os.path.join(self.dir, f"{name}.log")
            if os.path.exists(path):
                out.append(f"--- {name}\n" + open(path).read()[-3000:])
        return "\n".join(out)


@pytest.fixture
def pool_factory() -> Iterator[object]:
    pools: list[Pool] = []

    def make(broker_args: list[str] | None = None) -> Pool:
        d = tempfile.mkdtemp(prefix="rp-tc-", dir="/tmp")
        p = Pool(dir=d, worker_ep=f"ipc://{d}/w", client_ep=f"ipc://{d}/c", broker_args=broker_args or [])
        pools.append(p)
        return p

    yield make
    for p in pools:
        p.stop()
        shutil.rmtree(p.dir, ignore_errors=True)


class InprocPool:
    """One in-process broker on fixed ipc endpoints (so it can be restarted as a new epoch), its peers."""

    def __init__(self, sockets: SocketFactory, worker_ep: str, client_ep: str) -> None:
        self.sockets = sockets
        self.worker_ep = worker_ep
        self.client_ep = client_ep
        self.broker: Broker | None = None
        self._task: asyncio.Task[None] | None = None
        self.workers: list[FakeWorker] = []
        self.clients: list[TrainerClient] = []

    async def start_broker(self, **overrides: Any) -> Broker:
        config = BrokerConfig(**{"heartbeat_interval_s": 0.05, "missed_heartbeats": 3, "drain_timeout_s": 0.0,
                                 "worker_endpoint": self.worker_ep, "client_endpoint": self.client_ep, **overrides})
        self.broker = Broker(config, self.sockets)
        self._task = asyncio.create_task(self.broker.run(), name="broker.run")
        await asyncio.wait_for(self.broker.ready.wait(), 5)
        return self.broker

    async def stop_broker(self) -> None:
        if self.broker is not None and self._task is not None:
            self.broker.stop()
            await asyncio.wait_for(self._task, 10)
        self.broker = self._task = None

    async def worker(self, worker_id: str = "w", kind: type[FakeWorker] = FakeWorker, **kw: Any) -> FakeWorker:
        w = kind(self.sockets, self.worker_ep, worker_id, **kw)
        self.workers.append(w)
        return await w.start()

    async def client(self, **config: Any) -> TrainerClient:
        cfg = TrainerClientConfig(**{"broker": self.client_ep, "request_timeout_s": 2.0, "request_retries": 5,
                                     "pull_wait_s": 0.1, **config})
        c = TrainerClient(config=cfg, sockets=self.sockets)
        self.clients.append(c)
        await c.connect()
        return c

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not predicate():
            if loop.time() > deadline:
                raise TimeoutError("condition not met")
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        for c in self.clients:
            await c.close()
        for w in self.workers:
            await w.close()
        await self.stop_broker()


@pytest.fixture
async def inproc_pool(zmq_ctx: Any, ipc_endpoint: Callable[[str], str]) -> AsyncIterator[InprocPool]:
    pool = InprocPool(SocketFactory(zmq_ctx), ipc_endpoint("w"), ipc_endpoint("c"))
    await pool.start_broker()
    yield pool
    await pool.close()
