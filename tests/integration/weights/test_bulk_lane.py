"""The network path's bulk lane (protocol minor 13): chunk bytes over plain TCP straight into the subscriber's buffer.

Real sockets on both sides; faults are made on the live lane (its connections reset mid-version, a lane that
accepts and never answers, garbage on the wire, a corrupted chunk) and each must end in a verified version or
a clear error, never a part of one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import socket
import struct
import time
from typing import Any

import pytest

from rollpool.protocol import WeightSyncError
from rollpool.weights import WeightVersionGoneError
from rollpool.weights.paths import lane_native
from rollpool.weights.paths.bulk import lane_host
from tests.integration.weights.test_channel import assert_same, model, wrap_sources

from .counters import settled

TCP = {"router_endpoint": "tcp://127.0.0.1:*", "pub_endpoint": "tcp://127.0.0.1:*"}


async def test_over_tcp_every_chunk_comes_over_the_bulk_lane_and_verifies(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher(**TCP)
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint, streams=2)
    w = model(1)
    manifest = await pub.publish(w, 1)
    assert len(manifest.buckets) > 2
    got = await sub.fetch(1)
    assert_same(got.tensors, w)
    assert got.manifest.bulk_port == pub._server.bulk.port > 0
    assert sub.bulk_bytes == sub.bytes_received == got.total_bytes  # no chunk over the ROUTER
    assert await settled(lambda: pub._server.bulk_bytes_served, got.total_bytes) == got.total_bytes and not sub.fallbacks
    # the publisher counts the lane's bytes for the subscriber as it counts the ROUTER's (keep_versions=0 releases on it)
    assert sum(pub._server.versions[1].served_by_peer.values()) == got.total_bytes


async def test_a_subscriber_that_does_not_take_the_lane_gets_the_same_version_over_the_router(make_publisher: Any, make_subscriber: Any) -> None:
    # as a subscriber of minor 12 (it does not know Manifest.bulk_port) or one with ROLLPOOL_WEIGHT_BULK=0
    pub = await make_publisher(**TCP)
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint, bulk=False)
    w = model(2)
    await pub.publish(w, 1)
    got = await sub.fetch(1)
    assert_same(got.tensors, w)
    assert sub.bulk_bytes == 0 and sub.bytes_received == got.total_bytes and pub._server.bulk_bytes_served == 0


async def test_no_lane_off_tcp_or_when_turned_off(make_publisher: Any, monkeypatch: pytest.MonkeyPatch, ipc_endpoint: Any) -> None:
    pub = await make_publisher(router_endpoint=ipc_endpoint("r"), pub_endpoint=ipc_endpoint("p"))
    assert pub._server.bulk is None and (await pub.publish(model(3), 1)).bulk_port == 0
    monkeypatch.setenv("ROLLPOOL_WEIGHT_BULK", "0")
    pub2 = await make_publisher(**TCP)
    assert pub2._server.bulk is None and (await pub2.publish(model(3), 1)).bulk_port == 0
    assert lane_host("tcp://10.1.2.3:6000") == "10.1.2.3" and lane_host("tcp://[::1]:6000") == "::1"
    assert lane_host("ipc:///tmp/x") is None and lane_host("tcp://*:6000") is None


async def test_a_corrupted_chunk_on_the_lane_is_refetched_and_never_applied(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher(**TCP)
    w = model(4)
    await pub.publish(w, 1)
    wrap_sources(pub, 1, flips=2)  # the first two reads of every bucket come out with a flipped byte
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint, max_refetch=3)
    got = await sub.fetch(1)
    assert_same(got.tensors, w)
    assert sub.buckets_refetched >= 2 and sub.bulk_bytes > got.total_bytes  # bad buckets came again, over the lane


async def test_a_cut_bucket_is_verified_whole_and_fetched_again_whole(make_publisher: Any, make_subscriber: Any) -> None:
    # (the cut is `stream_jobs`, tests/unit/weights/test_manifest.py) 3 streams, every bucket's first chunk corrupted once; cut buckets are fetched again whole
    pub = await make_publisher(**TCP)
    w = model(12)
    manifest = await pub.publish(w, 1)
    wrap_sources(pub, 1, flips=1)
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint, streams=3, max_refetch=2)
    got = await sub.fetch(1)
    assert_same(got.tensors, w)
    assert sub.buckets_refetched == len(manifest.buckets) and not sub.fallbacks
    assert pub._server.bulk.connections == 3


class _NotArrived:
    """A bucket source whose bytes have not arrived yet (a streamed or relayed version) until `arrive()`."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.arrived = inner, False

    def read(self, offset: int, nbytes: int) -> Any:
        return self.inner.read(offset, nbytes) if self.arrived else None


