"""`rollpool top` shows refusals by role end to end (CURVE roles and limits, as an operator sees them).

A real broker with CURVE roles (keys from `rollpool keys gen`, the broker host's files only) publishing
to a real Redis; an intruder holding only a worker host's files dials the client port. `rollpool top
--once` must list the refusal under REFUSALS, by role and socket. (What workers refuse to send, by
limit, is shown by tests/integration/workers/test_worker_oversize.py.)
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import zmq.asyncio

from rollpool.broker import Broker, BrokerConfig
from rollpool.cli import build_parser
from rollpool.cli.keys import generate
from rollpool.monitor.sink import RedisMetricsSink
from rollpool.protocol import SecurityConfig, SocketFactory, encode
from rollpool.protocol import messages as m
from rollpool.protocol.roles import HOST_FILES

pytestmark = pytest.mark.redis


def _host_dir(pool: Path, host: str, dest: Path) -> Path:
    """Only what `rollpool keys gen` says to ship to `host`."""
    dest.mkdir(parents=True)
    for item in HOST_FILES[host]:
        if item.endswith("/"):
            shutil.copytree(pool / item, dest / item)
        else:
            shutil.copy(pool / item, dest / item)
    return dest


async def test_top_lists_a_worker_key_refused_on_the_client_port(redis_server: str, pool: str, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    generate(str(tmp_path / "keys"))
    sink = RedisMetricsSink(redis_server, pool, flush_interval_s=0.05)
    broker_ctx, intruder_ctx = zmq.asyncio.Context(), zmq.asyncio.Context()
    broker_sockets = SocketFactory(broker_ctx, security=SecurityConfig.from_dir(str(_host_dir(tmp_path / "keys", "broker", tmp_path / "b"))))
    broker = Broker(BrokerConfig(worker_endpoint="tcp://127.0.0.1:*", client_endpoint="tcp://127.0.0.1:*", heartbeat_interval_s=0.1,
                                 drain_timeout_s=0.0, pool=pool), broker_sockets, metrics=sink)
    task = asyncio.create_task(broker.run())
    intruder = SocketFactory(intruder_ctx, security=SecurityConfig.from_dir(str(_host_dir(tmp_path / "keys", "worker", tmp_path / "w"))))
    try:
        await asyncio.wait_for(broker.ready.wait(), 5)
        sock = intruder.dealer(broker.client_endpoint, identity=b"intruder")
        await sock.send_multipart(encode(m.StatusRequest(request_id="s")))
        for _ in range(200):
            if broker.counters().get("refused.role.worker@broker.client"):
                break
            await asyncio.sleep(0.05)
        sock.close(linger=0)
        await asyncio.sleep(0.3)  # a broker heartbeat publishes its counters
        assert sink.flush()
        args = build_parser().parse_args(["top", "--once", "--redis-url", redis_server, "--pool", pool])
        assert int(await asyncio.to_thread(args._run, args)) == 0
        frame = capsys.readouterr().out
        row = next((line for line in frame.splitlines() if line.strip().startswith("by role")), None)
        assert row is not None and "worker@broker.client" in row, frame
    finally:
        broker.stop()
        await asyncio.wait_for(task, 10)
        intruder.close()
        broker_sockets.close()
        intruder_ctx.destroy(linger=0)
        broker_ctx.destroy(linger=0)
        sink.close()
