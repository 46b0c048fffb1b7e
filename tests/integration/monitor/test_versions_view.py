"""Version convergence and fleet activation on real parts: a broker (real sockets, fleet activation) switches two
workers to a new version together; its convergence record and fleet round reach a real Redis through its metrics sink
(the broker hash and a `version_converged` event), and `rollpool top`'s frame and the exporter's text show them."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from rollpool import protocol as p
from rollpool.broker import Broker, BrokerConfig
from rollpool.monitor.prometheus import render_prometheus
from rollpool.monitor.reader import PoolReader
from rollpool.monitor.terminal import render_frame
from rollpool.protocol import SocketFactory
from tests.integration.broker.peers import FakeClient
from tests.integration.broker.test_broker_wire import RawWorker
from tests.integration.monitor.test_reconcile_view import _Harness
from tests.unit.monitor.promtext import parse_prometheus, sample_value

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


async def test_top_and_the_exporter_show_a_version_converging_under_fleet_activation(zmq_ctx: Any, make_sink: Any, redis_server: str,
                                                                                      pool: str) -> None:
    sink = make_sink(series_interval_s=0.0)
    sockets = SocketFactory(zmq_ctx)
    cfg = BrokerConfig(worker_endpoint="tcp://127.0.0.1:*", client_endpoint="tcp://127.0.0.1:*", heartbeat_interval_s=0.2,
                       drain_timeout_s=0.0, activation="fleet")
    broker = Broker(cfg, sockets, sink)
    run = asyncio.create_task(broker.run())
    await asyncio.wait_for(broker.ready.wait(), 5)
    c = await FakeClient(sockets, broker.client_endpoint).start()
    ws = [RawWorker(_Harness(broker, sockets), f"v{i}", minor=p.PROTOCOL_MINOR, capacity=2) for i in range(2)]  # type: ignore[arg-type]
    try:
        for w in ws:
            await w.hello()
        await c.set_version(1)
        for w in ws:  # staged: both ask, and both are granted together
            await w.send(p.ApplyRequest(version=1))
        for w in ws:
            assert (await w.recv(p.ApplyGrant)).version == 1
        for w in ws:
            await w.send(p.ApplyDone(version=1, ok=True, duration_s=0.01))
        with PoolReader(redis_server, pool) as reader:
            deadline = time.monotonic() + 10
            state = reader.snapshot()
            while not (state.broker and state.broker.get("convergence_last_version") == 1 and state.broker.get("fleet_version") == 1):
                assert time.monotonic() < deadline, state.broker
                await asyncio.sleep(0.1)
                state = reader.snapshot()
        b = state.broker
        assert b is not None and b["versions_converged"] == 1 and b["convergence_slowest_worker"] in ("v0", "v1")
        assert b["versions"]["fleet_rounds"][0]["switched"] == 2 and b["fleet_activations"] == 1
        assert any(ev.kind == "version_converged" and ev.fields.get("version") == 1 for ev in state.events)
        frame = render_frame(state, width=100)
        assert "VERSIONS" in frame and "last v1 in" in frame and "fleet v1  activations 1" in frame
        fams = parse_prometheus(render_prometheus(state))
        assert sample_value(fams, "rollpool_versions_converged_total") == 1
        assert sample_value(fams, "rollpool_fleet_version") == 1
    finally:
        for w in ws:
            w.close()
        await c.close()
        broker.stop()
        await asyncio.wait_for(run, 10)
