"""The shared-memory path staged to the engine's device (CPU-runnable: the device edge is faked, `FakeDevice`).

The worker copies each bucket from the publisher's mapped segment straight to its device and verifies the publisher's
`host_mix64` on the device copy; it is chosen when the subscriber has a staging device and the manifest carries the GPU
checksums, and falls back (logged, counted) to the CPU shared-memory path otherwise. A corrupt segment is refetched
and never applied. The real device is exercised by tests/gpu/test_shm_device_gpu.py.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from rollpool.protocol.errors import WeightSyncError  # noqa: E402
from rollpool.protocol.messages import Manifest  # noqa: E402
from rollpool.protocol.metrics import MemoryMetricsSink  # noqa: E402
from rollpool.weights.gpu import DeviceSlabs, mix64_checksum, mix64_reference  # noqa: E402
from rollpool.weights.memory import SHM_DIR  # noqa: E402
from rollpool.weights.serving import WeightServer  # noqa: E402
from rollpool.weights.subscriber import WeightSubscriber  # noqa: E402

from .segments import RestoreOnRefetch, bucket_bytes, flip_byte  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")

NO_GPU_CHECKSUM = "the publisher gives no GPU checksum (host_mix64) for this version"


class FakeDevice:
    """Fake of the device edge (no GPU here): "device" buffers are CPU tensors, the host-to-device copy is a CPU copy
    and the checksum of the copy is the same `mix64` the GPU runs (plain torch ops). Nothing is registered."""

    registers = False
    made: list[FakeDevice] = []

    def __init__(self, device: str, slabs: DeviceSlabs) -> None:
        self.device = device
        self.copies = 0
        FakeDevice.made.append(self)

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, slab: torch.Tensor) -> None:
        pass

    def scratch(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def stage(self, src: torch.Tensor, dst: torch.Tensor) -> Any:
        dst.copy_(src)
        self.copies += 1
        return dst

    def digest(self, handle: Any) -> str:
        return mix64_checksum(handle)


class DeviceMemory(torch.Tensor):
    """A CPU tensor that says it is CUDA memory (`is_cuda`), as a real device's buffers do (fake, named so)."""

    @property
    def is_cuda(self) -> bool:
        return True


class FakeCudaDevice(FakeDevice):
    """`FakeDevice` whose buffers say they are CUDA memory, as the real edge's are."""

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8).as_subclass(DeviceMemory)


def model(seed: int, n: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"layers.{i}.w": torch.randn(256, 1024, generator=g).to(torch.bfloat16) for i in range(n)}
    out["norm"] = torch.randn(1024, generator=g)
    out["odd"] = torch.randn(5, generator=g).to(torch.bfloat16)  # 10 bytes: a tail word
    return out


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(want) and all(torch.equal(got[k], t) for k, t in want.items())


def staging(make_subscriber: Any, router: str | None, **kw: Any) -> WeightSubscriber:
    """A subscriber as a worker whose engine stages to CUDA makes it, with the device faked."""
    sub: WeightSubscriber = make_subscriber(router, path=kw.pop("path", "auto"), **kw)
    sub.stage_device = "fake:0"
    sub.device_ops = FakeDevice
    return sub


