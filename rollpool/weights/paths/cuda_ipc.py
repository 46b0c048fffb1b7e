"""The same-GPU path (CUDA IPC): an engine on the trainer's GPU copies each bucket device-to-device out of the
publisher's exported device buffer (the arena), then verifies the GPU checksum (mix64) of its own copy.

Both ends live here:
    - `CudaIpcPath`, the subscriber's: the arenas opened once and kept (the publisher reuses K of them), the copy on a
      side stream of a worker thread, a bad bucket copied again after asking for the manifest again (a version
      evicted meanwhile answers ``gone``), at most `max_refetch` times; never a version in part. An arena that
      cannot be opened, or a withdrawn one, is a `PathFallbackError` (shared memory or the network serve it).
    - `IpcArenas`, the publisher's: one arena per version (allocated once and reused, exported once), the trainer's
      CUDA tensors snapshotted into it on a side stream that waits for the trainer's stream, each bucket's mix64
      published as soon as it is summed (`WeightServer.complete_ipc`). Offered on ``cuda_ipc``, and on ``auto``
      once a subscriber on this host said it sees the GPU (its hello); an arena that cannot be made or exported
      turns the path off for good (logged), the host buckets serve alike.

The device helpers (mix64, arena offsets, export and open) are in `rollpool.weights.gpu`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from rollpool.protocol.logs import RateLimitedLog
from rollpool.protocol.messages import BucketInfo, CudaIpcBuffer, Manifest, ManifestRequest
from rollpool.weights.bucketing import dtype_from_name, dtype_name, flat_bytes, unpack_bucket
from rollpool.weights.gpu import (
    ARENA_ALIGN,
    DeviceSlabs,
    arena_offsets,
    device_uuids,
    export_buffer,
    mix64_checksum,
    open_buffer,
    side_stream,
    warm_up_in_background,
)
from rollpool.weights.manifest import CUDA_IPC, GpuBudget, check_manifest
from rollpool.weights.paths.base import BucketCallback, FetchContext, Fetched, FetchJob, PathFallbackError
from rollpool.weights.paths.ipc_ring import IpcRing, RingReader
from rollpool.weights.serving import ServedVersion, WeightServer
from rollpool.weights.snapshot import Place, SnapshotKnobs, plan_version, referenced_version

__all__ = ["CudaIpcPath", "IpcArenas", "warm_in_background"]

log = logging.getLogger(__name__)
_errlog = RateLimitedLog(log)

Places = list[Place]
"""Where each tensor of a version goes, in order."""


def warm_in_background() -> None:
    """The same-GPU path may be used soon: its checksum kernels warmed on this process's GPU, in a thread."""
    if torch.cuda.is_available():
        warm_up_in_background(torch.device("cuda", torch.cuda.current_device()))


