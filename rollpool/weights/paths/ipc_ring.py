"""The same-GPU path's ring (CUDA IPC, protocol minor 22, `RING_MINOR`): a version streamed bucket by bucket through a
few bucket-sized device slots on the trainer's GPU, when a whole-version arena would pass the publisher's GPU budget.

The publisher (`IpcRing`)
    - Exports one buffer of S slots once (S = as many slots of the largest bucket as the free budget holds, at most
      `RING_MAX_SLOTS`, at least 2; taken from the publisher's `GpuBudget`, reused by every later version whose buckets
      fit its slots) and names it on the version's manifest (`CudaIpcBuffer.ring_slots` = S; bucket k at
      `BucketInfo.ipc_offset` = its slot's offset).
    - `stream` copies bucket k from the trainer's tensors into slot ``k % S`` (device to device, on a ring stream that
      first waits for the trainer's stream) once the slot's previous bucket was released, sums its mix64 there and
      publishes it (`BucketInfo.ipc_checksum`); the schedule is `rollpool.weights.ring.RingSchedule` (pure).
    - How the trainer is blocked: `publish` returns once every bucket has been copied out of the trainer's tensors,
      into its slot (the ring) and into the host buckets (the ordinary snapshot, run beside the ring so the version is
      kept whole for every other peer, late joiners and a fallback: `keep_versions` means what it always meant). The
      last S buckets are then still in their slots; the next version's ring waits for them to be released.
    - ``keep_versions=0`` (`IpcArenas.ring_only`): the ring alone, no host snapshot; `publish` returns once the taker
      copied every bucket out, and a ring abandoned meanwhile leaves the host copy of the still unchanged tensors.
    - One subscriber takes a version's ring: the first to claim it (`ManifestRequest.ring_done` >= 0). Every other one
      is answered without the device buffer and takes the host path (shared memory staged to its GPU, or the network):
      a ring that waited for the slowest of several readers would stall on any one of them, and the host copy is
      there anyway. The taker's requests are the release signal and the wait in one: ``ring_done`` = k releases the
      buckets below k and is parked until bucket k is in its slot (one request per bucket; no polling).
    - A taker that releases nothing for `release_timeout_s`, or no claim within `claim_timeout_s`, abandons the ring:
      parked requests are answered without the device buffer, the version stays served from its host buckets, so
      nothing is lost. A ring that nobody claimed is not offered again until a subscriber asks with ``ring`` (a
      publisher with no same-GPU reader would otherwise block its trainer `claim_timeout_s` per version).
    - Once a version's ring ended, its manifest names no device buffer (the slots carry the next version).

The subscriber (`RingReader`): claims, copies each bucket out of its slot into its own device buffer (the same 2 x M
device slabs the other device paths use), verifies the mix64 of its copy (the bytes the engine loads), and releases the
slot with its next request. A bad copy is copied again from the slot (the slot is not released meanwhile), at most
`max_refetch` times; a ring that ended early, a bucket that stays bad, or no answer within `fetch_timeout_s` is a
counted fallback to the host path (`PathFallbackError`): the version is fetched whole from there, never in part. Its
``weights fetched`` line says ``cuda_ipc_ring`` (an arena fetch says ``cuda_ipc``).

The device edge (`RingDevice`): CUDA here (`CudaRingDevice`); the CPU tests put a fake with plain CPU tensors for
slots in its place (named so), so the whole protocol runs through real ZeroMQ sockets without a GPU.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, Protocol

import torch

from rollpool.protocol.logs import RateLimitedLog
from rollpool.protocol.messages import BucketInfo, CudaIpcBuffer, Manifest, ManifestRequest
from rollpool.weights.bucketing import dtype_name, flat_bytes, unpack_bucket
from rollpool.weights.gpu import (
    DeviceSlabs,
    arena_offsets,
    device_uuids,
    export_buffer,
    mix64_format,
    mix64_partial,
    open_buffer,
)
from rollpool.weights.manifest import RING_CHECKSUM_PART_BYTES, GpuBudget, ring_scratch_bytes
from rollpool.weights.paths.base import BucketCallback, FetchContext, Fetched, ManifestTimeoutError, PathFallbackError
from rollpool.weights.ring import RING_LEFT, RingSchedule
from rollpool.weights.serving import ServedVersion, peer_of
from rollpool.weights.snapshot import Place

__all__ = ["CLAIM_TIMEOUT_S", "RELEASE_TIMEOUT_S", "RING_MAX_SLOTS", "RING_PATH", "CudaRingDevice", "IpcRing", "RingDevice",
           "RingReader"]

log = logging.getLogger(__name__)
_errlog = RateLimitedLog(log)

RING_PATH = "cuda_ipc_ring"
"""The path a ring fetch names (`Fetched.path`, the ``weights fetched`` line, `WeightSubscriber.last_path`)."""
RING_MAX_SLOTS = 4
"""The most slots a ring takes, however large the budget (two already pipeline: one filled while one is copied out)."""
CLAIM_TIMEOUT_S = 0.5
"""How long a version's ring waits, from the publish, for a subscriber to claim it before the version goes over the host
path alone. A same-GPU worker claims within milliseconds of the announce; one busy applying the previous version (a
``drain`` apply) claims late and takes the host path. Short, because the trainer waits it out whenever nobody claims: at
8B the host snapshot beside the ring takes about as long anyway."""
RELEASE_TIMEOUT_S = 2.0
"""How long the ring waits for its taker to release a slot (a dead or stuck subscriber) before it is abandoned."""
MIX64_PART_BYTES = RING_CHECKSUM_PART_BYTES
"""A ring slot's mix64 is summed in parts of this size, so its temporaries stay small beside the slots (3 x 16 MiB,
taken from the budget with the slots: `ring_scratch_bytes`)."""


class RingDevice(Protocol):
    """The ring's device edge: `CudaRingDevice` on a GPU; a fake with CPU tensors for slots in the CPU tests."""

    def accepts(self, device: torch.device) -> bool:
        """Whether tensors on `device` can go through a ring here."""

    def uuids(self, device: torch.device) -> set[str]:
        """The UUIDs `device` is known by (a subscriber's hello names one of them)."""

    def allocate(self, nbytes: int, device: torch.device) -> torch.Tensor: ...

    def export(self, buf: torch.Tensor) -> CudaIpcBuffer: ...

    def open(self, info: CudaIpcBuffer, device_index: int) -> torch.Tensor: ...

    def mark(self, device: torch.device) -> Any:
        """A mark of the trainer's stream now, called on the caller's thread (the fills wait for it)."""

    def fill(self, slot: torch.Tensor, pieces: list[tuple[int, torch.Tensor]], after: Any) -> str:
        """Copy each (offset, tensor) into `slot` after `after`; the mix64 of `slot` once landed (a worker thread)."""

    def copy_out(self, src: torch.Tensor, dst: torch.Tensor) -> str:
        """Copy `src` (a slot) into `dst`; the mix64 of `dst` once landed (a worker thread)."""


