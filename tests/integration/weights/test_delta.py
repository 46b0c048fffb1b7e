"""Delta weight versions over real sockets: a subscriber holding the previous version gets the changed elements and
rebuilds a version bit-identical to the trainer's; every fault ends in a verified full version, never a wrong tensor."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from rollpool.protocol import DELTA_MINOR, encode  # noqa: E402
from rollpool.protocol.messages import Manifest, ManifestRequest  # noqa: E402
from rollpool.weights.bucketing import checksum  # noqa: E402
from rollpool.weights.delta import payload_offsets  # noqa: E402
from rollpool.weights.memory import SHM_DIR  # noqa: E402

from .delta_models import model as _model  # noqa: E402
from .delta_models import published as _published  # noqa: E402
from .delta_models import same as _same  # noqa: E402
from .delta_models import step as _step  # noqa: E402

pytestmark = pytest.mark.asyncio


@pytest.fixture(autouse=True, params=["host", "device"])
def _deltas_on(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> str:
    """Delta versions are opt-in (`WeightPathConfig.weight_delta`); every publisher, relay and subscriber here reads it
    from the environment, as a process started with ``ROLLPOOL_WEIGHT_DELTA=1`` would. Every test runs twice: the
    publisher's deltas made on the host, and on the tensors' device (`rollpool.weights.delta_device`, its torch code on
    these CPU tensors, the GPU budget raised to hold the base), which must change nothing a subscriber or relay sees."""
    monkeypatch.setenv("ROLLPOOL_WEIGHT_DELTA", "1")
    if request.param == "device":
        from rollpool.weights import delta_device, publisher

        monkeypatch.setattr(delta_device, "DEVICE_TYPES", ("cuda", "cpu"))
        monkeypatch.setattr(publisher, "gpu_budget_bytes", lambda _cfg, _bucket_bytes: 1 << 34)
    return str(request.param)


async def test_a_subscriber_holding_the_base_gets_the_changed_elements_and_the_trainers_bytes(make_publisher: Any, make_subscriber: Any,
                                                                                              _deltas_on: str, sub_path: str,
                                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from rollpool.weights import delta as delta_mod

    monkeypatch.setattr(delta_mod, "IN_PLACE_MAX_FRACTION", 0.05)  # every bucket of these 1% steps rebuilt in place (from v3 on)
    pub = await make_publisher()
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint, path=sub_path)
    total = sum(t.numel() * t.element_size() for t in _model().values())
    m1 = _model()
    await _published(pub, m1, 1)
    served = await sub.fetch(1)
    assert _same(served.tensors, m1) and sub.delta_versions == 0 and sub.last_path == sub_path
    spare = pub._server._spare_thread  # the first delta's segment, made once version 1's copy returned
    assert spare is not None
    await asyncio.to_thread(spare.join, 10.0)
    model = m1
    for version in (2, 3, 4):
        before_model, model = model, _step(model, version)
        await _published(pub, model, version)
        before, before_shm, before_bulk, served_bytes = sub.bytes_received, sub.shm_bytes, sub.bulk_bytes, pub.bytes_served
        wv = await sub.fetch(version)
        assert _same(wv.tensors, model)
        assert wv.manifest.delta_base == version - 1
        spare = pub._server._spare_thread  # (a trainer's step takes seconds: the next delta's segment is made by then)
        if spare is not None:
            await asyncio.to_thread(spare.join, 10.0)
        # the publisher's version is in shared memory, so its delta is there too; only a subscriber on shm reads it there
        assert wv.manifest.delta_shm is not None and sub.last_path == sub_path
        got = sub.bytes_received - before if sub_path == "network" else sub.shm_bytes - before_shm
        if sub_path == "shm":  # the delta path ran, not a full version: its encoded bytes read in place, none on a socket
            assert sub.bytes_received == before and pub.bytes_served == served_bytes
        else:  # over TCP the encoded bytes take the server's bulk lane (minor 26), as a full version's bytes do
            assert sub.bulk_bytes - before_bulk == got
        # 1% of the bf16 elements as (int32 index, value) pairs and the fp32 norm whole: a few % of the version
        assert 0 < got < total // 10
        wire = sub.last_wire  # what status and top show: the bytes by encoding, the changed fraction carried
        assert wire.version == version and wire.wire_bytes == got and wire.model_bytes == total
        assert wire.bytes_by_encoding["gaps"] + wire.bytes_by_encoding["sparse"] == wire.wire_bytes > 0  # scattered: no bucket whole
        assert 0.009 < wire.changed_fraction < 0.011  # 1% of each tensor's elements changed
        # as a worker does: the version the engine served is recycled once the new one is applied; until then the
        # rebuild never wrote it (from version 3 on the rebuild writes, in place, the buffer recycled the time before)
        assert _same(served.tensors, before_model)
        sub.recycle(served)
        served = wv
    assert sub.delta_versions == 3 and sub.delta_fallbacks == 0 and sub.delta.in_place_versions == 2
    assert sub.buffers_allocated == 2  # the base and the version being rebuilt: recycled buffers come back a version later
    stats = pub.stats
    assert stats["last_delta_version"] == 4 and 5_000 < stats["last_delta_changed_ppm"] < 20_000
    assert stats["delta_manifests_served"] == 3 and 0 < stats["last_delta_wire_bytes"] < total // 10
    assert stats["delta_device_versions"] == (3 if _deltas_on == "device" else 0)
    assert pub.path_note["delta_made_on"] == _deltas_on
    assert pub._server.delta_shm_written == 3
    # no delta's write made its segment: each found one made and touched ahead, the first's once version 1 was copied
    # (a fresh segment costs its first write a page fault per 4 KiB: 0.26-0.32 s at 8B, before the delta is served)
    assert pub._server.delta_shm_fresh == 0


@pytest.fixture
def shm_dir() -> str:
    if not os.path.isdir(SHM_DIR):
        pytest.skip("no /dev/shm")
    return SHM_DIR


async def test_a_recycled_buffer_written_after_it_was_given_back_is_caught_by_the_checksum_of_the_in_place_rebuild(
        make_publisher: Any, make_subscriber: Any, sub_path: str) -> None:
    """A version rebuilt in place starts from the bytes the buffer recycled the time before holds (the version two
    before). A caller that wrote into it after giving it back (against `recycle`'s contract) gets no wrong tensor: the
    rebuilt buckets fail their checksums and the full version arrives; the next delta is rebuilt again."""
    pub = await make_publisher()
    sub, m2 = await _holding_v1_with_v2_published(pub, make_subscriber, sub_path)
    served = await sub.fetch(2)  # a delta, rebuilt by copying the base
    assert _same(served.tensors, m2) and sub.delta_versions == 1 and sub.delta.in_place_versions == 0
    m3 = _step(m2, 3)
    await _published(pub, m3, 3)
    free = [b for bufs in sub.buffers.pool._free.values() for b in bufs]
    assert free  # the buffer version 1 was in: the next delta is rebuilt in it
    for b in free:
        b[::4096] ^= 0x01  # written after it was given back
    wv = await sub.fetch(3)
    assert _same(wv.tensors, m3) and sub.delta_fallbacks == 1 and sub.delta.in_place_versions == 0 and sub.last_path == sub_path
    sub.recycle(served)
    m4 = _step(m3, 4)
    await _published(pub, m4, 4)
    wv4 = await sub.fetch(4)  # 3 came full: its delta is not kept, so version 4 is rebuilt by a copy of the base
    assert _same(wv4.tensors, m4) and sub.delta_versions == 2 and sub.delta_fallbacks == 1


async def test_a_subscriber_on_shm_asks_an_older_server_for_no_delta_and_one_on_auto_gets_it_over_the_network(
        make_publisher: Any, make_subscriber: Any, monkeypatch: pytest.MonkeyPatch, shm_dir: str) -> None:
    """A server of `DELTA_PATHS_MINOR - 1` puts no delta in shared memory: a subscriber held to ``shm`` (which could not
    fetch the encoded bytes over the network) does not ask it for deltas and gets full versions from shared memory,
    never a fallback; one on ``auto`` gets the delta over the network, as from every server before."""
    from rollpool.protocol import DELTA_PATHS_MINOR
    from rollpool.weights import serving

    monkeypatch.setattr(serving, "PROTOCOL_MINOR", DELTA_PATHS_MINOR - 1)
    pub = await make_publisher()
    pub._server.delta_segments = None  # what the older server lacks
    strict = make_subscriber(pub.router_endpoint, pub.pub_endpoint, path="shm", worker_id="strict")
    auto = make_subscriber(pub.router_endpoint, pub.pub_endpoint, path="auto", worker_id="auto")
    model = _model()
    await _published(pub, model, 1)
    for s in (strict, auto):
        s.recycle(await s.fetch(1))
    lane_bytes = auto.bulk_bytes
    for version in (2, 3):
        model = _step(model, version)
        await _published(pub, model, version)
        for s in (strict, auto):
            wv = await s.fetch(version)
            assert _same(wv.tensors, model)
            s.recycle(wv)
    assert strict.delta_versions == 0 and strict.delta_fallbacks == 0 and strict.last_path == "shm" and strict.fallbacks == {}
    assert strict.bytes_received == 0
    assert auto.delta_versions == 2 and auto.delta_fallbacks == 0 and auto.last_path == "network"
    assert auto.bulk_bytes == lane_bytes  # that server's lane knows no delta request: the encoded bytes came over the ROUTER


async def test_a_bulk_lane_lost_while_it_carries_a_delta_leaves_the_rest_to_the_router(make_publisher: Any, make_subscriber: Any) -> None:
    """The lane fails part-way through a delta's encoded bytes: what it verified is kept, the ROUTER brings the rest, and
    the version is still rebuilt from the delta, bit-identical."""
    pub = await make_publisher(bucket_bytes=64 * 1024)
    sub, m2 = await _holding_v1_with_v2_published(pub, make_subscriber)
    served = pub._server.versions[2]
    assert served.delta is not None and len(served.delta.payload.buckets) >= 3
    lane = pub._server.bulk
    assert lane is not None
    answer, answered = lane._answer, []

    def fails_on_the_second(conn: Any, peer: bytes, held: Any, version: int, bucket: int, offset: int, nbytes: int,
                            delta_base: int = -1, early: bool = False) -> None:
        if delta_base >= 0 and answered:
            conn.shutdown(2)  # the lane drops: the subscriber's stream sees the connection fail
            return
        answered.append(bucket)
        answer(conn, peer, held, version, bucket, offset, nbytes, delta_base, early)

    lane._answer = fails_on_the_second
    before, before_bulk = sub.bytes_received, sub.bulk_bytes
    wv = await sub.fetch(2)
    assert _same(wv.tensors, m2) and sub.delta_versions == 1 and sub.delta_fallbacks == 0
    lane_bytes, total = sub.bulk_bytes - before_bulk, sub.bytes_received - before
    assert 0 < lane_bytes < total  # part over the lane, the rest over the ROUTER


async def test_a_peer_of_the_previous_minor_never_asks_for_deltas_and_gets_full_versions(make_publisher: Any, sockets: Any) -> None:
    import msgpack
    import zmq

    pub = await make_publisher()
    m1 = _model()
    await _published(pub, m1, 1)
    await _published(pub, _step(m1, 2), 2)
    assert pub._server.versions[2].delta is not None  # a delta is served to those who ask
    frames = encode(ManifestRequest(request_id="old", version=2, streamed=True, delta_base=1))
    header = msgpack.unpackb(frames[0])
    header[1] = DELTA_MINOR - 1
    del header[3]["delta_base"]  # the field did not exist then
    dealer = sockets.context.socket(zmq.DEALER)  # a raw peer of the minor before
    dealer.connect(pub.router_endpoint)
    try:
        await dealer.send_multipart([msgpack.packb(header), *frames[1:]])
        from rollpool.protocol import decode
        reply = decode(await asyncio.wait_for(dealer.recv_multipart(), 5))
    finally:
        dealer.close(linger=0)
    assert isinstance(reply, Manifest) and reply.version == 2 and reply.delta_base == -1
    assert all(b.encoding == "" and b.delta_nbytes == 0 for b in reply.buckets)


async def test_a_subscriber_of_the_minor_before_deltas_in_shared_memory_gets_its_delta_over_the_router(make_publisher: Any,
                                                                                                      sockets: Any) -> None:
    """A raw peer of `DELTA_PATHS_MINOR - 1` (which knows no `Manifest.delta_shm` and no bulk-lane delta request) asks
    the new publisher for a delta and fetches its encoded bytes with `Fetch.delta_base` over the ROUTER, as before."""
    import msgpack
    import zmq

    from rollpool.protocol import DELTA_PATHS_MINOR, decode
    from rollpool.protocol.messages import Chunk, Fetch

    pub = await make_publisher()
    m1 = _model()
    await _published(pub, m1, 1)
    await _published(pub, _step(m1, 2), 2)
    served = pub._server.versions[2].delta
    assert served is not None and served.shm is not None  # the new publisher put it in shared memory too

    def old(msg: Any) -> list[bytes]:
        frames = encode(msg)
        header = msgpack.unpackb(frames[0])
        header[1] = DELTA_PATHS_MINOR - 1
        return [msgpack.packb(header), *frames[1:]]

    dealer = sockets.context.socket(zmq.DEALER)
    dealer.connect(pub.router_endpoint)
    try:
        await dealer.send_multipart(old(ManifestRequest(request_id="old", version=2, streamed=True, delta_base=1)))
        reply = decode(await asyncio.wait_for(dealer.recv_multipart(), 5))
        assert isinstance(reply, Manifest) and reply.delta_base == 1
        carried = [b for b in reply.buckets if b.encoding != "unchanged"]
        first = carried[0]
        await dealer.send_multipart(old(Fetch(request_id="f", version=2, bucket=0, offset=0, nbytes=first.delta_nbytes, delta_base=1)))
        chunk = decode(await asyncio.wait_for(dealer.recv_multipart(), 5))
    finally:
        dealer.close(linger=0)
    assert isinstance(chunk, Chunk) and checksum(bytes(chunk.data)) == first.delta_checksum


async def test_a_late_joiner_and_a_subscriber_that_skipped_a_version_get_full_versions(make_publisher: Any, make_subscriber: Any,
                                                                                        sub_path: str) -> None:
    pub = await make_publisher()
    early = make_subscriber(pub.router_endpoint, pub.pub_endpoint, worker_id="early", path=sub_path)
    m1 = _model()
    await _published(pub, m1, 1)
    early.recycle(await early.fetch(1))
    m2 = _step(m1, 2)
    await _published(pub, m2, 2)
    m3 = _step(m2, 3)
    await _published(pub, m3, 3)
    late = make_subscriber(pub.router_endpoint, pub.pub_endpoint, worker_id="late", path=sub_path)
    for sub in (early, late):  # early holds 1, the delta of 3 is against 2; late holds nothing
        wv = await sub.fetch(3)
        assert _same(wv.tensors, m3) and wv.manifest.delta_base == -1 and sub.last_path == sub_path
    assert early.delta_versions == 0 and pub._server.full_served_to_delta_askers >= 1


async def test_a_delta_not_made_in_time_leaves_its_askers_the_full_version(make_publisher: Any, make_subscriber: Any,
                                                                            sub_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A subscriber holding the base waits for the delta at most `weight_delta_wait_s` after the version is complete,
    then gets the full version (at 8B a delta made on the host kept a worker waiting 5 s for a version whose full bytes
    were ready and checksummed after 0.6 s)."""
    from rollpool.weights.serving import WeightServer

    settling = WeightServer._settling

    async def slow(v: Any) -> None:  # the delta takes 1.5 s to be made
        await asyncio.sleep(1.5)
        await settling(v)

    monkeypatch.setattr(WeightServer, "_settling", staticmethod(slow))
    monkeypatch.setenv("ROLLPOOL_WEIGHT_DELTA_WAIT_S", "0.1")
    pub = await make_publisher()
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint, path=sub_path)
    m1 = _model()
    await pub.publish(m1, 1, wait_ready=True)
    sub.recycle(await sub.fetch(1))
    m2 = _step(m1, 2)
    await pub.publish(m2, 2, wait_ready=True)
    assert pub._server.versions[2].delta_state == "pending"
    wv = await sub.fetch(2)  # (had it waited for the delta, it would have got it: delta_base 1)
    assert _same(wv.tensors, m2) and wv.manifest.delta_base == -1 and sub.last_path == sub_path
    assert pub.stats["delta_waits_ended"] == 1 and pub._server.full_served_to_delta_askers == 1


