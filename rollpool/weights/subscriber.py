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
import itertools
import logging
import os
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from rollpool.protocol.codec import decode, encode
from rollpool.protocol.errors import ProtocolError, WeightSyncError
from rollpool.protocol.logs import RateLimitedLog
from rollpool.protocol.messages import Announce, Chunk, Error, Fetch, Manifest, ManifestRequest
from rollpool.protocol.metrics import MetricsSink, NullMetricsSink
from rollpool.protocol.sockets import SocketFactory
from rollpool.weights.bucketing import (
    Checksummer,
    check_bucket_info,
    checksum_supported,
    unpack_buckets,
    verify_checksum,
)
from rollpool.weights.serving import MAX_CHUNK_BYTES, send_now
from rollpool.weights.wire import build

__all__ = ["WeightVersion", "WeightSubscriber", "WeightVersionGoneError", "TransferSink"]

log = logging.getLogger(__name__)

_MIN_CHUNK_BYTES = 4096


@dataclass(frozen=True, slots=True)
class WeightVersion:
    """A complete, verified weight version."""

    version: int
    tensors: dict[str, torch.Tensor]
    """Named tensors, views of `buffers` (no copy)."""
    manifest: Manifest
    buffers: tuple[torch.Tensor, ...] = ()
    """The verified buckets as 1-D uint8 tensors, in manifest order (e.g. for SGLang's flattened buckets)."""

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.manifest.buckets)


class WeightVersionGoneError(WeightSyncError):
    """The publisher no longer serves the version (evicted, or released with keep_versions=0)."""

    def __init__(self, version: int, message: str) -> None:
        super().__init__(f"weight version {version} is gone: {message}")
        self.version = version


