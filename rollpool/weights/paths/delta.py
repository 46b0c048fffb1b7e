"""Delta versions (protocol minor 18): a version carried as its changed bytes against a base the subscriber holds.

Both ends: the server end is `rollpool.weights.serving.WeightServer.make_delta` (a version's delta against the one
before it, computed from the host copies, answered to a manifest request that names the base it holds); this file
holds the subscriber's end, `DeltaPath`: the base it holds and the rebuild of a version from it.

What it promises
    - The base is the newest version fetched, when it was fetched whole into host buffers (`hold`); it is held until
      the next version is verified, so its buffer goes back to the subscriber's buffers then, not when its caller
      recycles it (`holds` tells the caller so). A version that lands on a device (the same GPU, shared memory staged
      to a GPU) leaves no base: the host copy of the version before it is stale (servers offer a delta against the
      version just before only), so no request names it and its buffer goes back.
    - A delta's encoded buckets are read where `rollpool.weights.manifest.delta_plan` says: copied out of the
      publisher's shared-memory segment on this host (`Manifest.delta_shm`, minor 26: each copy verified against its
      checksum, the segment's header unchanged after the copies), else over the bulk lane (minor 26) or the ROUTER
      (`NetworkPath`, each payload verified against its own checksum); each rebuilt bucket is verified against the
      checksum of the resulting bytes, so a rebuilt version is bit-identical to the full one or refused.
    - Anything that keeps the version from being rebuilt (no base, another publisher's base, buckets that do not line
      up, a corrupt delta) raises `WeightSyncError` or `rollpool.weights.delta.DeltaError`, and the caller fetches
      the full version instead (counted). A bucket is handed to ``on_bucket`` only once its resulting bytes verified
      (bit-identical to the publisher's), as the network path hands its own; the version is whole only when `fetch`
      returns, and a fallback hands every bucket again.
    - The rebuild writes a buffer of its own (taken from the subscriber's buffers), never the base's: the base is the
      version the engine serves, kept for a re-apply on a restarted engine until the next one is applied, so it stays
      intact whatever the delta holds. When that buffer still holds the version before the base (recycled by its
      caller, nothing written to it since) and the base came as a delta against it, the version is rebuilt there in
      place (the delta before and this one applied, no copy of the base); else the base is copied into it. A buffer a
      failed rebuild wrote goes back to the buffers only once no rebuild thread writes into it any more.
    - On the engine's GPU (`device`, a `rollpool.weights.delta_gpu.DeviceHeld`, when the worker's engine stages to
      CUDA and `weight_delta_on_device` is on): every whole-model version fetched into host buffers is staged into
      buffers kept on that GPU as each bucket verifies (`DeviceStaging`), and the engine is handed those; a delta
      against the version held there, whose manifest carries the mix64 of every bucket's resulting bytes, is rebuilt
      there in place and verified there (`_fetch_on_device`). In place, so the held version is gone from the first
      write: a failure drops it and the full version is fetched (staged afresh); a version whose tensors view it says
      so (`WeightVersion.intact`). The host copy of an older version is never named as the base once the GPU holds a
      newer one (`base_version`), and a delta the GPU cannot take is rebuilt on the host as above (the GPU's copy let
      go) or fetched whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch

from rollpool.protocol.errors import WeightSyncError
from rollpool.protocol.messages import BucketInfo, Manifest
from rollpool.weights.bucketing import Checksummer, checksum_supported, unpack_bucket, verify_checksum
from rollpool.weights.delta import (
    ENCODED_FRACTION_GUESS,
    UNCHANGED,
    WHOLE,
    DeltaError,
    in_place_pays,
    itemsize_of,
    patch_bucket,
    payload_offsets,
    rebuild_bucket,
    same_layout,
)
from rollpool.weights.delta_gpu import DeviceHeld, result_checks
from rollpool.weights.delta_gpu import rebuild_bucket as rebuild_on_device
from rollpool.weights.gpu import DeviceSlabs, side_stream
from rollpool.weights.manifest import BULK, NETWORK, SHM, Plan, check_manifest
from rollpool.weights.memory import ShmUnavailableError, VersionBuffers
from rollpool.weights.paths.base import BucketCallback, Fetched, FetchJob, PathFallbackError, WeightVersion
from rollpool.weights.paths.bulk import BulkPath
from rollpool.weights.paths.network import NetworkPath
from rollpool.weights.paths.shm import ShmSegments

__all__ = ["DeltaPath", "DeviceStaging"]

log = logging.getLogger("rollpool.weights.subscriber")


class DeltaPath:
    """The subscriber's end of delta versions (see the module docstring)."""

    def __init__(self, network: NetworkPath, buffers: VersionBuffers, *, enabled: bool, threads: int,
                 segments: ShmSegments | None = None, bulk: BulkPath | None = None, plan: Callable[[Manifest], Plan] | None = None) -> None:
        self.network = network
        self.bulk = bulk
        """The bulk lane (None: the encoded bytes come over the ROUTER only)."""
        self.buffers = buffers
        self.segments = segments
        """The publisher's shared-memory segments mapped here (None: the encoded bytes come over the network only)."""
        self.plan = plan
        """Where a delta's encoded bytes are read (`rollpool.weights.manifest.delta_plan` with this subscriber's facts;
        None: the network)."""
        self.enabled = enabled
        """`WeightPathConfig.weight_delta`: off, no base is held (and none asked for)."""
        self.threads = threads
        self.base: WeightVersion | None = None
        """The newest version fetched into host buffers: the base a delta version is rebuilt from."""
        self._base_recycled = False
        self.versions = 0
        """Versions rebuilt from a delta."""
        self.fallbacks = 0
        """Delta versions that could not be rebuilt (no base, a corrupt or evicted delta): fetched full instead."""
        self._pool: ThreadPoolExecutor | None = None
        self.in_place = True
        """Rebuild in place where it is safe (`_chain_for`); off: always copy the base (a benchmark's comparison)."""
        self.in_place_versions = 0
        """Versions rebuilt in place, in the buffer that held the version two before (no copy of the base)."""
        self._content: dict[int, tuple[weakref.ref[torch.Tensor], str, int]] = {}
        """Host buffers (by identity, held weakly: one the pool frees is gone from here) that hold a whole verified
        version nothing has written since: its publisher and number. A buffer is dropped from here as soon as a fetch
        takes it to write into."""
        self._last: tuple[Manifest, list[torch.Tensor | None]] | None = None
        """The newest version's delta when it came as one (its manifest and encoded bytes, owned here): applied again,
        with the next one, to the buffer that holds the version before it."""
        self._made: tuple[Manifest, list[torch.Tensor | None]] | None = None
        """The delta just rebuilt, until `hold` makes it `_last`."""
        self.device: DeviceHeld | None = None
        """The version held on the engine's GPU (`WeightPathConfig.weight_delta_on_device`; the subscriber sets it):
        a delta against it is rebuilt there, in place (`_fetch_on_device`). None: deltas are rebuilt on the host."""
        self.device_versions = 0
        """Versions rebuilt on the engine's GPU."""
        self.why_not_device = ""
        """Why the last delta version was not rebuilt on the GPU ("" when it was, or none came)."""
        self._device_pool: ThreadPoolExecutor | None = None
        self._scratch: torch.Tensor | None = None
        """The page-locked buffer a delta's encoded bytes land in before they are copied to the GPU (reused)."""
        self._scratch_ahead: Future[torch.Tensor] | None = None
        """That buffer being made ahead (`_make_scratch_ahead`)."""

    def base_version(self) -> int:
        """The version a manifest request names as its base (-1: none held): the newest of the one on the engine's GPU
        and the one in host buffers."""
        host = self.base.version if self.base is not None else -1
        held = self.device
        return max(host, held.version) if held is not None else host

    def verifies_on_device(self, base: int) -> bool:
        """Whether a delta against `base` is rebuilt on the engine's GPU and verified there by the mix64 of its resulting
        bytes (the GPU holds `base`): the manifest request then says so (`ManifestRequest.device_verify`), and may be
        answered before the publisher checksummed the version's host copy (minor 28)."""
        held = self.device
        return held is not None and base >= 0 and held.version == base and held.slab is not None

    def hold(self, wv: WeightVersion, *, on_device: bool = False) -> WeightVersion:
        """A version just fetched: in host buffers, it becomes the base of the next delta; on a device (`on_device`),
        no base is held after it. The previous base's buffer goes back to the buffers if its caller already recycled it
        (else when it does)."""
        if not self.enabled:
            return wv
        host = wv.slab is not None and not on_device and not wv.slab.is_cuda
        made, self._made = self._made, None
        self._last = made if made is not None and host and made[0].version == wv.version else None
        if host and wv.slab is not None:
            self._content[id(wv.slab)] = (weakref.ref(wv.slab), wv.manifest.publisher_id, wv.version)
        old, recycled = self.base, self._base_recycled
        self.base, self._base_recycled = (wv if host else None), False
        if old is not None and recycled and old.slab is not None:
            self.buffers.give(old.slab)
        return wv

    def holds(self, old: WeightVersion) -> bool:
        """`old` is being recycled: True (and noted) when it is still the base, whose buffer goes back later."""
        if self.base is not None and old.slab is not None and old.slab is self.base.slab:
            self._base_recycled = True
            return True
        return False

    def forget(self, slab: torch.Tensor | None) -> None:
        """`slab` was taken to be written: what it held is no longer known."""
        if slab is not None:
            self._content.pop(id(slab), None)

    def _chain_for(self, manifest: Manifest, slab: torch.Tensor) -> list[torch.Tensor | None] | None:
        """When `slab` (free, so nothing reads it) still holds the version before the base, whole and verified, and the
        base came as a delta against it from the same publisher: that delta's encoded bytes per bucket, so this version
        is rebuilt in place (both deltas applied to it, no copy of the base). None: copy the base."""
        held = self._content.pop(id(slab), None)
        last = self._last
        if not self.in_place or held is None or held[0]() is not slab or last is None:
            return None
        prev, payloads = last
        _ref, publisher, version = held
        if (publisher != manifest.publisher_id or prev.publisher_id != publisher or version != manifest.delta_base - 1
                or prev.version != manifest.delta_base or prev.delta_base != version or len(prev.buckets) != len(manifest.buckets)):
            return None
        encodings = [b.encoding for b in prev.buckets]
        return [p if e != WHOLE else None for p, e in zip(payloads, encodings, strict=True)]

    def close(self) -> None:
        self.base = None
        self._content.clear()
        self._last = self._made = None
        if self.device is not None:
            self.device.drop()
        self._scratch = self._scratch_ahead = None
        for pool in (self._pool, self._device_pool):
            if pool is not None:
                pool.shutdown(wait=False)
        self._pool = self._device_pool = None

    def device_why_not(self, manifest: Manifest) -> str:
        """"" when `manifest` (a delta) is rebuilt on the engine's GPU: the base is the version held there, the buckets
        line up and each carries the mix64 of its resulting bytes; else why not (then the host rebuilds it, or the
        version is fetched whole)."""
        held = self.device
        if held is None:
            return "deltas are rebuilt on the host (no engine GPU holds the base)"
        if not held.holds(manifest.publisher_id, manifest.delta_base):
            return f"the engine's GPU holds version {held.version}, not the base {manifest.delta_base}"
        if not held.lines_up(manifest.buckets):
            return "the base's buckets on the engine's GPU do not line up with the delta's"
        if manifest.adapter is not None:
            return "an adapter version"
        return result_checks(manifest.buckets)

    def release_device(self, slabs: DeviceSlabs | None) -> None:
        """The version on the engine's GPU is let go: a device path fetches the next one into a slab of its own, so its
        buffers go to `slabs` for that path to reuse (one version on the GPU at a time); None: freed (to the process's
        CUDA caching allocator, where the engine's own staging finds them)."""
        held = self.device
        if held is not None and held.slab is not None:
            slab = held.drop()
            if slabs is not None and slab is not None:
                slabs.give(slab)

    def staging(self, manifest: Manifest, slabs: DeviceSlabs) -> DeviceStaging | None:
        """The staging of a whole-model version fetched into host buffers onto the engine's GPU (into the buffers the
        version before it held there, in place), or None when no GPU holds versions here."""
        if self.device is None or manifest.adapter is not None or not manifest.buckets:
            return None
        return DeviceStaging(self.device, manifest, slabs, on_held=self._make_scratch_ahead)

    async def fetch(self, manifest: Manifest, on_bucket: BucketCallback | None) -> Fetched:
        """Rebuild `manifest`'s version from the base held here and the encoded buckets (fetched over the network
        path), each bucket verified against the checksum of its resulting bytes; raises `WeightSyncError` or
        `DeltaError` (the caller then fetches the full version).

        Each bucket is rebuilt as soon as its encoded bytes verified (an unchanged one at once), in `threads` threads,
        while the others arrive, and handed to `on_bucket` once its resulting bytes verified (as the network path hands
        its buckets: the version is whole only when this returns). The phases' seconds go into the ``weights fetched``
        line: ``fetch_s`` (the encoded bytes), ``rebuild_s`` and ``verify_s`` (decode and checksum, summed over the
        buckets: the checksum is taken in the same pass), ``rebuild_after_fetch_s`` (the last encoded bytes to the last
        bucket verified: what the rebuild adds after the fetch) and ``delta_total_s``."""
        why_not_device = self.device_why_not(manifest)
        if not why_not_device:
            self.why_not_device = ""
            return await self._fetch_on_device(manifest, on_bucket)
        self.why_not_device = why_not_device if self.device is not None else ""
        pending = [b.index for b in manifest.buckets if not b.checksum]
        if pending:  # an early delta (minor 28): its proof is the GPU's mix64 alone, which cannot be taken here
            raise WeightSyncError(f"the delta's checksums of {len(pending)} resulting buckets are still pending (served early, to be verified "
                                  f"on the engine's GPU) and it cannot be rebuilt there: {why_not_device}")
        got = await self._fetch_on_host(manifest, on_bucket, why_not_device)
        # rebuilt on the host (the delta could not be on the GPU): the engine stages it itself, so the GPU's copy of an
        # older version is let go (its memory reused by that staging; the next whole version is held there again)
        self.release_device(None)
        return got

    async def _fetch_on_host(self, manifest: Manifest, on_bucket: BucketCallback | None, why_not_device: str) -> Fetched:
        """`fetch` from the base held in host buffers (`why_not_device`: why not on the engine's GPU)."""
        t0 = time.perf_counter()
        base = self.base
        if base is None or base.version != manifest.delta_base:
            held = "none" if base is None else str(base.version)
            on_gpu = f"; not on the engine's GPU: {why_not_device}" if self.device is not None else ""
            raise WeightSyncError(f"the base is not held here (holding {held}){on_gpu}")
        if base.manifest.publisher_id != manifest.publisher_id:
            raise WeightSyncError(f"the base came from publisher {base.manifest.publisher_id!r}, the delta from {manifest.publisher_id!r}")
        if not same_layout(manifest.buckets, base.manifest.buckets) or len(base.buffers) != len(manifest.buckets):
            raise WeightSyncError("the base's buckets do not line up with the delta's")
        steps = self.plan(manifest) if self.plan is not None else None
        if steps is not None and steps.refusal:
            raise WeightSyncError(steps.refusal)
        via = SHM if steps is not None and SHM in steps.to_try else NETWORK
        await self.buffers.reserved()
        slab, buffers = self.buffers.take([b.nbytes for b in manifest.buckets], manifest.version)
        chain = self._chain_for(manifest, slab)
        prev = self._last[0] if chain is not None and self._last is not None else None
        loop = asyncio.get_running_loop()
        pool = self._threads()
        work: dict[int, Future[tuple[bool, float, float]]] = {}
        done: asyncio.Queue[int] = asyncio.Queue()
        patched: set[int] = set()
        """Buckets rebuilt in place (the others: a copy of the base's, then this delta)."""

        def start(i: int, payload: torch.Tensor | None) -> None:
            if i in work:
                return
            b = manifest.buckets[i]
            if chain is not None and prev is not None and b.encoding != WHOLE and in_place_pays(prev.buckets[i]):
                patched.add(i)
                work[i] = f = pool.submit(_patch_one, b, (prev.buckets[i].encoding, chain[i]), (b.encoding, payload), buffers[i])
            else:
                work[i] = f = pool.submit(_rebuild_one, b, payload, base.buffers[i], buffers[i])
            f.add_done_callback(lambda _f: _call_soon(loop, done.put_nowait, i))

        try:
            for b in manifest.buckets:
                if b.encoding == UNCHANGED:
                    start(b.index, None)  # no bytes to wait for
            if via == SHM:
                payloads = await self.read_payloads(manifest, on_payload=start)
            else:
                payloads, _carried = await self.fetch_payloads(manifest, on_payload=start)
            fetched = time.perf_counter()
            for i, p in enumerate(payloads):
                start(i, p)
            rebuild_s, verify_s = await self._collect(manifest, work, done, buffers, on_bucket)
        except BaseException:
            self._give_when_done(slab, list(work.values()))  # (a rebuild still writing keeps its buffer until it ends)
            raise
        now = time.perf_counter()
        self.versions += 1
        self.in_place_versions += bool(patched)
        self._made = (manifest, payloads)
        return Fetched(manifest, buffers, slab, via, {"delta_base": manifest.delta_base, "delta_bytes": sum(b.delta_nbytes for b in manifest.buckets),
                                                      "delta_rebuilt_on": "host", "why_not_delta_on_device": why_not_device,
                                                      "in_place": bool(patched), "in_place_buckets": len(patched),
                                                      "fetch_s": round(fetched - t0, 4), "rebuild_s": round(rebuild_s, 4),
                                                      "verify_s": round(verify_s, 4), "rebuild_after_fetch_s": round(now - fetched, 4),
                                                      "delta_total_s": round(now - t0, 4)})

    async def _collect(self, manifest: Manifest, work: dict[int, Future[tuple[bool, float, float]]], done: asyncio.Queue[int],
                       buffers: list[torch.Tensor], on_bucket: BucketCallback | None) -> tuple[float, float]:
        """Every bucket's rebuild as it ends (`done` names it): a verified one to `on_bucket` (until one failed), then
        the seconds spent (rebuild, checksum); raises the first `DeltaError`, else `WeightSyncError` naming the buckets
        whose resulting bytes do not match."""
        bad: list[int] = []
        errors: list[DeltaError] = []
        rebuild_s = verify_s = 0.0
        for _ in range(len(manifest.buckets)):
            i = await done.get()
            try:
                ok, spent, hashed = work[i].result()
            except Exception as exc:  # noqa: BLE001 - whatever broke a rebuild, the full version is fetched instead
                errors.append(exc if isinstance(exc, DeltaError) else DeltaError(f"bucket {i} not rebuilt: {exc!r}"))
                continue
            rebuild_s, verify_s = rebuild_s + spent, verify_s + hashed
            if not ok:
                bad.append(i)
            elif on_bucket is not None and not bad and not errors:
                res = on_bucket(i, unpack_bucket(manifest.buckets[i], buffers[i]))
                if asyncio.iscoroutine(res):
                    await res
        if errors:
            raise errors[0]
        if bad:
            raise WeightSyncError(f"buckets {sorted(bad)} rebuilt from the delta do not match their checksums")
        return rebuild_s, verify_s

    def _give_when_done(self, slab: torch.Tensor, work: list[Future[tuple[bool, float, float]]]) -> None:
        """`slab` back to the buffers once no rebuild writes into it any more (now, or when the last one ends)."""
        running = [f for f in work if not f.done() and not f.cancel()]
        if not running:
            self.buffers.pool.give([slab])
            return
        left = [len(running)]
        loop = asyncio.get_running_loop()

        def one_ended(_f: Future[tuple[bool, float, float]]) -> None:
            left[0] -= 1
            if left[0] == 0:
                _call_soon(loop, self.buffers.pool.give, [slab])

        for f in running:
            f.add_done_callback(one_ended)

    async def fetch_payloads(self, manifest: Manifest, on_payload: Callable[[int, torch.Tensor], None] | None = None, *,
                             reuse: bool = False) -> tuple[list[torch.Tensor | None], list[BucketInfo]]:
        """A delta manifest's encoded buckets over the network path, each verified against its own checksum: per bucket
        its payload (None: unchanged), and the buckets that carry bytes (the payload's dense numbering, as served).
        `on_payload(bucket, payload)` is told each one as it verifies (`bucket`: its index in `manifest`)."""
        carried = [b for b in manifest.buckets if b.encoding != UNCHANGED]
        payload_manifest = replace(manifest, buckets=tuple(BucketInfo(index=i, dtype="uint8", nbytes=b.delta_nbytes, checksum=b.delta_checksum)
                                                           for i, b in enumerate(carried)), host_key="", cuda_ipc=None, bulk_port=0)
        offsets, total = payload_offsets([b.delta_nbytes for b in carried])  # each 8-byte aligned: decoded through int32 and element views
        scratch = self._scratch_of(total) if reuse else torch.empty(total, dtype=torch.uint8)
        views = [scratch[at : at + b.delta_nbytes] for b, at in zip(carried, offsets, strict=True)]
        told = None if on_payload is None else (lambda j, _tensors: on_payload(carried[j].index, views[j]))
        if carried:
            steps = self.plan(manifest) if self.plan is not None else None
            lane = self.bulk is not None and steps is not None and BULK in steps.to_try
            job = FetchJob(check_manifest(replace(payload_manifest, bulk_port=manifest.bulk_port if lane else 0)), on_bucket=told,
                           buffers=views, slab=scratch)
            lane_done = False
            if self.bulk is not None and lane:
                try:
                    await self.bulk.fetch(job)
                    lane_done = True
                except PathFallbackError as exc:  # what the lane verified is kept; the ROUTER fetches the rest
                    log.info("weight version %d: the delta's encoded bytes over the ROUTER: %s", manifest.version, exc.reason)
                    if exc.resume is not None:
                        job.manifest, job.skip = exc.resume
            if not lane_done:
                await self.network.fetch(job)
        payloads: list[torch.Tensor | None] = [None] * len(manifest.buckets)
        for b, view in zip(carried, views, strict=True):
            payloads[b.index] = view
        return payloads, carried

    async def read_payloads(self, manifest: Manifest, on_payload: Callable[[int, torch.Tensor], None] | None = None, *,
                            reuse: bool = False) -> list[torch.Tensor | None]:
        """A delta manifest's encoded buckets copied out of the publisher's segment (`Manifest.delta_shm`, laid out by
        `payload_offsets`) into a buffer of this subscriber's, each copy verified against its checksum while in cache, in
        `threads` threads (`on_payload` told each one as it verifies, as `fetch_payloads` tells them); per bucket its
        payload (None: unchanged). The segment's header must name this version before the copies and be unchanged
        after them (else the publisher reused it meanwhile: the delta was evicted): `WeightSyncError`, as for a segment
        that cannot be mapped; `DeltaError` for encoded bytes that do not match their checksum."""
        seg = manifest.delta_shm
        if seg is None or self.segments is None:
            raise WeightSyncError("the delta names no shared-memory segment")
        try:
            reader = self.segments.reader(seg.name, seg.nbytes)
        except ShmUnavailableError as exc:
            raise WeightSyncError(f"cannot map the delta's segment ({exc})") from exc
        state = reader.state()
        if state[0] != manifest.version:
            raise WeightSyncError(f"the delta's segment holds version {state[0]}, not {manifest.version} (the delta was evicted)")
        carried = [b for b in manifest.buckets if b.encoding != UNCHANGED]
        offsets, total = payload_offsets([b.delta_nbytes for b in carried])
        if total > seg.nbytes:
            raise DeltaError(f"the delta's {total} encoded bytes do not fit its segment of {seg.nbytes}")
        source = reader.host_tensor()
        scratch = self._scratch_of(total) if reuse else torch.empty(total, dtype=torch.uint8)
        payloads: list[torch.Tensor | None] = [None] * len(manifest.buckets)
        for b, at in zip(carried, offsets, strict=True):
            payloads[b.index] = scratch[at : at + b.delta_nbytes]

        def copy_checked(b: BucketInfo, at: int) -> bool:
            mine = scratch[at : at + b.delta_nbytes]
            mine.copy_(source[at : at + b.delta_nbytes])
            return verify_checksum(b.delta_checksum, mine.numpy().data)

        loop = asyncio.get_running_loop()
        pool = self._threads()
        checks = [(b, asyncio.wrap_future(pool.submit(copy_checked, b, at), loop=loop)) for b, at in zip(carried, offsets, strict=True)]
        try:
            for b, f in checks:
                if not await f:
                    raise DeltaError(f"bucket {b.index}'s encoded bytes in shared memory do not match their checksum")
                if reader.state() != state:
                    raise WeightSyncError(f"the publisher reused the delta's segment while it was read (version {manifest.version} evicted)")
                if on_payload is not None:
                    on_payload(b.index, payloads[b.index])  # type: ignore[arg-type]
        finally:
            for _b, f in checks:
                f.cancel()
        self.network.ctx.counters.shm_bytes += sum(b.delta_nbytes for b in carried)
        return payloads

    async def rebuild(self, manifest: Manifest, payloads: Sequence[torch.Tensor | None], base: Sequence[torch.Tensor],
                      out: Sequence[torch.Tensor]) -> None:
        """Write each bucket of `manifest`'s version into `out` from `base` and its payload (in `threads` threads) and
        verify it against the checksum of the resulting bytes (taken in the same pass); `WeightSyncError` or
        `DeltaError` if any does not match."""
        if len(base) != len(manifest.buckets) or len(out) != len(manifest.buckets):
            raise WeightSyncError("the base's buckets do not line up with the delta's")

        def one(i: int) -> bool:
            return _rebuild_one(manifest.buckets[i], payloads[i], base[i], out[i])[0]

        oks = await asyncio.to_thread(lambda: list(self._threads().map(one, range(len(manifest.buckets)))))
        bad = [i for i, ok in enumerate(oks) if not ok]
        if bad:
            raise WeightSyncError(f"buckets {bad} rebuilt from the delta do not match their checksums")

    def _make_scratch_ahead(self, model_bytes: int) -> None:
        """A whole version is held on the engine's GPU (the first delta's base): the page-locked buffer its deltas land
        in is made now, `delta.ENCODED_FRACTION_GUESS` of the model's bytes (x 5/4, as every such buffer), in a thread, not when the first delta is fetched
        (page-locking ~0.7 GB took ~0.6 s of that delta's fetch at 8B on an H200)."""
        held = self.device
        if not self.enabled or held is None or held.device.type != "cuda" or self._scratch is not None or self._scratch_ahead is not None:
            return
        nbytes = _scratch_bytes(int(model_bytes * ENCODED_FRACTION_GUESS))
        fut: Future[torch.Tensor] = Future()

        def make() -> None:
            try:
                fut.set_result(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
            except BaseException as exc:  # noqa: BLE001 - the first delta's fetch makes it then
                fut.set_exception(exc)

        self._scratch_ahead = fut
        threading.Thread(target=make, name="rollpool-delta-scratch", daemon=True).start()

    def _scratch_of(self, nbytes: int) -> torch.Tensor:
        """The reused buffer a delta's encoded bytes land in before they go to the GPU (page-locked there, so the copies
        run at full speed; grown when a delta needs more). Only the device rebuild uses it: it has read the bytes by the
        time its fetch returns (each bucket's check waits for its copy), so the next fetch may write it again."""
        held = self.device
        pin = held is not None and held.device.type == "cuda"
        ahead, self._scratch_ahead = self._scratch_ahead, None
        if ahead is not None:  # (made since the first version was held: a wait here is shorter than making it now)
            try:
                made = ahead.result()
            except Exception as exc:  # noqa: BLE001
                log.info("the delta's page-locked buffer could not be made ahead (%s): made now", exc)
            else:
                if self._scratch is None or int(made.numel()) > int(self._scratch.numel()):
                    self._scratch = made
        if self._scratch is None or int(self._scratch.numel()) < nbytes:
            self._scratch = torch.empty(_scratch_bytes(nbytes), dtype=torch.uint8, pin_memory=pin)
        return self._scratch[:nbytes]

    async def _fetch_on_device(self, manifest: Manifest, on_bucket: BucketCallback | None) -> Fetched:
        """`manifest`'s version rebuilt in place in the buffers of the version held on the engine's GPU (its base,
        `device_why_not` says so): each bucket's encoded bytes fetched and verified on the host as on the host path,
        copied to the GPU, decoded and scattered there, and the resulting bytes verified there against the manifest's
        mix64 of them (`rollpool.weights.delta_gpu.rebuild_bucket`), handed to ``on_bucket`` as they verify. The base is
        written in place, so from the first write it holds neither version: any failure drops it (the caller fetches
        the version whole, staged afresh) and raises `WeightSyncError` or `DeltaError`."""
        t0 = time.perf_counter()
        held = self.device
        assert held is not None
        steps = self.plan(manifest) if self.plan is not None else None
        if steps is not None and steps.refusal:
            raise WeightSyncError(steps.refusal)
        via = SHM if steps is not None and SHM in steps.to_try else NETWORK
        views = list(held.views)
        stream = side_stream(held.device) if held.device.type == "cuda" else None
        held.version = -1  # written in place from here on: the version it held is gone until this one verifies
        loop = asyncio.get_running_loop()
        pool = self._device_threads()
        work: dict[int, Future[tuple[bool, float, float]]] = {}
        done: asyncio.Queue[int] = asyncio.Queue()

        def start(i: int, payload: torch.Tensor | None) -> None:
            if i in work:
                return
            work[i] = f = pool.submit(_device_one, manifest.buckets[i], payload, views[i], stream)
            f.add_done_callback(lambda _f: _call_soon(loop, done.put_nowait, i))

        try:
            for b in manifest.buckets:
                if b.encoding == UNCHANGED:
                    start(b.index, None)  # verified as it is: the base's bucket is the result
            if via == SHM:
                payloads = await self.read_payloads(manifest, on_payload=start, reuse=True)
            else:
                payloads, _carried = await self.fetch_payloads(manifest, on_payload=start, reuse=True)
            fetched = time.perf_counter()
            for i, p in enumerate(payloads):
                start(i, p)
            rebuild_s, verify_s = await self._collect(manifest, work, done, views, on_bucket)
        except BaseException:
            await self._abandon_device(list(work.values()))
            raise
        held.done(manifest.publisher_id, manifest.version, manifest.buckets)
        now = time.perf_counter()
        self.versions += 1
        self.device_versions += 1
        return Fetched(manifest, views, None, via, {"delta_base": manifest.delta_base, "delta_bytes": sum(b.delta_nbytes for b in manifest.buckets),
                                                    "delta_rebuilt_on": "device", "device": str(held.device),
                                                    "fetch_s": round(fetched - t0, 4), "rebuild_s": round(rebuild_s, 4),
                                                    "verify_s": round(verify_s, 4), "rebuild_after_fetch_s": round(now - fetched, 4),
                                                    "device_rebuild_s": round(rebuild_s + verify_s, 4), "delta_total_s": round(now - t0, 4)},
                       on_device=True, held=held)

    async def _abandon_device(self, work: list[Future[tuple[bool, float, float]]]) -> None:
        """A rebuild on the GPU failed part-way: the base there is neither version, so it is dropped, once the bucket
        its thread may still be patching is done (queued ones are cancelled; one bucket's work, milliseconds), so the
        full version that follows, staged into the same buffers, is never written over by it."""
        held = self.device
        running = [f for f in work if not f.cancel() and not f.done()]
        if held is not None:
            held.version = -1
        if running:
            try:
                await asyncio.shield(asyncio.wait([asyncio.wrap_future(f) for f in running]))  # (their outcome no longer matters)
            except asyncio.CancelledError:
                # the caller goes away now: the buffers are let go, not reused (the bucket still being patched keeps its
                # view alive until it is done; whatever comes next takes other buffers)
                if held is not None:
                    held.drop()
                raise
        self.release_device(self.buffers.slabs)

    def _device_threads(self) -> ThreadPoolExecutor:
        """One thread for the GPU's rebuild work: the buckets' copies, kernels and checks queued in order on one stream."""
        if self._device_pool is None:
            self._device_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-rebuild-gpu")
        return self._device_pool

    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="weights-rebuild")
        return self._pool