async def _restarted(make_publisher: Any, endpoint: str, pub_endpoint: str) -> Any:
    """A publisher on the endpoints of one just closed: ZeroMQ releases a closed socket's port in its I/O thread, a little
    later, so the rebind is tried again while the port is still held."""
    import zmq

    for _ in range(100):
        try:
            return await make_publisher(router_endpoint=endpoint, pub_endpoint=pub_endpoint)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE:
                raise
            await asyncio.sleep(0.05)
    raise AssertionError(f"{endpoint} stayed in use")


async def _holding_v1_with_v2_published(pub: Any, make_subscriber: Any, path: str = "network") -> tuple[Any, dict[str, torch.Tensor]]:
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint, path=path)
    m1 = _model()
    await _published(pub, m1, 1)
    sub.recycle(await sub.fetch(1))
    m2 = _step(m1, 2)
    await _published(pub, m2, 2)
    return sub, m2


async def test_a_delta_whose_base_the_subscriber_does_not_hold_ends_in_the_full_version(make_publisher: Any, make_subscriber: Any,
                                                                                         sub_path: str) -> None:
    pub = await make_publisher()
    sub, m2 = await _holding_v1_with_v2_published(pub, make_subscriber, sub_path)
    delta_manifest = await sub.fetch_manifest(2)
    assert delta_manifest.delta_base == 1
    other = make_subscriber(pub.router_endpoint, pub.pub_endpoint, worker_id="other", path=sub_path)  # holds no version
    other.watch.known, other.watch.latest = delta_manifest, 2  # handed the delta manifest (as a catch-up would)
    wv = await other.fetch(2)
    assert _same(wv.tensors, m2) and other.delta_fallbacks == 1 and other.delta_versions == 0 and other.last_path == sub_path


