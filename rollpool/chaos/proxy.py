"""A message-level link-fault proxy between rollout workers and the broker's worker port.

``tc netem`` is the right tool for delay and loss, but it needs the kernel's
netem qdisc, which this machine lacks (``ip netns`` works, ``tc qdisc add ...
netem`` answers "Specified qdisc kind is unknown"). A proxy that dropped bytes
would break ZeroMQ's framing, so this one works on whole messages and models
what a real link does to a TCP connection:

- delay: every message waits ``delay_s`` before it is forwarded;
- loss: a lost TCP segment is retransmitted, so ZeroMQ never loses a message
  on a live connection; with probability ``loss`` a message is held one
  retransmission timeout (``rto_s``) and, like TCP, everything behind it in
  that direction waits too (head-of-line blocking). Order is always kept.

Messages are lost only when a connection dies: that is what the process kills
of the chaos run exercise. Frontend: a ROUTER the workers dial; backend: one
DEALER per worker connection, dialling the broker with a derived identity.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from rollpool.protocol.sockets import SocketFactory

__all__ = ["LinkFaults", "MessageProxy"]

log = logging.getLogger(__name__)


@dataclass
class LinkFaults:
    delay_s: float = 0.0
    loss: float = 0.0
    rto_s: float = 0.2


class MessageProxy:
    def __init__(self, sockets: SocketFactory, *, frontend: str, backend: str, seed: int = 0) -> None:
        self.sockets = sockets
        self.frontend_endpoint = frontend
        self.backend_endpoint = backend
        self.faults = LinkFaults()
        self.forwarded = 0
        self.held = 0
        self.undeliverable = 0
        self._rng = random.Random(seed)
        self._front: Any = None
        self._backs: dict[bytes, Any] = {}
        self._up: asyncio.Queue[tuple[float, bytes, list[bytes]]] = asyncio.Queue()
        self._down: asyncio.Queue[tuple[float, bytes, list[bytes]]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._front = self.sockets.router(self.frontend_endpoint, serves="broker.worker")
        self.frontend_endpoint = self._front.getsockopt_string(zmq.LAST_ENDPOINT)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._front_loop(), name="proxy._front_loop"),
            loop.create_task(self._deliver_loop(self._up, upstream=True), name="proxy._up_loop"),
            loop.create_task(self._deliver_loop(self._down, upstream=False), name="proxy._down_loop"),
        ]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for s in self._backs.values():
            s.close(linger=0)
        if self._front is not None:
            self._front.close(linger=0)

    def _due(self) -> float:
        f = self.faults
        due = asyncio.get_running_loop().time() + f.delay_s
        if f.loss > 0 and self._rng.random() < f.loss:
            self.held += 1
            due += f.rto_s
        return due

    async def _front_loop(self) -> None:
        while True:
            ident, *frames = await self._front.recv_multipart()
            if ident not in self._backs:
                back = self.sockets.dealer(self.backend_endpoint, identity=b"px" + ident)
                self._backs[ident] = back
                self._tasks.append(asyncio.get_running_loop().create_task(self._back_loop(ident, back), name="proxy._back_loop"))
            self._up.put_nowait((self._due(), ident, frames))

    async def _back_loop(self, ident: bytes, back: Any) -> None:
        while True:
            frames = await back.recv_multipart()
            self._down.put_nowait((self._due(), ident, frames))

    async def _deliver_loop(self, queue: asyncio.Queue[tuple[float, bytes, list[bytes]]], *, upstream: bool) -> None:
        loop = asyncio.get_running_loop()
        hold_until = 0.0  # head-of-line: nothing passes a held message
        while True:
            due, ident, frames = await queue.get()
            hold_until = max(hold_until, due)
            wait = hold_until - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            try:
                if upstream:
                    await self._backs[ident].send_multipart(frames, flags=zmq.NOBLOCK)
                else:
                    await self._front.send_multipart([ident, *frames], flags=zmq.NOBLOCK)
                self.forwarded += 1
            except zmq.ZMQError:  # the worker is gone (or not reading): what the real link would do
                self.undeliverable += 1
