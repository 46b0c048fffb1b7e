"""A fault-injecting fake link: a ZMTP-aware TCP proxy that loses, duplicates, delays and reorders whole messages.

A fake at the process edge, named so (`FaultyZmtpProxy`). Loss at the TCP
level (netem in a netns) is repaired by TCP and never loses a ZeroMQ message
on a live connection; real systems lose messages anyway (a peer's send
timeout, a full high-water mark, a connection that dies with data queued, a
bug). This proxy makes those losses happen on demand, on live connections, so
that the reconciliation DESIGN.md promises can be tested.

How it works: it listens on a TCP port and, for every connection accepted,
dials the real endpoint. Bytes are parsed as ZMTP 3.x with the NULL mechanism
(RFC 23/37: a 64-byte greeting each way, then frames of a flags byte, a 1- or
8-byte size and a body; a message is a run of frames ending in one without
MORE). Commands (READY, PING, PONG, SUBSCRIBE) pass unchanged; every message
whose first frame is a rollpool header (``[major, minor, type, fields]``) is a
candidate for a fault, in either direction:

- ``up`` is from the connecting peer (DEALER, SUB) to the binding one
  (ROUTER, PUB); ``down`` is the other way;
- drop: the message is not forwarded;
- duplicate: it is forwarded twice, back to back;
- delay: the stream in that direction stops for ``delay_s`` before it (order
  kept: what TCP retransmission would look like, but on a live connection);
- reorder: it is held and sent after the next message of that direction
  (counted as reordered), or after ``reorder_hold_s`` when no next message
  comes (counted as delayed);
- reset: `reset()` aborts every live connection with an RST; both ZeroMQ ends
  see a disconnect, the connecting one dials again, and whatever was queued
  in either direction is lost.

A CURVE connection (mechanism other than NULL) is forwarded untouched and
counted in ``unparsed_connections``: its frames are encrypted.

Faults come from `MessageFaults` (probabilities, optionally limited to message
types and a direction, seeded) and from one-shot `FaultRule`s a test adds for
a precise scenario ("drop the next batch going down"). `counts` holds, per
port name, direction, message type and action (forwarded, dropped,
duplicated, delayed, reordered), how many messages it touched; every copy
written counts once as forwarded or duplicated, so what the far end received
is exactly ``forwarded + duplicated``. `report()` returns them as a nested dict.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgpack

__all__ = ["ACTIONS", "FaultRule", "FaultyZmtpProxy", "MessageFaults"]

log = logging.getLogger(__name__)

ACTIONS = ("forwarded", "dropped", "duplicated", "delayed", "reordered")
_GREETING_BYTES = 64
_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04


@dataclass
class MessageFaults:
    """Random per-message faults; each probability applies to every candidate message independently."""

    drop: float = 0.0
    duplicate: float = 0.0
    delay: float = 0.0
    reorder: float = 0.0
    delay_s: float = 0.05
    reorder_hold_s: float = 0.2
    types: frozenset[str] | None = None
    """Only these message types (None: every rollpool message)."""
    direction: str | None = None
    """``up``, ``down`` or None (both)."""

    def __post_init__(self) -> None:
        for name in ("drop", "duplicate", "delay", "reorder"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"MessageFaults.{name} must be within [0, 1], got {p}")
        if self.direction not in (None, "up", "down"):
            raise ValueError(f"MessageFaults.direction must be 'up', 'down' or None, got {self.direction!r}")

    @property
    def active(self) -> bool:
        return bool(self.drop or self.duplicate or self.delay or self.reorder)


@dataclass
class FaultRule:
    """A one-shot fault: the next `count` messages of `msg_type` going `direction` get `action`."""

    msg_type: str
    action: str
    direction: str = "down"
    count: int = 1
    skip: int = 0
    """Let this many matching messages pass first."""
    hits: int = 0

    def __post_init__(self) -> None:
        if self.action not in ("drop", "duplicate", "delay", "reorder"):
            raise ValueError(f"FaultRule.action must be drop, duplicate, delay or reorder, got {self.action!r}")
        if self.direction not in ("up", "down"):
            raise ValueError(f"FaultRule.direction must be 'up' or 'down', got {self.direction!r}")


@dataclass(eq=False)
class _Conn:
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class _Held:
    """A message held back for reordering, with the timer that releases it if nothing follows."""

    def __init__(self, data: bytes, kind: str, handle: asyncio.TimerHandle) -> None:
        self.data = data
        self.kind = kind
        self.handle = handle


class FaultyZmtpProxy:
    """``await FaultyZmtpProxy("broker:client", "tcp://127.0.0.1:5556").start()``; dial ``proxy.endpoint`` instead."""

    def __init__(self, name: str, upstream: str, *, listen_host: str = "127.0.0.1", listen_port: int = 0, seed: int = 0) -> None:
        if not upstream.startswith("tcp://"):
            raise ValueError(f"FaultyZmtpProxy proxies tcp:// endpoints only, got {upstream!r}")
        host, _, port = upstream[len("tcp://"):].rpartition(":")
        self.name = name
        self.upstream = (host, int(port))
        self.listen = (listen_host, listen_port)
        self.faults = MessageFaults()
        self.rules: list[FaultRule] = []
        self.counts: Counter[tuple[str, str, str]] = Counter()
        """(direction, message type, action) -> messages."""
        self.connections = 0
        self.resets = 0
        self.unparsed_connections = 0
        self.upstream_refused = 0
        self.endpoint = ""
        self._rng = random.Random(seed)
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> FaultyZmtpProxy:
        self._server = await asyncio.start_server(self._accept, self.listen[0], self.listen[1])
        port = self._server.sockets[0].getsockname()[1]
        self.listen = (self.listen[0], port)
        self.endpoint = f"tcp://{self.listen[0]}:{port}"
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.reset(count=False)
        tasks = [t for c in list(self._conns) for t in c.tasks]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None

    def reset(self, *, count: bool = True) -> int:
        """Abort every live connection with an RST (both ends see a disconnect); returns how many."""
        n = 0
        for c in list(self._conns):
            for w in (c.client, c.server):
                _abort(w)
            for t in c.tasks:
                t.cancel()
            self._conns.discard(c)
            n += 1
        if count:
            self.resets += n
        return n

    @property
    def live_connections(self) -> int:
        return len(self._conns)

    # ------------------------------------------------------------------ reporting

    def report(self) -> dict[str, Any]:
        """``{"port", "connections", "resets", "by_type": {direction: {type: {action: n}}}}``."""
        by_type: dict[str, dict[str, dict[str, int]]] = {}
        for (direction, kind, action), n in sorted(self.counts.items()):
            by_type.setdefault(direction, {}).setdefault(kind, {})[action] = n
        return {
            "port": self.name,
            "upstream": f"tcp://{self.upstream[0]}:{self.upstream[1]}",
            "connections": self.connections,
            "resets": self.resets,
            "unparsed_connections": self.unparsed_connections,
            "upstream_refused": self.upstream_refused,
            "by_type": by_type,
        }

    def total(self, action: str, direction: str | None = None, msg_type: str | None = None) -> int:
        return sum(n for (d, t, a), n in self.counts.items()
                   if a == action and (direction is None or d == direction) and (msg_type is None or t == msg_type))

    # ------------------------------------------------------------------ connections

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*self.upstream), 5)
        except (OSError, TimeoutError):
            self.upstream_refused += 1
            _abort(writer)  # like a refused connection: the peer dials again
            return
        for w in (writer, up_writer):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connections += 1
        conn = _Conn(client=writer, server=up_writer)
        self._conns.add(conn)
        loop = asyncio.get_running_loop()
        conn.tasks = [
            loop.create_task(self._pump(reader, up_writer, "up", conn), name=f"zmtp_proxy.{self.name}.up"),
            loop.create_task(self._pump(up_reader, writer, "down", conn), name=f"zmtp_proxy.{self.name}.down"),
        ]

    def _drop_conn(self, conn: _Conn) -> None:
        if conn in self._conns:
            self._conns.discard(conn)
            for w in (conn.client, conn.server):
                _abort(w)
            for t in conn.tasks:
                if t is not asyncio.current_task():
                    t.cancel()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str, conn: _Conn) -> None:
        held: list[_Held] = []
        try:
            # the greeting goes in parts (libzmq sends its signature, then waits for the peer's):
            # forward each piece as it comes
            greeting = b""
            while len(greeting) < _GREETING_BYTES:
                piece = await reader.read(_GREETING_BYTES - len(greeting))
                if not piece:
                    return
                greeting += piece
                writer.write(piece)
                await writer.drain()
            if greeting[12:32].rstrip(b"\0") != b"NULL":
                self.unparsed_connections += direction == "up"
                while data := await reader.read(1 << 16):
                    writer.write(data)
                    await writer.drain()
                return
            parts: list[bytes] = []
            first_body: bytes | None = None
            while True:
                head = await reader.readexactly(2)
                flags = head[0]
                if flags & _LONG:
                    rest = await reader.readexactly(7)
                    size = struct.unpack(">Q", head[1:] + rest)[0]
                    raw_head = head + rest
                else:
                    size = head[1]
                    raw_head = head
                body = await reader.readexactly(size) if size else b""
                if flags & _COMMAND:
                    writer.write(raw_head + body)
                    await writer.drain()
                    continue
                parts.append(raw_head)
                parts.append(body)
                if first_body is None:
                    first_body = body
                if flags & _MORE:
                    continue
                data = b"".join(parts)
                kind = _message_type(first_body)
                parts, first_body = [], None
                await self._forward(data, kind, direction, writer, held)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            for h in held:
                h.handle.cancel()
            self._drop_conn(conn)

    def _choose(self, kind: str, direction: str) -> str | None:
        for rule in self.rules:
            if rule.msg_type == kind and rule.direction == direction and rule.hits < rule.count + rule.skip:
                rule.hits += 1
                if rule.hits > rule.skip:
                    if rule.hits >= rule.count + rule.skip:
                        self.rules.remove(rule)
                    return rule.action
                return None
        f = self.faults
        if kind == "other" or not f.active:
            return None
        if f.direction is not None and f.direction != direction:
            return None
        if f.types is not None and kind not in f.types:
            return None
        r = self._rng.random()
        for action, p in (("drop", f.drop), ("duplicate", f.duplicate), ("delay", f.delay), ("reorder", f.reorder)):
            if r < p:
                return action
            r -= p
        return None

    async def _forward(self, data: bytes, kind: str, direction: str, writer: asyncio.StreamWriter, held: list[_Held]) -> None:
        action = self._choose(kind, direction)
        count = self.counts
        if action == "drop":
            count[direction, kind, "dropped"] += 1
            return
        if action == "delay":
            count[direction, kind, "delayed"] += 1
            await asyncio.sleep(self.faults.delay_s)
        if action == "reorder" and not held:
            loop = asyncio.get_running_loop()

            def release() -> None:  # nothing came to overtake it: it was only late
                if held:
                    h = held.pop()
                    count[direction, h.kind, "delayed"] += 1
                    if not writer.is_closing():
                        writer.write(h.data)
                        count[direction, h.kind, "forwarded"] += 1

            held.append(_Held(data, kind, loop.call_later(self.faults.reorder_hold_s, release)))
            return
        writer.write(data)
        count[direction, kind, "forwarded"] += 1
        if action == "duplicate":
            writer.write(data)
            count[direction, kind, "duplicated"] += 1
        if held:  # this message overtook the held one: now it follows
            h = held.pop()
            h.handle.cancel()
            writer.write(h.data)
            count[direction, h.kind, "reordered"] += 1
            count[direction, h.kind, "forwarded"] += 1
        await writer.drain()


def _message_type(header: bytes) -> str:
    """The type of a rollpool message from its header frame ``[major, minor, type, fields]``, read lazily.

    Only the first three items are unpacked (`peek_type` limits nested sizes and
    gives up on a large Submit); anything that is not a rollpool header is ``other``.
    """
    try:
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(header) + 1)
        unpacker.feed(header)
        if unpacker.read_array_header() != 4:
            return "other"
        unpacker.skip()
        unpacker.skip()
        kind = unpacker.unpack()
        return kind if type(kind) is str and len(kind) <= 64 else "other"
    except Exception:  # noqa: BLE001 - any bytes: a header that does not unpack is of kind 'other'
        return "other"


def _abort(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(Exception):
        writer.transport.abort()