def _corrupt(served: Any, k: int, change: Any, *, keep_checksum: bool) -> None:
    """The `k`-th carried bucket of `served`'s delta changed by `change(array)` where every subscriber reads it: the
    bytes the ROUTER serves and their copy in shared memory (`Manifest.delta_shm`); with `keep_checksum` the encoded
    bytes' checksum is made to match them (so only the checksum of the resulting bytes can catch the change)."""
    d = served.delta
    payload = d.payload
    src = payload.sources[k]
    change(src.array)
    if d.shm_buffer is not None:
        offsets, _total = payload_offsets([b.nbytes for b in payload.buckets])
        n = payload.buckets[k].nbytes
        d.shm_buffer.numpy()[offsets[k] : offsets[k] + n] = src.array
    if keep_checksum:
        i = [b.index for b in d.buckets if b.encoding != "unchanged"][k]
        digest = checksum(src.array.data)
        payload.buckets = tuple(replace(b, checksum=digest) if b.index == k else b for b in payload.buckets)
        d.buckets = tuple(replace(b, delta_checksum=digest) if b.index == i else b for b in d.buckets)


def _flip_last(a: Any) -> None:
    a[-1] ^= 0x40  # a changed value's bits flipped


@pytest.mark.parametrize("where", ["payload", "payload_and_its_checksum"])
async def test_a_corrupt_delta_bucket_ends_in_the_full_version(make_publisher: Any, make_subscriber: Any, where: str, sub_path: str) -> None:
    pub = await make_publisher()
    sub, m2 = await _holding_v1_with_v2_published(pub, make_subscriber, sub_path)
    served = pub._server.versions[2]
    assert served.delta is not None
    i = next(j for j, b in enumerate(served.delta.buckets) if b.encoding in ("sparse", "gaps"))
    k = sum(1 for b in served.delta.buckets[:i] if b.encoding != "unchanged")
    # with the checksum kept, the encoded bytes check out, so only the checksum of the resulting bytes can catch it
    _corrupt(served, k, _flip_last, keep_checksum=where == "payload_and_its_checksum")
    wv = await sub.fetch(2)
    assert _same(wv.tensors, m2) and sub.last_path == sub_path
    assert sub.delta_fallbacks == 1 and sub.delta_versions == 0


