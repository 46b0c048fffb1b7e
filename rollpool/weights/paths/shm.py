"""The shared-memory paths: a publisher on this host keeps each version's buckets in /dev/shm segments
(`rollpool.weights.memory.ShmBuffer`, written by its snapshot), and a subscriber on the same host reads them.

Two subscriber ends, tried in this order by the plan (`rollpool.weights.manifest.plan`):
    - `ShmDevicePath` (``shm_device``): each bucket is copied host-to-device from the segment (page-locked once,
      when first mapped) into a device buffer and verified there, on the GPU, against the publisher's mix64 of its
      host bytes (`BucketInfo.host_mix64`). Buckets are staged as their mix64 appears, so the copies overlap the
      publisher's snapshot: the manifest with more of them is asked for once and the server parks the request until
      they exist (`ManifestRequest.after_mix64`, minor 19); a server older than that is asked again every 2 ms.
    - `ShmPath` (``shm``): each bucket is copied on the CPU into the subscriber's host buffer and checksummed (xxh3)
      while in cache.

What they promise
    - The bytes verified are the subscriber's own copy (what the engine loads), never the shared segment.
    - A bucket that fails its checksum is copied again, at most `max_refetch` times, then the version is refused
      whole (`WeightSyncError`); a torn read (the publisher reused the segment: the version was evicted), a segment
      that cannot be mapped, a publisher that gives no GPU checksums, or GPU checksums that do not come within
      `fetch_timeout_s` is a `PathFallbackError` (the next path serves the version, so nothing is lost).
    - A parked request unanswered after its share of that deadline (`fetch_timeout_s` / (`max_refetch` + 1): the
      answer was lost or is late) is asked again; a late answer to the earlier one is dropped unread.
    - `ShmSegments` keeps the publisher's segments mapped across versions (the publisher reuses K sets in turn), and
      maps (and page-locks, on a device that registers) the segments a manifest names (`Manifest.shm_reserved`,
      minor 11) ahead of use, in a thread, so no version pays it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from rollpool.protocol.codec import PARKED_MINOR
from rollpool.protocol.errors import WeightSyncError
from rollpool.protocol.logs import RateLimitedLog
from rollpool.protocol.messages import Manifest
from rollpool.weights.bucketing import Checksummer, unpack_bucket, verify_checksum
from rollpool.weights.gpu import DeviceSlabs, arena_offsets, mix64_format, mix64_partial
from rollpool.weights.manifest import SHM, SHM_DEVICE, check_manifest
from rollpool.weights.memory import ShmReader, ShmUnavailableError
from rollpool.weights.paths.base import (
    BucketCallback,
    FetchContext,
    Fetched,
    FetchJob,
    ManifestTimeoutError,
    PathFallbackError,
    WeightVersionGoneError,
)

__all__ = ["CudaStaging", "ShmDevicePath", "ShmPath", "ShmSegments"]

log = logging.getLogger("rollpool.weights.subscriber")


class ShmSegments:
    """The publisher's segments mapped here (kept across versions), the staging edge to the engine's GPU, and the
    registering thread that maps what a manifest names ahead of use."""

    def __init__(self, host_key: str, path: str, slabs: DeviceSlabs) -> None:
        self.host_key = host_key
        self.path = path
        self.slabs = slabs
        self.stage_device: str | None = None
        """The device the engine loads from (None: the CPU shared-memory path only)."""
        self.device_ops: Callable[[str, DeviceSlabs], Any] = CudaStaging
        """Makes the staging edge for `stage_device` (tests put a fake device here, named so)."""
        self.ops: Any = None
        self.readers: dict[str, ShmReader] = {}
        self.lock = threading.RLock()
        """`readers` is also filled by the registering thread (`register_ahead`)."""
        self.segment_maps = 0
        """Segments mapped so far (a warm subscriber maps none per version: the publisher reuses its segments)."""
        self.segments_registered_ahead = 0
        """Segments mapped (and page-locked, on a device that registers) by the registering thread before a version used them."""
        self._ahead: tuple[tuple[str, int], ...] = ()
        """The publisher's segments last named (`Manifest.shm_reserved`) and handed to the registering thread."""
        self.ahead_thread: threading.Thread | None = None
        self._errlog = RateLimitedLog(log)

    def close(self) -> None:
        self._ahead = ()  # a registering thread stops at its next segment
        with self.lock:
            for r in self.readers.values():
                r.close()
            self.readers = {}

    def stats(self) -> dict[str, int]:
        with self.lock:
            registered = sum(1 for r in self.readers.values() if r.registered)
            return {"segments_mapped": len(self.readers), "segment_maps": self.segment_maps, "segments_registered": registered,
                    "segments_registered_ahead": self.segments_registered_ahead}

    def staging(self) -> Any:
        assert self.stage_device is not None
        with self.lock:  # made once, by the loop or the registering thread
            if self.ops is None:
                self.ops = self.device_ops(self.stage_device, self.slabs)
            return self.ops

    def reader(self, name: str, nbytes: int, register: bool = False) -> ShmReader:
        with self.lock:
            r = self.readers.get(name)
            if r is not None and r.nbytes == nbytes and r.alive():
                if register and not r.registered:
                    self._register(r)
                return self.readers[name]
            if r is not None:
                self.readers.pop(name).close()
            r = self.readers[name] = ShmReader(name, nbytes)
            self.segment_maps += 1
            if register:
                self._register(r)
            return self.readers[name]

    def drop_dead(self) -> None:
        with self.lock:
            for name in [n for n, r in self.readers.items() if not r.alive()]:
                self.readers.pop(name).close()

    def registers_ahead(self) -> bool:
        return self.stage_device is not None and self.path in ("auto", "shm")

    def register_ahead(self, manifest: Manifest) -> None:
        """A manifest named the publisher's segments (`Manifest.shm_reserved`): a subscriber that stages from shared
        memory to its GPU maps and page-locks them now, in a thread (page-locking runs at about 2.5 GB/s: 2 x 14.5 GB
        would cost the first version 12 s), so no version pays it and the event loop and generation go on."""
        if not self.registers_ahead() or (manifest.shm_reserved and manifest.host_key != self.host_key):
            return
        want = tuple((seg.name, seg.nbytes) for seg in manifest.shm_reserved)
        if want == self._ahead:
            return  # (an empty list the first time: a publisher of minor 10, or one without segments)
        self._ahead = want
        self.ahead_thread = threading.Thread(target=self._register_segments, args=(want,), name="weights-register", daemon=True)
        self.ahead_thread.start()

    def _register_segments(self, want: tuple[tuple[str, int], ...]) -> None:
        """Registering thread: map and page-lock each named segment not mapped yet (a newer list supersedes this one)."""
        t0 = time.perf_counter()
        made = nbytes = 0
        registers = self.staging().registers
        for name, n in want:
            if self._ahead != want:
                return  # superseded by a newer list, or closed
            with self.lock:
                known = self.readers.get(name)
                if known is not None and known.nbytes == n and (known.registered or not registers) and known.alive():
                    continue
            try:
                self.reader(name, n, True)
            except ShmUnavailableError as exc:
                log.debug("segment %s not mapped ahead: %s", name, exc)
                continue
            made += 1
            nbytes += n
            self.segments_registered_ahead += 1
        self.drop_dead()
        if made:
            self._warm_staging([name for name, _n in want])
        with self.lock:
            registered = sum(1 for r in self.readers.values() if r.registered)
        log.info("weight segments registered %s", json.dumps({"segments": len(want), "mapped_now": made, "bytes_now": nbytes,
                                                              "registered": registered, "seconds": round(time.perf_counter() - t0, 3),
                                                              "at": time.time()}))

    def _warm_staging(self, names: list[str]) -> None:
        """Registering thread: one staged copy and checksum from every named segment (64 KiB each, and one full mix64
        slice) into a scratch buffer, so the first version does not pay the staging's first kernels, index tensors and
        first copies out of each freshly registered segment (version 1 of the shm row took 0.45 s to fetch against 0.33
        s warm, 2026-12-04). Best effort: a failure is logged at debug level and the fetch pays it instead."""
        try:
            ops = self.staging()
            with self.lock:
                readers = [r for r in (self.readers.get(n) for n in names) if r is not None and r.nbytes]
            if not readers:
                return
            big = max(readers, key=lambda r: r.nbytes)
            scratch = ops.scratch(min(big.nbytes, _WARM_SLICE_BYTES))  # not a version's slab: a fetch may run meanwhile
            handles = [ops.stage(r.host_tensor()[: min(r.nbytes, _WARM_PIECE_BYTES)], scratch[: min(r.nbytes, _WARM_PIECE_BYTES)])
                       for r in readers]
            handles.append(ops.stage(big.host_tensor()[: scratch.numel()], scratch))
            for h in handles:
                ops.digest(h)
        except Exception:
            log.debug("warming the shm staging path up failed", exc_info=True)

    def _register(self, r: ShmReader) -> None:
        """Page-lock a mapped segment for the staging device, once per mapping (it is kept across versions)."""
        ops = self.staging()
        if not ops.registers:
            return
        if r.register():
            return
        # this CUDA cannot register a read-only mapping: map it again read-write (never written here) and register that
        rw = ShmReader(r.name, r.nbytes, writable=True)
        if rw.register():
            self.readers[r.name] = rw
            r.close()
            return
        rw.close()
        self._errlog.warning("register", "weight segment %s could not be page-locked here; copies to the GPU run from pageable memory", r.name)



