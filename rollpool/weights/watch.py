"""`PublisherWatch`: what a subscriber knows of its publisher's versions, and its manifest requests.

What it promises
    - It learns of new versions three ways: PUB announcements, a "latest"
      manifest request on `open`, and another whenever `note_version(v)`
      names a version newer than any it knows (a broker heartbeat). So a
      worker that joins late, or missed announcements, catches up. At most one
      such catch-up request is out at a time.
    - The manifest a catch-up request got is the one the next fetch of that
      version takes (`take_known`): one manifest request per version.
    - `fetch_manifest` (the `ManifestSource` every path is handed) retries a
      silent publisher a bounded number of times, each try bounded by its
      timeout; ``gone`` is `WeightVersionGoneError`, any other refusal
      `WeightSyncError`, no answer at all `ManifestTimeoutError`.
    - `forget_newer(v)` forgets versions known above `v` (a rebased pool) and
      asks again; a waiting `wait_for_newer` returns so its caller looks again.
    - An announcement that says the publisher's shared-memory segments changed
      makes a subscriber that maps them ahead (`SegmentHints`) ask for the
      manifest that names them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from rollpool.protocol.codec import decode
from rollpool.protocol.errors import ProtocolError, WeightSyncError
from rollpool.protocol.logs import RateLimitedLog
from rollpool.protocol.messages import Announce, Error, Manifest, ManifestRequest
from rollpool.protocol.sockets import SocketFactory
from rollpool.weights.paths.base import ManifestTimeoutError, WeightVersionGoneError
from rollpool.weights.paths.network import DealerSet

__all__ = ["PublisherWatch", "SegmentHints"]

log = logging.getLogger("rollpool.weights.subscriber")


class SegmentHints(Protocol):
    """The shared-memory side's part in the watch (`rollpool.weights.paths.shm.ShmSegments`)."""

    def registers_ahead(self) -> bool:
        """Whether the publisher's segments are mapped ahead of use (then a changed set is asked for at once)."""

    def register_ahead(self, manifest: Manifest) -> None:
        """A manifest came: map the segments it names ahead (or nothing)."""


