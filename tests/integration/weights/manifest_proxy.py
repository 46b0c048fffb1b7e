"""A message proxy in front of a weight server's ROUTER, for faults on a live connection: the subscriber dials the
proxy's ROUTER; each of its sockets gets a DEALER to the server (its identity kept). Every request and reply passes a
hook that may drop it, hold it for a while, or rewrite its frames (a peer of an older minor). Real ZeroMQ sockets, real
frames; only the hooks decide."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from rollpool.protocol.codec import decode

Hook = Callable[[list[bytes], Any], "tuple[list[bytes], float] | None"]
"""``hook(frames, decoded)``: None drops the message; ``(frames, delay_s)`` forwards `frames` after `delay_s`."""


def passthrough(frames: list[bytes], msg: Any) -> tuple[list[bytes], float] | None:
    return frames, 0.0


class ManifestProxy:
    def __init__(self, ctx: zmq.asyncio.Context, backend: str, *, up: Hook = passthrough, down: Hook = passthrough) -> None:
        self.ctx = ctx
        self.backend = backend
        self.up = up
        self.down = down
        self.requests: list[Any] = []
        """Every request the subscriber sent, decoded (before the hook)."""
        self.replies: list[Any] = []
        """Every reply the server sent, decoded (before the hook)."""
        self.endpoint = ""
        self._front: Any = None
        self._backs: dict[bytes, Any] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> ManifestProxy:
        self._front = self.ctx.socket(zmq.ROUTER)
        self._front.setsockopt(zmq.LINGER, 0)
        self._front.bind("tcp://127.0.0.1:*")
        self.endpoint = self._front.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._spawn(self._front_loop())
        return self

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for s in (self._front, *self._backs.values()):
            if s is not None:
                s.close(linger=0)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _front_loop(self) -> None:
        while True:
            ident, *frames = await self._front.recv_multipart()
            back = self._backs.get(ident)
            if back is None:
                back = self._backs[ident] = self.ctx.socket(zmq.DEALER)
                back.setsockopt(zmq.LINGER, 0)
                back.setsockopt(zmq.IDENTITY, ident)
                back.connect(self.backend)
                self._spawn(self._back_loop(ident, back))
            msg = decode(frames)
            self.requests.append(msg)
            self._forward(self.up(frames, msg), back, [])

    async def _back_loop(self, ident: bytes, back: Any) -> None:
        while True:
            frames = await back.recv_multipart()
            msg = decode(frames)
            self.replies.append(msg)
            self._forward(self.down(frames, msg), self._front, [ident])

    def _forward(self, verdict: tuple[list[bytes], float] | None, sock: Any, prefix: list[bytes]) -> None:
        if verdict is None:
            return
        frames, delay_s = verdict
        if delay_s <= 0:
            sock.send_multipart([*prefix, *frames])
            return

        async def later() -> None:
            await asyncio.sleep(delay_s)
            await sock.send_multipart([*prefix, *frames])

        self._spawn(later())