async def test_a_request_waits_for_its_bytes_by_the_clock_not_by_how_often_other_bytes_arrive(make_publisher: Any, make_subscriber: Any) -> None:
    """A lane request for bytes not yet there waits up to `wait_s`. Each arrival of other bytes wakes it (a relay
    wakes it at every chunk it receives); the wait was counted as 0.5 s per wake-up, so 60 arrivals within a
    second answered ``busy`` and sent the version over the ROUTER (a counted fallback) though the bytes came."""
    pub = await make_publisher(**TCP)
    w = model(6)
    manifest = await pub.publish(w, 1)
    lane = pub._server.bulk
    lane.wait_s = 3.0
    served = pub._server.versions[1]
    held = _NotArrived(served.sources[-1])
    served.sources[-1] = held
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint, streams=1)
    fetch = asyncio.create_task(sub.fetch(1))
    await asyncio.sleep(0.3)  # the last bucket's request is waiting on the lane now
    for _ in range(12):  # other bytes arrive: 12 wake-ups, 6 s by the old count, in about 0.25 s
        lane.notify()
        await asyncio.sleep(0.02)
    held.arrived = True
    pub._server.notify_arrived(1)
    got = await asyncio.wait_for(fetch, 10)
    assert_same(got.tensors, w)
    assert not sub.fallbacks, sub.fallbacks
    assert sub.bulk_bytes == sum(b.nbytes for b in manifest.buckets)


async def test_the_fetched_line_says_when_each_bucket_came_over_the_lane(make_publisher: Any, make_subscriber: Any,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """The ``weights fetched`` line of a lane fetch carries a per-bucket timeline (ms from the transfer's start to the
    bucket's first chunk and to it verified), so a slow version tells a bucket the publisher had not ready yet from a
    slow transfer: here the last bucket's bytes arrive 0.4 s late."""
    pub = await make_publisher(**TCP)
    w = model(6)
    manifest = await pub.publish(w, 1)
    served = pub._server.versions[1]
    held = _NotArrived(served.sources[-1])
    served.sources[-1] = held
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint, streams=1)
    caplog.set_level(logging.INFO, logger="rollpool.weights.subscriber")
    fetch = asyncio.create_task(sub.fetch(1))
    await asyncio.sleep(0.4)
    held.arrived = True
    pub._server.notify_arrived(1)
    assert_same((await asyncio.wait_for(fetch, 10)).tensors, w)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("weights fetched "))
    timeline = json.loads(line.split(" ", 2)[2])["timeline"]
    first, verified = timeline["first_chunk_ms"], timeline["verified_ms"]
    assert len(first) == len(verified) == len(manifest.buckets)
    assert all(0 <= f <= v <= timeline["total_ms"] for f, v in zip(first, verified, strict=True))
    assert first[-1] >= 350 and max(verified[:-1]) < 350  # the late bucket waited; the others did not


async def test_a_bucket_corrupted_every_time_fails_the_version_with_a_clear_error(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher(**TCP)
    await pub.publish(model(5), 1)
    wrap_sources(pub, 1, flips=10_000)
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint, max_refetch=1)
    with pytest.raises(WeightSyncError, match="failed its checksum 2 times"):
        await sub.fetch(1)


async def test_a_lane_reset_mid_version_takes_the_router_for_that_version(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher(**TCP)
    w = model(6)
    await pub.publish(w, 1)
    lane = pub._server.bulk
    reads = [0]

    def reset_on_fifth_read(n: int) -> None:
        reads[0] += 1
        if reads[0] == 5:
            lane.close()  # every lane connection reset, the listener gone: the lane is lost mid-version

    wrap_sources(pub, 1, on_read=reset_on_fifth_read)
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint)
    staged: list[int] = []
    got = await sub.fetch(1, on_bucket=lambda i, _tensors: staged.append(i))
    assert_same(got.tensors, w)
    assert sub.fallbacks == {"bulk lane unavailable": 1}
    assert 0 < sub.bulk_bytes < got.total_bytes
    # the buckets the lane had verified are kept: the ROUTER fetched only the rest, and each bucket was staged once
    first = got.manifest.buckets[0].nbytes
    assert sub.bytes_received - sub.bulk_bytes == got.total_bytes - first
    assert sorted(staged) == list(range(len(got.manifest.buckets)))


