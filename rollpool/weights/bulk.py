"""The network path's bulk lane (protocol minor 13): bucket bytes over plain TCP, straight into the subscriber's buffer.

Over ZeroMQ a chunk is received into a ZeroMQ message and then copied into its bucket: one memory pass per byte
that a receiver writing into caller memory does not make (`Socket.recv_into` copies out of a message too).
This lane keeps the manifest, the versions, the checksums and verify-then-apply of the ROUTER path and moves
only the chunk bytes: the server answers each request with `sendall` from the version's own buffers, the
subscriber `recv_into`s its bucket and folds the chunk into the bucket's running checksum while it is in cache.

Wire (all integers little-endian; one TCP connection per subscriber stream, requests pipelined):

    hello     b"RPBH" u16 n, n bytes: the subscriber's peer id (its ROUTER identity without ``#<stream>``)
    request   b"RPBQ" u64 version, u32 bucket, u64 offset, u32 nbytes
    reply     b"RPBA" u8 status, u32 nbytes, u16 n, n bytes: the bucket's checksum (status 0) or the error
              message; then `nbytes` bytes of the chunk (status 0 only)

Status: 0 ok, 1 ``gone``, 2 ``unknown_version``, 3 ``bad_range``, 4 ``busy`` (the bytes did not arrive in time),
5 ``bad_request`` (then the server closes the connection). The server names the lane in every manifest
(`Manifest.bulk_port`: the ROUTER's port + 2 when that port is fixed, any free one otherwise); the subscriber
connects to the host of the ROUTER endpoint it already uses (and, when it cannot connect at all, does not try
that lane again). A server
whose sockets use CURVE, or whose ROUTER is not on TCP, offers no lane (the bytes would bypass the
encryption); a subscriber that cannot reach the lane, or loses it mid-version, takes the ROUTER path for the
version (logged, counted in `WeightSubscriber.fallbacks`). ``ROLLPOOL_WEIGHT_BULK=0`` turns it off on either side.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollpool.weights.serving import WeightServer

__all__ = ["BulkError", "BulkServer", "BulkUnavailable", "bulk_enabled", "fetch_bucket_range", "lane_host", "lane_port"]

log = logging.getLogger(__name__)

_HELLO = struct.Struct("<4sH")
_REQUEST = struct.Struct("<4sQIQI")
_REPLY = struct.Struct("<4sBIH")
_MAX_PEER_ID = 512
OK, GONE, UNKNOWN_VERSION, BAD_RANGE, BUSY, BAD_REQUEST = range(6)
STATUS_CODES = ("ok", "gone", "unknown_version", "bad_range", "busy", "bad_request")


def bulk_enabled() -> bool:
    """``ROLLPOOL_WEIGHT_BULK`` (default on): ``0``, ``false`` or ``off`` turns the lane off on this side."""
    return os.environ.get("ROLLPOOL_WEIGHT_BULK", "1").strip().lower() not in ("0", "false", "off", "no")


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


class BulkUnavailable(Exception):
    """The lane cannot be used for this version (unreachable, reset, silent): take the ROUTER path.

    `unreachable`: the connection could not be made at all (a firewall, a port not published); the subscriber
    does not try that lane again."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


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
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the peer closed the connection")
        got += k


# ---------------------------------------------------------------------------------------------- the server


