"""The weight-publish channel over real ZeroMQ sockets (tcp and ipc loopback).

Each test asserts what a worker relies on: a version arrives whole and
verified or not at all; late joiners catch up; every wait ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
zmq = pytest.importorskip("zmq")

from rollpool.protocol import decode, encode  # noqa: E402
from rollpool.protocol.errors import WeightSyncError  # noqa: E402
from rollpool.protocol.messages import Announce, Error, Fetch, Manifest, ManifestRequest  # noqa: E402
from rollpool.weights import WeightVersionGoneError  # noqa: E402


def model(seed: int, n: int = 6) -> dict[str, torch.Tensor]:
    """About 0.6 MiB in mixed dtypes: several buckets and many chunks at the test sizes."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for i in range(n):
        out[f"layers.{i}.w"] = torch.randn(128, 256, generator=g).to(torch.bfloat16)
        out[f"layers.{i}.norm"] = torch.randn(256, generator=g)
    out["step"] = torch.tensor(seed, dtype=torch.int64)
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t), k


class FaultySource:
    """Test shim around a bucket source: flips one byte of the first `flips` reads, runs `on_read` hooks."""

    def __init__(self, inner: Any, flips: int = 0, on_read: Callable[[int], None] | None = None) -> None:
        self.inner, self.flips, self.on_read, self.reads = inner, flips, on_read, 0

    def read(self, offset: int, nbytes: int) -> Any:
        self.reads += 1
        if self.on_read is not None:
            self.on_read(self.reads)
        data = self.inner.read(offset, nbytes)
        if data is not None and self.flips > 0:
            self.flips -= 1
            data = bytearray(data)
            data[len(data) // 2] ^= 0x40
            data = bytes(data)
        return data


class LoopHook:
    """A `FaultySource` hook's action: `start()` (a coroutine) begun once on the test's loop, from whichever thread
    reads (the ROUTER reads on the loop, the bulk lane in its connection threads); `done()` awaits it."""

    def __init__(self, start: Callable[[], Any]) -> None:
        self.loop, self.start, self.fired = asyncio.get_running_loop(), start, False
        self.tasks: list[asyncio.Future[Any]] = []

    def fire(self) -> None:
        if not self.fired:
            self.fired = True
            self.loop.call_soon_threadsafe(lambda: self.tasks.append(asyncio.ensure_future(self.start())))

    async def done(self) -> None:
        while self.fired and not self.tasks:  # noqa: ASYNC110 - fired from another thread: the task comes next turn
            await asyncio.sleep(0)
        await asyncio.gather(*self.tasks)


def wrap_sources(pub: Any, version: int, **kw: Any) -> list[FaultySource]:
    served = pub._server.versions[version]
    served.sources = [FaultySource(s, **kw) for s in served.sources]
    return served.sources  # type: ignore[no-any-return]


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
async def test_publish_then_fetch_round_trips(transport: str, make_publisher: Any, make_subscriber: Any, ipc_endpoint: Any) -> None:
    if transport == "tcp":
        pub = await make_publisher(router_endpoint="tcp://127.0.0.1:*", pub_endpoint="tcp://127.0.0.1:*")
        assert pub.router_endpoint.startswith("tcp://127.0.0.1:") and not pub.router_endpoint.endswith("*")
    else:
        pub = await make_publisher(router_endpoint=ipc_endpoint("r"), pub_endpoint=ipc_endpoint("p"))
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint)
    w = model(1)
    manifest = await pub.publish(w, 1)
    assert len(manifest.buckets) > 2
    assert await sub.wait_for_newer(0, timeout_s=5) == 1
    got = await sub.fetch()
    assert got.version == 1 and got.manifest.version == 1
    assert_same(got.tensors, w)
    # the tensors are views of the received buckets
    ptrs = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in got.buffers]
    assert all(any(lo <= t.data_ptr() < hi for lo, hi in ptrs) for t in got.tensors.values() if t.numel())