async def test_a_silent_lane_is_given_up_after_the_fetch_timeout(make_publisher: Any, make_subscriber: Any,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="rollpool.weights.paths.bulk")
    pub = await make_publisher(**TCP)
    w = model(7)
    await pub.publish(w, 1)
    # a fake lane at the process edge: the kernel accepts the connection, nothing ever answers
    silent = socket.create_server(("127.0.0.1", 0), backlog=16)
    try:
        pub._server.versions[1].bulk_port = silent.getsockname()[1]
        sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint, fetch_timeout_s=0.3)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        got = await sub.fetch(1)
        assert loop.time() - t0 < 3
        assert_same(got.tensors, w)
        assert sub.fallbacks == {"bulk lane unavailable": 1} and sub.bulk_bytes == 0
        assert any("was silent for 0.3 s" in r.getMessage() for r in caplog.records)  # the log says what happened
    finally:
        silent.close()


async def test_a_lane_that_cannot_be_reached_is_not_tried_again(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher(**TCP)
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there: connections are refused (as a firewall that rejects)
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint)
    for version in (1, 2):
        w = model(10 + version)
        await pub.publish(w, version)
        pub._server.versions[version].bulk_port = port
        got = await sub.fetch(version)
        assert_same(got.tensors, w)
    assert sub.fallbacks == {"bulk lane unavailable": 1} and sub.bulk_bytes == 0  # the second version did not try


def test_the_lane_port_follows_a_fixed_router_port() -> None:
    from rollpool.weights.paths.bulk import lane_port

    assert lane_port("tcp://0.0.0.0:6100") == 6102  # the PUB is on 6101 by convention: containers publish 6100-6102
    assert lane_port("tcp://127.0.0.1:*") == lane_port("tcp://127.0.0.1:0") == lane_port("ipc:///tmp/w") == 0


async def test_garbage_and_bad_requests_on_the_lane_get_an_answer_and_the_lane_keeps_serving(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher(**TCP)
    w = model(8)
    await pub.publish(w, 1)
    port = pub._server.bulk.port

    def exchange(payload: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
            c.sendall(payload)
            c.shutdown(socket.SHUT_WR)
            out = b""
            while chunk := c.recv(65536):
                out += chunk
            return out

    hello = struct.pack("<4sH", b"RPBH", 3) + b"bad"
    for payload, status in [
        (b"GET / HTTP/1.1\r\n\r\n", 5),  # not a hello: bad_request, closed
        (hello + b"junkjunkjunkjunkjunkjunkjunk", 5),  # not a request
        (hello + struct.pack("<4sQIQI", b"RPBQ", 1, 99, 0, 16), 3),  # no such bucket: bad_range
        (hello + struct.pack("<4sQIQI", b"RPBQ", 1, 0, 0, 64 << 20), 3),  # over the largest chunk
        (hello + struct.pack("<4sQIQI", b"RPBQ", 7, 0, 0, 16), 2),  # unknown_version
    ]:
        reply = await asyncio.to_thread(exchange, payload)
        magic, got_status, nbytes, n = struct.unpack_from("<4sBIH", reply)
        assert (magic, got_status, nbytes) == (b"RPBA", status, 0), (payload[:12], reply[:40])
        assert n > 0  # every error says what was wrong
    await asyncio.to_thread(exchange, b"\x00")  # a peer that sends one byte and leaves
    # a silent peer holds its connection only until the idle limit
    pub._server.bulk.idle_s = 0.2
    with socket.create_connection(("127.0.0.1", port), timeout=5) as idle:
        assert await asyncio.to_thread(idle.recv, 16) == b""  # closed by the server, nothing sent
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint)
    got = await sub.fetch(1)
    assert_same(got.tensors, w)
    assert sub.bulk_bytes == got.total_bytes


async def test_a_relay_takes_the_lane_upstream_and_offers_its_own_downstream(make_publisher: Any, make_subscriber: Any, make_relay: Any) -> None:
    pub = await make_publisher(**TCP)
    relay = await make_relay(upstream_router=pub.router_endpoint, upstream_pub=pub.pub_endpoint, **TCP)
    sub = make_subscriber(relay.router_endpoint, relay.pub_endpoint)
    w = model(9)
    await pub.publish(w, 1)
    await sub.wait_for_newer(0, timeout_s=5)
    got = await sub.fetch(1)
    assert_same(got.tensors, w)
    assert relay.upstream.bulk_bytes == got.total_bytes and sub.bulk_bytes == got.total_bytes
    assert await settled(lambda: pub._server.bulk_bytes_served, got.total_bytes) == got.total_bytes  # one upstream fetch


async def test_a_relay_forwards_a_version_on_its_lane_while_the_version_still_arrives(make_publisher: Any, make_subscriber: Any,
                                                                                      make_relay: Any) -> None:
    """A subscriber of a relay asks the relay's lane for chunks the relay is still receiving: its requests wait
    and are answered as the bytes arrive (each arrival wakes every waiting request), all over the lane."""
    pub = await make_publisher(bucket_bytes=4 << 20, **TCP)
    w = model(3, n=40)  # one bucket of ~2.6 MiB: about 40 chunks of 64 KiB, so about 40 arrivals upstream
    relay = await make_relay(upstream_router=pub.router_endpoint, upstream_pub=pub.pub_endpoint, window_chunks=1, **TCP)
    relay._server.bulk.wait_s = 4.0
    sub = make_subscriber(relay.router_endpoint, relay.pub_endpoint, window_chunks=8, streams=2)
    await pub.publish(w, 1)
    wrap_sources(pub, 1, on_read=lambda n: time.sleep(0.01))  # each upstream chunk 10 ms: the version takes ~0.4 s
    await sub.wait_for_newer(0, timeout_s=5)  # the relay announces as soon as it starts receiving
    got = await sub.fetch(1)
    assert_same(got.tensors, w)
    assert not sub.fallbacks, sub.fallbacks
    assert sub.bulk_bytes == got.total_bytes and relay.upstream.bulk_bytes == got.total_bytes
    assert relay._server.parked_served > 0  # chunks waited on the relay's lane for their bytes



async def test_a_version_dropped_while_a_connection_serves_its_bucket_answers_gone_and_sends_nothing_more(
        make_publisher: Any, make_subscriber: Any) -> None:
    """The chunks a connection reads in its own thread are checked after they are held: a version dropped before the
    read is never sent from (its buffers are reused once nothing holds them), the next request is answered ``gone``."""
    pub = await make_publisher(chunk_bytes=16 << 10, **TCP)
    await pub.publish(model(14), 1)
    loop = asyncio.get_running_loop()

    async def drop() -> None:
        pub._server.drop_version(1)

    def drop_on_second_read(n: int) -> None:  # in the lane's connection thread, before the read
        if n == 2:
            asyncio.run_coroutine_threadsafe(drop(), loop).result(5)

    wrap_sources(pub, 1, on_read=drop_on_second_read)
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint, streams=1)
    with pytest.raises(WeightVersionGoneError):
        await sub.fetch(1)
    assert pub._server.bulk.chunks_served == 1  # the first chunk only: the one read after the drop never went out


