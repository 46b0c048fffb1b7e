"""The network path's bulk lane (protocol minor 13): bucket bytes over plain TCP, straight into the subscriber's buffer.

Over ZeroMQ a chunk is received into a ZeroMQ message and then copied into its bucket: one memory pass per byte
that a receiver writing into caller memory does not make (`Socket.recv_into` copies out of a message too).
This lane keeps the manifest, the versions, the checksums and verify-then-apply of the ROUTER path and moves
only the chunk bytes: the server answers each request with `sendall` from the version's own buffers, the
subscriber `recv_into`s its bucket and folds what landed into the bucket's running checksum while it is in cache.

Wire (all integers little-endian; one TCP connection per subscriber stream, requests pipelined):

    hello     b"RPBH" u16 n, n bytes: the subscriber's peer id (its ROUTER identity without ``#<stream>``)
    request   b"RPBQ" u64 version, u32 bucket, u64 offset, u32 nbytes
    request   b"RPBD" the same, then i64 delta_base: the bucket's encoded bytes of the version's delta against that base
              (`Fetch.delta_base`, minor 26: `DELTA_PATHS_MINOR`; asked only of a server that says that minor or newer)
    request   b"RPBE" as RPBQ, answered as soon as the chunk's bytes are in place, before the bucket's checksum (the
              reply's text is then empty), but for the chunk that ends the bucket: it waits for the checksum and carries
              it, so a bucket's checksum still arrives before it is verified (minor 30: `EARLY_BYTES_MINOR`; asked only
              of a server that says that minor or newer)
    reply     b"RPBA" u8 status, u32 nbytes, u16 n, n bytes: the bucket's checksum (status 0) or the error
              message; then `nbytes` bytes of the chunk (status 0 only)

Status: 0 ok, 1 ``gone``, 2 ``unknown_version``, 3 ``bad_range``, 4 ``busy`` (the bytes did not arrive in time),
5 ``bad_request`` (then the server closes the connection). The server names the lane in every manifest
(`Manifest.bulk_port`: the ROUTER's port + 2 when that port is fixed, any free one otherwise); the subscriber
connects to the host of the ROUTER endpoint it already uses (and, when it cannot connect at all, does not try
that lane again). A server
whose sockets use CURVE, or whose ROUTER is not on TCP, offers no lane (the bytes would bypass the
encryption); a subscriber that cannot reach the lane, or loses it mid-version, takes the ROUTER path for the
version (logged, counted in `WeightSubscriber.fallbacks`). `WeightPathConfig.weight_bulk` off (``ROLLPOOL_WEIGHT_BULK=0`` at load) turns it off on
that side.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import errno
import functools
import logging
import os
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Protocol

import torch

import rollpool.weights.paths.lane_native as lane_native
from rollpool.protocol.codec import EARLY_BYTES_MINOR
from rollpool.protocol.errors import WeightSyncError
from rollpool.protocol.messages import Manifest
from rollpool.weights.bucketing import Checksummer, checksum_supported, unpack_bucket, verify_checksum
from rollpool.weights.manifest import BULK, MAX_CHUNK_BYTES, NETWORK, chunk_bytes_of, stream_jobs
from rollpool.weights.paths.base import (
    BucketCallback,
    ChunkRead,
    FetchContext,
    Fetched,
    FetchJob,
    PathFallbackError,
    TransferSink,
    WeightVersionGoneError,
)

__all__ = ["BulkError", "BulkPath", "BulkServer", "BulkUnavailableError", "VersionStore", "fetch_bucket_range",
           "lane_host", "lane_port"]

log = logging.getLogger(__name__)

_HELLO = struct.Struct("<4sH")
_REQUEST = struct.Struct("<4sQIQI")
_DELTA_BASE = struct.Struct("<q")
_REPLY = struct.Struct("<4sBIH")
_MAX_PEER_ID = 512
OK, GONE, UNKNOWN_VERSION, BAD_RANGE, BUSY, BAD_REQUEST = range(6)
STATUS_CODES = ("ok", "gone", "unknown_version", "bad_range", "busy", "bad_request")


def lane_host(router_endpoint: str | None) -> str | None:
    """The host a subscriber reaches the lane on: the one of its ROUTER endpoint (None: not TCP)."""
    if not router_endpoint or not router_endpoint.startswith("tcp://"):
        return None
    host = router_endpoint[len("tcp://"):].rsplit(":", 1)[0]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return None if host in ("", "*") else host


class BulkError(Exception):
    """The server answered a request with an error status (`code`, one of `STATUS_CODES`)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class BulkUnavailableError(Exception):
    """The lane cannot be used for this version (unreachable, reset, silent): take the ROUTER path.

    `unreachable`: the connection could not be made at all (a firewall, a port not published); the subscriber
    does not try that lane again."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


WAIT_POLL_S = 0.5
"""A request waiting for bytes to arrive looks again at least this often (it is woken at each arrival: `notify`)."""

FOLD_BYTES = 32 << 20
"""A folded bucket's landed bytes go into its running checksum up to this many at a time (and the rest at its end): each
fold gives the interpreter lock up and waits for it again (python-xxhash releases it while it sums), so in a worker
whose engine's Python runs beside, a fold per 8 MiB chunk was one more wait a chunk."""
FOLD_BUDGET_BYTES = 64 << 20
"""... and all the streams' bytes waiting for their fold stay within this (at 8 streams that is a fold per 8 MiB chunk,
as before `FOLD_BYTES`), so what a fold reads is still in the cache: `fold_bytes`."""


