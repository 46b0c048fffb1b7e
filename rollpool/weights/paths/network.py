"""The network path: ZeroMQ chunks over the server's ROUTER, the path every publisher and relay serves.

Both ends: the server end is `rollpool.weights.serving.WeightServer` (one answer per request, never blocking on a
peer); this file holds the subscriber's end: `DealerSet`, its DEALER sockets (one per stream) and the request router
over them, and `NetworkPath`, the windowed, verified transfer of a version's buckets.

What it promises
    - Transfer keeps a window of `window_chunks` `Fetch` requests outstanding per stream (credit-based flow control:
      the server only ever answers requests).
    - No reply for `fetch_timeout_s` re-asks for what is outstanding, at most `max_refetch` times in a row, then
      `WeightSyncError`. A bucket that fails its checksum is fetched again, at most `max_refetch` times.
    - A chunk carrying its bucket's checksum fills a streamed manifest's pending one (told to the sink).
    - A reply that does not match its request is counted against the bucket, never written into it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from rollpool.protocol.codec import decode, encode
from rollpool.protocol.errors import ProtocolError, WeightSyncError
from rollpool.protocol.logs import RateLimitedLog
from rollpool.protocol.messages import Chunk, Error, Fetch, Manifest
from rollpool.protocol.sockets import SocketFactory, send_now
from rollpool.weights.bucketing import Checksummer, checksum_supported, unpack_bucket, verify_checksum
from rollpool.weights.manifest import NETWORK, chunk_bytes_of
from rollpool.weights.paths.base import (
    BucketCallback,
    FetchContext,
    Fetched,
    FetchJob,
    TransferSink,
    WeightVersionGoneError,
)

__all__ = ["DealerSet", "NetworkPath"]

log = logging.getLogger("rollpool.weights.subscriber")


class DealerSet:
    """A subscriber's DEALER sockets to one server, one per stream, and the request router over them.

    The server counts the streams as one peer (their identities are ``<peer>#<n>``). A reply is handed to the handler
    routed for its request id; a malformed one is counted in `protocol_errors` and logged once per minute."""

    def __init__(self, sockets: SocketFactory, peer: str) -> None:
        self.sockets = sockets
        self.peer = peer
        """The identity the streams share (``<worker_id>/<prefix>``)."""
        self.endpoint: str | None = None
        self.protocol_errors = 0
        self._dealers: list[Any] = []
        self._next = 0
        self._routes: dict[str, Callable[[Any], None]] = {}
        self._ids = itertools.count()
        self._prefix = peer.rsplit("/", 1)[-1]
        self._errlog = RateLimitedLog(log)
        self.tasks: set[asyncio.Task[None]] = set()

    def open(self, endpoint: str, streams: int) -> None:
        """Connect `streams` sockets to `endpoint` and start their receive loops. Needs a running loop."""
        self.close()
        self.endpoint = endpoint
        loop = asyncio.get_running_loop()
        for i in range(streams):
            identity = self.peer[:250].encode() + f"#{i}".encode()
            dealer = self.sockets.dealer(endpoint, identity=identity)
            self._dealers.append(dealer)
            task: asyncio.Task[None] = loop.create_task(self._recv_loop(dealer), name=f"WeightSubscriber._recv_loop[{i}]")
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def close(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        self._routes.clear()
        for s in self._dealers:
            s.close(linger=0)
        self._dealers = []

    @property
    def connected(self) -> bool:
        return bool(self._dealers)

    @property
    def streams(self) -> int:
        return len(self._dealers)

    def request_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    def route(self, request_id: str, handler: Callable[[Any], None]) -> None:
        self._routes[request_id] = handler

    def unroute(self, request_id: str) -> None:
        self._routes.pop(request_id, None)

    def send(self, msg: Any, *, spread: bool = False) -> bool:
        """Send on the first stream, or (`spread`: chunk requests) on the streams in turn; False if it could not be queued."""
        import zmq

        if not self._dealers:
            raise WeightSyncError("the weight subscriber is not connected")
        dealer = self._dealers[0]
        if spread and len(self._dealers) > 1:
            self._next = (self._next + 1) % len(self._dealers)
            dealer = self._dealers[self._next]
        return send_now(dealer, encode(msg), flags=zmq.DONTWAIT) is None

    async def request(self, msg_of: Callable[[str], Any], timeout_s: float) -> Any:
        """Send the request `msg_of(request_id)` and wait for its reply; TimeoutError after `timeout_s`."""
        rid = self.request_id()
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def resolve(msg: Any) -> None:
            if not fut.done():
                fut.set_result(msg)

        self._routes[rid] = resolve
        try:
            self.send(msg_of(rid))
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._routes.pop(rid, None)

    async def _recv_loop(self, dealer: Any) -> None:
        while True:
            frames = await dealer.recv_multipart(copy=False)
            try:
                msg = decode(frames)
            except ProtocolError as exc:
                self.protocol_errors += 1
                self._errlog.warning("recv", "malformed message from weight publisher %s: %s", self.endpoint, exc)
                continue
            rid = getattr(msg, "request_id", None)
            route = self._routes.get(rid) if isinstance(rid, str) else None
            if route is not None:
                route(msg)
            elif isinstance(msg, Error):
                self._errlog.warning("error", "weight publisher error without a pending request: %s: %s", msg.code, msg.message)


class NetworkPath:
    """The subscriber's end of the network path (see the module docstring)."""

    name = NETWORK
    host_buffers = True

    def __init__(self, ctx: FetchContext, dealers: DealerSet) -> None:
        self.ctx = ctx
        self.dealers = dealers

    async def fetch(self, job: FetchJob) -> Fetched:
        assert job.buffers is not None
        transfer = _Transfer(self.ctx, self.dealers, job.manifest, job.buffers, job.sink, job.on_bucket, skip=job.skip)
        await transfer.run()
        manifest = replace(job.manifest, buckets=tuple(replace(b, checksum=c) for b, c in zip(job.manifest.buckets, transfer.expected, strict=True)))
        return Fetched(manifest, job.buffers, job.slab, NETWORK)


class _Transfer:
    """One windowed, verified transfer of a manifest's buckets into buffers (the network path).

    The window is `window_chunks` per stream, requests spread over the
    subscriber's streams. Chunks are copied into their buckets by `lanes`
    single-thread executors (one lane per bucket, so a bucket's running
    checksum is fed in offset order; chunks that arrive early are folded in
    when the gap before them closes); with several lanes the requests
    interleave that many buckets so every lane has work.
    """

    def __init__(self, ctx: FetchContext, dealers: DealerSet, manifest: Manifest, buffers: list[torch.Tensor], sink: TransferSink | None,
                 on_bucket: BucketCallback | None = None, skip: frozenset[int] = frozenset()) -> None:
        """`skip`: buckets already in `buffers` and verified (by the bulk lane before it failed): not fetched."""
        self.ctx = ctx
        self.dealers = dealers
        self.manifest = manifest
        self.buffers = buffers
        self.views = [b.numpy() for b in buffers]
        self.sink = sink
        self.on_bucket = on_bucket
        self.window = ctx.window_chunks * max(1, dealers.streams)
        self.chunk = chunk_bytes_of(manifest)
        self.todo: deque[tuple[int, int, int]] = deque()
        self.outstanding: dict[str, tuple[int, int, int]] = {}
        self.received = [0] * len(buffers)
        self.expected = [b.checksum for b in manifest.buckets]
        self.sums: list[Checksummer | None] = [Checksummer.for_digest(c) if c else None for c in self.expected]
        self.summed_to = [0] * len(buffers)
        self.early: list[dict[int, int]] = [{} for _ in buffers]
        self.failures = [0] * len(buffers)
        self.replies: asyncio.Queue[Any] = asyncio.Queue()
        # Copying a chunk into its bucket and folding it into the checksum run in worker threads
        # (both release the GIL) while the loop keeps receiving.
        self.lanes = [ThreadPoolExecutor(1, thread_name_prefix="weights-absorb")
                      for _ in range(max(1, min(dealers.streams, ctx.copy_threads, len(buffers) or 1)))]
        self.pending: deque[tuple[asyncio.Future[None], int, int, int]] = deque()
        n = len(self.lanes)
        for i in skip:
            self.received[i] = manifest.buckets[i].nbytes
        for first in range(0, len(buffers), n):
            group = [self._chunks_of(i) for i in range(first, min(first + n, len(buffers))) if i not in skip]
            for k in range(max((len(g) for g in group), default=0)):
                self.todo.extend(g[k] for g in group if k < len(g))
        for i, b in enumerate(manifest.buckets):
            if b.nbytes == 0 and i not in skip:
                self._verify(i)

    def _chunks_of(self, bucket: int) -> list[tuple[int, int, int]]:
        n = self.manifest.buckets[bucket].nbytes
        return [(bucket, off, min(self.chunk, n - off)) for off in range(0, n, self.chunk)]

    async def run(self) -> None:
        ctx = self.ctx
        stalls = 0
        try:
            while self.todo or self.outstanding or self.pending:
                while self.todo and len(self.outstanding) < self.window:
                    self._request(self.todo.popleft())
                if self.pending and (len(self.pending) >= self.window or not self.outstanding):
                    await self.pending[0][0]  # a memcpy and a checksum: bounded, no network wait
                    self._settle()
                    continue
                try:
                    msg = await asyncio.wait_for(self.replies.get(), ctx.fetch_timeout_s)
                except TimeoutError:
                    stalls += 1
                    if stalls > ctx.max_refetch:
                        raise WeightSyncError(
                            f"weight version {self.manifest.version}: no reply from {self.dealers.endpoint} "
                            f"for {stalls} x {ctx.fetch_timeout_s} s ({len(self.outstanding)} chunks outstanding)"
                        ) from None
                    self._requeue_outstanding()
                    continue
                if self._handle(msg):
                    stalls = 0
                self._settle()
        finally:
            for rid in self.outstanding:
                self.dealers.unroute(rid)
            for lane in self.lanes:
                lane.shutdown(wait=True, cancel_futures=True)

    def _request(self, req: tuple[int, int, int]) -> None:
        rid = self.dealers.request_id()
        bucket, offset, nbytes = req
        self.outstanding[rid] = req
        self.dealers.route(rid, self.replies.put_nowait)
        # a send that cannot be queued is like a lost reply: the timeout asks again
        self.dealers.send(Fetch(request_id=rid, version=self.manifest.version, bucket=bucket, offset=offset, nbytes=nbytes,
                                delta_base=self.manifest.delta_base), spread=True)

    def _requeue_outstanding(self) -> None:
        reqs = sorted(self.outstanding.values())
        for rid in self.outstanding:
            self.dealers.unroute(rid)
        self.outstanding.clear()
        self.todo.extendleft(reversed(reqs))

    def _handle(self, msg: Any) -> bool:
        """Apply one reply; True if it was progress."""
        req = self.outstanding.pop(msg.request_id, None)
        self.dealers.unroute(msg.request_id)
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
        if msg.checksum and msg.checksum != self.expected[bucket]:
            if self.expected[bucket] or not checksum_supported(msg.checksum.partition(":")[0]):
                self._fail_chunk(req, f"a chunk naming checksum {msg.checksum!r}, not the bucket's {self.expected[bucket]!r}")
                return True
            # a streamed manifest's pending checksum: the bucket's chunks carry it
            self.expected[bucket] = msg.checksum
            self.sums[bucket] = Checksummer.for_digest(msg.checksum)
            if self.sink is not None:
                self.sink.on_checksum(bucket, msg.checksum)
        lane = self.lanes[bucket % len(self.lanes)]
        fut = asyncio.get_running_loop().run_in_executor(lane, self._absorb, bucket, offset, msg.data)
        self.pending.append((fut, bucket, offset, nbytes))
        self.ctx.counters.bytes_received += nbytes
        return True

    def _absorb(self, bucket: int, offset: int, data: Any) -> None:
        """Lane thread: copy one chunk into its bucket and fold what is now contiguous into the running checksum."""
        n = len(data)
        view = self.views[bucket]
        view[offset : offset + n] = np.frombuffer(data, dtype=np.uint8)
        summer = self.sums[bucket]
        if summer is None:
            return
        if self.summed_to[bucket] != offset:
            self.early[bucket][offset] = n  # folded in once the chunks before it are
            return
        summer.update(data)
        pos = offset + n
        early = self.early[bucket]
        while pos in early:
            m = early.pop(pos)
            summer.update(view[pos : pos + m])
            pos += m
        self.summed_to[bucket] = pos

    def _settle(self) -> None:
        """Account for the chunks the lanes have finished, in order; verify completed buckets."""
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
        expected = self.expected[bucket]
        summer = self.sums[bucket]
        if info.nbytes == 0:
            ok = not expected or verify_checksum(expected, b"")
        elif not expected or summer is None:
            ok = False  # no chunk named the pending checksum: nothing to verify against
        elif self.summed_to[bucket] == info.nbytes:
            ok = verify_checksum(expected, running=summer)
        else:  # cannot happen (every chunk is folded in order); verify the assembled buffer
            ok = verify_checksum(expected, self.views[bucket])
        if ok:
            if self.on_bucket is not None:
                self.on_bucket(bucket, unpack_bucket(info, self.buffers[bucket]))
            return
        self.ctx.bucket_failed(self.manifest.version, bucket, self.failures, NETWORK)
        self.received[bucket] = 0
        self.sums[bucket] = Checksummer.for_digest(expected) if expected else None
        self.summed_to[bucket] = 0
        self.early[bucket] = {}
        if self.sink is not None:
            self.sink.on_bucket_reset(bucket)
        self.todo.extendleft(reversed(self._chunks_of(bucket)))

    def _fail_chunk(self, req: tuple[int, int, int], why: str) -> None:
        bucket = req[0]
        self.failures[bucket] += 1
        log.warning("weight version %d: bucket %d: %s", self.manifest.version, bucket, why)
        if self.failures[bucket] > self.ctx.max_refetch:
            raise WeightSyncError(f"weight version {self.manifest.version}: bucket {bucket}: {why}, {self.failures[bucket]} times")
        self.todo.appendleft(req)