class TransferSink(Protocol):
    """Told of a transfer's progress (the relay forwards chunks as they arrive)."""

    def on_chunk(self, bucket: int, offset: int, nbytes: int) -> None: ...

    def on_bucket_reset(self, bucket: int) -> None: ...


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
    ) -> None:
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
        self.router_endpoint: str | None = None
        self.pub_endpoint: str | None = None
        self.bytes_received = 0
        self.buckets_refetched = 0
        self.protocol_errors = 0
        self._latest = -1
        self._hint = -1
        self._changed = asyncio.Event()
        self._dealer: Any = None
        self._sub: Any = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._catch_up: asyncio.Task[None] | None = None
        self._routes: dict[str, Callable[[Any], None]] = {}
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._errlog = RateLimitedLog(log)
        self._free: dict[int, list[torch.Tensor]] = {}

    # -- connection

    def connect(self, router_endpoint: str, pub_endpoint: str | None = None) -> None:
        """Connect (or reconnect to new endpoints) and ask for the latest version. Needs a running loop."""
        if (router_endpoint, pub_endpoint) == (self.router_endpoint, self.pub_endpoint) and self._dealer is not None:
            return
        self._close_sockets()
        self.router_endpoint, self.pub_endpoint = router_endpoint, pub_endpoint
        identity = f"{self.worker_id}/{self._prefix}".encode()[:255]
        self._dealer = self.sockets.dealer(router_endpoint, identity=identity)
        self._spawn(self._recv_loop(self._dealer), "_recv_loop")
        if pub_endpoint:
            self._sub = self.sockets.sub(pub_endpoint)
            self._spawn(self._announce_loop(self._sub), "_announce_loop")
        self._ask_latest()

    @property
    def connected(self) -> bool:
        return self._dealer is not None

    def close(self) -> None:
        self._close_sockets()
        self._free = {}

    async def aclose(self) -> None:
        tasks = list(self._tasks)
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
        self._routes.clear()
        for s in (self._dealer, self._sub):
            if s is not None:
                s.close(linger=0)
        self._dealer = self._sub = None

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

    async def wait_for_newer(self, than: int, timeout_s: float | None = None) -> int:
        """Wait until a version newer than `than` is known; return it. `WeightSyncError` after `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while self._latest <= than:
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
        if self._dealer is None or (self._catch_up is not None and not self._catch_up.done()):
            return
        self._catch_up = self._spawn(self._catch_up_once(), "_catch_up")

    async def _catch_up_once(self) -> None:
        try:
            await self.fetch_manifest(None, attempts=1)
        except WeightSyncError as exc:
            self._errlog.warning("latest", "asking %s for the latest weight version failed: %s", self.router_endpoint, exc)

    # -- loops

    async def _recv_loop(self, dealer: Any) -> None:
        while True:
            frames = await dealer.recv_multipart(copy=False)
            try:
                msg = decode(frames)
            except ProtocolError as exc:
                self.protocol_errors += 1
                self._errlog.warning("recv", "malformed message from weight publisher %s: %s", self.router_endpoint, exc)
                continue
            rid = getattr(msg, "request_id", None)
            route = self._routes.get(rid) if isinstance(rid, str) else None
            if route is not None:
                route(msg)
            elif isinstance(msg, Error):
                self._errlog.warning("error", "weight publisher error without a pending request: %s: %s", msg.code, msg.message)

    async def _announce_loop(self, sub: Any) -> None:
        while True:
            frames = await sub.recv_multipart()
            try:
                msg = decode(frames)
            except ProtocolError as exc:
                self.protocol_errors += 1
                self._errlog.warning("sub", "malformed announcement from %s: %s", self.pub_endpoint, exc)
                continue
            if isinstance(msg, Announce):
                self._observe(msg.version)

    # -- requests

    def _request_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    def _send(self, msg: Any) -> bool:
        import zmq

        if self._dealer is None:
            raise WeightSyncError("the weight subscriber is not connected")
        return send_now(self._dealer, encode(msg), flags=zmq.DONTWAIT) is None

    async def fetch_manifest(self, version: int | None = None, *, attempts: int | None = None) -> Manifest:
        """The manifest of `version` (None: the latest). Retries a silent publisher up to `max_refetch` times."""
        tries = (self.max_refetch + 1) if attempts is None else attempts
        loop = asyncio.get_running_loop()
        for _attempt in range(tries):
            rid = self._request_id()
            fut: asyncio.Future[Any] = loop.create_future()
            self._routes[rid] = _resolver(fut)
            try:
                self._send(build(ManifestRequest, request_id=rid, version=version))
                reply = await asyncio.wait_for(fut, self.fetch_timeout_s)
            except TimeoutError:
                continue
            finally:
                self._routes.pop(rid, None)
            if isinstance(reply, Manifest):
                if reply.version >= 0:
                    self._observe(reply.version)
                return reply
            if isinstance(reply, Error):
                if reply.code == "gone":
                    raise WeightVersionGoneError(-1 if version is None else version, reply.message)
                raise WeightSyncError(f"publisher refused the manifest request: {reply.code}: {reply.message}")
            raise WeightSyncError(f"publisher answered a manifest request with {type(reply).__name__}")
        what = "latest" if version is None else str(version)
        raise WeightSyncError(f"no manifest ({what}) from {self.router_endpoint} within {tries} x {self.fetch_timeout_s} s")

    async def fetch(self, version: int | None = None) -> WeightVersion:
        """Fetch and verify a whole version (None: the latest). Raises `WeightSyncError`; never returns part of one."""
        moves = 0
        while True:
            manifest = await self.fetch_manifest(version)
            if manifest.version < 0:
                raise WeightSyncError(f"publisher {self.router_endpoint} holds no weight version yet")
            buffers = [self._buffer(b.nbytes) for b in _checked(manifest).buckets]
            try:
                await self.fetch_into(manifest, buffers)
            except WeightVersionGoneError:
                self._recycle_buffers(buffers)
                if version is not None or moves >= self.max_refetch:
                    raise
                moves += 1
                log.info("weight version %d was evicted while being fetched; moving to the latest", manifest.version)
                continue
            tensors = unpack_buckets(zip(manifest.buckets, buffers, strict=True))
            self.metrics.event("version_fetched", {"worker_id": self.worker_id, "version": manifest.version, "bytes": sum(b.nbytes for b in manifest.buckets)})
            return WeightVersion(version=manifest.version, tensors=tensors, manifest=manifest, buffers=tuple(buffers))

    def recycle(self, old: WeightVersion) -> None:
        """Hand back a version the caller no longer uses (its tensors were copied into the engine).

        The next fetch reuses its bucket buffers where the sizes match (they do
        when every version has the same layout), which spares the page faults
        of fresh memory: about 5x the cost of the copy itself on first touch.
        The caller must not use `old`'s tensors afterwards.
        """
        self._recycle_buffers(list(old.buffers))

    def _recycle_buffers(self, buffers: list[torch.Tensor]) -> None:
        self._free = {}  # hold at most one version's worth
        for b in buffers:
            self._free.setdefault(int(b.numel()), []).append(b)

    def _buffer(self, nbytes: int) -> torch.Tensor:
        free = self._free.get(nbytes)
        if free:
            return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)

    async def fetch_into(self, manifest: Manifest, buffers: list[torch.Tensor], sink: TransferSink | None = None) -> None:
        """Fill `buffers` (1-D uint8, one per bucket) with `manifest`'s buckets and verify each one."""
        _checked(manifest)
        if len(buffers) != len(manifest.buckets):
            raise ValueError("one buffer per bucket")
        transfer = _Transfer(self, manifest, buffers, sink)
        await transfer.run()


