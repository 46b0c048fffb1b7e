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
import concurrent.futures
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch

from rollpool.protocol.errors import WeightSyncError
from rollpool.protocol.logs import RateLimitedLog
from rollpool.protocol.messages import BucketInfo, Manifest, ShmSegment, TensorInfo
from rollpool.protocol.metrics import MetricsSink, NullMetricsSink
from rollpool.protocol.sockets import SocketFactory
from rollpool.weights.bucketing import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_CHUNK_BYTES,
    BucketPacker,
    BucketPlanner,
    Checksummer,
    checksum_supported,
    default_checksum_algorithm,
    dtype_from_name,
    dtype_name,
    flat_bytes,
    named_tensors_of,
    tensor_bytes,
)
from rollpool.weights.config import WEIGHT_PATHS, default_copy_threads
from rollpool.weights.gpu import (
    mix64_checksum,
    mix64_format,
    mix64_partial,
    side_stream,
)
from rollpool.weights.memory import BufferPool, ShmBuffer, host_key, shm_free_bytes, sweep_stale_segments, wait_released
from rollpool.weights.paths.bulk import bulk_enabled
from rollpool.weights.paths.cuda_ipc import IpcArenas
from rollpool.weights.serving import MAX_CHUNK_BYTES, ServedVersion, WeightServer, new_server_id

__all__ = ["WeightPublisher", "layout_of"]

log = logging.getLogger(__name__)

_MiB = 1024 * 1024
_SHM_HEADROOM_BYTES = 64 * _MiB
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


class GatedSource(ContiguousSource):
    """A streamed bucket: unreadable (fetches park) until it is copied and checksummed."""

    __slots__ = ("ready",)

    def __init__(self, data: torch.Tensor) -> None:
        super().__init__(data)
        self.ready = False

    def read(self, offset: int, nbytes: int) -> Any:
        if not self.ready:
            return None
        return self.array[offset : offset + nbytes].data


def layout_of(named_shapes: Any) -> list[tuple[str, str, tuple[int, ...], int]]:
    """``(name, dtype name, shape, nbytes)`` per tensor, in order, of tensors (meta ones too) or ``(name, (shape, dtype))`` pairs."""
    items: Any
    if isinstance(named_shapes, torch.nn.Module):
        items = named_shapes.state_dict(keep_vars=False).items()
    elif isinstance(named_shapes, Mapping):
        items = named_shapes.items()
    else:
        items = named_shapes
    out: list[tuple[str, str, tuple[int, ...], int]] = []
    for name, spec in items:
        if isinstance(spec, torch.Tensor):
            shape, dtype = tuple(int(x) for x in spec.shape), spec.dtype
        else:
            try:
                shape_any, dtype_any = spec
            except (TypeError, ValueError):
                raise TypeError(f"{name!r}: expected a tensor or (shape, dtype), got {type(spec).__name__}") from None
            shape = tuple(int(x) for x in shape_any)
            dtype = dtype_any if isinstance(dtype_any, torch.dtype) else dtype_from_name(str(dtype_any))
        numel = 1
        for x in shape:
            numel *= x
        out.append((str(name), dtype_name(dtype), shape, numel * torch.empty(0, dtype=dtype).element_size()))
    return out