@pytest.mark.parametrize("where", ["values", "positions"])
async def test_a_bucket_that_fails_while_others_are_rebuilt_and_handed_on_ends_in_the_full_version(make_publisher: Any, make_subscriber: Any,
                                                                                                   where: str, sub_path: str) -> None:
    """Buckets are rebuilt as their encoded bytes arrive and handed on as each verifies: one whose encoded bytes check
    out but whose result cannot be right (a value's bits flipped, or positions past the bucket) ends in the full
    version; nothing handed on, before or after, differs from the trainer's tensors, and the failed rebuild's buffer
    serves the next delta."""
    pub = await make_publisher(bucket_bytes=64 * 1024)
    sub, m2 = await _holding_v1_with_v2_published(pub, make_subscriber, sub_path)
    served = pub._server.versions[2]
    assert served.delta is not None
    carried = [b for b in served.delta.buckets if b.encoding != "unchanged"]
    assert len(carried) >= 3 and carried[-1].encoding == "gaps"

    def past_the_bucket(a: Any) -> None:
        a[:2] = 0xFF  # the first gap 65535: past the bucket's 32768 elements

    # the encoded bytes check out
    _corrupt(served, len(carried) - 1, _flip_last if where == "values" else past_the_bucket, keep_checksum=True)
    handed: list[dict[str, torch.Tensor]] = []
    wv = await sub.fetch(2, on_bucket=lambda _i, tensors: handed.append({n: t.clone() for n, t in tensors.items()}))
    assert _same(wv.tensors, m2) and sub.delta_fallbacks == 1 and sub.delta_versions == 0 and sub.last_path == sub_path
    assert handed and all(torch.equal(t.view(torch.uint8), m2[n].contiguous().view(torch.uint8)) for h in handed for n, t in h.items())
    sub.recycle(wv)
    m3 = _step(m2, 3)
    await _published(pub, m3, 3)
    wv3 = await sub.fetch(3)
    assert _same(wv3.tensors, m3) and sub.delta_versions == 1 and sub.delta_fallbacks == 1 and sub.last_path == sub_path