class _TimedSummer:
    """A running checksum that counts the seconds spent in it (the ``verify_s`` of a rebuild)."""

    __slots__ = ("inner", "seconds")

    def __init__(self, inner: Checksummer) -> None:
        self.inner, self.seconds = inner, 0.0

    def update(self, data: Any) -> None:
        t = time.perf_counter()
        self.inner.update(data)
        self.seconds += time.perf_counter() - t


def _rebuild_one(b: BucketInfo, payload: torch.Tensor | None, base: torch.Tensor, out: torch.Tensor) -> tuple[bool, float, float]:
    """Bucket `b` rebuilt into `out` and its resulting bytes checksummed in the same pass: (whether they match
    `b.checksum`, seconds, seconds of them checksumming). An unknown checksum algorithm is a mismatch, never a pass."""
    algo = b.checksum.partition(":")[0]
    if not checksum_supported(algo):
        return False, 0.0, 0.0
    t = time.perf_counter()
    summer = _TimedSummer(Checksummer(algo))
    rebuild_bucket(b.encoding, payload, base, out, itemsize_of(b.dtype), summer)
    return verify_checksum(b.checksum, running=summer.inner), time.perf_counter() - t, summer.seconds


def _patch_one(b: BucketInfo, before: tuple[str, torch.Tensor | None], now: tuple[str, torch.Tensor | None], out: torch.Tensor
               ) -> tuple[bool, float, float]:
    """Bucket `b` rebuilt in place: `out` holds the version two before; the delta before and this one are applied to it
    (`patch_bucket`: a bucket neither touched is not written) and its resulting bytes checksummed in the same pass, as
    every rebuilt bucket is (the bytes of a recycled buffer are its caller's to keep unwritten; the checksum is what
    says they were). As `_rebuild_one`: (match, seconds, seconds checksumming)."""
    algo = b.checksum.partition(":")[0]
    if not checksum_supported(algo):
        return False, 0.0, 0.0
    t = time.perf_counter()
    summer = _TimedSummer(Checksummer(algo))
    patch_bucket([before, now], out, itemsize_of(b.dtype), summer)
    return verify_checksum(b.checksum, running=summer.inner), time.perf_counter() - t, summer.seconds


