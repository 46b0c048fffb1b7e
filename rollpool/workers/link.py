"""`BrokerLink`: the worker's one DEALER to the broker.

Every message the worker sends goes through `send`: one at a time (a lock keeps
multipart messages whole), within ``send_timeout_s``. It returns False instead of
raising when the broker cannot be reached. The DEALER sets ZMQ_IMMEDIATE, so nothing
queues for an absent broker; the session keeps what must not be lost (results) and
hellos retry. `recv` decodes strictly. An undecodable message is logged (once a
minute) and skipped, never fatal. Imports only `rollpool.protocol` (and pyzmq).

Oversize: libzmq drops a message part over the broker's MAXMSGSIZE together with the
connection and tells nobody, so `send` checks every message against the limits the
broker announced in its Welcome (`peer_limits`; the defaults before one came) and
refuses one over them with `MessageTooLargeError`, which names the limit; each refusal
is logged and counted by limit (`refused`). The worker turns a refused Result into an
error result for the task (see `Worker._do`), so the trainer is told and nothing is lost.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from rollpool.protocol import Hello, Inline, decode, encode
from rollpool.protocol.codec import check_size
from rollpool.protocol.errors import MessageTooLargeError, ProtocolError
from rollpool.protocol.logs import RateLimitedLog
from rollpool.protocol.sockets import SocketFactory

__all__ = ["BrokerLink"]

log = logging.getLogger(__name__)


class BrokerLink:
    """The DEALER socket to the broker's worker port (see the module docstring)."""

    def __init__(self, sockets: SocketFactory, endpoint: str, identity: str, send_timeout_s: float) -> None:
        self.sockets = sockets
        self.endpoint = endpoint
        self.identity = identity
        self.send_timeout_s = send_timeout_s
        self.sent = 0
        self.send_failures = 0
        self.bad_messages = 0
        self.peer_limits: tuple[int, int] = (0, 0)
        """(max_msg_bytes, max_header_bytes) the broker announced in its Welcome; 0: not said (the defaults)."""
        self.inline: Inline | None = None
        """How small arrays travel to the broker: inline in the header once a Welcome settled on minor 12 or later
        (`inline_for`), None (every array in a frame) before, and from each Hello until the next Welcome (the
        broker answering it may be an older one)."""
        self.refused: dict[str, int] = {}
        """Messages refused before sending, by the limit they were over (``max_msg_bytes``, ``max_header_bytes``)."""
        self._sock: Any = None  # zmq.asyncio.Socket (SocketFactory is typed Any)
        self._lock = asyncio.Lock()
        self._bad = RateLimitedLog(log)

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def connect(self) -> None:
        import zmq

        sock = self.sockets.dealer(None, identity=self.identity.encode())
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no queue for an absent broker: hellos retry instead
        sock.connect(self.endpoint)
        self._sock = sock

    async def send(self, msg: object) -> bool:
        """Send one message; False when the broker is unreachable within the send timeout (or not connected).

        Raises `MessageTooLargeError` (logged, counted in `refused`) for a message over `peer_limits`: the
        broker's libzmq would drop it with the connection.
        """
        if self._sock is None:
            return False
        if type(msg) is Hello:
            self.inline = None
        frames = encode(msg, self.inline)
        try:
            check_size(frames, self.peer_limits[0], getattr(msg, "TYPE", type(msg).__name__), self.peer_limits[1])
        except MessageTooLargeError as exc:
            limit = exc.limit or "max_msg_bytes"
            self.refused[limit] = self.refused.get(limit, 0) + 1
            self._bad.warning(f"oversize:{limit}", "not sending to the broker: %s", exc)
            raise
        async with self._lock:
            try:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for loses a cancel that lands as the send completes,
                # and the loop that sent (a worker being stopped) then runs on instead of ending
                async with asyncio.timeout(self.send_timeout_s):
                    await self._sock.send_multipart(frames)
            except TimeoutError:
                self.send_failures += 1
                self._bad.warning(f"send:{type(msg).__name__}", "send of %s to the broker at %s timed out after %.1f s "
                                  "(is a broker listening there?)", type(msg).__name__, self.endpoint, self.send_timeout_s)
                return False
            except Exception as exc:  # noqa: BLE001 - zmq errors: the broker is unreachable
                self.send_failures += 1
                # EAGAIN under ZMQ_IMMEDIATE means no connection: say where nobody answers, once a minute
                self._bad.warning(f"send:{type(msg).__name__}", "send of %s to the broker at %s failed: %s "
                                  "(is a broker listening there? `rollpool status` or the broker's log tells)",
                                  type(msg).__name__, self.endpoint, exc)
                return False
        self.sent += 1
        return True

    async def recv(self) -> object | None:
        """The next message from the broker; None for one that did not decode (logged, counted)."""
        assert self._sock is not None, "connect() first"
        frames = await self._sock.recv_multipart(copy=False)
        try:
            msg: object = decode(frames)
            return msg
        except ProtocolError as exc:
            self.bad_messages += 1
            self._bad.warning("broker", "undecodable message from the broker: %s", exc)
            return None

    def close(self, linger_ms: int = 0) -> None:
        if self._sock is not None:
            self._sock.close(linger=linger_ms)
            self._sock = None
