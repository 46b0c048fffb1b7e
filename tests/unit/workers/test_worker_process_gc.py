"""`rollpool worker` freezes its start-up heap out of the garbage collector once its engines are up (a full
collection of it came due around the first weight version and held the event loop for 118 ms on the H200)."""

from __future__ import annotations

import asyncio
import gc
import socket

import pytest
import zmq.asyncio

pytest.importorskip("torch")  # a worker imports its weight subscriber (torch) before its engine starts

from rollpool.cli.worker import _Workers
from rollpool.protocol.metrics import NullMetricsSink
from rollpool.protocol.sockets import SocketFactory
from rollpool.workers.config import WorkerConfig


def _unused_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def unfrozen() -> object:
    gc.unfreeze()  # whatever an earlier test in this process froze
    yield
    gc.unfreeze()


async def test_a_worker_process_freezes_its_start_up_heap_once_every_engine_is_up(unfrozen: object) -> None:
    ctx = zmq.asyncio.Context()
    config = WorkerConfig(broker=_unused_endpoint(), engine="sim", count=2, worker_id="gc",
                          send_timeout_s=0.2)  # no broker: the engines start anyway (and the goodbye gives up soon)
    workers = _Workers(config, SocketFactory(ctx), NullMetricsSink())
    before = gc.get_freeze_count()
    run = asyncio.create_task(workers.run())
    try:
        async with asyncio.timeout(20):
            while gc.get_freeze_count() == before:  # noqa: ASYNC110 - the collector has no event to wait on
                await asyncio.sleep(0.01)
        assert all(w.started.is_set() for w in workers.workers)
        assert gc.get_freeze_count() > 1000  # the interpreter, numpy, pyzmq, the engine: not a handful
    finally:
        workers.stop()
        await asyncio.wait_for(run, 30)
        ctx.destroy(linger=0)
