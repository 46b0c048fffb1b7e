"""CURVE through the socket factory: the right keys talk, no key or an unknown key is refused.

Refusal is silent by ZeroMQ's design (the handshake never completes, so no
message is delivered either way): the test asserts that a request gets no
answer while a well-keyed client on the same broker is served.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from rollpool.broker import Broker, BrokerConfig
from rollpool.cli.keys import generate
from rollpool.protocol import ClientHello, ClientWelcome, SecurityConfig, SocketFactory, decode, encode
from rollpool.protocol.sockets import SERVER_PUBLIC_FILE

TRAINER_SECRET_FILE = "trainer.key_secret"

pytestmark = pytest.mark.chaos


def _hello(client_id: str) -> list[bytes]:
    return encode(ClientHello(client_id=client_id, protocol_min=1, protocol_max=1))


async def _ask(ctx: zmq.asyncio.Context, security: SecurityConfig | None, endpoint: str, timeout_s: float) -> Any:
    factory = SocketFactory(ctx, security=security)
    sock = factory.dealer(endpoint, identity=os.urandom(6))
    try:
        await sock.send_multipart(_hello("probe"))
        if await sock.poll(int(timeout_s * 1000)):
            return decode(await sock.recv_multipart())
        return None
    finally:
        sock.close(linger=0)


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    generate(str(tmp_path / "pool"))
    generate(str(tmp_path / "rogue"))  # a valid key pair the pool has never allowed
    return tmp_path


async def test_broker_refuses_missing_and_unknown_keys(keys: Path) -> None:
    server_ctx = zmq.asyncio.Context()
    client_ctx = zmq.asyncio.Context()
    sockets = SocketFactory(server_ctx, security=SecurityConfig.from_dir(str(keys / "pool")))
    broker = Broker(BrokerConfig(worker_endpoint="tcp://127.0.0.1:*", client_endpoint="tcp://127.0.0.1:*"), sockets)
    task = asyncio.create_task(broker.run())
    try:
        await asyncio.wait_for(broker.ready.wait(), 5)
        ep = broker.client_endpoint
        good = SecurityConfig.from_dir(str(keys / "pool"), role="trainer")
        assert isinstance(await _ask(client_ctx, good, ep, 5.0), ClientWelcome)

        assert await _ask(client_ctx, None, ep, 1.0) is None  # plaintext client: refused
        unknown = SecurityConfig(
            client_key_file=str(keys / "rogue" / TRAINER_SECRET_FILE),
            server_public_file=str(keys / "pool" / SERVER_PUBLIC_FILE),
        )
        assert await _ask(client_ctx, unknown, ep, 1.0) is None  # valid key, not allowed: refused
        wrong_server = SecurityConfig(
            client_key_file=str(keys / "pool" / TRAINER_SECRET_FILE),
            server_public_file=str(keys / "rogue" / SERVER_PUBLIC_FILE),
        )
        assert await _ask(client_ctx, wrong_server, ep, 1.0) is None  # pinned the wrong server: no session

        # the broker kept serving the allowed client throughout
        assert isinstance(await _ask(client_ctx, good, ep, 5.0), ClientWelcome)
        assert broker.protocol_errors == 0
    finally:
        broker.stop()
        await asyncio.wait_for(task, 10)
        sockets.close()
        server_ctx.destroy(linger=0)
        client_ctx.destroy(linger=0)


async def test_weights_over_curve_publisher_and_relay(keys: Path) -> None:
    """A subscriber with the pool's keys fetches through a CURVE relay; one without keys gets nothing."""
    from rollpool.protocol import WeightSyncError
    from rollpool.weights import WeightPublisher, WeightSubscriber
    from rollpool.weights.relay import Relay

    torch = pytest.importorskip("torch")
    pub_ctx, relay_ctx, sub_ctx, plain_ctx = (zmq.asyncio.Context() for _ in range(4))
    pub_sockets = SocketFactory(pub_ctx, security=SecurityConfig.from_dir(str(keys / "pool"), role="trainer"))
    relay_sockets = SocketFactory(relay_ctx, security=SecurityConfig.from_dir(str(keys / "pool"), role="relay"))
    sec = SecurityConfig.from_dir(str(keys / "pool"), role="worker")
    publisher = WeightPublisher(pub_sockets, router_endpoint="tcp://127.0.0.1:*", pub_endpoint="tcp://127.0.0.1:*",
                                chunk_bytes=1 << 20)
    await publisher.start()
    relay = Relay(relay_sockets, upstream_router=publisher.router_endpoint, upstream_pub=publisher.pub_endpoint,
                  router_endpoint="tcp://127.0.0.1:*", pub_endpoint="tcp://127.0.0.1:*", fetch_timeout_s=5.0)
    relay_task = asyncio.create_task(relay.run())
    subs: list[Any] = []
    try:
        tensors = {"w": torch.arange(1 << 20, dtype=torch.float32)}
        await publisher.publish(tensors, 1)
        await asyncio.wait_for(_relay_ready(relay), 10)
        good = WeightSubscriber(SocketFactory(sub_ctx, security=sec), worker_id="good", fetch_timeout_s=5.0, max_refetch=1)
        subs.append(good)
        good.connect(relay.router_endpoint, relay.pub_endpoint)
        assert await good.wait_for_newer(0, timeout_s=20) == 1
        wv = await asyncio.wait_for(good.fetch(1), 30)
        assert torch.equal(wv.tensors["w"], tensors["w"])
        # no bulk lane under CURVE (its plain TCP would bypass the encryption): every byte came over the ROUTER
        assert publisher._server.bulk is None and relay._server.bulk is None
        assert wv.manifest.bulk_port == 0 and good.bulk_bytes == 0 and good.bytes_received == wv.total_bytes

        plain = WeightSubscriber(SocketFactory(plain_ctx), worker_id="plain", fetch_timeout_s=0.5, max_refetch=1)
        subs.append(plain)
        plain.connect(relay.router_endpoint, relay.pub_endpoint)
        with pytest.raises(WeightSyncError):
            await asyncio.wait_for(plain.fetch(1), 30)
        plain_direct = WeightSubscriber(SocketFactory(plain_ctx), worker_id="plain2", fetch_timeout_s=0.5, max_refetch=1)
        subs.append(plain_direct)
        plain_direct.connect(publisher.router_endpoint, publisher.pub_endpoint)
        with pytest.raises(WeightSyncError):
            await asyncio.wait_for(plain_direct.fetch(1), 30)
    finally:
        for s in subs:
            await s.aclose()
        relay.stop()
        await asyncio.wait_for(relay_task, 10)
        await publisher.close()
        pub_sockets.close()
        relay_sockets.close()
        for c in (pub_ctx, relay_ctx, sub_ctx, plain_ctx):
            c.destroy(linger=0)


async def _relay_ready(relay: Any) -> None:
    while not getattr(relay, "router_endpoint", None) or "*" in str(relay.router_endpoint):  # noqa: ASYNC110 (the relay has no ready event)
        await asyncio.sleep(0.02)