def fold_bytes(streams: int, chunk_bytes: int) -> int:
    """How many landed bytes a stream folds at a time: `FOLD_BYTES` within `FOLD_BUDGET_BYTES` over the streams, at least a
    chunk."""
    return max(chunk_bytes, min(FOLD_BYTES, FOLD_BUDGET_BYTES // max(1, streams)))


CONNECT_TIMEOUT_S = 3.0
"""How long a subscriber waits for the lane's connection before it takes the ROUTER."""


def lane_port(router_bind: str) -> int:
    """The lane's port for a ROUTER bound at `router_bind`: its port + 2 (the PUB takes + 1 by convention) when
    the ROUTER's port is fixed, so a firewall or a container can publish it; 0 (any free port) otherwise."""
    port = router_bind.rsplit(":", 1)[-1]
    return int(port) + 2 if port.isdigit() and 0 < int(port) <= 65533 else 0


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = sock.recv(n, socket.MSG_WAITALL)
    if len(data) != n:
        raise ConnectionError("the peer closed the connection")
    return data


def _recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, view.nbytes
    while got < n:  # one call on a socket in blocking mode (`kernel_timeouts`); more only on a timeout or a signal
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            raise ConnectionError("the peer closed the connection")
        got += k


def kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Leave `sock` in blocking mode and let the kernel time its calls out (`SO_RCVTIMEO`, `SO_SNDTIMEO`): a chunk is
    then sent or received in one call that holds no interpreter lock, where Python's own timeout (a non-blocking
    socket polled) returns to the interpreter for every piece the socket buffer takes. A call that times out raises
    an `OSError` (``EAGAIN``), as a dead peer's does."""
    sec = max(0.0, seconds)
    tv = struct.pack("@ll", int(sec), int((sec - int(sec)) * 1e6))
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def send_parts(sock: socket.socket, parts: list[memoryview]) -> None:
    """`parts` (byte views) in order, in one `sendmsg` where the socket takes them all (blocking mode)."""
    while parts:
        sent = sock.sendmsg(parts)
        if sent <= 0:
            raise ConnectionError("the peer stopped taking bytes")
        k = 0
        while k < len(parts) and sent >= parts[k].nbytes:
            sent -= parts[k].nbytes
            k += 1
        parts = parts[k:]
        if parts and sent:
            parts[0] = parts[0][sent:]


# ---------------------------------------------------------------------------------------------- the server


class VersionStore(Protocol):
    """What the lane serves from (`rollpool.weights.serving.WeightServer`), called on its event loop, but for
    `still_serves`, which a connection thread calls."""

    name: str

    def read_chunk(self, version: int, bucket: int, offset: int, nbytes: int, delta_base: int = -1, early: bool = False) -> ChunkRead: ...

    served_changes: ctypes.c_int64
    """Bumped whenever `still_serves` may turn False (read by the compiled send loop, `lane_native`)."""

    def bulk_served(self, v: Any, peer: bytes, nbytes: int, parked: bool = False, chunks: int = 1) -> None: ...

    def still_serves(self, version: int, v: Any) -> bool: ...


_STATUS = {"gone": GONE, "unknown_version": UNKNOWN_VERSION, "bad_range": BAD_RANGE}


class _Held:
    """What a connection answered its last chunk from (`BulkServer._answer`): a later chunk of the same bucket is read
    there in the connection's thread, with no trip to the loop, while the store still serves it (an ``RPBE`` request's
    before the bucket's checksum too, as the loop's lookup would answer it)."""

    __slots__ = ("bucket", "delta_base", "size", "v", "version")

    def __init__(self) -> None:
        self.version, self.bucket, self.delta_base, self.size = -1, -1, -1, 0
        self.v: Any = None


class BulkServer:
    """The lane's server beside a `WeightServer`: one thread per connection, answering from its versions.

    A connection thread looks a bucket up on the event loop, where the version store lives (the same checks and the
    same source `read` as the ROUTER's fetch), then sends from its own thread, holding the bytes while it does (so a
    source's buffer counts as in flight, as a zero-copy ZeroMQ frame would). The bucket's later chunks are read in the
    thread, each checked with `VersionStore.still_serves` after it is held (a version dropped before the read is
    never sent from: its buffers are reused only once nothing holds them), and what the loop keeps (bytes served per
    peer, the last request time that `keep_versions=0` releases on) is handed to it after each chunk, without waiting
    for it. In the trainer's
    process the loop and these threads share one interpreter lock with whatever else the trainer runs: a trip to the
    loop per chunk, and a send of a chunk in pieces, each wait for that lock (one Python thread busy beside the
    publisher took the lane from 2.8 to 0.37 GB/s on the 2-core VM, `bench/lane_probe.py`). The sockets are in
    blocking mode with the kernel's timeouts (`SO_RCVTIMEO`, `SO_SNDTIMEO`), so a chunk goes out in one call, and the
    requests that came since are read in one. Where the bucket's bytes are one contiguous buffer (a snapshot's, a delta
    payload's), its later requests are answered by the compiled send loop (`lane_native`) with the lock released,
    back in Python at the next request for another bucket, after `lane_native.IDLE_MS` without one, or when the
    store's `served_changes` moved (then `still_serves` is asked again). A request for bytes not yet arrived (a
    streamed or relayed version) waits up to `wait_s` for `notify`, then is answered ``busy``.
    """

    def __init__(self, server: VersionStore, host: str, port: int = 0, *, wait_s: float = 30.0, idle_s: float = 120.0,
                 max_connections: int = 256) -> None:
        self.server = server
        self.wait_s = wait_s
        self.idle_s = idle_s
        """A connection that sends nothing for this long is closed (a subscriber opens its connections per version)."""
        self.max_connections = max_connections
        self.bytes_served = 0
        self.chunks_served = 0
        self.loop_lookups = 0
        """Chunks looked up on the loop (the first of each bucket a connection serves, and those not arrived yet)."""
        self.native_chunks = 0
        """Chunks sent by the compiled send loop (`lane_native`), counted in `chunks_served` too."""
        self.early_chunks = 0
        """Chunks sent before their bucket's checksum was known (``RPBE``, an empty text), counted in `chunks_served` too."""
        self.connections = 0
        self.refused = 0
        self._arrived = threading.Condition()
        self._arrivals = 0
        """Bumped by `notify`: a waiter that saw it move since its lookup looks again instead of waiting."""
        self.waiting = 0
        """Requests waiting now for their bytes to arrive (a streamed or relayed version's)."""
        self._counted = threading.Lock()
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._listen = socket.create_server((host, port), backlog=64, family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.port: int = self._listen.getsockname()[1]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._accept_loop, name=f"{server.name}.bulk", daemon=True)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listen.shutdown(socket.SHUT_RDWR)
        self._listen.close()
        for c in list(self._conns):
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        self.notify()

    def notify(self) -> None:
        """Bytes arrived (or a version was dropped): wake the requests waiting for them."""
        with self._arrived:
            self._arrivals += 1
            self._arrived.notify_all()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listen.accept()
            except OSError:
                return
            if len(self._conns) >= self.max_connections:
                self.refused += 1
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            kernel_timeouts(conn, self.idle_s)
            self._conns.add(conn)
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), name=f"{self.server.name}.bulk.conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        held = _Held()
        peer = b""
        try:
            magic, n = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
            if magic != b"RPBH" or n > _MAX_PEER_ID:
                self._refuse(conn, "not a bulk-lane hello")
                return
            peer = _recv_exact(conn, n)
            pending = bytearray()
            native_next = True
            while not self._closed:
                if len(pending) < _REQUEST.size or (pending[:4] == b"RPBD" and len(pending) < _REQUEST.size + _DELTA_BASE.size):
                    got = conn.recv(1 << 16)  # the requests that came since (pipelined: usually several)
                    if not got:
                        return
                    pending += got
                    continue
                magic, version, bucket, offset, nbytes = _REQUEST.unpack_from(pending)
                if magic not in (b"RPBQ", b"RPBD", b"RPBE"):
                    self._refuse(conn, "not a bulk-lane request")
                    return
                size = _REQUEST.size + (_DELTA_BASE.size if magic == b"RPBD" else 0)
                delta_base = _DELTA_BASE.unpack_from(pending, _REQUEST.size)[0] if magic == b"RPBD" else -1
                early = magic == b"RPBE"
                if native_next and (version, bucket, delta_base) == (held.version, held.bucket, held.delta_base):
                    served = self._serve_native(conn, peer, held, bytes(pending), early)
                    if served is not None:
                        pending = bytearray(served.left)
                        if served.why == lane_native.CLOSED:
                            return
                        if served.why < 0:
                            raise OSError(-served.why, os.strerror(-served.why))
                        # no chunk went out and the front request is still there: Python answers it (never a spin)
                        native_next = served.chunks > 0 or served.why == lane_native.IDLE
                        continue
                native_next = True
                del pending[:size]
                self._answer(conn, peer, held, version, bucket, offset, nbytes, delta_base, early)
        except (OSError, struct.error):
            pass  # the subscriber left (or sent garbage): nothing of ours is lost, it asks again elsewhere
        finally:
            self._conns.discard(conn)
            conn.close()

    def _answer(self, conn: socket.socket, peer: bytes, held: _Held, version: int, bucket: int, offset: int, nbytes: int,
                delta_base: int = -1, early: bool = False) -> None:
        if (version, bucket, delta_base) == (held.version, held.bucket, held.delta_base) and 0 <= offset and 0 < nbytes <= MAX_CHUNK_BYTES \
                and offset + nbytes <= held.size:
            source = held.v.sources[bucket]
            data = source.read(offset, nbytes)
            if data is None and early and offset + nbytes < held.size and hasattr(source, "read_early"):
                data = source.read_early(offset, nbytes)  # (the text below is then "" while the checksum is pending)
            # held first, then checked: a version dropped before the read was not sent from (nor is its buffer reused
            # while this thread holds the bytes); one dropped after it goes out whole, as from the loop's lookup
            if data is not None and self.server.still_serves(version, held.v):
                self._send_chunk(conn, held, peer, held.v.buckets[bucket].checksum, data, nbytes)
                return
        seen = self._arrivals  # (read before the lookup: an arrival during it is not slept through)
        found = self._on_loop(self._lookup, version, bucket, offset, nbytes, delta_base, early)
        began = time.monotonic()
        waited = 0.0
        parked = found is None
        if parked:
            with self._counted:
                self.waiting += 1
        while found is None and waited < self.wait_s and not self._closed:  # the bytes have not arrived yet
            with self._arrived:
                if self._arrivals == seen:
                    self._arrived.wait(min(WAIT_POLL_S, self.wait_s - waited))
                seen = self._arrivals
            waited = time.monotonic() - began  # by the clock: every arrival of other bytes wakes this thread
            found = self._on_loop(self._lookup, version, bucket, offset, nbytes, delta_base, early)
        if parked:
            with self._counted:
                self.waiting -= 1
        with self._counted:
            self.loop_lookups += 1
        if found is None:
            self._reply(conn, BUSY, f"bucket {bucket} of version {version}: the bytes did not arrive within {self.wait_s} s")
            return
        status, text, data, v = found
        if status != OK:
            self._reply(conn, status, text)
            return
        held.version, held.bucket, held.delta_base, held.v = version, bucket, delta_base, v
        held.size = v.buckets[bucket].nbytes
        self._send_chunk(conn, held, peer, text, data, nbytes, parked=waited > 0)

    def _serve_native(self, conn: socket.socket, peer: bytes, held: _Held, pending: bytes, early: bool = False) -> lane_native.Served | None:
        """The held bucket's requests in `pending` and those that follow, answered by the compiled send loop with the
        interpreter lock released (`lane_native`); None where it cannot serve them (off, the bytes not one
        contiguous buffer, the version no longer served: the caller's Python path answers). `early` (the front request
        is ``RPBE``): a bucket whose bytes are in place but whose checksum is pending is served too, to ``RPBE``
        requests only, with an empty text and never its last chunk (the loop returns there: Python waits for the
        checksum)."""
        if not lane_native.enabled():
            return None
        changes = self.server.served_changes
        changes0 = changes.value  # read before the check: a change after it stops the loop at its next chunk
        if not self.server.still_serves(held.version, held.v):
            return None
        sources = held.v.sources  # (emptied when the version is released: then the change stops the loop)
        source = sources[held.bucket] if held.bucket < len(sources) else None
        whole_of = getattr(source, "contiguous", None)
        whole = whole_of() if whole_of is not None else None
        size, early_only = held.size, False
        if whole is None and early:
            early_of = getattr(source, "contiguous_early", None)
            whole = early_of() if early_of is not None else None
            # every chunk but the last: its request (ending at the bucket's end) is past what the loop is given
            size, early_only = held.size - 1, True
        if whole is None or whole.itemsize != 1 or whole.nbytes < held.size or size < 1:  # (a bucket's buffer is uint8)
            return None
        body = b"" if early_only else held.v.buckets[held.bucket].checksum.encode()
        head = _REPLY.pack(b"RPBA", OK, 0, len(body)) + body
        served = lane_native.serve(conn, whole[:size], held.version, held.bucket, held.delta_base, head, pending,
                                   changes, changes0, MAX_CHUNK_BYTES, early_only=early_only)
        del whole  # the bucket's bytes are held (in flight) only while the loop sends from them
        if served.chunks:
            with self._counted:
                self.bytes_served += served.nbytes
                self.chunks_served += served.chunks
                self.native_chunks += served.chunks
                self.early_chunks += served.chunks if early_only else 0
            if self._loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop closed: nothing left to account to
                    self._loop.call_soon_threadsafe(functools.partial(self.server.bulk_served, held.v, peer, served.nbytes,
                                                                      chunks=served.chunks))
        return served

    def _send_chunk(self, conn: socket.socket, held: _Held, peer: bytes, checksum: str, data: Any, nbytes: int, *,
                    parked: bool = False) -> None:
        """The reply and its bytes in one call (the socket in blocking mode takes them all); counted, and told to the
        loop (`VersionStore.bulk_served`; `parked`: the chunk waited for its bytes to arrive)."""
        body = checksum.encode()
        send_parts(conn, [memoryview(_REPLY.pack(b"RPBA", OK, nbytes, len(body)) + body), memoryview(data).cast("B")])
        del data
        with self._counted:
            self.bytes_served += nbytes
            self.chunks_served += 1
            self.early_chunks += not body
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nothing left to account to
                self._loop.call_soon_threadsafe(self.server.bulk_served, held.v, peer, nbytes, parked)

    def _lookup(self, version: int, bucket: int, offset: int, nbytes: int, delta_base: int = -1,
                early: bool = False) -> tuple[int, str, Any, Any] | None:
        """On the loop, the ROUTER's own lookup: (status, checksum or message, bytes, version), None: not arrived yet."""
        got = self.server.read_chunk(version, bucket, offset, nbytes, delta_base, early)
        if got.code:
            return _STATUS.get(got.code, BAD_REQUEST), got.text, None, None
        if got.data is None:
            return None
        return OK, got.text, got.data, got.version

    def _on_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` on the server's event loop (where its version store lives) and wait for the result."""
        assert self._loop is not None
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                done.set_exception(exc)

        self._loop.call_soon_threadsafe(run)
        return done.result(timeout=self.wait_s)

    @classmethod
    def _refuse(cls, conn: socket.socket, message: str) -> None:
        """Answer ``bad_request`` and end the connection so the answer arrives: what the peer sent after the
        garbage is read and dropped first (closing with unread bytes would reset the connection and lose it)."""
        cls._reply(conn, BAD_REQUEST, message)
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(1.0)
        with contextlib.suppress(OSError):
            for _ in range(64):
                if not conn.recv(65536):
                    break

    @staticmethod
    def _reply(conn: socket.socket, status: int, message: str) -> None:
        body = message.encode()[:4096]
        conn.sendall(_REPLY.pack(b"RPBA", status, 0, len(body)) + body)


# ---------------------------------------------------------------------------------------------- the client


class _Lane:
    """One connection of a subscriber stream."""

    def __init__(self, host: str, port: int, peer: bytes, timeout_s: float) -> None:
        try:
            self.sock = socket.create_connection((host, port), timeout=min(timeout_s, CONNECT_TIMEOUT_S))
        except OSError as exc:
            raise BulkUnavailableError(f"cannot reach the bulk lane at {host}:{port}: {exc}", unreachable=True) from exc
        kernel_timeouts(self.sock, timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(_HELLO.pack(b"RPBH", len(peer)) + peer)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def fetch_bucket_range(
    host: str,
    port: int,
    peer: bytes,
    version: int,
    jobs: Iterable[tuple[int, list[tuple[int, int]]]],
    views: Sequence[memoryview],
    *,
    timeout_s: float,
    window: int,
    on_chunk: Callable[[int, int, int, str, memoryview], None],
    on_part_done: Callable[[int], list[tuple[int, int]]],
    stop: threading.Event,
    delta_base: int = -1,
    batch_bytes: int = 0,
    early: bool = False,
) -> None:
    """Thread of one subscriber stream: fetch `jobs` (bucket, chunks of it as (offset, nbytes)) into `views` (with
    `delta_base` >= 0, the encoded bytes of `version`'s delta against it: the payload buckets' numbering).

    `on_chunk(bucket, offset, nbytes, checksum, data)` runs in this thread once a chunk is in its view (the caller
    folds it into the running checksum); `on_part_done(bucket)` runs when this job's chunks of the bucket have
    landed and returns the chunks to fetch again (a bucket that failed its checksum), or none. `early`: ask with
    ``RPBE`` (a server of `EARLY_BYTES_MINOR` or newer), so a bucket's chunks but its last come before its checksum,
    with an empty text (`on_chunk` is told ``""``). Raises `BulkError`
    for an error status, `BulkUnavailableError` when the connection fails or goes silent for `timeout_s`.
    """
    lane = _Lane(host, port, peer, timeout_s)
    try:
        for bucket, chunks in jobs:
            todo = chunks
            while todo and not stop.is_set():
                _fetch_chunks(lane.sock, version, bucket, todo, views[bucket], window, on_chunk, stop, delta_base, batch_bytes, early)
                if stop.is_set():
                    return
                todo = on_part_done(bucket)
    except (BlockingIOError, TimeoutError) as exc:  # the kernel's timeout (`kernel_timeouts`): nothing came
        raise BulkUnavailableError(f"the bulk lane to {host}:{port} was silent for {timeout_s} s") from exc
    except (OSError, ConnectionError, struct.error) as exc:
        raise BulkUnavailableError(f"the bulk lane to {host}:{port} failed: {exc}") from exc
    finally:
        lane.close()


def _fetch_chunks(sock: socket.socket, version: int, bucket: int, chunks: Sequence[tuple[int, int]], view: memoryview,
                  window: int, on_chunk: Callable[[int, int, int, str, memoryview], None], stop: threading.Event,
                  delta_base: int = -1, batch_bytes: int = 0, early: bool = False) -> None:
    """`chunks` of `bucket` into `view`, `window` requests ahead. In the worker's process the engine's Python shares the
    interpreter lock with this thread, and each socket call gives the lock up and waits for it again behind that Python
    (up to the switch interval): so the compiled receiving loop takes the chunks where it is on (`lane_native`,
    `batch_bytes` at a time before `on_chunk` hears of them), else requests go out half a window at a time, and a
    chunk's checksum, its bytes and the next reply's header come in one `recvmsg_into`."""
    asks = b"RPBD" if delta_base >= 0 else b"RPBE" if early else b"RPBQ"
    if chunks and view.nbytes and not view.readonly and lane_native.enabled():
        _fetch_chunks_native(sock, version, bucket, list(chunks), view, window, on_chunk, stop, delta_base, batch_bytes, asks)
        return
    n = len(chunks)
    sent = 0
    head = memoryview(bytearray(_REPLY.size))

    def ask(upto: int) -> int:
        reqs = b"".join(_REQUEST.pack(asks, version, bucket, off, k)
                        + (_DELTA_BASE.pack(delta_base) if delta_base >= 0 else b"") for off, k in chunks[sent:upto])
        sock.sendall(reqs)
        return upto

    sent = ask(min(n, max(1, window)))
    _recv_into_exact(sock, head)
    for k, (offset, nbytes) in enumerate(chunks):
        if sent < n and sent - (k + 1) < max(1, window // 2):
            sent = ask(min(n, k + 1 + max(1, window)))  # (the next reply's header is read with this chunk: asked first)
        magic, status, size, n_text = _REPLY.unpack(head)
        if magic != b"RPBA":
            raise ConnectionError("not a bulk-lane reply")
        if status != OK:
            text = _recv_exact(sock, n_text).decode(errors="replace") if n_text else ""
            raise BulkError(STATUS_CODES[status] if status < len(STATUS_CODES) else f"status_{status}", text)
        if size != nbytes:
            raise ConnectionError(f"a reply of {size} bytes to a request of {nbytes}")
        text_buf = bytearray(n_text)
        part = view[offset : offset + nbytes]
        _recv_into_parts(sock, [memoryview(text_buf), part, *([head] if k + 1 < n else [])])
        on_chunk(bucket, offset, nbytes, text_buf.decode(errors="replace"), part)
        if stop.is_set():
            return


def _fetch_chunks_native(sock: socket.socket, version: int, bucket: int, chunks: list[tuple[int, int]], view: memoryview,
                         window: int, on_chunk: Callable[[int, int, int, str, memoryview], None], stop: threading.Event,
                         delta_base: int, batch_bytes: int, magic: bytes = b"RPBQ") -> None:
    """`_fetch_chunks` by the compiled receiving loop (`lane_native.ChunkFetch`): the landed chunks are handed to
    `on_chunk` after each return, with the text each carried."""
    job = lane_native.ChunkFetch(chunks, magic, version, bucket, delta_base, max(1, window), view)
    text = b""  # what the chunks landed so far carried (a reply's checksum text)
    k = 0
    while k < len(chunks):
        why = job.run(sock, text, max(1, batch_bytes))
        done = job.done
        for i in range(k, done):
            carried = job.text if why == lane_native.NEW_TEXT and i == done - 1 else text
            offset, nbytes = chunks[i]
            on_chunk(bucket, offset, nbytes, carried.decode(errors="replace"), view[offset : offset + nbytes])
        if why == lane_native.NEW_TEXT:
            text = job.text
        k = done
        if stop.is_set():
            return
        if why in (lane_native.ALL_LANDED, lane_native.BATCH, lane_native.NEW_TEXT):
            continue
        if why == lane_native.BAD_STATUS:
            _magic, status, size, n_text = _REPLY.unpack(job.header)
            if status != OK:
                message = _recv_exact(sock, n_text).decode(errors="replace") if n_text else ""
                raise BulkError(STATUS_CODES[status] if status < len(STATUS_CODES) else f"status_{status}", message)
            raise ConnectionError(f"a reply of {size} bytes to a request of {chunks[k][1]}")
        if why == lane_native.NOT_LANE:
            raise ConnectionError("not a bulk-lane reply")
        if why == lane_native.CLOSED:
            raise ConnectionError("the peer closed the connection")
        if why in (-errno.EAGAIN, -errno.EWOULDBLOCK):
            raise BlockingIOError(errno.EAGAIN, "the kernel's timeout")
        raise OSError(-why, os.strerror(-why))


def _recv_into_parts(sock: socket.socket, parts: list[memoryview]) -> None:
    """Fill `parts` in order from `sock`: one call in blocking mode (`kernel_timeouts`), more only on a timeout or a signal."""
    parts = [p for p in parts if p.nbytes]
    while parts:
        got = sock.recvmsg_into(parts, 0, socket.MSG_WAITALL)[0]
        if got == 0:
            raise ConnectionError("the peer closed the connection")
        while parts and got >= parts[0].nbytes:
            got -= parts[0].nbytes
            parts.pop(0)
        if parts and got:
            parts[0] = parts[0][got:]


# ---------------------------------------------------------------------------------------------- the subscriber's transfer


def _taken(queue: deque[tuple[int, list[tuple[int, int]]]]) -> Iterator[tuple[int, list[tuple[int, int]]]]:
    """A stream thread's jobs: the next one from the shared queue each time it is free (``popleft`` is atomic)."""
    while True:
        try:
            yield queue.popleft()
        except IndexError:
            return


class _BulkTransfer:
    """The network path over a server's bulk lane: as the ROUTER's chunk window (`paths.network`), without a copy per byte.

    The version's buckets, in order, are jobs in one queue (the last ones cut into parts, see `plan`); each of
    `streams` threads, with one TCP connection, takes the next job when free, asks for its chunks `window_chunks`
    ahead and receives each one straight into its bucket's buffer. A whole bucket is folded into its running
    checksum as it lands, `fold_bytes` at a time (recently landed: in cache); a bucket cut into parts is checksummed in one pass by the thread that
    lands its last part. A bucket that fails is fetched again whole
    by that thread (at most `max_refetch` times); an error status ends the transfer (``gone``:
    `WeightVersionGoneError`); a connection that fails or is silent for `fetch_timeout_s` raises
    `BulkUnavailableError` (the caller takes the ROUTER for the version). `on_bucket` and the sink are told on the loop.
    """

    def __init__(self, ctx: FetchContext, peer: bytes, manifest: Manifest, buffers: list[torch.Tensor], sink: TransferSink | None,
                 on_bucket: BucketCallback | None, host: str, port: int, early: bool = False) -> None:
        self.ctx = ctx
        self.early = early and manifest.delta_base < 0 and manifest.protocol_minor >= EARLY_BYTES_MINOR
        """Ask with ``RPBE``: a bucket's chunks but its last before its checksum (`fetch_bucket_range`)."""
        self.peer = peer
        self.manifest = manifest
        self.buffers = buffers
        self.views = [memoryview(b.numpy().data).cast("B") if b.numel() else memoryview(b"") for b in buffers]
        self.sink = sink
        self.on_bucket = on_bucket
        self.host, self.port = host, port
        self.chunk = chunk_bytes_of(manifest)
        self.expected = [b.checksum for b in manifest.buckets]
        self.sums: list[Checksummer | None] = [Checksummer.for_digest(c) if c else None for c in self.expected]
        n = len(manifest.buckets)
        self.failures = [0] * n
        self.parts_left = [0] * n
        self.folding = [True] * n
        """The bucket's chunks arrive in order on one thread: folded into its running checksum as they land."""
        self.folded_to = [0] * n
        """A folded bucket's bytes below this are in its running checksum (`fold_bytes` at a time, the rest at its end)."""
        self.fold_bytes = fold_bytes(ctx.streams, self.chunk)
        self.verified: set[int] = set()
        """Buckets whole and verified (kept when the lane fails and the rest comes over the ROUTER)."""
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.loop = asyncio.get_running_loop()
        self.t0 = time.monotonic()
        self.first_ms = [-1.0] * n
        """Per bucket: ms from the transfer's start to its first chunk landing (the ``weights fetched`` line's timeline:
        a bucket the publisher had not summed yet waits there)."""
        self.verified_ms = [-1.0] * n
        """Per bucket: ms to it being whole and verified (then handed to `on_bucket`)."""

    def timeline(self) -> dict[str, Any]:
        """Where the transfer's time went, per bucket (the shared-memory path logs its own, `paths.shm`)."""
        return {"total_ms": self._ms(), "first_chunk_ms": self.first_ms, "verified_ms": self.verified_ms}

    def _ms(self) -> float:
        return round((time.monotonic() - self.t0) * 1000, 1)

    def plan(self, streams: int) -> list[tuple[int, list[tuple[int, int]]]]:
        """The version's jobs for `streams` threads (`rollpool.weights.manifest.stream_jobs`)."""
        jobs, self.parts_left, self.folding = stream_jobs([b.nbytes for b in self.manifest.buckets], self.chunk, streams)
        return jobs

    async def run(self) -> None:
        ctx, version = self.ctx, self.manifest.version
        queue = deque(self.plan(ctx.streams))
        for i, b in enumerate(self.manifest.buckets):
            if b.nbytes == 0:
                self.parts_left[i] = 1
                if self._part_done(i):
                    raise WeightSyncError(f"weight version {version}: empty bucket {i} does not match its checksum")
        n = max(1, min(ctx.streams, len(queue)))
        pool = ThreadPoolExecutor(n, thread_name_prefix="weights-bulk")
        futures = [
            self.loop.run_in_executor(pool, functools.partial(
                fetch_bucket_range, self.host, self.port, self.peer, version, _taken(queue), self.views, timeout_s=ctx.fetch_timeout_s,
                window=ctx.window_chunks, on_chunk=self._on_chunk, on_part_done=self._part_done, stop=self.stop,
                delta_base=self.manifest.delta_base, batch_bytes=self.fold_bytes, early=self.early))
            for _ in range(n)
        ] if queue else []
        try:
            await asyncio.gather(*futures)
        except BulkError as exc:
            if exc.code == "gone":
                raise WeightVersionGoneError(version, exc.message) from None
            if exc.code == "busy":
                raise BulkUnavailableError(str(exc)) from None
            raise WeightSyncError(f"weight version {version}: the bulk lane refused a fetch: {exc}") from None
        finally:
            self.stop.set()
            await asyncio.gather(*futures, return_exceptions=True)  # each thread ends at its next chunk
            pool.shutdown(wait=False)

    def _chunks_of(self, bucket: int) -> list[tuple[int, int]]:
        n = self.manifest.buckets[bucket].nbytes
        return [(off, min(self.chunk, n - off)) for off in range(0, n, self.chunk)]

    def _on_chunk(self, bucket: int, offset: int, nbytes: int, checksum: str, data: memoryview) -> None:
        """Stream thread: a chunk is in its bucket; fold it into the running checksum when the bucket is folded."""
        if checksum and checksum != self.expected[bucket]:
            with self.lock:
                if checksum != self.expected[bucket]:
                    if self.expected[bucket] or not checksum_supported(checksum.partition(":")[0]):
                        raise WeightSyncError(f"weight version {self.manifest.version}: bucket {bucket}: a chunk naming checksum "
                                              f"{checksum!r}, not {self.expected[bucket]!r}")
                    self.expected[bucket] = checksum  # a streamed manifest's pending checksum: the bucket's chunks carry it
                    early = self.sums[bucket]
                    if early is None or early.algorithm != checksum.partition(":")[0]:  # (else its early fold stands)
                        self.sums[bucket] = Checksummer.for_digest(checksum)
                        self.folded_to[bucket] = 0
                    if self.sink is not None:
                        self.loop.call_soon_threadsafe(self.sink.on_checksum, bucket, checksum)
        if self.first_ms[bucket] < 0:
            self.first_ms[bucket] = self._ms()
        summer = self.sums[bucket]
        if summer is None and not checksum and self.folding[bucket]:
            # bytes before the checksum (RPBE): folded as they land all the same, by this side's default algorithm (a
            # publisher's, unless the two differ: then the bucket is folded again from its start once the text names it)
            summer = self.sums[bucket] = Checksummer()
        if self.folding[bucket] and summer is not None and offset + nbytes - self.folded_to[bucket] >= self.fold_bytes:
            summer.update(self.views[bucket][self.folded_to[bucket] : offset + nbytes])
            self.folded_to[bucket] = offset + nbytes
        counters = self.ctx.counters
        with counters.lock:
            counters.bytes_received += nbytes
            counters.bulk_bytes += nbytes
            counters.early_bytes += 0 if checksum else nbytes  # (only an RPBE reply carries no text)
        if self.sink is not None:
            self.loop.call_soon_threadsafe(self.sink.on_chunk, bucket, offset, nbytes)

    def _part_done(self, bucket: int) -> list[tuple[int, int]]:
        """Stream thread: its part of a bucket landed. When the bucket is whole, verify it; the chunks to fetch
        again (all of the bucket's, on this thread, folded in order), or none."""
        with self.lock:
            self.parts_left[bucket] -= 1
            if self.parts_left[bucket] > 0:
                return []  # another thread lands the rest and verifies
        info, expected, summer = self.manifest.buckets[bucket], self.expected[bucket], self.sums[bucket]
        if info.nbytes == 0:
            ok = not expected or verify_checksum(expected, b"")
        elif not expected:
            ok = False  # no chunk named the pending checksum: nothing to verify against
        elif self.folding[bucket]:
            if summer is not None and self.folded_to[bucket] < info.nbytes:
                summer.update(self.views[bucket][self.folded_to[bucket] :])
            ok = summer is not None and verify_checksum(expected, running=summer)
        else:
            ok = verify_checksum(expected, self.views[bucket])  # cut into parts: one pass over the whole bucket
        if ok:
            with self.lock:
                self.verified.add(bucket)
            self.verified_ms[bucket] = self._ms()
            if self.on_bucket is not None:
                self.loop.call_soon_threadsafe(self.on_bucket, bucket, unpack_bucket(info, self.buffers[bucket]))
            return []
        self.ctx.bucket_failed(self.manifest.version, bucket, self.failures, NETWORK, "", "bulk lane", loop=self.loop)
        self.sums[bucket] = Checksummer.for_digest(expected) if expected else None
        self.folding[bucket] = True
        self.folded_to[bucket] = 0
        self.parts_left[bucket] = 1
        if self.sink is not None:
            self.loop.call_soon_threadsafe(self.sink.on_bucket_reset, bucket)
        return self._chunks_of(bucket)


class BulkPath:
    """The subscriber's end of the bulk lane: the version over the lane, or a `PathFallbackError` that keeps what the
    lane verified (the ROUTER fetches the rest)."""

    name = BULK
    host_buffers = True

    def __init__(self, ctx: FetchContext, peer: bytes, endpoint: Callable[[], str | None], *, early_bytes: bool = True) -> None:
        self.ctx = ctx
        self.peer = peer
        self.endpoint = endpoint
        """The ROUTER endpoint in use (the lane is on its host)."""
        self.early_bytes = early_bytes
        """Take a bucket's bytes before its checksum from a server that offers it (``RPBE``, `EARLY_BYTES_MINOR`): the
        bucket is verified as before, once its last chunk brought the checksum. A relay does not (its downstream's
        older subscribers would get bytes with no checksum from it)."""
        self.unreachable: set[tuple[str, int]] = set()
        """Lanes that could not be connected to at all: not tried again (a firewall stays shut)."""

    async def fetch(self, job: FetchJob) -> Fetched:
        assert job.buffers is not None
        manifest, buffers, sink = job.manifest, job.buffers, job.sink
        host = lane_host(self.endpoint())
        assert host is not None  # the plan takes the lane only on a TCP endpoint
        bulk = _BulkTransfer(self.ctx, self.peer, manifest, buffers, sink, job.on_bucket, host, manifest.bulk_port, self.early_bytes)
        try:
            await bulk.run()
        except BulkUnavailableError as exc:
            # the rest of the version over the ROUTER: the buckets the lane verified are kept (and were staged);
            # the others start again (a relay's downstream forgets what it was told had arrived of them)
            if exc.unreachable:
                self.unreachable.add((host, manifest.bulk_port))
            log.info("weight version %d: %s (%d of %d buckets verified over it)", manifest.version, exc, len(bulk.verified), len(buffers))
            if sink is not None:
                for i in range(len(buffers)):
                    if i not in bulk.verified:
                        sink.on_bucket_reset(i)
            raise PathFallbackError("bulk lane unavailable", resume=(_with_checksums(manifest, bulk.expected), frozenset(bulk.verified))) from None
        return Fetched(_with_checksums(manifest, bulk.expected), buffers, job.slab, NETWORK, {"timeline": bulk.timeline()})


def _with_checksums(manifest: Manifest, checksums: list[str]) -> Manifest:
    return replace(manifest, buckets=tuple(replace(b, checksum=c) for b, c in zip(manifest.buckets, checksums, strict=True)))