def _evicting(through: Any, pub: Any, m2: Any, newer: dict[str, Any]) -> Any:
    """A fetch that, on the first delta asked for, has versions 3 and 4 published first (the delta's version and its
    base evicted while it is being fetched); `newer` gets their models."""

    async def evicting(job: Any) -> Any:
        if job.manifest.delta_base >= 0 and not newer:
            newer["m3"] = _step(m2, 3)
            await _published(pub, newer["m3"], 3)
            newer["m4"] = _step(newer["m3"], 4)
            await _published(pub, newer["m4"], 4)
        return await through(job)

    return evicting


async def test_a_delta_evicted_mid_fetch_ends_in_a_verified_full_version(make_publisher: Any, make_subscriber: Any, sub_path: str) -> None:
    pub = await make_publisher()
    sub, m2 = await _holding_v1_with_v2_published(pub, make_subscriber, sub_path)
    newer: dict[str, Any] = {}
    if sub_path == "network":
        # keep_versions=2: versions 1 and 2, and 2's delta, go; the encoded bytes go over the bulk lane, else the ROUTER
        sub._bulk.fetch = _evicting(sub._bulk.fetch, pub, m2, newer)
        sub._network.fetch = _evicting(sub._network.fetch, pub, m2, newer)
    else:
        read = sub.delta.read_payloads

        async def evicted_before_read(manifest: Any, on_payload: Any = None) -> Any:
            # the manifest is here, then versions 3 and 4 are published before the encoded bytes are read: version 2
            # and its delta are evicted, and 4's delta is written into the segment 2's was in
            newer["m3"] = _step(m2, 3)
            await _published(pub, newer["m3"], 3)
            newer["m4"] = _step(newer["m3"], 4)
            await _published(pub, newer["m4"], 4)
            assert pub._server.versions[4].delta.shm.name == manifest.delta_shm.name  # the same segment, reused
            return await read(manifest, on_payload)

        sub.delta.read_payloads = evicted_before_read
    wv = await sub.fetch()  # the latest: 2 was announced
    assert wv.version == 4 and _same(wv.tensors, newer["m4"]) and sub.last_path == sub_path
    assert sub.delta_fallbacks == 1


