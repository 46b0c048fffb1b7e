"""`BrokerLink`: the worker's one DEALER to the broker.

Every message the worker sends goes through `send`: one at a time (a lock keeps
multipart messages whole), within ``send_timeout_s``. It returns False instead of
raising when the broker cannot be reached. The DEALER sets ZMQ_IMMEDIATE, so nothing
queues for an absent broker; the session keeps what must not be lost (results) and
hellos retry. `recv` decodes strictly. An undecodable message is logged (once a
minute) and skipped, never fatal. Imports only `rollpool.protocol` (and pyzmq).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from rollpool.protocol import decode, encode
from rollpool.protocol.errors import ProtocolError
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
        """Send one message; False when the broker is unreachable within the send timeout (or not connected)."""
        if self._sock is None:
            return False
        frames = encode(msg)
        async with self._lock:
            try:
                await asyncio.wait_for(self._sock.send_multipart(frames), self.send_timeout_s)
            except TimeoutError:
                self.send_failures += 1
                log.debug("send of %s timed out", type(msg).__name__)
                return False
            except Exception as exc:  # noqa: BLE001 - zmq errors: the broker is unreachable
                self.send_failures += 1
                log.warning("send of %s failed: %s", type(msg).__name__, exc)
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
