"""Streamed publish, reserved buffers and several streams, over real ZeroMQ sockets (the network path).

What a trainer and a worker rely on: `publish` returns once the trainer may change its tensors (and the
version served is the snapshot, not what the trainer did next); buckets are served while the rest is
still checksummed; a subscriber of the previous minor version only ever sees complete manifests; a warm
publisher and subscriber allocate nothing per version.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
import pytest

torch = pytest.importorskip("torch")
zmq = pytest.importorskip("zmq")

from rollpool.protocol import decode  # noqa: E402
from rollpool.protocol.messages import Manifest  # noqa: E402

_MiB = 1024 * 1024


def big_model(seed: int, n: int = 4) -> dict[str, torch.Tensor]:
    """`n` bf16 tensors of 1 MiB: above the inline threshold, so copies and checksums run in threads."""
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.w": torch.randn(512, 1024, generator=g).to(torch.bfloat16) for i in range(n)}


class GatedExecutor(ThreadPoolExecutor):
    """Test shim for the publisher's checksum threads: every job waits until `open()`."""

    def __init__(self) -> None:
        super().__init__(2, thread_name_prefix="gated")
        self.gate = threading.Event()
        self.submitted = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        self.submitted += 1

        def gated() -> Any:
            self.gate.wait(30)
            return fn(*args, **kwargs)

        return super().submit(gated)

    def open(self) -> None:
        self.gate.set()


def old_manifest_request(rid: str) -> list[bytes]:
    """A ManifestRequest exactly as a peer of protocol minor 0 sends it (no `streamed`, no `host_key`)."""
    return [msgpack.packb([1, 0, "manifest_request", {"request_id": rid}], use_bin_type=True)]


async def test_publish_returns_before_checksums_and_buckets_stream(make_publisher: Any, make_subscriber: Any, zmq_ctx: Any) -> None:
    pub = await make_publisher(bucket_bytes=1 * _MiB, chunk_bytes=256 * 1024)
    gated = GatedExecutor()
    pub._pools.sum.shutdown()
    pub._pools = dataclasses.replace(pub._pools, sum=gated)  # the checksum threads, held back by the test
    w = big_model(1)
    snapshot = {k: t.clone() for k, t in w.items()}
    manifest = await pub.publish(w, 1)
    # returned while every checksum is still pending: the trainer may change its tensors now
    assert [b.checksum for b in manifest.buckets] == [""] * 4
    assert gated.submitted == 4
    for t in w.values():
        t.add_(1.0)  # the optimizer step right after publish

    # a subscriber of minor 0 asks: parked until the version is complete (never a pending manifest)
    old = zmq_ctx.socket(zmq.DEALER)
    old.setsockopt(zmq.LINGER, 0)
    old.connect(pub.router_endpoint)
    await old.send_multipart(old_manifest_request("old-1"))

    sub = make_subscriber(pub.router_endpoint)
    seen: list[int] = []
    fetch = asyncio.ensure_future(sub.fetch(1, on_bucket=lambda i, tensors: seen.append(i)))
    streamed = await sub.fetch_manifest(1)
    assert streamed.version == 1 and [b.checksum for b in streamed.buckets] == [""] * 4
    await asyncio.sleep(0.05)
    assert not fetch.done() and seen == []  # nothing is readable before its checksum exists
    gated.open()
    got = await asyncio.wait_for(fetch, 10)
    assert sorted(seen) == [0, 1, 2, 3]  # each bucket was handed over as it verified
    for k, t in snapshot.items():
        assert torch.equal(got.tensors[k], t), k  # the snapshot, not the trainer's next step
    reply = decode(await asyncio.wait_for(old.recv_multipart(), 10))
    assert isinstance(reply, Manifest) and reply.request_id == "old-1"
    assert all(b.checksum.startswith("xxh3_64:") for b in reply.buckets)
    assert [b.checksum for b in reply.buckets] == [b.checksum for b in got.manifest.buckets]
    old.close()
    await pub.wait_ready(1)


