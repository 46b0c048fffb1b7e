"""The publisher's copy pipeline: one version's tensors snapshotted into its own buckets, and the bucket sources the
server reads from.

What it promises
    - `Snapshot.copy` returns once the caller's tensors may change again: every copy landed (CUDA tensors on a side
      stream, into page-locked buckets queued by one issuing thread and waited for by one landing thread, so the copy
      engine never waits for a thread to be scheduled), and the GPU mix64 reads of them finished.
    - Each bucket is checksummed (xxh3, in threads) as its copies land: its bytes are folded into a running checksum
      in offset order, a range at a time once its tensors are all in place (`_Fold`), so the checksum is done about
      when the last copy lands; summed whole after its last copy instead for a bucket under 1 MiB, and for CPU tensors
      on a host without a core to spare beyond the copy threads (there a fold would only slow the copy); then made
      readable and its checksum published (`SnapshotSink.complete_bucket`); on shared-memory versions its mix64 is published too
      (`SnapshotSink.set_host_mix64`), summed on the GPU tensor by tensor where it can be, else on the CPU after the
      xxh3, so the network and CPU shm paths never wait for it.
    - An iterator is copied as it comes (at most 4 x copy_threads copies outstanding) and checked against the layout;
      a dict's or module's small tensors are copied in jobs of up to 4 MiB (one thread hop per job, not per tensor).
    - A failed checksum thread withdraws the version (`Snapshot.checksummed` fails).

A snapshot is given its knobs (`SnapshotKnobs`), the publisher's threads (`SnapshotPools`), its buckets
(`SnapshotBuffers`: evicted versions' buffers reused, else host memory or shared-memory segments) and where to publish
(`SnapshotSink`, the `WeightServer`); it never calls back into the publisher. The versions that are not snapshotted
this way are made here too: an iterator without a reserved layout packed as it comes (`packed_version`), and the
caller's own tensors served in place (`referenced_version`, ``keep_versions=0``).
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
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from rollpool.protocol.errors import WeightSyncError
from rollpool.protocol.logs import RateLimitedLog
from rollpool.protocol.messages import BucketInfo, TensorInfo
from rollpool.weights.bucketing import (
    BucketPacker,
    BucketPlanner,
    Checksummer,
    dtype_from_name,
    dtype_name,
    flat_bytes,
    named_tensors_of,
    tensor_bytes,
)
from rollpool.weights.gpu import mix64_checksum, mix64_format, mix64_partial, side_stream
from rollpool.weights.memory import BufferPool, ShmBuffer, shm_free_bytes, sweep_stale_segments
from rollpool.weights.serving import ServedVersion

__all__ = ["THREAD_COPY_BYTES", "ContiguousSource", "GatedSource", "PiecesSource", "Place", "PlanMemo", "Snapshot", "SnapshotBuffers",
           "SnapshotKnobs", "layout_key", "packed_version", "plan_version", "referenced_version", "warm_segments", "SnapshotPools", "SnapshotSink", "cpu_bytes",
           "host_copy", "layout_of", "word_aligned"]

log = logging.getLogger("rollpool.weights.publisher")

_MiB = 1024 * 1024
THREAD_COPY_BYTES = 1 * _MiB
"""Tensors at least this large are copied in a worker thread (smaller ones inline: a thread hop costs more)."""
_THREAD_COPY_BYTES = THREAD_COPY_BYTES
_BATCH_BYTES = 4 * _MiB
"""Tensors smaller than this go to a copy thread together, up to this many bytes a job."""
_MEMO_PLAN = True
"""Reuse the previous version's plan (and a publisher its adapter check) when the names, shapes and dtypes are the same
(`PlanMemo`); False plans and checks every version (bench/lora.py's ``--compare plan`` runs both)."""
_FOLD_CHECKSUMS: bool | None = None
"""Fold each bucket's bytes into its checksum as its copies land (`_Fold`), so the checksum is done about when the last
copy lands: None where it overlaps the copies (`Snapshot._fold_wanted`), True always, False never (the whole bucket
summed after its last copy; bench/lora.py's ``--compare-what checksums`` and ``--fold`` set it)."""
_FOLD_MIN_BYTES = 1 * _MiB
"""A fold is handed to a checksum thread once this many contiguous bytes wait (or the bucket's last copy landed): a
thread hop per small tensor would cost more than its bytes."""
_SUMS_AFTER_COPIES: bool | None = None
"""Hold every bucket's checksum until the version's last copy landed (`Snapshot.copy`), so the copies, which the trainer
waits for, have the host's cores and memory bandwidth to themselves: None for CPU tensors (copied by threads, the
checksums' reads competing with them), True always, False never (summed as each bucket's last copy lands, or folded).
The first bucket is then checksummed one bucket's sum after the copy, not before it (bench/cpu_publish_probe.py);
its bytes go out before that to a subscriber that asks (`Snapshot._mark_landed`). Not the first buckets summed as
they land all the same: that started a few streams sooner and made the fetch slower (on an H100 host the tcp row from
CPU tensors went from 1.26x the CUDA row to 1.35x with 2 such buckets, 1.37x with 4,
h100-weights-8b-cpu-tensors-early2-s26.json)."""


class _Job(NamedTuple):
    """One tensor's copy into its bucket."""

    idx: int
    offset: int
    tensor: torch.Tensor
    stream: Any
    mix_stream: Any


def host_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class _Fold:
    """One bucket's running checksum, fed in offset order while its tensors land in any order.

    `land` marks a tensor's bytes as in place; `take` hands out the next range to fold: from where folding stopped to
    the end of the contiguous run of landed tensors (gaps between tensors included: nothing writes them), and the
    bucket's tail once every tensor landed. Each byte is folded once, in order, after it landed and never changes
    again, so the digest is the one of the whole bucket summed after its last copy. Bookkeeping only: the caller
    holds a lock around `land` and `take` and folds one range at a time (`running`)."""

    __slots__ = ("ends", "landed", "nbytes", "next", "pos", "running", "starts", "summer")

    def __init__(self, algorithm: str, nbytes: int, tensors: Any) -> None:
        spans = sorted((t.offset, t.offset + t.nbytes) for t in tensors if t.nbytes)
        self.starts = {s: i for i, (s, _e) in enumerate(spans)}
        self.ends = [e for _s, e in spans]
        self.landed = [False] * len(spans)
        self.nbytes = nbytes
        self.next = 0
        """Tensors before it are folded (or handed out to be)."""
        self.pos = 0
        """Bytes folded (or handed out to be)."""
        self.running = False
        """A range is being folded (by one thread: a bucket's bytes go into its summer in order)."""
        self.summer = Checksummer(algorithm)

    def land(self, offset: int) -> None:
        self.landed[self.starts[offset]] = True

    def take(self, min_bytes: int) -> tuple[int, int] | None:
        """The next range to fold, once at least `min_bytes` are ready (or it reaches the bucket's end); None: not yet."""
        k = self.next
        while k < len(self.landed) and self.landed[k]:
            k += 1
        hi = self.nbytes if k == len(self.landed) else (self.ends[k - 1] if k > self.next else self.pos)
        if hi <= self.pos or (hi - self.pos < min_bytes and hi < self.nbytes):
            return None
        lo, self.pos, self.next = self.pos, hi, k
        return lo, hi


class Place(NamedTuple):
    """Where one tensor of a version goes."""

    bucket: int
    offset: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class SnapshotKnobs:
    publisher_id: str
    chunk_bytes: int
    host_key: str
    pool: str
    copy_threads: int
    checksum_algorithm: str
    host_copy_threads: int = 0
    """Threads that copy CPU tensors (0: `copy_threads`): the trainer waits for those copies, and more threads than the
    checksums' share copy faster where the host has the cores (`rollpool.weights.config.default_host_copy_threads`)."""

    @property
    def cpu_copy_threads(self) -> int:
        return self.host_copy_threads or self.copy_threads


@dataclass(frozen=True, slots=True)
class SnapshotPools:
    """The publisher's threads, made once: copies, the one issuing and one landing thread of CUDA copies into
    page-locked memory, xxh3 checksums, and the GPU mix64 sums (never queued behind the xxh3 jobs)."""

    copy: ThreadPoolExecutor
    issue: ThreadPoolExecutor
    land: ThreadPoolExecutor
    sum: ThreadPoolExecutor
    mix: ThreadPoolExecutor

    @classmethod
    def make(cls, copy_threads: int, checksum_threads: int) -> SnapshotPools:
        """`copy_threads`: the most copies at once (of CPU tensors, and of CUDA tensors into pageable memory)."""
        return cls(copy=ThreadPoolExecutor(copy_threads, thread_name_prefix="weights-copy"),
                   issue=ThreadPoolExecutor(1, thread_name_prefix="weights-issue"),
                   land=ThreadPoolExecutor(1, thread_name_prefix="weights-land"),
                   sum=ThreadPoolExecutor(checksum_threads, thread_name_prefix="weights-checksum"),
                   mix=ThreadPoolExecutor(1, thread_name_prefix="weights-mix"))

    def shutdown(self) -> None:
        for pool in (self.copy, self.issue, self.land, self.sum, self.mix):
            pool.shutdown(wait=True, cancel_futures=True)


class SnapshotSink(Protocol):
    """Where a snapshot publishes each bucket as it is ready (`rollpool.weights.serving.WeightServer`)."""

    def complete_bucket(self, version: int, bucket: int, checksum: str) -> None: ...

    def set_host_mix64(self, version: int, bucket: int, checksum: str) -> None: ...

    def bytes_landed(self, version: int) -> None:
        """Buckets of `version` have their bytes in place and their checksums not yet (`GatedSource.landed`; called
        from any thread): wake the requests that take bytes before the checksum (the bulk lane's ``RPBE``)."""


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

    def contiguous(self) -> Any:
        """The whole bucket as one uint8 array (the bulk lane's compiled send loop reads there), or None: not all there."""
        return self.array

    def read_early(self, offset: int, nbytes: int) -> Any:
        """`read`, for a request that takes bytes before the bucket's checksum (the lane's ``RPBE``): the same here."""
        return self.read(offset, nbytes)

    def contiguous_early(self) -> Any:
        """`contiguous`, for a request that takes bytes before the bucket's checksum: the same here."""
        return self.contiguous()

    def in_flight(self) -> bool:
        # the attribute and getrefcount's own argument; anything more is a chunk still held
        return sys.getrefcount(self.array) > 2


class GatedSource(ContiguousSource):
    """A streamed bucket: unreadable (fetches park) until it is copied and checksummed (`ready`); readable by a request
    that takes bytes before the checksum (`read_early`) once its last copy landed (`landed`)."""

    __slots__ = ("landed", "ready")

    def __init__(self, data: torch.Tensor) -> None:
        super().__init__(data)
        self.ready = False
        self.landed = False

    def read(self, offset: int, nbytes: int) -> Any:
        if not self.ready:
            return None
        return self.array[offset : offset + nbytes].data

    def contiguous(self) -> Any:
        return self.array if self.ready else None

    def read_early(self, offset: int, nbytes: int) -> Any:
        if not (self.ready or self.landed):
            return None
        return self.array[offset : offset + nbytes].data

    def contiguous_early(self) -> Any:
        return self.array if self.ready or self.landed else None


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


def layout_key(items: Any) -> tuple[tuple[str, torch.Size, torch.dtype], ...]:
    """What a plan depends on, of ``(name, tensor)`` pairs: each name, shape and dtype in order (cheap to build and
    compare: no sizes computed)."""
    return tuple((n, t.shape, t.dtype) for n, t in items)


class PlanMemo:
    """The previous dict's or module's plan, kept by its publisher: a trainer publishes the same tensors every version,
    so the next one with the same `layout_key` (and bucket size) reuses it (the places and the planner are only read)."""

    __slots__ = ("key", "places", "planner")

    def __init__(self) -> None:
        self.key: tuple[int, tuple[tuple[str, torch.Size, torch.dtype], ...]] | None = None
        self.places: list[Place] = []
        self.planner: BucketPlanner | None = None


def plan_version(named_tensors: Any, bucket_bytes: int, layout: list[tuple[str, str, tuple[int, ...], int]] | None,
                 memo: PlanMemo | None = None) -> tuple[Any, list[Place] | None, BucketPlanner]:
    """(the tensors, where each goes in order, the planner) for one version.

    A dict or a module is planned from its sizes (`memo`: the previous plan, reused when the names, shapes and dtypes
    are the same, and replaced otherwise); an iterator is planned from the reserved `layout` (`layout_of`) and
    checked against it as it streams; an iterator without one is planned as it comes (`places` None: `packed_version`).
    """
    planner = BucketPlanner(bucket_bytes)
    if isinstance(named_tensors, (Mapping, torch.nn.Module)):
        items: Any = list(named_tensors_of(named_tensors))
        key = (bucket_bytes, layout_key(items)) if memo is not None and _MEMO_PLAN else None
        if key is not None and memo is not None and memo.planner is not None and key == memo.key:
            return items, memo.places, memo.planner
        layout = [(n, dtype_name(t.dtype), tuple(int(x) for x in t.shape), tensor_bytes(t)) for n, t in items]
        places = _place(planner, layout)
        if key is not None and memo is not None:
            memo.key, memo.places, memo.planner = key, places, planner
        return items, places, planner
    elif layout is not None:
        items = named_tensors_of(named_tensors)
    else:
        return named_tensors_of(named_tensors), None, planner
    return items, _place(planner, layout), planner


def _place(planner: BucketPlanner, layout: list[tuple[str, str, tuple[int, ...], int]]) -> list[Place]:
    places: list[Place] = []
    for name, dtype, shape, nbytes in layout:
        idx, offset, _closed = planner.place(name, dtype, shape, nbytes)
        places.append(Place(idx, offset, name, shape, dtype, nbytes))
    return places


class Snapshot:
    """One streamed snapshot: copies in threads (CUDA on a side stream), each bucket checksummed when its last copy lands,
    then made readable and its checksum published (`WeightServer.complete_bucket`) on the loop."""

    def __init__(self, knobs: SnapshotKnobs, pools: SnapshotPools, sink: SnapshotSink, version: int, places: list[Place],
                 planner: BucketPlanner, buffers: list[torch.Tensor], segments: list[ShmBuffer | None]) -> None:
        self.knobs = knobs
        self.pools = pools
        self.sink = sink
        self.version = version
        self.places = places
        self.buffers = buffers
        self.loop = asyncio.get_running_loop()
        self.segments = segments
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
        self.served = ServedVersion(version=version, publisher_id=knobs.publisher_id, buckets=infos, sources=list(self.sources),
                                    chunk_bytes=knobs.chunk_bytes, host_key=knobs.host_key if shm else "", pool=knobs.pool)
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
        self.mix_aligned = [self.mix and word_aligned(b.tensors) for b in planner.buckets]
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
        self.folds = [_Fold(knobs.checksum_algorithm, b.nbytes, b.tensors) if _FOLD_CHECKSUMS is not False and b.nbytes >= _THREAD_COPY_BYTES else None
                      for b in planner.buckets]
        """Per bucket: its checksum folded as its copies land (`_Fold`), or None: summed whole after its last copy
        (a small bucket, summed inline)."""
        if not buffers:
            self.checksummed.set_result(None)
        self._lock = threading.Lock()
        self.holding = False
        """The buckets' checksums wait for the version's last copy (`_sums_after_copies`)."""
        self.held: list[int] = []
        """Buckets whose last copy landed while `holding`: summed by `_release_sums`."""
        for seg in self.segments:
            if seg is not None:
                seg.begin_write()

    def mix_for_deltas(self, wanted: bool = True) -> bool:
        """Before `copy`, when `wanted`: a network version whose deltas are made gets the mix64 of each bucket's bytes too (minor 27,
        `RESULT_MIX64_MINOR`: a delta manifest carries it as the mix64 of the resulting bytes, so a subscriber holding
        the base on its GPU verifies its rebuild there). Only where it is summed tensor by tensor (every bucket word
        aligned: on the GPU from CUDA tensors, else numpy per tensor range); True when it will be."""
        if self.mix or not wanted:
            return self.mix
        if not all(word_aligned(b.tensors) for b in self.planned):
            return False
        self.mix = True
        self.mix_aligned = [True] * len(self.planned)
        self.parts_left = [2] * len(self.buffers)
        return True

    def abandon(self) -> None:
        if not self.checksummed.done():
            self.checksummed.cancel()

    async def copy(self, items: Any) -> None:
        """Copy every tensor into its place; return when the caller's tensors may change (all copies landed).

        Tensors are copied as they come (an iterator is never gathered whole: at most 4 x copy_threads
        copies are outstanding, so at most that many of its tensors are alive at once). A dict's or a module's small
        tensors (all alive anyway) are copied in jobs of up to `_BATCH_BYTES` (`_Batches`)."""
        self.holding = self._sums_after_copies(items)
        if self.holding or not self._fold_wanted(items):
            self.folds = [None] * len(self.folds)
        streams: dict[Any, Any] = {}
        mix_streams: dict[Any, Any] = {}
        it = iter(items)
        inline = isinstance(items, list) and sum(tensor_bytes(t) for _, t in items) < _THREAD_COPY_BYTES
        # as many copies outstanding as the threads that run them take (an iterator's tensors stay bounded by it)
        threads = self.knobs.cpu_copy_threads if _list_on(items) == "cpu" else self.knobs.copy_threads
        window = asyncio.Semaphore(4 * max(1, threads))
        futures: list[asyncio.Future[None]] = []
        # how many copies each bucket waits for is known from the plan, so a bucket's last copy is its last
        for b in self.planned:
            self.left[b.index] = sum(1 for t in b.tensors if t.nbytes)
        self._finish_empty()
        # an iterator's tensors are copied one job each: its memory bound counts tensors alive, not bytes
        batches = _Batches(self, window, futures, _BATCH_BYTES if isinstance(items, list) else 0)
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
                await batches.add(_Job(idx, offset, tensor, stream, mix_stream), nbytes, stream is not None and self._pinned(idx))
                del tensor  # only the copy job holds it now
            await batches.flush()
            for _extra in it:
                raise ValueError(f"more tensors than the reserved layout's {len(self.places)}")
            self.marks["issued"] = time.perf_counter()
            await asyncio.gather(*futures)
            self.marks["landed"] = time.perf_counter()
            self._mark_landed()
            self._release_sums()
            if mix_streams:
                # the GPU mix64 read the trainer's tensors beside the copies: done before they may change (one wait for
                # the whole version, not one per tensor)
                await asyncio.to_thread(_synchronize_all, list(mix_streams.values()))
            self.marks["mixed"] = time.perf_counter()
        except BaseException:
            await asyncio.gather(*futures, return_exceptions=True)  # no copy still writes into buffers handed back
            raise

    def _sums_after_copies(self, items: Any) -> bool:
        """Whether the checksums wait for the version's last copy (`_SUMS_AFTER_COPIES`): by default for a list of CPU
        tensors (an iterator's are not known ahead; those are summed as today)."""
        if _SUMS_AFTER_COPIES is not None:
            return _SUMS_AFTER_COPIES
        return _list_on(items) == "cpu"

    def _mark_landed(self) -> None:
        """Every copy landed: with the checksums held, every bucket's bytes become servable to requests that take bytes
        before the checksum now (the trainer has its tensors back), and those waiting are woken. Not at each bucket's
        own last copy: the fetch then shares the host's cores and memory with the copies the trainer waits for (trainer
        blocked 0.57 s against 0.36-0.38 s on an H100 host, the row no faster, h100-weights-8b-cpu-tensors-early-during-s27.json;
        0.52-0.57 s against 0.22 s on the 2-core VM, cpu-publish-probe-early-bytes-2core-s26.json)."""
        if self.holding:
            for source in self.sources:
                source.landed = True
            self.sink.bytes_landed(self.version)

    def _release_sums(self) -> None:
        """Every copy landed: the buckets held for their checksum are summed now, in order (the first is served first)."""
        with self._lock:
            held, self.held, self.holding = sorted(self.held), [], False
        for idx in held:
            self.pools.sum.submit(self._checksum, idx)

    def _fold_wanted(self, items: Any) -> bool:
        """Whether folding the checksums during the copies overlaps them: CUDA tensors are copied by the copy engine
        (the host's cores are free), CPU tensors by `copy_threads` threads, so a fold needs a core beyond those and the
        event loop's; without one it only moves the checksum's time into the copy's (the trainer waits longer)."""
        if _FOLD_CHECKSUMS is not None:
            return _FOLD_CHECKSUMS
        if _list_on(items) == "cuda":
            return True
        return host_cores() > self.knobs.cpu_copy_threads + 1

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
            host_copy(dst, src)
        self._landed(idx, mix_stream, offset)

    def _copy_many(self, jobs: list[_Job]) -> None:
        """Copy thread: a batch of tensors, one after the other (`_copy`)."""
        for job in jobs:
            self._copy(job.idx, job.offset, job.tensor, job.stream, job.mix_stream)

    def _issue(self, jobs: list[_Job], landed: concurrent.futures.Future[None]) -> None:
        """Issuing thread (one per publisher, so copies are queued in the order they were planned): a batch of CUDA
        tensors' copies into page-locked memory queued on their side stream and their GPU mix64 parts beside them,
        nothing waited on; the landing thread waits for the batch's last copy (one event per batch)."""
        try:
            stream = jobs[0].stream
            for job in jobs:
                idx, offset, mix_stream = job.idx, job.offset, job.mix_stream
                src = flat_bytes(job.tensor)
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
        self.pools.land.submit(self._land, [(j.idx, j.mix_stream, j.offset) for j in jobs], done, landed)

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

    def _land(self, jobs: list[tuple[int, Any, int]], done: Any, landed: concurrent.futures.Future[None]) -> None:
        """Landing thread: copies complete in the order they were queued on the one side stream, so they are waited
        for in that order (a batch's last copy done: all of them are)."""
        try:
            done.synchronize()
            for idx, mix_stream, offset in jobs:
                self._landed(idx, mix_stream, offset)
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

    def _landed(self, idx: int, mix_stream: Any, offset: int) -> None:
        """A tensor's bytes (at `offset`) are in its bucket: folded into its checksum once enough are contiguous; the
        bucket's last copy finishes its checksum (and publishes the bucket's GPU-summed mix64 where every part of it
        was summed on the GPU)."""
        fold = self.folds[idx]
        rng = None
        with self._lock:
            self.left[idx] -= 1
            last = self.left[idx] == 0
            if fold is not None:
                fold.land(offset)
                if not fold.running:
                    rng = fold.take(0 if last else _FOLD_MIN_BYTES)
                    fold.running = rng is not None
        if rng is not None:
            self.pools.sum.submit(self._fold, idx, rng)
        if last:
            # every byte of the bucket is in place and none changes again: while the checksums wait for the copies
            # (`holding`), servable to a request that takes bytes before the checksum (`GatedSource.read_early`) from
            # the version's last copy (`_mark_landed`); otherwise the checksum follows the copy closely (folded beside
            # it) and the bucket is served from then on, as to anyone
            if self.slotted[idx]:
                assert self.slots is not None  # the digest's copy landed before the bucket's last copy was waited for
                self._call(self._mix_ready, idx, mix64_format(int(self.slots[idx])))
            elif self.mix and self.mix_parts[idx] == self._parts_of(idx):
                # every part is queued on the mix stream: a checksum thread adds them up there and publishes the sum
                assert mix_stream is not None
                queued = torch.cuda.Event()  # type: ignore[no-untyped-call]
                queued.record(mix_stream)
                self.pools.mix.submit(self._mix_from_device, idx, mix_stream, queued)
            if fold is None:
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
            return
        with self._lock:
            if self.holding:  # until the version's last copy landed (`_release_sums`)
                self.held.append(idx)
                return
        self.pools.sum.submit(self._checksum, idx)

    def _fold(self, idx: int, rng: tuple[int, int] | None) -> None:
        """Checksum thread: fold the bucket's landed bytes into its checksum, range after range while more are ready;
        the range that reaches the bucket's end publishes the digest (`_digest_ready`)."""
        fold = self.folds[idx]
        assert fold is not None
        try:
            # withdrawn, abandoned or evicted (its buffers may serve the next version): stop at the next range
            while rng is not None and not self.checksummed.done():
                lo, hi = rng
                fold.summer.update(self.buffers[idx][lo:hi].numpy())
                if hi == fold.nbytes:
                    digest = fold.summer.hexdigest()
                    break
                with self._lock:
                    rng = fold.take(0 if self.left[idx] == 0 else _FOLD_MIN_BYTES)
                    fold.running = rng is not None
            else:
                return
        except BaseException as exc:  # noqa: BLE001 - handed to the loop, which withdraws the version
            self._call(self._failed, exc)
            return
        self._digest_ready(idx, digest)

    def _checksum(self, idx: int) -> None:
        """Checksum thread (xxh3 releases the GIL, so buckets are summed in parallel): the whole bucket at once."""
        try:
            summer = Checksummer(self.knobs.checksum_algorithm)
            if self.buffers[idx].numel():
                summer.update(self.buffers[idx].numpy())
            digest = summer.hexdigest()
        except BaseException as exc:  # noqa: BLE001 - handed to the loop, which withdraws the version
            self._call(self._failed, exc)
            return
        self._digest_ready(idx, digest)

    def _digest_ready(self, idx: int, digest: str) -> None:
        """Checksum thread: the bucket's checksum published (it becomes readable), then its CPU mix64 where needed."""
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
        self.sink.complete_bucket(self.version, idx, digest)
        self._part_done(idx)

    def _mix_ready(self, idx: int, digest: str) -> None:
        """The bucket's bytes are in its segment and their mix64 is known: a subscriber staging to a GPU may copy it
        (the segment's header names the version from now on; the xxh3 checksum may still be pending)."""
        if self.checksummed.done():
            return
        seg = self.segments[idx]
        if seg is not None:
            seg.end_write(self.version)
        self.sink.set_host_mix64(self.version, idx, digest)
        self._part_done(idx)

    def _part_done(self, idx: int) -> None:
        self.parts_left[idx] -= 1
        if self.parts_left[idx] == 0:
            self.pending -= 1
            if self.pending == 0:
                self.checksummed.set_result(None)


class _Batches:
    """The copy jobs of one `Snapshot.copy`: small tensors (an adapter's matrices: hundreds of a few hundred KB each)
    go to a thread together, up to `_BATCH_BYTES` a job, since a thread hop per tensor cost more than its bytes (most
    of an adapter version's snapshot); at most the window's count of jobs are outstanding."""

    def __init__(self, snap: Snapshot, window: asyncio.Semaphore, futures: list[asyncio.Future[None]], batch_bytes: int) -> None:
        self.snap = snap
        self.batch_bytes = batch_bytes
        self.window = window
        self.futures = futures
        self.jobs: list[_Job] = []
        self.nbytes = 0
        self.issued = False
        """The jobs are CUDA copies into page-locked memory (the issuing and landing threads), else copy-thread jobs."""

    async def add(self, job: _Job, nbytes: int, issued: bool) -> None:
        if self.jobs and (issued != self.issued or self.jobs[-1].stream is not job.stream):
            await self.flush()
        self.issued = issued
        self.jobs.append(job)
        self.nbytes += nbytes
        if self.nbytes >= self.batch_bytes:
            await self.flush()

    async def flush(self) -> None:
        if not self.jobs:
            return
        jobs, self.jobs, self.nbytes = self.jobs, [], 0
        pools = self.snap.pools
        await self.window.acquire()
        if self.issued:
            # into page-locked memory: queued by the issuing thread, waited for by the landing thread (the copy
            # engine never waits for a copy thread to be scheduled, whatever else the host runs)
            landed: concurrent.futures.Future[None] = concurrent.futures.Future()
            pools.issue.submit(self.snap._issue, jobs, landed)
            fut = asyncio.wrap_future(landed)
        else:
            fut = asyncio.wrap_future(pools.copy.submit(self.snap._copy_many, jobs))
        fut.add_done_callback(lambda _f: self.window.release())
        self.futures.append(fut)


def _list_on(items: Any) -> str | None:
    """The device type of a list of (name, tensor) pairs (its first tensor's); None for an iterator or an empty list."""
    if isinstance(items, list) and items and isinstance(items[0][1], torch.Tensor):
        return str(items[0][1].device.type)
    return None


def _keep_until_done(t: torch.Tensor, stream: Any) -> None:
    """The caching allocator does not hand `t`'s memory out again before `stream`'s work queued so far is done (an
    iterator's tensor may be freed by its producer while its copy or mix64 is still queued)."""
    with contextlib.suppress(RuntimeError):  # memory the caching allocator does not own: the caller keeps it alive
        t.record_stream(stream)


def _synchronize_all(streams: list[Any]) -> None:
    for st in streams:
        st.synchronize()


def word_aligned(tensors: Any) -> bool:
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


def cpu_bytes(tensor: torch.Tensor) -> memoryview:
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return t.reshape(-1).view(torch.uint8).numpy().data




# --------------------------------------------------------------------------- the buckets snapshots copy into

_SHM_HEADROOM_BYTES = 64 * _MiB
"""Left free in /dev/shm beyond what a version's segments need (other users of the host)."""


class SnapshotBuffers:
    """The buckets a publisher's snapshots copy into: an evicted version's buffer of the same size and kind (a spare)
    once no chunk of it is still queued for a peer, else one of the host pool or, where the path allows and /dev/shm
    has room, of the shared-memory pool (page-locked where CUDA is available, within `pinned_budget_bytes`)."""

    def __init__(self, *, pin: bool, pinned_budget_bytes: int | None, shm: bool, pool: str, owner_id: str) -> None:
        self.owner_id = owner_id
        self.host = BufferPool(kind="host", pin=pin, pinned_budget_bytes=pinned_budget_bytes)
        self.shm: BufferPool | None = None
        if shm:
            sweep_stale_segments(pool)
            self.shm = BufferPool(kind="shm", pin=pin, pinned_budget_bytes=pinned_budget_bytes, pool=pool, owner_id=owner_id)
        self.spare: list[ContiguousSource] = []
        """Buckets of evicted versions, reused by the next snapshot once nothing of theirs is in flight."""
        self.shm_fallbacks = 0
        """Versions buffered in ordinary memory although the path asked for shared memory (no room in /dev/shm)."""
        self._fallback_log = RateLimitedLog(log)

    @property
    def buffers_allocated(self) -> int:
        return self.host.allocations + (self.shm.allocations if self.shm else 0)

    @property
    def pinned_bytes(self) -> int:
        return self.host.pinned_bytes + (self.shm.pinned_bytes if self.shm else 0)

    def segments(self) -> list[ShmBuffer]:
        """Every shared-memory segment held now (served, spare or reserved)."""
        return self.shm.segments() if self.shm is not None else []

    def segment_of(self, buf: torch.Tensor) -> ShmBuffer | None:
        return self.shm.segment_of(buf) if self.shm is not None else None

    def pool_for(self, fresh_bytes: int, path: str) -> BufferPool:
        """The shared-memory pool where `path` allows and /dev/shm has room for `fresh_bytes` more, else host memory
        (counted in `shm_fallbacks`; on the ``shm`` path, `WeightSyncError`)."""
        if self.shm is None or path == "network":
            return self.host
        if fresh_bytes <= 0 or shm_free_bytes() >= fresh_bytes + _SHM_HEADROOM_BYTES:
            return self.shm
        self.shm_fallbacks += 1
        self._fallback_log.warning("shm-room", "weight publisher %s: /dev/shm has %d bytes free, a version needs %d more: "
                                   "buffering in ordinary memory (network path; give /dev/shm room, see docs/weights.md)",
                                   self.owner_id, shm_free_bytes(), fresh_bytes)
        if path == "shm":
            raise WeightSyncError(f"path 'shm': /dev/shm has {shm_free_bytes()} bytes free, a version needs {fresh_bytes}")
        return self.host

    def reserve(self, layout: list[tuple[str, str, tuple[int, ...], int]], bucket_bytes: int, copies: int, path: str
                ) -> tuple[int, list[torch.Tensor]]:
        """Allocate (and touch) the buckets of `layout` (`layout_of`) for `copies` versions on `path`; (the bytes
        reserved, the shared-memory buffers to warm up: page-locked segments where CUDA is available, else none)."""
        planner = BucketPlanner(bucket_bytes)
        for name, dtype, shape, nbytes in layout:
            planner.place(name, dtype, shape, nbytes)
        sizes = [b.nbytes for b in planner.buckets]
        total = sum(sizes) * copies
        pool = self.pool_for(total, path)
        made = pool.reserve([n for _ in range(copies) for n in sizes])
        log.info("weight publisher %s reserved %d bytes (%d buckets x %d versions, %s memory, %d page-locked)",
                 self.owner_id, total, len(sizes), copies, pool.kind, pool.pinned_bytes)
        return total, (made if pool.kind == "shm" and pool.pin and torch.cuda.is_available() else [])

    def take(self, sizes: list[int], path: str) -> list[torch.Tensor]:
        """One buffer per bucket size for a version on `path`: spares first, then the reserved segments (their room is
        taken already), then fresh memory of the kind /dev/shm has room for; what no version reuses is freed."""
        spare = [int(src.data.numel()) for src in self.spare]
        reserved = self.shm.free_sizes() if self.shm is not None else []
        fresh = 0
        for n in sizes:
            if n in spare:
                spare.remove(n)
            elif n in reserved:
                reserved.remove(n)
            else:
                fresh += n
        pool = self.pool_for(fresh, path)
        buffers = [self._buffer(n, pool) for n in sizes]
        self.trim_spares(sum(sizes), kind=pool.kind)  # after a layout or path change, what no version reuses is freed
        return buffers

    def retire(self, sources: list[Any]) -> None:
        """An evicted (or withdrawn) version's buckets become spares for the next snapshot."""
        self.spare.extend(src for src in sources if isinstance(src, ContiguousSource))

    def switch(self, path: str) -> None:
        """The next versions go on `path`: the other kind's idle buffers are freed now (served versions keep theirs
        until evicted)."""
        self.trim_spares(0)
        (self.host if path != "network" else self.shm or self.host).trim(0)

    def trim_spares(self, keep_bytes: int, *, kind: str | None = None) -> None:
        """Free spare buffers (oldest first) down to `keep_bytes`, and every spare not of `kind` (``host``/``shm``:
        the kind the next versions take), released in the background: after a path switch these are a whole
        version of page-locked segments, whose release took 0.41 s of a trainer's publish on the H200."""
        self.spare, host, shm = self._split_spares(keep_bytes, kind)
        for pool, bufs in ((self.host, host), (self.shm, shm)):
            if pool is not None and bufs:
                pool.drop(bufs)  # takes the last references: the unmapping happens in its thread

    def close(self) -> None:
        self.spare = []
        self.host.close()
        if self.shm is not None:
            self.shm.close()  # segments unlinked; mappings go with the last view

    def _split_spares(self, keep_bytes: int, kind: str | None) -> tuple[list[ContiguousSource], list[torch.Tensor], list[torch.Tensor]]:
        """(the spares kept, the host buffers and the shm buffers to free) for `trim_spares`."""
        host: list[torch.Tensor] = []
        shm: list[torch.Tensor] = []
        keep: list[ContiguousSource] = []
        for src in self.spare:
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
        for i, src in enumerate(self.spare):
            if int(src.data.numel()) == nbytes and not src.in_flight() and (self.segment_of(src.data) is not None) == (pool.kind == "shm"):
                del self.spare[i]
                return src.data
        return pool.take(nbytes)


def warm_segments(bufs: list[torch.Tensor], after: threading.Thread | None = None) -> threading.Thread:
    """A thread (a publish waits for it; `after`, an earlier one, is waited for first): one device-to-host pass into
    every segment just reserved, and the GPU mix64 at full slice size on the mix stream, so the first version of a shm
    snapshot from CUDA tensors does not pay the first copies into the freshly registered pages nor the mix64's first
    temporaries (its first version was 0.64 s blocked against 0.35 s warm, 2026-12-04)."""
    if after is not None:
        after.join()

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

    thread = threading.Thread(target=warm, name="weights-snapshot-warm", daemon=True)
    thread.start()
    return thread


# --------------------------------------------------------------------------- versions not snapshotted by `Snapshot`


async def packed_version(items: Any, version: int, bucket_bytes: int, knobs: SnapshotKnobs) -> ServedVersion:
    """An iterator without a reserved layout: packed into buckets that grow as it comes, served once whole."""
    packer = BucketPacker(bucket_bytes, checksum_algorithm=knobs.checksum_algorithm)
    for name, tensor in items:
        if tensor_bytes(tensor) >= THREAD_COPY_BYTES:
            await asyncio.to_thread(packer.add, name, tensor)
        else:
            packer.add(name, tensor)
    buckets = await asyncio.to_thread(packer.finish)
    return ServedVersion(version=version, publisher_id=knobs.publisher_id, buckets=tuple(b.info for b in buckets),
                         sources=[ContiguousSource(b.data) for b in buckets], chunk_bytes=knobs.chunk_bytes, pool=knobs.pool)


async def referenced_version(named_tensors: Any, version: int, bucket_bytes: int, knobs: SnapshotKnobs) -> ServedVersion:
    """``keep_versions=0``: the caller's own tensors served in place (contiguous CPU tensors; others copied once, to
    CPU and contiguous), each bucket checksummed over its pieces."""
    planner = BucketPlanner(bucket_bytes)
    pieces: dict[int, list[tuple[int, memoryview]]] = {}
    sums: dict[int, Checksummer] = {}
    for name, tensor in named_tensors_of(named_tensors):
        nbytes = tensor_bytes(tensor)
        idx, offset, _closed = planner.place(name, dtype_name(tensor.dtype), tuple(int(s) for s in tensor.shape), nbytes)
        view = cpu_bytes(tensor)
        pieces.setdefault(idx, []).append((offset, view))
        summer = sums.setdefault(idx, Checksummer(knobs.checksum_algorithm))
        if nbytes >= THREAD_COPY_BYTES:
            await asyncio.to_thread(summer.update, view)
        elif nbytes:
            summer.update(view)
    infos = tuple(
        BucketInfo(index=b.index, dtype=b.dtype, nbytes=b.nbytes, checksum=sums.get(b.index, Checksummer(knobs.checksum_algorithm)).hexdigest(),
                   tensors=tuple(TensorInfo(name=t.name, dtype=t.dtype, shape=t.shape, offset=t.offset, nbytes=t.nbytes) for t in b.tensors))
        for b in planner.buckets
    )
    return ServedVersion(version=version, publisher_id=knobs.publisher_id, buckets=infos,
                         sources=[PiecesSource(pieces.get(i, [])) for i in range(len(infos))], chunk_bytes=knobs.chunk_bytes)


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """One CPU tensor's bytes into a host buffer (both uint8, the same length): numpy's copy, which is the C library's
    `memcpy` (non-temporal stores for large copies: the destination is written without being read first), the GIL
    released. Measured on the H200 host (16 cores, `bench/host_copy_probe.py`, the 8B layout into /dev/shm):
    34.7 GB/s in 8 threads against 27.7 GB/s for torch's `copy_` (1.25x), 44.1 against 38.1 GB/s in 16. torch's
    `copy_` where numpy cannot view a tensor (a subclass, a tensor with the conjugate or negative bit)."""
    try:
        d, s = dst.numpy(), src.numpy()
    except (RuntimeError, TypeError):
        dst.copy_(src)
        return
    np.copyto(d, s)
