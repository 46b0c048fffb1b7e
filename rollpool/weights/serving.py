"""The serving half shared by `WeightPublisher` and `Relay`: ROUTER (manifests, chunks) + PUB (announces).

Guarantees
    - Every request gets one answer: a `Manifest`, a `Chunk` or an `Error`
      (``gone``: the version was evicted; ``unknown_version``; ``bad_range``;
      ``unavailable``: a relay lost the version it was still receiving;
      ``busy``: too many parked requests; ``unexpected``: not a weights
      request; or the `ProtocolError` code of a malformed message). A
      malformed message is counted, logged once per peer per minute, and the
      server keeps serving.
    - The server never blocks on one peer: replies are sent with DONTWAIT on a
      ROUTER with ROUTER_MANDATORY; a reply that cannot be queued (the peer
      stopped reading and its high-water mark is reached, or it left) is
      dropped and counted, and the peer's own timeout makes it ask again. Chunk
      frames are zero-copy views of the version's buffers, so a slow peer costs
      references, not memory.
    - Flow control is the peer's: it keeps a bounded window of `Fetch`
      requests, each answered by one chunk of at most `max_chunk_bytes`.
    - A fetch of bytes that have not arrived yet (a relay still receiving the
      version) is parked and answered as soon as they arrive.
    - The newest version is re-announced every `announce_interval_s`, so a
      subscriber whose SUB connected after the first announce still hears it.
    - Streamed versions (protocol minor 1): a version may be served while its
      buckets are still being snapshotted and checksummed. Its manifest then
      names ``""`` for each pending checksum; a bucket's bytes become readable
      only once its checksum exists, and every chunk carries its bucket's
      checksum (`Chunk.checksum`). A manifest request that does not say
      ``streamed`` (a subscriber of minor 0) is answered with the newest
      *complete* version, or parked until the version completes, so older
      peers only ever see manifests whose checksums all exist.
    - The same-GPU path (minor 9): a version may name a device buffer
      (`Manifest.cuda_ipc`) and per bucket its offset and GPU checksum
      (`BucketInfo.ipc_checksum`, ``""`` while pending). A manifest request
      with ``wait_ipc`` is parked until every GPU checksum exists (the host
      checksums may still be pending); `on_manifest_request` lets the owner
      read the asker's hello (`ManifestRequest.host_key`, ``gpu_uuids``).
    - Parked manifest requests (minor 19, `PARKED_MINOR`): a request naming
      ``after_mix64`` n is answered once the version carries more than n GPU
      checksums of its host bytes (`BucketInfo.host_mix64`, pushed by
      `set_host_mix64`), at once when it already does or none will come (not
      a shared-memory version), ``gone`` when the version is dropped, and
      ``busy`` past `max_parked`. The asker's own deadline bounds the wait; an
      answer that was lost or came late is asked for again. Every manifest
      says the server's minor (`Manifest.protocol_minor`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, Self

from rollpool.protocol.codec import PROTOCOL_MINOR, decode, encode, peek_type
from rollpool.protocol.errors import ProtocolError
from rollpool.protocol.logs import RateLimitedLog
from rollpool.protocol.messages import (
    AdapterSpec,
    Announce,
    BucketInfo,
    Chunk,
    CudaIpcBuffer,
    Error,
    Fetch,
    Manifest,
    ManifestRequest,
    ShmSegment,
)
from rollpool.protocol.metrics import MetricsSink, NullMetricsSink
from rollpool.protocol.roles import server_socket
from rollpool.protocol.sockets import SocketFactory, send_now
from rollpool.weights.config import WeightPathConfig
from rollpool.weights.delta import WHOLE, DeltaSet, encode_buckets, same_layout
from rollpool.weights.manifest import MAX_CHUNK_BYTES
from rollpool.weights.paths.base import Attr, ChunkRead
from rollpool.weights.paths.bulk import BulkServer, lane_host, lane_port

if TYPE_CHECKING:
    from rollpool.weights.memory import BufferPool

__all__ = ["MAX_CHUNK_BYTES", "BucketSource", "DeltaServed", "ServedVersion", "TensorSource", "WeightServer", "peer_of"]

log = logging.getLogger(__name__)

REQUEST_MAX_BYTES = 64 * 1024
"""MAXMSGSIZE of the server's ROUTER: requests are small."""


class RingHook(Protocol):
    """The same-GPU ring's say in manifest requests (`rollpool.weights.paths.ipc_ring.IpcRing`, minor 22)."""

    def take_request(self, ident: bytes, req: ManifestRequest, v: ServedVersion, send: Callable[[bytes, Any], Any]) -> bool:
        """True when the ring answered or parked the request (a taker's claim or release)."""

    def outgoing(self, ident: bytes, m: Manifest) -> Manifest:
        """The manifest as `ident` may see it (a ring's buffer only for a subscriber that takes rings)."""


class BucketSource(Protocol):
    """Bytes of one bucket: `read` returns a bytes-like slice, or None if not arrived yet."""

    def read(self, offset: int, nbytes: int) -> Any: ...


@dataclass(slots=True)
class ServedVersion:
    version: int
    publisher_id: str
    buckets: tuple[BucketInfo, ...]
    sources: list[BucketSource]
    chunk_bytes: int
    served_by_peer: dict[bytes, int] = field(default_factory=dict)
    """Bytes served per subscriber (its stream sockets counted together)."""
    last_request_s: float = 0.0
    released: bool = False
    """The manifest is still answered, but the bytes are gone (keep_versions=0 after release)."""
    host_key: str = ""
    pool: str = ""
    waiting_manifests: list[tuple[bytes, ManifestRequest]] = field(default_factory=list)
    """Manifest requests of minor-0 peers parked until every checksum exists."""
    cuda_ipc: CudaIpcBuffer | None = None
    """The device buffer of the same-GPU path (buckets at `BucketInfo.ipc_offset`), or None."""
    waiting_ipc: list[tuple[bytes, ManifestRequest]] = field(default_factory=list)
    """Manifest requests (``wait_ipc``) parked until every GPU checksum exists."""
    bulk_port: int = 0
    """The server's bulk lane (`Manifest.bulk_port`), set when the version is added."""
    adapter: AdapterSpec | None = None
    """The version is a LoRA adapter (`Manifest.adapter`, rollpool.weights.adapters); None: whole-model weights."""
    adapter_on: int = -1
    """A whole-model version: the adapter version on under it (`Manifest.adapter_on`); -1: none."""
    base_on: int = -1
    """An adapter version: the whole-model version it applies over (`Manifest.base_on`); -1: the model from disk."""
    delta_state: str = "none"
    """``"pending"``: the owner will compute a delta against the previous version (`WeightServer.make_delta`), manifest
    requests for one wait for it; ``"ready"``: `delta` is served; ``"none"``: full versions only."""
    delta: DeltaServed | None = None
    early: DeltaServed | None = None
    """A delta made on the publisher's GPU, served before the version is complete (`WeightServer.serve_early_delta`) to
    askers that verify on their GPU (``device_verify``); `delta` once the version is (the same one, its checksums in)."""
    early_building: asyncio.Future[None] | None = None
    """`serve_early_delta` under way (`make_delta` waits for it, so the delta served early is the one served on)."""
    delta_settling: bool = False
    """`make_delta` has begun: no delta is served early from then on (it serves the complete one)."""
    waiting_delta: list[tuple[bytes, ManifestRequest]] = field(default_factory=list)
    delta_overdue: bool = False
    """Its delta is still being made `WeightServer.delta_wait_s` after it was complete: askers get the full version."""
    waiting_mix64: list[tuple[bytes, ManifestRequest]] = field(default_factory=list)
    """Manifest requests (``after_mix64``) parked until the version carries more GPU checksums of its host bytes."""
    delta_parts: dict[int, tuple[ServedVersion, Future[tuple[DeltaSet, str]]]] = field(default_factory=dict)
    """`WeightServer.early_delta`: per bucket, the base it is encoded against and its encoding under way or done."""
    delta_started: float = 0.0
    """When the delta's first bucket began to be encoded (perf_counter; 0: not begun)."""
    delta_hold: bool = False
    """`WeightServer.early_delta` waits (`release_delta`): the owner's snapshot is still copying (the trainer waits on
    it, and the encode would compete with it for cores and memory bandwidth)."""

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def complete(self) -> bool:
        """Every bucket's checksum exists."""
        return all(b.checksum for b in self.buckets)

    @property
    def mix64_count(self) -> int:
        """Buckets whose GPU checksum of their host bytes (`BucketInfo.host_mix64`) exists."""
        return sum(1 for b in self.buckets if b.host_mix64)

    def mix64_waits(self, after: int) -> bool:
        """A request parked at `after` GPU checksums still waits: this shared-memory version (only those get them) has
        no more than that yet, and more will come."""
        have = self.mix64_count
        return bool(self.host_key) and have <= after and have < len(self.buckets)

    @property
    def ipc_complete(self) -> bool:
        """Every bucket's GPU checksum exists (or the version has no device buffer)."""
        return self.cuda_ipc is None or all(b.ipc_checksum for b in self.buckets)

    def set_ipc_checksum(self, bucket: int, checksum: str) -> None:
        self.buckets = tuple(replace(b, ipc_checksum=checksum) if b.index == bucket else b for b in self.buckets)

    def set_checksum(self, bucket: int, checksum: str) -> None:
        self.buckets = tuple(replace(b, checksum=checksum) if b.index == bucket else b for b in self.buckets)

    def manifest(self, request_id: str) -> Manifest:
        return Manifest(request_id=request_id, version=self.version, publisher_id=self.publisher_id, buckets=self.buckets,
                     chunk_bytes=self.chunk_bytes, host_key=self.host_key, pool=self.pool, cuda_ipc=self.cuda_ipc, bulk_port=self.bulk_port,
                        adapter=self.adapter, adapter_on=self.adapter_on,
                        base_on=self.base_on)


