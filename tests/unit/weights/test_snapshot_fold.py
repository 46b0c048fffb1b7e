"""A bucket's checksum folded as its copies land: what a worker relies on is that the checksum the publisher announces is
the checksum of the bucket's bytes, however its copies landed, and that it is summed while copies still land."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from rollpool.protocol.messages import TensorInfo  # noqa: E402
from rollpool.weights import snapshot  # noqa: E402
from rollpool.weights.bucketing import checksum, default_checksum_algorithm, flat_bytes  # noqa: E402
from rollpool.weights.snapshot import Snapshot, SnapshotKnobs, SnapshotPools, _Fold, plan_version  # noqa: E402

_MiB = 1024 * 1024


class RecordingSink:
    """A stand-in for the `WeightServer` (the snapshot's `SnapshotSink`): records what each bucket published."""

    def __init__(self) -> None:
        self.checksums: dict[int, str] = {}

    def complete_bucket(self, version: int, bucket: int, checksum: str) -> None:
        self.checksums[bucket] = checksum

    def set_host_mix64(self, version: int, bucket: int, checksum: str) -> None:  # shm versions only: not these
        raise AssertionError("no mix64 on a host-memory version")

    def bytes_landed(self, version: int) -> None:
        pass


def adapter_like(seed: int, n: int = 32) -> dict[str, torch.Tensor]:
    """Matrices of a few hundred KB, odd sizes: several fold ranges in one bucket."""
    g = torch.Generator().manual_seed(seed)
    return {f"m.{i}.lora_{'AB'[i % 2]}.weight": torch.randn(16, 3000 + 37 * i, generator=g).to(torch.bfloat16) for i in range(n)}


def made(named: dict[str, torch.Tensor], bucket_bytes: int, copy_threads: int = 1) -> tuple[Snapshot, list[Any], SnapshotPools, RecordingSink]:
    _items, places, planner = plan_version(named, bucket_bytes, None)
    assert places is not None
    algorithm = default_checksum_algorithm()
    knobs = SnapshotKnobs(publisher_id="p", chunk_bytes=1 * _MiB, host_key="", pool="t", copy_threads=copy_threads,
                          checksum_algorithm=algorithm)
    pools = SnapshotPools.make(1, 1)  # one checksum thread: a no-op submitted after the folds runs after them
    sink = RecordingSink()
    buffers = [torch.full((b.nbytes,), 0xAB, dtype=torch.uint8) for b in planner.buckets]  # stale bytes of a reused buffer
    snap = Snapshot(knobs, pools, sink, 1, places, planner, buffers, [None] * len(buffers))
    for b in planner.buckets:
        snap.left[b.index] = sum(1 for t in b.tensors if t.nbytes)
    return snap, places, pools, sink


def land(snap: Snapshot, place: Any, tensor: torch.Tensor) -> None:
    """What a copy thread does for one tensor: its bytes into its place, then `_landed`."""
    src = flat_bytes(tensor)
    snap.buffers[place.bucket][place.offset : place.offset + src.numel()].copy_(src)
    snap._landed(place.bucket, None, place.offset)


@pytest.mark.parametrize("order", ["shuffled", "reversed", "in_order"])
async def test_the_folded_checksum_is_the_whole_buckets_however_copies_land(order: str) -> None:
    named = adapter_like(3)
    snap, places, pools, sink = made(named, bucket_bytes=2 * _MiB)  # 3.7 MB: two buckets, each folded
    assert len(snap.buffers) == 2 and all(f is not None for f in snap.folds)
    tensors = list(named.values())
    landing = list(range(len(places)))
    if order == "shuffled":
        random.Random(5).shuffle(landing)
    elif order == "reversed":
        landing.reverse()
    try:
        for i in landing:
            land(snap, places[i], tensors[i])
        await asyncio.wait_for(snap.checksummed, 10)
    finally:
        pools.shutdown()
    algorithm = default_checksum_algorithm()
    for idx, buf in enumerate(snap.buffers):
        assert sink.checksums[idx] == checksum(buf.numpy(), algorithm), f"bucket {idx} ({order})"
    assert all(s.ready for s in snap.sources)


async def test_a_bucket_is_summed_while_its_copies_still_land() -> None:
    named = adapter_like(4, n=16)
    snap, places, pools, sink = made(named, bucket_bytes=64 * _MiB)  # one bucket
    fold = snap.folds[0]
    assert fold is not None
    tensors = list(named.values())
    try:
        for i in range(len(places) - 1):  # every copy but the last, in order
            land(snap, places[i], tensors[i])
        await asyncio.wrap_future(pools.sum.submit(lambda: None))  # the folds queued so far have run
        assert fold.pos >= 1 * _MiB  # summed before the last copy landed
        assert sink.checksums == {} and not snap.sources[0].ready  # and not readable before its checksum is whole
        land(snap, places[-1], tensors[-1])
        await asyncio.wait_for(snap.checksummed, 10)
    finally:
        pools.shutdown()
    assert sink.checksums[0] == checksum(snap.buffers[0].numpy(), default_checksum_algorithm())


async def test_without_folding_the_bucket_is_summed_after_its_last_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The previous behaviour stays one switch away (bench/lora.py's ``--compare-what checksums``), with the same digest."""
    monkeypatch.setattr(snapshot, "_FOLD_CHECKSUMS", False)
    named = adapter_like(3)
    snap, places, pools, sink = made(named, bucket_bytes=64 * _MiB)
    assert snap.folds == [None]
    try:
        for p, t in zip(places, named.values(), strict=True):
            land(snap, p, t)
        await asyncio.wait_for(snap.checksummed, 10)
    finally:
        pools.shutdown()
    assert sink.checksums[0] == checksum(snap.buffers[0].numpy(), default_checksum_algorithm())


def test_fold_ranges_cover_the_bucket_once_in_order_gaps_and_tail_included() -> None:
    # tensors at [8, 108), [108, 208), [300, 400) of a 512-byte bucket: a gap at 0, between, and a tail
    tensors = [TensorInfo("a", "uint8", (100,), 8, 100), TensorInfo("b", "uint8", (100,), 108, 100),
               TensorInfo("z", "uint8", (0,), 208, 0), TensorInfo("c", "uint8", (100,), 300, 100)]
    f = _Fold(default_checksum_algorithm(), 512, tensors)
    f.land(108)
    assert f.take(0) is None  # "a" before it has not landed
    f.land(8)
    assert f.take(500) is None  # fewer than asked for, and not the bucket's end
    assert f.take(0) == (0, 208)
    f.land(300)
    assert f.take(10**6) == (208, 512)  # the bucket's end is handed out whatever its size
    assert f.take(0) is None


@pytest.mark.parametrize(("cores", "folded"), [(2, False), (16, True)])
async def test_cpu_tensors_are_folded_only_with_a_core_to_spare(monkeypatch: pytest.MonkeyPatch, cores: int, folded: bool) -> None:
    """CPU tensors are copied by the copy threads: a fold beside them needs a core of its own, else it only slows the copy
    the trainer waits for. Either way the digest is the bucket's. (With the checksums summed as buckets land, not held
    until the last copy: `_SUMS_AFTER_COPIES` False.)"""
    monkeypatch.setattr(snapshot, "host_cores", lambda: cores)
    monkeypatch.setattr(snapshot, "_SUMS_AFTER_COPIES", False)
    named = adapter_like(6)
    snap, _places, pools, sink = made(named, bucket_bytes=64 * _MiB, copy_threads=2)
    try:
        await snap.copy(list(named.items()))
        await asyncio.wait_for(snap.checksummed, 10)
    finally:
        pools.shutdown()
    assert (snap.folds[0] is not None) is folded
    assert sink.checksums[0] == checksum(snap.buffers[0].numpy(), default_checksum_algorithm())


async def test_cpu_tensors_checksums_wait_for_the_versions_last_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer waits for its CPU tensors' copies, not for the checksums: no bucket is summed (its reads competing
    with the copies for the host's memory bandwidth and cores) before the version's last copy landed; then every bucket
    is, with its bytes' digest, and is served."""
    copies: list[int] = []
    summed_after: dict[int, int] = {}
    real_copy, real_checksum = snapshot.host_copy, Snapshot._checksum

    def slow_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        real_copy(dst, src)
        time.sleep(0.01)  # a copy takes a while: a checksum queued early would run before the later copies
        copies.append(1)

    def checksum_seen(self: Snapshot, idx: int) -> None:
        summed_after[idx] = len(copies)
        real_checksum(self, idx)

    monkeypatch.setattr(snapshot, "host_copy", slow_copy)
    monkeypatch.setattr(Snapshot, "_checksum", checksum_seen)
    g = torch.Generator().manual_seed(8)
    named = {f"w{i}": torch.randn(512, 1024, generator=g).to(torch.bfloat16) for i in range(6)}  # 1 MiB each
    snap, _places, pools, sink = made(named, bucket_bytes=2 * _MiB)  # three buckets
    assert len(snap.buffers) == 3
    try:
        await snap.copy(list(named.items()))
        await asyncio.wait_for(snap.checksummed, 10)
    finally:
        pools.shutdown()
    assert summed_after == {0: 6, 1: 6, 2: 6}
    algorithm = default_checksum_algorithm()
    assert [sink.checksums[i] for i in range(3)] == [checksum(b.numpy(), algorithm) for b in snap.buffers]
    assert all(s.ready for s in snap.sources)


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 2), (16, 15), (64, 16)])
def test_a_publisher_copies_cpu_tensors_with_up_to_16_threads(monkeypatch: pytest.MonkeyPatch, cores: int, threads: int) -> None:
    from rollpool.weights import config

    monkeypatch.setattr(config.os, "cpu_count", lambda: cores)
    assert config.default_host_copy_threads() == threads


def test_a_host_copy_writes_the_tensors_bytes_and_takes_torchs_copy_where_numpy_cannot_view() -> None:
    from rollpool.weights.bucketing import flat_bytes
    from rollpool.weights.snapshot import host_copy

    src = torch.randn(1001, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.zeros(2 * 1001 + 6, dtype=torch.uint8)
    host_copy(dst[3 : 3 + 2002], flat_bytes(src))
    assert dst[3 : 3 + 2002].numpy().tobytes() == src.view(torch.int16).numpy().tobytes()
    assert not dst[:3].any() and not dst[-3:].any()  # nothing written outside its place
    neg = torch.randn(5)._neg_view()  # numpy cannot view a tensor with the negative bit: torch copies it
    out = torch.empty(5)
    host_copy(out, neg)
    assert torch.equal(out, -neg._neg_view())