class _ShmEnd:
    """What both subscriber ends share: the context, the segments, and their own threads (made at first use)."""

    _threads_name = ""

    def __init__(self, ctx: FetchContext, segments: ShmSegments, threads: int) -> None:
        self.ctx = ctx
        self.segments = segments
        self._threads = threads
        self._exec: ThreadPoolExecutor | None = None

    def _executor(self) -> ThreadPoolExecutor:
        if self._exec is None:
            self._exec = ThreadPoolExecutor(self._threads, thread_name_prefix=self._threads_name)
        return self._exec

    def close(self) -> None:
        if self._exec is not None:
            self._exec.shutdown(wait=False, cancel_futures=True)
            self._exec = None


class ShmPath(_ShmEnd):
    """The CPU end of the shared-memory path (see the module docstring)."""

    name = SHM
    host_buffers = True
    _threads_name = "weights-shm"

    def __init__(self, ctx: FetchContext, segments: ShmSegments) -> None:
        super().__init__(ctx, segments, ctx.copy_threads)

    async def fetch(self, job: FetchJob) -> Fetched:
        assert job.buffers is not None
        return Fetched(await self._fetch_shm(job.manifest, job.buffers, job.on_bucket), job.buffers, job.slab, SHM)

    async def _fetch_shm(self, manifest: Manifest, buffers: list[torch.Tensor], on_bucket: BucketCallback | None) -> Manifest:
        """Copy each bucket out of the publisher's segment into our buffer, checksumming our copy (what the engine loads).

        Returns the manifest with every checksum."""
        if not all(b.checksum for b in manifest.buckets):
            # a streamed publish still checksumming: wait for the manifest with every checksum (small, on the socket)
            manifest = check_manifest(await self.ctx.manifests.fetch_manifest(manifest.version, streamed=False))
        readers: list[ShmReader] = []
        try:
            for b in manifest.buckets:
                try:
                    readers.append(self.segments.reader(b.shm_segment, b.nbytes))
                except ShmUnavailableError as exc:
                    raise PathFallbackError(f"cannot map the publisher's segment ({exc})") from exc
            loop = asyncio.get_running_loop()
            exec_ = self._executor()
            failures = [0] * len(readers)

            async def one(i: int) -> None:
                info = manifest.buckets[i]
                while True:
                    outcome = await loop.run_in_executor(exec_, _copy_verified, readers[i], manifest.version, info.checksum, buffers[i])
                    if outcome == "torn":
                        raise PathFallbackError(f"bucket {i}: the publisher reused its segment while it was read (version {manifest.version} evicted)")
                    if outcome == "ok":
                        self.ctx.counters.shm_bytes += info.nbytes
                        if on_bucket is not None:
                            on_bucket(i, unpack_bucket(info, buffers[i]))
                        return
                    self.ctx.bucket_failed(manifest.version, i, failures, "shm", "from shared memory", "shared memory")

            results = await asyncio.gather(*(one(i) for i in range(len(readers))), return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            # a real failure (checksum, gone) wins over a reason to fall back to the network
            errors.sort(key=lambda e: isinstance(e, PathFallbackError))
            if errors:
                raise errors[0]
        finally:
            # the publisher reuses its segments across versions (K sets, in turn): keep every live one mapped, not only this
            # version's (no page-table faults next time); unlinked ones are dropped
            self.segments.drop_dead()
        return manifest



class ShmDevicePath(_ShmEnd):
    """The end of the shared-memory path that stages to the engine's GPU (see the module docstring). Its one thread
    waits for staged buckets' digests, in the order they were queued."""

    name = SHM_DEVICE
    host_buffers = False
    _threads_name = "weights-verify"

    def __init__(self, ctx: FetchContext, segments: ShmSegments) -> None:
        super().__init__(ctx, segments, 1)

    async def fetch(self, job: FetchJob) -> Fetched:
        return await self._fetch_shm_device(job.manifest, job.on_bucket)

    async def _fetch_shm_device(self, manifest: Manifest, on_bucket: BucketCallback | None) -> Fetched:
        """Copy each bucket host-to-device from the publisher's segment (registered here once, when first mapped) into a
        device buffer and verify the mix64 of the device copy (the bytes the engine loads) on the GPU against the
        publisher's `host_mix64`. Buckets are staged as their mix64 appears in the manifest (`_GpuChecksums`: one parked
        request at a time), so the copies overlap the publisher's snapshot. A bad bucket is copied again (at
        most `max_refetch` times), then the version is refused whole; a torn read, a publisher that gives no GPU
        checksums, or a segment that cannot be mapped is a `PathFallbackError` (the CPU paths serve the version)."""
        ops = self.segments.staging()
        loop = asyncio.get_running_loop()
        timeline = _Timeline(loop.time(), len(manifest.buckets))
        try:
            readers = await asyncio.to_thread(lambda: [self.segments.reader(b.shm_segment, b.nbytes, True) for b in manifest.buckets])
        except ShmUnavailableError as exc:
            raise PathFallbackError(f"cannot map the publisher's segment ({exc})") from exc
        timeline.mark("mapped", loop.time())
        sizes = [b.nbytes for b in manifest.buckets]
        offsets, total = arena_offsets(sizes)
        slab = ops.alloc(total)
        timeline.mark("slab", loop.time())
        buffers = [slab[o : o + n] for o, n in zip(offsets, sizes, strict=True)]
        done: set[int] = set()
        verifying: dict[int, asyncio.Future[str]] = {}
        """Buckets whose copy is queued: the verifying thread waits for each one's digest (in the order they were queued),
        while this loop goes on asking for the next buckets' GPU checksums."""
        failures = [0] * len(sizes)
        checksums = _GpuChecksums(self.ctx, manifest.version, loop.time() + self.ctx.fetch_timeout_s)
        try:
            while len(done) < len(sizes):
                ready = [i for i, b in enumerate(manifest.buckets) if b.host_mix64 and i not in done and i not in verifying]
                if ready:
                    timeline.seen(ready, loop.time())
                    queued = await asyncio.to_thread(_stage_queue, ops, readers, manifest.version, ready, buffers)
                    timeline.queued(ready, loop.time())
                    for i, state, handle in queued:
                        verifying[i] = loop.run_in_executor(self._executor(), timeline.digested, i, _stage_outcome, ops, readers[i],
                                                            state, handle, manifest.buckets[i].host_mix64)
                for i in sorted(i for i, f in verifying.items() if f.done()):
                    timeline.verified(i, loop.time())
                    if self._staged_bucket(manifest, i, verifying.pop(i).result(), buffers[i], failures, on_bucket):
                        done.add(i)
                    timeline.handed_s += loop.time() - timeline.t0 - timeline.verified_ms[i] / 1000
                if len(done) < len(sizes):
                    t_poll = loop.time()
                    manifest = await self._next_mix64(manifest, done, verifying, checksums)
                    timeline.waited(t_poll, loop.time())
        except BaseException:
            checksums.cancel()
            if verifying:  # copies still queued into the slab: it goes back once they are done
                asyncio.gather(*verifying.values(), return_exceptions=True).add_done_callback(lambda _f: ops.give(slab))
            else:
                ops.give(slab)
            raise
        finally:
            self.segments.drop_dead()  # unlinked segments (keep the live ones mapped)
        return Fetched(manifest, buffers, slab, SHM, {"staged_to": str(self.segments.stage_device), **self.segments.stats(),
                                                      "manifest_asks": checksums.asks, "manifest_reasks": checksums.reasks,
                                                      "timeline": timeline.as_dict(loop.time())}, on_device=True)

    async def _next_mix64(self, manifest: Manifest, done: set[int], verifying: dict[int, asyncio.Future[str]],
                          checksums: _GpuChecksums) -> Manifest:
        """`_fetch_shm_device` has nothing to queue: wait for the next verdict where every bucket left is queued (a bad
        one is queued again after it), else for whichever comes first of a verdict and the manifest with more GPU
        checksums (`checksums`: its request stays outstanding across verdicts)."""
        if not any(not b.host_mix64 for i, b in enumerate(manifest.buckets) if i not in done and i not in verifying):
            if verifying:
                await asyncio.wait(list(verifying.values()), return_when=asyncio.FIRST_COMPLETED)
            return manifest
        if manifest.protocol_minor < PARKED_MINOR and all(b.checksum for b in manifest.buckets) and not any(b.host_mix64 for b in manifest.buckets):
            raise PathFallbackError(NO_GPU_CHECKSUM)  # (a newer server says so by answering with none new: `_GpuChecksums`)
        asking = checksums.ask(manifest)
        waits: list[asyncio.Future[Any]] = [asking, *verifying.values()]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if not asking.done():
            return manifest  # a verdict first: handed on while the request stays parked
        again = check_manifest(checksums.take())
        if [(b.nbytes, b.shm_segment) for b in again.buckets] != [(b.nbytes, b.shm_segment) for b in manifest.buckets]:
            raise PathFallbackError("the publisher's segments changed under the fetch")
        return again

    def _staged_bucket(self, manifest: Manifest, i: int, outcome: str, buffer: torch.Tensor, failures: list[int],
                       on_bucket: BucketCallback | None) -> bool:
        """One bucket's staging outcome: True when verified (handed to `on_bucket`); a bad one is counted (and refused
        after `max_refetch` copies), a torn read falls back."""
        if outcome == "torn":
            raise PathFallbackError(f"bucket {i}: the publisher reused its segment while it was read (version {manifest.version} evicted)")
        info = manifest.buckets[i]
        if outcome == "ok":
            self.ctx.counters.shm_bytes += info.nbytes
            self.ctx.counters.device_stage_bytes += info.nbytes
            if on_bucket is not None:
                on_bucket(i, unpack_bucket(info, buffer))
            return True
        self.ctx.bucket_failed(manifest.version, i, failures, "shm_device", "staged from shared memory", "shared memory staged to the GPU")
        return False



class _GpuChecksums:
    """The manifest of one version with more GPU checksums than the fetch has, one request outstanding at a time.

    A server of `PARKED_MINOR` or later (`Manifest.protocol_minor`) is asked once per new checksum: it parks the
    request until the version carries more than the asker has (`ManifestRequest.after_mix64`). A try unanswered after
    `fetch_timeout_s` / (`max_refetch` + 1) is asked again (its answer was lost or is late; a late one is dropped, its
    request no longer routed), until the deadline. An older server is asked again every `_MIX64_POLL_S`, as before.
    Past the deadline, or refused (``busy``), the fetch falls back to the next path (`PathFallbackError`)."""

    def __init__(self, ctx: FetchContext, version: int, deadline: float) -> None:
        self.ctx = ctx
        self.version = version
        self.deadline = deadline
        self.try_s = ctx.fetch_timeout_s / (ctx.max_refetch + 1)
        self.asks = 0
        """Manifest requests sent (parked or polled)."""
        self.reasks = 0
        """Parked requests asked again after a try went unanswered."""
        self._task: asyncio.Task[Manifest] | None = None

    def ask(self, manifest: Manifest) -> asyncio.Task[Manifest]:
        """The request outstanding for a manifest with more GPU checksums than `manifest` (made if none is)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._ask(manifest), name="weights-gpu-checksums")
        return self._task

    def take(self) -> Manifest:
        """The answer of the finished request (or what it raised); the next `ask` sends a new one."""
        assert self._task is not None and self._task.done()
        task, self._task = self._task, None
        return task.result()

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _ask(self, manifest: Manifest) -> Manifest:
        loop = asyncio.get_running_loop()
        parks = manifest.protocol_minor >= PARKED_MINOR
        have = sum(1 for b in manifest.buckets if b.host_mix64)
        while True:
            remaining = self.deadline - loop.time()
            if remaining <= 0:
                raise PathFallbackError(f"the publisher's GPU checksums did not come within {self.ctx.fetch_timeout_s} s")
            self.asks += 1
            if not parks:
                await asyncio.sleep(_MIX64_POLL_S)
                return await self.ctx.manifests.fetch_manifest(self.version, delta=False)
            try:
                again = await self.ctx.manifests.fetch_manifest(self.version, attempts=1, delta=False, after_mix64=have,
                                                                timeout_s=min(remaining, self.try_s))
                if sum(1 for b in again.buckets if b.host_mix64) <= have:
                    raise PathFallbackError(NO_GPU_CHECKSUM)  # answered with none new: none will come
                return again
            except ManifestTimeoutError:
                self.reasks += 1
            except WeightVersionGoneError:
                raise
            except WeightSyncError as exc:  # refused (busy): the CPU copy serves the version
                raise PathFallbackError(f"the publisher refused to park the manifest request ({exc})") from exc


class _Timeline:
    """When each bucket of a staged fetch was seen with its GPU checksum, queued and verified (ms from the start of
    `_fetch_shm_device`), for the ``weights fetched`` log line: where a slow version spent its time."""

    def __init__(self, t0: float, buckets: int) -> None:
        self.t0 = t0
        self.marks: dict[str, float] = {}
        self.seen_ms = [-1.0] * buckets
        self.queued_ms = [-1.0] * buckets
        self.verified_ms = [-1.0] * buckets
        self.digest_ms = [-1.0] * buckets
        self.waits_ms: list[tuple[float, float]] = []
        """Each `_next_mix64` (a verdict or the manifest with more GPU checksums awaited): when it began and how long it took."""
        self.handed_s = 0.0
        """Time spent in ``on_bucket`` (the engine's staging of each verified bucket), on the loop."""

    def _ms(self, t: float) -> float:
        return round((t - self.t0) * 1000, 1)

    def mark(self, what: str, t: float) -> None:
        self.marks[what] = self._ms(t)

    def seen(self, which: list[int], t: float) -> None:
        for i in which:
            self.seen_ms[i] = self._ms(t)

    def queued(self, which: list[int], t: float) -> None:
        for i in which:
            self.queued_ms[i] = self._ms(t)

    def digested(self, i: int, fn: Callable[..., str], *args: Any) -> str:
        """Verifying thread: `fn(*args)` (`_stage_outcome`), noting when its digest came back."""
        try:
            return fn(*args)
        finally:
            self.digest_ms[i] = self._ms(time.monotonic())  # the event loop's clock (asyncio's loop.time())

    def waited(self, t0: float, t1: float) -> None:
        self.waits_ms.append((self._ms(t0), round((t1 - t0) * 1000, 1)))

    def verified(self, i: int, t: float) -> None:
        self.verified_ms[i] = self._ms(t)

    def as_dict(self, t_end: float) -> dict[str, Any]:
        return {"total_ms": self._ms(t_end), "waits": len(self.waits_ms), "on_bucket_ms": round(self.handed_s * 1000, 1),
                **{f"{k}_ms": v for k, v in self.marks.items()}, "seen_ms": self.seen_ms, "queued_ms": self.queued_ms,
                "digest_ms": self.digest_ms, "verified_ms": self.verified_ms, "waits_ms": self.waits_ms}


_WARM_PIECE_BYTES = 64 * 1024
_WARM_SLICE_BYTES = 64 * 1024 * 1024
"""`_warm_staging`: what is copied from each segment, and the largest copy (one full mix64 slice)."""
NO_GPU_CHECKSUM = "the publisher gives no GPU checksum (host_mix64) for this version"
_MIX64_POLL_S = 0.002
"""How often a server older than `PARKED_MINOR` is asked for the manifest again while some buckets' GPU checksums are
pending (a newer one parks the request instead)."""


class CudaStaging:
    """The staging edge of the shared-memory path on CUDA: host-to-device copies on one stream, the mix64 of each copy
    on another (waiting on the copy's event), device buffers from the subscriber's reused slabs."""

    registers = True

    def __init__(self, device: str, slabs: DeviceSlabs) -> None:
        from rollpool.weights.gpu import side_stream

        d = torch.device(device)
        self.device = d if d.index is not None else torch.device("cuda", torch.cuda.current_device())  # slabs match by index
        self.slabs = slabs
        self.copy_stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        self.mix_stream = side_stream(self.device)

    def alloc(self, nbytes: int) -> torch.Tensor:
        return self.slabs.take_at_least(nbytes, self.device)

    def give(self, slab: torch.Tensor) -> None:
        self.slabs.give(slab)

    def scratch(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def stage(self, src: torch.Tensor, dst: torch.Tensor) -> Any:
        """Queue the copy of `src` (registered host memory) into `dst` and the mix64 of `dst`; a handle for `digest`."""
        with torch.cuda.stream(self.copy_stream):
            dst.copy_(src, non_blocking=True)
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copied.record(self.copy_stream)
        with torch.cuda.stream(self.mix_stream):
            self.mix_stream.wait_event(copied)
            return mix64_partial(dst, 0)

    def digest(self, handle: Any) -> str:
        with torch.cuda.stream(self.mix_stream):
            return mix64_format(int(handle.item()))


def _stage_queue(ops: Any, readers: list[ShmReader], version: int, which: list[int],
                 buffers: list[torch.Tensor]) -> list[tuple[int, tuple[int, int] | None, Any]]:
    """Worker thread: queue the copies and checksums of buckets `which` (nothing waited on): per bucket its segment's
    state before the copy and the handle of its digest (state None: the segment does not hold `version`)."""
    out: list[tuple[int, tuple[int, int] | None, Any]] = []
    for i in which:
        state = readers[i].state()
        out.append((i, None, None) if state[0] != version else (i, state, ops.stage(readers[i].host_tensor(), buffers[i])))
    return out


def _stage_outcome(ops: Any, reader: ShmReader, state: tuple[int, int] | None, handle: Any, expected: str) -> str:
    """Verifying thread: wait for a queued bucket's digest: ``"ok"``, ``"bad"`` (the device copy's mix64 differs) or
    ``"torn"`` (the segment did not hold the version, or was rewritten while it was copied)."""
    if state is None:
        return "torn"
    digest = ops.digest(handle)  # waits for the bucket's copy and checksum
    if reader.state() != state:
        return "torn"
    return "ok" if digest == expected else "bad"


_SHM_PIECE_BYTES = 4 * 1024 * 1024


def _copy_verified(reader: ShmReader, version: int, expected: str, dst: torch.Tensor) -> str:
    """Worker thread: copy a bucket out of shared memory, checksumming the copy piece by piece while it is in cache.

    ``"ok"``, ``"bad"`` (checksum) or ``"torn"`` (the segment does not hold `version`, or was rewritten meanwhile).
    """
    v0, g0 = reader.state()
    if v0 != version:
        return "torn"
    n = int(dst.numel())
    out = dst.numpy()
    summer = Checksummer.for_digest(expected)
    for off in range(0, n, _SHM_PIECE_BYTES):
        end = min(n, off + _SHM_PIECE_BYTES)
        out[off:end] = np.frombuffer(reader.bytes(off, end - off), dtype=np.uint8)
        summer.update(out[off:end])
    v1, g1 = reader.state()
    if (v1, g1) != (v0, g0):
        return "torn"
    return "ok" if verify_checksum(expected, running=summer) else "bad"


