"""`WeightSubscriber`: the worker's (and relay's) side of the weight-publish channel.

What it promises
    - It learns of new versions three ways: PUB announcements, a "latest"
      manifest request on connect, and another whenever `note_version(v)`
      names a version newer than any it knows (a broker heartbeat). So a
      worker that joins late, or missed announcements, catches up.
    - `fetch()` returns a `WeightVersion` only when every bucket has arrived
      and matched its manifest checksum. A bucket that fails verification is
      fetched again, at most `max_refetch` times; then `WeightSyncError`.
      A version is never returned in part.
    - Every wait has a timeout: no reply for `fetch_timeout_s` re-asks for what
      is outstanding, at most `max_refetch` times in a row, then raises
      `WeightSyncError` (the caller keeps its old weights).
    - Transfer keeps a window of `window_chunks` `Fetch` requests outstanding
      (credit-based flow control: the publisher only ever answers requests).
    - A version evicted by the publisher while being fetched raises
      `WeightVersionGoneError` when that version was asked for by number; when
      the latest was asked for, the fetch moves on to the new latest (at most
      `max_refetch` times).
    - The tensors handed back are views of the received bucket buffers (one
      copy per byte, from the socket's frame into the bucket buffer).
      ``pin_memory=True`` allocates those buffers page-locked when CUDA is
      available (fast host-to-device copies); without CUDA it is ignored.

Copies a byte makes from the trainer's tensor to the engine's (snapshot mode):
trainer tensor -> publisher bucket (1, in `publish`, before the version is
announced), kernel send (1, tcp or ipc), kernel receive into a ZeroMQ frame (1),
frame -> subscriber bucket (1, in a worker thread, beside the checksum pass),
then the engine's own copy onto its device (1). ``keep_versions=0`` drops the
first. Receiving straight into the bucket (``Socket.recv_into``) was tried: it
saves no copy, because libzmq's ``zmq_recv`` itself copies out of its frame,
and it moves that copy onto the event loop, which measured slower (see
docs/weights.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from rollpool.protocol.codec import decode
from rollpool.protocol.errors import ProtocolError, WeightSyncError
from rollpool.protocol.logs import RateLimitedLog
from rollpool.protocol.messages import Announce, CudaIpcBuffer, Error, Manifest, ManifestRequest
from rollpool.protocol.metrics import MetricsSink, NullMetricsSink
from rollpool.protocol.sockets import SocketFactory
from rollpool.weights.bucketing import Checksummer, unpack_bucket, unpack_buckets, verify_checksum
from rollpool.weights.config import WEIGHT_PATHS, WeightPathConfig, default_copy_threads, weight_streams
from rollpool.weights.cuda_ipc import DeviceSlabs, arena_offsets, mix64_checksum, mix64_format, mix64_partial
from rollpool.weights.manifest import BULK, CUDA_IPC, NETWORK, SHM, SHM_DEVICE, FetchFacts, Plan, check_manifest, plan
from rollpool.weights.memory import BufferPool, ShmReader, ShmUnavailableError, host_key
from rollpool.weights.paths.base import (
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
from rollpool.weights.paths.bulk import BulkPath, bulk_enabled, lane_host
from rollpool.weights.paths.network import DealerSet, NetworkPath

__all__ = ["WeightVersion", "WeightSubscriber", "WeightVersionGoneError", "TransferSink"]

log = logging.getLogger(__name__)

_MIN_CHUNK_BYTES = 4096


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
        path: str | None = None,
        streams: int | None = None,
        pinned_budget_bytes: int | None = None,
        copy_threads: int | None = None,
        reserve_bytes: int | None = None,
        stage_device: str | None = None,
        bulk: bool | None = None,
    ) -> None:
        # unset: from the environment (ROLLPOOL_WEIGHT_PATH, ..._STREAMS, ROLLPOOL_PINNED_BUDGET_BYTES,
        # ROLLPOOL_WEIGHT_RESERVE_BYTES), so a worker whose config predates these fields can still be told
        path = path or os.environ.get("ROLLPOOL_WEIGHT_PATH") or "auto"
        pinned_budget_bytes = pinned_budget_bytes if pinned_budget_bytes is not None else _env_int("ROLLPOOL_PINNED_BUDGET_BYTES")
        reserve_bytes = reserve_bytes if reserve_bytes is not None else _env_int("ROLLPOOL_WEIGHT_RESERVE_BYTES")
        if path not in WEIGHT_PATHS:
            raise ValueError(f"path must be one of {WEIGHT_PATHS}, got {path!r}")
        streams = weight_streams(streams)
        if fetch_timeout_s <= 0:
            raise ValueError(f"fetch_timeout_s must be > 0, got {fetch_timeout_s}")
        if not 1 <= window_chunks <= 1024:
            raise ValueError(f"window_chunks must be in [1, 1024], got {window_chunks}")
        if max_refetch < 0:
            raise ValueError(f"max_refetch must be >= 0, got {max_refetch}")
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
        self.copy_threads = copy_threads or default_copy_threads()
        self.host_key = host_key()
        self.router_endpoint: str | None = None
        self.pub_endpoint: str | None = None
        self.bulk = bulk_enabled() if bulk is None else bulk
        """Take a server's bulk lane on the network path when its manifest names one (`rollpool.weights.paths.bulk`;
        unset: ``ROLLPOOL_WEIGHT_BULK``, default on)."""
        self.config = WeightPathConfig(weight_path=path, weight_streams=streams, pinned_budget_bytes=pinned_budget_bytes,
                                       weight_bulk=self.bulk)
        """The knobs the path plan reads (`rollpool.weights.manifest.plan`)."""
        self.counters = FetchCounters()
        """Bytes per path and refetches (`bytes_received`, `shm_bytes`, ... read them)."""
        self._prefix = uuid.uuid4().hex[:8]
        peer = f"{self.worker_id}/{self._prefix}"[:250]
        self.dealers = DealerSet(sockets, peer)
        """The DEALER sockets (one per stream) and the request router over them."""
        self.ctx = FetchContext(worker_id=self.worker_id, metrics=self.metrics, manifests=self, counters=self.counters,
                                fetch_timeout_s=fetch_timeout_s, window_chunks=window_chunks, max_refetch=max_refetch,
                                streams=streams, copy_threads=self.copy_threads)
        self._network = NetworkPath(self.ctx, self.dealers)
        self._bulk = BulkPath(self.ctx, peer.encode(), lambda: self.router_endpoint)
        self._protocol_errors = 0
        self._ipc = _Own(CUDA_IPC, False, lambda job: self._fetch_ipc(job.manifest, job.on_bucket))
        self._shm_device = _Own(SHM_DEVICE, False, lambda job: self._fetch_shm_device(job.manifest, job.on_bucket))
        self._shm = _Own(SHM, True, self._fetch_shm_job)
        self.fallbacks: dict[str, int] = {}
        """Versions fetched over the network although `path` allowed shared memory, by reason."""
        self.last_path = ""
        """The path of the last completed fetch: ``cuda_ipc``, ``shm`` or ``network``."""
        self._gpus: dict[str, int] | None = None
        self.stage_device: str | None = stage_device if stage_device and stage_device.startswith("cuda") and torch.cuda.is_available() else None
        """The device the engine loads from (its ``cuda`` device, set by the worker when its engine stages to CUDA): on
        the shared-memory path each bucket is copied from the publisher's segment straight to it and verified there
        (`BucketInfo.host_mix64`, on the GPU). None: the CPU shared-memory path (copy + CPU checksum)."""
        self.device_ops: Callable[[str, DeviceSlabs], Any] = CudaStaging
        """Makes the staging edge for `stage_device` (tests put a fake device here, named so)."""
        self._ops: Any = None
        self._ipc_open: dict[tuple[bytes, int], torch.Tensor] = {}
        """The publisher's arenas opened here (kept across versions: the publisher reuses them)."""
        self._dev_slabs = DeviceSlabs()
        self._latest = -1
        self._hint = -1
        self._forgets = 0
        """Bumped by `forget_newer` (a waiting `wait_for_newer` returns to let its caller look again)."""
        self._changed = asyncio.Event()
        self._sub: Any = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._catch_up: asyncio.Task[None] | None = None
        self._errlog = RateLimitedLog(log)
        self._pool = BufferPool(kind="host", pin=self.pin_memory, pinned_budget_bytes=pinned_budget_bytes)
        self._reserved_versions = 0
        self._copy_exec: ThreadPoolExecutor | None = None
        self._verify_exec: ThreadPoolExecutor | None = None
        """One thread that waits for staged buckets' digests, in the order they were queued (`_fetch_shm_device`)."""
        self._readers: dict[str, ShmReader] = {}
        self._readers_lock = threading.RLock()
        """`_readers` is also filled by the registering thread (`_register_ahead`)."""
        self.segment_maps = 0
        """Segments mapped so far (a warm subscriber maps none per version: the publisher reuses its segments)."""
        self._ahead: tuple[tuple[str, int], ...] = ()
        """The publisher's segments last named (`Manifest.shm_reserved`) and handed to the registering thread."""
        self._ahead_thread: threading.Thread | None = None
        self._shm_generation = 0
        self.segments_registered_ahead = 0
        """Segments mapped (and page-locked, on a device that registers) by the registering thread before a version used them."""
        self._reserving: threading.Thread | None = None
        self._warned_reserve = False
        if reserve_bytes:
            self.reserve_in_background(reserve_bytes)

    # -- connection

    def connect(self, router_endpoint: str, pub_endpoint: str | None = None) -> None:
        """Connect (or reconnect to new endpoints) and ask for the latest version. Needs a running loop."""
        if (router_endpoint, pub_endpoint) == (self.router_endpoint, self.pub_endpoint) and self.dealers.connected:
            return
        self._close_sockets()
        self.router_endpoint, self.pub_endpoint = router_endpoint, pub_endpoint
        self.dealers.open(router_endpoint, self.streams)
        if pub_endpoint:
            self._sub = self.sockets.sub(pub_endpoint)
            self._spawn(self._announce_loop(self._sub), "_announce_loop")
        self._ask_latest()

    @property
    def connected(self) -> bool:
        return self.dealers.connected

    # counters, by path (the worker reports them)

    @property
    def bytes_received(self) -> int:
        """Bucket bytes received on the network path (over ZeroMQ or the bulk lane)."""
        return self.counters.bytes_received

    @property
    def bulk_bytes(self) -> int:
        """Of `bytes_received`, those received over the bulk lane."""
        return self.counters.bulk_bytes

    @property
    def shm_bytes(self) -> int:
        """Bucket bytes copied from a publisher's shared-memory segments."""
        return self.counters.shm_bytes

    @property
    def device_stage_bytes(self) -> int:
        """Bucket bytes copied from shared memory straight to `stage_device` and verified there."""
        return self.counters.device_stage_bytes

    @property
    def ipc_bytes(self) -> int:
        """Bucket bytes copied device-to-device from a publisher's exported GPU buffer (the same-GPU path)."""
        return self.counters.ipc_bytes

    @property
    def buckets_refetched(self) -> int:
        return self.counters.buckets_refetched

    @property
    def protocol_errors(self) -> int:
        return self._protocol_errors + self.dealers.protocol_errors

    def close(self) -> None:
        self._close_sockets()
        self._pool.close()
        self._ahead = ()  # a registering thread stops at its next segment
        with self._readers_lock:
            for r in self._readers.values():
                r.close()
            self._readers = {}
        self._ipc_open = {}  # the publisher's arenas unmapped (torch closes a handle with its last tensor)
        self._dev_slabs.trim(0)
        if self._copy_exec is not None:
            self._copy_exec.shutdown(wait=False, cancel_futures=True)
            self._copy_exec = None
        if self._verify_exec is not None:
            self._verify_exec.shutdown(wait=False, cancel_futures=True)
            self._verify_exec = None

    async def aclose(self) -> None:
        tasks = [*self._tasks, *self.dealers.tasks]
        self.close()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    async def __aenter__(self) -> WeightSubscriber:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _close_sockets(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        self._tasks.clear()
        self._catch_up = None
        self.dealers.close()
        if self._sub is not None:
            self._sub.close(linger=0)
        self._sub = None

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro, name=f"WeightSubscriber.{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- what is known

    def latest_known(self) -> int:
        """The newest version the publisher is known to hold (-1: none yet)."""
        return self._latest

    def note_version(self, version: int) -> None:
        """A broker heartbeat (or welcome) names `version`: ask the publisher for its latest if it is new to us."""
        if version > self._latest:
            self._hint = max(self._hint, version)
            self._ask_latest()

    def forget_newer(self, version: int) -> None:
        """The pool was rebased to `version`: versions known above it are of an abandoned run. Forgotten, and the
        publisher asked for its latest again (a restarted publisher may start lower); a waiting `wait_for_newer`
        returns what is known now so its caller can look again."""
        if self._latest > version or version < -1:
            self._latest = -1
            self._hint = -1
            self._forgets += 1
            self._changed.set()
            self._ask_latest()

    async def wait_for_newer(self, than: int, timeout_s: float | None = None) -> int:
        """Wait until a version newer than `than` is known; return it. `WeightSyncError` after `timeout_s`.
        Returns early (maybe not newer) when `forget_newer` forgot versions meanwhile."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        forgets = self._forgets
        while self._latest <= than and self._forgets == forgets:
            self._changed.clear()
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                raise WeightSyncError(f"no weight version newer than {than} within {timeout_s} s")
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                continue
        return self._latest

    def _observe(self, version: int) -> None:
        if version > self._latest:
            self._latest = version
            self._changed.set()

    def _ask_latest(self) -> None:
        if not self.dealers.connected or (self._catch_up is not None and not self._catch_up.done()):
            return
        self._catch_up = self._spawn(self._catch_up_once(), "_catch_up")

    async def _catch_up_once(self) -> None:
        try:
            await self.fetch_manifest(None, attempts=1)
        except WeightSyncError as exc:
            self._errlog.warning("latest", "asking %s for the latest weight version failed: %s", self.router_endpoint, exc)

    # -- loops

    async def _announce_loop(self, sub: Any) -> None:
        while True:
            frames = await sub.recv_multipart()
            try:
                msg = decode(frames)
            except ProtocolError as exc:
                self._protocol_errors += 1
                self._errlog.warning("sub", "malformed announcement from %s: %s", self.pub_endpoint, exc)
                continue
            if isinstance(msg, Announce):
                self._observe(msg.version)
                if msg.shm_generation != self._shm_generation and self._registers_ahead():
                    # the publisher's segments changed (a reserve, a new layout): the manifest names them
                    self._shm_generation = msg.shm_generation
                    self._ask_latest()

    def gpu_uuids(self) -> dict[str, int]:
        """The GPUs this process sees by UUID (the same-GPU path's hello); empty on ``network``/``shm`` or without CUDA."""
        if self._gpus is None:
            from rollpool.weights.cuda_ipc import device_uuids

            self._gpus = device_uuids() if self.path in ("auto", "cuda_ipc") else {}
            if self._gpus:
                # the first same-GPU version should not pay the checksum kernels' first load: warmed in a thread now
                threading.Thread(target=_warm_current_device, name="weights-ipc-warm", daemon=True).start()
        return self._gpus

    async def fetch_manifest(self, version: int | None = None, *, attempts: int | None = None, streamed: bool = True,
                             wait_ipc: bool = False) -> Manifest:
        """The manifest of `version` (None: the latest). Retries a silent publisher up to `max_refetch` times.

        `streamed`: accept pending checksums (``""``, each following on its
        bucket's chunks); False waits for a manifest whose checksums all exist.
        """
        tries = (self.max_refetch + 1) if attempts is None else attempts
        gpus = tuple(self.gpu_uuids())
        for _attempt in range(tries):
            try:
                reply = await self.dealers.request(lambda rid: ManifestRequest(request_id=rid, version=version, streamed=streamed,
                                                                               host_key=self.host_key, gpu_uuids=gpus, wait_ipc=wait_ipc),
                                                   self.fetch_timeout_s)
            except TimeoutError:
                continue
            if isinstance(reply, Manifest):
                if reply.version >= 0:
                    self._observe(reply.version)
                self._register_ahead(reply)
                return reply
            if isinstance(reply, Error):
                if reply.code == "gone":
                    raise WeightVersionGoneError(-1 if version is None else version, reply.message)
                raise WeightSyncError(f"publisher refused the manifest request: {reply.code}: {reply.message}")
            raise WeightSyncError(f"publisher answered a manifest request with {type(reply).__name__}")
        what = "latest" if version is None else str(version)
        raise WeightSyncError(f"no manifest ({what}) from {self.router_endpoint} within {tries} x {self.fetch_timeout_s} s")

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
            manifest = check_manifest(await self.fetch_manifest(version))
            if manifest.version < 0:
                raise WeightSyncError(f"publisher {self.router_endpoint} holds no weight version yet")
            try:
                return await self._fetch_planned(manifest, on_bucket)
            except WeightVersionGoneError:
                if version is not None or moves >= self.max_refetch:
                    raise
                moves += 1
                log.info("weight version %d was evicted while being fetched; moving to the latest", manifest.version)

    async def _fetch_planned(self, manifest: Manifest, on_bucket: BucketCallback | None) -> WeightVersion:
        """Walk the plan: each path to try is tried; each reason to pass one over is reported when the walk reaches it."""
        steps = plan(manifest, self.facts(), self.config)
        if steps.refusal:
            raise WeightSyncError(steps.refusal)
        job = FetchJob(manifest, on_bucket)
        try:
            return self._fetched(await self._walk(steps, job))
        except BaseException:
            if job.slab is not None:
                self._pool.give([job.slab])
            raise

    async def _walk(self, steps: Plan, job: FetchJob) -> Fetched:
        """The first path of `steps` that serves `job`; a fallback is reported and the walk goes on."""
        for step in steps.steps:
            if step.why_not:
                if step.counted:
                    self._fallback(job.manifest.version, step.why_not, path=step.path)
                continue
            path = self._path(step.path)
            if path.host_buffers and job.buffers is None:
                await self._reserved()  # the device paths need no host buffer: they do not wait for the reserve
                job.slab, job.buffers = self._buffers_for(job.manifest)
            try:
                return await path.fetch(job)
            except PathFallbackError as exc:
                self._fallback(job.manifest.version, exc.reason, path=step.path)
                if exc.resume is not None:
                    job.manifest, job.skip = exc.resume
        raise WeightSyncError(f"weight version {job.manifest.version}: no path left to fetch it")  # (network is always last)

    def _path(self, name: str) -> FetchPath:
        paths: dict[str, FetchPath] = {CUDA_IPC: self._ipc, SHM_DEVICE: self._shm_device, SHM: self._shm, BULK: self._bulk,
                                       NETWORK: self._network}
        return paths[name]

    def _fetched(self, got: Fetched) -> WeightVersion:
        """The one tail of every fetch: the path noted, the ``weights fetched`` log line and event, the version."""
        manifest, path, details = got.manifest, got.path, got.details
        self.last_path = path
        nbytes = sum(b.nbytes for b in manifest.buckets)
        c = self.counters
        log.info("weights fetched %s", json.dumps({"version": manifest.version, "path": path, **details, "bytes": nbytes,
                                                   "bytes_received": c.bytes_received, "bulk_bytes": c.bulk_bytes,
                                                   "shm_bytes": c.shm_bytes, "device_stage_bytes": c.device_stage_bytes,
                                                   "ipc_bytes": c.ipc_bytes, "fallbacks": sum(self.fallbacks.values()),
                                                   "at": time.time()}))
        event = {"worker_id": self.worker_id, "version": manifest.version, "bytes": nbytes, "path": path}
        if "staged_to" in details:
            event["staged_to"] = details["staged_to"]
        self.metrics.event("version_fetched", event)
        tensors = unpack_buckets(zip(manifest.buckets, got.buffers, strict=True))
        return WeightVersion(version=manifest.version, tensors=tensors, manifest=manifest, buffers=tuple(got.buffers), slab=got.slab)

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
        """
        if versions < 1:
            raise ValueError(f"versions must be >= 1, got {versions}")
        if total_bytes is None:
            if named_shapes is None:
                raise ValueError("reserve needs named_shapes or total_bytes")
            from rollpool.weights.publisher import layout_of

            total_bytes = sum(n for _name, _dtype, _shape, n in layout_of(named_shapes))
        t0 = time.perf_counter()
        if self.stage_device is not None:
            # the device buffers the staged shm path (and the same-GPU path) copies into: allocated now, not by the first
            # version (first: it is quick, and those paths do not wait for the host buffers below)
            self.reserve_device(total_bytes, self.stage_device, versions)
        # free buffers that already fit a version count (a second reserve, e.g. ROLLPOOL_WEIGHT_RESERVE_BYTES and then
        # the worker's own at engine start, tops up instead of doubling the page-locked memory)
        have = sum(1 for n in self._pool.free_sizes() if n >= total_bytes)
        self._pool.reserve([total_bytes] * max(0, versions - have))
        self._reserved_versions = max(self._reserved_versions, versions)
        log.info("weights reserved %s", json.dumps({"bytes": total_bytes * versions, "pinned_bytes": self._pool.pinned_bytes,
                                                    "device": str(self.stage_device), "seconds": round(time.perf_counter() - t0, 3),
                                                    "at": time.time()}))
        return total_bytes * versions

    def reserve_in_background(self, total_bytes: int, versions: int = 2) -> None:
        """`reserve` in a thread (page-locking 2 x 14.5 GB takes seconds; the event loop and its heartbeats go on);
        the next fetch waits for it to finish before it takes a buffer."""
        if self._reserving is not None:
            self._reserving.join()
        self._reserving = threading.Thread(target=self.reserve, kwargs={"total_bytes": total_bytes, "versions": versions},
                                           name="weights-reserve", daemon=True)
        self._reserving.start()

    async def _reserved(self) -> None:
        if self._reserving is not None:
            await asyncio.to_thread(self._reserving.join)
            self._reserving = None

    @property
    def buffers_allocated(self) -> int:
        """Host buffers made fresh so far (reserved ones included; a warm subscriber makes none per version)."""
        return self._pool.allocations

    @property
    def pinned_bytes(self) -> int:
        return self._pool.pinned_bytes

    @property
    def pinned_budget_bytes(self) -> int | None:
        """The most page-locked bucket memory this subscriber allocates (None: no bound)."""
        return self._pool.pinned_budget_bytes

    def reserve_device(self, total_bytes: int, device: str | torch.device, versions: int = 2) -> int:
        """Allocate the same-GPU path's device buffers for `versions` versions now (else the first such fetch does)."""
        # room for every bucket's alignment padding too (ARENA_ALIGN each; 1 MiB covers 4096 buckets)
        slabs = [self._dev_slabs.take_at_least(arena_offsets([total_bytes])[1] + (1 << 20), device) for _ in range(versions)]
        for s in slabs:
            self._dev_slabs.give(s)
        return sum(int(s.numel()) for s in slabs)

    def recycle(self, old: WeightVersion) -> None:
        """Hand back a version the caller no longer uses (its tensors were copied into the engine).

        The next fetch reuses its buffer (one per version; a version's buckets
        are views of it), which spares the page faults of fresh memory: about 5x
        the cost of the copy itself on first touch. The caller must not use
        `old`'s tensors afterwards.
        """
        if old.slab is not None and old.slab.is_cuda:
            self._dev_slabs.give(old.slab)
            self._dev_slabs.trim(max(self._reserved_versions, 2))
        elif old.slab is not None:
            self._recycle_buffers([old.slab])
        else:
            self._recycle_buffers(list(old.buffers))

    def _recycle_buffers(self, buffers: list[torch.Tensor]) -> None:
        self._pool.give(buffers)
        self._pool.trim(max(self._reserved_versions, 1) * max((int(b.numel()) for b in buffers), default=0))

    def _buffers_for(self, manifest: Manifest) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(one buffer of the version's total size, the bucket views carved from it in order)."""
        total = sum(b.nbytes for b in manifest.buckets)
        free = self._pool.free_sizes()
        if self._reserved_versions and free and max(free) < total and not self._warned_reserve:
            self._warned_reserve = True
            log.warning("weight version %d takes %d bytes, more than the %d reserved per version: fresh buffers are "
                        "allocated (and the reserved ones dropped when unused)", manifest.version, total, max(free))
        slab = self._pool.take_at_least(total)
        views: list[torch.Tensor] = []
        pos = 0
        for b in manifest.buckets:
            views.append(slab[pos : pos + b.nbytes])
            pos += b.nbytes
        return slab, views

    def _buffer(self, nbytes: int) -> torch.Tensor:
        return self._pool.take(nbytes)

    # -- the same-GPU path (CUDA IPC)

    def _open_ipc(self, info: CudaIpcBuffer, device_index: int) -> torch.Tensor:
        from rollpool.weights.cuda_ipc import open_buffer

        key = (info.handle, info.storage_offset)
        t = self._ipc_open.get(key)
        if t is None:
            try:
                t = open_buffer(info, device_index)
            except Exception as exc:
                raise PathFallbackError(f"cannot open the publisher's GPU buffer ({type(exc).__name__}: {exc})") from exc
            self._ipc_open[key] = t
            while len(self._ipc_open) > 4:  # the publisher keeps K arenas; older ones were freed
                self._ipc_open.pop(next(iter(self._ipc_open)))
        return t

    async def _fetch_ipc(self, manifest: Manifest, on_bucket: BucketCallback | None) -> Fetched:
        """Copy each bucket device-to-device out of the publisher's buffer into our own, and verify the GPU checksum
        of our copy (the bytes the engine loads). A bad bucket is copied again after the manifest is asked for again
        (a version evicted meanwhile answers ``gone``), at most `max_refetch` times; the version is never returned in part."""
        if not all(b.ipc_checksum for b in manifest.buckets):
            manifest = check_manifest(await self.fetch_manifest(manifest.version, wait_ipc=True))
        ipc = manifest.cuda_ipc
        if ipc is None:
            raise PathFallbackError("the publisher withdrew the device buffer")
        index = self.gpu_uuids()[ipc.device_uuid]
        src = self._open_ipc(ipc, index)
        sizes = [b.nbytes for b in manifest.buckets]
        offsets, total = arena_offsets(sizes)
        slab = self._dev_slabs.take_at_least(total, f"cuda:{index}")
        buffers = [slab[o : o + n] for o, n in zip(offsets, sizes, strict=True)]
        failures = [0] * len(sizes)
        todo = list(range(len(sizes)))
        try:
            while todo:
                bad = await asyncio.to_thread(_copy_ipc, src, manifest, buffers, todo)
                for i in todo:
                    if i not in bad:
                        self.counters.ipc_bytes += sizes[i]
                        if on_bucket is not None:
                            on_bucket(i, unpack_bucket(manifest.buckets[i], buffers[i]))
                for i in bad:
                    self.ctx.bucket_failed(manifest.version, i, failures, "cuda_ipc", "from the GPU buffer", "CUDA IPC")
                if bad:
                    await self.fetch_manifest(manifest.version, wait_ipc=True)  # still served? (gone: the caller moves on)
                todo = bad
        except BaseException:
            self._dev_slabs.give(slab)
            raise
        return Fetched(manifest, buffers, slab, CUDA_IPC)

    # -- the shared-memory path

    def _fallback(self, version: int, why: str, *, path: str = "shm") -> None:
        """A same-host path (`path`) could not serve `version`: the next one down is taken (counted, logged)."""
        self.fallbacks[why] = self.fallbacks.get(why, 0) + 1
        nxt = {"cuda_ipc": "shared memory or the network", "shm_device": "shared memory copied on the CPU", "bulk": "the ROUTER"}.get(path, "the network path")
        self._errlog.warning("fallback:" + why, "weight version %d not on %s, over %s: %s (counted in fallbacks)", version, path, nxt, why)
        self.metrics.event("weights_fallback", {"worker_id": self.worker_id, "version": version, "reason": why, "from": path})
        if self.path == "shm" and path == "shm":
            raise WeightSyncError(f"weight path 'shm': {why}")

    async def _fetch_shm_job(self, job: FetchJob) -> Fetched:
        assert job.buffers is not None
        return Fetched(await self._fetch_shm(job.manifest, job.buffers, job.on_bucket), job.buffers, job.slab, SHM)

    async def _fetch_shm(self, manifest: Manifest, buffers: list[torch.Tensor], on_bucket: BucketCallback | None) -> Manifest:
        """Copy each bucket out of the publisher's segment into our buffer, checksumming our copy (what the engine loads).

        Returns the manifest with every checksum."""
        if not all(b.checksum for b in manifest.buckets):
            # a streamed publish still checksumming: wait for the manifest with every checksum (small, on the socket)
            manifest = check_manifest(await self.fetch_manifest(manifest.version, streamed=False))
        readers: list[ShmReader] = []
        try:
            for b in manifest.buckets:
                try:
                    readers.append(self._reader(b.shm_segment, b.nbytes))
                except ShmUnavailableError as exc:
                    raise PathFallbackError(f"cannot map the publisher's segment ({exc})") from exc
            loop = asyncio.get_running_loop()
            if self._copy_exec is None:
                self._copy_exec = ThreadPoolExecutor(self.copy_threads, thread_name_prefix="weights-shm")
            exec_ = self._copy_exec
            failures = [0] * len(readers)

            async def one(i: int) -> None:
                info = manifest.buckets[i]
                while True:
                    outcome = await loop.run_in_executor(exec_, _copy_verified, readers[i], manifest.version, info.checksum, buffers[i])
                    if outcome == "torn":
                        raise PathFallbackError(f"bucket {i}: the publisher reused its segment while it was read (version {manifest.version} evicted)")
                    if outcome == "ok":
                        self.counters.shm_bytes += info.nbytes
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
            self._drop_dead_readers()
        return manifest

    # -- the shared-memory path staged to the engine's GPU

    def _staging(self) -> Any:
        assert self.stage_device is not None
        with self._readers_lock:  # made once, by the loop or the registering thread
            if self._ops is None:
                self._ops = self.device_ops(self.stage_device, self._dev_slabs)
            return self._ops

    async def _fetch_shm_device(self, manifest: Manifest, on_bucket: BucketCallback | None) -> Fetched:
        """Copy each bucket host-to-device from the publisher's segment (registered here once, when first mapped) into a
        device buffer and verify the mix64 of the device copy (the bytes the engine loads) on the GPU against the
        publisher's `host_mix64`. Buckets are staged as their mix64 appears in the manifest (asked for again every few
        ms while some are pending), so the copies overlap the publisher's snapshot. A bad bucket is copied again (at
        most `max_refetch` times), then the version is refused whole; a torn read, a publisher that gives no GPU
        checksums, or a segment that cannot be mapped is a `PathFallbackError` (the CPU paths serve the version)."""
        ops = self._staging()
        loop = asyncio.get_running_loop()
        timeline = _Timeline(loop.time(), len(manifest.buckets))
        try:
            readers = await asyncio.to_thread(lambda: [self._reader(b.shm_segment, b.nbytes, True) for b in manifest.buckets])
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
        deadline = loop.time() + self.fetch_timeout_s
        try:
            while len(done) < len(sizes):
                ready = [i for i, b in enumerate(manifest.buckets) if b.host_mix64 and i not in done and i not in verifying]
                if ready:
                    timeline.seen(ready, loop.time())
                    queued = await asyncio.to_thread(_stage_queue, ops, readers, manifest.version, ready, buffers)
                    timeline.queued(ready, loop.time())
                    for i, state, handle in queued:
                        verifying[i] = loop.run_in_executor(self._verifier(), timeline.digested, i, _stage_outcome, ops, readers[i],
                                                            state, handle, manifest.buckets[i].host_mix64)
                for i in sorted(i for i, f in verifying.items() if f.done()):
                    timeline.verified(i, loop.time())
                    if self._staged_bucket(manifest, i, verifying.pop(i).result(), buffers[i], failures, on_bucket):
                        done.add(i)
                    timeline.handed_s += loop.time() - timeline.t0 - timeline.verified_ms[i] / 1000
                if len(done) < len(sizes):
                    t_poll = loop.time()
                    manifest = await self._next_mix64(manifest, done, verifying, deadline)
                    timeline.waited(t_poll, loop.time())
        except BaseException:
            if verifying:  # copies still queued into the slab: it goes back once they are done
                asyncio.gather(*verifying.values(), return_exceptions=True).add_done_callback(lambda _f: ops.give(slab))
            else:
                ops.give(slab)
            raise
        finally:
            self._drop_dead_readers()  # unlinked segments (keep the live ones mapped)
        with self._readers_lock:
            registered = sum(1 for r in self._readers.values() if r.registered)
        return Fetched(manifest, buffers, slab, SHM, {"staged_to": str(self.stage_device), "segments_mapped": len(self._readers),
                                                      "segment_maps": self.segment_maps, "segments_registered": registered,
                                                      "segments_registered_ahead": self.segments_registered_ahead,
                                                      "timeline": timeline.as_dict(loop.time())})

    async def _next_mix64(self, manifest: Manifest, done: set[int], verifying: dict[int, asyncio.Future[str]], deadline: float) -> Manifest:
        """`_fetch_shm_device` has nothing to queue: wait for the next verdict where every bucket left is queued (a bad
        one is queued again after it), else ask for the manifest again after a few ms (more buckets' GPU checksums)."""
        if not any(not b.host_mix64 for i, b in enumerate(manifest.buckets) if i not in done and i not in verifying):
            if verifying:
                await asyncio.wait(list(verifying.values()), return_when=asyncio.FIRST_COMPLETED)
            return manifest
        if all(b.checksum for b in manifest.buckets) and not any(b.host_mix64 for b in manifest.buckets):
            raise PathFallbackError("the publisher gives no GPU checksum (host_mix64) for this version")
        if asyncio.get_running_loop().time() > deadline:
            raise PathFallbackError(f"the publisher's GPU checksums did not come within {self.fetch_timeout_s} s")
        await asyncio.sleep(_MIX64_POLL_S)
        again = check_manifest(await self.fetch_manifest(manifest.version))
        if [(b.nbytes, b.shm_segment) for b in again.buckets] != [(b.nbytes, b.shm_segment) for b in manifest.buckets]:
            raise PathFallbackError("the publisher's segments changed under the fetch")
        return again

    def _verifier(self) -> ThreadPoolExecutor:
        if self._verify_exec is None:
            self._verify_exec = ThreadPoolExecutor(1, thread_name_prefix="weights-verify")
        return self._verify_exec

    def _staged_bucket(self, manifest: Manifest, i: int, outcome: str, buffer: torch.Tensor, failures: list[int],
                       on_bucket: BucketCallback | None) -> bool:
        """One bucket's staging outcome: True when verified (handed to `on_bucket`); a bad one is counted (and refused
        after `max_refetch` copies), a torn read falls back."""
        if outcome == "torn":
            raise PathFallbackError(f"bucket {i}: the publisher reused its segment while it was read (version {manifest.version} evicted)")
        info = manifest.buckets[i]
        if outcome == "ok":
            self.counters.shm_bytes += info.nbytes
            self.counters.device_stage_bytes += info.nbytes
            if on_bucket is not None:
                on_bucket(i, unpack_bucket(info, buffer))
            return True
        self.ctx.bucket_failed(manifest.version, i, failures, "shm_device", "staged from shared memory", "shared memory staged to the GPU")
        return False

    def _reader(self, name: str, nbytes: int, register: bool = False) -> ShmReader:
        with self._readers_lock:
            r = self._readers.get(name)
            if r is not None and r.nbytes == nbytes and r.alive():
                if register and not r.registered:
                    self._register(r)
                return self._readers[name]
            if r is not None:
                self._readers.pop(name).close()
            r = self._readers[name] = ShmReader(name, nbytes)
            self.segment_maps += 1
            if register:
                self._register(r)
            return self._readers[name]

    def _drop_dead_readers(self) -> None:
        with self._readers_lock:
            for name in [n for n, r in self._readers.items() if not r.alive()]:
                self._readers.pop(name).close()

    # -- registering the publisher's segments ahead of use (minor 11)

    def _registers_ahead(self) -> bool:
        return self.stage_device is not None and self.path in ("auto", "shm")

    def _register_ahead(self, manifest: Manifest) -> None:
        """A manifest named the publisher's segments (`Manifest.shm_reserved`): a subscriber that stages from shared
        memory to its GPU maps and page-locks them now, in a thread (page-locking runs at about 2.5 GB/s: 2 x 14.5 GB
        would cost the first version 12 s), so no version pays it and the event loop and generation go on."""
        if not self._registers_ahead() or (manifest.shm_reserved and manifest.host_key != self.host_key):
            return
        want = tuple((seg.name, seg.nbytes) for seg in manifest.shm_reserved)
        if want == self._ahead:
            return  # (an empty list the first time: a publisher of minor 10, or one without segments)
        self._ahead = want
        self._ahead_thread = threading.Thread(target=self._register_segments, args=(want,), name="weights-register", daemon=True)
        self._ahead_thread.start()

    def _register_segments(self, want: tuple[tuple[str, int], ...]) -> None:
        """Registering thread: map and page-lock each named segment not mapped yet (a newer list supersedes this one)."""
        t0 = time.perf_counter()
        made = nbytes = 0
        registers = self._staging().registers
        for name, n in want:
            if self._ahead != want:
                return  # superseded by a newer list, or closed
            with self._readers_lock:
                known = self._readers.get(name)
                if known is not None and known.nbytes == n and (known.registered or not registers) and known.alive():
                    continue
            try:
                self._reader(name, n, True)
            except ShmUnavailableError as exc:
                log.debug("segment %s not mapped ahead: %s", name, exc)
                continue
            made += 1
            nbytes += n
            self.segments_registered_ahead += 1
        self._drop_dead_readers()
        if made:
            self._warm_staging([name for name, _n in want])
        with self._readers_lock:
            registered = sum(1 for r in self._readers.values() if r.registered)
        log.info("weight segments registered %s", json.dumps({"segments": len(want), "mapped_now": made, "bytes_now": nbytes,
                                                              "registered": registered, "seconds": round(time.perf_counter() - t0, 3),
                                                              "at": time.time()}))

    def _warm_staging(self, names: list[str]) -> None:
        """Registering thread: one staged copy and checksum from every named segment (64 KiB each, and one full mix64
        slice) into a scratch buffer, so the first version does not pay the staging's first kernels, index tensors and
        first copies out of each freshly registered segment (version 1 of the shm row took 0.45 s to fetch against 0.33
        s warm, 2026-12-04). Best effort: a failure is logged at debug level and the fetch pays it instead."""
        try:
            ops = self._staging()
            with self._readers_lock:
                readers = [r for r in (self._readers.get(n) for n in names) if r is not None and r.nbytes]
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
        ops = self._staging()
        if not ops.registers:
            return
        if r.register():
            return
        # this CUDA cannot register a read-only mapping: map it again read-write (never written here) and register that
        rw = ShmReader(r.name, r.nbytes, writable=True)
        if rw.register():
            self._readers[r.name] = rw
            r.close()
            return
        rw.close()
        self._errlog.warning("register", "weight segment %s could not be page-locked here; copies to the GPU run from pageable memory", r.name)

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


class _Own:
    """A path still written as a method of the subscriber."""

    def __init__(self, name: str, host_buffers: bool, fn: Callable[[FetchJob], Awaitable[Fetched]]) -> None:
        self.name, self.host_buffers, self._fn = name, host_buffers, fn

    async def fetch(self, job: FetchJob) -> Fetched:
        return await self._fn(job)


def _warm_current_device() -> None:
    from rollpool.weights.cuda_ipc import warm_up

    try:
        warm_up(torch.device("cuda", torch.cuda.current_device()))
    except Exception:
        log.debug("warming the same-GPU path up failed", exc_info=True)


def _copy_ipc(src: torch.Tensor, manifest: Manifest, buffers: list[torch.Tensor], which: list[int]) -> list[int]:
    """Worker thread: copy buckets `which` device-to-device from the publisher's buffer and checksum each copy on the
    GPU (on a side stream of this thread); the buckets whose checksum differs."""
    from rollpool.weights.cuda_ipc import side_stream

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
        """Each `_next_mix64` (a verdict awaited, or a manifest poll): when it began and how long it took."""
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
_MIX64_POLL_S = 0.002
"""How often the manifest is asked for again while some buckets' GPU checksums are pending."""


class CudaStaging:
    """The staging edge of the shared-memory path on CUDA: host-to-device copies on one stream, the mix64 of each copy
    on another (waiting on the copy's event), device buffers from the subscriber's reused slabs."""

    registers = True

    def __init__(self, device: str, slabs: DeviceSlabs) -> None:
        from rollpool.weights.cuda_ipc import side_stream

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


def _env_int(name: str) -> int | None:
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {text!r}") from None