async def test_a_delta_segment_written_again_while_it_is_copied_is_a_torn_read_and_ends_in_the_full_version(
        make_publisher: Any, make_subscriber: Any, monkeypatch: pytest.MonkeyPatch, shm_dir: str) -> None:
    """The publisher writes the delta's segment again while the subscriber copies the encoded bytes out (the header
    names the same version, in a new generation): nothing copied is used, and the full version arrives."""
    from rollpool.weights.paths import delta as delta_path

    pub = await make_publisher(bucket_bytes=64 * 1024)
    sub, m2 = await _holding_v1_with_v2_published(pub, make_subscriber, "shm")
    served = pub._server.versions[2]
    assert served.delta is not None and served.delta.shm is not None
    seg = pub._server.delta_segments.segment_of(served.delta.shm_buffer)
    verify, calls = delta_path.verify_checksum, []

    def rewritten_meanwhile(expected: str, data: Any = None, **kw: Any) -> bool:
        if not calls:  # during the first copy, the publisher writes the segment again
            seg.begin_write()
            seg.end_write(2)
        calls.append(expected)
        return verify(expected, data, **kw)

    monkeypatch.setattr(delta_path, "verify_checksum", rewritten_meanwhile)
    wv = await sub.fetch(2)
    assert _same(wv.tensors, m2) and sub.delta_fallbacks == 1 and sub.delta_versions == 0 and sub.last_path == "shm"
    assert any("reused the delta's segment" in why for why in sub.fallbacks)


async def test_a_publisher_restarted_between_versions_is_never_a_base(make_publisher: Any, make_subscriber: Any, sockets: Any,
                                                                      sub_path: str) -> None:
    pub = await make_publisher()
    endpoint, pub_endpoint = pub.router_endpoint, pub.pub_endpoint
    sub, _m2 = await _holding_v1_with_v2_published(pub, make_subscriber, sub_path)
    await pub.close()
    restarted = await _restarted(make_publisher, endpoint, pub_endpoint)
    # the new run publishes its own version 1 (other bytes) and then 2: a delta of 2 against *its* 1
    r1 = _model(seed=7)
    await _published(restarted, r1, 1)
    r2 = _step(r1, 9)
    await _published(restarted, r2, 2)
    assert restarted._server.versions[2].delta is not None
    wv = await sub.fetch(2)
    assert _same(wv.tensors, r2) and sub.delta_versions == 0 and sub.delta_fallbacks == 1 and sub.last_path == sub_path


