"""What every transport path of the weight channel shares: the records a fetch hands back, the context a path is
given, and the one `FetchPath` Protocol each path implements (one file per path under ``weights/paths/``).

Contract of a path
    - `FetchPath.fetch(job)` fills and verifies every bucket of ``job.manifest`` (a bucket's bytes are handed to
      ``job.on_bucket`` only once they match their checksum) and returns a `Fetched`: the manifest with the
      checksums it verified, the bucket views and the one buffer they are carved from. It never returns part of a
      version.
    - `PathFallbackError`: this path cannot serve this version (a torn read, a missing GPU checksum, an unreachable
      lane); the fetch goes on to the next path of the plan (`rollpool.weights.manifest.plan`). A path that got part
      of the version verified says so (`PathFallbackError.resume`), and the next path fetches only the rest.
    - `WeightSyncError` (a bucket that keeps failing its checksum, a silent publisher) and `WeightVersionGoneError`
      end the fetch; no other path is tried for that version.
    - A path is given what it needs in a `FetchContext` (counters, limits, the manifest source); it never calls back
      into the subscriber.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, Protocol, TypeVar

from rollpool.protocol.errors import WeightSyncError
from rollpool.protocol.messages import Manifest
from rollpool.protocol.metrics import MetricsSink

if TYPE_CHECKING:
    import torch

    from rollpool.weights.delta_gpu import DeviceHeld

__all__ = [
    "Attr",
    "BucketCallback",
    "ChunkRead",
    "FetchContext",
    "FetchCounters",
    "FetchJob",
    "FetchPath",
    "Fetched",
    "ManifestSource",
    "ManifestTimeoutError",
    "PathFallbackError",
    "TransferSink",
    "WeightVersion",
    "WeightVersionGoneError",
]

log = logging.getLogger("rollpool.weights.subscriber")


T = TypeVar("T")


class Attr(Generic[T]):
    """An attribute of a facade that is its part's: ``bytes_received: Attr[int] = Attr("counters")`` reads (and, made
    with ``writable=True``, writes) ``self.counters.bytes_received`` (`field`: the part's name for it, when it differs).
    The facades keep their public names while the state lives in the part that owns it."""

    def __init__(self, part: str, doc: str = "", *, writable: bool = False, field: str = "") -> None:
        self.part = part
        self.writable = writable
        self.__doc__ = doc
        self.name = self.field = field

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.field = self.field or name

    def __get__(self, obj: object, objtype: type | None = None) -> T:
        value: T = getattr(getattr(obj, self.part), self.field)
        return value

    def __set__(self, obj: object, value: T) -> None:
        if not self.writable:
            raise AttributeError(f"{self.name} is read-only (it is {self.part}.{self.field})")
        setattr(getattr(obj, self.part), self.field, value)


@dataclass(frozen=True, slots=True)
class WeightVersion:
    """A complete, verified weight version."""

    version: int
    tensors: dict[str, torch.Tensor]
    """Named tensors, views of `buffers` (no copy)."""
    manifest: Manifest
    buffers: tuple[torch.Tensor, ...] = ()
    """The verified buckets as 1-D uint8 tensors, in manifest order (e.g. for SGLang's flattened buckets)."""
    slab: torch.Tensor | None = None
    """The one buffer `buffers` are views of (what `WeightSubscriber.recycle` hands back)."""
    held: DeviceHeld | None = None
    """The version is held on the engine's GPU (`rollpool.weights.delta_gpu.DeviceHeld`): `tensors` are views of its
    device buffers (kept there as the next delta's base), `buffers` of the host copy when one was fetched (else the
    device buffers too). Those device buffers are written in place by the next version: see `intact`."""
    details: dict[str, Any] = field(default_factory=dict)
    """How it was fetched (the ``weights fetched`` line's path details: ``delta_rebuilt_on``, ``device_rebuild_s``, ...)."""

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.manifest.buckets)

    @property
    def intact(self) -> bool:
        """Whether `tensors` still hold this version: False once the device buffers they view were written by a newer
        version (staged into them, or a delta rebuilt in them in place); such tensors must not be applied again."""
        return self.held is None or self.held.holds(self.manifest.publisher_id, self.version)


class WeightVersionGoneError(WeightSyncError):
    """The publisher no longer serves the version (evicted, or released with keep_versions=0)."""

    def __init__(self, version: int, message: str) -> None:
        super().__init__(f"weight version {version} is gone: {message}")
        self.version = version


class ManifestTimeoutError(WeightSyncError):
    """No manifest came within the tries asked for (a silent publisher, or an answer lost or late on the way)."""


class TransferSink(Protocol):
    """Told of a transfer's progress (the relay forwards chunks as they arrive)."""

    def on_chunk(self, bucket: int, offset: int, nbytes: int) -> None: ...

    def on_bucket_reset(self, bucket: int) -> None: ...

    def on_checksum(self, bucket: int, checksum: str) -> None:
        """A streamed manifest's pending checksum arrived on the bucket's first chunk."""


BucketCallback = Callable[[int, "dict[str, torch.Tensor]"], Any]
"""``on_bucket(index, tensors)``: a bucket verified (its tensors are final views; the version is not whole yet)."""


class ChunkRead(NamedTuple):
    """A server's lookup of one chunk (`rollpool.weights.serving.WeightServer.read_chunk`)."""

    code: str
    """"" when found, else the error code (``gone``, ``unknown_version``, ``bad_range``)."""
    text: str
    """The bucket's checksum when found (``""`` while pending), else the error message."""
    data: Any = None
    """The bytes (a zero-copy view), or None: not arrived yet (a streamed or relayed version)."""
    version: Any = None
    """The served version's record, handed back with `VersionStore.bulk_served`."""


class ManifestSource(Protocol):
    """Where a path asks for a manifest again (the subscriber's request router)."""

    async def fetch_manifest(self, version: int | None = None, *, attempts: int | None = None, streamed: bool = True,
                             wait_ipc: bool = False, delta: bool = True, after_mix64: int = -1,
                             timeout_s: float | None = None, ring_done: int = -1) -> Manifest: ...


@dataclass(slots=True)
class FetchCounters:
    """Bytes and refetches of one subscriber, by path (read by the worker's monitoring)."""

    bytes_received: int = 0
    """Bucket bytes received on the network path (over ZeroMQ or the bulk lane)."""
    bulk_bytes: int = 0
    """Of `bytes_received`, those received over the bulk lane."""
    early_bytes: int = 0
    """Of `bulk_bytes`, those received before their bucket's checksum (``RPBE``, minor 30: a trainer's CPU tensors)."""
    shm_bytes: int = 0
    """Bucket bytes copied from a publisher's shared-memory segments."""
    device_stage_bytes: int = 0
    """Bucket bytes copied from shared memory straight to the staging device and verified there."""
    ipc_bytes: int = 0
    """Bucket bytes copied device-to-device from a publisher's exported GPU buffer (the same-GPU path)."""
    buckets_refetched: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    """For counts added from a path's threads (the bulk lane's streams)."""


@dataclass(slots=True)
class FetchContext:
    """What a path is given: the subscriber's limits, its counters and event sink, and where to ask for a manifest."""

    worker_id: str
    metrics: MetricsSink
    manifests: ManifestSource
    counters: FetchCounters
    fetch_timeout_s: float
    window_chunks: int
    max_refetch: int
    streams: int
    copy_threads: int

    def __post_init__(self) -> None:
        if self.fetch_timeout_s <= 0:
            raise ValueError(f"fetch_timeout_s must be > 0, got {self.fetch_timeout_s}")
        if not 1 <= self.window_chunks <= 1024:
            raise ValueError(f"window_chunks must be in [1, 1024], got {self.window_chunks}")
        if self.max_refetch < 0:
            raise ValueError(f"max_refetch must be >= 0, got {self.max_refetch}")

    def bucket_failed(self, version: int, i: int, failures: list[int], path: str, where: str = "", what: str = "", *,
                      loop: asyncio.AbstractEventLoop | None = None) -> None:
        """One failed checksum of bucket `i`: counted, logged, evented (through `loop` from another thread); past
        `max_refetch` the version is refused whole (raises `WeightSyncError`)."""
        failures[i] += 1
        with self.counters.lock:
            self.counters.buckets_refetched += 1
        log.warning("weight version %d: bucket %d%s failed its checksum (attempt %d)", version, i, f" {where}" if where else "", failures[i])
        event = {"worker_id": self.worker_id, "version": version, "bucket": i, "path": path}
        if loop is None:
            self.metrics.event("bucket_refetched", event)
        else:
            loop.call_soon_threadsafe(self.metrics.event, "bucket_refetched", event)
        if failures[i] > self.max_refetch:
            raise WeightSyncError(f"weight version {version}: bucket {i} failed its checksum {failures[i]} times" + (f" ({what})" if what else ""))


@dataclass(slots=True)
class FetchJob:
    """One version to fetch on one path."""

    manifest: Manifest
    on_bucket: BucketCallback | None = None
    buffers: list[torch.Tensor] | None = None
    """The host buffers (one view per bucket) a host path fills; None for the device paths (they own theirs)."""
    slab: torch.Tensor | None = None
    """The one buffer `buffers` are carved from."""
    sink: TransferSink | None = None
    skip: frozenset[int] = frozenset()
    """Buckets already in `buffers` and verified (by a path that failed part-way): not fetched again."""


@dataclass(frozen=True, slots=True)
class Fetched:
    manifest: Manifest
    """With every checksum the path verified (a streamed manifest's pending ones filled in)."""
    buffers: list[torch.Tensor]
    slab: torch.Tensor | None
    path: str
    """The path's name in the ``weights fetched`` line and `WeightSubscriber.last_path` (the bulk lane says ``network``)."""
    details: dict[str, Any] = field(default_factory=dict)
    """Extra fields for the ``weights fetched`` log line (the staged path's timeline)."""
    on_device: bool = False
    """The buffers are the device path's own (the same GPU, shared memory staged to a GPU), not host buffers of the
    subscriber's: the version cannot be a delta's base on the host."""
    held: DeviceHeld | None = None
    """The version is also (or only) on the engine's GPU, held there as the next delta's base (`WeightVersion.held`)."""


class PathFallbackError(Exception):
    """This path cannot serve this version: the next path of the plan takes it (a counted fallback)."""

    def __init__(self, reason: str, *, resume: tuple[Manifest, frozenset[int]] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.resume = resume
        """(the manifest with the checksums learnt, the buckets verified): what the next path need not fetch again."""


class FetchPath(Protocol):
    """One transport path, the subscriber's end (its server end lives in the same file)."""

    name: str
    """Its name in the plan (`rollpool.weights.manifest.PATHS`)."""
    host_buffers: bool
    """Whether it fills the job's host buffers (else it allocates device buffers of its own)."""

    async def fetch(self, job: FetchJob) -> Fetched: ...
