"""`WeightSubscriber`: the worker's (and relay's) side of the weight-publish channel, a facade over the paths.

What it promises
    - It learns of new versions three ways: PUB announcements, a "latest"
      manifest request on connect, and another whenever `note_version(v)`
      names a version newer than any it knows (a broker heartbeat). So a
      worker that joins late, or missed announcements, catches up. The
      manifest such a request got is the one the next `fetch` of that version
      uses: one manifest request per version (`rollpool.weights.watch`).
    - `fetch()` walks `rollpool.weights.manifest.plan` for the version's
      manifest: each path to try (`rollpool.weights.paths`) in turn, each
      reason to pass one over logged and counted in `fallbacks` when the walk
      reaches it, a path that fails during the fetch (`PathFallbackError`)
      likewise. It returns a `WeightVersion` only when every bucket has
      arrived and matched its checksum; a bucket that fails is fetched again,
      at most `max_refetch` times, then `WeightSyncError`. A version is never
      returned in part.
    - Every wait has a timeout: no reply for `fetch_timeout_s` re-asks for what
      is outstanding, at most `max_refetch` times in a row, then raises
      `WeightSyncError` (the caller keeps its old weights).
    - A version evicted by the publisher while being fetched raises
      `WeightVersionGoneError` when that version was asked for by number; when
      the latest was asked for, the fetch moves on to the new latest (at most
      `max_refetch` times).
    - Host buffers are allocated once and reused (`reserve`, `recycle`); the
      tensors handed back are views of them (or of device buffers on the
      same-GPU and staged paths). ``pin_memory=True`` allocates them
      page-locked when CUDA is available; without CUDA it is ignored.
    - Every knob is its `WeightPathConfig` (`config`), read once when made.

The copies a byte makes on each path are in docs/weights.md ("Copies a byte makes").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from rollpool.protocol.codec import DELTA_PATHS_MINOR
from rollpool.protocol.errors import WeightSyncError
from rollpool.protocol.logs import RateLimitedLog
from rollpool.protocol.messages import Manifest
from rollpool.protocol.metrics import MetricsSink, NullMetricsSink
from rollpool.protocol.sockets import SocketFactory
from rollpool.weights.bucketing import unpack_buckets
from rollpool.weights.config import WeightPathConfig, with_overrides
from rollpool.weights.delta import DeltaError, WireSummary, wire_summary
from rollpool.weights.delta_gpu import DeviceHeld
from rollpool.weights.gpu import DeviceSlabs, warm_up_in_background
from rollpool.weights.manifest import (
    BULK,
    CUDA_IPC,
    NETWORK,
    SHM,
    SHM_DEVICE,
    FetchFacts,
    Plan,
    check_manifest,
    delta_plan,
    plan,
)
from rollpool.weights.memory import VersionBuffers, host_key
from rollpool.weights.paths.base import (
    Attr,
    BucketCallback,
    FetchContext,
    FetchCounters,
    Fetched,
    FetchJob,
    FetchPath,
    PathFallbackError,
    TransferSink,
    WeightVersion,
    WeightVersionGoneError,
)
from rollpool.weights.paths.bulk import BulkPath, lane_host
from rollpool.weights.paths.cuda_ipc import CudaIpcPath
from rollpool.weights.paths.delta import DeltaPath
from rollpool.weights.paths.network import DealerSet, NetworkPath
from rollpool.weights.paths.shm import ShmDevicePath, ShmPath, ShmSegments
from rollpool.weights.watch import PublisherWatch

__all__ = ["WeightVersion", "WeightSubscriber", "WeightVersionGoneError", "TransferSink"]

log = logging.getLogger(__name__)


class WeightSubscriber:
    """SUB (announcements) + DEALER (manifests, chunks) to one publisher or relay."""

    def __init__(
        self,
        sockets: SocketFactory,
        *,
        worker_id: str = "",
        fetch_timeout_s: float = 30.0,
        window_chunks: int = 16,
        max_refetch: int = 3,
        metrics: MetricsSink | None = None,
        pin_memory: bool = False,
        weights: WeightPathConfig | None = None,
        stage_device: str | None = None,
        path: str | None = None,
        streams: int | None = None,
        pinned_budget_bytes: int | None = None,
        copy_threads: int | None = None,
        reserve_bytes: int | None = None,
        bulk: bool | None = None,
        early_bytes: bool | None = None,
    ) -> None:
        """`weights`: every weight-path knob (None: `WeightPathConfig.from_env`, read once here); `path`, `streams`,
        `pinned_budget_bytes`, `copy_threads`, `reserve_bytes`, `bulk` and `early_bytes` override one of its fields each."""
        cfg = with_overrides(weights, weight_path=path, weight_streams=streams, pinned_budget_bytes=pinned_budget_bytes,
                             weight_copy_threads=copy_threads, weight_reserve_bytes=reserve_bytes, weight_bulk=bulk,
                             weight_early_bytes=early_bytes)
        path, streams, pinned_budget_bytes = cfg.weight_path, cfg.streams, cfg.pinned_budget_bytes
        self.sockets = sockets
        self.worker_id = worker_id or f"sub-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.fetch_timeout_s = fetch_timeout_s
        self.window_chunks = window_chunks
        self.max_refetch = max_refetch
        self.pin_memory = pin_memory and torch.cuda.is_available()
        """Bucket buffers in page-locked memory, for fast copies to a GPU (False without CUDA)."""
        self.metrics: MetricsSink = metrics or NullMetricsSink()
        self.path = path
        self.streams = streams
        self.copy_threads = cfg.copy_threads
        self.config = cfg
        """Every weight-path knob (the path plan reads it: `rollpool.weights.manifest.plan`)."""
        self.counters = FetchCounters()
        """Bytes per path and refetches (`bytes_received`, `shm_bytes`, ... read them)."""
        self._prefix = uuid.uuid4().hex[:8]
        peer = f"{self.worker_id}/{self._prefix}"[:250]
        self.dealers = DealerSet(sockets, peer)
        """The DEALER sockets (one per stream) and the request router over them."""
        self.buffers = VersionBuffers(pin=self.pin_memory, pinned_budget_bytes=pinned_budget_bytes, slabs=DeviceSlabs())
        """The host buffers, one per version, and the device slabs of the device paths (`reserve`, `recycle`)."""
        self.segments = ShmSegments(host_key(), path, self.buffers.slabs)
        """The publisher's shared-memory segments mapped here, and the staging edge to the engine's GPU."""
        cuda = stage_device if stage_device and stage_device.startswith("cuda") and torch.cuda.is_available() else None
        self.segments.stage_device = cuda if cfg.weight_shm_to_device else None
        self.watch = PublisherWatch(sockets, self.dealers, self.segments, host_key=self.segments.host_key,
                                    asks_deltas=cfg.weight_delta and path in ("auto", NETWORK, SHM),  # deltas ride these paths
                                    fetch_timeout_s=fetch_timeout_s, max_refetch=max_refetch,
                                    gpu_uuids=self.gpu_uuids, delta_base=lambda: self.delta.base_version(),
                                    device_verify=lambda base: self.delta.verifies_on_device(base))
        """The versions the publisher is known to hold, and the manifest requests to it (the paths' `ManifestSource`)."""
        if path == SHM:
            self.watch.deltas_need_minor = DELTA_PATHS_MINOR  # an older server's deltas come over the network only
        self.ctx = FetchContext(worker_id=self.worker_id, metrics=self.metrics, manifests=self.watch, counters=self.counters,
                                fetch_timeout_s=fetch_timeout_s, window_chunks=window_chunks, max_refetch=max_refetch,
                                streams=streams, copy_threads=self.copy_threads)
        self._network = NetworkPath(self.ctx, self.dealers)
        self._bulk = BulkPath(self.ctx, peer.encode(), lambda: self.router_endpoint, early_bytes=cfg.weight_early_bytes)
        self.fallbacks: dict[str, int] = {}
        """Versions a faster path did not serve, by reason (each one a counted fallback to the next path)."""
        self.last_fallback = ""
        """The reason of the latest fallback ("" before any): `rollpool top` shows it beside the count."""
        self._fetch_fallbacks: list[str] = []
        """The fallback reasons of the fetch under way (its ``weights fetched`` line lists them)."""
        self._manifest_wait: dict[str, Any] = {}
        """This fetch's wait for its manifest (`fetch`), for the ``weights fetched`` line."""
        self.last_path = ""
        """The path of the last completed fetch: ``cuda_ipc``, ``shm`` or ``network``."""
        self.ipc = CudaIpcPath(self.ctx, self.buffers.slabs, path)
        """The same-GPU path (its `gpus` is the device edge tests fake)."""
        self._shm = ShmPath(self.ctx, self.segments)
        self._shm_device = ShmDevicePath(self.ctx, self.segments)
        self._errlog = RateLimitedLog(log)
        self.delta = DeltaPath(self._network, self.buffers, enabled=cfg.weight_delta, threads=cfg.delta_threads, segments=self.segments,
                               bulk=self._bulk, plan=lambda m: delta_plan(m, self.facts(), self.config))
        """Delta versions: the base held here and the rebuild from it (`rollpool.weights.paths.delta`)."""
        if cuda is not None and cfg.weight_delta and cfg.weight_delta_on_device:
            # the engine's GPU holds the version it loads from, kept as the next delta's base (tests put a CPU
            # `DeviceHeld` in `delta.device` to run the same flow on CPU tensors)
            self.delta.device = DeviceHeld(cuda)
            warm_up_in_background(cuda)  # the first delta checked on the GPU does not build the checksum kernel
        self.last_wire: WireSummary | None = None
        """The last version fetched: its bytes on the wire by encoding and the changed fraction it carried (status, top)."""
        if cfg.weight_reserve_bytes:
            self.reserve_in_background(cfg.weight_reserve_bytes)

    # -- connection

    def connect(self, router_endpoint: str, pub_endpoint: str | None = None) -> None:
        """Connect (or reconnect to new endpoints) and ask for the latest version. Needs a running loop."""
        if (router_endpoint, pub_endpoint) == (self.router_endpoint, self.pub_endpoint) and self.dealers.connected:
            return
        self.watch.open(router_endpoint, pub_endpoint, self.streams)

    @property
    def connected(self) -> bool:
        return self.dealers.connected

    router_endpoint: Attr[str | None] = Attr("watch", "The publisher's (or relay's) ROUTER, once connected.")
    pub_endpoint: Attr[str | None] = Attr("watch", "Its PUB (None: no announcements heard, versions learned by asking).")
    host_key: Attr[str] = Attr("watch", "This host's key (boot and /dev/shm): the same-host paths' hello.", writable=True)

    # counters by path (the worker reports them), and the shared-memory part's state, under their public names
    bytes_received: Attr[int] = Attr("counters", "Bucket bytes received on the network path (over ZeroMQ or the bulk lane).")
    bulk_bytes: Attr[int] = Attr("counters", "Of `bytes_received`, those received over the bulk lane.")
    early_bytes: Attr[int] = Attr("counters", "Of `bulk_bytes`, those received before their bucket's checksum (minor 30).")
    shm_bytes: Attr[int] = Attr("counters", "Bucket bytes copied from a publisher's shared-memory segments.")
    device_stage_bytes: Attr[int] = Attr("counters", "Bucket bytes copied from shared memory straight to `stage_device`, verified there.")
    ipc_bytes: Attr[int] = Attr("counters", "Bucket bytes copied device-to-device from a publisher's exported GPU buffer.")
    buckets_refetched: Attr[int] = Attr("counters")
    stage_device: Attr[str | None] = Attr("segments", "The engine's ``cuda`` device when it stages to CUDA (the worker sets it): shared-memory "
                                          "buckets are copied straight to it and verified there. None: the CPU copy.", writable=True)
    device_ops: Attr[Callable[[str, DeviceSlabs], Any]] = Attr("segments", "Makes the staging edge for `stage_device` (tests put a fake "
                                                               "device here, named so).", writable=True)
    segment_maps: Attr[int] = Attr("segments", "Segments mapped so far (a warm subscriber maps none per version).")
    segments_registered_ahead: Attr[int] = Attr("segments", "Segments mapped (and page-locked) ahead of the version that used them.")
    delta_versions: Attr[int] = Attr("delta", "Versions rebuilt from a delta.", field="versions")
    delta_device_versions: Attr[int] = Attr("delta", "Of those, versions rebuilt on the engine's GPU.", field="device_versions")
    delta_fallbacks: Attr[int] = Attr("delta", "Delta versions that could not be rebuilt (no base, a corrupt or evicted delta): fetched "
                                      "full instead.", field="fallbacks")

    @property
    def protocol_errors(self) -> int:
        return self.watch.protocol_errors + self.dealers.protocol_errors

    def close(self) -> None:
        self.watch.close()
        self.delta.close()
        self.segments.close()
        self.ipc.close()
        self.buffers.close()
        self._shm.close()
        self._shm_device.close()

    async def aclose(self) -> None:
        tasks = [*self.watch.tasks, *self.dealers.tasks]
        self.close()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    async def __aenter__(self) -> WeightSubscriber:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- what is known (the watch's)

    def latest_known(self) -> int:
        """The newest version the publisher is known to hold (-1: none yet)."""
        return self.watch.latest

    def note_version(self, version: int) -> None:
        """A broker heartbeat (or welcome) names `version`: ask the publisher for its latest if it is new to us."""
        self.watch.note_version(version)

    def forget_newer(self, version: int) -> None:
        """The pool was rebased to `version`: versions known above it are of an abandoned run. Forgotten, and the
        publisher asked for its latest again (a restarted publisher may start lower); a waiting `wait_for_newer`
        returns what is known now so its caller can look again."""
        self.watch.forget_newer(version)

    async def wait_for_newer(self, than: int, timeout_s: float | None = None) -> int:
        """Wait until a version newer than `than` is known; return it. `WeightSyncError` after `timeout_s`.
        Returns early (maybe not newer) when `forget_newer` forgot versions meanwhile."""
        return await self.watch.wait_for_newer(than, timeout_s)

    def gpu_uuids(self) -> dict[str, int]:
        """The GPUs this process sees by UUID (the same-GPU path's hello); empty on ``network``/``shm`` or without CUDA."""
        return self.ipc.gpu_uuids()

    async def fetch_manifest(self, version: int | None = None, *, attempts: int | None = None, streamed: bool = True,
                             wait_ipc: bool = False, delta: bool = True, after_mix64: int = -1,
                             timeout_s: float | None = None, delta_base: int | None = None, ring_done: int = -1) -> Manifest:
        """The manifest of `version` (None: the latest): `PublisherWatch.fetch_manifest` says how it is asked for."""
        return await self.watch.fetch_manifest(version, attempts=attempts, streamed=streamed, wait_ipc=wait_ipc, delta=delta,
                                               after_mix64=after_mix64, timeout_s=timeout_s, delta_base=delta_base,
                                               ring_done=ring_done)

    def facts(self) -> FetchFacts:
        """This side of the hello, as the path plan reads it."""
        return FetchFacts(host_key=self.host_key, gpu_uuids=frozenset(self.gpu_uuids()), stage_device=self.stage_device is not None,
                          lane_host=lane_host(self.router_endpoint), unreachable_lanes=frozenset(self._bulk.unreachable))

    async def fetch(self, version: int | None = None, *, on_bucket: BucketCallback | None = None) -> WeightVersion:
        """Fetch and verify a whole version (None: the latest). Raises `WeightSyncError`; never returns part of one.

        The paths are tried in the order `rollpool.weights.manifest.plan` gives
        for the version's manifest (the same GPU, shared memory staged to the
        engine's GPU, shared memory, the bulk lane, the ROUTER); a path passed
        over for a reason the user must hear, or one that fails during the
        fetch, is a fallback that is logged and counted in `fallbacks`.
        `on_bucket(index, tensors)` is called as each bucket verifies, so an
        engine can stage it onto its device while the next one arrives; the
        version is still only complete (and applicable) when `fetch` returns.
        """
        moves = 0
        while True:
            t_manifest = time.perf_counter()
            known = self.watch.take_known(version)
            manifest = check_manifest(known or await self.fetch_manifest(version))
            # how long this fetch waited for its manifest (a delta's waits for the server to make it; a manifest the
            # catch-up already holds waited before this fetch began): the ``weights fetched`` line's manifest_s
            self._manifest_wait = {"manifest_s": round(time.perf_counter() - t_manifest, 4), "manifest_at": time.time(),
                                   "manifest_known": known is not None}
            if manifest.version < 0:
                raise WeightSyncError(f"publisher {self.router_endpoint} holds no weight version yet")
            try:
                if manifest.delta_base >= 0:
                    try:
                        return self._fetched(await self.delta.fetch(manifest, on_bucket))
                    except (WeightSyncError, DeltaError) as exc:
                        self.delta.fallbacks += 1
                        self._fallback(manifest.version, f"delta against {manifest.delta_base}: {exc}", path="delta")
                        manifest = check_manifest(await self.fetch_manifest(manifest.version, delta=False))
                return await self._fetch_planned(manifest, on_bucket)
            except WeightVersionGoneError:
                if version is not None or moves >= self.max_refetch:
                    raise
                moves += 1
                log.info("weight version %d was evicted while being fetched; moving to the latest", manifest.version)

    async def _fetch_planned(self, manifest: Manifest, on_bucket: BucketCallback | None) -> WeightVersion:
        """Walk the plan: each path to try is tried; each reason to pass one over is reported when the walk reaches it."""
        steps = plan(manifest, self.facts(), self.config)
        self._fetch_fallbacks = []
        if steps.refusal:
            raise WeightSyncError(steps.refusal)
        job = FetchJob(manifest, on_bucket)
        staging = self.delta.staging(manifest, self.buffers.slabs)
        if staging is not None:  # a whole-model version goes to the engine's GPU as it verifies, and stays there
            job.on_bucket = staging.hook(job, on_bucket)
        try:
            got = await self._walk(steps, job)
            return self._fetched(await staging.finish(got) if staging is not None else got)
        except BaseException:
            if staging is not None:
                staging.abandon()
            if job.slab is not None:
                self.buffers.pool.give([job.slab])
            raise

    async def _walk(self, steps: Plan, job: FetchJob) -> Fetched:
        """The first path of `steps` that serves `job`; a fallback is reported and the walk goes on."""
        for step in steps.steps:
            if step.why_not:
                if step.counted:
                    self._fallback(job.manifest.version, step.why_not, path=step.path)
                continue
            path = self._path(step.path)
            if not path.host_buffers and step.path in (CUDA_IPC, SHM_DEVICE) and job.manifest.adapter is None:
                self.delta.release_device(self.buffers.slabs)  # that path takes a slab of its own: this one, one version on the GPU
            if path.host_buffers and job.buffers is None:
                await self.buffers.reserved()  # the device paths need no host buffer: they do not wait for the reserve
                job.slab, job.buffers = self._take_buffers(job.manifest)
            try:
                return await path.fetch(job)
            except PathFallbackError as exc:
                self._fallback(job.manifest.version, exc.reason, path=step.path)
                if exc.resume is not None:
                    job.manifest, job.skip = exc.resume
        raise WeightSyncError(f"weight version {job.manifest.version}: no path left to fetch it")  # (network is always last)

    def _path(self, name: str) -> FetchPath:
        paths: dict[str, FetchPath] = {CUDA_IPC: self.ipc, SHM_DEVICE: self._shm_device, SHM: self._shm, BULK: self._bulk,
                                       NETWORK: self._network}
        return paths[name]

    def _fetched(self, got: Fetched) -> WeightVersion:
        """The one tail of every fetch: the path noted, the ``weights fetched`` log line and event, the version (held as
        the next delta's base when it is in host buffers)."""
        manifest, path, details = got.manifest, got.path, got.details
        self.last_path = path
        nbytes = sum(b.nbytes for b in manifest.buckets)
        c = self.counters
        log.info("weights fetched %s", json.dumps({"version": manifest.version, "path": path, **details, "bytes": nbytes,
                                                   "bytes_received": c.bytes_received, "bulk_bytes": c.bulk_bytes,
                                                   "shm_bytes": c.shm_bytes, "device_stage_bytes": c.device_stage_bytes,
                                                   "ipc_bytes": c.ipc_bytes, "fallbacks": sum(self.fallbacks.values()),
                                                   "fallback_reasons": list(self._fetch_fallbacks),
                                                   **self._manifest_wait, "at": time.time()}))
        event = {"worker_id": self.worker_id, "version": manifest.version, "bytes": nbytes, "path": path}
        if "staged_to" in details:
            event["staged_to"] = details["staged_to"]
        self.metrics.event("version_fetched", event)
        self.last_wire = wire_summary(manifest.version, manifest.buckets, manifest.delta_base)
        held = got.held
        # the engine loads the GPU's copy where one is held (it maps those tensors; no copy of its own)
        tensors = unpack_buckets(zip(manifest.buckets, held.views if held is not None else got.buffers, strict=True))
        wv = WeightVersion(version=manifest.version, tensors=tensors, manifest=manifest, buffers=tuple(got.buffers), slab=got.slab, held=held,
                           details={"path": path, **{k: v for k, v in details.items() if k != "timeline"}})
        return self.delta.hold(wv, on_device=got.on_device)

    # -- memory

    def reserve(self, named_shapes: Any = None, *, total_bytes: int | None = None, versions: int = 2) -> int:
        """Allocate (and touch) host buffers for `versions` versions before the first one; returns the bytes.
        Free buffers that already fit a version count towards them (so a second call tops up).

        `named_shapes`: the engine's own parameters (tensors, meta tensors, or
        ``(name, (shape, dtype))`` pairs), or give `total_bytes`. A version's
        buckets are carved from one buffer of its total size, so neither the
        tensor order nor the publisher's bucket size has to match. Two versions
        by default: the one the engine serves (kept for a re-apply after a
        restart) and the one being fetched. Page-locked when the subscriber was
        made with ``pin_memory`` on a CUDA host, within `pinned_budget_bytes`.
        With a `stage_device`, the device buffers the staged shared-memory path
        and the same-GPU path copy into are allocated first.
        """
        if versions < 1:
            raise ValueError(f"versions must be >= 1, got {versions}")
        if total_bytes is None:
            if named_shapes is None:
                raise ValueError("reserve needs named_shapes or total_bytes")
            from rollpool.weights.snapshot import layout_of

            total_bytes = sum(n for _name, _dtype, _shape, n in layout_of(named_shapes))
        return self.buffers.reserve(total_bytes, versions, self._device_for_reserve())

    def reserve_in_background(self, total_bytes: int, versions: int = 2) -> None:
        """`reserve` in a thread (page-locking 2 x 14.5 GB takes seconds; the event loop and its heartbeats go on);
        the next fetch waits for it to finish before it takes a buffer."""
        self.buffers.reserve_in_background(total_bytes, versions, self._device_for_reserve())

    def _device_for_reserve(self) -> str | None:
        """The device whose slab `reserve` makes first: the staged shared-memory path's, or the GPU that holds versions."""
        held = self.delta.device
        return self.stage_device or (str(held.device) if held is not None and held.device.type == "cuda" else None)

    def reserve_device(self, total_bytes: int, device: str | torch.device, versions: int = 2) -> int:
        """Allocate the same-GPU path's device buffers for `versions` versions now (else the first such fetch does)."""
        return self.buffers.reserve_device(total_bytes, device, versions)

    buffers_allocated: Attr[int] = Attr("buffers", "Host buffers made fresh so far (reserved ones included; a warm subscriber makes none per version).")
    pinned_bytes: Attr[int] = Attr("buffers")
    pinned_budget_bytes: Attr[int | None] = Attr("buffers", "The most page-locked bucket memory this subscriber allocates (None: no bound).")

    def recycle(self, old: WeightVersion) -> None:
        """Hand back a version the caller no longer uses (its tensors were copied into the engine).

        The next fetch reuses its buffer (one per version; a version's buckets
        are views of it), which spares the page faults of fresh memory: about 5x
        the cost of the copy itself on first touch. The caller must not use
        `old`'s tensors afterwards.
        """
        if old.held is not None and (old.slab is None or old.slab is old.held.slab):
            return  # device buffers held on the engine's GPU (the next delta's base; let go by the delta path)
        if self.delta.holds(old):
            return  # still the base of the next delta: back to the buffers when a newer version lands
        self.buffers.give(old.slab, old.buffers)

    def _take_buffers(self, manifest: Manifest) -> tuple[torch.Tensor, list[torch.Tensor]]:
        slab, buffers = self.buffers.take([b.nbytes for b in manifest.buckets], manifest.version)
        self.delta.forget(slab)  # about to be written: no longer the version it held (a delta's in-place rebuild asks)
        return slab, buffers

    # -- the shared-memory path

    def _fallback(self, version: int, why: str, *, path: str = "shm") -> None:
        """A same-host path (`path`) could not serve `version`: the next one down is taken (counted, logged)."""
        self.fallbacks[why] = self.fallbacks.get(why, 0) + 1
        self.last_fallback = why
        self._fetch_fallbacks.append(why)
        nxt = {"cuda_ipc": "shared memory or the network", "shm_device": "shared memory copied on the CPU", "bulk": "the ROUTER"}.get(path, "the network path")
        self._errlog.warning("fallback:" + why, "weight version %d not on %s, over %s: %s (counted in fallbacks)", version, path, nxt, why)
        self.metrics.event("weights_fallback", {"worker_id": self.worker_id, "version": version, "reason": why, "from": path})
        if self.path == "shm" and path == "shm":
            raise WeightSyncError(f"weight path 'shm': {why}")

    async def fetch_into(self, manifest: Manifest, buffers: list[torch.Tensor], sink: TransferSink | None = None, *,
                         on_bucket: BucketCallback | None = None) -> Manifest:
        """Fill `buffers` (1-D uint8, one per bucket) with `manifest`'s buckets over the network (the bulk lane where the
        plan takes it, else the ROUTER) and verify each one. Returns the manifest with the checksums it verified (a
        streamed one's pending checksums filled in)."""
        check_manifest(manifest)
        if len(buffers) != len(manifest.buckets):
            raise ValueError("one buffer per bucket")
        network = plan(manifest, self.facts(), replace(self.config, weight_path=NETWORK))
        got = await self._walk(network, FetchJob(manifest, on_bucket, buffers=buffers, sink=sink))
        return got.manifest