async def test_a_relay_that_missed_the_base_serves_the_full_version_then_deltas(make_publisher: Any, make_subscriber: Any, sockets: Any) -> None:
    from rollpool.weights.relay import Relay

    pub = await make_publisher()
    relay = Relay(sockets, upstream_router=pub.router_endpoint, upstream_pub=pub.pub_endpoint, router_endpoint="tcp://127.0.0.1:*",
                  pub_endpoint="tcp://127.0.0.1:*", announce_interval_s=0.1, fetch_timeout_s=2.0)
    await relay.start()  # not run(): the test says when it follows upstream
    try:
        subs = [make_subscriber(relay.router_endpoint, relay.pub_endpoint, worker_id=f"w{i}") for i in range(2)]
        model = _model()
        await _published(pub, model, 1)
        await relay.follow_latest()
        for s in subs:
            s.recycle(await s.fetch(1))
        m2 = _step(model, 2)
        await _published(pub, m2, 2)
        m3 = _step(m2, 3)
        await _published(pub, m3, 3)
        assert await relay.follow_latest() == 3  # the relay never got 2
        for s in subs:
            wv = await s.fetch(3)
            assert _same(wv.tensors, m3) and wv.manifest.delta_base == -1
            s.recycle(wv)
        m4 = _step(m3, 4)
        await _published(pub, m4, 4)
        await relay.follow_latest()
        for _ in range(500):
            if relay._server.versions[4].delta_state != "pending":
                break
            await asyncio.sleep(0.01)
        for s in subs:
            wv = await s.fetch(4)
            assert _same(wv.tensors, m4) and wv.manifest.delta_base == 3
        assert all(s.delta_versions == 1 for s in subs)
    finally:
        await relay.close()


async def _relay_holding_v1(pub: Any, make_subscriber: Any, sockets: Any) -> tuple[Any, list[Any], dict[str, torch.Tensor]]:
    """A relay (started, not run: the test says when it follows upstream) and two subscribers behind it, all holding 1."""
    from rollpool.weights.relay import Relay

    relay = Relay(sockets, upstream_router=pub.router_endpoint, upstream_pub=pub.pub_endpoint, router_endpoint="tcp://127.0.0.1:*",
                  pub_endpoint="tcp://127.0.0.1:*", announce_interval_s=0.1, fetch_timeout_s=2.0)
    await relay.start()
    subs = [make_subscriber(relay.router_endpoint, relay.pub_endpoint, worker_id=f"w{i}") for i in range(2)]
    m1 = _model()
    await _published(pub, m1, 1)
    assert await relay.follow_latest() == 1
    for s in subs:
        s.recycle(await s.fetch(1))
    return relay, subs, m1


async def test_a_relay_holding_the_base_rebuilds_the_delta_verifies_it_and_forwards_it(make_publisher: Any, make_subscriber: Any,
                                                                                      sockets: Any) -> None:
    pub = await make_publisher()
    relay, subs, m1 = await _relay_holding_v1(pub, make_subscriber, sockets)
    total = sum(t.numel() * t.element_size() for t in m1.values())
    try:
        model = m1
        for version in (2, 3):
            model = _step(model, version)
            await _published(pub, model, version)
            before = relay.upstream_bytes
            assert await relay.follow_latest() == version
            assert 0 < relay.upstream_bytes - before < total // 10  # the relay got the changed elements, not the version
            served = relay._server.versions[version]
            assert served.delta is not None and served.delta.base == version - 1
            # the upstream's encoded buckets pass through as they came: the same checksums a subscriber verifies
            def carried(buckets: Any) -> list[tuple[str, str, int, str]]:
                return [(b.checksum, b.encoding, b.delta_nbytes, b.delta_checksum) for b in buckets]

            assert carried(served.delta.buckets) == carried(pub._server.versions[version].delta.buckets)
            for s in subs:
                sub_before = s.bytes_received
                wv = await s.fetch(version)
                assert _same(wv.tensors, model) and wv.manifest.delta_base == version - 1
                assert 0 < s.bytes_received - sub_before < total // 10
                s.recycle(wv)
        assert relay.delta_versions == 2 and relay.delta_fallbacks == 0
        assert all(s.delta_versions == 2 and s.delta_fallbacks == 0 for s in subs)
        late = make_subscriber(relay.router_endpoint, relay.pub_endpoint, worker_id="late")  # holds no base: the relay's full copy
        wv = await late.fetch(3)
        assert _same(wv.tensors, model) and wv.manifest.delta_base == -1 and late.bytes_received == total
        assert relay._server.last_delta["version"] == 3 and 0 < relay._server.last_delta["wire_bytes"] < total // 10
    finally:
        await relay.close()