async def test_an_old_peer_asking_for_the_latest_gets_the_newest_complete_version(make_publisher: Any, zmq_ctx: Any) -> None:
    pub = await make_publisher(bucket_bytes=1 * _MiB)
    await pub.publish(big_model(1), 1, wait_ready=True)
    gated = GatedExecutor()
    pub._pools.sum.shutdown()
    pub._pools = dataclasses.replace(pub._pools, sum=gated)  # the checksum threads, held back by the test
    await pub.publish(big_model(2), 2)
    old = zmq_ctx.socket(zmq.DEALER)
    old.setsockopt(zmq.LINGER, 0)
    old.connect(pub.router_endpoint)
    await old.send_multipart(old_manifest_request("old-latest"))
    reply = decode(await asyncio.wait_for(old.recv_multipart(), 10))
    assert isinstance(reply, Manifest) and reply.version == 1 and all(b.checksum for b in reply.buckets)
    gated.open()
    await pub.wait_ready(2)
    old.close()


async def test_a_warm_publisher_and_subscriber_allocate_nothing_per_version(make_publisher: Any, make_subscriber: Any) -> None:
    w = big_model(0)
    pub = await make_publisher(bucket_bytes=1 * _MiB, keep_versions=2, path="network")
    reserved = pub.reserve({k: torch.empty(t.shape, dtype=t.dtype, device="meta") for k, t in w.items()})
    assert reserved == 2 * 4 * _MiB
    made = pub.stats["buffers_allocated"]
    assert made == 8
    sub = make_subscriber(pub.router_endpoint)
    assert sub.reserve(w) == 2 * 4 * _MiB and sub.buffers_allocated == 2
    sub.reserve(total_bytes=4 * _MiB)  # a second reserve (the environment's, then the worker's own) tops up: none made
    assert sub.buffers_allocated == 2
    previous = None
    for v in range(1, 6):
        w = big_model(v)
        await pub.publish(w, v)
        got = await sub.fetch(v)
        for k, t in w.items():
            assert torch.equal(got.tensors[k], t)
        if previous is not None:
            sub.recycle(previous)  # the engine copied it: its buffer takes the next fetch
        previous = got
    assert pub.stats["buffers_allocated"] == made
    assert sub.buffers_allocated == 2


async def test_a_sharded_trainer_streams_layer_by_layer_into_the_reserved_layout(make_publisher: Any, make_subscriber: Any) -> None:
    w = big_model(3)
    pub = await make_publisher(bucket_bytes=1 * _MiB)
    pub.reserve([(k, (tuple(t.shape), "bfloat16")) for k, t in w.items()])
    gathered: list[str] = []

    def layers() -> Any:
        for k, t in w.items():
            gathered.append(k)  # rank 0 gathers one layer, yields it, frees it on the next step
            yield k, t.clone()

    await pub.publish(layers(), 1)
    sub = make_subscriber(pub.router_endpoint)
    got = await sub.fetch(1)
    assert gathered == list(w) and all(torch.equal(got.tensors[k], t) for k, t in w.items())

    def wrong() -> Any:
        yield "layers.0.w", torch.zeros(3, dtype=torch.bfloat16)

    with pytest.raises(ValueError, match="layout"):
        await pub.publish(wrong(), 2)
    assert pub.latest_version == 1 and 2 not in pub.versions  # a failed snapshot is never served


