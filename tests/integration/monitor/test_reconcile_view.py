"""Monitoring of the reconciliation on real parts: a broker (real sockets) repairs a lost task, re-sends an
unacknowledged batch, stalls and hears of a failed version; its counters and events reach a real Redis through its
metrics sink, and `rollpool top`'s frame and the Prometheus exporter's text show each of them."""

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
from tests.integration.broker.peers import FakeClient, make_group, make_prompt
from tests.integration.broker.test_broker_wire import RawWorker
from tests.unit.monitor.promtext import parse_prometheus, sample_value

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


class _Harness:
    """What `RawWorker` needs of the broker tests' harness."""

    def __init__(self, broker: Broker, sockets: SocketFactory) -> None:
        self.broker, self.sockets = broker, sockets


async def test_top_and_the_exporter_show_what_the_broker_reconciled(zmq_ctx: Any, make_sink: Any, redis_server: str, pool: str) -> None:
    sink = make_sink(series_interval_s=0.0)
    sockets = SocketFactory(zmq_ctx)
    cfg = BrokerConfig(worker_endpoint="tcp://127.0.0.1:*", client_endpoint="tcp://127.0.0.1:*", heartbeat_interval_s=0.2,
                       drain_timeout_s=0.0, result_resend_s=0.3)
    broker = Broker(cfg, sockets, sink)
    run = asyncio.create_task(broker.run())
    await asyncio.wait_for(broker.ready.wait(), 5)
    c = await FakeClient(sockets, broker.client_endpoint).start()
    w = RawWorker(_Harness(broker, sockets), "rec", minor=p.PROTOCOL_MINOR, capacity=2, features=(p.Feature.RECONCILE,))  # type: ignore[arg-type]
    try:
        welcome = await w.hello()
        await c.submit([make_prompt("q0"), make_prompt("q1")])
        t1, _lost = await w.recv(p.Task), await w.recv(p.Task)
        # task 2 lost on the wire: the heartbeat holds task 1 only, one sequence free -> reconciled, credit corrected
        await w.send(p.WorkerHeartbeat(worker_id="rec", epoch=welcome.epoch, dispatch_seq=2, free_capacity=1, held_count=1,
                                       inflight_task_ids=(t1.task_id,), held_full=True))
        again = await w.recv(p.Task)
        for t in (t1, again):
            await w.send(p.Result(task_id=t.task_id, prompt_id=t.prompt.prompt_id, trajectories=make_group(t, "rec")))
        await w.send(p.ApplyDone(version=7, ok=False, error="unknown parameter 'lm_head.extra'"))
        first = await c.pull(wait_s=2.0)  # pulled, never acknowledged: sent again after result_resend_s
        assert first.groups
        await asyncio.sleep(0.4)
        resent = await c.pull(wait_s=1.0)
        assert {g.prompt_id for g in resent.groups} & {g.prompt_id for g in first.groups}
        time.sleep(0.5)  # noqa: ASYNC251 - on purpose: the broker's loop stops reading (a stall, as a GC pause)
        await asyncio.sleep(0.6)  # its next state publication carries the counters

        with PoolReader(redis_server, pool) as reader:
            deadline = time.monotonic() + 10
            state = reader.snapshot()
            while not (state.broker and state.broker.get("broker_stalls") and state.broker.get("results_resent")):
                assert time.monotonic() < deadline, state.broker
                await asyncio.sleep(0.1)
                state = reader.snapshot()
        b = state.broker
        assert b is not None and b["leases_reconciled"] == 1 and b["credit_corrections"] >= 1 and b["versions_failed"] == 1

        frame = render_frame(state, width=100)
        assert "RECONCILIATION" in frame
        for text in (f"results re-sent {b['results_resent']}", "leases reconciled 1", f"credit corrections {b['credit_corrections']}",
                     f"broker stalls {b['broker_stalls']} (", "versions failed 1",
                     "last failed version 7 on rec: unknown parameter 'lm_head.extra'"):
            assert text in frame, (text, frame)
        assert all(len(line) <= 100 for line in frame.splitlines())

        fams = parse_prometheus(render_prometheus(state))
        assert fams["rollpool_leases_reconciled_total"]["type"] == "counter"
        assert sample_value(fams, "rollpool_leases_reconciled_total") == 1
        assert sample_value(fams, "rollpool_results_resent_total") == b["results_resent"] >= 1
        assert sample_value(fams, "rollpool_credit_corrections_total") == b["credit_corrections"]
        assert sample_value(fams, "rollpool_broker_stalls_total") == b["broker_stalls"] >= 1
        assert sample_value(fams, "rollpool_broker_stall_seconds_total") == pytest.approx(b["broker_stall_ms_total"] / 1000)
        assert sample_value(fams, "rollpool_broker_stall_max_seconds") >= 0.3
        assert sample_value(fams, "rollpool_versions_failed_total") == 1
    finally:
        w.close()
        await c.close()
        broker.stop()
        await asyncio.wait_for(run, 10)
        sockets.close()
