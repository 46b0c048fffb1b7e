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
from rollpool.protocol.messages import BucketInfo, Manifest  # noqa: E402
from rollpool.protocol.metrics import MemoryMetricsSink  # noqa: E402
from rollpool.weights.cuda_ipc import DeviceSlabs, mix64_checksum, mix64_reference  # noqa: E402
from rollpool.weights.memory import SHM_DIR, SHM_HEADER_BYTES  # noqa: E402
from rollpool.weights.serving import WeightServer  # noqa: E402
from rollpool.weights.subscriber import WeightSubscriber  # noqa: E402

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

    def stage(self, src: torch.Tensor, dst: torch.Tensor) -> Any:
        dst.copy_(src)
        self.copies += 1
        return dst

    def digest(self, handle: Any) -> str:
        return mix64_checksum(handle)


def model(seed: int, n: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"layers.{i}.w": torch.randn(256, 1024, generator=g).to(torch.bfloat16) for i in range(n)}
    out["norm"] = torch.randn(1024, generator=g)
    out["odd"] = torch.randn(5, generator=g).to(torch.bfloat16)  # 10 bytes: a tail word
    return out


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(want) and all(torch.equal(got[k], t) for k, t in want.items())


def staging(make_subscriber: Any, router: str, **kw: Any) -> WeightSubscriber:
    """A subscriber as a worker whose engine stages to CUDA makes it, with the device faked."""
    sub: WeightSubscriber = make_subscriber(router, path=kw.pop("path", "auto"), **kw)
    sub.stage_device = "fake:0"
    sub.device_ops = FakeDevice
    return sub


def segment_bytes(segment: str, nbytes: int) -> bytes:
    with open(os.path.join(SHM_DIR, segment), "rb") as f:
        f.seek(SHM_HEADER_BYTES)
        return f.read(nbytes)


def flip(segment: str, offset: int) -> tuple[str, int]:
    path = os.path.join(SHM_DIR, segment)
    pos = SHM_HEADER_BYTES + offset
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x5A]))
    return path, pos


async def test_buckets_go_from_the_segments_to_the_device_verified_by_the_publishers_mix64(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher(pool="tdev", publisher_id="pubdev1")
    w = model(1)
    manifest = await pub.publish(w, 1, wait_ready=True)
    # the publisher's mix64 of each bucket's host bytes (CPU tensors: summed on the CPU) is the reference digest
    for b in manifest.buckets:
        assert b.host_mix64 == mix64_reference(segment_bytes(b.shm_segment, b.nbytes))
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
    assert len(sub._readers) == 2 * len(manifest.buckets)  # both versions' segments stay mapped


async def test_without_a_staging_device_the_cpu_shm_path_serves(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher()
    w = model(2)
    await pub.publish(w, 1, wait_ready=True)
    sub = make_subscriber(pub.router_endpoint, path="auto")
    got = await sub.fetch(1)
    assert same(got.tensors, w) and sub.last_path == "shm" and sub.device_stage_bytes == 0 and sub.fallbacks == {}


async def test_a_publisher_without_gpu_checksums_is_a_counted_fallback_to_the_cpu_shm_path(make_publisher: Any, make_subscriber: Any,
                                                                                         monkeypatch: Any) -> None:
    # an older publisher (minor 9) faked: it never publishes host_mix64
    monkeypatch.setattr(WeightServer, "set_host_mix64", lambda self, version, bucket, checksum: None)
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
    path, pos = flip(manifest.buckets[0].shm_segment, 100)

    class RestoreOnRefetch(MemoryMetricsSink):
        """Fake sink: the first refetch of bucket 0 restores the byte (a transient fault in the shared memory)."""

        def event(self, name: str, fields: dict[str, Any]) -> None:
            super().event(name, fields)
            if name == "bucket_refetched" and fields["bucket"] == 0 and fields["path"] == "shm_device":
                flip(os.path.basename(path), pos - SHM_HEADER_BYTES)

    sub = staging(make_subscriber, pub.router_endpoint, metrics=RestoreOnRefetch())
    got = await sub.fetch(1)
    assert sub.buckets_refetched == 1 and sub.last_path == "shm" and sub.device_stage_bytes > 0
    assert same(got.tensors, w)  # the bytes handed to the engine are the good ones


async def test_a_segment_that_stays_corrupt_is_never_staged_into_an_applied_version(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher()
    manifest = await pub.publish(model(5), 1, wait_ready=True)
    flip(manifest.buckets[-1].shm_segment, 8)
    sub = staging(make_subscriber, pub.router_endpoint, max_refetch=2)
    seen: list[int] = []
    with pytest.raises(WeightSyncError, match="checksum"):
        await sub.fetch(1, on_bucket=lambda i, _t: seen.append(i))
    assert len(manifest.buckets) - 1 not in seen  # the bad bucket never reached the engine's staging
    assert sub.buckets_refetched == 3


def _manifest(**kw: Any) -> Manifest:
    b = BucketInfo(index=0, dtype="float32", nbytes=32, checksum="", shm_segment="rollpool-p-x-1-1", host_mix64="mix64:0123456789abcdef")
    fields: dict[str, Any] = {"request_id": "m", "version": 3, "host_key": "boot/shm", "buckets": (b,)}
    fields.update(kw)
    return Manifest(**fields)


def _chooser(path: str, device: str | None, host: str = "boot/shm") -> WeightSubscriber:
    sub = WeightSubscriber.__new__(WeightSubscriber)  # the choice alone, no sockets
    sub.path, sub.host_key, sub.stage_device = path, host, device
    return sub


def test_the_choice_needs_a_staging_device_a_shm_path_and_this_host() -> None:
    m = _manifest()
    assert _chooser("auto", "fake:0")._shm_device_choice(m)
    assert _chooser("shm", "fake:0")._shm_device_choice(m)
    assert not _chooser("auto", None)._shm_device_choice(m)  # no staging engine: the CPU shm path
    assert not _chooser("network", "fake:0")._shm_device_choice(m)
    assert not _chooser("cuda_ipc", "fake:0")._shm_device_choice(m)
    assert not _chooser("auto", "fake:0", host="other/shm")._shm_device_choice(m)  # another host: the CPU path explains
    assert not _chooser("auto", "fake:0")._shm_device_choice(_manifest(host_key=""))