async def test_a_streamed_iterator_is_never_gathered_whole(make_publisher: Any, make_subscriber: Any) -> None:
    """Rank 0's memory: at most the copy window's worth of gathered layers is alive at once, not the model."""
    import gc
    import weakref

    g = torch.Generator().manual_seed(9)
    w = {f"layers.{i}.w": torch.randn(256, 256, generator=g) for i in range(40)}  # 40 x 256 KiB
    pub = await make_publisher(bucket_bytes=1 * _MiB, copy_threads=1)
    pub.reserve(w)
    alive: weakref.WeakSet[Any] = weakref.WeakSet()
    peak = 0

    def layers() -> Any:
        nonlocal peak
        for k, t in w.items():
            gc.collect()
            peak = max(peak, len(alive))
            gathered = t.clone()  # what an all-gather of one layer hands rank 0
            alive.add(gathered)
            yield k, gathered
            del gathered

    await pub.publish(layers(), 1)
    assert peak <= 4 + 1, peak  # the window (4 x copy_threads) plus the one being handed over, not 40
    got = await make_subscriber(pub.router_endpoint).fetch(1)
    assert all(torch.equal(got.tensors[k], t) for k, t in w.items())


async def test_several_streams_fetch_one_version_and_count_as_one_peer(make_publisher: Any, make_subscriber: Any) -> None:
    w = big_model(4, n=6)
    pub = await make_publisher(bucket_bytes=1 * _MiB, chunk_bytes=128 * 1024, keep_versions=0, release_idle_s=30)
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint, streams=3, window_chunks=2)
    assert sub.dealers.streams == 3
    publish = asyncio.ensure_future(pub.publish(w, 1, expected_fetchers=1))
    await sub.wait_for_newer(0, timeout_s=10)  # the announce (PUB) of version 1
    got = await sub.fetch(1)
    assert all(torch.equal(got.tensors[k], t) for k, t in w.items())
    await asyncio.wait_for(publish, 10)  # released by one complete fetch over three sockets
    assert sub.bytes_received == 6 * _MiB


async def test_the_environment_tells_a_worker_to_reserve_before_its_first_fetch(make_publisher: Any, make_subscriber: Any,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A subscriber made without a config reads ROLLPOOL_WEIGHT_* once, when it is made (`WeightPathConfig.from_env`)."""
    w = big_model(5)
    monkeypatch.setenv("ROLLPOOL_WEIGHT_RESERVE_BYTES", str(4 * _MiB))
    monkeypatch.setenv("ROLLPOOL_WEIGHT_STREAMS", "2")
    pub = await make_publisher(bucket_bytes=1 * _MiB)
    await pub.publish(w, 1)
    sub = make_subscriber(pub.router_endpoint)  # reserves in a thread while the loop goes on
    assert sub.streams == 2
    got = await sub.fetch(1)
    assert all(torch.equal(got.tensors[k], t) for k, t in w.items())
    assert sub.buffers_allocated == 2  # the two reserved, nothing fresh for the first version


async def test_hundreds_of_small_tensors_are_copied_together_and_arrive_intact(make_publisher: Any, make_subscriber: Any) -> None:
    """An adapter's shape: hundreds of small matrices, copied in jobs of several tensors (across bucket boundaries,
    odd sizes included); every byte arrives where it belongs, and training may change them once publish returned."""
    from rollpool.weights import snapshot

    g = torch.Generator().manual_seed(11)
    w = {f"m.{i}.lora_{'AB'[i % 2]}.weight": torch.randn(4 + i % 3, 1000 + i, generator=g) for i in range(300)}  # ~15 MB
    pub = await make_publisher(bucket_bytes=3 * _MiB, copy_threads=2)
    copy_jobs = 0
    copy_many = snapshot.Snapshot._copy_many

    def counted(self: Any, jobs: Any) -> None:
        nonlocal copy_jobs
        copy_jobs += 1
        copy_many(self, jobs)

    snapshot.Snapshot._copy_many = counted  # type: ignore[method-assign]
    try:
        await pub.publish(w, 1)
    finally:
        snapshot.Snapshot._copy_many = copy_many  # type: ignore[method-assign]
    expected = {k: t.clone() for k, t in w.items()}
    for t in w.values():
        t.add_(1.0)  # a training step after publish returned
    got = await make_subscriber(pub.router_endpoint).fetch(1)
    assert got.tensors.keys() == expected.keys()
    assert all(torch.equal(got.tensors[k], t) for k, t in expected.items())
    assert copy_jobs < 20  # not a job (a thread hop) per tensor