needs_native = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here: the Python path serves")


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
async def test_a_lane_connection_goes_to_the_event_loop_once_per_bucket_and_the_compiled_loops_carry_the_rest(
        make_publisher: Any, make_subscriber: Any, monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    """The publisher's loop shares the trainer's interpreter lock: a trip to it per chunk waited on whatever Python the
    trainer ran beside (bench/lane_probe.py). A connection looks a bucket up there once; its later chunks go out from
    the compiled send loop without the lock (`lane_native`) and the subscriber's compiled loop receives them (off:
    Python's, in the connection's thread). The loop still learns every byte served (keep_versions=0 releases on it)."""
    from rollpool.weights.paths import bulk

    if not native:
        monkeypatch.setattr(lane_native, "_off", "off for the test")
    received: list[int] = []
    real = bulk._fetch_chunks_native
    monkeypatch.setattr(bulk, "_fetch_chunks_native", lambda *a: received.append(len(a[3])) or real(*a))
    pub = await make_publisher(chunk_bytes=16 << 10, **TCP)
    w = model(17)
    manifest = await pub.publish(w, 1)
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint, streams=1)
    got = await sub.fetch(1)
    assert_same(got.tensors, w)
    lane = pub._server.bulk
    buckets = sum(1 for b in manifest.buckets if b.nbytes)
    # (the server counts a chunk after it went out: the fetch may return first)
    total = sum(-(-b.nbytes // (16 << 10)) for b in manifest.buckets)
    assert await settled(lambda: lane.chunks_served, total) == total > 3 * buckets  # many chunks a bucket at the test sizes
    assert lane.loop_lookups == buckets
    want = total - buckets if native else 0
    assert await settled(lambda: lane.native_chunks, want) == want
    assert await settled(lambda: sum(pub._server.versions[1].served_by_peer.values()), got.total_bytes) == got.total_bytes
    assert await settled(lambda: pub._server.chunks_served, lane.chunks_served) == lane.chunks_served
    assert sum(received) == (lane.chunks_served if native else 0)  # every chunk through the receiving loop, or none


@needs_native
async def test_a_version_dropped_while_the_compiled_loop_serves_its_bucket_answers_gone(
        make_publisher: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled loop checks the store's change counter before each chunk: a version dropped while it waits for
    the next request is not sent from; Python answers that request ``gone``."""
    monkeypatch.setattr(lane_native, "IDLE_MS", 5000)  # the loop is still waiting in C when the request comes
    pub = await make_publisher(chunk_bytes=16 << 10, **TCP)
    manifest = await pub.publish(model(18), 1)
    bucket = next(i for i, b in enumerate(manifest.buckets) if b.nbytes >= 3 * (16 << 10))
    lane = pub._server.bulk
    c = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", lane.port), 5)
    c.settimeout(5)

    def ask(k: int) -> tuple[int, bytes]:
        c.sendall(struct.pack("<4sQIQI", b"RPBQ", 1, bucket, k * (16 << 10), 16 << 10))
        status, nbytes, n = struct.unpack("<xxxxBIH", c.recv(11, socket.MSG_WAITALL))
        return status, c.recv(n + nbytes, socket.MSG_WAITALL)

    try:
        c.sendall(struct.pack("<4sH", b"RPBH", 1) + b"p")
        assert (await asyncio.to_thread(ask, 0))[0] == 0  # looked up on the loop
        assert (await asyncio.to_thread(ask, 1))[0] == 0  # from the compiled loop (it counts when it returns)
        pub._server.drop_version(1)
        status, text = await asyncio.to_thread(ask, 2)
        assert status == 1 and b"version 1" in text  # gone
        assert lane.chunks_served == 2 and lane.native_chunks == 1 and lane.loop_lookups == 2
    finally:
        c.close()


async def test_a_bucket_folded_a_few_chunks_at_a_time_verifies_and_a_corrupt_one_is_fetched_again(
        make_publisher: Any, make_subscriber: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A subscriber folds a bucket's landed bytes into its checksum `FOLD_BYTES` at a time, not per chunk (each fold waits
    for the interpreter lock): here 40 KiB over 16 KiB chunks, so folds end mid-chunk-run and the rest at the bucket's
    end; every byte is summed once, and a flipped one is still caught."""
    from rollpool.weights.paths import bulk

    monkeypatch.setattr(bulk, "FOLD_BYTES", 40 << 10)
    pub = await make_publisher(chunk_bytes=16 << 10, **TCP)
    w = model(15)
    manifest = await pub.publish(w, 1)
    assert max(b.nbytes for b in manifest.buckets) > 3 * (40 << 10)
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint, streams=1, max_refetch=2)
    assert_same((await sub.fetch(1)).tensors, w)
    assert sub.buckets_refetched == 0
    w2 = model(16)
    await pub.publish(w2, 2)
    wrap_sources(pub, 2, flips=1)  # each bucket's first chunk comes with a flipped byte, once
    assert_same((await sub.fetch(2)).tensors, w2)
    assert sub.buckets_refetched == len(manifest.buckets)


def test_the_bytes_waiting_for_their_fold_stay_within_the_budget_over_the_streams() -> None:
    """Few streams (a small worker) fold 32 MiB at a time; at 8 streams a chunk at a time, as before, so the 8 streams'
    unfolded bytes (64 MiB) are still in the cache when folded."""
    from rollpool.weights.paths.bulk import fold_bytes

    mib = 1 << 20
    assert [fold_bytes(s, 8 * mib) // mib for s in (1, 2, 4, 8, 16)] == [32, 32, 16, 8, 8]
    assert fold_bytes(1, 4 * mib) == 32 * mib and fold_bytes(16, 16 * mib) == 16 * mib  # never less than a chunk


class _HeldChecksums:
    """A trainer's CPU-tensor version whose checksums wait for its copies (every bucket's, the test's being small), and
    then for the test: `release` sums them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from rollpool.weights import snapshot

        monkeypatch.setattr(snapshot, "_SUMS_AFTER_COPIES", True)
        monkeypatch.setattr(snapshot, "_THREAD_COPY_BYTES", 1)
        self.held: list[Any] = []
        self._release = snapshot.Snapshot._release_sums
        monkeypatch.setattr(snapshot.Snapshot, "_release_sums", lambda snap: self.held.append(snap))

    def release(self) -> None:
        for snap in self.held:
            self._release(snap)


async def _publish_and_fetch(make_publisher: Any, make_subscriber: Any, w: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """A publish of `w` as version 1 and one subscriber's fetch of it (one stream), started side by side: (publisher,
    subscriber, publishing task, fetching task)."""
    pub = await make_publisher(chunk_bytes=16 << 10, **TCP)
    publishing = asyncio.create_task(pub.publish(w, 1))
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint, streams=1, fetch_timeout_s=30.0)
    return pub, sub, publishing, asyncio.create_task(sub.fetch(1))


def _early_chunks_of_first_bucket(pub: Any, chunk: int = 16 << 10) -> int:
    """Every chunk of the version's first bucket but its last: what goes out before its checksum to one stream."""
    first = next(b.nbytes for b in pub._server.versions[1].buckets if b.nbytes)
    return -(-first // chunk) - 1


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
@pytest.mark.parametrize("server_minor", [30, 29])
async def test_a_buckets_bytes_go_out_before_its_checksum_only_to_a_subscriber_that_asks_and_verify_once_it_comes(
        make_publisher: Any, make_subscriber: Any, monkeypatch: pytest.MonkeyPatch, native: bool, server_minor: int) -> None:
    """A trainer's CPU tensors are checksummed after the version's last copy (the copies have the cores to themselves):
    a subscriber of minor 30 asks with ``RPBE`` and gets every chunk but each bucket's last while the checksums are
    still held, with an empty text; the last chunk waits for the checksum and carries it, so the bucket is verified
    as before. A subscriber that does not ask (``RPBQ``, as every one before minor 30), and any subscriber of a server
    of minor 29, gets nothing before the checksum. Both end with the trainer's tensors, bit for bit."""
    from rollpool.weights import serving

    if not native:
        monkeypatch.setattr(lane_native, "_off", "off for the test")
    monkeypatch.setattr(serving, "PROTOCOL_MINOR", server_minor)  # what the server's manifests say
    sums = _HeldChecksums(monkeypatch)
    pub = await make_publisher(chunk_bytes=16 << 10, **TCP)
    w = model(19)
    manifest = await pub.publish(w, 1)
    assert sums.held and not any(b.checksum for b in manifest.buckets if b.nbytes)  # copied, no checksum yet
    early = make_subscriber(pub.router_endpoint, pub.pub_endpoint, streams=2, fetch_timeout_s=20.0, worker_id="early")
    old = make_subscriber(pub.router_endpoint, pub.pub_endpoint, streams=2, fetch_timeout_s=20.0, worker_id="old",
                          early_bytes=False)
    fetches = [asyncio.create_task(early.fetch(1)), asyncio.create_task(old.fetch(1))]
    v = pub._server.versions[1]

    def served_to(who: str) -> int:
        return sum(n for peer, n in v.served_by_peer.items() if (peer.decode() if isinstance(peer, bytes) else peer).startswith(who))

    # each of the early subscriber's two streams takes a bucket and gets all of it but its last chunk, then waits there
    chunk = 16 << 10
    firsts = [b.nbytes for b in manifest.buckets if b.nbytes][:2]
    want = sum(n - (n - (n - 1) // chunk * chunk) for n in firsts) if server_minor >= 30 else 0
    assert want > 0 or server_minor < 30
    got_early = await settled(lambda: served_to("early"), want, timeout_s=5.0) if want else served_to("early")
    await asyncio.sleep(0.2)  # (what the subscriber that does not ask would have had by now)
    assert (got_early, served_to("early"), served_to("old")) == (want, want, 0)
    assert pub._server.bulk.early_chunks == sum(-(-n // chunk) - 1 for n in firsts) * (server_minor >= 30)
    assert pub.stats["bulk_early_chunks"] == pub._server.bulk.early_chunks
    assert not any(f.done() for f in fetches)
    sums.release()
    for got in await asyncio.gather(*fetches):
        assert_same(got.tensors, w)
    assert early.bulk_bytes == early.bytes_received and old.bulk_bytes == old.bytes_received
    assert not early.fallbacks and not old.fallbacks and early.buckets_refetched == old.buckets_refetched == 0
    # what the worker reports (`weights_early_bytes`) is what the server sent it early: the two buckets' chunks above, and
    # any a stream's next request got before the released checksums reached the server's loop (a race: seen in CI)
    assert early.early_bytes == pub._server.bulk.early_chunks * chunk >= want and old.early_bytes == 0


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
async def test_a_request_waiting_for_a_bucket_is_answered_early_as_soon_as_its_copies_land(
        make_publisher: Any, make_subscriber: Any, monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    """A subscriber asks for a bucket before the trainer's copies reach it (the manifest is announced first): its
    request waits on the lane, and the bucket's last copy landing wakes it (not the next checksum, which the copies
    hold back, nor the waiter's own look every `WAIT_POLL_S`, made longer than the test here)."""
    import threading

    from rollpool.weights import snapshot
    from rollpool.weights.paths import bulk

    if not native:
        monkeypatch.setattr(lane_native, "_off", "off for the test")
    monkeypatch.setattr(bulk, "WAIT_POLL_S", 60.0)
    sums = _HeldChecksums(monkeypatch)
    gate = threading.Event()
    landed = snapshot.Snapshot._landed

    def gated(self: Any, *args: Any) -> None:
        gate.wait(20)  # the copies land once the test lets them
        landed(self, *args)

    monkeypatch.setattr(snapshot.Snapshot, "_landed", gated)
    w = model(20)
    pub, sub, publishing, fetching = await _publish_and_fetch(make_publisher, make_subscriber, w)
    lane = pub._server.bulk
    assert await settled(lambda: lane.waiting, 1, timeout_s=10.0) == 1  # the first request waits for its bytes
    gate.set()
    await publishing
    want = _early_chunks_of_first_bucket(pub)
    assert await settled(lambda: lane.early_chunks, want, timeout_s=10.0) == want
    sums.release()
    got = await fetching
    assert_same(got.tensors, w)
    assert not sub.fallbacks and sub.bulk_bytes == sub.bytes_received


async def test_while_the_trainer_waits_for_its_copies_no_bytes_go_out(
        make_publisher: Any, make_subscriber: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the checksums held for a CPU-tensor version's copies, a bucket's bytes become servable before its checksum
    at the version's last copy, when the trainer has its tensors back, not at the bucket's own: serving them during the
    copies took the cores the copies use (the trainer blocked 2.5x as long on the 2-core VM, 1.5x on an H100 host)."""
    import threading

    from rollpool.weights import snapshot

    sums = _HeldChecksums(monkeypatch)
    gate, first_landed = threading.Event(), threading.Event()
    landed = snapshot.Snapshot._landed

    def gated(self: Any, idx: int, *args: Any) -> None:
        if idx == len(self.buffers) - 1:
            gate.wait(20)  # the last bucket's copy (the model's last tensor) lands once the test lets it
        landed(self, idx, *args)
        if idx == 0 and self.left[0] == 0:
            first_landed.set()

    monkeypatch.setattr(snapshot.Snapshot, "_landed", gated)
    w = model(21)
    pub, sub, publishing, fetching = await _publish_and_fetch(make_publisher, make_subscriber, w)
    assert await asyncio.to_thread(first_landed.wait, 10)
    lane = pub._server.bulk
    want = _early_chunks_of_first_bucket(pub)
    # the first bucket's copies are in, the version's last is not: the request waits
    assert await settled(lambda: lane.waiting, 1, timeout_s=10.0) == 1
    assert lane.early_chunks == 0 and not publishing.done()
    gate.set()
    await publishing
    assert await settled(lambda: lane.early_chunks, want, timeout_s=10.0) == want  # the copies done: served early
    sums.release()
    assert_same((await fetching).tensors, w)


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
async def test_a_relay_takes_bytes_before_their_checksum_and_forwards_them_only_to_the_subscribers_that_ask(
        make_publisher: Any, make_subscriber: Any, make_relay: Any, monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    """Minor 30 through a relay: with the trainer's checksums held, the relay's own fetch asks with ``RPBE`` and gets
    each bucket's chunks but its last; it forwards them to its subscriber that asks too, and its subscriber that does
    not (``RPBQ``: what every subscriber before minor 30 sends) and one without the lane (the ROUTER's fetches,
    parked) get no chunk of a bucket before the bucket's checksum has come through. Once the checksums come, both end with the trainer's tensors, bit for bit, over the lane. (The
    relay hears of arrived chunks every fold's worth of them, `fold_bytes`: a few chunks here, the test's buckets being
    small.)"""
    from rollpool.weights.paths import bulk

    if not native:
        monkeypatch.setattr(lane_native, "_off", "off for the test")
    monkeypatch.setattr(bulk, "FOLD_BYTES", 40 << 10)
    sums = _HeldChecksums(monkeypatch)
    pub = await make_publisher(chunk_bytes=16 << 10, **TCP)
    relay = await make_relay(upstream_router=pub.router_endpoint, upstream_pub=pub.pub_endpoint, fetch_timeout_s=20.0, **TCP)
    w = model(23)
    await pub.publish(w, 1)
    early = make_subscriber(relay.router_endpoint, relay.pub_endpoint, streams=2, fetch_timeout_s=20.0, worker_id="early")
    old = make_subscriber(relay.router_endpoint, relay.pub_endpoint, streams=2, fetch_timeout_s=20.0, worker_id="old",
                          early_bytes=False)
    router = make_subscriber(relay.router_endpoint, relay.pub_endpoint, fetch_timeout_s=20.0, worker_id="router", bulk=False)
    await early.wait_for_newer(0, timeout_s=5)  # the relay announces once it starts receiving
    fetches = [asyncio.create_task(s.fetch(1)) for s in (early, old, router)]
    v = relay._server.versions[1]

    def served_to(who: str) -> int:
        return sum(n for peer, n in v.served_by_peer.items() if (peer.decode() if isinstance(peer, bytes) else peer).startswith(who))

    forwarded = await settled(lambda: min(relay._server.bulk.early_chunks, 1), 1, timeout_s=5.0)
    await asyncio.sleep(0.3)  # (what the subscriber that does not ask would have had by now)
    assert pub._server.bulk.early_chunks > 0  # the relay asked upstream before the checksums
    assert forwarded == 1 and served_to("early") > 0 and served_to("old") == served_to("router") == 0
    assert not any(f.done() for f in fetches) and sums.held
    sums.release()
    for got in await asyncio.gather(*fetches):
        assert_same(got.tensors, w)
    assert early.bulk_bytes == early.bytes_received and old.bulk_bytes == old.bytes_received
    assert not early.fallbacks and not old.fallbacks and early.buckets_refetched == old.buckets_refetched == 0
    assert router.bulk_bytes == 0 and router.buckets_refetched == 0
    assert relay.upstream.buckets_refetched == 0
    assert relay.stats["bulk_early_chunks"] == relay._server.bulk.early_chunks > 0 and relay.stats["versions_fetched"] == 1


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
@pytest.mark.parametrize("algorithm", ["the publisher's", "another"])
async def test_bytes_before_their_checksum_are_folded_as_they_land_and_verify(
        make_publisher: Any, make_subscriber: Any, monkeypatch: pytest.MonkeyPatch, native: bool, algorithm: str) -> None:
    """A bucket's bytes that come before its checksum go into its running checksum as they land (in cache), by the
    subscriber's default algorithm, not in one pass once the text came; a text naming another algorithm starts the
    fold again from the bucket's start. Either way every bucket verifies, none is fetched again."""
    from rollpool.weights import bucketing
    from rollpool.weights.paths import bulk

    if not native:
        monkeypatch.setattr(lane_native, "_off", "off for the test")
    if algorithm == "another":  # the subscriber's default differs from the publisher's (xxh3_64 here)
        class _Crc(bucketing.Checksummer):
            __slots__ = ()

            def __init__(self, algorithm: str | None = None) -> None:
                super().__init__(algorithm or "crc32")

        monkeypatch.setattr(bulk, "Checksummer", _Crc)
    monkeypatch.setattr(bulk, "FOLD_BYTES", 40 << 10)
    transfers: list[Any] = []
    made = bulk._BulkTransfer.__init__

    def seen(self: Any, *args: Any, **kw: Any) -> None:
        made(self, *args, **kw)
        transfers.append(self)

    monkeypatch.setattr(bulk._BulkTransfer, "__init__", seen)
    sums = _HeldChecksums(monkeypatch)
    pub = await make_publisher(chunk_bytes=16 << 10, **TCP)
    w = model(29)
    await pub.publish(w, 1)
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint, streams=1, fetch_timeout_s=20.0)  # (no bucket cut in parts)
    fetching = asyncio.create_task(sub.fetch(1))
    first = next(i for i, b in enumerate(pub._server.versions[1].buckets) if b.nbytes)
    assert await settled(lambda: sum(t.folded_to[first] > 0 for t in transfers), 1, timeout_s=5.0) == 1
    (t,) = transfers
    assert t.folding[first] and t.sums[first] is not None and not t.expected[first]  # folded before its checksum came
    sums.release()
    assert_same((await fetching).tensors, w)
    assert sub.buckets_refetched == 0 and not sub.fallbacks and sub.early_bytes > 0
    summer = t.sums[first]
    assert summer is not None and summer.algorithm == bucketing.default_checksum_algorithm()  # the publisher's, in the end
