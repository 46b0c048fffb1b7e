"""Per-peer limits on a live broker: refused with an error that names the limit, counted, others served."""

from __future__ import annotations

from rollpool import protocol as p
from rollpool.broker.guard import PULLS_PER_PEER
from tests.integration.broker.conftest import Harness


async def test_a_pull_flood_from_one_peer_is_capped_and_answered(start_broker) -> None:  # type: ignore[no-untyped-def]
    """Break 3: one peer's long-polls used to queue without bound (and each timeout removed one in O(n))."""
    h: Harness = await start_broker()
    good = await h.client("good")
    rogue = h.sockets.dealer(h.broker.client_endpoint, identity=b"flood")
    n = 3_000
    try:
        for i in range(n):
            await rogue.send_multipart(p.encode(p.Pull(request_id=f"f{i}", max_groups=1, wait_s=30.0)))
        refused = 0
        while refused < n - PULLS_PER_PEER:
            assert await rogue.poll(5000), f"only {refused} of {n - PULLS_PER_PEER} excess pulls were answered"
            msg = p.decode(await rogue.recv_multipart())
            if isinstance(msg, p.Error) and msg.code == "limit":
                assert "pulls_per_peer" in msg.message and msg.request_id
                refused += 1
        status = await good.status()  # the broker kept serving the well-behaved client
        assert status.counters["pending_pulls"] <= PULLS_PER_PEER
        assert status.counters["refused.limit.pulls_per_peer"] == n - PULLS_PER_PEER
    finally:
        rogue.close(linger=0)


async def test_a_hello_cannot_make_the_broker_adopt_more_than_its_capacity(start_broker) -> None:  # type: ignore[no-untyped-def]
    """Re-announced tasks are adopted up to the worker's capacity; duplicates and the excess are refused."""
    h: Harness = await start_broker()
    sock = h.sockets.dealer(h.broker.worker_endpoint, identity=b"greedy")
    inflight = tuple(p.InflightTask(task_id=f"t{i}", prompt_id=f"p{i % 5000}", group_size=1) for i in range(10_000))
    try:
        await sock.send_multipart(p.encode(p.Hello(worker_id="greedy", protocol_min=1, protocol_max=1, engine="sim",
                                                   capacity=4, credits=0, inflight=inflight)))
        assert await sock.poll(5000)
        welcome = p.decode(await sock.recv_multipart())
        assert isinstance(welcome, p.Welcome)
        assert len(welcome.adopted) == 4 and len(welcome.refused) == 10_000 - 4
        assert len(h.broker.state.groups) == 4
        assert h.broker.counters()["refused.limit.inflight_per_hello"] == 1
    finally:
        sock.close(linger=0)