async def test_buckets_go_from_the_segments_to_the_device_verified_by_the_publishers_mix64(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher(pool="tdev", publisher_id="pubdev1")
    w = model(1)
    manifest = await pub.publish(w, 1, wait_ready=True)
    # the publisher's mix64 of each bucket's host bytes (CPU tensors: summed on the CPU) is the reference digest
    for b in manifest.buckets:
        assert b.host_mix64 == mix64_reference(bucket_bytes(b.shm_segment, b.nbytes))
    sub = staging(make_subscriber, pub.router_endpoint)
    seen: list[int] = []
    got = await sub.fetch(1, on_bucket=lambda i, _t: seen.append(i))
    total = sum(b.nbytes for b in manifest.buckets)
    assert same(got.tensors, w) and sorted(seen) == list(range(len(manifest.buckets)))
    assert sub.last_path == "shm" and sub.fallbacks == {} and sub.device_stage_bytes == total
    assert sub.bytes_received == 0 and pub.bytes_served == 0  # no bucket byte on a socket
    for v in (2, 3, 4):  # the segments are reused: mapped once, the mappings kept
        w = model(v)
        await pub.publish(w, v, wait_ready=True)
        got = await sub.fetch(v)
        assert same(got.tensors, w) and sub.last_path == "shm"
    assert sub.device_stage_bytes == 4 * total and sub.fallbacks == {}
    assert len(sub.segments.readers) == 2 * len(manifest.buckets)  # both versions' segments stay mapped


async def test_without_a_staging_device_the_cpu_shm_path_serves(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher()
    w = model(2)
    await pub.publish(w, 1, wait_ready=True)
    sub = make_subscriber(pub.router_endpoint, path="auto")
    got = await sub.fetch(1)
    assert same(got.tensors, w) and sub.last_path == "shm" and sub.device_stage_bytes == 0 and sub.fallbacks == {}


async def test_a_publisher_without_gpu_checksums_is_a_counted_fallback_to_the_cpu_shm_path(make_publisher: Any, make_subscriber: Any,
                                                                                         monkeypatch: Any) -> None:
    # an older publisher (minor 9) faked: it never publishes host_mix64, and says an older minor on its manifests
    monkeypatch.setattr(WeightServer, "set_host_mix64", lambda self, version, bucket, checksum: None)
    monkeypatch.setattr("rollpool.weights.serving.PROTOCOL_MINOR", 9)
    pub = await make_publisher()
    w = model(3)
    await pub.publish(w, 1, wait_ready=True)
    events = MemoryMetricsSink()
    sub = staging(make_subscriber, pub.router_endpoint, metrics=events)
    got = await sub.fetch(1)
    assert same(got.tensors, w) and sub.last_path == "shm" and sub.device_stage_bytes == 0
    assert sub.fallbacks == {NO_GPU_CHECKSUM: 1}
    assert any(name == "weights_fallback" and f["from"] == "shm_device" for name, f in events.events)


async def test_a_corrupt_segment_is_restaged_and_then_verified_on_the_device(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher()
    w = model(4)
    manifest = await pub.publish(w, 1, wait_ready=True)
    flip_byte(manifest.buckets[0].shm_segment, 100)
    restore = RestoreOnRefetch(manifest.buckets[0].shm_segment, 100, path="shm_device")
    sub = staging(make_subscriber, pub.router_endpoint, metrics=restore)
    got = await sub.fetch(1)
    assert sub.buckets_refetched == 1 and sub.last_path == "shm" and sub.device_stage_bytes > 0
    assert same(got.tensors, w)  # the bytes handed to the engine are the good ones


async def test_a_segment_that_stays_corrupt_is_never_staged_into_an_applied_version(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher()
    manifest = await pub.publish(model(5), 1, wait_ready=True)
    flip_byte(manifest.buckets[-1].shm_segment, 8)
    sub = staging(make_subscriber, pub.router_endpoint, max_refetch=2)
    seen: list[int] = []
    with pytest.raises(WeightSyncError, match="checksum"):
        await sub.fetch(1, on_bucket=lambda i, _t: seen.append(i))
    assert len(manifest.buckets) - 1 not in seen  # the bad bucket never reached the engine's staging
    assert sub.buckets_refetched == 3


async def _until(cond: Any, what: str) -> None:
    import asyncio

    for _ in range(500):  # a bound on the wait, not a timing assertion
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def test_a_staging_subscriber_maps_the_reserved_segments_before_the_first_version(make_publisher: Any, make_subscriber: Any) -> None:
    """Minor 11: the publisher's reserve names its segments on every manifest (the empty version -1 one too), and a
    subscriber that stages to its GPU maps (on CUDA: page-locks) them in a thread, so no version pays it."""
    pub = await make_publisher(pool="tahead", publisher_id="pubahead1")
    w = model(7)
    pub.reserve(w)
    sub = staging(make_subscriber, pub.router_endpoint)
    segments = pub._server.shm_reserved
    assert len(segments) >= 2 and pub.latest_version == -1  # two versions' worth of segments, no version yet
    await _until(lambda: sub.segments_registered_ahead == len(segments), "every reserved segment mapped ahead")
    # and the staging path warmed before the first version: one small copy out of every segment and one full slice
    await _until(lambda: sub.segments.ops is not None and sub.segments.ops.copies == len(segments) + 1, "the staging path warmed up")
    maps = sub.segment_maps
    assert maps == len(segments)
    for v in (1, 2, 3, 4):
        w = model(v)
        await pub.publish(w, v, wait_ready=True)
        got = await sub.fetch(v)
        assert same(got.tensors, w) and sub.last_path == "shm" and sub.fallbacks == {}
    assert sub.segment_maps == maps  # no version mapped a segment: all of them were mapped before the first


async def test_segments_made_after_the_subscriber_connected_are_announced_and_mapped_ahead(make_publisher: Any,
                                                                                           make_subscriber: Any) -> None:
    pub = await make_publisher(pool="tahead2", publisher_id="pubahead2")
    sub = staging(make_subscriber, pub.router_endpoint, pub=pub.pub_endpoint)
    await pub.publish(model(1, n=1), 1, wait_ready=True)  # a smaller layout: its segments are made by this version
    await _until(lambda: sub.segments_registered_ahead >= 1, "the first version's segments mapped ahead")
    pub.set_path("network")
    pub.set_path("auto")  # the old segments are freed; the reserve below makes new ones and announces their generation
    w = model(2)
    pub.reserve(w)
    segments = {s.name for s in pub._server.shm_reserved}
    await _until(lambda: segments <= set(sub.segments.readers), "the new segments mapped ahead after the announce")
    maps = sub.segment_maps
    got = await sub.fetch((await pub.publish(w, 2, wait_ready=True)).version)
    assert same(got.tensors, w) and sub.last_path == "shm" and sub.segment_maps == maps


async def test_a_minor10_peer_gets_its_manifest_from_a_publisher_that_names_its_segments(make_publisher: Any, make_subscriber: Any,
                                                                                           zmq_ctx: Any) -> None:
    """The previous minor: a raw minor-10 manifest request is answered (the new fields ride along; older decoders ignore
    fields they do not know), and a minor-10 manifest (no `shm_reserved`) makes a staging subscriber map nothing ahead."""
    import msgpack
    import zmq

    from rollpool.protocol.codec import decode

    pub = await make_publisher(pool="tahead3", publisher_id="pubahead3")
    pub.reserve(model(3))
    dealer = zmq_ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.router_endpoint)
    try:
        await dealer.send_multipart([msgpack.packb([1, 10, "manifest_request", {"request_id": "old", "streamed": True}], use_bin_type=True)])
        reply = decode(await dealer.recv_multipart())
    finally:
        dealer.close(linger=0)
    assert isinstance(reply, Manifest) and reply.request_id == "old" and reply.version == -1 and len(reply.shm_reserved) >= 2
    old = decode([msgpack.packb([1, 10, "manifest", {"request_id": "m", "version": -1, "host_key": "boot/shm"}], use_bin_type=True)])
    assert old.shm_reserved == ()
    ann = decode([msgpack.packb([1, 10, "announce", {"version": 1, "publisher_id": "p", "total_bytes": 1, "num_buckets": 1}],
                                use_bin_type=True)])
    assert ann.shm_generation == 0
    sub = staging(make_subscriber, None)  # not connected: only this manifest names segments to it
    sub.segments.register_ahead(old)
    assert sub.segments.ahead_thread is None  # nothing named: nothing to map ahead


@pytest.mark.parametrize("device", [FakeDevice, FakeCudaDevice], ids=["device_fake", "cuda_like_fake"])
async def test_a_version_staged_on_the_device_leaves_no_stale_delta_base(make_publisher: Any, make_subscriber: Any,
                                                                         monkeypatch: Any, device: Any) -> None:
    """A subscriber whose version 1 sits in host buffers and version 2 on the device holds no delta base: its request
    for version 3 names none (not the stale 1, which no server offers a delta against), and version 1's host buffer
    goes back when the worker hands it back."""
    monkeypatch.setenv("ROLLPOOL_WEIGHT_DELTA", "1")
    pub = await make_publisher()
    named: list[tuple[int | None, int]] = []
    hello = pub._server.on_manifest_request

    def note(req: Any) -> None:
        named.append((req.version, req.delta_base))
        if hello is not None:
            hello(req)

    pub._server.on_manifest_request = note
    sub = make_subscriber(pub.router_endpoint, path="auto")  # no staging device yet: version 1 lands in host buffers
    w1 = model(21)
    await pub.publish(w1, 1, wait_ready=True)
    v1 = await sub.fetch(1)
    assert same(v1.tensors, w1) and sub.device_stage_bytes == 0
    sub.stage_device, sub.device_ops = "fake:0", device  # the engine now stages to its device
    w2 = model(22)  # every element new: no delta against 1 (past weight_delta_max_fraction), the full version is staged
    await pub.publish(w2, 2, wait_ready=True)
    v2 = await sub.fetch(2)
    assert same(v2.tensors, w2) and sub.device_stage_bytes > 0 and sub.delta_versions == 0
    free_before = len(sub.buffers.pool.free_sizes())
    sub.recycle(v1)  # the worker hands back the version its engine no longer serves
    assert len(sub.buffers.pool.free_sizes()) == free_before + 1
    w3 = model(23)
    await pub.publish(w3, 3, wait_ready=True)
    named.clear()
    asked = pub.stats["full_manifests_to_delta_askers"]
    v3 = await sub.fetch(3)
    assert same(v3.tensors, w3) and sub.last_path == "shm"
    assert named and all(base == -1 for _version, base in named), named
    assert pub.stats["full_manifests_to_delta_askers"] == asked