class BulkServer:
    """The lane's server beside a `WeightServer`: one thread per connection, answering from its versions.

    A connection thread looks each request up on the event loop, where the version store lives (the same
    checks and the same source `read` as the ROUTER's fetch), then sends from its own thread, holding the bytes
    while it does (so a source's buffer counts as in flight, as a zero-copy ZeroMQ frame would); what the loop
    keeps (bytes served per peer, the last request time that `keep_versions=0` releases on) is handed to the loop
    after each chunk. A request for bytes not yet arrived (a streamed or relayed version) waits up to `wait_s`
    for `notify`, then is answered ``busy``.
    """

    def __init__(self, server: WeightServer, host: str, port: int = 0, *, wait_s: float = 30.0, idle_s: float = 120.0,
                 max_connections: int = 256) -> None:
        self.server = server
        self.wait_s = wait_s
        self.idle_s = idle_s
        """A connection that sends nothing for this long is closed (a subscriber opens its connections per version)."""
        self.max_connections = max_connections
        self.bytes_served = 0
        self.chunks_served = 0
        self.connections = 0
        self.refused = 0
        self._arrived = threading.Condition()
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
            conn.settimeout(self.idle_s)
            self._conns.add(conn)
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), name=f"{self.server.name}.bulk.conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            magic, n = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
            if magic != b"RPBH" or n > _MAX_PEER_ID:
                self._refuse(conn, "not a bulk-lane hello")
                return
            peer = _recv_exact(conn, n)
            while not self._closed:
                magic, version, bucket, offset, nbytes = _REQUEST.unpack(_recv_exact(conn, _REQUEST.size))
                if magic != b"RPBQ":
                    self._refuse(conn, "not a bulk-lane request")
                    return
                self._answer(conn, peer, version, bucket, offset, nbytes)
        except (OSError, struct.error):
            pass  # the subscriber left (or sent garbage): nothing of ours is lost, it asks again elsewhere
        finally:
            self._conns.discard(conn)
            conn.close()

    def _answer(self, conn: socket.socket, peer: bytes, version: int, bucket: int, offset: int, nbytes: int) -> None:
        found = self._on_loop(self._lookup, version, bucket, offset, nbytes)
        began = time.monotonic()
        waited = 0.0
        while found is None and waited < self.wait_s and not self._closed:  # the bytes have not arrived yet
            with self._arrived:
                self._arrived.wait(min(0.5, self.wait_s - waited))
            waited = time.monotonic() - began  # by the clock: every arrival of other bytes wakes this thread
            found = self._on_loop(self._lookup, version, bucket, offset, nbytes)
        if found is None:
            self._reply(conn, BUSY, f"bucket {bucket} of version {version}: the bytes did not arrive within {self.wait_s} s")
            return
        status, text, data, v = found
        if status != OK:
            self._reply(conn, status, text)
            return
        body = text.encode()
        conn.sendall(_REPLY.pack(b"RPBA", OK, nbytes, len(body)) + body)
        conn.sendall(data)
        del data
        self.bytes_served += nbytes
        self.chunks_served += 1
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nothing left to account to
                self._loop.call_soon_threadsafe(self.server.bulk_served, v, peer, nbytes, waited > 0)

    def _lookup(self, version: int, bucket: int, offset: int, nbytes: int) -> tuple[int, str, Any, Any] | None:
        """On the loop, as the ROUTER's fetch: (status, checksum or message, bytes, version), None: not arrived yet."""
        from rollpool.weights.serving import MAX_CHUNK_BYTES

        srv = self.server
        v = srv.versions.get(version)
        if v is None:
            latest = srv.latest
            latest_v = latest.version if latest is not None else -1
            if version <= max(srv.highest_dropped, latest_v):
                return GONE, f"version {version} is no longer served (latest is {latest_v})", None, None
            return UNKNOWN_VERSION, f"version {version} is not published (latest is {latest_v})", None, None
        if v.released:
            return GONE, f"version {version} was released by its publisher (keep_versions=0)", None, None
        size = v.buckets[bucket].nbytes if 0 <= bucket < len(v.buckets) else -1
        if size < 0 or nbytes < 1 or nbytes > MAX_CHUNK_BYTES or offset + nbytes > size:
            return BAD_RANGE, f"[{offset}, +{nbytes}) is not a chunk of bucket {bucket} of version {version}", None, None
        if self._loop is not None:
            v.last_request_s = self._loop.time()  # as the ROUTER's fetch: keep_versions=0 releases after an idle spell
        data = v.sources[bucket].read(offset, nbytes)
        if data is None:
            return None
        return OK, v.buckets[bucket].checksum, data, v

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
            raise BulkUnavailable(f"cannot reach the bulk lane at {host}:{port}: {exc}", unreachable=True) from exc
        self.sock.settimeout(timeout_s)
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
) -> None:
    """Thread of one subscriber stream: fetch `jobs` (bucket, chunks of it as (offset, nbytes)) into `views`.

    `on_chunk(bucket, offset, nbytes, checksum, data)` runs in this thread once a chunk is in its view (the caller
    folds it into the running checksum); `on_part_done(bucket)` runs when this job's chunks of the bucket have
    landed and returns the chunks to fetch again (a bucket that failed its checksum), or none. Raises `BulkError`
    for an error status, `BulkUnavailable` when the connection fails or goes silent for `timeout_s`.
    """
    lane = _Lane(host, port, peer, timeout_s)
    try:
        for bucket, chunks in jobs:
            todo = chunks
            while todo and not stop.is_set():
                _fetch_chunks(lane.sock, version, bucket, todo, views[bucket], window, on_chunk, stop)
                if stop.is_set():
                    return
                todo = on_part_done(bucket)
    except (OSError, ConnectionError, struct.error) as exc:
        raise BulkUnavailable(f"the bulk lane to {host}:{port} failed: {exc}") from exc
    finally:
        lane.close()


def _fetch_chunks(sock: socket.socket, version: int, bucket: int, chunks: Sequence[tuple[int, int]], view: memoryview,
                  window: int, on_chunk: Callable[[int, int, int, str, memoryview], None], stop: threading.Event) -> None:
    sent = 0
    for k, (offset, nbytes) in enumerate(chunks):
        while sent < len(chunks) and sent < k + window:
            off, n = chunks[sent]
            sock.sendall(_REQUEST.pack(b"RPBQ", version, bucket, off, n))
            sent += 1
        magic, status, size, n_text = _REPLY.unpack(_recv_exact(sock, _REPLY.size))
        text = _recv_exact(sock, n_text).decode(errors="replace") if n_text else ""
        if magic != b"RPBA":
            raise ConnectionError("not a bulk-lane reply")
        if status != OK:
            raise BulkError(STATUS_CODES[status] if status < len(STATUS_CODES) else f"status_{status}", text)
        if size != nbytes:
            raise ConnectionError(f"a reply of {size} bytes to a request of {nbytes}")
        part = view[offset : offset + nbytes]
        _recv_into_exact(sock, part)
        on_chunk(bucket, offset, nbytes, text, part)
        if stop.is_set():
            return