@pytest.mark.parametrize("where", ["payload", "payload_and_its_checksum"])
async def test_a_corrupt_delta_at_the_relay_ends_in_the_full_version_downstream_too(make_publisher: Any, make_subscriber: Any,
                                                                                    sockets: Any, where: str) -> None:
    pub = await make_publisher()
    relay, subs, m1 = await _relay_holding_v1(pub, make_subscriber, sockets)
    try:
        m2 = _step(m1, 2)
        await _published(pub, m2, 2)
        served = pub._server.versions[2]
        assert served.delta is not None
        payload = served.delta.payload
        i = next(j for j, b in enumerate(served.delta.buckets) if b.encoding in ("sparse", "gaps"))
        k = sum(1 for b in served.delta.buckets[:i] if b.encoding != "unchanged")
        src = payload.sources[k]
        src.array[-1] ^= 0x40
        if where == "payload_and_its_checksum":  # only the checksum of the rebuilt bytes can catch it
            digest = checksum(src.array.data)
            payload.buckets = tuple(replace(b, checksum=digest) if b.index == k else b for b in payload.buckets)
            served.delta.buckets = tuple(replace(b, delta_checksum=digest) if b.index == i else b for b in served.delta.buckets)
        assert await relay.follow_latest() == 2
        assert relay.delta_fallbacks == 1 and relay.delta_versions == 0
        for _ in range(500):  # the relay, holding 1 and the full 2, computes the delta between them itself
            if relay._server.versions[2].delta_state != "pending":
                break
            await asyncio.sleep(0.01)
        for s in subs:
            wv = await s.fetch(2)
            assert _same(wv.tensors, m2)
            s.recycle(wv)
    finally:
        await relay.close()


async def test_a_delta_evicted_while_the_relay_fetches_it_ends_in_the_full_latest(make_publisher: Any, make_subscriber: Any, sockets: Any) -> None:
    from rollpool.protocol.errors import WeightSyncError

    pub = await make_publisher()
    relay, subs, m1 = await _relay_holding_v1(pub, make_subscriber, sockets)
    try:
        m2 = _step(m1, 2)
        await _published(pub, m2, 2)
        newer: dict[str, Any] = {}
        # keep_versions=2: 2 and its delta go mid-fetch (over the bulk lane, else the ROUTER)
        relay.upstream._bulk.fetch = _evicting(relay.upstream._bulk.fetch, pub, m2, newer)
        relay.upstream._network.fetch = _evicting(relay.upstream._network.fetch, pub, m2, newer)
        with pytest.raises(WeightSyncError):  # the follow loop logs it and looks again
            await relay.follow_latest()
        assert relay.latest_version == 1 and relay.delta_fallbacks == 1 and 2 not in relay._server.versions
        assert await relay.follow_latest() == 4  # holding 1, not 3: the full version
        assert relay._server.versions[4].delta is None
        for s in subs:
            wv = await s.fetch(4)
            assert _same(wv.tensors, newer["m4"]) and wv.manifest.delta_base == -1
    finally:
        await relay.close()


async def test_a_publisher_restarted_between_versions_is_never_a_relay_s_base(make_publisher: Any, make_subscriber: Any, sockets: Any) -> None:
    pub = await make_publisher()
    endpoint, pub_endpoint = pub.router_endpoint, pub.pub_endpoint
    relay, subs, _m1 = await _relay_holding_v1(pub, make_subscriber, sockets)
    try:
        await pub.close()
        restarted = await _restarted(make_publisher, endpoint, pub_endpoint)
        r1 = _model(seed=7)  # the new run's own 1 (other bytes), then a delta of 2 against it
        await _published(restarted, r1, 1)
        r2 = _step(r1, 9)
        await _published(restarted, r2, 2)
        assert restarted._server.versions[2].delta is not None
        assert await relay.follow_latest() == 2
        assert relay.delta_versions == 0 and relay.delta_fallbacks == 1
        for _ in range(500):
            if relay._server.versions[2].delta_state != "pending":
                break
            await asyncio.sleep(0.01)
        for s in subs:
            wv = await s.fetch(2)
            assert _same(wv.tensors, r2)
    finally:
        await relay.close()