def _resolver(fut: asyncio.Future[Any]) -> Callable[[Any], None]:
    def resolve(msg: Any) -> None:
        if not fut.done():
            fut.set_result(msg)

    return resolve


def _checked(manifest: Manifest) -> Manifest:
    try:
        for i, b in enumerate(manifest.buckets):
            if b.index != i:
                raise ValueError(f"bucket {i} has index {b.index}")
            check_bucket_info(b)
            algo = b.checksum.partition(":")[0]
            if not checksum_supported(algo):
                raise ValueError(f"bucket {i}: checksum algorithm {algo!r} cannot be verified here (xxh3_64 needs the xxhash package)")
    except ValueError as exc:
        raise WeightSyncError(f"manifest of version {manifest.version} is invalid: {exc}") from exc
    return manifest


class _Transfer:
    """One windowed, verified transfer of a manifest's buckets into buffers."""

    def __init__(self, sub: WeightSubscriber, manifest: Manifest, buffers: list[torch.Tensor], sink: TransferSink | None) -> None:
        self.sub = sub
        self.manifest = manifest
        self.buffers = buffers
        self.views = [b.numpy() for b in buffers]
        self.sink = sink
        self.chunk = min(max(manifest.chunk_bytes, _MIN_CHUNK_BYTES), MAX_CHUNK_BYTES)
        self.todo: deque[tuple[int, int, int]] = deque()
        self.outstanding: dict[str, tuple[int, int, int]] = {}
        self.received = [0] * len(buffers)
        self.sums = [Checksummer.for_digest(b.checksum) for b in manifest.buckets]
        self.summed_to = [0] * len(buffers)
        self.failures = [0] * len(buffers)
        self.replies: asyncio.Queue[Any] = asyncio.Queue()
        # Copying a chunk into its bucket and folding it into the checksum run in one worker
        # thread (both release the GIL), in arrival order, while the loop keeps receiving.
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="weights-absorb")
        self.pending: deque[tuple[asyncio.Future[None], int, int, int]] = deque()
        for i, b in enumerate(manifest.buckets):
            self.todo.extend(self._chunks_of(i))
            if b.nbytes == 0:
                self._verify(i)

    def _chunks_of(self, bucket: int) -> list[tuple[int, int, int]]:
        n = self.manifest.buckets[bucket].nbytes
        return [(bucket, off, min(self.chunk, n - off)) for off in range(0, n, self.chunk)]

    async def run(self) -> None:
        sub = self.sub
        stalls = 0
        try:
            while self.todo or self.outstanding or self.pending:
                while self.todo and len(self.outstanding) < sub.window_chunks:
                    self._request(self.todo.popleft())
                if self.pending and (len(self.pending) >= sub.window_chunks or not self.outstanding):
                    await self.pending[0][0]  # a memcpy and a crc: bounded, no network wait
                    self._settle()
                    continue
                try:
                    msg = await asyncio.wait_for(self.replies.get(), sub.fetch_timeout_s)
                except TimeoutError:
                    stalls += 1
                    if stalls > sub.max_refetch:
                        raise WeightSyncError(
                            f"weight version {self.manifest.version}: no reply from {sub.router_endpoint} "
                            f"for {stalls} x {sub.fetch_timeout_s} s ({len(self.outstanding)} chunks outstanding)"
                        ) from None
                    self._requeue_outstanding()
                    continue
                if self._handle(msg):
                    stalls = 0
                self._settle()
        finally:
            for rid in self.outstanding:
                sub._routes.pop(rid, None)
            self.pool.shutdown(wait=True, cancel_futures=True)

    def _request(self, req: tuple[int, int, int]) -> None:
        rid = self.sub._request_id()
        bucket, offset, nbytes = req
        self.outstanding[rid] = req
        self.sub._routes[rid] = self.replies.put_nowait
        # a send that cannot be queued is like a lost reply: the timeout asks again
        self.sub._send(build(Fetch, request_id=rid, version=self.manifest.version, bucket=bucket, offset=offset, nbytes=nbytes))

    def _requeue_outstanding(self) -> None:
        reqs = sorted(self.outstanding.values())
        for rid in self.outstanding:
            self.sub._routes.pop(rid, None)
        self.outstanding.clear()
        self.todo.extendleft(reversed(reqs))

    def _handle(self, msg: Any) -> bool:
        """Apply one reply; True if it was progress."""
        req = self.outstanding.pop(msg.request_id, None)
        self.sub._routes.pop(msg.request_id, None)
        if req is None:
            return False
        bucket, offset, nbytes = req
        if isinstance(msg, Error):
            if msg.code == "gone":
                raise WeightVersionGoneError(self.manifest.version, msg.message)
            raise WeightSyncError(f"weight version {self.manifest.version}: publisher refused a fetch: {msg.code}: {msg.message}")
        if not isinstance(msg, Chunk) or (msg.version, msg.bucket, msg.offset) != (self.manifest.version, bucket, offset) or memoryview(msg.data).nbytes != nbytes:
            self._fail_chunk(req, "a reply that does not match its request")
            return True
        fut = asyncio.get_running_loop().run_in_executor(self.pool, self._absorb, bucket, offset, msg.data)
        self.pending.append((fut, bucket, offset, nbytes))
        self.sub.bytes_received += nbytes
        return True

    def _absorb(self, bucket: int, offset: int, data: Any) -> None:
        """Worker thread: copy one chunk into its bucket and fold it into the running checksum."""
        self.views[bucket][offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
        if self.summed_to[bucket] == offset:
            self.sums[bucket].update(data)
            self.summed_to[bucket] += len(data)

    def _settle(self) -> None:
        """Account for the chunks the worker has finished, in order; verify completed buckets."""
        while self.pending and self.pending[0][0].done():
            fut, bucket, offset, nbytes = self.pending.popleft()
            fut.result()
            self.received[bucket] += nbytes
            if self.sink is not None:
                self.sink.on_chunk(bucket, offset, nbytes)
            if self.received[bucket] == self.manifest.buckets[bucket].nbytes:
                self._verify(bucket)

    def _verify(self, bucket: int) -> None:
        info = self.manifest.buckets[bucket]
        if self.summed_to[bucket] == info.nbytes:
            ok = verify_checksum(info.checksum, running=self.sums[bucket])
        else:  # chunks arrived out of order: checksum the assembled buffer
            ok = verify_checksum(info.checksum, self.views[bucket])
        if ok:
            return
        self.failures[bucket] += 1
        self.sub.buckets_refetched += 1
        log.warning("weight version %d: bucket %d failed its checksum (attempt %d)", self.manifest.version, bucket, self.failures[bucket])
        if self.failures[bucket] > self.sub.max_refetch:
            raise WeightSyncError(f"weight version {self.manifest.version}: bucket {bucket} failed its checksum {self.failures[bucket]} times")
        self.received[bucket] = 0
        self.sums[bucket] = Checksummer.for_digest(info.checksum)
        self.summed_to[bucket] = 0
        if self.sink is not None:
            self.sink.on_bucket_reset(bucket)
        self.todo.extendleft(reversed(self._chunks_of(bucket)))

    def _fail_chunk(self, req: tuple[int, int, int], why: str) -> None:
        bucket = req[0]
        self.failures[bucket] += 1
        log.warning("weight version %d: bucket %d: %s", self.manifest.version, bucket, why)
        if self.failures[bucket] > self.sub.max_refetch:
            raise WeightSyncError(f"weight version {self.manifest.version}: bucket {bucket}: {why}, {self.failures[bucket]} times")
        self.todo.appendleft(req)
