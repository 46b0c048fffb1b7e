"""`WeightPublisher`: the trainer's side of the weight-publish channel, a facade over the server, the snapshot and
the same-GPU arenas.

``await publish(named_tensors, version)`` snapshots the tensors into the
publisher's own CPU buckets (`snapshot.py`: one copy per byte, done in worker
threads so the event loop keeps serving; training may change its tensors as
soon as publish returns), computes each bucket's checksum, keeps the newest
`keep_versions` versions, announces the new one on PUB and serves manifests
and chunks on ROUTER and the bulk lane (see `serving.py` for the serving
guarantees). A whole-model version published after a LoRA adapter version
names that adapter version (the newest one), which the engines keep on under
it (`Manifest.adapter_on`); that adapter version is kept served past
`keep_versions` until a newer adapter version replaces it (one adapter
version's bytes besides the K versions), so a late joiner fetches it with the
whole-model version. Not with ``keep_versions=0``: the adapter's bytes are
released like any version's, and a joiner then skips the whole-model versions
over it (docs/lora.md, "Late joiners"). The other way round, an adapter
version names the whole-model version it applies over (the newest one,
`Manifest.base_on`), kept served past `keep_versions` while it is the base
of the newest adapter version (one whole model's bytes besides the K
versions, only once adapter versions have pushed it out of them), so a late
joiner applies it before the adapter. CUDA tensors on the same-GPU path are snapshotted into a device
arena first (`paths/cuda_ipc.py`). With delta versions on and a GPU budget that holds it, CUDA tensors are compared
with the previous version kept on their GPU instead of copied (`delta_device.py`): the call returns after that diff,
and the host copy is made from the device base afterwards. Every knob is its `WeightPathConfig`.

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
On the same GPU the ring carries CUDA tensors instead, with no copy
(`paths/ipc_ring.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any, cast

import torch

from rollpool.protocol.messages import AdapterSpec, Manifest, ShmSegment
from rollpool.protocol.metrics import MetricsSink, NullMetricsSink
from rollpool.protocol.sockets import SocketFactory
from rollpool.weights import delta_device as _delta_device
from rollpool.weights import snapshot as _snapshot
from rollpool.weights.adapters import lora_pairs
from rollpool.weights.bucketing import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_CHUNK_BYTES,
    BucketPlanner,
    checksum_supported,
    default_checksum_algorithm,
)
from rollpool.weights.config import (
    WEIGHT_PATHS,
    WeightPathConfig,
    default_copy_threads,
    default_host_copy_threads,
    with_overrides,
)
from rollpool.weights.delta import DeltaSet
from rollpool.weights.gpu import warm_up_host_in_background, warm_up_in_background
from rollpool.weights.manifest import GpuBudget, gpu_budget_bytes
from rollpool.weights.memory import BufferPool, host_key, wait_released
from rollpool.weights.paths.base import Attr
from rollpool.weights.paths.cuda_ipc import IpcArenas
from rollpool.weights.serving import (
    MAX_CHUNK_BYTES,
    ServedVersion,
    ServingFace,
    WeightServer,
    first_delta_segment_bytes,
    new_server_id,
    with_digest,
)
from rollpool.weights.snapshot import (
    Place,
    PlanMemo,
    Snapshot,
    SnapshotBuffers,
    SnapshotKnobs,
    SnapshotPools,
    layout_key,
    layout_of,
    packed_version,
    plan_version,
    referenced_version,
    warm_segments,
)

__all__ = ["EARLY_FIRST_S", "WeightPublisher", "layout_of"]

EARLY_FIRST_S = 0.5
"""The longest the host copy of a device-made delta version waits for the delta to be served early first (`_finish_device`)."""

log = logging.getLogger(__name__)


class WeightPublisher(ServingFace):
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
        weights: WeightPathConfig | None = None,
    ) -> None:
        """`weights`: every weight-path knob (None: `WeightPathConfig.from_env`, read once here); `path`,
        `pinned_budget_bytes` and `copy_threads` override one of its fields each."""
        cfg = with_overrides(weights, weight_path=path, pinned_budget_bytes=pinned_budget_bytes, weight_copy_threads=copy_threads)
        path, pinned_budget_bytes = cfg.weight_path, cfg.pinned_budget_bytes
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
        self.config = cfg
        self.copy_threads = cfg.copy_threads
        self.checksum_threads = checksum_threads or default_copy_threads()
        # page-locked buckets (device-to-host copies at full speed) where CUDA is available
        self._buffers = SnapshotBuffers(pin=torch.cuda.is_available(), pinned_budget_bytes=pinned_budget_bytes,
                                        shm=path != "network" and keep_versions > 0, pool=pool, owner_id=self.publisher_id)
        # a trainer's CPU tensors are copied by threads it waits for: more of them where the host has the cores
        self.host_copy_threads = cfg.weight_copy_threads or default_host_copy_threads()
        self._pools = SnapshotPools.make(max(self.copy_threads, self.host_copy_threads), self.checksum_threads)
        self._knobs = SnapshotKnobs(publisher_id=self.publisher_id, chunk_bytes=chunk_bytes, host_key=self.host_key, pool=pool,
                                    copy_threads=self.copy_threads, checksum_algorithm=self.checksum_algorithm,
                                    host_copy_threads=self.host_copy_threads)
        self.last_phases: dict[str, float] = {}
        """The last planned publish's phases, seconds from its call: ``begun`` (buffers taken), ``announced``,
        ``issued`` (every copy handed out), ``landed`` (every copy done), ``mixed`` (the GPU mix64 reads done), ``diffed``
        (a delta made on the device: the diff and the base's update done, instead of the copy's marks), ``returned``."""
        self._finishing: dict[int, asyncio.Future[None]] = {}
        self._layout: list[tuple[str, str, tuple[int, ...], int]] | None = None
        self._plan = PlanMemo()
        """The previous dict's or module's plan (reused while the names, shapes and dtypes stay the same)."""
        self._adapter_on = -1
        """The newest adapter version published: the engines keep it on under every whole-model version published after
        it (docs/lora.md), so those name it (`Manifest.adapter_on`) and it is kept served past `keep_versions`."""
        self._base_on = -1
        """The newest whole-model version published (-1: none): every adapter version published after it applies over it
        (docs/lora.md), so those name it (`Manifest.base_on`) and it is kept served past `keep_versions` while it is the
        base of the newest adapter version."""
        self._adapter_checked: tuple[AdapterSpec, Any] | None = None
        """The spec and `layout_key` of the last adapter version checked (`lora_pairs` depends on nothing else)."""
        self._server = WeightServer(
            sockets,
            router_endpoint=router_endpoint,
            pub_endpoint=pub_endpoint,
            name="publisher",
            announce_interval_s=announce_interval_s,
            metrics=self.metrics,
            weights=cfg,
        )
        self._server.early_delta = True  # a snapshot's bucket is final once checksummed: its delta is encoded then
        if self._buffers.shm is not None:
            # deltas of versions held in shared memory are written there too, for subscribers on this host
            # (segments of their own: named apart from the snapshot's, swept and reaped alike)
            self._server.delta_segments = BufferPool(kind="shm", pool=pool, owner_id=f"{self.publisher_id}_delta")
        self._latest = -1
        self._released_manifest: ServedVersion | None = None
        self._lock = asyncio.Lock()
        self.gpu_budget = GpuBudget(gpu_budget_bytes(cfg, bucket_bytes))
        """The GPU memory this publisher may allocate on the trainer's GPU (`publisher_gpu_budget_bytes`, default two
        buckets), shared by its device users; `gpu_budget.free_bytes()` is what is left."""
        self._ipc = IpcArenas(self.publisher_id, self.host_key, path, self.gpu_budget)
        """The same-GPU path's arenas (`rollpool.weights.paths.cuda_ipc`)."""
        self._delta_base = _delta_device.DeviceBase(self.gpu_budget)
        """The previous version on the trainer's GPU, for deltas made there (`rollpool.weights.delta_device`)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            # a trainer already on its GPU: the checksum kernels built there now, not in its first version
            warm_up_in_background(torch.device("cuda", torch.cuda.current_device()))
        self._delta_note: dict[str, Any] = {"delta_made_on": "", "why_not_delta_on_device": ""}
        """Where the last planned version's delta is compared (`path_note`): ``device`` or ``host`` and why not the
        device ("" when delta versions are off)."""
        self._delta_broken = ""
        """Why a diff on the device failed here (then it is never tried again), or ""."""
        self._base_reader: asyncio.Future[None] | None = None
        """The host copy being made from the device base (the last device version's `_finish_device`): the next diff
        writes the base only once it is done."""
        self._base_mixer: asyncio.Future[None] | None = None
        """The mix64 of the device base's buckets being summed for an early delta (`_serve_early`): the next diff
        writes the base only once it is done."""
        self.delta_device_versions = 0
        """Versions whose delta was made on the device."""
        self._server.on_manifest_request = self._ipc.hello
        self._server.ring = self._ipc.ring  # the same-GPU ring's takers and who may see its buffer
        self._warming: threading.Thread | None = None
        """The warm-up pass over freshly reserved segments (`warm_segments`); a publish waits for it."""
        if reserve is not None:
            self.reserve(reserve)

    # -- lifecycle

    async def start(self) -> None:
        await self._server.start()
        log.info("weight publisher %s serving on %s, announcing on %s", self.publisher_id, self.router_endpoint, self.pub_endpoint)

    async def close(self) -> None:
        for fut in [*self._finishing.values(), *([self._base_mixer] if self._base_mixer is not None else [])]:
            fut.cancel()
        await self._server.close()
        self._pools.shutdown()
        self._ipc.close()
        self._delta_base.release()
        self._buffers.close()
        await asyncio.to_thread(wait_released)  # and those dropped in the background before

    @property
    def versions(self) -> list[int]:
        """Versions whose bytes are served now, oldest first."""
        return sorted(self._server.versions)

    shm_fallbacks: Attr[int] = Attr("_buffers", "Versions buffered in ordinary memory although the path asked for shared memory (no room in /dev/shm).")

    @property
    def path_note(self) -> dict[str, Any]:
        """The last planned version's offer: ``offered`` (``cuda_ipc``: a whole-version device arena besides the host
        buckets, ``cuda_ipc_ring``: the version streamed through the same-GPU ring, or ``host``), ``why_not_cuda_ipc``
        (why no arena was offered; "" when one was), ``why_not_ring`` (why no ring either) and ``last_ring`` (the last
        ring's outcome: buckets released, its taker, why it was abandoned), ``delta_made_on`` (with delta versions on:
        ``device``, the changed elements found on the trainer's GPU, or ``host``, after the full copy; "" when off) and
        ``why_not_delta_on_device`` (why the host, "" when the device), and ``delta_compared_by`` (on the device: the
        ``kernels`` of `rollpool.weights.diff_kernel` or ``torch ops (why)``; "" before the first diff there or on the host)."""
        on_device = self._delta_note.get("delta_made_on") == "device"
        return {**self._ipc.note, "last_ring": dict(self._ipc.ring.last), **self._delta_note,
                "delta_compared_by": _delta_device.compared_by(self._delta_base.device) if on_device else ""}

    @property
    def ipc_versions(self) -> int:
        """Versions offered on the same-GPU path."""
        return self._ipc.versions

    @property
    def stats(self) -> dict[str, int]:
        return {
            "latest_version": self._latest,
            **self._server.stats(),
            "shm_fallbacks": self.shm_fallbacks,
            "ipc_versions": self._ipc.versions,
            "ipc_arenas": len(self._ipc.exports),
            "ipc_ring_versions": self._ipc.ring.versions,
            "ipc_ring_abandoned": self._ipc.ring.abandoned,
            "ipc_ring_bytes": self._ipc.ring.allocated,
            "delta_device_versions": self.delta_device_versions,
            "gpu_budget_bytes": self.gpu_budget.budget,
            "gpu_budget_used_bytes": self.gpu_budget.used,
            "buffers_allocated": self._buffers.buffers_allocated,
            "pinned_bytes": self._buffers.pinned_bytes,
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
        self._layout = layout_of(named_shapes)
        total, to_warm = self._buffers.reserve(self._layout, self.bucket_bytes, max(1, self.keep_versions), self.path)
        self._sync_segments()
        if to_warm:
            self._warming = warm_segments(to_warm, after=self._warming)
        return total

    def _sync_segments(self) -> None:
        """Name every segment held now on the manifests (minor 11), so staging workers register them ahead of use."""
        segs = tuple(sorted((ShmSegment(name=b.name, nbytes=b.nbytes) for b in self._buffers.segments()), key=lambda x: x.name))
        self._server.set_shm_reserved(segs, self.host_key)

    def set_path(self, path: str) -> None:
        """Change the path for the next versions: ``network`` buffers them in ordinary memory (no segments offered),
        ``auto``/``shm`` in shared memory (where the publisher was not made with ``network``)."""
        if path not in WEIGHT_PATHS:
            raise ValueError(f"path must be one of {WEIGHT_PATHS}, got {path!r}")
        if path != "network" and self._buffers.shm is None:
            raise ValueError("this publisher was made with path='network' and has no shared-memory pool")
        if path != self.path:
            self._buffers.switch(path)
            self._sync_segments()
        self.path = self._ipc.path = path

    def manifest_of(self, version: int) -> Manifest | None:
        """The manifest of a served version as it stands (checksums still pending show ``""``)."""
        v = self._server.versions.get(version)
        return v.manifest("") if v is not None else None

    # -- publishing

    async def publish(self, named_tensors: Any, version: int, *, expected_fetchers: int | None = None, wait_ready: bool = False,
                      adapter: AdapterSpec | None = None) -> Manifest:
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

        `adapter`: the version is a LoRA adapter with this spec (`rollpool.weights.adapters`): `named_tensors` must be
        the adapter's matrices (a dict, as PEFT's ``get_peft_model_state_dict`` gives them), checked here
        (`WeightsRefusedError` naming what is wrong); the manifest carries the spec.
        """
        if adapter is not None:
            if not isinstance(named_tensors, Mapping):
                raise TypeError("an adapter version is published from a dict of its lora_A / lora_B tensors")
            checked = (adapter, layout_key(named_tensors.items()))
            if not (_snapshot._MEMO_PLAN and checked == self._adapter_checked):  # the same names and shapes: passed before
                lora_pairs(named_tensors, adapter)
                self._adapter_checked = checked
        if self._server.router_endpoint == "":
            raise RuntimeError("WeightPublisher.start() must be awaited before publish()")
        async with self._lock:
            if version <= self._latest:
                raise ValueError(f"version {version} is not newer than the latest published version {self._latest}")
            t0 = time.perf_counter()
            if adapter is not None:
                self._server.pending_adapters[version] = adapter
                if self._base_on >= 0:
                    self._server.pending_base_on[version] = self._base_on
            elif self._adapter_on >= 0:
                self._server.pending_adapter_on[version] = self._adapter_on
            try:
                manifest = await self._publish_locked(named_tensors, version, t0, expected_fetchers, wait_ready)
            finally:
                self._server.pending_adapters.pop(version, None)
                self._server.pending_adapter_on.pop(version, None)
                self._server.pending_base_on.pop(version, None)
            if adapter is not None:
                previous, self._adapter_on = self._adapter_on, version
                if previous >= 0 and self.keep_versions > 0 and previous in sorted(self._server.versions)[: -self.keep_versions]:
                    self._evict(previous)  # kept past the window while it was on; the new adapter replaces it
            else:
                previous, self._base_on = self._base_on, version
                if previous >= 0 and self.keep_versions > 0 and previous in sorted(self._server.versions)[: -self.keep_versions]:
                    self._evict(previous)  # kept past the window while adapters applied over it; this one replaces it
            return manifest

    @property
    def adapter_on(self) -> int:
        """The adapter version on under the next whole-model version (-1: none published), kept served while it is on:
        one adapter version's bytes besides the `keep_versions` versions."""
        return self._adapter_on

    @property
    def base_on(self) -> int:
        """The whole-model version the next adapter version applies over (-1: none published, the engines' model from
        disk), kept served while it is the base of the newest adapter version: one whole model's bytes besides the
        `keep_versions` versions, only once it has fallen out of them (adapter versions published after it)."""
        return self._base_on

    async def _publish_locked(self, named_tensors: Any, version: int, t0: float, expected_fetchers: int | None,
                              wait_ready: bool) -> Manifest:
        """`publish` under its lock, the adapter bookkeeping done."""
        if self.keep_versions == 0:
            return await self._publish_referenced(named_tensors, version, t0, expected_fetchers)
        if self.keep_versions >= 2:
            # evict first what this version evicts anyway (a complete newer one stays served):
            # its buffers are reused (no page faults of fresh memory) and memory peaks at K
            # versions, not K + 1. With K = 1 the old version is served until the new one is
            # ready and its buffers are kept as spares for the next publish.
            for old in sorted(self._server.versions)[: -(self.keep_versions - 1)]:
                self._evict_past_window(old)
        items, places, planner = plan_version(named_tensors, self.bucket_bytes, self._layout, self._plan)
        if places is None:  # an iterator and no reserved layout: packed as it comes, served once whole
            served = await packed_version(items, version, self.bucket_bytes, self._knobs)
            self._latest = version
            self._server.add_version(served)
            self._after_publish(served, t0, time.perf_counter())
            for old in sorted(self._server.versions)[: -self.keep_versions or None]:
                if old != version:
                    self._evict_past_window(old)
            return served.manifest("")
        return await self._publish_planned(items, places, planner, version, t0, wait_ready)

    async def _publish_referenced(self, named_tensors: Any, version: int, t0: float, expected_fetchers: int | None) -> Manifest:
        """``keep_versions=0``: the caller's tensors served until released; on the same GPU the ring alone carries them
        (no copy; held until its taker has them all)."""
        ringed, why_not_ring = await self._ipc.ring_only(named_tensors, version, self.bucket_bytes, self._knobs, self._server)
        self._ipc.note_offer(version, "host" if ringed is None else "cuda_ipc_ring", why_not_ring)
        served = ringed or await referenced_version(named_tensors, version, self.bucket_bytes, self._knobs)
        self._latest = version
        self._server.add_version(served)
        self._after_publish(served, t0, t0)
        manifest = served.manifest("")
        if not served.released:  # (a version the ring carried whole is released already)
            await self._server.serve_until_released(served, expected_fetchers, max_hold_s=self.max_hold_s,
                                                    release_idle_s=self.release_idle_s)
        return manifest

    def _spare_first_delta_segment(self, served: ServedVersion, delta: bool) -> None:
        """With deltas on (`delta`) and none written to shared memory yet, the first one's segment is made and touched
        once a version in shared memory is copied (the trainer is free then): a fresh one costs the delta's write a page
        fault per 4 KiB, 0.26-0.32 s at 8B, before it is served."""
        if delta and served.host_key and not self._server.delta_shm_written:
            self._server.spare_delta_segment(first_delta_segment_bytes(sum(b.nbytes for b in served.buckets)))

    async def _publish_planned(self, items: Any, places: list[Place], planner: BucketPlanner,
                               version: int, t0: float, wait_ready: bool) -> Manifest:
        """The streamed snapshot of a planned version (see `publish`); on the same-GPU path a device snapshot first."""
        if self._warming is not None:  # the reserved segments' warm-up pass writes them: done before a version does
            await asyncio.to_thread(self._warming.join)
            self._warming = None
        snap = self._begin(version, places, planner)
        snap.marks["begun"] = time.perf_counter()
        _warm_kernels(items)
        ipc_device = self._ipc.device_for(items)
        offered, why_not_ring, arena = "host", "", cast(Any, None)
        if ipc_device is not None:
            try:
                got = self._ipc.begin(snap.served, places, ipc_device)
            except Exception:  # noqa: BLE001 - an arena that cannot be made or exported (logged there): the host path serves
                self._ipc.release(version)
                snap.served.cuda_ipc = None
                got = None
            if got is None:  # no arena (past the GPU budget, or failed): said in why_not; the ring, where its slots fit
                offered, why_not_ring = self._ipc.offer_ring(snap.served, ipc_device)
                ipc_device = None
            else:
                offered, (arena, snap.ipc_offsets, arena_items) = "cuda_ipc", got
        self._ipc.note_offer(version, offered, why_not_ring)
        previous, self._latest = self._latest, version
        delta = ipc_device is None and self.config.weight_delta
        on_device = self._delta_device_for(version, items, snap.served.buckets, offered, delta)
        snap.mix_for_deltas(delta and (on_device is not None or _on_cuda(items)))  # a delta's result checks (minor 27)
        if delta:
            self._server.expect_delta(snap.served)  # the delta against the previous version follows
            snap.served.delta_hold = True  # each bucket's delta is encoded once the trainer is free (after the copy)
        self._server.add_version(snap.served)  # announced now; buckets are served as they become ready
        snap.marks["announced"] = time.perf_counter()
        try:
            from_base = await self._copy(snap, offered, arena, places, items, on_device is not None)
        except BaseException:
            self._server.drop_version(version, code="unavailable")
            self._latest = previous
            snap.abandon()
            self._buffers.retire(list(snap.sources))  # its buffers serve the next publish
            if ipc_device is not None:
                self._ipc.release(version)
            raise
        copied = time.perf_counter()
        snap.marks["returned"] = copied
        self._server.release_delta(version)
        self._spare_first_delta_segment(snap.served, delta)
        self.last_phases = {k: round(at - t0, 4) for k, at in sorted(snap.marks.items(), key=lambda kv: kv[1])}
        if ipc_device is not None:
            self._finishing[version] = asyncio.ensure_future(self._finish_ipc(snap, arena, arena_items, t0, copied))
        elif from_base is not None:
            self._finishing[version] = self._base_reader = asyncio.ensure_future(self._finish_device(snap, from_base, t0, copied))
        else:
            self._finishing[version] = asyncio.ensure_future(self._finish(snap, t0, copied))
        for old in sorted(self._server.versions)[: -self.keep_versions or None]:
            if old != version:
                self._evict_past_window(old)
        if wait_ready:
            await self.wait_ready(version)
        return snap.served.manifest("")

    async def _copy(self, snap: Snapshot, offered: str, arena: Any, places: list[Place], items: Any,
                    on_device: bool = False) -> list[tuple[str, torch.Tensor]] | None:
        """The snapshot's copy for the path offered (the call's blocking part: the trainer may step once it returns); with
        a delta made on the device, that diff instead, and the views of the device base the host copy is made from
        later (returned; None otherwise)."""
        if on_device:
            views = await self._diff_on_device(snap, places, items)
            if views is not None:
                return views
        if offered == "cuda_ipc":
            snap.ipc_stream = await self._ipc.copy(arena, snap.ipc_offsets, places, items)
        elif offered == "cuda_ipc_ring":  # the host snapshot and the ring read the trainer's tensors side by side
            await self._ipc.ring.beside(snap.copy(items), snap.version, places, items, self._server.complete_ipc)
        else:
            await snap.copy(items)
        return None

    async def wait_ready(self, version: int | None = None) -> None:
        """Wait until `version` (None: the latest) has every bucket's checksum (and so is served whole)."""
        v = self._latest if version is None else version
        fut = self._finishing.get(v)
        if fut is not None:
            await asyncio.shield(fut)

    async def _finish(self, snap: Snapshot, t0: float, copied: float) -> None:
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
        self._server.start_delta(snap.version, algorithm=self.checksum_algorithm)  # against the previous host copy

    def _after_publish(self, served: ServedVersion, t0: float, copied: float) -> None:
        now = time.perf_counter()
        log.info("published weight version %d: %d bytes in %d buckets (caller free after %.3f s, checksummed after %.3f s)",
                 served.version, served.total_bytes, len(served.buckets), copied - t0, now - t0)
        self.metrics.event("version_published", {"version": served.version, "bytes": served.total_bytes, "buckets": len(served.buckets),
                                                 "pack_s": round(now - t0, 6), "blocked_s": round(copied - t0, 6),
                                                 "memory": "shm" if any(b.shm_segment for b in served.buckets) else "host"})

    def _begin(self, version: int, places: list[Place], planner: BucketPlanner) -> Snapshot:
        buffers = self._buffers.take([b.nbytes for b in planner.buckets], self.path)
        self._sync_segments()
        return Snapshot(self._knobs, self._pools, self._server, version, places, planner, buffers, [self._buffers.segment_of(b) for b in buffers])

    # -- deltas made on the trainer's GPU

    def _delta_device_for(self, version: int, items: Any, buckets: tuple[Any, ...], offered: str, delta: bool) -> torch.device | None:
        """The device this version's delta is made on (`rollpool.weights.delta_device`): the tensors' GPU, when they are
        all there and the base fits the GPU budget; else None (the host compares the copies), the reason in `path_note`
        and the log, and the device base is freed. None and the base freed when no delta is made (`delta` false:
        deltas are off, or the same-GPU arena serves the version)."""
        device: torch.device | None = None
        why = ""
        if not delta:
            self._delta_base.release()
            self._delta_note = {"delta_made_on": "", "why_not_delta_on_device": ""}
            return None
        if offered != "host":
            why = "the same-GPU ring reads the tensors beside the host copy"
        elif version in self._server.pending_adapters:
            why = "an adapter version is compared on the host"
        elif not isinstance(items, list) or not items:
            why = "an iterator's tensors are compared on the host after their copy"
        elif self._delta_broken:
            why = f"the device diff failed here before ({self._delta_broken})"
        else:
            devices = {t.device for _n, t in items}
            device = next(iter(devices))
            if len(devices) != 1:
                why = "the tensors are on several devices"
            elif device.type not in _delta_device.DEVICE_TYPES:
                why = f"the tensors are on the {device.type}: the host's threads compare them"
            else:
                why = self._delta_base.why_not(buckets, device)
        note = {"delta_made_on": "host" if why else "device", "why_not_delta_on_device": why}
        if note != self._delta_note:
            log.info("weight publisher %s: from version %d, deltas are made on the %s", self.publisher_id, version,
                     f"host ({why})" if why else f"tensors' device ({device}; base: {self._delta_base.need_bytes(buckets)} bytes of the GPU budget)")
        self._delta_note = note
        if why:
            self._delta_base.release()  # the host path needs none: its memory goes back to the trainer
            return None
        return device

    async def _diff_on_device(self, snap: Snapshot, places: list[Place], items: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]] | None:
        """The trainer's wait on the device path: the changed elements found against the base on its GPU and the base
        written (it is this version then); each bucket's payload reaches the host and is checksummed in the delta's
        threads. Returns the base's views, which the host copy of the version is made from once the trainer is free,
        or None when the device failed (logged; the trainer's tensors, unchanged, are copied as on the host path)."""
        for reader in (self._base_reader, self._base_mixer):
            if reader is not None and not reader.done():  # the previous version's host copy (or its mix64) still reads the base
                with contextlib.suppress(BaseException):
                    await asyncio.wait([reader])
        base = self._server.versions.get(snap.version - 1)
        device = items[0][1].device
        after = torch.cuda.current_stream(device) if device.type == "cuda" else None  # the trainer's stream, on its thread
        early = snap.mix and all(snap.mix_aligned)  # the delta served early: its result's sums queued behind the diff
        try:
            made = await asyncio.to_thread(functools.partial(self._delta_base.diff, mix=early), snap.version, snap.served.buckets, places, items,
                                           list(snap.buffers), after)
        except Exception as exc:  # noqa: BLE001 - the host path serves the version
            self._delta_broken = f"{type(exc).__name__}: {exc}"
            log.error("weight publisher %s: the device diff failed (%s); deltas are made on the host from now on", self.publisher_id,
                      self._delta_broken)
            self._delta_base.release()
            self._delta_note = {"delta_made_on": "host", "why_not_delta_on_device": f"the device diff failed ({self._delta_broken})"}
            return None
        snap.marks["diffed"] = time.perf_counter()
        if made is not None and base is not None:
            parts = [functools.partial(_device_part, d, self.checksum_algorithm) for d in made]
            if self._server.take_delta_parts(snap.served, base, parts):
                self.delta_device_versions += 1
                if early:
                    self._server.early_coming(snap.version)  # the complete delta waits for the early one: the same delta
                    self._base_mixer = asyncio.ensure_future(self._serve_early(snap.version, places))
        return self._delta_base.views(places)

    async def _serve_early(self, version: int, places: list[Place]) -> None:
        """The device-made delta of `version` served before the version's host copy and checksums exist, to subscribers
        that verify on their GPU (`WeightServer.serve_early_delta`): each bucket's mix64 of the resulting bytes summed
        from the device base (which holds the version now) as the snapshot sums the host copy's, tensor by tensor."""
        mix64: list[str] | None = None
        t0 = time.perf_counter()
        try:
            mix64 = await asyncio.to_thread(self._delta_base.mix64s, places)
        except Exception as exc:  # noqa: BLE001 - the delta is served once the version is complete, as for every asker
            log.warning("weight publisher %s: no early delta for version %d (%s)", self.publisher_id, version, exc)
        finally:  # (called even when cancelled: the complete delta waits for it)
            await asyncio.shield(self._server.serve_early_delta(version, mix64, time.perf_counter() - t0))

    async def _finish_device(self, snap: Snapshot, views: list[tuple[str, torch.Tensor]], t0: float, copied: float) -> None:
        """After the device diff: the version's host buckets copied from the device base (the trainer's tensors may have
        changed by now; the base holds the version) and checksummed as usual. Where a delta is served early, the copy
        begins once it is (at most `EARLY_FIRST_S` later): issuing the whole model's copies takes the event loop and the
        GIL for tenths of a second at 8B, and the early delta's parts, its sums and its answer waited behind them (on an
        H100 at 8B it was served 0.17 s after the diff, for ~0.05 s of work). Once the copy is issued and landed, the
        next diff's page-locked payload blocks are made ahead (`delta_device.PayloadHost`): making new ones takes the
        CUDA driver for tenths of a second, which neither the early delta's copies nor this copy should wait for."""
        await self._early_first()
        try:
            await snap.copy(views)
        except BaseException as exc:
            self._withdraw(snap, exc, "the host copy from the device base")
            raise
        self._delta_base.payload_host.warm_for(self._delta_base.payload_sizes)
        await self._finish(snap, t0, copied)

    async def _early_first(self) -> None:
        """Until the early delta under way is served (`_serve_early`), `EARLY_FIRST_S` at most."""
        early = self._base_mixer
        if early is not None and not early.done():
            with contextlib.suppress(BaseException):
                await asyncio.wait([early], timeout=EARLY_FIRST_S)

    def _withdraw(self, snap: Snapshot, exc: BaseException, what: str) -> None:
        """A version whose copy after the trainer's wait failed (`what`): no longer served (logged unless cancelled)."""
        if not isinstance(exc, asyncio.CancelledError):
            log.error("weight version %d: %s failed (%s); withdrawn", snap.version, what, exc)
        self._server.drop_version(snap.version, code="unavailable")
        self._finishing.pop(snap.version, None)

    # -- the same-GPU path (CUDA IPC)

    async def _finish_ipc(self, snap: Snapshot, arena: torch.Tensor, arena_items: list[tuple[str, torch.Tensor]], t0: float,
                          copied: float) -> None:
        """After the device snapshot: each bucket's GPU checksum (then the same-GPU peers may read), then the host
        buckets copied from the arena (the network and shared-memory peers) and checksummed as usual."""
        try:
            await self._ipc.checksums(arena, snap.ipc_offsets, snap.served, snap.ipc_stream, self._server.complete_ipc)
            await snap.copy(arena_items)
        except BaseException as exc:
            self._withdraw(snap, exc, "the same-GPU snapshot")
            raise
        await self._finish(snap, t0, copied)

    def _evict_past_window(self, version: int) -> None:
        """`version` is past the `keep_versions` window: evicted, unless it is the adapter version on under the newest
        versions (a joiner fetches it with them: `Manifest.adapter_on`), or the whole-model version the newest adapter
        versions apply over (`Manifest.base_on`)."""
        if version not in (self._adapter_on, self._base_on):
            self._evict(version)

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
            self._buffers.retire(served.sources)


def _warm_kernels(items: Any) -> None:
    """From a trainer's first version of CUDA tensors on, the checksum kernels are built on its GPU in the background
    (a later version's GPU sums then do not wait for the build: ~2.6 s on a fresh machine for the fused mix64); from
    its first version of CPU tensors on, the compiled CPU mix64 (a compiler's run where not built on this machine yet)."""
    if _on_cuda(items):
        warm_up_in_background(items[0][1].device)
    else:
        warm_up_host_in_background()


def _on_cuda(items: Any) -> bool:
    """Whether a publish's tensors (a list of ``(name, tensor)``) are all CUDA tensors (an iterator's are not looked at)."""
    return isinstance(items, list) and bool(items) and all(isinstance(t, torch.Tensor) and t.is_cuda for _n, t in items)


def _device_part(diff: _delta_device.BucketDiff, algorithm: str) -> tuple[DeltaSet, str]:
    """A device-made bucket's delta once its payload is on the host, with its checksum (a delta thread runs it);
    `DeltaSet.timings` gets ``landed_at`` (the payload on the host, `time.time()`)."""
    ds = diff.wait()
    ds.timings["landed_at"] = time.time()
    return with_digest(ds, algorithm)