class TensorSource:
    """A delta payload held as one uint8 CPU tensor (kept until its version is dropped)."""

    __slots__ = ("array",)

    def __init__(self, data: Any) -> None:
        self.array = data.numpy()

    def read(self, offset: int, nbytes: int) -> Any:
        return self.array[offset : offset + nbytes].data

    def contiguous(self) -> Any:
        return self.array


@dataclass(slots=True)
class DeltaServed:
    """A version's delta against `base`: the manifest's buckets with their encodings, and the encoded bytes served as
    buckets of their own (`payload`, indexed densely over the buckets that carry bytes: `Fetch.delta_base`)."""

    base: int
    buckets: tuple[BucketInfo, ...]
    payload: ServedVersion
    changed_fraction: float
    bytes_by_encoding: dict[str, int]
    timings: dict[str, float] = field(default_factory=dict)
    """Where it was made here: seconds of its phases (`WeightServer.note_delta`)."""
    shm: ShmSegment | None = None
    """The shared-memory segment its encoded bytes were also written to (`Manifest.delta_shm`), or None."""
    shm_buffer: Any = None
    """That segment's bytes (given back to `WeightServer.delta_segments` when the version is dropped)."""

    @property
    def wire_bytes(self) -> int:
        return sum(self.bytes_by_encoding.values())


def _whole(src: BucketSource, n: int) -> Any:
    """A bucket's bytes (all there) as a 1-D uint8 tensor over the source's memory."""
    import torch

    data = src.read(0, n) if n else memoryview(b"")
    if data is None:
        raise ValueError("a bucket's bytes are not all there")
    return torch.frombuffer(data, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)


def _encode_bucket_of(v: ServedVersion, base: ServedVersion, i: int, algorithm: str | None) -> tuple[DeltaSet, str]:
    """Bucket `i` of `v` encoded against `base`'s (a one-bucket `DeltaSet`, its timings) and its payload's checksum
    (``""`` when it carries none or is the bucket itself); run in the server's delta threads."""
    b = v.buckets[i]
    if not same_layout([b], [base.buckets[i]]):
        raise ValueError(f"bucket {i} does not line up with the base's")
    ds = encode_buckets([_whole(v.sources[i], b.nbytes)], [_whole(base.sources[i], base.buckets[i].nbytes)], [b], base_version=base.version)
    assert ds is not None
    return with_digest(ds, algorithm)


def with_digest(ds: DeltaSet, algorithm: str | None) -> tuple[DeltaSet, str]:
    """A one-bucket delta and its payload's checksum (``""`` when it carries none or is the bucket itself)."""
    from rollpool.weights.bucketing import checksum

    payload, digest = ds.payloads[0], ""
    if payload is not None and ds.encodings[0] != WHOLE:
        t = time.perf_counter()
        digest = checksum(payload.numpy().data, algorithm)
        ds.timings["checksum_s"] = time.perf_counter() - t
    return ds, digest


def first_delta_segment_bytes(model_bytes: int) -> int:
    """The segment made ahead for a publisher's first delta (`WeightServer.spare_delta_segment`), before any delta's
    size is known: `delta.ENCODED_FRACTION_GUESS` of the version, rounded up to a power of two (at 8B, 1 GiB: it holds
    a delta of up to ~3.7% changed bf16 elements; a larger one makes its own as before)."""
    from rollpool.weights.delta import ENCODED_FRACTION_GUESS

    n = _segment_bytes(max(1, int(model_bytes * ENCODED_FRACTION_GUESS)))
    return 1 << (n - 1).bit_length()