class _Snapshot:
    """One streamed snapshot: copies in threads (CUDA on a side stream), each bucket checksummed when its last copy lands,
    then made readable and its checksum published (`WeightServer.complete_bucket`) on the loop."""

    def __init__(self, pub: WeightPublisher, version: int, places: list[tuple[int, int, str, tuple[int, ...], str, int]], planner: BucketPlanner,
                 buffers: list[torch.Tensor]) -> None:
        self.pub = pub
        self.version = version
        self.places = places
        self.buffers = buffers
        self.loop = asyncio.get_running_loop()
        self.segments = [pub.segment_of(b) for b in buffers]
        infos = tuple(
            BucketInfo(index=b.index, dtype=b.dtype, nbytes=b.nbytes, checksum="", tensors=tuple(b.tensors),
                  shm_segment=seg.name if seg is not None else "")
            for b, seg in zip(planner.buckets, self.segments, strict=True)
        )
        shm = bool(infos) and all(seg is not None for seg in self.segments)
        if not shm:
            infos = tuple(replace(i, shm_segment="") for i in infos)
        self.planned = list(planner.buckets)
        self.sources = [GatedSource(b) for b in buffers]
        self.served = ServedVersion(version=version, publisher_id=pub.publisher_id, buckets=infos, sources=list(self.sources),
                                    chunk_bytes=pub.chunk_bytes, host_key=pub.host_key if shm else "", pool=pub.pool)
        self.left = [0] * len(buffers)
        self.pending = len(buffers)
        # the same-host path staged to a GPU (minor 10): a mix64 of each bucket's host bytes, on shm versions only.
        # From CUDA tensors it is summed on the GPU per tensor as it is copied (`mix64_partial` at the tensor's word
        # offset: every tensor of the bucket 8-byte aligned, only the last with a tail); otherwise on the CPU over the
        # bucket after its xxh3 (so the network and CPU shm paths are never delayed by it).
        self.mix = shm
        self.mix_parts = [0] * len(buffers)
        self.mix_dev: list[list[torch.Tensor]] = [[] for _ in buffers]
        """Per bucket: its tensors' mix64 parts as int64 scalars on the GPU (summed on the mix stream, never waited on by
        a copy thread: a checksum thread reads them once the bucket's last part was queued)."""
        self.mix_aligned = [self.mix and _word_aligned(b.tensors) for b in planner.buckets]
        self.parts_left = [2 if self.mix else 1 for _ in buffers]
        """Per bucket: its checksum, and its mix64 on shm versions; the bucket is finished when both exist."""
        self.checksummed: asyncio.Future[None] = self.loop.create_future()
        self.ipc_offsets: list[int] = []
        """The buckets' offsets in the version's device arena (the same-GPU path), else empty."""
        self.ipc_stream: Any = None
        self.issued = [0] * len(buffers)
        """Per bucket: its CUDA copies queued by the issuing thread."""
        self.slots: torch.Tensor | None = None
        """Page-locked int64 per bucket: its GPU mix64 sum, copied behind its copies (`_queue_digest`)."""
        self.slotted = [False] * len(buffers)
        self.pinned: list[bool | None] = [None] * len(buffers)
        """Per bucket: whether its buffer is page-locked (asked once, on its first CUDA copy)."""
        self.marks: dict[str, float] = {}
        """perf_counter of the copy's phases (`WeightPublisher.last_phases`)."""
        if not buffers:
            self.checksummed.set_result(None)
        self._lock = threading.Lock()
        for seg in self.segments:
            if seg is not None:
                seg.begin_write()

    def abandon(self) -> None:
        if not self.checksummed.done():
            self.checksummed.cancel()

    async def copy(self, items: Any) -> None:
        """Copy every tensor into its place; return when the caller's tensors may change (all copies landed).

        Tensors are copied as they come (an iterator is never gathered whole: at most 4 x copy_threads
        copies are outstanding, so at most that many of its tensors are alive at once)."""
        pub = self.pub
        streams: dict[Any, Any] = {}
        mix_streams: dict[Any, Any] = {}
        it = iter(items)
        inline = isinstance(items, list) and sum(tensor_bytes(t) for _, t in items) < _THREAD_COPY_BYTES
        window = asyncio.Semaphore(4 * max(1, pub.copy_threads))
        futures: list[asyncio.Future[None]] = []
        # how many copies each bucket waits for is known from the plan, so a bucket's last copy is its last
        for b in self.planned:
            self.left[b.index] = sum(1 for t in b.tensors if t.nbytes)
        self._finish_empty()
        try:
            for count, (idx, offset, name, shape, dtype, nbytes) in enumerate(self.places):
                try:
                    got_name, tensor = next(it)
                except StopIteration:
                    raise ValueError(f"the tensors ended before {name!r}; the reserved layout has {len(self.places)}") from None
                if got_name != name or tuple(int(x) for x in tensor.shape) != shape or dtype_name(tensor.dtype) != dtype:
                    raise ValueError(f"tensor {count}: got {got_name!r} {tuple(tensor.shape)} {tensor.dtype}, the layout has {name!r} {shape} {dtype}")
                if not nbytes:
                    continue
                stream, mix_stream = self._streams_of(tensor, streams, mix_streams)
                if inline:
                    self._copy(idx, offset, tensor, stream, mix_stream)
                    continue
                await window.acquire()
                if stream is not None and self._pinned(idx):
                    # into page-locked memory: queued by the issuing thread, waited for by the landing thread (the copy
                    # engine never waits for a copy thread to be scheduled, whatever else the host runs)
                    landed: concurrent.futures.Future[None] = concurrent.futures.Future()
                    pub._issue_pool.submit(self._issue, idx, offset, tensor, stream, mix_stream, landed)
                    fut = asyncio.wrap_future(landed)
                else:
                    fut = asyncio.wrap_future(pub._copy_pool.submit(self._copy, idx, offset, tensor, stream, mix_stream))
                fut.add_done_callback(lambda _f: window.release())
                futures.append(fut)
                del tensor  # only the copy job holds it now
            for _extra in it:
                raise ValueError(f"more tensors than the reserved layout's {len(self.places)}")
            self.marks["issued"] = time.perf_counter()
            await asyncio.gather(*futures)
            self.marks["landed"] = time.perf_counter()
            if mix_streams:
                # the GPU mix64 read the trainer's tensors beside the copies: done before they may change (one wait for
                # the whole version, not one per tensor)
                await asyncio.to_thread(_synchronize_all, list(mix_streams.values()))
            self.marks["mixed"] = time.perf_counter()
        except BaseException:
            await asyncio.gather(*futures, return_exceptions=True)  # no copy still writes into buffers handed back
            raise

    def _finish_empty(self) -> None:
        """Buckets with no bytes to copy are checksummed (and mixed) at once."""
        for idx in range(len(self.buffers)):
            if self.left[idx] == 0:
                if self.mix:
                    self._mix_ready(idx, mix64_format(0))
                self._sum_later(idx)

    def _streams_of(self, tensor: torch.Tensor, streams: dict[Any, Any], mix_streams: dict[Any, Any]) -> tuple[Any, Any]:
        """(the copy stream, the mix64 stream) of a CUDA tensor's device, made on first use; (None, None) for CPU tensors."""
        if tensor.device.type != "cuda":
            return None, None
        stream = streams.get(tensor.device)
        if stream is None:
            # the side stream first waits for the trainer's work on this device: the copy sees the latest values
            stream = streams[tensor.device] = torch.cuda.Stream(device=tensor.device)  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            if self.mix:  # the GPU mix64 reads the same tensors beside the copy (compute beside the copy engine)
                mix_streams[tensor.device] = side_stream(tensor.device)
                mix_streams[tensor.device].wait_stream(torch.cuda.current_stream(tensor.device))
        return stream, mix_streams.get(tensor.device)

    def _pinned(self, idx: int) -> bool:
        pinned = self.pinned[idx]
        if pinned is None:
            pinned = self.pinned[idx] = bool(self.buffers[idx].is_pinned())
        return pinned

    def _copy(self, idx: int, offset: int, tensor: torch.Tensor, stream: Any, mix_stream: Any = None) -> None:
        """Copy thread: one tensor into its bucket, waited for here (CPU tensors, and CUDA tensors into pageable
        memory, which the driver copies synchronously anyway); then `_landed`."""
        src = flat_bytes(tensor)
        dst = self.buffers[idx][offset : offset + int(src.numel())]
        if stream is not None:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=dst.is_pinned())
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(stream)
            part = self._mix_part(idx, offset, src, mix_stream)
            done.synchronize()
            self._add_part(idx, part)
        else:
            dst.copy_(src)
        self._landed(idx, mix_stream)

    def _issue(self, idx: int, offset: int, tensor: torch.Tensor, stream: Any, mix_stream: Any, landed: concurrent.futures.Future[None]) -> None:
        """Issuing thread (one per publisher, so copies are queued in the order they were planned): a CUDA tensor's
        copy into page-locked memory queued on the side stream and its GPU mix64 part beside it, nothing waited on;
        the landing thread waits for the copy."""
        try:
            src = flat_bytes(tensor)
            dst = self.buffers[idx][offset : offset + int(src.numel())]
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            _keep_until_done(src, stream)
            self._add_part(idx, self._mix_part(idx, offset, src, mix_stream))
            self.issued[idx] += 1  # (only this thread counts them)
            if self.mix and self.issued[idx] == self._parts_of(idx) and self.mix_parts[idx] == self.issued[idx]:
                self._queue_digest(idx, stream, mix_stream)
            with torch.cuda.stream(stream):
                done = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]  # waited for asleep, not spinning
                done.record(stream)
        except BaseException as exc:  # noqa: BLE001 - the publish fails with it (copy() gathers every copy)
            landed.set_exception(exc)
            return
        self.pub._land_pool.submit(self._land, idx, done, mix_stream, landed)

    def _queue_digest(self, idx: int, stream: Any, mix_stream: Any) -> None:
        """Issuing thread, after a bucket's last copy: its GPU mix64 parts added up on the mix stream and the sum copied
        into this snapshot's page-locked digest slot on the copy stream, right behind the bucket's copies (so the landing
        thread reads it when the bucket lands; a `.item()` would wait behind every copy queued by then)."""
        try:
            if self.slots is None:
                self.slots = torch.zeros(len(self.buffers), dtype=torch.int64, pin_memory=True)
            parts = self.mix_dev[idx]
            with torch.cuda.stream(mix_stream):
                total = torch.stack(parts).sum() if len(parts) > 1 else parts[0]
                summed = torch.cuda.Event()  # type: ignore[no-untyped-call]
                summed.record(mix_stream)
            with torch.cuda.stream(stream):
                stream.wait_event(summed)
                self.slots[idx : idx + 1].copy_(total.reshape(1), non_blocking=True)
            _keep_until_done(total, stream)
        except Exception:  # the parts stay: the landing thread sums them with a wait instead
            log.warning("weight version %d: bucket %d's mix64 could not be queued behind its copies; summed after it lands",
                        self.version, idx, exc_info=True)
            return
        self.mix_dev[idx] = []
        self.slotted[idx] = True

    def _land(self, idx: int, done: Any, mix_stream: Any, landed: concurrent.futures.Future[None]) -> None:
        """Landing thread: copies complete in the order they were queued on the one side stream, so they are waited
        for in that order."""
        try:
            done.synchronize()
            self._landed(idx, mix_stream)
        except BaseException as exc:  # noqa: BLE001 - the publish fails with it
            landed.set_exception(exc)
            return
        landed.set_result(None)

    def _mix_part(self, idx: int, offset: int, src: torch.Tensor, mix_stream: Any) -> torch.Tensor | None:
        """The tensor's GPU mix64 part, queued on the mix stream (the trainer's bytes, read before publish returns:
        copy() waits for the mix stream), where the bucket is summed tensor by tensor."""
        if mix_stream is None or not self.mix_aligned[idx] or src.data_ptr() % 8:
            return None
        with torch.cuda.stream(mix_stream):
            part = mix64_partial(src, offset // 8)
        _keep_until_done(src, mix_stream)
        return part

    def _add_part(self, idx: int, part: torch.Tensor | None) -> None:
        """A tensor's GPU mix64 part joins its bucket's (before the tensor counts as landed)."""
        if part is not None:
            with self._lock:
                self.mix_dev[idx].append(part)
                self.mix_parts[idx] += 1

    def _landed(self, idx: int, mix_stream: Any) -> None:
        """A tensor's bytes are in its bucket: the bucket's last copy queues its checksum (and publishes the bucket's
        GPU-summed mix64 where every part of it was summed on the GPU)."""
        with self._lock:
            self.left[idx] -= 1
            last = self.left[idx] == 0
        if last:
            if self.slotted[idx]:
                assert self.slots is not None  # the digest's copy landed before the bucket's last copy was waited for
                self._call(self._mix_ready, idx, mix64_format(int(self.slots[idx])))
            elif self.mix and self.mix_parts[idx] == self._parts_of(idx):
                # every part is queued on the mix stream: a checksum thread adds them up there and publishes the sum
                assert mix_stream is not None
                queued = torch.cuda.Event()  # type: ignore[no-untyped-call]
                queued.record(mix_stream)
                self.pub._mix_pool.submit(self._mix_from_device, idx, mix_stream, queued)
            self._sum_later(idx)

    def _mix_from_device(self, idx: int, mix_stream: Any, queued: Any) -> None:
        """Checksum thread: the bucket's GPU mix64 parts added up on the mix stream, then published (`_mix_ready`)."""
        try:
            with torch.cuda.stream(mix_stream):
                mix_stream.wait_event(queued)
                parts = self.mix_dev[idx]
                total = torch.stack(parts).sum() if len(parts) > 1 else parts[0]
                digest = mix64_format(int(total.item()))
            self.mix_dev[idx] = []
        except BaseException as exc:  # noqa: BLE001 - handed to the loop, which withdraws the version
            self._call(self._failed, exc)
            return
        self._call(self._mix_ready, idx, digest)

    def _parts_of(self, idx: int) -> int:
        return sum(1 for t in self.planned[idx].tensors if t.nbytes)

    def _sum_later(self, idx: int) -> None:
        if self.buffers[idx].numel() < _THREAD_COPY_BYTES:
            self._checksum(idx)
        else:
            self.pub._sum_pool.submit(self._checksum, idx)

    def _checksum(self, idx: int) -> None:
        """Checksum thread (xxh3 releases the GIL, so buckets are summed in parallel)."""
        try:
            summer = Checksummer(self.pub.checksum_algorithm)
            if self.buffers[idx].numel():
                summer.update(self.buffers[idx].numpy())
            digest = summer.hexdigest()
        except BaseException as exc:  # noqa: BLE001 - handed to the loop, which withdraws the version
            self._call(self._failed, exc)
            return
        self._call(self._ready, idx, digest)
        if self.mix and self.mix_parts[idx] != self._parts_of(idx):
            # not summed on the GPU (CPU tensors, or an unaligned bucket): the mix64 of the host bucket, on the CPU,
            # after its checksum was published (the network and CPU shm paths do not wait for it)
            try:
                mixed = mix64_checksum(self.buffers[idx]) if self.buffers[idx].numel() else mix64_format(0)
            except BaseException as exc:  # noqa: BLE001 - handed to the loop, which withdraws the version
                self._call(self._failed, exc)
                return
            self._call(self._mix_ready, idx, mixed)

    def _call(self, fn: Any, *args: Any) -> None:
        try:
            on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:  # a worker thread
            on_loop = False
        if on_loop:
            fn(*args)
            return
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            self.loop.call_soon_threadsafe(fn, *args)

    def _failed(self, exc: BaseException) -> None:
        if not self.checksummed.done():
            self.checksummed.set_exception(exc)

    def _ready(self, idx: int, digest: str) -> None:
        if self.checksummed.done():
            return  # withdrawn or evicted meanwhile
        self.sources[idx].ready = True
        seg = self.segments[idx]
        if seg is not None:
            seg.end_write(self.version)
        self.pub._server.complete_bucket(self.version, idx, digest)
        self._part_done(idx)

    def _mix_ready(self, idx: int, digest: str) -> None:
        """The bucket's bytes are in its segment and their mix64 is known: a subscriber staging to a GPU may copy it
        (the segment's header names the version from now on; the xxh3 checksum may still be pending)."""
        if self.checksummed.done():
            return
        seg = self.segments[idx]
        if seg is not None:
            seg.end_write(self.version)
        self.pub._server.set_host_mix64(self.version, idx, digest)
        self._part_done(idx)

    def _part_done(self, idx: int) -> None:
        self.parts_left[idx] -= 1
        if self.parts_left[idx] == 0:
            self.pending -= 1
            if self.pending == 0:
                self.checksummed.set_result(None)


def _keep_until_done(t: torch.Tensor, stream: Any) -> None:
    """The caching allocator does not hand `t`'s memory out again before `stream`'s work queued so far is done (an
    iterator's tensor may be freed by its producer while its copy or mix64 is still queued)."""
    with contextlib.suppress(RuntimeError):  # memory the caching allocator does not own: the caller keeps it alive
        t.record_stream(stream)


def _synchronize_all(streams: list[Any]) -> None:
    for st in streams:
        st.synchronize()


def _word_aligned(tensors: Any) -> bool:
    """Whether a bucket's mix64 can be summed tensor by tensor: every tensor starts at a multiple of 8 bytes and only
    the last one has a tail (its zero padding is the bucket's own)."""
    ts = [t for t in tensors if t.nbytes]
    return all(t.offset % 8 == 0 for t in ts) and all(t.nbytes % 8 == 0 for t in ts[:-1])


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
        path: str | None = None,
        pool: str = "default",
        pinned_budget_bytes: int | None = None,
        copy_threads: int | None = None,
        checksum_threads: int | None = None,
        reserve: Any = None,
    ) -> None:
        path = path or os.environ.get("ROLLPOOL_WEIGHT_PATH") or "auto"  # unset: from the environment
        if path not in WEIGHT_PATHS:
            raise ValueError(f"path must be one of {WEIGHT_PATHS}, got {path!r}")
        if pinned_budget_bytes is None and os.environ.get("ROLLPOOL_PINNED_BUDGET_BYTES", "").strip():
            pinned_budget_bytes = int(os.environ["ROLLPOOL_PINNED_BUDGET_BYTES"])
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
        self.path = path
        self.pool = pool
        self.host_key = host_key()
        self.copy_threads = copy_threads or default_copy_threads()
        self.checksum_threads = checksum_threads or default_copy_threads()
        self.shm_fallbacks = 0
        """Versions buffered in ordinary memory although the path asked for shared memory (no room in /dev/shm)."""
        self._fallback_log = RateLimitedLog(log)
        pin = torch.cuda.is_available()  # page-locked buckets: device-to-host copies at full speed
        self._host_pool = BufferPool(kind="host", pin=pin, pinned_budget_bytes=pinned_budget_bytes)
        self._shm_pool: BufferPool | None = None
        if path != "network" and keep_versions > 0:
            sweep_stale_segments(pool)
            self._shm_pool = BufferPool(kind="shm", pin=pin, pinned_budget_bytes=pinned_budget_bytes, pool=pool, owner_id=self.publisher_id)
        self._copy_pool = ThreadPoolExecutor(self.copy_threads, thread_name_prefix="weights-copy")
        self._issue_pool = ThreadPoolExecutor(1, thread_name_prefix="weights-issue")
        self._land_pool = ThreadPoolExecutor(1, thread_name_prefix="weights-land")
        self.last_phases: dict[str, float] = {}
        """The last planned publish's phases, seconds from its call: ``begun`` (buffers taken), ``announced``,
        ``issued`` (every copy handed out), ``landed`` (every copy done), ``mixed`` (the GPU mix64 reads done), ``returned``."""
        self._sum_pool = ThreadPoolExecutor(self.checksum_threads, thread_name_prefix="weights-checksum")
        self._mix_pool = ThreadPoolExecutor(1, thread_name_prefix="weights-mix")
        """Adds up each bucket's GPU mix64 parts (a short wait on the mix stream): never queued behind the xxh3 jobs,
        so a staging worker may copy a bucket as soon as it landed."""
        self._finishing: dict[int, asyncio.Future[None]] = {}
        self._layout: list[tuple[str, str, tuple[int, ...], int]] | None = None
        self._server = WeightServer(
            sockets,
            router_endpoint=router_endpoint,
            pub_endpoint=pub_endpoint,
            name="publisher",
            announce_interval_s=announce_interval_s,
            metrics=self.metrics,
            bulk=bulk_enabled(),
        )
        self._latest = -1
        self._spare: list[ContiguousSource] = []
        """Buckets of evicted versions, reused by the next snapshot once nothing of theirs is in flight."""
        self._released_manifest: ServedVersion | None = None
        self._lock = asyncio.Lock()
        self._served_event = asyncio.Event()
        self._server.on_served = lambda v: self._served_event.set()
        self._ipc = IpcArenas(self.publisher_id, self.host_key, path)
        """The same-GPU path's arenas (`rollpool.weights.paths.cuda_ipc`)."""
        self._server.on_manifest_request = self._ipc.hello
        self._warming: threading.Thread | None = None
        """The warm-up pass over freshly reserved segments (`_warm_snapshot`); a publish waits for it."""
        if reserve is not None:
            self.reserve(reserve)

    # -- lifecycle

    async def start(self) -> None:
        await self._server.start()
        log.info("weight publisher %s serving on %s, announcing on %s", self.publisher_id, self.router_endpoint, self.pub_endpoint)

    async def close(self) -> None:
        for fut in list(self._finishing.values()):
            fut.cancel()
        await self._server.close()
        self._copy_pool.shutdown(wait=True, cancel_futures=True)
        self._issue_pool.shutdown(wait=True, cancel_futures=True)
        self._land_pool.shutdown(wait=True, cancel_futures=True)
        self._sum_pool.shutdown(wait=True, cancel_futures=True)
        self._mix_pool.shutdown(wait=True, cancel_futures=True)
        self._spare = []
        self._ipc.close()
        self._host_pool.close()
        if self._shm_pool is not None:
            self._shm_pool.close()  # segments unlinked; mappings go with the last view
        await asyncio.to_thread(wait_released)  # and those dropped in the background before

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
    def ipc_versions(self) -> int:
        """Versions offered on the same-GPU path."""
        return self._ipc.versions

    @property
    def stats(self) -> dict[str, int]:
        s = self._server
        return {
            "latest_version": self._latest,
            "bytes_served": s.bytes_served,
            "chunks_served": s.chunks_served,
            "dropped_replies": s.dropped_replies,
            "protocol_errors": s.protocol_errors,
            "shm_fallbacks": self.shm_fallbacks,
            "ipc_versions": self._ipc.versions,
            "ipc_arenas": len(self._ipc.exports),
            "buffers_allocated": self._host_pool.allocations + (self._shm_pool.allocations if self._shm_pool else 0),
            "pinned_bytes": self._host_pool.pinned_bytes + (self._shm_pool.pinned_bytes if self._shm_pool else 0),
        }

    # -- memory

    def reserve(self, named_shapes: Any) -> int:
        """Allocate (and touch) the buckets of this layout for `keep_versions` versions, before the first one.

        `named_shapes`: what `publish` will get (a dict or module of tensors, meta
        tensors included), or pairs ``(name, (shape, dtype))``. Buffers are
        page-locked where CUDA is available (within `pinned_budget_bytes`) and
        shared-memory segments on the ``auto``/``shm`` paths where /dev/shm has
        room. The layout is also the plan an iterator publish is copied by
        (a sharded trainer's rank 0 streaming layer by layer). Returns the bytes
        reserved.
        """
        layout = layout_of(named_shapes)
        planner = BucketPlanner(self.bucket_bytes)
        for name, dtype, shape, nbytes in layout:
            planner.place(name, dtype, shape, nbytes)
        self._layout = layout
        sizes = [b.nbytes for b in planner.buckets]
        copies = max(1, self.keep_versions)
        pool = self._pool_for(sum(sizes) * copies)
        made = pool.reserve([n for _ in range(copies) for n in sizes])
        total = sum(sizes) * copies
        log.info("weight publisher %s reserved %d bytes (%d buckets x %d versions, %s memory, %d page-locked)",
                 self.publisher_id, total, len(sizes), copies, pool.kind, pool.pinned_bytes)
        self._sync_segments()
        if pool.kind == "shm" and pool.pin and torch.cuda.is_available():
            self._warm_snapshot(made)
        return total

    def _warm_snapshot(self, bufs: list[torch.Tensor]) -> None:
        """In a thread (a publish waits for it): one device-to-host pass into every segment just reserved, and the GPU
        mix64 at full slice size on the mix stream, so the first version of a shm snapshot from CUDA tensors does not pay
        the first copies into the freshly registered pages nor the mix64's first temporaries (its first version was
        0.64 s blocked against 0.35 s warm, 2026-12-04)."""
        if self._warming is not None:
            self._warming.join()

        def warm() -> None:
            try:
                device = torch.device("cuda", torch.cuda.current_device())
                stream = side_stream(device)
                biggest = max((int(b.numel()) for b in bufs), default=0)
                if not biggest:
                    return
                with torch.cuda.stream(stream):
                    scratch = torch.zeros(min(biggest, 256 << 20), dtype=torch.uint8, device=device)
                    step = int(scratch.numel())
                    for b in bufs:
                        n = int(b.numel())
                        for off in range(0, n, step):
                            b[off : min(n, off + step)].copy_(scratch[: min(step, n - off)], non_blocking=True)
                    part = mix64_partial(scratch, 0)
                    int(part.item())
                stream.synchronize()
            except Exception:
                log.debug("warming the shm snapshot path up failed", exc_info=True)

        self._warming = threading.Thread(target=warm, name="weights-snapshot-warm", daemon=True)
        self._warming.start()

    def _sync_segments(self) -> None:
        """Name every segment held now on the manifests (minor 11), so staging workers register them ahead of use."""
        segs: tuple[ShmSegment, ...] = ()
        if self._shm_pool is not None:
            segs = tuple(sorted((ShmSegment(name=b.name, nbytes=b.nbytes) for b in self._shm_pool.segments()), key=lambda x: x.name))
        self._server.set_shm_reserved(segs, self.host_key)

    def set_path(self, path: str) -> None:
        """Change the path for the next versions: ``network`` buffers them in ordinary memory (no segments offered),
        ``auto``/``shm`` in shared memory (where the publisher was not made with ``network``)."""
        if path not in WEIGHT_PATHS:
            raise ValueError(f"path must be one of {WEIGHT_PATHS}, got {path!r}")
        if path != "network" and self._shm_pool is None:
            raise ValueError("this publisher was made with path='network' and has no shared-memory pool")
        if path != self.path:
            # the other kind's idle buffers are freed now (served versions keep theirs until evicted)
            self._trim_spares(0)
            (self._host_pool if path != "network" else self._shm_pool or self._host_pool).trim(0)
            self._sync_segments()
        self.path = self._ipc.path = path

    def manifest_of(self, version: int) -> Manifest | None:
        """The manifest of a served version as it stands (checksums still pending show ``""``)."""
        v = self._server.versions.get(version)
        return v.manifest("") if v is not None else None

    def _pool_for(self, fresh_bytes: int) -> BufferPool:
        """The shared-memory pool where the path allows and /dev/shm has room for `fresh_bytes` more, else host memory."""
        if self._shm_pool is None or self.path == "network":
            return self._host_pool
        if fresh_bytes <= 0 or shm_free_bytes() >= fresh_bytes + _SHM_HEADROOM_BYTES:
            return self._shm_pool
        self.shm_fallbacks += 1
        self._fallback_log.warning("shm-room", "weight publisher %s: /dev/shm has %d bytes free, a version needs %d more: "
                                   "buffering in ordinary memory (network path; give /dev/shm room, see docs/weights.md)",
                                   self.publisher_id, shm_free_bytes(), fresh_bytes)
        if self.path == "shm":
            raise WeightSyncError(f"path 'shm': /dev/shm has {shm_free_bytes()} bytes free, a version needs {fresh_bytes}")
        return self._host_pool

    # -- publishing

    async def publish(self, named_tensors: Any, version: int, *, expected_fetchers: int | None = None, wait_ready: bool = False) -> Manifest:
        """Publish `named_tensors` (a dict, an nn.Module or an iterator of (name, tensor)) as `version`.

        Versions must increase. Returns once the caller may change its tensors:
        the snapshot is copied (CUDA tensors on a side stream into page-locked
        buffers, the wait included), while checksums may still be computed in
        threads; each bucket is served as soon as it is copied and checksummed,
        and the version is announced before its first bucket is ready. The
        manifest returned names the checksums known then (`wait_ready=True`
        waits for all of them). With ``keep_versions=0`` it returns once the
        version is released (see the module docstring; `expected_fetchers` is
        how many complete fetches release it early).
        """
        if self._server.router_endpoint == "":
            raise RuntimeError("WeightPublisher.start() must be awaited before publish()")
        async with self._lock:
            if version <= self._latest:
                raise ValueError(f"version {version} is not newer than the latest published version {self._latest}")
            t0 = time.perf_counter()
            if self.keep_versions == 0:
                served = await self._reference(named_tensors, version)
                self._latest = version
                self._server.add_version(served)
                self._after_publish(served, t0, t0)
                manifest = served.manifest("")
                await self._hold(served, expected_fetchers)
                return manifest
            if self.keep_versions >= 2:
                # evict first what this version evicts anyway (a complete newer one stays served):
                # its buffers are reused (no page faults of fresh memory) and memory peaks at K
                # versions, not K + 1. With K = 1 the old version is served until the new one is
                # ready and its buffers are kept as spares for the next publish.
                for old in sorted(self._server.versions)[: -(self.keep_versions - 1)]:
                    self._evict(old)
            items, places, planner = self._plan(named_tensors)
            if places is None:  # an iterator and no reserved layout: packed as it comes, served once whole
                served = await self._pack_unplanned(items, version)
                self._latest = version
                self._server.add_version(served)
                self._after_publish(served, t0, time.perf_counter())
                for old in sorted(self._server.versions)[: -self.keep_versions or None]:
                    if old != version:
                        self._evict(old)
                return served.manifest("")
            return await self._publish_planned(items, places, planner, version, t0, wait_ready)

    async def _publish_planned(self, items: Any, places: list[tuple[int, int, str, tuple[int, ...], str, int]], planner: BucketPlanner,
                               version: int, t0: float, wait_ready: bool) -> Manifest:
        """The streamed snapshot of a planned version (see `publish`); on the same-GPU path a device snapshot first."""
        if self._warming is not None:  # the reserved segments' warm-up pass writes them: done before a version does
            await asyncio.to_thread(self._warming.join)
            self._warming = None
        snap = self._begin(version, places, planner)
        snap.marks["begun"] = time.perf_counter()
        ipc_device = self._ipc.device_for(items)
        if ipc_device is not None:
            try:
                arena, snap.ipc_offsets, arena_items = self._ipc.begin(snap.served, places, ipc_device)
            except Exception:  # noqa: BLE001 - an arena that cannot be made or exported (logged there): the host path serves
                self._ipc.release(version)
                snap.served.cuda_ipc = None
                ipc_device = None
        previous, self._latest = self._latest, version
        self._server.add_version(snap.served)  # announced now; buckets are served as they become ready
        snap.marks["announced"] = time.perf_counter()
        try:
            if ipc_device is not None:
                snap.ipc_stream = await self._ipc.copy(arena, snap.ipc_offsets, places, items)
            else:
                await snap.copy(items)
        except BaseException:
            self._server.drop_version(version, code="unavailable")
            self._latest = previous
            snap.abandon()
            self._spare.extend(snap.sources)  # its buffers serve the next publish
            if ipc_device is not None:
                self._ipc.release(version)
            raise
        copied = time.perf_counter()
        snap.marks["returned"] = copied
        self.last_phases = {k: round(at - t0, 4) for k, at in sorted(snap.marks.items(), key=lambda kv: kv[1])}
        if ipc_device is not None:
            self._finishing[version] = asyncio.ensure_future(self._finish_ipc(snap, arena, arena_items, t0, copied))
        else:
            self._finishing[version] = asyncio.ensure_future(self._finish(snap, t0, copied))
        for old in sorted(self._server.versions)[: -self.keep_versions or None]:
            if old != version:
                self._evict(old)
        if wait_ready:
            await self.wait_ready(version)
        return snap.served.manifest("")

    async def wait_ready(self, version: int | None = None) -> None:
        """Wait until `version` (None: the latest) has every bucket's checksum (and so is served whole)."""
        v = self._latest if version is None else version
        fut = self._finishing.get(v)
        if fut is not None:
            await asyncio.shield(fut)

    async def _finish(self, snap: _Snapshot, t0: float, copied: float) -> None:
        try:
            await snap.checksummed
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                log.error("weight version %d: checksumming failed (%s); withdrawn", snap.version, exc)
            self._server.drop_version(snap.version, code="unavailable")
            raise
        finally:
            self._finishing.pop(snap.version, None)
        self._after_publish(snap.served, t0, copied)

    def _after_publish(self, served: ServedVersion, t0: float, copied: float) -> None:
        now = time.perf_counter()
        log.info("published weight version %d: %d bytes in %d buckets (caller free after %.3f s, checksummed after %.3f s)",
                 served.version, served.total_bytes, len(served.buckets), copied - t0, now - t0)
        self.metrics.event("version_published", {"version": served.version, "bytes": served.total_bytes, "buckets": len(served.buckets),
                                                 "pack_s": round(now - t0, 6), "blocked_s": round(copied - t0, 6),
                                                 "memory": "shm" if any(b.shm_segment for b in served.buckets) else "host"})

    def _plan(self, named_tensors: Any) -> tuple[Any, list[tuple[int, int, str, tuple[int, ...], str, int]] | None, BucketPlanner]:
        """(the tensors, where each goes: (bucket, offset, name, shape, dtype, nbytes) in order, the planner).

        A dict or a module is planned from its sizes; an iterator is planned from
        the reserved layout (`reserve`) and checked against it as it streams; an
        iterator without one is planned as it comes (`places` None).
        """
        planner = BucketPlanner(self.bucket_bytes)
        if isinstance(named_tensors, (Mapping, torch.nn.Module)):
            items: Any = list(named_tensors_of(named_tensors))
            layout = [(n, dtype_name(t.dtype), tuple(int(x) for x in t.shape), tensor_bytes(t)) for n, t in items]
        elif self._layout is not None:
            items, layout = named_tensors_of(named_tensors), self._layout
        else:
            return named_tensors_of(named_tensors), None, planner
        places = []
        for name, dtype, shape, nbytes in layout:
            idx, offset, _closed = planner.place(name, dtype, shape, nbytes)
            places.append((idx, offset, name, shape, dtype, nbytes))
        return items, places, planner

    def _begin(self, version: int, places: list[tuple[int, int, str, tuple[int, ...], str, int]], planner: BucketPlanner) -> _Snapshot:
        sizes = [b.nbytes for b in planner.buckets]
        spare = [int(s.data.numel()) for s in self._spare]
        reserved = self._shm_pool.free_sizes() if self._shm_pool is not None else []
        fresh = 0
        for n in sizes:  # what this version needs beyond its spares and the reserved segments (their room is taken already)
            if n in spare:
                spare.remove(n)
            elif n in reserved:
                reserved.remove(n)
            else:
                fresh += n
        pool = self._pool_for(fresh)
        buffers = [self._buffer(n, pool) for n in sizes]
        self._trim_spares(sum(sizes), kind=pool.kind)  # after a layout or path change, what no version reuses is freed
        self._sync_segments()
        return _Snapshot(self, version, places, planner, buffers)

    # -- the same-GPU path (CUDA IPC)

    async def _finish_ipc(self, snap: _Snapshot, arena: torch.Tensor, arena_items: list[tuple[str, torch.Tensor]], t0: float,
                          copied: float) -> None:
        """After the device snapshot: each bucket's GPU checksum (then the same-GPU peers may read), then the host
        buckets copied from the arena (the network and shared-memory peers) and checksummed as usual."""
        try:
            await self._ipc.checksums(arena, snap.ipc_offsets, snap.served, snap.ipc_stream, self._server.complete_ipc)
            await snap.copy(arena_items)
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                log.error("weight version %d: the same-GPU snapshot failed (%s); withdrawn", snap.version, exc)
            self._server.drop_version(snap.version, code="unavailable")
            self._finishing.pop(snap.version, None)
            raise
        await self._finish(snap, t0, copied)

    def _evict(self, version: int) -> None:
        served = self._server.versions.get(version)
        self._server.drop_version(version)
        fut = self._finishing.pop(version, None)
        if fut is not None:
            fut.cancel()
        if version in self._ipc.of_version:
            if fut is not None and not fut.done():  # its host copy may still read the arena: reused once it stopped
                fut.add_done_callback(lambda _f: self._ipc.release(version))
            else:
                self._ipc.release(version)
        if served is not None:
            self._spare.extend(s for s in served.sources if isinstance(s, ContiguousSource))

    def _trim_spares(self, keep_bytes: int, *, kind: str | None = None) -> None:
        """Free spare buffers (oldest first) down to `keep_bytes`, and every spare not of `kind` (``host``/``shm``:
        the kind the next versions take), released in the background: after a path switch these are a whole
        version of page-locked segments, whose release took 0.41 s of a trainer's publish on the H200."""
        self._spare, host, shm = self._split_spares(keep_bytes, kind)
        for pool, bufs in ((self._host_pool, host), (self._shm_pool, shm)):
            if pool is not None and bufs:
                pool.drop(bufs)  # takes the last references: the unmapping happens in its thread

    def _split_spares(self, keep_bytes: int, kind: str | None) -> tuple[list[ContiguousSource], list[torch.Tensor], list[torch.Tensor]]:
        """(the spares kept, the host buffers and the shm buffers to free) for `_trim_spares`."""
        host: list[torch.Tensor] = []
        shm: list[torch.Tensor] = []
        keep: list[ContiguousSource] = []
        for src in self._spare:
            if kind is not None and (self.segment_of(src.data) is not None) != (kind == "shm"):
                (shm if kind == "host" else host).append(src.data)
            else:
                keep.append(src)
        held = sum(int(s.data.numel()) for s in keep)
        while keep and held > keep_bytes:
            src = keep.pop(0)
            held -= int(src.data.numel())
            (shm if self.segment_of(src.data) is not None else host).append(src.data)
        return keep, host, shm

    def _buffer(self, nbytes: int, pool: BufferPool) -> torch.Tensor:
        """A bucket buffer: an evicted version's of the same size and kind that nothing still reads, else one of the
        pool's (reserved, or fresh: page-locked when CUDA is available, within the budget)."""
        for i, src in enumerate(self._spare):
            if int(src.data.numel()) == nbytes and not src.in_flight() and (self.segment_of(src.data) is not None) == (pool.kind == "shm"):
                del self._spare[i]
                return src.data
        return pool.take(nbytes)

    def segment_of(self, buf: torch.Tensor) -> ShmBuffer | None:
        return self._shm_pool.segment_of(buf) if self._shm_pool is not None else None

    async def _pack_unplanned(self, items: Any, version: int) -> ServedVersion:
        packer = BucketPacker(self.bucket_bytes, checksum_algorithm=self.checksum_algorithm)
        for name, tensor in items:
            if tensor_bytes(tensor) >= _THREAD_COPY_BYTES:
                await asyncio.to_thread(packer.add, name, tensor)
            else:
                packer.add(name, tensor)
        buckets = await asyncio.to_thread(packer.finish)
        return ServedVersion(version=version, publisher_id=self.publisher_id, buckets=tuple(b.info for b in buckets),
                             sources=[ContiguousSource(b.data) for b in buckets], chunk_bytes=self.chunk_bytes, pool=self.pool)

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
            BucketInfo(index=b.index, dtype=b.dtype, nbytes=b.nbytes, checksum=sums.get(b.index, Checksummer(self.checksum_algorithm)).hexdigest(), tensors=tuple(TensorInfo(name=t.name, dtype=t.dtype, shape=t.shape, offset=t.offset, nbytes=t.nbytes) for t in b.tensors))
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