_streams: dict[str, Any] = {}
_streams_lock = threading.Lock()


def _ring_stream(device: torch.device) -> Any:
    """One ring stream per device (not the snapshot's side stream: the ring's copies must not queue behind its
    device-to-host copies, which run at the same time)."""
    key = str(device)
    with _streams_lock:
        s = _streams.get(key)
        if s is None:
            s = _streams[key] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        return s


def parted_mix64(data: torch.Tensor, part_bytes: int = MIX64_PART_BYTES) -> str:
    """`mix64_checksum` of a 1-D uint8 tensor summed in parts of `part_bytes` (a multiple of 8), on the current stream;
    the same digest with temporaries of one part."""
    n = int(data.numel())
    acc = torch.zeros((), dtype=torch.int64, device=data.device)
    for off in range(0, n, part_bytes):
        acc += mix64_partial(data[off : off + part_bytes], off // 8)
    return mix64_format(int(acc.item()))


class CudaRingDevice:
    """The ring's CUDA edge: slots in one exported device buffer, copies and checksums on a ring stream."""

    def accepts(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def uuids(self, device: torch.device) -> set[str]:
        return {u for u, i in device_uuids().items() if i == device.index}

    def allocate(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def export(self, buf: torch.Tensor) -> CudaIpcBuffer:
        return export_buffer(buf)

    def open(self, info: CudaIpcBuffer, device_index: int) -> torch.Tensor:
        return open_buffer(info, device_index)

    def mark(self, device: torch.device) -> Any:
        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record(torch.cuda.current_stream(device))
        return ev

    def fill(self, slot: torch.Tensor, pieces: list[tuple[int, torch.Tensor]], after: Any) -> str:
        stream = _ring_stream(slot.device)
        stream.wait_event(after)
        with torch.cuda.stream(stream):
            for off, tensor in pieces:
                src = flat_bytes(tensor)
                slot[off : off + int(src.numel())].copy_(src, non_blocking=True)
            return parted_mix64(slot)  # .item() waits for this stream: the slot has landed when the digest is known

    def copy_out(self, src: torch.Tensor, dst: torch.Tensor) -> str:
        stream = _ring_stream(dst.device)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            return parted_mix64(dst)


def _without_ring(m: Manifest) -> Manifest:
    """`m` naming no device buffer (an asker that does not take this ring, or a ring that ended)."""
    if m.cuda_ipc is None:
        return m
    return replace(m, cuda_ipc=None, buckets=tuple(replace(b, ipc_offset=-1, ipc_checksum="") for b in m.buckets))


Send = Callable[[bytes, Any], Any]


class IpcRing:
    """The publisher's end of the ring (see the module docstring); one per publisher, beside its arenas."""

    def __init__(self, publisher_id: str, budget: GpuBudget, *, device: RingDevice | None = None,
                 claim_timeout_s: float = CLAIM_TIMEOUT_S, release_timeout_s: float = RELEASE_TIMEOUT_S,
                 max_slots: int = RING_MAX_SLOTS, clock: Callable[[], float] = time.monotonic) -> None:
        self.publisher_id = publisher_id
        self.budget = budget
        self.device: RingDevice = device if device is not None else CudaRingDevice()
        """The device edge (the CPU tests put a fake here, named so)."""
        self.claim_timeout_s = claim_timeout_s
        self.release_timeout_s = release_timeout_s
        self.max_slots = max_slots
        self.clock = clock
        self.buffer: torch.Tensor | None = None
        self.info: CudaIpcBuffer | None = None
        self.slot_bytes = 0
        self.slots = 0
        self.allocated = 0
        """Bytes of the ring's buffer taken from the budget."""
        self.rings: dict[int, RingSchedule] = {}
        """Each version whose ring has not ended, by version (the one streaming, and one whose last slots are still read)."""
        self._served: dict[int, ServedVersion] = {}
        self._parked: dict[int, list[tuple[bytes, ManifestRequest]]] = {}
        self.peers: set[bytes] = set()
        """Subscribers that said they take rings (`ManifestRequest.ring`): only their manifests name a ring's buffer."""
        self.send: Send | None = None
        """The server's reply (set by `WeightServer` when it is given this ring)."""
        self.versions = 0
        """Versions whose ring was done (every bucket copied out by its taker)."""
        self.abandoned = 0
        self.last: dict[str, Any] = {}
        """The last ring's outcome: version, slots, buckets released, taker, and why it was abandoned ("" when done)."""
        self.unclaimed = False
        """The last ring had no taker: not offered again until a subscriber asks with ``ring``."""
        self.broken = ""
        """Why the ring failed here (then it is never offered again), or ""."""
        self._changed: asyncio.Event | None = None

    def close(self) -> None:
        for sched in self.rings.values():
            sched.abandon("the publisher closed")
        self.rings = {}
        self._served = {}
        self._parked = {}
        self.buffer = self.info = None
        self.budget.give(self.allocated)
        self.allocated = 0

    # -- the offer

    def offer(self, served: ServedVersion, device: torch.device) -> str:
        """Name the ring on `served` (its buffer allocated and exported once, within the budget); "" when offered,
        else why not (then the version goes over the host paths alone)."""
        sizes = [b.nbytes for b in served.buckets]
        if not sizes or sum(sizes) == 0:
            return "the version has no bytes"
        if self.broken:
            return f"the same-GPU ring failed here before ({self.broken})"
        if self.unclaimed:
            return "no subscriber claimed the last same-GPU ring (offered again once a same-GPU subscriber asks for one)"
        slot = arena_offsets([max(sizes)])[1]
        reuse = self.buffer is not None and self.buffer.device == device and slot <= self.slot_bytes
        if not reuse:
            free = self.budget.free_bytes() + self.allocated
            scratch = ring_scratch_bytes(slot)
            slots = min(self.max_slots, max(0, free - scratch) // slot, len(sizes)) if slot else 0
            if slots < min(2, len(sizes)):
                need = min(2, len(sizes)) * slot + scratch
                return (f"a same-GPU ring of {min(2, len(sizes))} slots of {slot} bytes (the largest bucket) and {scratch} bytes "
                        f"to checksum them would pass the "
                        f"publisher's GPU budget ({self.budget.free_bytes() + self.allocated} of {self.budget.budget} bytes free; "
                        f"publisher_gpu_budget_bytes) and needs {need}")
            if any(not s.ended for s in self.rings.values()):
                return "the ring's slots are still read for an earlier version and must grow for this one"
            try:
                self._allocate(slots, slot, device)
            except Exception as exc:  # noqa: BLE001 - an allocation or export that fails: logged, the ring is off, the host serves
                self.broken = f"{type(exc).__name__}: {exc}"
                log.error("weight publisher %s: the same-GPU ring cannot be made (%s); not offered from now on", self.publisher_id,
                          self.broken)
                return f"the same-GPU ring failed here ({self.broken})"
        assert self.info is not None
        self.rings[served.version] = RingSchedule(served.version, len(sizes), self.slots, start_s=self.clock(),
                                                  claim_timeout_s=self.claim_timeout_s, release_timeout_s=self.release_timeout_s)
        self._served[served.version] = served
        served.cuda_ipc = self.info
        served.buckets = tuple(replace(b, ipc_offset=(b.index % self.slots) * self.slot_bytes, ipc_checksum="") for b in served.buckets)
        return ""

    def _allocate(self, slots: int, slot_bytes: int, device: torch.device) -> None:
        self.buffer = self.info = None
        self.budget.give(self.allocated)
        self.allocated = 0
        nbytes = slots * slot_bytes
        taken = nbytes + ring_scratch_bytes(slot_bytes)  # the checksums' scratch: allocated by each checksum, counted here
        self.budget.take(taken, "the same-GPU ring")
        try:
            buffer = self.device.allocate(nbytes, device)
            info = replace(self.device.export(buffer), ring_slots=slots)
        except BaseException:
            self.budget.give(taken)
            raise
        self.buffer, self.info, self.allocated = buffer, info, taken
        self.slots, self.slot_bytes = slots, slot_bytes
        log.info("weight publisher %s: a same-GPU ring of %d slots of %d bytes and %d bytes to checksum them (%d bytes of the "
                 "%d-byte GPU budget)", self.publisher_id, slots, slot_bytes, taken - nbytes, taken, self.budget.budget)

    # -- the stream

    async def stream(self, version: int, places: list[Place], items: list[tuple[str, torch.Tensor]],
                     complete: Callable[[int, int, str], None]) -> None:
        """Put every bucket of `version` through the ring (module docstring); returns once each is in its slot or the
        ring ended (abandoned: the host buckets serve it). Never raises but for cancellation."""
        sched = self.rings.get(version)
        served = self._served.get(version)
        if sched is None or served is None or self.buffer is None:
            return
        try:
            for old, other in list(self.rings.items()):  # the earlier versions' last slots are released first
                if old != version:
                    while not other.ended:
                        await self._wait(other)
            pieces = self._pieces(sched.num_buckets, places, items)
            after = self.device.mark(self.buffer.device)
            for k in range(sched.num_buckets):
                while not sched.may_fill() and not sched.ended:
                    await self._wait(sched)
                if sched.ended:
                    break
                off = (k % self.slots) * self.slot_bytes
                slot = self.buffer[off : off + served.buckets[k].nbytes]
                digest = await asyncio.to_thread(self.device.fill, slot, pieces[k], after)
                if sched.ended:
                    break
                sched.fill(k)
                complete(version, k, digest)
                self._changed_now(version)
        except asyncio.CancelledError:
            sched.abandon("the publish was cancelled")
            self._changed_now(version)
            raise
        except Exception as exc:  # noqa: BLE001 - a device fault: logged, the ring is off from now on, the host buckets serve
            self.broken = f"{type(exc).__name__}: {exc}"
            log.error("weight publisher %s: the same-GPU ring failed (%s); version %d goes over the host paths and no ring is "
                      "offered from now on", self.publisher_id, self.broken, version)
            sched.abandon(f"the ring failed ({self.broken})")
        self._changed_now(version)

    async def beside(self, host_copy: Awaitable[Any], version: int, places: list[Place], items: list[tuple[str, torch.Tensor]],
                     complete: Callable[[int, int, str], None]) -> None:
        """`stream` beside `host_copy` (the version's host snapshot, from the same tensors): returns once both are done;
        the host copy's failure cancels the ring and raises."""
        streaming = asyncio.ensure_future(self.stream(version, places, items, complete))
        try:
            await host_copy
            await streaming
        except BaseException:
            streaming.cancel()
            raise

    async def until_ended(self, version: int) -> bool:
        """Wait until the ring of `version` ended (its taker released every bucket, or it was abandoned); whether it
        was done (not abandoned)."""
        sched = self.rings.get(version)
        if sched is None:
            return False
        while not sched.ended:
            await self._wait(sched)
        return not sched.abandoned

    @staticmethod
    def _pieces(n: int, places: list[Place], items: list[tuple[str, torch.Tensor]]) -> list[list[tuple[int, torch.Tensor]]]:
        out: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(n)]
        for (idx, offset, name, shape, dtype, nbytes), (got, tensor) in zip(places, items, strict=True):
            if got != name or tuple(int(x) for x in tensor.shape) != shape or dtype_name(tensor.dtype) != dtype:
                raise ValueError(f"got {got!r} {tuple(tensor.shape)} {tensor.dtype}, the layout has {name!r} {shape} {dtype}")
            if nbytes:
                out[idx].append((offset, tensor))
        return out

    async def _wait(self, sched: RingSchedule) -> None:
        """Until something changes for the ring or its deadline passes (then it is abandoned: `expire`)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        deadline = sched.deadline_s()
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), None if deadline is None else max(0.0, deadline - self.clock()))
        except TimeoutError:
            pass
        if sched.expire(self.clock()):
            self._changed_now(sched.version)

    def _changed_now(self, version: int) -> None:
        """The ring of `version` moved: parked requests answered, the driver woken, an ended ring put away."""
        sched = self.rings.get(version)
        if sched is not None:
            self._answer(version, sched)
            if sched.ended:
                self._end(version, sched)
        if self._changed is not None:
            self._changed.set()

    def _end(self, version: int, sched: RingSchedule) -> None:
        self.rings.pop(version, None)
        served = self._served.pop(version, None)
        if served is not None and served.cuda_ipc is not None and served.cuda_ipc.ring_slots:
            # the slots carry the next version now: the version names no device buffer from here on
            served.cuda_ipc = None
            served.buckets = tuple(replace(b, ipc_offset=-1, ipc_checksum="") for b in served.buckets)
        taker = sched.taker.decode(errors="replace") if sched.taker is not None else None
        self.last = {"version": version, "slots": sched.slots, "released": sched.released, "buckets": sched.num_buckets,
                     "taker": taker, "abandoned": sched.abandoned}
        if sched.abandoned:
            self.abandoned += 1
            self.unclaimed = sched.taker is None
            _errlog.warning("ring-abandoned", "weight publisher %s: the same-GPU ring of version %d was abandoned (%s); the version is "
                            "served from its host buckets", self.publisher_id, version, sched.abandoned)
        else:
            self.versions += 1

    def _answer(self, version: int, sched: RingSchedule) -> None:
        waiting = self._parked.pop(version, [])
        still = []
        served = self._served.get(version)
        for ident, req in waiting:
            if served is None or self.send is None:
                continue
            if sched.answer_now(req.ring_done):
                m = served.manifest(req.request_id)
                self.send(ident, _without_ring(m) if sched.ended else m)
            else:
                still.append((ident, req))
        if still:
            self._parked[version] = still

    # -- the server's hooks (WeightServer.ring)

    def take_request(self, ident: bytes, req: ManifestRequest, v: ServedVersion, send: Send) -> bool:
        """A manifest request for `v`: True when the ring answered or parked it (a taker's claim or release), False when
        the server answers it as usual."""
        self.send = send
        peer = peer_of(ident)
        if req.ring:
            self.peers.add(peer)
            if self.unclaimed and req.gpu_uuids:
                self.unclaimed = False  # a same-GPU subscriber is back: the next version's ring is offered again
        if req.ring_done == -1:
            return False
        sched = self.rings.get(v.version)
        if sched is None:  # no ring for this version (never, or ended): the manifest names no device buffer
            send(ident, _without_ring(v.manifest(req.request_id)))
            return True
        now = self.clock()
        if req.ring_done == RING_LEFT:
            sched.leave(peer, "the subscriber left the ring (it takes the host path)")
            self._changed_now(v.version)
            send(ident, _without_ring(v.manifest(req.request_id)))
            return True
        why = sched.claim(peer, now)
        if why:
            _errlog.warning("ring-refused", "weight publisher %s: %s; that subscriber takes the host path", self.publisher_id, why)
            send(ident, _without_ring(v.manifest(req.request_id)))
            return True
        sched.release(peer, req.ring_done, now)
        self._parked.setdefault(v.version, []).append((ident, req))
        self._changed_now(v.version)  # answers it now when its bucket is in its slot (or the ring ended), else it waits
        return True

    def outgoing(self, ident: bytes, m: Manifest) -> Manifest:
        """A manifest on its way out: a ring's buffer is named only to a subscriber that takes rings."""
        if m.cuda_ipc is not None and m.cuda_ipc.ring_slots and peer_of(ident) not in self.peers:
            return _without_ring(m)
        return m

    def note(self) -> dict[str, Any]:
        """The ring's figures for the publisher's stats and path note."""
        return {"ring_slots": self.slots, "ring_slot_bytes": self.slot_bytes, "ring_bytes": self.allocated,
                "ring_versions": self.versions, "ring_abandoned": self.abandoned, "last_ring": dict(self.last)}


class RingReader:
    """The subscriber's end of the ring (see the module docstring)."""

    def __init__(self, ctx: FetchContext, slabs: DeviceSlabs) -> None:
        self.ctx = ctx
        self.slabs = slabs
        self.device: RingDevice = CudaRingDevice()
        """The device edge (the CPU tests put a fake here, named so)."""
        self._opened: tuple[bytes, torch.Tensor] | None = None
        """The publisher's ring opened here (kept across versions: the publisher reuses it)."""

    def close(self) -> None:
        self._opened = None

    def _open(self, info: CudaIpcBuffer, device_index: int) -> torch.Tensor:
        if self._opened is not None and self._opened[0] == info.handle:
            return self._opened[1]
        try:
            t = self.device.open(info, device_index)
        except Exception as exc:
            raise PathFallbackError(f"cannot open the publisher's same-GPU ring ({type(exc).__name__}: {exc})") from exc
        self._opened = (info.handle, t)
        return t

    async def _ask(self, version: int, ring_done: int) -> Manifest:
        """The taker's request: buckets below `ring_done` released; answered once bucket `ring_done` is in its slot."""
        per_try = self.ctx.fetch_timeout_s / (self.ctx.max_refetch + 1)
        try:
            return await self.ctx.manifests.fetch_manifest(version, ring_done=ring_done, timeout_s=per_try)
        except ManifestTimeoutError as exc:
            raise PathFallbackError(f"the publisher's same-GPU ring did not answer ({exc})") from exc

    async def _leave(self, version: int) -> None:
        """Tell the publisher this taker leaves the ring (best effort: its release time-out abandons it anyway)."""
        try:
            await self.ctx.manifests.fetch_manifest(version, ring_done=RING_LEFT, attempts=1,
                                                    timeout_s=self.ctx.fetch_timeout_s / (self.ctx.max_refetch + 1))
        except Exception:
            log.debug("weight version %d: leaving the ring was not answered", version, exc_info=True)

    async def fetch(self, manifest: Manifest, device_index: int, on_bucket: BucketCallback | None) -> Fetched:
        """Claim the version's ring and copy every bucket out of it (module docstring); `PathFallbackError` otherwise."""
        version, n = manifest.version, len(manifest.buckets)
        m = await self._ask(version, 0)  # the claim: answered once bucket 0 is in its slot
        if m.cuda_ipc is None or not m.cuda_ipc.ring_slots:
            raise PathFallbackError(f"the publisher's same-GPU ring of version {version} is not this subscriber's (another one on "
                                    "this GPU takes it, or it ended; the trainer's log says which)")
        slots = m.cuda_ipc.ring_slots
        src = self._open(m.cuda_ipc, device_index)
        sizes = [b.nbytes for b in m.buckets]
        offsets, total = arena_offsets(sizes)
        slab = self.slabs.take_at_least(total, src.device)
        buffers = [slab[o : o + s] for o, s in zip(offsets, sizes, strict=True)]
        verified: list[BucketInfo] = []
        failures = [0] * n
        t0 = time.perf_counter()
        try:
            for k in range(n):
                b = m.buckets[k]
                if b.ipc_offset < 0 or not b.ipc_checksum or b.ipc_offset + b.nbytes > int(src.numel()):
                    raise PathFallbackError(f"bucket {k} is not in the publisher's same-GPU ring")
                while True:
                    digest = await asyncio.to_thread(self.device.copy_out, src[b.ipc_offset : b.ipc_offset + b.nbytes], buffers[k])
                    if digest == b.ipc_checksum:
                        break
                    try:
                        self.ctx.bucket_failed(version, k, failures, RING_PATH, "from the same-GPU ring", "same-GPU ring")
                    except Exception as exc:  # past max_refetch: the host path serves the whole version
                        raise PathFallbackError(f"bucket {k} failed its checksum {failures[k]} times in the same-GPU ring") from exc
                verified.append(b)
                self.ctx.counters.ipc_bytes += b.nbytes
                if on_bucket is not None:
                    on_bucket(k, unpack_bucket(b, buffers[k]))
                m = await self._ask(version, k + 1)  # releases bucket k; waits for bucket k + 1 (the last: answered at once)
                if k + 1 < n and (m.cuda_ipc is None or not m.cuda_ipc.ring_slots):
                    raise PathFallbackError(f"the publisher's same-GPU ring of version {version} ended after {k + 1} of {n} buckets "
                                            "(abandoned: the trainer's log says why)")
        except PathFallbackError:
            self.slabs.give(slab)
            await self._leave(version)
            raise
        except BaseException:
            self.slabs.give(slab)
            raise
        done = replace(manifest, buckets=tuple(replace(mb, ipc_offset=b.ipc_offset, ipc_checksum=b.ipc_checksum)
                                               for mb, b in zip(manifest.buckets, verified, strict=True)))
        return Fetched(done, buffers, slab, RING_PATH, on_device=True, details={"ring_slots": slots, "ring_s": round(time.perf_counter() - t0, 4)})