def _segment_bytes(n: int) -> int:
    """A delta segment's size for `n` encoded bytes: rounded up to a sixteenth of the next power of two (at most 1/8
    more), so the next versions' deltas, of about the same size, reuse it."""
    n = max(n, 1 << 16)
    step = (1 << (n - 1).bit_length()) // 16
    return -(-n // step) * step


def peer_of(ident: bytes) -> bytes:
    """The subscriber an identity belongs to: its stream sockets are ``<id>#<n>``."""
    return ident.split(b"#", 1)[0]


class ServingFace:
    """What an owner of a `WeightServer` (`_server`: the publisher, the relay) shows of it: its endpoints, the bytes
    served, the newest version (`_latest`), and ``async with`` (`start`, then `close`)."""

    _server: WeightServer
    _latest: int

    async def start(self) -> None:
        await self._server.start()

    async def close(self) -> None:
        await self._server.close()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    router_endpoint: Attr[str] = Attr("_server", "The bound ROUTER endpoint.")
    pub_endpoint: Attr[str | None] = Attr("_server", "The bound PUB endpoint.")
    bytes_served: Attr[int] = Attr("_server", "Bucket bytes served (to subscribers, or downstream).")

    @property
    def latest_version(self) -> int:
        """The newest version published (a relay's: held complete and verified)."""
        return self._latest


class WeightServer:
    """ROUTER + PUB around a store of versions (the owner adds and drops versions)."""

    def __init__(
        self,
        sockets: SocketFactory,
        *,
        router_endpoint: str,
        pub_endpoint: str | None,
        name: str = "publisher",
        announce_interval_s: float = 1.0,
        send_hwm: int = 256,
        max_parked: int = 4096,
        metrics: MetricsSink | None = None,
        weights: WeightPathConfig | None = None,
    ) -> None:
        """`weights`: the knobs it reads are ``weight_bulk``, ``weight_delta_threads`` (the delta's threads) and
        ``weight_delta_max_fraction`` (None: their defaults)."""
        cfg = weights or WeightPathConfig()
        self.sockets = sockets
        self.offer_bulk = cfg.weight_bulk
        """Offer the bulk lane beside a TCP ROUTER (`WeightPathConfig.weight_bulk`; never under CURVE)."""
        self._router_bind = router_endpoint
        self._pub_bind = pub_endpoint
        self.name = name
        self._accepts = server_socket(f"{name}.router").accepts  # the types this ROUTER serves (rollpool.protocol.roles)
        self.announce_interval_s = announce_interval_s
        self.send_hwm = send_hwm
        self.max_parked = max_parked
        self.metrics: MetricsSink = metrics or NullMetricsSink()
        self.versions: dict[int, ServedVersion] = {}
        self.highest_dropped = -1
        self.pending_adapters: dict[int, AdapterSpec] = {}
        """Adapter specs of versions being published, taken by `add_version`."""
        self.pending_adapter_on: dict[int, int] = {}
        """The adapter version on under each whole-model version being published (`Manifest.adapter_on`), taken by
        `add_version`."""
        self.pending_base_on: dict[int, int] = {}
        """The whole-model version each adapter version being published applies over (`Manifest.base_on`), taken by
        `add_version`."""
        self.router_endpoint = ""
        self.pub_endpoint: str | None = None
        self.bytes_served = 0
        self.chunks_served = 0
        self.dropped_replies = 0
        self.protocol_errors = 0
        self.parked_served = 0
        """Fetches answered only once their bytes arrived (a relay forwarding as it receives)."""
        self.parked_manifests_served = 0
        """Manifest requests (``after_mix64``) answered once more GPU checksums existed (not at once)."""
        self._served = asyncio.Event()
        """Set whenever a chunk went out (`serve_until_released` waits on it)."""
        self.on_manifest_request: Callable[[ManifestRequest], None] | None = None
        """Told every manifest request (the publisher reads the asker's hello for the same-GPU path)."""
        self.ring: RingHook | None = None
        """The publisher's same-GPU ring: its takers' requests are its, and a ring's buffer is named only to ring takers."""
        self._parked: dict[int, list[tuple[bytes, Fetch]]] = {}
        self._router: Any = None
        self._pub: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._errlog = RateLimitedLog(log)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.shm_reserved: tuple[ShmSegment, ...] = ()
        """The owner's shared-memory segments (minor 11), named on every manifest with `shm_host_key`."""
        self.shm_host_key = ""
        self.shm_generation = 0
        """Bumped by `set_shm_reserved` when the set changes; announced, so subscribers ask for the manifest again."""
        self.bulk: BulkServer | None = None
        """The bulk lane (`rollpool.weights.paths.bulk`) beside the ROUTER, when this server offers one."""
        self.served_changes = ctypes.c_int64(0)
        """Bumped whenever `still_serves` may answer False for what it answered True (a version dropped or released,
        an early delta settled): the bulk lane's compiled send loop (`paths.lane_native`) stops at the next chunk."""
        self.bulk_bytes_served = 0
        self.delta_threads = cfg.delta_threads
        self.delta_max_fraction = cfg.weight_delta_max_fraction
        """A delta whose encoded bytes pass this fraction of the version's goes out as a full version."""
        self.delta_wait_s = cfg.weight_delta_wait_s
        """How long after its version is complete a delta may keep its askers waiting (`start_delta`): then they get the
        full version (a delta made on the host at 8B took ~5 s on the H100 host, its full version ~1.4 s over tcp)."""
        self.delta_waits_ended = 0
        """Manifest requests parked for a delta answered with the full version when `delta_wait_s` ran out."""
        self._deltas: set[asyncio.Task[Any]] = set()
        """Delta computations running (`start_delta`), cancelled by `close`."""
        self._delta_pool: ThreadPoolExecutor | None = None
        self.early_delta = False
        """Encode each bucket's delta as soon as the bucket is final (`complete_bucket`), while the rest of the version
        lands, instead of all after the version completes: the owner sets it when `complete_bucket` means the bucket's
        bytes are final (the publisher's snapshot; not a relay's streamed upstream checksums, whose bytes may still be
        arriving or be refetched)."""
        self.deltas_served = 0
        self.early_deltas = 0
        """Deltas served before their version was complete (`serve_early_delta`)."""
        self.early_deltas_served = 0
        """Manifests of such a delta answered before its version was complete (to askers that verify on their GPU)."""
        self.full_served_to_delta_askers = 0
        self.last_delta: dict[str, Any] = {}
        """The newest delta made: base, version, changed fraction, wire bytes by encoding (status and top read it)."""
        self.delta_segments: BufferPool | None = None
        """Shared-memory segments for deltas' encoded bytes (the publisher's, when its versions are in shared memory):
        a delta of a version held in shared memory is written to one before it is served, so a subscriber on this host
        reads it there (`Manifest.delta_shm`) instead of over a socket. None: over the network only (a relay)."""
        self.delta_shm_written = 0
        """Deltas written to shared memory."""
        self.delta_shm_fresh = 0
        """Of those, the ones that found no segment free and made one while the delta waited (`spare_delta_segment`)."""
        self._spare_thread: threading.Thread | None = None

    def set_shm_reserved(self, segments: tuple[ShmSegment, ...], host_key: str) -> None:
        """The owner's segments changed (made by a reserve or a version, or freed): named on manifests from now on."""
        if segments != self.shm_reserved:
            self.shm_reserved, self.shm_host_key = segments, host_key
            self.shm_generation += 1
            latest = self.latest
            if latest is not None:
                self.announce(latest)  # subscribers that register ahead learn of them now, not at the next re-announce

    # -- lifecycle

    async def start(self) -> None:
        import zmq

        self._loop = asyncio.get_running_loop()
        self._router = self.sockets.router(max_msg_bytes=REQUEST_MAX_BYTES, serves=f"{self.name}.router")
        self._router.setsockopt(zmq.SNDHWM, self.send_hwm)
        try:
            self._router.bind(self._router_bind)
            self.router_endpoint = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
            if self._pub_bind:
                self._pub = self.sockets.pub(self._pub_bind, serves=f"{self.name}.pub")
                self.pub_endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        except BaseException:
            self._close_sockets()
            raise
        host = lane_host(self.router_endpoint)
        if host is not None and self.sockets.security is None and self.offer_bulk:
            # the bulk lane listens on the address the ROUTER bound (0.0.0.0 for a wildcard); under CURVE, none
            try:
                self.bulk = BulkServer(self, host, lane_port(self._router_bind))
                self.bulk.start(self._loop)
            except OSError as exc:
                log.warning("%s: no bulk lane (%s); chunks go over the ROUTER", self.name, exc)
                self.bulk = None
        self._tasks = [
            asyncio.create_task(self._serve_loop(), name=f"{self.name}._serve_loop"),
            asyncio.create_task(self._announce_loop(), name=f"{self.name}._announce_loop"),
        ]

    async def close(self) -> None:
        for t in [*self._tasks, *self._deltas]:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []
        self._close_sockets()
        if self._delta_pool is not None:
            self._delta_pool.shutdown(wait=False, cancel_futures=True)
            self._delta_pool = None
        if self.delta_segments is not None:
            if self._spare_thread is not None:
                await asyncio.to_thread(self._spare_thread.join, 10.0)
            self.delta_segments.close()
        if self.bulk is not None:
            self.bulk.close()
            self.bulk = None

    def _close_sockets(self) -> None:
        for s in (self._router, self._pub):
            if s is not None:
                s.close(linger=0)
        self._router = self._pub = None

    # -- the store

    @property
    def latest(self) -> ServedVersion | None:
        return self.versions[max(self.versions)] if self.versions else None

    def add_version(self, v: ServedVersion, *, announce: bool = True) -> None:
        v.bulk_port = self.bulk.port if self.bulk is not None else 0
        if v.adapter is None:  # the publisher names an adapter version's spec before its snapshot makes the version
            v.adapter = self.pending_adapters.pop(v.version, None)
        if v.adapter_on < 0:
            v.adapter_on = self.pending_adapter_on.pop(v.version, -1)
        if v.base_on < 0:
            v.base_on = self.pending_base_on.pop(v.version, -1)
        self.versions[v.version] = v
        if announce:
            self.announce(v)

    def drop_version(self, version: int, *, code: str = "gone") -> None:
        v = self.versions.pop(version, None)
        if v is None:
            return
        self.served_changes.value += 1
        self.highest_dropped = max(self.highest_dropped, version)
        self._give_delta_segment(v.delta)
        self._give_delta_segment(v.early)
        if self.bulk is not None:
            self.bulk.notify()  # a bulk request waiting for this version's bytes answers gone now
        gone = f"version {version} is no longer served"
        for ident, req in self._parked.pop(version, []):
            self._send(ident, Error(code=code, message=gone, request_id=req.request_id, ref_type="fetch"))
        waiting = [*v.waiting_manifests, *v.waiting_ipc, *v.waiting_delta, *v.waiting_mix64]
        v.waiting_manifests, v.waiting_ipc, v.waiting_delta, v.waiting_mix64 = [], [], [], []
        for ident, mreq in waiting:
            self._send(ident, Error(code=code, message=gone, request_id=mreq.request_id, ref_type="manifest_request"))

    # -- deltas

    def expect_delta(self, v: ServedVersion) -> None:
        """Before `add_version`: a delta of `v` against the version before it will be made (`make_delta`), so a manifest
        request for one waits for it instead of getting the full version."""
        base = self.versions.get(v.version - 1)
        if base is not None and base.complete and not base.released:
            v.delta_state = "pending"

    def _delta_threads(self) -> ThreadPoolExecutor:
        if self._delta_pool is None:
            self._delta_pool = ThreadPoolExecutor(max_workers=max(1, self.delta_threads), thread_name_prefix="weights-delta")
        return self._delta_pool

    def _encode_early(self, v: ServedVersion, bucket: int) -> None:
        """`early_delta`: bucket `bucket` of `v` is final (snapshotted and checksummed): its delta against the same bucket
        of the version before is encoded now, in the delta's threads, while the rest of the snapshot lands."""
        base = self.versions.get(v.version - 1)
        if v.delta_hold or base is None or base.released or not base.complete or bucket in v.delta_parts or len(base.buckets) != len(v.buckets):
            return
        if v.delta_started == 0.0:
            v.delta_started = time.perf_counter()
        algo = v.buckets[bucket].checksum.partition(":")[0] or None
        v.delta_parts[bucket] = (base, self._delta_threads().submit(_encode_bucket_of, v, base, bucket, algo))

    def take_delta_parts(self, v: ServedVersion, base: ServedVersion, parts: Sequence[Callable[[], tuple[DeltaSet, str]]]) -> bool:
        """`v`'s delta against `base` made elsewhere (the publisher's device: `rollpool.weights.delta_device`), one part
        per bucket, each finished (its payload on the host, checksummed) in the delta's threads; `make_delta` serves them
        as it serves the buckets encoded here. False (nothing taken) unless `v` expects a delta against `base`."""
        if v.delta_state != "pending" or self.versions.get(v.version - 1) is not base or len(parts) != len(v.buckets):
            return False
        if v.delta_started == 0.0:
            v.delta_started = time.perf_counter()
        for i, part in enumerate(parts):
            v.delta_parts[i] = (base, self._delta_threads().submit(part))
        return True

    def release_delta(self, version: int) -> None:
        """`version`'s snapshot copy is done (`ServedVersion.delta_hold`): its buckets checksummed so far are encoded now,
        the others as their checksums come."""
        v = self.versions.get(version)
        if v is None or not v.delta_hold:
            return
        v.delta_hold = False
        if self.early_delta and v.delta_state == "pending":
            for b in v.buckets:
                if b.checksum:
                    self._encode_early(v, b.index)

    def start_delta(self, version: int, *, algorithm: str | None = None) -> None:
        """`make_delta` in the background when `version` expects one (`expect_delta`); `close` cancels it."""
        v = self.versions.get(version)
        if v is not None and v.delta_state == "pending":
            task = asyncio.ensure_future(self.make_delta(version, algorithm=algorithm))
            self._deltas.add(task)
            task.add_done_callback(self._deltas.discard)
            asyncio.get_running_loop().call_later(self.delta_wait_s, self._delta_overdue, v)

    def _delta_overdue(self, v: ServedVersion) -> None:
        """`delta_wait_s` after `v` was complete: if its delta is still being made, the requests parked for it get the
        full version now, and later ones do not wait (the delta, once made, is served to those that ask after)."""
        if self.versions.get(v.version) is not v or v.delta_state != "pending":
            return
        v.delta_overdue = True
        waiting, v.waiting_delta = v.waiting_delta, []
        if waiting:
            log.info("%s: the delta of weight version %d is not made %.1f s after the version was; %d waiting get the full version",
                     self.name, v.version, self.delta_wait_s, len(waiting))
        for ident, req in waiting:
            self.delta_waits_ended += 1
            self._answer_manifest(ident, req, v)

    async def make_delta(self, version: int, *, algorithm: str | None = None) -> DeltaServed | None:
        """Compute `version`'s delta against the version before it from the bytes this server holds (off the loop, in
        `delta_threads` threads; with `early_delta` the buckets encoded as they landed are taken as they are) and serve
        it; the manifest requests waiting for it are answered (a delta, or the full version when there is no base, the
        layouts differ or the delta passes `delta_max_fraction`)."""
        v = self.versions.get(version)
        if v is None:
            return None
        made: DeltaServed | None = None
        t_complete = time.perf_counter()
        timings: dict[str, float] = {}
        try:
            base = self.versions.get(version - 1)
            await self._settling(v)
            if v.delta_state == "pending" and base is not None and not base.released and v.complete:
                if self.early_delta and same_layout(v.buckets, base.buckets):
                    v.delta_hold = False  # (the version is complete: its snapshot's copy is long done)
                    for i in range(len(v.buckets)):
                        self._encode_early(v, i)  # (any bucket not encoded yet)
                    parts = v.delta_parts
                    got = [await asyncio.wrap_future(parts[i][1]) for i in range(len(v.buckets))] if len(parts) == len(v.buckets) else None
                    if got is not None and all(parts[i][0] is base for i in range(len(v.buckets))):
                        made = self._completed(v, base, got, timings)
                else:
                    if v.delta_started == 0.0:
                        v.delta_started = t_complete
                    made = await asyncio.to_thread(self._build_delta, v, base, algorithm, timings)
                if self.versions.get(version - 1) is not base:
                    made = None  # the base was dropped while it was read: its buffers may have been reused under us
        except Exception as exc:  # noqa: BLE001 - a delta is an optimization: the full version is served instead
            log.warning("%s: no delta for weight version %d (%s); full versions only", self.name, version, exc)
            made = None
        finally:
            v.delta_parts = {}
        if self.versions.get(version) is not v:
            return None
        if made is not None and made.shm is None and v.host_key and self.delta_segments is not None and not await self._write_shm(v, made, timings):
            return None
        now = time.perf_counter()
        v.delta, v.delta_state = made, ("ready" if made is not None else "none")
        self._end_early(v)
        if made is not None:
            made.timings = {**made.timings, **timings, "delta_made_s": round(now - (v.delta_started or t_complete), 4),
                            "delta_after_complete_s": round(now - t_complete, 4), "made_at": time.time()}
        self.note_delta(v)
        waiting, v.waiting_delta = v.waiting_delta, []
        for ident, req in waiting:
            self._answer_manifest(ident, req, v)
        return made

    def early_coming(self, version: int) -> None:
        """`version`'s delta made elsewhere will be offered early (`serve_early_delta` follows, with or without its
        mix64): `make_delta` waits for that call, so whichever ends first, the delta served early is the one served on."""
        v = self.versions.get(version)
        if v is not None and v.delta_state == "pending" and not v.delta_settling and v.early_building is None:
            v.early_building = asyncio.get_running_loop().create_future()

    async def serve_early_delta(self, version: int, mix64: Sequence[str] | None, mix_s: float = 0.0) -> DeltaServed | None:
        """`version`'s delta made elsewhere (`take_delta_parts`: the publisher's GPU) served before the version is
        complete, to the manifest requests that verify on their GPU (`ManifestRequest.device_verify`): once every
        bucket's part is finished, with `mix64` (per bucket, the mix64 of the resulting bytes, summed on the publisher's
        GPU) as each bucket's `BucketInfo.host_mix64`; its `checksum` stays the version's as far as it exists (``""``:
        pending). The other askers wait for `make_delta`, which serves this same delta once the version is complete.
        None (nothing served early) when a part failed, a bucket goes whole (its bytes are the version's host copy,
        not there yet), the delta passes `delta_max_fraction`, the version or its base changed meanwhile, or `mix64` is
        None (the publisher could not sum it: this call only ends what `early_coming` began). `mix_s`: the seconds the
        mix64 took (the delta's ``early_mix_s``)."""
        called_at = time.time()
        v = self.versions.get(version)
        if v is None:
            return None
        building = v.early_building
        if building is None:
            if v.delta_settling:
                return None
            building = v.early_building = asyncio.get_running_loop().create_future()
        try:
            base = self.versions.get(version - 1)
            if (mix64 is None or base is None or v.delta_state != "pending" or len(mix64) != len(v.buckets)
                    or len(v.delta_parts) != len(v.buckets)):
                return None
            made = await self._early(v, base, mix64, {"early_mix_s": round(mix_s, 4), "early_called_at": called_at})
            return made
        finally:
            if not building.done():
                building.set_result(None)
            if v.early_building is building:
                v.early_building = None

    async def _early(self, v: ServedVersion, base: ServedVersion, mix64: Sequence[str], given: dict[str, float]) -> DeltaServed | None:
        """`serve_early_delta`'s work (`make_delta` waits for it); `given`: timings of the caller's, kept with the delta's."""
        version = v.version
        parts = dict(v.delta_parts)
        timings: dict[str, float] = dict(given)
        try:
            got = [await asyncio.wrap_future(parts[i][1]) for i in range(len(v.buckets))]
        except Exception:  # noqa: BLE001 - make_delta meets the same failure and says it
            return None
        timings["parts_at"] = time.time()  # (where the early delta's time goes: the bench's early_* phases)
        timings["landed_at"] = max((d.timings.get("landed_at", 0.0) for d, _ in got), default=0.0)
        if (self.versions.get(version) is not v or self.versions.get(version - 1) is not base or v.delta_settling
                or base.released or any(parts[i][0] is not base for i in parts) or any(d.encodings[0] == WHOLE for d, _ in got)):
            return None
        made = self._delta_served(v, base, got, timings)
        if made is None:
            return None
        made.buckets = tuple(replace(b, host_mix64=m) for b, m in zip(made.buckets, mix64, strict=True))
        if v.host_key and self.delta_segments is not None and not await self._write_shm(v, made, timings):
            return None
        if self.versions.get(version) is not v:
            self._give_delta_segment(made)
            return None
        made.timings = {**timings, "early_at": time.time(),
                        "early_made_s": round(time.perf_counter() - (v.delta_started or time.perf_counter()), 4)}
        v.early = made
        self.early_deltas += 1
        waiting, v.waiting_delta = v.waiting_delta, []
        for ident, req in waiting:
            if req.device_verify and req.delta_base == made.base:
                self._answer_manifest(ident, req, v)
            else:
                v.waiting_delta.append((ident, req))
        return made

    def _completed(self, v: ServedVersion, base: ServedVersion, got: list[tuple[DeltaSet, str]], timings: dict[str, float]) -> DeltaServed | None:
        """`v`'s delta (complete) from its buckets' parts: the one served early when there is one (`serve_early_delta`),
        now with each bucket's checksum of the resulting bytes in (a ``whole`` bucket never goes early, so no payload's
        checksum was pending), else made of the parts now."""
        early = v.early
        if early is None or early.base != base.version:
            return self._delta_served(v, base, got, timings)
        early.buckets = tuple(replace(b, checksum=vb.checksum) for b, vb in zip(early.buckets, v.buckets, strict=True))
        return early

    @staticmethod
    async def _settling(v: ServedVersion) -> None:
        """`make_delta` begins for `v`: after an early delta under way (the delta served early is the one served on),
        and none served early from now on."""
        if v.early_building is not None:
            await asyncio.shield(v.early_building)
        v.delta_settling = True

    def _end_early(self, v: ServedVersion) -> None:
        """`v`'s delta is settled (`v.delta`): an early one not served on as it (no delta now, or another) gives its
        segment back, and its askers' fetches of it answer ``gone`` (they fetch the version whole)."""
        if v.early is not v.delta:
            self._give_delta_segment(v.early)
        if v.early is not None:
            self.served_changes.value += 1
        v.early = None

    async def _write_shm(self, v: ServedVersion, made: DeltaServed, timings: dict[str, float]) -> bool:
        """`made` (the delta of `v`, held in shared memory) written to a segment of its own too, off the loop; False when
        `v` was dropped meanwhile (the segment goes back). A failure to write it is logged: the network serves it."""
        t = time.perf_counter()
        try:
            await asyncio.to_thread(self._delta_to_shm, made, v.version)
        except Exception as exc:  # noqa: BLE001 - no room or no /dev/shm: the delta still goes over the network
            self._errlog.warning("delta_shm", "%s: the delta of weight version %d not in shared memory (%s); over the network only",
                                 self.name, v.version, exc)
        timings["shm_write_s"] = round(time.perf_counter() - t, 4)
        if self.versions.get(v.version) is not v:
            self._give_delta_segment(made)
            return False
        return True

    def _delta_to_shm(self, made: DeltaServed, version: int) -> None:
        """Write `made`'s encoded bytes into a segment of `delta_segments` (laid out by `payload_offsets`), its header
        naming `version` once they are all there; runs in a thread, before the delta is served."""
        import numpy as np

        from rollpool.weights.delta import payload_offsets

        pool = self.delta_segments
        assert pool is not None
        sizes = [b.nbytes for b in made.payload.buckets]
        offsets, total = payload_offsets(sizes)
        buf = pool.take_free(_segment_bytes(total))
        if buf is None:
            self.delta_shm_fresh += 1
            buf = pool.take_at_least(_segment_bytes(total))
        seg = pool.segment_of(buf)
        if seg is None:
            pool.give([buf])
            raise ValueError("the delta's buffer is not a shared-memory segment")
        out = buf.numpy()

        def put(src: BucketSource, at: int, n: int) -> None:
            data = src.read(0, n) if n else b""
            if data is None:
                raise ValueError("a delta's encoded bytes are not all there")
            out[at : at + n] = np.frombuffer(data, dtype=np.uint8, count=n)

        try:
            seg.begin_write()
            # the buckets' copies side by side in the delta's threads (numpy copies without the GIL; their parts are
            # all done by now, so none of them waits for this thread): one thread wrote 0.6 GB at 8B in ~0.13 s
            for f in [self._delta_threads().submit(put, *job) for job in zip(made.payload.sources, offsets, sizes, strict=True)]:
                f.result()
            seg.end_write(version)
        except BaseException:
            pool.give([buf])
            raise
        made.shm, made.shm_buffer = ShmSegment(name=seg.name, nbytes=seg.nbytes), buf
        self.delta_shm_written += 1
        self.spare_delta_segment(_segment_bytes(total))

    def spare_delta_segment(self, nbytes: int) -> None:
        """A free delta segment of `nbytes` for the next delta, made and its pages touched in a thread of its own
        (none while one is under way, none when one is free): a fresh segment costs its first write a page fault per
        4 KiB (on an H100 host at 8B, ~0.6 GB of encoded bytes: the write took 0.26-0.32 s in a fresh segment against
        0.02 s in a used one, all of it before the delta was served). The segments held for the versions served and
        the free ones are what they were (`_give_delta_segment` trims the free ones), with one made a version earlier."""
        pool = self.delta_segments
        if pool is None or pool.has_free(nbytes) or (self._spare_thread is not None and self._spare_thread.is_alive()):
            return

        def make() -> None:
            try:
                pool.reserve([nbytes])
            except Exception as exc:  # noqa: BLE001 - no room: the next delta makes its segment as it is written
                log.debug("%s: no spare delta segment of %d bytes (%s)", self.name, nbytes, exc)

        self._spare_thread = threading.Thread(target=make, name=f"{self.name}-delta-spare", daemon=True)
        self._spare_thread.start()

    def _give_delta_segment(self, made: DeltaServed | None) -> None:
        """`made`'s segment back to `delta_segments` (its header says no version first: a reader of it sees a torn read)."""
        if made is None or made.shm_buffer is None or self.delta_segments is None:
            return
        seg = self.delta_segments.segment_of(made.shm_buffer)
        if seg is not None:
            seg.begin_write()
        self.delta_segments.give([made.shm_buffer])
        self.delta_segments.trim(2 * int(made.shm_buffer.numel()))  # a spare or two for the next deltas, no more
        made.shm, made.shm_buffer = None, None

    def note_delta(self, v: ServedVersion) -> None:
        """`v` carries a delta now (made here, or a relay's from upstream): `last_delta` and the ``weight_delta`` event
        (with the phases' seconds where it was made here: ``compare_s``, ``encode_s`` and ``checksum_s`` summed over the
        buckets, ``delta_made_s`` from its first bucket's encode to ready, ``delta_after_complete_s`` from the version's
        last checksum to ready, ``made_at`` the wall clock then)."""
        made = v.delta
        if made is None:
            return
        self.last_delta = {"version": v.version, "base": made.base, "changed_fraction": made.changed_fraction,
                           "wire_bytes": made.wire_bytes, "model_bytes": v.total_bytes, "bytes_by_encoding": dict(made.bytes_by_encoding),
                           **made.timings}
        self.metrics.event("weight_delta", {"publisher": self.name, **self.last_delta})

    def _build_delta(self, v: ServedVersion, base: ServedVersion, algorithm: str | None, timings: dict[str, float]) -> DeltaServed | None:
        from rollpool.weights.bucketing import checksum
        from rollpool.weights.delta import compute_delta

        new = [_whole(s, b.nbytes) for s, b in zip(v.sources, v.buckets, strict=True)]
        old = [_whole(s, b.nbytes) for s, b in zip(base.sources, base.buckets, strict=True)]
        ds = compute_delta(new, old, v.buckets, base.buckets, base_version=base.version, threads=self.delta_threads,
                           max_fraction=self.delta_max_fraction)
        if ds is None:
            return None
        algo = algorithm or v.buckets[0].checksum.partition(":")[0] or None
        t = time.perf_counter()
        digests = [checksum(p.numpy().data, algo) if p is not None and enc != WHOLE else "" for enc, p in zip(ds.encodings, ds.payloads, strict=True)]
        timings.update(ds.timings, checksum_s=round(time.perf_counter() - t, 4))
        return self._served_payload(v, base, ds, digests)

    def _delta_served(self, v: ServedVersion, base: ServedVersion, got: list[tuple[DeltaSet, str]], timings: dict[str, float]) -> DeltaServed | None:
        """The buckets encoded one by one (`_encode_early`) as one delta, unless it passes `delta_max_fraction`."""
        ds = DeltaSet(base=base.version, encodings=[d.encodings[0] for d, _ in got], payloads=[d.payloads[0] for d, _ in got],
                      changed_elements=sum(d.changed_elements for d, _ in got), total_elements=sum(d.total_elements for d, _ in got))
        for key in ("compare_s", "encode_s", "checksum_s", "pin_s"):  # (pin_s: of encode_s, a device delta's page-locked payloads)
            timings[key] = round(sum(d.timings.get(key, 0.0) for d, _ in got), 4)
        total = v.total_bytes
        if total and ds.wire_bytes > self.delta_max_fraction * total:
            return None
        return self._served_payload(v, base, ds, [digest for _, digest in got])

    def _served_payload(self, v: ServedVersion, base: ServedVersion, ds: DeltaSet, digests: list[str]) -> DeltaServed:
        infos: list[BucketInfo] = []
        pinfos: list[BucketInfo] = []
        psources: list[BucketSource] = []
        for b, enc, payload, digest in zip(v.buckets, ds.encodings, ds.payloads, digests, strict=True):
            if payload is None:
                infos.append(replace(b, encoding=enc, delta_nbytes=0, delta_checksum=""))
                continue
            if enc == WHOLE:
                src, digest = v.sources[b.index], b.checksum  # the version's own bytes: no second copy
            else:
                src = TensorSource(payload)
            n = int(payload.numel())
            infos.append(replace(b, encoding=enc, delta_nbytes=n, delta_checksum=digest))
            pinfos.append(BucketInfo(index=len(pinfos), dtype="uint8", nbytes=n, checksum=digest))
            psources.append(src)
        payload_version = ServedVersion(version=v.version, publisher_id=v.publisher_id, buckets=tuple(pinfos), sources=psources,
                                        chunk_bytes=v.chunk_bytes)
        return DeltaServed(base=base.version, buckets=tuple(infos), payload=payload_version, changed_fraction=ds.changed_fraction,
                           bytes_by_encoding=ds.bytes_by_encoding())

    def _answer_manifest(self, ident: bytes, req: ManifestRequest, v: ServedVersion) -> None:
        """A version's manifest for this asker: its delta when it holds the base and one is served, else the full one."""
        d = v.delta
        early = d is None and req.device_verify and v.early is not None
        if early:
            d = v.early
        if req.delta_base >= 0 and d is not None and d.base == req.delta_base and not v.released:
            self.deltas_served += 1
            self.early_deltas_served += early
            # each bucket's mix64 of its bytes (the resulting bytes: minor 27), where it came after the delta was made, and
            # (an early delta) each checksum of them that exists by now
            buckets = tuple(replace(b, host_mix64=b.host_mix64 or vb.host_mix64, checksum=b.checksum or vb.checksum)
                            for b, vb in zip(d.buckets, v.buckets, strict=True))
            self._send(ident, replace(v.manifest(req.request_id), buckets=buckets, delta_base=d.base, delta_shm=d.shm))
            return
        if req.delta_base >= 0:
            self.full_served_to_delta_askers += 1
        self._send(ident, v.manifest(req.request_id))

    def complete_ipc(self, version: int, bucket: int, checksum: str) -> None:
        """A bucket's GPU checksum exists (the same-GPU path): the manifest requests waiting for all of them are answered."""
        v = self.versions.get(version)
        if v is None:
            return
        v.set_ipc_checksum(bucket, checksum)
        if v.ipc_complete and v.waiting_ipc:
            waiting, v.waiting_ipc = v.waiting_ipc, []
            for ident, req in waiting:
                self._send(ident, v.manifest(req.request_id))

    def set_host_mix64(self, version: int, bucket: int, checksum: str) -> None:
        """A bucket's mix64 of its host bytes (minor 10): manifests answered from now on carry it, and the requests
        parked for more of them (``after_mix64``) are answered now."""
        v = self.versions.get(version)
        if v is None:
            return
        v.buckets = tuple(replace(b, host_mix64=checksum) if b.index == bucket else b for b in v.buckets)
        if v.waiting_mix64:
            waiting, v.waiting_mix64 = v.waiting_mix64, []
            for ident, req in waiting:
                if v.mix64_waits(req.after_mix64):
                    v.waiting_mix64.append((ident, req))
                else:
                    self.parked_manifests_served += 1
                    self._send(ident, v.manifest(req.request_id))

    def bytes_landed(self, version: int) -> None:
        """Buckets of a streamed version are copied, their checksums not yet made (any thread): the bulk lane's requests
        that take bytes before the checksum (``RPBE``) and wait for them are woken."""
        if self.bulk is not None:
            self.bulk.notify()

    def complete_bucket(self, version: int, bucket: int, checksum: str) -> None:
        """A streamed version's bucket is snapshotted and checksummed: serve it, and the manifest once all are."""
        v = self.versions.get(version)
        if v is None:
            return
        v.set_checksum(bucket, checksum)
        self.notify_arrived(version)
        if self.early_delta and v.delta_state == "pending":
            self._encode_early(v, bucket)
        if v.complete and v.waiting_manifests:
            waiting, v.waiting_manifests = v.waiting_manifests, []
            for ident, req in waiting:
                self._send(ident, v.manifest(req.request_id))

    def announce(self, v: ServedVersion) -> None:
        if self._pub is None:
            return
        import zmq

        msg = Announce(version=v.version, publisher_id=v.publisher_id, total_bytes=v.total_bytes, num_buckets=len(v.buckets),
                       shm_generation=self.shm_generation)
        send_now(self._pub, encode(msg), flags=zmq.DONTWAIT)

    def notify_arrived(self, version: int) -> None:
        """Bytes of `version` arrived: answer the parked fetches that can now be served."""
        if self.bulk is not None:
            self.bulk.notify()
        parked = self._parked.get(version)
        if not parked:
            return
        v = self.versions.get(version)
        if v is None:
            return
        still: list[tuple[bytes, Fetch]] = []
        for ident, req in parked:
            data = v.sources[req.bucket].read(req.offset, req.nbytes)
            if data is None:
                still.append((ident, req))
            else:
                self.parked_served += 1
                self._send_chunk(ident, v, req, data)
        if still:
            self._parked[version] = still
        else:
            del self._parked[version]

    # -- loops

    async def _serve_loop(self) -> None:
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) < 2:
                continue
            ident, body = frames[0], frames[1:]
            try:
                msg = decode(body, accept=self._accepts)
            except ProtocolError as exc:
                self.protocol_errors += 1
                self._errlog.warning(ident.hex(), "%s: malformed message from peer %s: %s", self.name, ident.hex(), exc)
                self._send(ident, Error(code=exc.code, message=exc.message, ref_type=peek_type(body)))
                continue
            self._handle(ident, msg)

    async def _announce_loop(self) -> None:
        while True:
            await asyncio.sleep(self.announce_interval_s)
            v = self.latest
            if v is not None:
                self.announce(v)

    # -- requests

    def _handle(self, ident: bytes, msg: Any) -> None:
        if isinstance(msg, Fetch):
            self._fetch(ident, msg)
        elif isinstance(msg, ManifestRequest):
            self._manifest(ident, msg)
        else:
            self.protocol_errors += 1
            rid = getattr(msg, "request_id", None)
            self._send(ident, Error(code="unexpected", message=f"{self.name} serves manifest_request and fetch only", request_id=rid if isinstance(rid, str) else None, ref_type=getattr(msg, "TYPE", None)))

    def _missing(self, version: int, request_id: str, ref_type: str) -> Error:
        latest = self.latest
        latest_v = latest.version if latest is not None else -1
        if version <= max(self.highest_dropped, latest_v):
            return Error(code="gone", message=f"version {version} is no longer served (latest is {latest_v})", request_id=request_id, ref_type=ref_type)
        return Error(code="unknown_version", message=f"version {version} is not published (latest is {latest_v})", request_id=request_id, ref_type=ref_type)

    def _manifest(self, ident: bytes, req: ManifestRequest) -> None:
        if self.on_manifest_request is not None:
            self.on_manifest_request(req)
        if req.version is None:
            v = self.latest
            if v is not None and not v.complete and not req.streamed:
                # a minor-0 peer: the newest complete version, else wait for this one
                done = [x for x in self.versions.values() if x.complete]
                v = max(done, key=lambda x: x.version) if done else v
            if v is None:
                self._send(ident, Manifest(request_id=req.request_id, version=-1))
                return
        else:
            found = self.versions.get(req.version)
            if found is None:
                self._send(ident, self._missing(req.version, req.request_id, "manifest_request"))
                return
            v = found
        if self.ring is not None and self.ring.take_request(ident, req, v, self._send):
            return
        if req.wait_ipc and not v.ipc_complete:
            self._park(ident, req, v.waiting_ipc)
            return
        if not req.wait_ipc and not v.complete and not req.streamed:
            self._park(ident, req, v.waiting_manifests)
            return
        if req.after_mix64 >= 0 and v.mix64_waits(req.after_mix64):
            self._park(ident, req, v.waiting_mix64)
            return
        if req.delta_base >= 0 and req.delta_base == v.version - 1 and v.delta_state == "pending" and not v.delta_overdue:
            if not (req.device_verify and v.early is not None and v.early.base == req.delta_base):
                self._park(ident, req, v.waiting_delta)
                return
        self._answer_manifest(ident, req, v)

    def _park(self, ident: bytes, req: ManifestRequest, waiting: list[tuple[bytes, ManifestRequest]]) -> None:
        """A manifest request waits in `waiting` (answered ``busy`` when `max_parked` already do)."""
        if len(waiting) >= self.max_parked:
            self._send(ident, Error(code="busy", message="too many manifest requests waiting", request_id=req.request_id, ref_type="manifest_request"))
            return
        waiting.append((ident, req))

    def read_chunk(self, version: int, bucket: int, offset: int, nbytes: int, delta_base: int = -1, early: bool = False) -> ChunkRead:
        """The one lookup of a chunk, for the ROUTER and the bulk lane alike: its bytes (None: not arrived yet) and its
        bucket's checksum, or an error code (``gone``, ``unknown_version``, ``bad_range``) and message. A version read
        from counts as requested now (``keep_versions=0`` releases after an idle spell). `early` (the lane's ``RPBE``,
        minor 30): a chunk that does not end its bucket is answered once its bytes are in place, before the bucket's
        checksum (the text is then ``""``); the chunk that ends it waits for the checksum, as every chunk of ``RPBQ``."""
        v = self.versions.get(version)
        if v is None:
            err = self._missing(version, "", "fetch")
            return ChunkRead(err.code, err.message)
        if delta_base >= 0:
            d = v.delta or v.early
            if d is None or d.base != delta_base:
                return ChunkRead("gone", f"version {version}'s delta against {delta_base} is not served")
            v = d.payload
        if v.released:
            return ChunkRead("gone", f"version {v.version} was released by its publisher (keep_versions=0)")
        if not 0 <= bucket < len(v.buckets):
            return ChunkRead("bad_range", f"bucket {bucket} out of range")
        size = v.buckets[bucket].nbytes
        if nbytes < 1 or nbytes > MAX_CHUNK_BYTES or offset < 0 or offset + nbytes > size:
            return ChunkRead("bad_range", f"[{offset}, +{nbytes}) is not a chunk of bucket {bucket} ({size} bytes, at most {MAX_CHUNK_BYTES} per chunk)")
        if self._loop is not None:
            v.last_request_s = self._loop.time()
        source = v.sources[bucket]
        data = source.read(offset, nbytes)
        if data is None and early and offset + nbytes < size:
            read_early = getattr(source, "read_early", None)  # (a snapshot's landed bytes, a relay's arrived chunks)
            data = read_early(offset, nbytes) if read_early is not None else None
        return ChunkRead("", v.buckets[bucket].checksum, data, v)

    def _fetch(self, ident: bytes, req: Fetch) -> None:
        got = self.read_chunk(req.version, req.bucket, req.offset, req.nbytes, req.delta_base)
        if got.code:
            self._send(ident, Error(code=got.code, message=got.text, request_id=req.request_id, ref_type="fetch"))
            return
        if got.data is None:
            parked = self._parked.setdefault(req.version, [])
            if len(parked) >= self.max_parked:
                self._send(ident, Error(code="busy", message="too many requests waiting for bytes to arrive", request_id=req.request_id, ref_type="fetch"))
                return
            parked.append((ident, req))
            return
        self._send_chunk(ident, got.version, req, got.data)

    def _send_chunk(self, ident: bytes, v: ServedVersion, req: Fetch, data: Any) -> None:
        msg = Chunk(request_id=req.request_id, version=req.version, bucket=req.bucket, offset=req.offset, data=data,
                    checksum=v.buckets[req.bucket].checksum)
        if self._send(ident, msg, copy=False):
            self.bytes_served += req.nbytes
            self.chunks_served += 1
            self._served_to(v, peer_of(ident), req.nbytes)

    def bulk_served(self, v: Any, peer: bytes, nbytes: int, parked: bool = False, chunks: int = 1) -> None:
        """`chunks` chunks of `v`, `nbytes` in all, went out over the bulk lane (told on the loop by `BulkServer`: one
        at a time, or those its compiled send loop sent in one call): counted as the ROUTER's are (`parked`: it waited
        for its bytes to arrive, as a parked fetch), and `v` counts as requested now (``keep_versions=0`` releases
        after an idle spell; the lane reads a bucket's later chunks off the loop)."""
        self.parked_served += parked
        self.bytes_served += nbytes
        self.bulk_bytes_served += nbytes
        self.chunks_served += chunks
        if self._loop is not None:
            v.last_request_s = self._loop.time()
        self._served_to(v, peer, nbytes)

    def still_serves(self, version: int, v: ServedVersion) -> bool:
        """Whether `v` (what `read_chunk` of `version` answered from: the version or its delta's payload) is still
        served. Called by the bulk lane's connection threads, off the loop: it reads a dict and attributes only."""
        owner = self.versions.get(version)
        if owner is None or v.released:
            return False
        return v is owner or any(d is not None and d.payload is v for d in (owner.delta, owner.early))

    def _served_to(self, v: ServedVersion, peer: bytes, nbytes: int) -> None:
        v.served_by_peer[peer] = v.served_by_peer.get(peer, 0) + nbytes
        self._served.set()

    async def serve_until_released(self, served: ServedVersion, expected_fetchers: int | None, *, max_hold_s: float,
                                   release_idle_s: float) -> None:
        """A version served from its owner's own tensors (``keep_versions=0``): wait until it is released (every
        `expected_fetchers` peer got every byte, no request for `release_idle_s`, or `max_hold_s` passed), then stop
        serving its bytes; its manifest stays answerable (subscribers learn the number) and fetches answer ``gone``."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        served.last_request_s = start
        total = served.total_bytes
        try:
            while total:  # nothing to serve: the manifest alone is the version
                done = sum(1 for n in served.served_by_peer.values() if n >= total)
                if expected_fetchers is not None and done >= expected_fetchers:
                    break
                now = loop.time()
                if now - start >= max_hold_s or now - served.last_request_s >= release_idle_s:
                    break
                self._served.clear()
                wait_s = min(max_hold_s - (now - start), release_idle_s - (now - served.last_request_s))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._served.wait(), timeout=max(0.001, wait_s))
        finally:
            if total:
                served.released = True
                self.served_changes.value += 1
                served.sources = []

    def stats(self) -> dict[str, int]:
        """What this server served (the publisher's and the relay's `stats` include it)."""
        d = self.last_delta
        return {"bytes_served": self.bytes_served, "chunks_served": self.chunks_served, "dropped_replies": self.dropped_replies,
                "protocol_errors": self.protocol_errors, "delta_manifests_served": self.deltas_served,
                "full_manifests_to_delta_askers": self.full_served_to_delta_askers, "delta_waits_ended": self.delta_waits_ended,
                "last_delta_version": int(d.get("version", -1)), "last_delta_wire_bytes": int(d.get("wire_bytes", 0)),
                "last_delta_changed_ppm": round(float(d.get("changed_fraction", 0.0)) * 1e6),
                "bulk_early_chunks": self.bulk.early_chunks if self.bulk is not None else 0}

    def _send(self, ident: bytes, msg: Any, *, copy: bool = True) -> bool:
        import zmq

        if self._router is None:
            return False
        if isinstance(msg, Manifest):
            if self.ring is not None:
                msg = self.ring.outgoing(ident, msg)
            if self.shm_reserved:
                msg = replace(msg, shm_reserved=self.shm_reserved, host_key=msg.host_key or self.shm_host_key, protocol_minor=PROTOCOL_MINOR)
            else:
                msg = replace(msg, protocol_minor=PROTOCOL_MINOR)
        exc = send_now(self._router, [ident, *encode(msg)], flags=zmq.DONTWAIT, copy=copy)
        if exc is None:
            return True
        # Again (the peer's queue is full) or EHOSTUNREACH (the peer left)
        self.dropped_replies += 1
        self._errlog.warning("send:" + ident.hex(), "%s: reply to peer %s dropped: %s", self.name, ident.hex(), exc)
        return False


def new_server_id() -> str:
    return uuid.uuid4().hex[:12]