def _device_one(b: BucketInfo, payload: torch.Tensor | None, bucket: torch.Tensor, stream: Any) -> tuple[bool, float, float]:
    """Bucket `b` rebuilt in place on the GPU and verified there (`rollpool.weights.delta_gpu.rebuild_bucket`), on
    `stream` (None: the device's current one, or the CPU): (match, seconds patching, seconds checksumming)."""
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        return rebuild_on_device(b, payload, bucket)


class DeviceStaging:
    """A whole-model version fetched into host buffers, staged onto the engine's GPU bucket by bucket as each verifies,
    into the buffers the version before it held there (`DeviceHeld`, in place: one version on the GPU; the version
    before is no longer intact there from the first copy). The engine is handed the device tensors (it maps them, no
    copy of its own), and the GPU holds the version afterwards as the next delta's base."""

    def __init__(self, held: DeviceHeld, manifest: Manifest, slabs: DeviceSlabs, on_held: Callable[[int], None] | None = None) -> None:
        self.held = held
        self.on_held = on_held
        """Told the model's bytes once the version is held on the GPU."""
        self.manifest = manifest
        self.slabs = slabs
        self.views: list[torch.Tensor] | None = None
        self.staged: set[int] = set()
        self.stream = side_stream(held.device) if held.device.type == "cuda" else None

    def hook(self, job: FetchJob, inner: BucketCallback | None) -> BucketCallback:
        """`job`'s ``on_bucket``: a bucket verified in host buffers is copied to the GPU, and `inner` gets its device
        tensors; a device path's buckets (no host buffers) go to `inner` as they are."""

        def on_bucket(i: int, tensors: dict[str, torch.Tensor]) -> Any:
            if job.buffers is None:
                return inner(i, tensors) if inner is not None else None
            self._copy(i, job.buffers[i])
            assert self.views is not None
            return inner(i, unpack_bucket(self.manifest.buckets[i], self.views[i])) if inner is not None else None

        return on_bucket

    def _copy(self, i: int, host: torch.Tensor) -> None:
        if self.views is None:
            self.views = self.held.begin(self.manifest.buckets, take=self.slabs.take_at_least, give=self.slabs.give)
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            self.views[i].copy_(host, non_blocking=True)
        self.staged.add(i)

    async def finish(self, got: Fetched) -> Fetched:
        """The fetch is done: a host path's version is staged whole (the buckets not staged yet copied, the copies
        waited for) and held; a version the shared-memory path staged itself (``shm_device``, verified there) is held
        as it is; any other device path's leaves none held."""
        held = self.held
        if got.on_device:
            if self.views is not None:  # a host path staged some buckets, then failed over to a device path
                slab = held.drop()
                if slab is not None:
                    self.slabs.give(slab)
            # (the shared-memory path staged to the GPU names itself ``shm``, on the device)
            if got.path == SHM and got.slab is not None and got.slab.is_cuda == (held.device.type == "cuda"):
                held.adopt(got.slab, got.buffers, got.manifest.buckets, got.manifest.publisher_id, got.manifest.version)
                self._held(got.manifest)
                return replace(got, held=held)
            return got
        for i, host in enumerate(got.buffers):
            if i not in self.staged:
                self._copy(i, host)
        if self.stream is not None:
            await asyncio.to_thread(self.stream.synchronize)
        held.done(got.manifest.publisher_id, got.manifest.version, got.manifest.buckets)
        self._held(got.manifest)
        return replace(got, held=held)

    def _held(self, manifest: Manifest) -> None:
        if self.on_held is not None:
            self.on_held(sum(b.nbytes for b in manifest.buckets))

    def abandon(self) -> None:
        """The fetch failed: whatever was copied is no version."""
        if self.views is not None:
            self.held.version = -1


def _scratch_bytes(nbytes: int) -> int:
    return max(nbytes, 1 << 20) * 5 // 4


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
        loop.call_soon_threadsafe(fn, *args)
