"""A worker's Result over the broker's MAXMSGSIZE (the worker's side of oversize messages).

A real in-process broker whose sockets accept at most 32 KiB per message part (it says so in its
Welcome), a real `Worker` on the sim engine, a real `TrainerClient`, tcp loopback. libzmq drops a part
over MAXMSGSIZE together with the connection and reports nothing: before the fix the worker sent the
result, the broker's libzmq dropped it, and the group waited for its lease to expire (then again on the
next attempt), with nothing logged. Now the worker refuses to send it, logs and counts the refusal by
limit, and fails the task with an error naming the limit: the trainer gets the group FAILED with that
reason, and the worker keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq.asyncio

from rollpool import protocol as p
from rollpool.broker import Broker, BrokerConfig
from rollpool.protocol import SocketFactory
from rollpool.protocol.sockets import SocketOptions
from rollpool.trainer_client import TrainerClient, TrainerClientConfig
from rollpool.workers.config import WorkerConfig
from rollpool.workers.engines.sim import SimEngine
from rollpool.workers.worker import Worker

LIMIT = 32 * 1024
HB = 0.1


@pytest.fixture
async def small_broker() -> AsyncIterator[Broker]:
    ctx = zmq.asyncio.Context()
    sockets = SocketFactory(ctx, SocketOptions(max_msg_bytes=LIMIT))
    b = Broker(BrokerConfig(worker_endpoint="tcp://127.0.0.1:*", client_endpoint="tcp://127.0.0.1:*", heartbeat_interval_s=HB,
                            task_timeout_s=3.0, max_attempts=2, drain_timeout_s=0.0), sockets)
    task = asyncio.create_task(b.run())
    await asyncio.wait_for(b.ready.wait(), 5)
    try:
        yield b
    finally:
        b.stop()
        await asyncio.wait_for(task, 10)
        sockets.close()
        ctx.destroy(linger=0)


async def test_a_result_over_the_brokers_limit_is_refused_by_the_worker_and_fails_the_task_naming_it(
    small_broker: Broker, zmq_ctx: Any, caplog: pytest.LogCaptureFixture
) -> None:
    sockets = SocketFactory(zmq_ctx)  # the worker's and the client's sockets keep the default 64 MiB
    cfg = WorkerConfig(broker=small_broker.worker_endpoint, worker_id="w0", heartbeat_interval_s=HB, reconnect_backoff_s=0.1,
                       reconnect_backoff_max_s=0.5, drain_timeout_s=0.2, send_timeout_s=1.0)
    worker = Worker(cfg, sockets, engine_factory=lambda: SimEngine(decode_s_per_token=1e-6, length="fixed", length_median=12_000,
                                                                     capacity=8, vocab=300))
    run = asyncio.create_task(worker.run())
    client = TrainerClient(config=TrainerClientConfig(broker=small_broker.client_endpoint, request_timeout_s=1.0, pull_wait_s=0.2),
                           sockets=sockets)
    try:
        await client.connect()
        # 12,000 output tokens: the output_ids part alone is 48,000 bytes, over the broker's 32 KiB
        big = p.Prompt(prompt_id="big", text="x", group_size=1, sampling=p.SamplingParams(max_new_tokens=12_000))
        small = p.Prompt(prompt_id="small", text="y", group_size=1, sampling=p.SamplingParams(max_new_tokens=8))
        with caplog.at_level(logging.WARNING):
            await client.submit([big])
            for _ in range(200):
                if small_broker.counters()["failed"]:
                    break
                await asyncio.sleep(0.05)
        # the worker kept its connection and serves the next prompt; the failed group comes beside it
        await client.submit([small])
        batch = await client.get_batch(1, timeout=10)
        assert [g.prompt_id for g in batch.groups] == ["small"]
        assert [g.prompt_id for g in batch.other] == ["big"], small_broker.counters()
        failed = batch.other[0]
        assert failed.prompt_id == "big" and failed.state == p.GroupState.FAILED, failed
        assert f"max_msg_bytes of {LIMIT} bytes" in failed.reason and "result" in failed.reason, failed.reason
        assert failed.attempts <= 1  # failed at once, not after a lease timeout and a retry
        assert any(f"max_msg_bytes of {LIMIT} bytes" in r.getMessage() for r in caplog.records if r.name.startswith("rollpool.workers"))
        assert worker.link.refused == {"max_msg_bytes": 1}
        assert worker._state_fields("ready")["refused.limit.max_msg_bytes"] == 1  # published with the worker's state
        assert small_broker.counters()["workers_lost"] == 0
    finally:
        await client.close()
        worker.stop()
        await asyncio.wait_for(run, 10)


@pytest.mark.redis
async def test_rollpool_top_shows_the_workers_and_the_brokers_refusals_by_limit(
    redis_server: str, zmq_ctx: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    import uuid

    import msgpack

    from rollpool.cli import build_parser
    from rollpool.monitor.sink import RedisMetricsSink

    pool = "t" + uuid.uuid4().hex[:10]
    broker_sink = RedisMetricsSink(redis_server, pool, flush_interval_s=0.05)
    worker_sink = RedisMetricsSink(redis_server, pool, flush_interval_s=0.05)
    ctx = zmq.asyncio.Context()
    broker_sockets = SocketFactory(ctx, SocketOptions(max_msg_bytes=LIMIT))
    broker = Broker(BrokerConfig(worker_endpoint="tcp://127.0.0.1:*", client_endpoint="tcp://127.0.0.1:*", heartbeat_interval_s=HB,
                                 drain_timeout_s=0.0, pool=pool), broker_sockets, metrics=broker_sink)
    broker_task = asyncio.create_task(broker.run())
    await asyncio.wait_for(broker.ready.wait(), 5)
    sockets = SocketFactory(zmq_ctx)
    worker = Worker(WorkerConfig(broker=broker.worker_endpoint, worker_id="w0", heartbeat_interval_s=HB, drain_timeout_s=0.2, pool=pool),
                    sockets, metrics=worker_sink,
                    engine_factory=lambda: SimEngine(decode_s_per_token=1e-6, length="fixed", length_median=12_000, capacity=8, vocab=300))
    run = asyncio.create_task(worker.run())
    client = TrainerClient(config=TrainerClientConfig(broker=broker.client_endpoint, request_timeout_s=1.0, pull_wait_s=0.2), sockets=sockets)
    raw = sockets.dealer(broker.worker_endpoint, identity=b"raw")
    try:
        await client.connect()
        await client.submit([p.Prompt(prompt_id="big", text="x", sampling=p.SamplingParams(max_new_tokens=12_000))])
        # a client message on the worker port: the broker refuses it by its type (refused.limit.message_type)
        await raw.send_multipart([msgpack.packb([1, 0, "status_request", {"request_id": "r"}])])
        for _ in range(200):
            if worker.link.refused and broker.counters().get("refused.limit.message_type"):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(4 * HB)  # a heartbeat or two publishes both states
        assert broker_sink.flush() and worker_sink.flush()
        args = build_parser().parse_args(["top", "--once", "--redis-url", redis_server, "--pool", pool])
        assert int(await asyncio.to_thread(args._run, args)) == 0
        frame = capsys.readouterr().out
        assert "REFUSALS" in frame, frame
        workers_row = next(line for line in frame.splitlines() if "workers, by limit" in line)
        assert "max_msg_bytes 1" in workers_row, frame
        broker_row = next(line for line in frame.splitlines() if line.strip().startswith("by limit"))
        assert "message_type 1" in broker_row, frame
    finally:
        raw.close(linger=0)
        await client.close()
        worker.stop()
        await asyncio.wait_for(run, 10)
        broker.stop()
        await asyncio.wait_for(broker_task, 10)
        broker_sockets.close()
        ctx.destroy(linger=0)
        broker_sink.close()
        worker_sink.close()