class PublisherWatch:
    """The versions one publisher (or relay) is known to hold, and the manifest requests to it (see the module docstring)."""

    def __init__(self, sockets: SocketFactory, dealers: DealerSet, segments: SegmentHints, *, host_key: str, asks_deltas: bool,
                 fetch_timeout_s: float, max_refetch: int, gpu_uuids: Callable[[], dict[str, int]], delta_base: Callable[[], int],
                 device_verify: Callable[[int], bool] | None = None) -> None:
        self.sockets = sockets
        self.dealers = dealers
        self.segments = segments
        self.host_key = host_key
        """This host's key, sent with `gpu_uuids` in every request (the same-host paths' hello)."""
        self.gpu_uuids = gpu_uuids
        """This side's GPUs by UUID (empty: none, or a path that never uses them)."""
        self.asks_deltas = asks_deltas
        """Whether requests name a delta base (`weight_delta` on, on a path deltas travel: not one held to cuda_ipc)."""
        self.deltas_need_minor = 0
        """Requests name a delta base only to a server of at least this minor (`server_minor`): a subscriber held to
        ``shm`` asks only a server that puts deltas in shared memory (`DELTA_PATHS_MINOR`)."""
        self.server_minor = 0
        """The minor the last manifest said its server speaks (`Manifest.protocol_minor`; 0: none yet, or older)."""
        self.delta_base = delta_base
        """The version held as a delta's base (-1: none)."""
        self.device_verify = device_verify or (lambda _base: False)
        """Whether a delta against that base is verified on the engine's GPU (`ManifestRequest.device_verify`)."""
        self.fetch_timeout_s = fetch_timeout_s
        self.max_refetch = max_refetch
        self.router_endpoint: str | None = None
        self.pub_endpoint: str | None = None
        self.latest = -1
        """The newest version the publisher is known to hold (-1: none yet)."""
        self.known: Manifest | None = None
        """The manifest the catch-up request got: the next fetch of that version takes it instead of asking again."""
        self.protocol_errors = 0
        """Malformed announcements."""
        self.tasks: set[asyncio.Task[None]] = set()
        self._forgets = 0
        """Bumped by `forget_newer` (a waiting `wait_for_newer` returns to let its caller look again)."""
        self._changed = asyncio.Event()
        self._sub: Any = None
        self._catch_up: asyncio.Task[None] | None = None
        self._shm_generation = 0
        self._errlog = RateLimitedLog(log)

    # -- connection

    def open(self, router_endpoint: str, pub_endpoint: str | None, streams: int) -> None:
        """Connect the DEALERs (and the SUB, with `pub_endpoint`) and ask for the latest version. Needs a running loop."""
        self.close()
        self.router_endpoint, self.pub_endpoint = router_endpoint, pub_endpoint
        self.dealers.open(router_endpoint, streams)
        if pub_endpoint:
            self._sub = self.sockets.sub(pub_endpoint)
            self._spawn(self._announce_loop(self._sub), "_announce_loop")
        self.ask_latest()

    def close(self) -> None:
        self.known = None
        for t in list(self.tasks):
            t.cancel()
        self.tasks.clear()
        self._catch_up = None
        self.dealers.close()
        if self._sub is not None:
            self._sub.close(linger=0)
        self._sub = None

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro, name=f"WeightSubscriber.{name}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    # -- what is known

    def note_version(self, version: int) -> None:
        """A broker heartbeat (or welcome) names `version`: ask the publisher for its latest if it is new to us."""
        if version > self.latest:
            self.ask_latest()

    def forget_newer(self, version: int) -> None:
        """The pool was rebased to `version`: versions known above it are forgotten and the latest asked for again."""
        if self.latest > version or version < -1:
            self.known = None
            self.latest = -1
            self._forgets += 1
            self._changed.set()
            self.ask_latest()

    async def wait_for_newer(self, than: int, timeout_s: float | None = None) -> int:
        """Wait until a version newer than `than` is known; return it. `WeightSyncError` after `timeout_s`.
        Returns early (maybe not newer) when `forget_newer` forgot versions meanwhile."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        forgets = self._forgets
        while self.latest <= than and self._forgets == forgets:
            self._changed.clear()
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                raise WeightSyncError(f"no weight version newer than {than} within {timeout_s} s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return self.latest

    def take_known(self, version: int | None) -> Manifest | None:
        """The catch-up's manifest when it is of the version asked for (None: the latest known), once."""
        known, self.known = self.known, None
        if known is None or known.version < 0 or known.version != (self.latest if version is None else version):
            return None
        return known

    def _observe(self, version: int) -> None:
        if version > self.latest:
            self.latest = version
            self._changed.set()

    def ask_latest(self) -> None:
        """Ask for the latest version in the background (unless not connected, or such a request is out already)."""
        if not self.dealers.connected or (self._catch_up is not None and not self._catch_up.done()):
            return
        self._catch_up = self._spawn(self._catch_up_once(), "_catch_up")

    async def _catch_up_once(self) -> None:
        try:
            self.known = await self.fetch_manifest(None, attempts=1)  # what the next fetch takes, not asking again
        except WeightSyncError as exc:
            self._errlog.warning("latest", "asking %s for the latest weight version failed: %s", self.router_endpoint, exc)

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
                if msg.shm_generation != self._shm_generation and self.segments.registers_ahead():
                    # the publisher's segments changed (a reserve, a new layout): the manifest names them
                    self._shm_generation = msg.shm_generation
                    self.ask_latest()

    # -- manifest requests

    async def fetch_manifest(self, version: int | None = None, *, attempts: int | None = None, streamed: bool = True,
                             wait_ipc: bool = False, delta: bool = True, after_mix64: int = -1,
                             timeout_s: float | None = None, delta_base: int | None = None, ring_done: int = -1) -> Manifest:
        """The manifest of `version` (None: the latest). Retries a silent publisher up to `max_refetch` times (or
        `attempts`), each try waiting `timeout_s` (default `fetch_timeout_s`); none answered: `ManifestTimeoutError`.

        `streamed`: accept pending checksums (``""``, each following on its
        bucket's chunks); False waits for a manifest whose checksums all exist.
        `after_mix64` >= 0: a parked request, answered once the version carries
        more GPU checksums than that (`ManifestRequest.after_mix64`).
        `delta_base`: the base to name when asking for a delta (a relay names the version it holds); None: the one held
        here. Either way only with `delta` and `weight_delta` on.
        `ring_done`: a same-GPU ring taker's claim and release (`ManifestRequest.ring_done`, `paths/ipc_ring.py`).
        """
        tries = (self.max_refetch + 1) if attempts is None else attempts
        gpus = tuple(self.gpu_uuids())
        asks = delta and self.asks_deltas and self.server_minor >= self.deltas_need_minor
        base = (self.delta_base() if delta_base is None else delta_base) if asks else -1
        on_gpu = base >= 0 and delta_base is None and self.device_verify(base)
        waited = self.fetch_timeout_s if timeout_s is None else timeout_s
        for _attempt in range(tries):
            try:
                reply = await self.dealers.request(lambda rid: ManifestRequest(request_id=rid, version=version, streamed=streamed,
                                                                               host_key=self.host_key, gpu_uuids=gpus, wait_ipc=wait_ipc,
                                                                               delta_base=base, device_verify=on_gpu, after_mix64=after_mix64,
                                                                               ring=bool(gpus), ring_done=ring_done), waited)
            except TimeoutError:
                continue
            if isinstance(reply, Manifest):
                self.server_minor = reply.protocol_minor
                if reply.version >= 0:
                    self._observe(reply.version)
                self.segments.register_ahead(reply)
                return reply
            if isinstance(reply, Error):
                if reply.code == "gone":
                    raise WeightVersionGoneError(-1 if version is None else version, reply.message)
                raise WeightSyncError(f"publisher refused the manifest request: {reply.code}: {reply.message}")
            raise WeightSyncError(f"publisher answered a manifest request with {type(reply).__name__}")
        what = "latest" if version is None else str(version)
        raise ManifestTimeoutError(f"no manifest ({what}) from {self.router_endpoint} within {tries} x {waited:g} s")