async def test_training_may_change_its_tensors_after_publish(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher()
    w = model(2)
    want = {k: v.clone() for k, v in w.items()}
    await pub.publish(w, 1)
    for t in w.values():
        t.zero_()
    sub = make_subscriber(pub.router_endpoint)
    assert_same((await sub.fetch(1)).tensors, want)


async def test_recycled_buffers_are_reused_for_the_next_version(make_publisher: Any, make_subscriber: Any) -> None:
    from rollpool.weights.config import WeightPathConfig

    pub = await make_publisher()
    # without deltas; with them the version just fetched is the next delta's base and its buffer is reused one version
    # later (tests/integration/weights/test_delta.py)
    sub = make_subscriber(pub.router_endpoint, weights=WeightPathConfig(weight_delta=False))
    await pub.publish(model(1), 1)
    first = await sub.fetch(1)
    ptrs = sorted(b.data_ptr() for b in first.buffers)
    sub.recycle(first)
    await pub.publish(model(2), 2)
    second = await sub.fetch(2)
    assert sorted(b.data_ptr() for b in second.buffers) == ptrs
    assert_same(second.tensors, model(2))


async def test_late_joiner_catches_up_without_hearing_an_announce(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher(keep_versions=2)
    for v in (1, 2, 3):
        await pub.publish(model(v), v)
    assert pub.versions == [2, 3]
    sub = make_subscriber(pub.router_endpoint, None)  # no SUB socket: announcements cannot reach it
    assert await sub.wait_for_newer(-1, timeout_s=5) == 3
    got = await sub.fetch()
    assert got.version == 3
    assert_same(got.tensors, model(3))


async def test_note_version_from_a_heartbeat_makes_the_subscriber_ask(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher()
    sub = make_subscriber(pub.router_endpoint, None)
    await asyncio.sleep(0.1)  # the catch-up on connect finds nothing yet
    assert sub.latest_known() == -1
    await pub.publish(model(4), 4)
    with pytest.raises(WeightSyncError):
        await sub.wait_for_newer(-1, timeout_s=0.3)  # nothing tells it
    sub.note_version(4)  # a broker heartbeat names version 4
    assert await sub.wait_for_newer(-1, timeout_s=5) == 4


async def test_a_version_learnt_by_asking_is_fetched_with_one_manifest_request(make_publisher: Any, make_subscriber: Any) -> None:
    """The catch-up request's manifest (on connect, or a heartbeat naming a newer version) is the one the fetch uses."""
    pub = await make_publisher()
    asked: list[int | None] = []
    hello = pub._server.on_manifest_request
    assert hello is not None

    def counting(req: Any) -> None:
        asked.append(req.version)
        hello(req)

    pub._server.on_manifest_request = counting
    await pub.publish(model(5), 5)
    sub = make_subscriber(pub.router_endpoint, None)
    assert await sub.wait_for_newer(-1, timeout_s=5) == 5
    assert_same((await sub.fetch(5)).tensors, model(5))
    assert asked == [None]  # the catch-up's, and no second one for the same version
    await pub.publish(model(6), 6)
    sub.note_version(6)
    assert await sub.wait_for_newer(5, timeout_s=5) == 6
    assert_same((await sub.fetch()).tensors, model(6))
    assert asked == [None, None]


async def test_zero_byte_versions(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher()
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint)
    with pytest.raises(WeightSyncError, match="no weight version"):
        await sub.fetch()
    manifest = await pub.publish({}, 7)
    assert manifest.buckets == ()
    got = await sub.fetch()
    assert got.version == 7 and got.tensors == {} and got.total_bytes == 0


async def test_versions_must_increase(make_publisher: Any) -> None:
    pub = await make_publisher()
    await pub.publish({}, 3)
    with pytest.raises(ValueError, match="not newer"):
        await pub.publish({}, 3)


@pytest.mark.parametrize("algorithm", ["xxh3_64", "crc32"])
async def test_a_corrupt_chunk_is_detected_and_refetched(algorithm: str, make_publisher: Any, make_subscriber: Any) -> None:
    """Both checksum algorithms catch it: xxh3_64 (the default) and crc32 (older publishers, no xxhash)."""
    pub = await make_publisher(checksum_algorithm=algorithm)
    w = model(5)
    manifest = await pub.publish(w, 1)
    assert all(b.checksum.startswith(algorithm + ":") for b in manifest.buckets)
    wrap_sources(pub, 1, flips=1)  # every bucket's first chunk arrives with a flipped bit
    sub = make_subscriber(pub.router_endpoint, max_refetch=2)
    got = await sub.fetch(1)
    assert_same(got.tensors, w)
    assert sub.buckets_refetched == len(got.manifest.buckets)


class ResizingSource:
    """Test shim: the first `bad` reads answer a chunk of the wrong size (alternately too long and too short)."""

    def __init__(self, inner: Any, bad: int) -> None:
        self.inner, self.bad, self.reads = inner, bad, 0

    def read(self, offset: int, nbytes: int) -> Any:
        self.reads += 1
        data = self.inner.read(offset, nbytes)
        if data is None or self.bad <= 0:
            return data
        self.bad -= 1
        if self.bad % 2:
            return bytes(data) + b"\xff" * 8  # the right bytes, then garbage past the chunk's end
        return bytes(data)[:-1]


async def test_a_reply_of_the_wrong_size_never_lands_and_is_fetched_again(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher()
    w = model(8)
    await pub.publish(w, 1)
    served = pub._server.versions[1]
    served.sources = [ResizingSource(s, bad=2) for s in served.sources]
    sub = make_subscriber(pub.router_endpoint, max_refetch=2)
    got = await sub.fetch(1)
    assert_same(got.tensors, w)  # bit-exact: no stray byte of a wrong-size reply stayed in a bucket
    assert sub.buckets_refetched == 0  # caught per chunk, before the bucket's checksum
    assert all(s.bad == 0 for s in served.sources)


async def test_pin_memory_is_ignored_without_cuda(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher()
    await pub.publish(model(9), 1)
    sub = make_subscriber(pub.router_endpoint, pin_memory=True)
    got = await sub.fetch(1)
    assert_same(got.tensors, model(9))
    assert sub.pin_memory == torch.cuda.is_available()
    assert all(b.is_pinned() == torch.cuda.is_available() for b in got.buffers)


async def test_a_bucket_that_never_verifies_is_never_returned(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher()
    await pub.publish(model(6), 1)
    sources = wrap_sources(pub, 1)
    sources[1].flips = 10**9  # bucket 1 is always corrupt
    sub = make_subscriber(pub.router_endpoint, max_refetch=2)
    with pytest.raises(WeightSyncError, match="bucket 1 failed its checksum 3 times"):
        await sub.fetch(1)
    assert sub.buckets_refetched == 3


async def test_eviction_mid_fetch(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher(keep_versions=1)
    await pub.publish(model(1), 1)
    evict = LoopHook(lambda: pub.publish(model(2), 2))
    wrap_sources(pub, 1, on_read=lambda n: n == 3 and evict.fire())  # type: ignore[func-returns-value]
    sub = make_subscriber(pub.router_endpoint, window_chunks=1)
    with pytest.raises(WeightVersionGoneError, match="version 1 is gone") as info:
        await sub.fetch(1)  # that version by number: a clear error
    assert isinstance(info.value, WeightSyncError) and info.value.version == 1
    await evict.done()

    # asking for the latest moves on to the newer version instead
    evict = LoopHook(lambda: pub.publish(model(3), 3))
    wrap_sources(pub, 2, on_read=lambda n: n == 3 and evict.fire())  # type: ignore[func-returns-value]
    got = await sub.fetch()
    await evict.done()
    assert got.version == 3
    assert_same(got.tensors, model(3))


async def test_publisher_dies_mid_transfer_then_returns(make_publisher: Any, make_subscriber: Any, tcp_endpoint: Any) -> None:
    router, announce = tcp_endpoint(), tcp_endpoint()
    pub = await make_publisher(router_endpoint=router, pub_endpoint=announce)
    await pub.publish(model(1), 1)
    closing = LoopHook(pub.close)
    wrap_sources(pub, 1, on_read=lambda n: n == 2 and closing.fire())  # type: ignore[func-returns-value]
    sub = make_subscriber(router, announce, fetch_timeout_s=0.3, max_refetch=1)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(WeightSyncError, match="no reply"):
        await sub.fetch(1)
    assert loop.time() - t0 < 5
    await closing.done()

    pub2 = await make_publisher(router_endpoint=router, pub_endpoint=announce)
    await pub2.publish(model(1), 1)
    sub.fetch_timeout_s = 2.0
    got = await sub.fetch(1)
    assert_same(got.tensors, model(1))


async def test_keep_versions_zero_serves_the_callers_tensors(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher(keep_versions=0, release_idle_s=5.0)
    w = model(9)
    w["layers.0.w"] = w["layers.0.w"].t()  # non-contiguous: copied once, still served
    subs = [make_subscriber(pub.router_endpoint, pub.pub_endpoint) for _ in range(2)]
    publishing = asyncio.ensure_future(pub.publish(w, 1, expected_fetchers=2))
    await subs[0].wait_for_newer(0, timeout_s=5)
    got = await asyncio.gather(*(s.fetch(1) for s in subs))
    for g in got:
        assert_same(g.tensors, w)
    manifest = await asyncio.wait_for(publishing, 5)  # released once both fetched everything
    assert manifest.version == 1
    late = make_subscriber(pub.router_endpoint)
    assert (await late.fetch_manifest()).version == 1  # the number is still known...
    with pytest.raises(WeightVersionGoneError):
        await late.fetch(1)  # ...but the bytes went back to the trainer


async def test_malformed_frames_get_an_error_and_the_publisher_keeps_serving(make_publisher: Any, make_subscriber: Any, sockets: Any) -> None:
    pub = await make_publisher()
    await pub.publish(model(1), 1)
    rogue = sockets.dealer(pub.router_endpoint, identity=b"rogue")
    try:
        bad_requests: list[list[bytes]] = [
            [b"\xc1not msgpack"],
            [b"\x94\x01\x00\xa5hello\x80"],  # [1, 0, "hello", {}]: not a weights request
            encode(Announce(version=1, publisher_id="x", total_bytes=0, num_buckets=0)),
            encode(Fetch(request_id="r1", version=1, bucket=0, offset=0, nbytes=1 << 30)),
            encode(Fetch(request_id="r2", version=1, bucket=99, offset=0, nbytes=10)),
            encode(Fetch(request_id="r3", version=5, bucket=0, offset=0, nbytes=10)),
            encode(ManifestRequest(request_id="r4", version=0)),
        ]
        codes = []
        for frames in bad_requests:
            await rogue.send_multipart(frames)
            reply = decode(await asyncio.wait_for(rogue.recv_multipart(), 5))
            assert isinstance(reply, Error)
            codes.append(reply.code)
        # a type this socket does not serve is refused before its fields are read (the roles table: a peer cannot make
        # a socket parse a message it does not serve)
        assert codes == ["malformed", "unexpected_type", "unexpected_type", "bad_range", "bad_range", "unknown_version", "gone"]
        assert pub.stats["protocol_errors"] >= 3
        await rogue.send_multipart(encode(ManifestRequest(request_id="ok")))
        reply = decode(await asyncio.wait_for(rogue.recv_multipart(), 5))
        assert isinstance(reply, Manifest) and reply.version == 1
    finally:
        rogue.close(linger=0)
    sub = make_subscriber(pub.router_endpoint)
    assert_same((await sub.fetch()).tensors, model(1))


async def test_fetch_times_out_when_nobody_serves(make_subscriber: Any, tcp_endpoint: Any) -> None:
    sub = make_subscriber(tcp_endpoint(), fetch_timeout_s=0.2, max_refetch=1)
    with pytest.raises(WeightSyncError, match="no manifest"):
        await sub.fetch()


async def test_evicted_buffers_are_reused_but_never_under_a_chunk_in_flight(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher(keep_versions=2)
    await pub.publish(model(1), 1)
    await pub.publish(model(2), 2)
    old = pub._server.versions[1].sources
    held = old[0].read(0, 4096)  # a chunk of version 1 still queued for a slow peer
    held_bytes = bytes(held)
    await pub.publish(model(3), 3)  # evicts version 1
    new_ptrs = {s.data.data_ptr() for s in pub._server.versions[3].sources}
    assert old[0].data.data_ptr() not in new_ptrs  # in flight: not reused
    assert bytes(held) == held_bytes
    assert {s.data.data_ptr() for s in old[1:]} <= new_ptrs  # the others were reused
    sub = make_subscriber(pub.router_endpoint)
    assert_same((await sub.fetch(3)).tensors, model(3))
    assert_same((await sub.fetch(2)).tensors, model(2))
