"""Parked manifest requests (protocol minor `PARKED_MINOR`): the shared-memory path staged to the engine's device
waits for the publisher's GPU checksums (`BucketInfo.host_mix64`) with one request per new checksum, parked by the
server until the checksum exists, instead of asking again every 2 ms.

CPU-runnable: the device edge is `FakeDevice` (test_shm_device.py), and the publisher's GPU checksums are held back by
`HeldMix64` (a fake of the timing between the publisher's snapshot and its server) so a test decides when each one
appears. Faults on the live connection (an answer dropped, an answer late) come from `ManifestProxy`, a real ZeroMQ
proxy between the subscriber and the publisher's ROUTER.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import msgpack
import pytest

torch = pytest.importorskip("torch")

from rollpool.protocol import PARKED_MINOR, PROTOCOL_MINOR, decode, encode  # noqa: E402
from rollpool.protocol.messages import Error, Manifest, ManifestRequest  # noqa: E402
from rollpool.weights.memory import SHM_DIR  # noqa: E402
from rollpool.weights.serving import WeightServer  # noqa: E402

from .manifest_proxy import ManifestProxy  # noqa: E402
from .test_shm_device import model, same, staging  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")


class HeldMix64:
    """Fake of the publisher's GPU-checksum timing: each bucket's mix64, as its snapshot hands it to the server, is held
    until `release` (the bytes are in the segment already; only the manifest's checksum waits)."""

    def __init__(self, server: WeightServer) -> None:
        self.server = server
        self.real = server.set_host_mix64
        self.held: list[tuple[int, int, str]] = []
        server.set_host_mix64 = self.hold  # type: ignore[method-assign]

    def hold(self, version: int, bucket: int, checksum: str) -> None:
        self.held.append((version, bucket, checksum))

    def release(self, n: int | None = None) -> None:
        out, self.held = (self.held, []) if n is None else (self.held[:n], self.held[n:])
        for args in out:
            self.real(*args)

    def stop(self) -> None:
        """Release what is held and hold nothing more."""
        self.release()
        self.server.set_host_mix64 = self.real  # type: ignore[method-assign]


async def until(cond: Any, what: str) -> None:
    for _ in range(1000):  # a bound on the wait, not a timing assertion
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never: {what}")


def parked(proxy: ManifestProxy) -> list[ManifestRequest]:
    return [r for r in proxy.requests if isinstance(r, ManifestRequest) and r.after_mix64 >= 0]


async def held_version(pub: Any, seed: int) -> tuple[dict[str, torch.Tensor], HeldMix64, int]:
    """Publish version 1 with every GPU checksum held back (its xxh3 checksums come as usual)."""
    held = HeldMix64(pub._server)
    w = model(seed)
    manifest = await pub.publish(w, 1)
    n = len(manifest.buckets)
    await until(lambda: len(held.held) == n and pub._server.versions[1].complete, "every bucket copied and checksummed")
    return w, held, n


@pytest.fixture
async def proxies(zmq_ctx: Any) -> Any:
    made: list[ManifestProxy] = []

    async def make(backend: str, **kw: Any) -> ManifestProxy:
        made.append(await ManifestProxy(zmq_ctx, backend, **kw).start())
        return made[-1]

    yield make
    for p in made:
        await p.close()


async def test_a_parked_request_is_answered_when_the_next_gpu_checksum_appears(make_publisher: Any, make_subscriber: Any,
                                                                              proxies: Any) -> None:
    pub = await make_publisher(pool="tpark1", publisher_id="pubpark1")
    w, held, n = await held_version(pub, 11)
    proxy = await proxies(pub.router_endpoint)
    sub = staging(make_subscriber, proxy.endpoint)
    fetch = asyncio.create_task(sub.fetch(1))
    served = pub._server.versions[1]
    for k in range(n):
        await until(lambda: bool(served.waiting_mix64), f"a request parked for checksum {k + 1}")
        assert not fetch.done()
        held.release(1)
    got = await fetch
    assert same(got.tensors, w) and sub.last_path == "shm" and sub.fallbacks == {}
    assert sub.device_stage_bytes == sum(b.nbytes for b in served.buckets)  # every bucket staged on the device path
    # one request per new checksum, each answered by the server once that checksum existed: no poll
    assert [r.after_mix64 for r in parked(proxy)] == list(range(n))
    assert pub._server.parked_manifests_served == n and not served.waiting_mix64


async def test_a_request_is_answered_at_once_when_the_version_already_has_more_or_none_will_come(make_publisher: Any,
                                                                                               make_subscriber: Any) -> None:
    pub = await make_publisher(pool="tpark2", publisher_id="pubpark2")
    manifest = await pub.publish(model(12), 1, wait_ready=True)
    sub = staging(make_subscriber, pub.router_endpoint)
    got = await sub.fetch_manifest(1, after_mix64=0, attempts=1)
    assert got.protocol_minor == PROTOCOL_MINOR and all(b.host_mix64 for b in got.buckets)
    got = await sub.fetch_manifest(1, after_mix64=len(manifest.buckets), attempts=1)  # no more will come: at once
    assert got.version == 1
    net = await make_publisher(pool="tpark3", publisher_id="pubpark3", path="network")  # no segments: no GPU checksums
    await net.publish(model(13), 1, wait_ready=True)
    other = make_subscriber(net.router_endpoint)
    got = await other.fetch_manifest(1, after_mix64=0, attempts=1)
    assert got.version == 1 and not any(b.host_mix64 for b in got.buckets)
    assert pub._server.parked_manifests_served == 0 and net._server.parked_manifests_served == 0


async def test_gpu_checksums_that_never_come_fall_back_to_the_cpu_copy_and_lose_nothing(make_publisher: Any,
                                                                                     make_subscriber: Any) -> None:
    pub = await make_publisher(pool="tpark4", publisher_id="pubpark4")
    w, held, _n = await held_version(pub, 14)
    sub = staging(make_subscriber, pub.router_endpoint, fetch_timeout_s=0.6, max_refetch=1)
    got = await sub.fetch(1)
    # the device path gave up after fetch_timeout_s (re-asking once its share of it passed) and the CPU copy of the
    # shared-memory path served the whole version, verified
    assert same(got.tensors, w) and sub.last_path == "shm" and sub.device_stage_bytes == 0
    assert sub.fallbacks == {"the publisher's GPU checksums did not come within 0.6 s": 1}
    held.stop()
    w2 = model(15)
    await pub.publish(w2, 2, wait_ready=True)  # the checksums come again: the device path serves the next version
    got = await sub.fetch(2)
    assert same(got.tensors, w2) and sub.device_stage_bytes > 0 and sum(sub.fallbacks.values()) == 1


async def test_an_evicted_version_answers_a_parked_request_gone(make_publisher: Any, make_subscriber: Any) -> None:
    from rollpool.weights.paths.base import WeightVersionGoneError

    pub = await make_publisher(pool="tpark5", publisher_id="pubpark5")
    _w, held, _n = await held_version(pub, 16)
    sub = staging(make_subscriber, pub.router_endpoint)
    ask = asyncio.create_task(sub.fetch_manifest(1, after_mix64=0, attempts=1))
    await until(lambda: bool(pub._server.versions[1].waiting_mix64), "the request parked")
    pub._server.drop_version(1)
    with pytest.raises(WeightVersionGoneError):
        await ask
    held.release()


@pytest.mark.parametrize("fault", ["dropped", "late"])
async def test_a_parked_answer_lost_or_late_on_a_live_connection_is_asked_again(make_publisher: Any, make_subscriber: Any,
                                                                                proxies: Any, fault: str) -> None:
    pub = await make_publisher(pool=f"tpark6{fault}", publisher_id=f"pubpark6{fault}")
    w, held, n = await held_version(pub, 17)
    first: list[str] = []

    def down(frames: list[bytes], msg: Any) -> tuple[list[bytes], float] | None:
        if isinstance(msg, Manifest) and not first and msg.request_id in {r.request_id for r in parked(proxy)}:
            first.append(msg.request_id)  # the first parked answer: lost, or held past the subscriber's try
            return None if fault == "dropped" else (frames, 1.0)
        return frames, 0.0

    proxy = await proxies(pub.router_endpoint, down=down)
    # a try lasts fetch_timeout_s / (max_refetch + 1) = 0.5 s; the whole wait for GPU checksums 2 s
    sub = staging(make_subscriber, proxy.endpoint, fetch_timeout_s=2.0, max_refetch=3)
    fetch = asyncio.create_task(sub.fetch(1))
    await until(lambda: bool(pub._server.versions[1].waiting_mix64), "the first request parked")
    held.release(1)  # answered by the server; the answer is dropped (or late) on the way
    await until(lambda: len(parked(proxy)) >= 2, "the request asked again")
    held.release()
    got = await fetch
    assert same(got.tensors, w) and sub.last_path == "shm" and sub.fallbacks == {}
    assert sub.device_stage_bytes == sum(b.nbytes for b in pub._server.versions[1].buckets)
    asks = [r.after_mix64 for r in parked(proxy)]
    assert asks[:2] == [0, 0] and len(asks) <= n + 1  # the lost one asked again, once


async def test_a_server_of_the_previous_minor_is_asked_again_as_before(make_publisher: Any, make_subscriber: Any,
                                                                        proxies: Any) -> None:
    """The subscriber against a publisher of `PARKED_MINOR - 1` (emulated on the wire by the proxy: requests reach it
    without `after_mix64`, which it would ignore, and its manifests say no `protocol_minor`): it polls as before."""
    pub = await make_publisher(pool="tpark7", publisher_id="pubpark7")
    w, held, _n = await held_version(pub, 18)

    def older(frames: list[bytes], drop: str) -> list[bytes]:
        header = msgpack.unpackb(frames[0])
        header[1] = PARKED_MINOR - 1
        header[3].pop(drop, None)
        return [msgpack.packb(header), *frames[1:]]

    proxy = await proxies(pub.router_endpoint, up=lambda f, m: (older(f, "after_mix64"), 0.0),
                          down=lambda f, m: (older(f, "protocol_minor"), 0.0))
    held.release(1)  # one GPU checksum there: an old subscriber falls back when every xxh3 exists and none is
    sub = staging(make_subscriber, proxy.endpoint)
    fetch = asyncio.create_task(sub.fetch(1))
    await until(lambda: len(proxy.requests) > 3, "the manifest asked for again while its checksums are pending (the poll)")
    held.release()
    got = await fetch
    assert same(got.tensors, w) and sub.last_path == "shm" and sub.fallbacks == {}
    assert sub.device_stage_bytes == sum(b.nbytes for b in pub._server.versions[1].buckets)
    assert parked(proxy) == [] and pub._server.parked_manifests_served == 0  # never parked: the old server would not


async def test_a_subscriber_of_the_previous_minor_is_answered_at_once(make_publisher: Any, zmq_ctx: Any) -> None:
    import zmq

    pub = await make_publisher(pool="tpark8", publisher_id="pubpark8")
    _w, held, _n = await held_version(pub, 19)
    frames = encode(ManifestRequest(request_id="old", version=1, streamed=True, host_key="h"))
    header = msgpack.unpackb(frames[0])
    header[1] = PARKED_MINOR - 1
    dealer = zmq_ctx.socket(zmq.DEALER)  # a raw peer of the minor before: it never names after_mix64
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.router_endpoint)
    try:
        await dealer.send_multipart([msgpack.packb(header), *frames[1:]])
        reply = decode(await asyncio.wait_for(dealer.recv_multipart(), 5))
    finally:
        dealer.close(linger=0)
    assert isinstance(reply, Manifest) and not isinstance(reply, Error)
    assert reply.version == 1 and not any(b.host_mix64 for b in reply.buckets)  # answered at once, checksums pending
    held.release()


async def test_a_server_with_no_room_to_park_answers_busy_and_the_cpu_copy_serves(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher(pool="tpark9", publisher_id="pubpark9")
    w, held, _n = await held_version(pub, 20)
    pub._server.max_parked = 0  # every parked request is refused: "busy"
    sub = staging(make_subscriber, pub.router_endpoint)
    got = await sub.fetch(1)
    assert same(got.tensors, w) and sub.last_path == "shm" and sub.device_stage_bytes == 0
    [(reason, count)] = sub.fallbacks.items()
    assert count == 1 and reason.startswith("the publisher refused to park the manifest request") and "busy" in reason
    held.release()
