"""Rogue peers fuzz the live broker (worker and client ports), a publisher and a relay.

10,000 seeded inputs in all (the decode function alone has its own 20,000 in
tests/unit/protocol/test_codec.py); a well-behaved peer is answered every
500 inputs and at the end, and every service is still running. Long mode:
``ROLLPOOL_FUZZ_INPUTS=1000000 pytest tests/integration/chaos/test_fuzz_live.py``
(with ``-o timeout=0``).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
import zmq.asyncio

from rollpool.broker import Broker, BrokerConfig
from rollpool.chaos.fuzz import fuzz_socket
from rollpool.protocol import (
    ClientHello,
    Hello,
    Manifest,
    ManifestRequest,
    SocketFactory,
    StatusReply,
    StatusRequest,
    Welcome,
    decode,
    encode,
)

pytestmark = pytest.mark.chaos

INPUTS = int(os.environ.get("ROLLPOOL_FUZZ_INPUTS", "10000"))


class Prober:
    """A well-behaved peer: one request, one matching answer."""

    def __init__(self, sockets: SocketFactory, endpoint: str, identity: bytes) -> None:
        self.sock = sockets.dealer(endpoint, identity=identity)

    async def ask(self, msg: Any, expect: type) -> bool:
        await self.sock.send_multipart(encode(msg))
        while True:
            reply = decode(await asyncio.wait_for(self.sock.recv_multipart(), 5))
            if isinstance(reply, expect):
                return True

    def close(self) -> None:
        self.sock.close(linger=0)


async def test_live_services_survive_fuzzing_and_keep_serving() -> None:
    from rollpool.weights import WeightPublisher
    from rollpool.weights.relay import Relay

    ctx = zmq.asyncio.Context()
    sockets = SocketFactory(ctx)
    broker = Broker(BrokerConfig(worker_endpoint="tcp://127.0.0.1:*", client_endpoint="tcp://127.0.0.1:*",
                                 heartbeat_interval_s=0.2), sockets)
    broker_task = asyncio.create_task(broker.run())
    publisher = WeightPublisher(sockets, router_endpoint="tcp://127.0.0.1:*", pub_endpoint="tcp://127.0.0.1:*")
    await publisher.start()
    await publisher.publish({}, 1)
    relay = Relay(sockets, upstream_router=publisher.router_endpoint, upstream_pub=publisher.pub_endpoint,
                  router_endpoint="tcp://127.0.0.1:*", pub_endpoint="tcp://127.0.0.1:*", fetch_timeout_s=2.0)
    relay_task = asyncio.create_task(relay.run())
    probers: list[Prober] = []
    try:
        await asyncio.wait_for(broker.ready.wait(), 5)
        for _ in range(200):  # the relay binds in run()
            if "*" not in str(getattr(relay, "router_endpoint", "*")):
                break
            await asyncio.sleep(0.02)

        client = Prober(sockets, broker.client_endpoint, b"good-client")
        worker = Prober(sockets, broker.worker_endpoint, b"good-worker")
        pub_probe = Prober(sockets, publisher.router_endpoint, b"good-sub")
        relay_probe = Prober(sockets, relay.router_endpoint, b"good-sub2")
        probers += [client, worker, pub_probe, relay_probe]
        from rollpool.protocol import ClientWelcome

        assert await client.ask(ClientHello(client_id="good", protocol_min=1, protocol_max=1), ClientWelcome)

        hello = Hello(worker_id="good", protocol_min=1, protocol_max=1, engine="sim", capacity=1, credits=0)
        targets = [
            ("broker:client", broker.client_endpoint, lambda: client.ask(StatusRequest(request_id="s"), StatusReply)),
            ("broker:worker", broker.worker_endpoint, lambda: worker.ask(hello, Welcome)),
            ("publisher", publisher.router_endpoint, lambda: pub_probe.ask(ManifestRequest(request_id="m"), Manifest)),
            ("relay", relay.router_endpoint, lambda: relay_probe.ask(ManifestRequest(request_id="m"), Manifest)),
        ]
        reports = []
        for i, (name, ep, probe) in enumerate(targets):
            share = INPUTS // len(targets) + (INPUTS % len(targets) if i == 0 else 0)
            reports.append(await fuzz_socket(sockets, ep, name, share, probe, seed=i, probe_every=500))
        total = sum(r.inputs for r in reports)
        print({r.target: (r.inputs, r.replies, f"{r.probes_ok}/{r.probes}") for r in reports}, "total", total)
        assert total >= INPUTS
        for r in reports:
            assert r.probe_failures == [], (r.target, r.probe_failures[:3])
            assert r.probes_ok == r.probes > 0
        assert not broker_task.done() and not relay_task.done()
        assert broker.protocol_errors > 0  # the fuzz reached the decoder and was answered, not ignored
    finally:
        for p in probers:
            p.close()
        relay.stop()
        broker.stop()
        await asyncio.wait_for(relay_task, 10)
        await asyncio.wait_for(broker_task, 10)
        await publisher.close()
        sockets.close()
        ctx.destroy(linger=0)


async def test_broker_process_under_hostile_fuzzing_keeps_serving_with_bounded_memory(tmp_path: Any) -> None:
    """10,000 inputs (4 MiB header bombs, unknown-field floods, long-poll floods among them) to a broker process.

    A good client is answered every 250 inputs, a good worker heartbeats every
    50 ms throughout and is never declared dead (broker heartbeat 0.5 s: dead after 1.5 s), and the broker's peak memory
    (VmHWM) is reported and bounded.
    """
    import json

    from rollpool.chaos.fuzz import fuzz_broker_process

    out = await fuzz_broker_process(INPUTS, seed=11, probe_every=250, workdir=str(tmp_path))
    print(json.dumps(out, indent=1, sort_keys=True))
    assert out["total_inputs"] >= INPUTS and out["broker_alive"]
    assert out["probes_ok"] == out["probes"] > 0, out["reports"]
    assert out["good_worker_alive"] and out["workers_lost"] == 0
    hostile = {k: sum(r["hostile"][k] for r in out["reports"].values()) for k in ("bomb", "unknown_fields", "long_pull")}
    assert all(hostile.values()), hostile
    assert out["refusals"].get("refused.limit.max_header_objects", 0) >= 1
    assert out["refusals"].get("refused.limit.max_unknown_fields", 0) >= 1
    assert out["rss_peak_kib"] < 200 * 1024, f"broker peak RSS {out['rss_peak_kib'] / 1024:.0f} MiB"
