"""`WeightPublisher`: the trainer's side of the weight-publish channel.

``await publish(named_tensors, version)`` snapshots the tensors into the
publisher's own CPU buckets (one copy per byte, done in worker threads so the
event loop keeps serving; training may change its tensors as soon as publish
returns), computes each bucket's checksum, keeps the newest `keep_versions`
versions, announces the new one on PUB and serves manifests and chunks on
ROUTER (see `serving.py` for the serving guarantees).

Snapshot cost: a dict or a module has known sizes, so each bucket is allocated
once at its final size and tensors are copied by parallel threads, each bucket
checksummed as soon as its last copy lands. Buffers of evicted versions are
reused (fresh memory costs page faults, several times the copy itself), but
never one of which a chunk is still queued for a peer. With ``keep_versions``
>= 2 the versions this publish evicts are evicted before the snapshot (a newer
complete version stays served), so memory peaks at K versions; with K = 1 the
old version is served until the new one is ready and its buffers wait as
spares for the next publish. An iterator (a sharded trainer streaming layer by
layer) is copied as it comes, into buckets that grow as needed.

``keep_versions=0`` is for models too big to copy: nothing is snapshotted;
``publish`` serves the caller's own tensors and returns only when the version
is released (every expected fetcher got every byte, or no request for it came
for `release_idle_s`, or `max_hold_s` passed). The caller must not change the
tensors until then. After release the manifest stays the latest (so
subscribers learn the version number) but fetches answer ``gone``. Contiguous
CPU tensors are served in place; others are copied once (to CPU, contiguous).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from rollpool.protocol.messages import BucketInfo, Manifest, TensorInfo
from rollpool.protocol.metrics import MetricsSink, NullMetricsSink
from rollpool.protocol.sockets import SocketFactory
from rollpool.weights.bucketing import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_CHUNK_BYTES,
    BucketPacker,
    BucketPlanner,
    Checksummer,
    PackedBucket,
    checksum_supported,
    default_checksum_algorithm,
    dtype_name,
    flat_bytes,
    named_tensors_of,
    tensor_bytes,
)
from rollpool.weights.serving import MAX_CHUNK_BYTES, ServedVersion, WeightServer, new_server_id
from rollpool.weights.wire import build

__all__ = ["WeightPublisher"]

log = logging.getLogger(__name__)

_MiB = 1024 * 1024
_COPY_THREADS = min(4, os.cpu_count() or 1)
"""Threads that copy tensors into a snapshot's buckets."""
_THREAD_COPY_BYTES = 1 * _MiB
"""Tensors at least this large are copied in a worker thread (smaller ones inline: a thread hop costs more)."""


class ContiguousSource:
    """A bucket held as one contiguous uint8 CPU tensor: chunks are zero-copy slices.

    Every chunk handed out is a numpy slice that holds a reference to
    `array` until ZeroMQ has sent it, so `in_flight` tells when the buffer
    may be written again (a recycled buffer must not change bytes still
    queued for a slow peer).
    """

    __slots__ = ("data", "array")

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.array = data.numpy()

    def read(self, offset: int, nbytes: int) -> Any:
        return self.array[offset : offset + nbytes].data

    def in_flight(self) -> bool:
        # the attribute and getrefcount's own argument; anything more is a chunk still held
        return sys.getrefcount(self.array) > 2


class PiecesSource:
    """A bucket made of the caller's tensors (keep_versions=0): a chunk within one tensor is a zero-copy slice."""

    __slots__ = ("pieces", "starts")

    def __init__(self, pieces: list[tuple[int, memoryview]]) -> None:
        self.pieces = pieces
        self.starts = [p[0] for p in pieces]

    def read(self, offset: int, nbytes: int) -> Any:
        import bisect

        i = max(0, bisect.bisect_right(self.starts, offset) - 1)
        parts: list[memoryview] = []
        end = offset + nbytes
        pos = offset
        while pos < end and i < len(self.pieces):
            start, view = self.pieces[i]
            stop = start + view.nbytes
            if stop > pos:
                parts.append(view[pos - start : min(end, stop) - start])
                pos = min(end, stop)
            i += 1
        if len(parts) == 1:
            return parts[0]
        return b"".join(parts)