class CudaIpcPath:
    """The subscriber's end of the same-GPU path (see the module docstring)."""

    name = CUDA_IPC
    host_buffers = False

    def __init__(self, ctx: FetchContext, slabs: DeviceSlabs, path: str) -> None:
        self.ctx = ctx
        self.slabs = slabs
        self.path = path
        self.gpus: dict[str, int] | None = None
        """The GPUs this process sees by UUID (None: not asked yet; tests put a fake device list here, named so)."""
        self._opened: dict[tuple[bytes, int], torch.Tensor] = {}
        """The publisher's arenas opened here (kept across versions: the publisher reuses them)."""
        self.ring = RingReader(ctx, slabs)
        """The same-GPU ring's reader (`rollpool.weights.paths.ipc_ring`), for a version that streams through one."""

    def close(self) -> None:
        self._opened = {}  # the publisher's arenas unmapped (torch closes a handle with its last tensor)
        self.ring.close()

    def gpu_uuids(self) -> dict[str, int]:
        """The GPUs this process sees by UUID (the same-GPU path's hello); empty on ``network``/``shm`` or without CUDA. The
        first call warms the checksum kernels up in a thread."""
        if self.gpus is None:
            self.gpus = device_uuids() if self.path in ("auto", "cuda_ipc") else {}
            if self.gpus:
                # the first same-GPU version should not pay the checksum kernels' first load: warmed in a thread now
                warm_in_background()
        return self.gpus

    async def fetch(self, job: FetchJob) -> Fetched:
        ipc = job.manifest.cuda_ipc
        if ipc is not None and ipc.ring_slots:
            return await self.ring.fetch(job.manifest, self.gpu_uuids()[ipc.device_uuid], job.on_bucket)
        return await self._fetch_ipc(job.manifest, job.on_bucket)

    def _open(self, info: CudaIpcBuffer, device_index: int) -> torch.Tensor:
        key = (info.handle, info.storage_offset)
        t = self._opened.get(key)
        if t is None:
            try:
                t = open_buffer(info, device_index)
            except Exception as exc:
                raise PathFallbackError(f"cannot open the publisher's GPU buffer ({type(exc).__name__}: {exc})") from exc
            self._opened[key] = t
            while len(self._opened) > 4:  # the publisher keeps K arenas; older ones were freed
                self._opened.pop(next(iter(self._opened)))
        return t

    async def _fetch_ipc(self, manifest: Manifest, on_bucket: BucketCallback | None) -> Fetched:
        """Copy each bucket device-to-device out of the publisher's buffer into our own, and verify the GPU checksum
        of our copy (the bytes the engine loads). A bad bucket is copied again after the manifest is asked for again
        (a version evicted meanwhile answers ``gone``), at most `max_refetch` times; the version is never returned in part."""
        if not all(b.ipc_checksum for b in manifest.buckets):
            manifest = check_manifest(await self.ctx.manifests.fetch_manifest(manifest.version, wait_ipc=True))
        ipc = manifest.cuda_ipc
        if ipc is None:
            raise PathFallbackError("the publisher withdrew the device buffer")
        index = self.gpu_uuids()[ipc.device_uuid]
        src = self._open(ipc, index)
        sizes = [b.nbytes for b in manifest.buckets]
        offsets, total = arena_offsets(sizes)
        slab = self.slabs.take_at_least(total, f"cuda:{index}")
        buffers = [slab[o : o + n] for o, n in zip(offsets, sizes, strict=True)]
        failures = [0] * len(sizes)
        todo = list(range(len(sizes)))
        try:
            while todo:
                bad = await asyncio.to_thread(_copy_ipc, src, manifest, buffers, todo)
                for i in todo:
                    if i not in bad:
                        self.ctx.counters.ipc_bytes += sizes[i]
                        if on_bucket is not None:
                            on_bucket(i, unpack_bucket(manifest.buckets[i], buffers[i]))
                for i in bad:
                    self.ctx.bucket_failed(manifest.version, i, failures, "cuda_ipc", "from the GPU buffer", "CUDA IPC")
                if bad:
                    await self.ctx.manifests.fetch_manifest(manifest.version, wait_ipc=True)  # still served? (gone: the caller moves on)
                todo = bad
        except BaseException:
            self.slabs.give(slab)
            raise
        return Fetched(manifest, buffers, slab, CUDA_IPC, on_device=True)


class _NotYet:
    """A ring-only version's bucket on the host: not there (fetches wait) until an abandoned ring makes the host copy."""

    def read(self, offset: int, nbytes: int) -> Any:
        return None


def _copy_ipc(src: torch.Tensor, manifest: Manifest, buffers: list[torch.Tensor], which: list[int]) -> list[int]:
    """Worker thread: copy buckets `which` device-to-device from the publisher's buffer and checksum each copy on the
    GPU (on a side stream of this thread); the buckets whose checksum differs."""
    from rollpool.weights.gpu import side_stream

    stream = side_stream(src.device)
    bad = []
    with torch.cuda.stream(stream):
        for i in which:
            b = manifest.buckets[i]
            if b.ipc_offset + b.nbytes > int(src.numel()):
                raise PathFallbackError(f"bucket {i} lies beyond the publisher's GPU buffer")
            buffers[i].copy_(src[b.ipc_offset : b.ipc_offset + b.nbytes], non_blocking=True)
        for i in which:
            if mix64_checksum(buffers[i]) != manifest.buckets[i].ipc_checksum:
                bad.append(i)
    stream.synchronize()
    return bad