def _cpu_bytes(tensor: torch.Tensor) -> memoryview:
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return t.reshape(-1).view(torch.uint8).numpy().data


class WeightPublisher:
    """Versioned tensor buckets served over ROUTER, announced on PUB."""

    def __init__(
        self,
        sockets: SocketFactory,
        *,
        router_endpoint: str = "tcp://127.0.0.1:*",
        pub_endpoint: str | None = "tcp://127.0.0.1:*",
        keep_versions: int = 2,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        metrics: MetricsSink | None = None,
        publisher_id: str | None = None,
        announce_interval_s: float = 1.0,
        release_idle_s: float = 10.0,
        max_hold_s: float = 600.0,
        checksum_algorithm: str | None = None,
    ) -> None:
        if keep_versions < 0:
            raise ValueError(f"keep_versions must be >= 0, got {keep_versions}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        if not 4096 <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [4096, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
        if release_idle_s <= 0 or max_hold_s <= 0:
            raise ValueError("release_idle_s and max_hold_s must be > 0")
        self.checksum_algorithm = checksum_algorithm or default_checksum_algorithm()
        if not checksum_supported(self.checksum_algorithm):
            raise ValueError(f"checksum_algorithm {self.checksum_algorithm!r} is not available here (xxh3_64 needs the xxhash package; crc32 always works)")
        self.keep_versions = keep_versions
        self.bucket_bytes = bucket_bytes
        self.chunk_bytes = chunk_bytes
        self.publisher_id = publisher_id or new_server_id()
        self.release_idle_s = release_idle_s
        self.max_hold_s = max_hold_s
        self.metrics: MetricsSink = metrics or NullMetricsSink()
        self._server = WeightServer(
            sockets,
            router_endpoint=router_endpoint,
            pub_endpoint=pub_endpoint,
            name="publisher",
            announce_interval_s=announce_interval_s,
            metrics=self.metrics,
        )
        self._latest = -1
        self._spare: list[ContiguousSource] = []
        """Buckets of evicted versions, reused by the next snapshot once nothing of theirs is in flight."""
        self._released_manifest: ServedVersion | None = None
        self._lock = asyncio.Lock()
        self._served_event = asyncio.Event()
        self._server.on_served = lambda v: self._served_event.set()

    # -- lifecycle

    async def start(self) -> None:
        await self._server.start()
        log.info("weight publisher %s serving on %s, announcing on %s", self.publisher_id, self.router_endpoint, self.pub_endpoint)

    async def close(self) -> None:
        await self._server.close()

    async def __aenter__(self) -> WeightPublisher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def router_endpoint(self) -> str:
        return self._server.router_endpoint

    @property
    def pub_endpoint(self) -> str | None:
        return self._server.pub_endpoint

    @property
    def latest_version(self) -> int:
        return self._latest

    @property
    def versions(self) -> list[int]:
        """Versions whose bytes are served now, oldest first."""
        return sorted(self._server.versions)

    @property
    def bytes_served(self) -> int:
        return self._server.bytes_served

    @property
    def stats(self) -> dict[str, int]:
        s = self._server
        return {
            "latest_version": self._latest,
            "bytes_served": s.bytes_served,
            "chunks_served": s.chunks_served,
            "dropped_replies": s.dropped_replies,
            "protocol_errors": s.protocol_errors,
        }

    # -- publishing

    async def publish(self, named_tensors: Any, version: int, *, expected_fetchers: int | None = None) -> Manifest:
        """Publish `named_tensors` (a dict, an nn.Module or an iterator of (name, tensor)) as `version`.

        Versions must increase. Returns the manifest once the version is
        announced (and, with ``keep_versions=0``, once it is released; see the
        module docstring; `expected_fetchers` is how many complete fetches
        release it early).
        """
        if self._server.router_endpoint == "":
            raise RuntimeError("WeightPublisher.start() must be awaited before publish()")
        async with self._lock:
            if version <= self._latest:
                raise ValueError(f"version {version} is not newer than the latest published version {self._latest}")
            t0 = time.perf_counter()
            if self.keep_versions == 0:
                served = await self._reference(named_tensors, version)
            else:
                if self.keep_versions >= 2:
                    # evict first what this version evicts anyway (a complete newer one stays served):
                    # its buffers are reused (no page faults of fresh memory) and memory peaks at K
                    # versions, not K + 1. With K = 1 the old version is served until the new one is
                    # ready and its buffers are kept as spares for the next publish.
                    for old in sorted(self._server.versions)[: -(self.keep_versions - 1)]:
                        self._evict(old)
                try:
                    buckets = await self._snapshot(named_tensors)
                finally:
                    self._spare = []
                served = ServedVersion(
                    version=version,
                    publisher_id=self.publisher_id,
                    buckets=tuple(b.info for b in buckets),
                    sources=[ContiguousSource(b.data) for b in buckets],
                    chunk_bytes=self.chunk_bytes,
                )
            self._latest = version
            self._server.add_version(served)
            for old in sorted(self._server.versions)[: -self.keep_versions or None]:
                if old != version:
                    self._evict(old)
            manifest = build(Manifest, request_id="", version=version, publisher_id=self.publisher_id, buckets=served.buckets, chunk_bytes=self.chunk_bytes)
            pack_s = time.perf_counter() - t0
            log.info("published weight version %d: %d bytes in %d buckets (packed in %.3f s)", version, served.total_bytes, len(served.buckets), pack_s)
            self.metrics.event("version_published", {"version": version, "bytes": served.total_bytes, "buckets": len(served.buckets), "pack_s": round(pack_s, 6)})
            if self.keep_versions == 0:
                await self._hold(served, expected_fetchers)
            return manifest

    def _evict(self, version: int) -> None:
        served = self._server.versions.get(version)
        self._server.drop_version(version)
        if served is not None:
            self._spare.extend(s for s in served.sources if isinstance(s, ContiguousSource))

    def _buffer(self, nbytes: int, *, pinned: bool = False) -> torch.Tensor:
        """A bucket buffer: an evicted version's of the same size that nothing still reads, else fresh memory
        (page-locked when the tensors come from a GPU: the device-to-host copy then runs at full speed)."""
        for i, src in enumerate(self._spare):
            if int(src.data.numel()) == nbytes and not src.in_flight() and (not pinned or src.data.is_pinned()):
                del self._spare[i]
                return src.data
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    async def _snapshot(self, named_tensors: Any) -> list[PackedBucket]:
        if isinstance(named_tensors, (Mapping, torch.nn.Module)):
            items = list(named_tensors_of(named_tensors))
            if sum(tensor_bytes(t) for _, t in items) < _THREAD_COPY_BYTES:
                return self._snapshot_planned(items, threads=0)  # a thread hop costs more
            return await asyncio.to_thread(self._snapshot_planned, items, threads=_COPY_THREADS)
        # an iterator (a sharded trainer gathering layer by layer): copy as the tensors come
        packer = BucketPacker(self.bucket_bytes, checksum_algorithm=self.checksum_algorithm)
        for name, tensor in named_tensors_of(named_tensors):
            if tensor_bytes(tensor) >= _THREAD_COPY_BYTES:
                await asyncio.to_thread(packer.add, name, tensor)
            else:
                packer.add(name, tensor)
        return await asyncio.to_thread(packer.finish)

    def _snapshot_planned(self, items: list[tuple[str, torch.Tensor]], *, threads: int) -> list[PackedBucket]:
        """Worker thread: all sizes known, so each bucket is allocated (or reused) once at its final size,
        tensors are copied by parallel threads (torch's copy releases the GIL), and each bucket is
        checksummed by the thread that finishes its last copy."""
        planner = BucketPlanner(self.bucket_bytes)
        places: list[tuple[int, int, torch.Tensor]] = []
        for name, tensor in items:
            idx, offset, _closed = planner.place(name, dtype_name(tensor.dtype), tuple(int(x) for x in tensor.shape), tensor_bytes(tensor))
            places.append((idx, offset, tensor))
        pinned = torch.cuda.is_available() and any(t.device.type == "cuda" for _, t in items)
        buffers = [self._buffer(b.nbytes, pinned=pinned) for b in planner.buckets]
        digests = [Checksummer(self.checksum_algorithm).hexdigest()] * len(buffers)  # of no bytes
        left = [0] * len(buffers)
        for idx, _offset, tensor in places:
            left[idx] += 1 if tensor_bytes(tensor) else 0
        lock = threading.Lock()

        def copy(idx: int, offset: int, tensor: torch.Tensor) -> None:
            src = flat_bytes(tensor)
            buffers[idx][offset : offset + int(src.numel())].copy_(src)
            with lock:
                left[idx] -= 1
                last = left[idx] == 0
            if last:
                summer = Checksummer(self.checksum_algorithm)
                summer.update(buffers[idx].numpy())
                digests[idx] = summer.hexdigest()

        jobs = [(idx, offset, t) for idx, offset, t in places if tensor_bytes(t)]
        if threads < 2:
            for job in jobs:
                copy(*job)
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="weights-snapshot") as pool:
                for f in [pool.submit(copy, *job) for job in jobs]:
                    f.result()
        return [
            PackedBucket(info=build(BucketInfo, index=b.index, dtype=b.dtype, nbytes=b.nbytes, checksum=digests[b.index], tensors=tuple(b.tensors)), data=buffers[b.index])
            for b in planner.buckets
        ]

    async def _reference(self, named_tensors: Any, version: int) -> ServedVersion:
        planner = BucketPlanner(self.bucket_bytes)
        pieces: dict[int, list[tuple[int, memoryview]]] = {}
        sums: dict[int, Checksummer] = {}
        for name, tensor in named_tensors_of(named_tensors):
            nbytes = tensor_bytes(tensor)
            idx, offset, _closed = planner.place(name, dtype_name(tensor.dtype), tuple(int(s) for s in tensor.shape), nbytes)
            view = _cpu_bytes(tensor)
            pieces.setdefault(idx, []).append((offset, view))
            summer = sums.setdefault(idx, Checksummer(self.checksum_algorithm))
            if nbytes >= _THREAD_COPY_BYTES:
                await asyncio.to_thread(summer.update, view)
            elif nbytes:
                summer.update(view)
        infos = tuple(
            build(BucketInfo, index=b.index, dtype=b.dtype, nbytes=b.nbytes, checksum=sums.get(b.index, Checksummer(self.checksum_algorithm)).hexdigest(), tensors=tuple(build(TensorInfo, name=t.name, dtype=t.dtype, shape=t.shape, offset=t.offset, nbytes=t.nbytes) for t in b.tensors))
            for b in planner.buckets
        )
        return ServedVersion(
            version=version,
            publisher_id=self.publisher_id,
            buckets=infos,
            sources=[PiecesSource(pieces.get(i, [])) for i in range(len(infos))],
            chunk_bytes=self.chunk_bytes,
        )

    async def _hold(self, served: ServedVersion, expected_fetchers: int | None) -> None:
        """keep_versions=0: serve the caller's tensors until released, then drop the bytes."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        served.last_request_s = start
        total = served.total_bytes
        try:
            while True:
                done = sum(1 for n in served.served_by_peer.values() if n >= total)
                if expected_fetchers is not None and done >= expected_fetchers:
                    break
                now = loop.time()
                if now - start >= self.max_hold_s or now - served.last_request_s >= self.release_idle_s:
                    break
                if total == 0:
                    break  # nothing to serve: the manifest alone is the version
                self._served_event.clear()
                wait_s = min(self.max_hold_s - (now - start), self.release_idle_s - (now - served.last_request_s))
                try:
                    await asyncio.wait_for(self._served_event.wait(), timeout=max(0.001, wait_s))
                except TimeoutError:
                    pass
        finally:
            if total:
                # the manifest stays answerable (subscribers learn the number); fetches answer "gone"
                served.released = True
                served.sources = []