class IpcArenas:
    """The publisher's end of the same-GPU path (see the module docstring)."""

    def __init__(self, publisher_id: str, host_key: str, path: str, budget: GpuBudget | None = None) -> None:
        self.publisher_id = publisher_id
        self.budget = budget if budget is not None else GpuBudget(1 << 62)
        """The publisher's GPU budget: an arena that would pass it is not made (the version goes over the host paths)."""
        self.allocated = 0
        """Bytes of arenas allocated against the budget (held or free for reuse)."""
        self.why_not = ""
        """Why the last version was not offered on the same-GPU path ("" when it was), for the log and `path_note`."""
        self.host_key = host_key
        self.path = path
        """The publisher's weight path (`WeightPublisher.set_path` changes it)."""
        self.slabs = DeviceSlabs()
        """Device arenas (one per version, reused; allocated only once this path is used)."""
        self.exports: list[tuple[torch.Tensor, CudaIpcBuffer]] = []
        """Each arena with its export (`_share_cuda_` once per arena)."""
        self.of_version: dict[int, torch.Tensor] = {}
        self.peers: set[str] = set()
        """GPU UUIDs that subscribers on this host said they see (their hello): on ``auto`` CUDA tensors are exported."""
        self.versions = 0
        """Versions offered on the same-GPU path."""
        self.broken = ""
        """Why the same-GPU path failed here (then it is never offered again), or ""."""
        self.ring = IpcRing(publisher_id, self.budget)
        """The bucket-by-bucket ring (`rollpool.weights.paths.ipc_ring`), offered when a whole-version arena would pass
        the budget; its `device` is the device edge `device_for` asks too (the CPU tests fake it, named so)."""
        self.note: dict[str, Any] = {}
        """The last planned version's offer (`note_offer`; the publisher's `path_note`)."""
        if path == CUDA_IPC:
            warm_in_background()

    def close(self) -> None:
        self.exports = []
        self.of_version = {}
        self.slabs.trim(0)
        self.budget.give(self.allocated)
        self.allocated = 0
        self.ring.close()

    def note_offer(self, version: int, offered: str, why_not_ring: str = "") -> None:
        """Which path the publisher offers from `version` (``cuda_ipc`` arena, ``cuda_ipc_ring``, ``host``), and why the
        faster ones are not: logged when it changes."""
        note = {"version": version, "offered": offered, "why_not_cuda_ipc": self.why_not, "why_not_ring": why_not_ring}
        if (offered, note["why_not_cuda_ipc"], why_not_ring) != (self.note.get("offered"), self.note.get("why_not_cuda_ipc"),
                                                                 self.note.get("why_not_ring")):
            said = {"cuda_ipc": "a same-GPU device arena besides the host buckets",
                    "cuda_ipc_ring": f"the same-GPU ring besides the host buckets (no whole-version arena: {self.why_not})"}
            log.info("weight publisher %s: from version %d, %s", self.publisher_id, version,
                     said.get(offered) or f"host buckets only (no same-GPU buffer: {self.why_not or 'not asked for'}"
                     + (f"; no ring: {why_not_ring}" if why_not_ring else "") + ")")
        self.note = note

    def hello(self, req: ManifestRequest) -> None:
        """A subscriber's hello: on this host, the GPUs it sees (so ``auto`` knows a same-GPU peer exists)."""
        if req.gpu_uuids and req.host_key and req.host_key == self.host_key:
            new = set(req.gpu_uuids) - self.peers
            if new:
                self.peers |= new
                log.info("weight publisher %s: a subscriber on this host sees GPU(s) %s", self.publisher_id, sorted(new))
                warm_in_background()

    def device_for(self, items: Any) -> torch.device | None:
        """The device to export this version from: CUDA tensors, all on one device, on ``cuda_ipc``, or on ``auto``
        when a subscriber on this host said it sees that GPU; else None (host buckets only)."""
        self.why_not = ""
        if self.path not in (CUDA_IPC, "auto"):
            self.why_not = f"the publisher's path is {self.path!r}"
            return None
        if not isinstance(items, list) or not items:
            self.why_not = "an iterator or an empty version is not exported"
            return None
        if self.broken:
            self.why_not = f"the same-GPU path failed here before ({self.broken})"
            return None
        devices: set[torch.device] = {t.device for _n, t in items}
        if len(devices) != 1:
            self.why_not = "the tensors are on several devices"
            return None
        device: torch.device = next(iter(devices))
        if not self.ring.device.accepts(device):
            self.why_not = "the tensors are on the CPU"
            if self.path == CUDA_IPC:
                _errlog.warning("ipc-cpu", "weight publisher %s: path 'cuda_ipc' with CPU tensors: no device buffer "
                                "offered (subscribers take shared memory or the network)", self.publisher_id)
            return None
        if self.path == "auto":
            mine = self.ring.device.uuids(device)
            if not mine & self.peers:
                self.why_not = "no subscriber on this host said it sees this GPU"
                return None
        return device

    def begin(self, served: ServedVersion, places: Places,
              device: torch.device) -> tuple[torch.Tensor, list[int], list[tuple[str, torch.Tensor]]] | None:
        """An arena for the version (reused), named with its bucket offsets on `served`'s manifest; (the arena, the
        buckets' offsets in it, its views in the layout's order). None when a new arena would pass the GPU budget (the
        reason in `why_not`, logged once a minute; the host paths serve the version). An arena that cannot be made or
        exported turns this path off for good (logged) and raises."""
        self.why_not = ""
        _offsets, total = arena_offsets([b.nbytes for b in served.buckets])
        fresh = max(total, ARENA_ALIGN)
        if not self.slabs.fits(total, device):
            self.why_not = self.budget.why_not(fresh, "a whole-version same-GPU arena")
            if self.why_not:
                _errlog.warning("ipc-budget", "weight publisher %s: version %d not offered on the same-GPU path: %s; same-host "
                                "peers take shared memory (staged to their GPU where they can)", self.publisher_id, served.version,
                                self.why_not)
                return None
        else:
            fresh = 0
        try:
            got = self._begin(served, places, device)
            if fresh:
                self.budget.take(fresh, "a whole-version same-GPU arena")
                self.allocated += fresh
            return got
        except Exception as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            log.error("weight publisher %s: the same-GPU path failed (%s); no device buffer is offered from now on",
                      self.publisher_id, self.broken)
            raise

    def _begin(self, served: ServedVersion, places: Places, device: torch.device) -> tuple[torch.Tensor, list[int], list[tuple[str, torch.Tensor]]]:
        sizes = [b.nbytes for b in served.buckets]
        offsets, total = arena_offsets(sizes)
        arena = self.slabs.take_at_least(total, device)
        info = next((i for a, i in self.exports if a is arena), None)
        if info is None:
            try:
                info = export_buffer(arena)
            except BaseException:
                self.slabs.give(arena)
                raise
            self.exports.append((arena, info))
        self.of_version[served.version] = arena
        served.cuda_ipc = info
        served.buckets = tuple(replace(b, ipc_offset=offsets[b.index]) for b in served.buckets)
        views = []
        for idx, offset, name, shape, dtype, nbytes in places:
            start = offsets[idx] + offset
            views.append((name, arena[start : start + nbytes].view(dtype_from_name(dtype)).view(shape)))
        self.versions += 1
        return arena, offsets, views

    async def ring_only(self, named_tensors: Any, version: int, bucket_bytes: int, knobs: SnapshotKnobs,
                        server: WeightServer) -> tuple[ServedVersion | None, str]:
        """``keep_versions=0`` on the same GPU: the caller's CUDA tensors go through the ring alone, no host copy. Returns
        (the served version, "") once the ring ended: ``released`` when its taker copied every bucket out (the version's
        bytes are gone from here, as after any keep_versions=0 release); else abandoned, and the host copy of the
        still unchanged tensors now serves it (`referenced_version`, held as keep_versions=0 holds). (None, why not)
        when no ring can carry it (the caller serves its tensors as before)."""
        items, places, planner = plan_version(named_tensors, bucket_bytes, None)
        device = self.device_for(items) if places is not None else None
        if device is None or places is None:
            return None, ""
        buckets = tuple(BucketInfo(index=b.index, dtype=b.dtype, nbytes=b.nbytes, checksum="", tensors=tuple(b.tensors))
                        for b in planner.buckets)
        served = ServedVersion(version=version, publisher_id=knobs.publisher_id, buckets=buckets, sources=[_NotYet()] * len(buckets),
                               chunk_bytes=knobs.chunk_bytes, host_key=knobs.host_key, pool=knobs.pool)
        self.why_not = "keep_versions=0: the caller's tensors go through the ring, no arena"
        why = self.broken or self.ring.offer(served, device)
        if why:
            return None, why
        server.add_version(served)  # announced: the same-GPU subscriber claims the ring
        await self.ring.stream(version, places, items, server.complete_ipc)
        if await self.ring.until_ended(version):
            served.released, served.sources = True, []
            return served, ""
        ref = await referenced_version(named_tensors, version, bucket_bytes, knobs)  # the tensors have not changed yet
        served.sources = ref.sources
        for b in ref.buckets:
            server.complete_bucket(version, b.index, b.checksum)
        return served, ""

    def offer_ring(self, served: ServedVersion, device: torch.device) -> tuple[str, str]:
        """No arena for `served`: (``cuda_ipc_ring``, "") when it streams through the ring, else (``host``, why not)."""
        why = self.broken or self.ring.offer(served, device)
        return ("host", why) if why else ("cuda_ipc_ring", "")

    def release(self, version: int) -> None:
        arena = self.of_version.pop(version, None)
        if arena is not None:
            self.slabs.give(arena)

    @staticmethod
    async def copy(arena: torch.Tensor, offsets: list[int], places: Places, items: list[tuple[str, torch.Tensor]]) -> Any:
        """Device-to-device snapshot into the arena on a side stream that first waits for the trainer's stream;
        returns (the stream) once it landed (then the trainer may change its tensors)."""
        device = arena.device
        stream = side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for (idx, offset, name, shape, dtype, nbytes), (got, tensor) in zip(places, items, strict=True):
                if got != name or tuple(int(x) for x in tensor.shape) != shape or dtype_name(tensor.dtype) != dtype:
                    raise ValueError(f"got {got!r} {tuple(tensor.shape)} {tensor.dtype}, the layout has {name!r} {shape} {dtype}")
                if nbytes:
                    start = offsets[idx] + offset
                    arena[start : start + nbytes].copy_(flat_bytes(tensor), non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(stream)
        await asyncio.to_thread(done.synchronize)
        return stream

    @staticmethod
    async def checksums(arena: torch.Tensor, offsets: list[int], served: ServedVersion, stream: Any,
                        complete: Callable[[int, int, str], None]) -> None:
        """Each bucket's GPU checksum of the arena, in a thread, told to `complete(version, bucket, digest)` on the loop as
        soon as it is known (then the same-GPU peers may read that bucket)."""
        loop = asyncio.get_running_loop()

        def sums() -> None:
            for b in served.buckets:
                off = offsets[b.index]
                digest = mix64_checksum(arena[off : off + b.nbytes], stream=stream)
                loop.call_soon_threadsafe(complete, served.version, b.index, digest)

        await asyncio.to_thread(sums)
