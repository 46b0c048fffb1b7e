"""Delta versions made on the tensors' device: the trainer's CUDA tensors compared with the previous version held on
their GPU, and only the changed elements brought to the host.

Contract
    - `DeviceBase` holds one version's bytes on a device in bucket layout (one buffer, each bucket at its
      `rollpool.weights.gpu.arena_offsets` offset), which version that is, and the scratch one bucket's encoding needs.
      It costs `need_bytes`: 1 x the model's bytes plus `SCRATCH_BUCKETS` x the largest bucket (and one piece's
      positions), counted against the publisher's `GpuBudget` (`why_not` says when they do not fit), allocated on first
      use and kept until the layout or the device changes or `release`.
    - `DeviceBase.diff(version, buckets, places, items, wholes)`: per bucket, the caller's tensors are compared with the
      base element by element in the width `delta.encode_bucket` compares (`delta.word_width`: a bf16 element is a
      2-byte word, bit for bit), then written into the base (which holds `version` afterwards), and the changed elements
      are encoded on the device by `delta.plan_encoding`'s rule into `delta.py`'s wire forms (``gaps``: uint16
      gap - 1, ``sparse``: int32 index, little-endian, then the values). Each bucket's `DeltaSet` has exactly the
      payload bytes `delta.encode_bucket` makes of the same two versions (a ``whole`` bucket's payload is the caller's
      host buffer of it, `wholes`, as the host path's is the host bucket); a payload is copied to the host (page-locked
      on CUDA, on a stream of its own, so the trainer does not wait for it) and `BucketDiff.wait` returns once it
      landed. `diff` returns None for the deltas when the base held no `version - 1` of the same layout (the first
      version, a skipped one, a changed layout): the base is written all the same.
    - It reads the caller's tensors only inside `diff` (on CUDA on a side stream that first waits for the caller's
      stream, synchronised before it returns): once it returned they may change. Nothing else may write the base
      while `views` (the base as the version's tensors, for the host copy made from it) are being read.
    - torch ops, so the same code runs on CPU tensors (the tests; `DEVICE_TYPES`) and CUDA tensors (the GPU); on CUDA a
      bucket is compared, counted and its positions gathered by `rollpool.weights.diff_kernel` where it is usable (one
      host sync a bucket instead of one a piece; only the changed elements written into the base), with the same
      positions and base, and the torch ops where it is not.

Why a whole base on the device and not bucket by bucket from the host copy: staging the previous version's host bucket
to the GPU reads the model's bytes over PCIe while the trainer waits, as long as today's device-to-host copy of the new
version, so it would save the trainer nothing; a device base turns that wait into two reads of the model in HBM.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rollpool.protocol.messages import BucketInfo
from rollpool.weights import diff_kernel
from rollpool.weights.bucketing import dtype_from_name, dtype_name, flat_bytes
from rollpool.weights.delta import (
    ENCODED_FRACTION_GUESS,
    GAPS,
    SPARSE,
    UNCHANGED,
    WHOLE,
    DeltaSet,
    itemsize_of,
    plan_encoding,
    position_bytes,
    same_layout,
    word_width,
)
from rollpool.weights.gpu import arena_offsets, mix64_format, mix64_partial, side_stream
from rollpool.weights.manifest import GpuBudget

__all__ = ["DEVICE_TYPES", "compared_by", "MIX_STREAM_PRIORITY", "PIECE_ELEMENTS", "SCRATCH_BUCKETS", "BucketDiff", "DeviceBase", "PayloadHost"]

log = logging.getLogger(__name__)

DEVICE_TYPES: tuple[str, ...] = ("cuda",)
"""Device types whose tensors the publisher diffs on their device. The tests add ``"cpu"`` to run this module's torch
code on CPU tensors; on the CPU the host path (numpy in `weight_delta_threads` threads) is the one used."""

PIECE_ELEMENTS = 1 << 25
"""Changed positions are found, and counted, in pieces of this many elements: one piece's int64 positions (at most 256 MiB) are the
only temporary that grows with the bucket beyond the scratch below."""

SCRATCH_BUCKETS = 5
"""The scratch of one bucket's encoding, in buckets' bytes, at the worst case a delta is still made (just under the
``whole`` threshold): its comparison mask (<= 1), the positions as int32 and their gaps (< 2.7), the values (< 1) and
the payload (< 1), never all at once."""

MIX_STREAM_PRIORITY = -5
"""The priority of the stream that sums the early delta's mix64s (`mix64s`): lower is higher, clamped by torch to the
device's range (the highest there), so the sums run ahead of the trainer's next step on its default stream."""
_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(slots=True)
class BucketDiff:
    """One bucket's delta made on the device: its one-bucket `DeltaSet` (payload on the host once `wait` returned)."""

    delta: DeltaSet
    done: Any = None
    """A CUDA event recorded after the payload's copy to the host (None: already there)."""
    on_device: bool = False
    """Whether its payload was made on a GPU and copied to the host (`PayloadHost`)."""

    def wait(self) -> DeltaSet:
        if self.done is not None:
            self.done.synchronize()
            self.done = None
        return self.delta


def _tiles(ranges: Sequence[tuple[int, int]], nbytes: int) -> bool:
    """Whether (offset, nbytes) ranges cover [0, `nbytes`) end to end, each but the last a whole number of words: then a
    bucket's mix64 summed over it at once is the sum of its tensors' parts."""
    pos = 0
    for offset, n in sorted(ranges):
        if offset != pos or pos % 8:
            return False
        pos += n
    return pos == nbytes


def _page_locked(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class PayloadHost:
    """The page-locked host memory a device delta's payloads are copied into, made before the trainer waits for it.

    Page-locked blocks come from torch's caching host allocator, which rounds a request up to a power of two and reuses
    a freed block of that size; a block it has none free of costs a `cudaHostAlloc` (on an H100 at 8B: 0.58-0.60 s for
    the ~33 payloads of each of the first two device deltas, in the trainer's wait; copying them to pageable memory
    instead took as long, 0.53 s, on an H200). So `warm_for` makes blocks of the sizes the next version's payloads will
    have (the last version's, `DeviceBase.payload_sizes`; before any, `delta.ENCODED_FRACTION_GUESS` of each bucket: torch
    rounds a block to a power of two, so it holds for 1.6-3.1% changed at 512 MiB buckets), in a thread of its own, all
    held at once and then freed into the allocator's cache, so the next version finds free blocks while the blocks of
    the versions still served are held. Blocks the cache has free already are reused by it (no new memory): the
    page-locked memory grows to at most one version's payloads more than are held at once.

    The publisher calls `warm_for` once a version's host copy has landed (a thread making new blocks holds up the CUDA
    calls of the publisher's other threads: started right after each diff, on an H200 at 8B, it delayed the early deltas
    of the versions whose blocks it was making by ~0.45 s). `allocate` makes one page-locked block (the tests pass a
    fake)."""

    def __init__(self, allocate: Callable[[int], torch.Tensor] | None = None) -> None:
        self._allocate = allocate or _page_locked
        self.warmed = 0
        """Warm-ups done."""
        self._thread: threading.Thread | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        """A page-locked host buffer of `nbytes` for a payload."""
        return self._allocate(nbytes)

    def warm_for(self, sizes: Sequence[int]) -> None:
        """Make page-locked blocks of these sizes ahead, in a thread (none when one is still running)."""
        if not sizes or (self._thread is not None and self._thread.is_alive()):
            return
        self._thread = threading.Thread(target=self._warm, args=(list(sizes),), name="rollpool-payload-pin", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _warm(self, sizes: list[int]) -> None:
        try:
            held = [self._allocate(n) for n in sizes]  # all at once: the blocks the served versions hold are not among them
            del held
        except Exception as e:  # noqa: BLE001 (out of page-locked memory, a driver error: the diff allocates as it needs)
            log.warning("page-locked buffers for device deltas could not be made ahead (%s)", e)
            return
        self.warmed += 1


class DeviceBase:
    """The previous version on the tensors' device (see the module docstring)."""

    def __init__(self, budget: GpuBudget) -> None:
        self.budget = budget
        self.device: torch.device | None = None
        self.arena: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None
        self.offsets: list[int] = []
        self.buckets: tuple[BucketInfo, ...] = ()
        self.version = -1
        """The version the base holds (-1: none, or a diff that failed part way)."""
        self.charged = 0
        """Bytes taken from the budget (given back by `release`)."""
        self._copy_stream: Any = None
        self._mix_stream: Any = None
        self._mixed: tuple[Any, torch.Tensor] | None = None
        """The sums `diff` queued for `mix64s` (with ``mix=True``): (their event, their host copy)."""
        self.payload_host = PayloadHost()
        self.payload_sizes: list[int] = []
        """The host payload sizes the next diff is expected to need (the last diff's, or `delta.ENCODED_FRACTION_GUESS`'s), for
        `PayloadHost.warm_for`."""

    @staticmethod
    def need_bytes(buckets: Sequence[BucketInfo]) -> int:
        """The device memory a base of this layout costs: the version's bytes plus one bucket's scratch."""
        _offsets, total = arena_offsets([b.nbytes for b in buckets])
        largest = max((b.nbytes for b in buckets), default=0)
        return total + SCRATCH_BUCKETS * largest + 8 * PIECE_ELEMENTS

    def fits(self, buckets: Sequence[BucketInfo], device: torch.device) -> bool:
        return self.arena is not None and self.device == device and same_layout(self.buckets, buckets)

    def why_not(self, buckets: Sequence[BucketInfo], device: torch.device) -> str:
        """"" when a base for this layout on `device` is held or fits the budget, else why not."""
        if self.fits(buckets, device):
            return ""
        return self.budget.why_not(self.need_bytes(buckets) - self.charged,
                                   "a device delta base (1 x the model's bytes) and its encoding scratch")

    def release(self) -> None:
        """Free the base (its budget given back); the next `diff` makes none (no `version - 1` held)."""
        self.arena = self.mask = None
        self.buckets, self.offsets, self.version, self.device, self._copy_stream = (), [], -1, None, None
        self._mix_stream = self._mixed = None
        self.budget.give(self.charged)
        self.charged = 0

    def _allocate(self, buckets: Sequence[BucketInfo], device: torch.device) -> None:
        if self.fits(buckets, device):
            return
        self.release()
        need = self.need_bytes(buckets)
        self.budget.take(need, "a device delta base (1 x the model's bytes) and its encoding scratch")
        self.charged = need
        self.offsets, total = arena_offsets([b.nbytes for b in buckets])
        self.arena = torch.empty(total, dtype=torch.uint8, device=device)
        self.mask = torch.empty(max((b.nbytes // word_width(b.nbytes, itemsize_of(b.dtype)) for b in buckets), default=0),
                                dtype=torch.bool, device=device)  # one flag per element of the largest bucket
        self.buckets, self.device = tuple(buckets), device
        if device.type == "cuda":  # the kernels built and checked there now, beside the trainer, not in its first delta's wait
            threading.Thread(target=diff_kernel.usable, args=(device,), name="rollpool-diff-kernels", daemon=True).start()

    def _copier(self, device: torch.device, after: Any) -> Any:
        """The stream payloads are copied to the host on (made once), after the work queued on `after` so far."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self._copy_stream.wait_stream(after)
        return self._copy_stream

    def views(self, places: Sequence[Any]) -> list[tuple[str, torch.Tensor]]:
        """The base as the version's tensors (`Place` order: name, shape, dtype), views of its buffer."""
        assert self.arena is not None
        out = []
        for idx, offset, name, shape, dtype, nbytes in places:
            start = self.offsets[idx] + offset
            out.append((name, self.arena[start : start + nbytes].view(dtype_from_name(dtype)).view(shape)))
        return out

    def mix64s(self, places: Sequence[Any]) -> list[str]:
        """Each bucket's mix64 of the bytes the base holds (after `diff`: the version's, the mix64 of a delta's resulting
        bytes, `BucketInfo.host_mix64`), summed tensor by tensor at its word offset as the snapshot sums a host copy's
        (`rollpool.weights.gpu.mix64_partial`; every tensor of a bucket 8-byte aligned), on a stream of its own on CUDA,
        one sync at the end: the sums `diff` queued (``mix=True``) where it did, else queued now. Only reads the base:
        the caller keeps `diff` from writing it meanwhile."""
        queued, self._mixed = self._mixed, None
        if queued is None:
            if self.arena is None:
                raise RuntimeError("no device base is held")
            queued = self._queue_mix64s(places, None)
        done, sums = queued
        if done is not None:
            done.synchronize()
        return [mix64_format(int(x)) for x in sums.tolist()]

    def _queue_mix64s(self, places: Sequence[Any], after: Any) -> tuple[Any, torch.Tensor]:
        """The base's bucket sums queued on the mix stream (after the work queued on `after` so far, when given) and
        copied to page-locked memory behind them: (an event recorded after that copy, the host int64 sums); on the CPU
        (None, the sums). Launching them takes ~1 ms of Python for 33 buckets, which `diff` spends while the trainer
        waits anyway: launched later from a thread of their own, beside the host copy's threads, they waited for the GIL
        ~0.15 s on an H100 at 8B (the sums themselves take ~7 ms there)."""
        arena, offsets, buckets = self.arena, self.offsets, self.buckets
        assert arena is not None
        parts: list[list[tuple[int, int]]] = [[] for _ in buckets]
        for idx, offset, _name, _shape, _dtype, nbytes in places:
            if nbytes:
                parts[idx].append((offset, nbytes))
        stream = None
        if arena.is_cuda:
            if self._mix_stream is None:
                # the highest priority the device has: the trainer's next step, queued on its own stream once `diff`
                # returns, does not take the GPU's blocks ahead of these ~7 ms of sums (at 8B on an H100)
                self._mix_stream = torch.cuda.Stream(device=arena.device, priority=MIX_STREAM_PRIORITY)  # type: ignore[no-untyped-call]
            stream = self._mix_stream
            if after is not None:
                stream.wait_stream(after)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            totals = []
            for idx, (b, ranges) in enumerate(zip(buckets, parts, strict=True)):
                if _tiles(ranges, b.nbytes):  # one sum over the bucket (its tensors end to end: the same sum, one call)
                    totals.append(mix64_partial(arena[offsets[idx] : offsets[idx] + b.nbytes], 0))
                    continue
                total = torch.zeros((), dtype=torch.int64, device=arena.device)
                for offset, nbytes in ranges:
                    start = offsets[idx] + offset
                    total += mix64_partial(arena[start : start + nbytes], offset // 8)
                totals.append(total)
            sums = torch.stack(totals) if totals else torch.empty(0, dtype=torch.int64, device=arena.device)
            if stream is None:
                return None, sums
            host = torch.empty(int(sums.numel()), dtype=torch.int64, pin_memory=True)
            host.copy_(sums, non_blocking=True)
            done = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            done.record(stream)
        return done, host

    def diff(self, version: int, buckets: Sequence[BucketInfo], places: Sequence[Any], items: Sequence[tuple[str, torch.Tensor]],
             wholes: Sequence[torch.Tensor], after: Any = None, *, mix: bool = False) -> list[BucketDiff] | None:
        """Compare `items` (laid out by `places` into `buckets`) with the base, write them into it, and return each
        bucket's delta against the base's version when that is `version - 1` of this layout, else None (see the module
        docstring). On CUDA the work first waits for `after` (the caller's stream, taken on its thread; None: this
        thread's current stream). With `mix` and deltas made, the base's bucket sums for `mix64s` are queued behind the
        diff (not waited for here). On failure the base holds no version (the caller's tensors are unchanged; it copies
        them itself)."""
        device = items[0][1].device if items else torch.device("cpu")
        had = self.version if self.fits(buckets, device) else -1
        compare = had >= 0 and had == version - 1
        self._allocate(buckets, device)
        self.version = -1
        unread, self._mixed = self._mixed, None  # sums queued by the last diff and never taken: they may still read the base
        by_bucket: list[list[tuple[int, torch.Tensor]]] = [[] for _ in buckets]
        for (idx, offset, name, shape, dtype, nbytes), (got, tensor) in zip(places, items, strict=True):
            if got != name or tuple(int(x) for x in tensor.shape) != tuple(shape) or dtype_name(tensor.dtype) != dtype:
                raise ValueError(f"got {got!r} {tuple(tensor.shape)} {tensor.dtype}, the layout has {name!r} {shape} {dtype}")
            if nbytes:
                by_bucket[idx].append((offset, tensor))
        stream = side_stream(device) if device.type == "cuda" else None
        if stream is not None:
            stream.wait_stream(after if after is not None else torch.cuda.current_stream(device))
            if unread is not None and unread[0] is not None:
                stream.wait_event(unread[0])  # the base is written only once they have read it
        out: list[BucketDiff | None] = []
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for b, tensors, whole in zip(buckets, by_bucket, wholes, strict=True):
                out.append(self._bucket(b, tensors, whole, had if compare else -1, stream))
            if compare and mix:
                self._mixed = self._queue_mix64s(places, stream)
            if stream is not None:
                stream.synchronize()  # (the diff's stream: the sums run on after this returns)
        self.version = version
        if compare:
            self.payload_sizes = [int(p.numel()) for d in out if d is not None and d.on_device for p in d.delta.payloads if p is not None]
        elif device.type == "cuda":
            self.payload_sizes = [max(1, int(b.nbytes * ENCODED_FRACTION_GUESS)) for b in buckets]
        return [d for d in out if d is not None] if compare else None

    def _bucket(self, b: BucketInfo, tensors: list[tuple[int, torch.Tensor]], whole: torch.Tensor, had: int, stream: Any) -> BucketDiff | None:
        """One bucket: compared with the base (`had` >= 0: the version it holds) and written into it, then encoded
        (see `diff`); None when there is nothing to compare with."""
        assert self.arena is not None and self.mask is not None
        t0 = time.perf_counter()
        width = word_width(b.nbytes, itemsize_of(b.dtype))
        word = _WORD[width]
        n = b.nbytes // width
        base = self.arena[self.offsets[b.index] : self.offsets[b.index] + b.nbytes].view(word)
        mask = self.mask[:n]
        pairs = [(flat_bytes(tensor).view(word), offset // width) for offset, tensor in sorted(tensors, key=lambda t: t[0])]
        pieces = [(src, base[lo : lo + src.numel()]) for src, lo in pairs]
        counted = _count_by_kernel(pieces) if had >= 0 and n and diff_kernel.usable(base.device) else None
        if counted is None:
            for (src, lo), (_src, part) in zip(pairs, pieces, strict=True):
                if had >= 0:
                    torch.ne(src, part, out=mask[lo : lo + src.numel()])
                part.copy_(src)
            if had < 0:  # nothing to compare with: the base is written, no delta
                return None
            k = _count(mask) if n else 0
        else:
            k = counted[1]  # (the base is written below: only what changed, or all of it for a whole bucket)
        t1 = time.perf_counter()
        enc = plan_encoding(k, n, width, None)
        payload: torch.Tensor | None = None
        if counted is not None and enc == WHOLE:
            for src, part in pieces:
                part.copy_(src)
        if enc is None:
            if counted is None:
                idx = _positions(mask, k)
            else:
                idx = torch.empty(k, dtype=torch.int32, device=base.device)
                _gather_by_kernel(pieces, [lo for _src, lo in pairs], counted[0], idx)
            gaps = torch.empty_like(idx)
            gaps[:1] = idx[:1]
            torch.sub(idx[1:], idx[:-1], out=gaps[1:])
            gaps[1:] -= 1
            enc = plan_encoding(k, n, width, int(gaps.max().item()) + 1)
            if enc in (GAPS, SPARSE):
                pos = position_bytes(enc)
                payload = torch.empty(k * (pos + width), dtype=torch.uint8, device=mask.device)
                if enc == GAPS:  # each gap - 1 fits 2 bytes: the low two of its little-endian int32
                    payload[: 2 * k].view(k, 2).copy_(gaps.view(torch.uint8).view(k, 4)[:, :2])
                else:
                    payload[: 4 * k].copy_(idx.view(torch.uint8))
                del gaps
                payload[pos * k :].copy_(torch.index_select(base, 0, idx).view(torch.uint8))  # the base holds the new values now
        done = None
        pin_s = 0.0
        on_device = payload is not None and payload.is_cuda
        if payload is not None and on_device:  # to the host on a stream of its own: the next bucket's diff goes on
            copier = self._copier(payload.device, stream)
            t_pin = time.perf_counter()
            host = self.payload_host.take(int(payload.numel()))  # (made ahead: `PayloadHost`)
            pin_s = time.perf_counter() - t_pin
            with torch.cuda.stream(copier):
                host.copy_(payload, non_blocking=True)
                done = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
                done.record(copier)
            payload.record_stream(copier)  # its memory is not reused before the copy read it
            payload = host
        t2 = time.perf_counter()
        assert enc is not None
        got: torch.Tensor | None = None if enc == UNCHANGED else (whole if enc == WHOLE else payload)
        ds = DeltaSet(base=had, encodings=[enc], payloads=[got], changed_elements=k, total_elements=n,
                      timings={"compare_s": round(t1 - t0, 4), "encode_s": round(t2 - t1, 4), "pin_s": round(pin_s, 4)})
        return BucketDiff(ds, done, on_device)


def compared_by(device: torch.device | None) -> str:
    """What compares a bucket of a base on `device` (`rollpool.weights.diff_kernel.compared_by`)."""
    return diff_kernel.compared_by(device)


def _count_by_kernel(pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, int] | None:
    """`diff_kernel.count_changed` of a bucket's pieces (the base not written yet), or None when the kernels cannot run
    here (switched off for the process: the torch path compares this bucket and the next)."""
    try:
        return diff_kernel.count_changed(pieces)
    except Exception as e:  # noqa: BLE001 - a kernel that does not build or launch on this device
        diff_kernel.switch_off(f"{type(e).__name__}: {e}")
        return None


def _gather_by_kernel(pieces: list[tuple[torch.Tensor, torch.Tensor]], offsets: list[int], starts: torch.Tensor,
                      positions: torch.Tensor) -> None:
    """`diff_kernel.gather_changed`; a failure switches the kernels off and is raised: the base may be written in part,
    so the diff fails (the base then holds no version, as for any failure of `DeviceBase.diff`)."""
    try:
        diff_kernel.gather_changed(pieces, offsets, starts, positions)
    except Exception as e:
        diff_kernel.switch_off(f"{type(e).__name__}: {e}")
        raise


def _count(mask: torch.Tensor) -> int:
    """The set elements of a bool `mask`, summed `PIECE_ELEMENTS` at a time on its device (one sync): torch sums a
    bool tensor by first casting it whole to int64, 8 bytes an element (2 GiB for a 512 MiB bucket of bf16, which ran
    the trainer's GPU out of memory on an H100 at 8B)."""
    acc = torch.zeros((), dtype=torch.int64, device=mask.device)
    for lo in range(0, int(mask.numel()), PIECE_ELEMENTS):
        acc += mask[lo : lo + PIECE_ELEMENTS].sum()
    return int(acc.item())


def _positions(mask: torch.Tensor, k: int) -> torch.Tensor:
    """The `k` positions of `mask`'s set elements, ascending, as int32 (found `PIECE_ELEMENTS` at a time)."""
    idx = torch.empty(k, dtype=torch.int32, device=mask.device)
    at = 0
    for lo in range(0, int(mask.numel()), PIECE_ELEMENTS):
        part = torch.nonzero(mask[lo : lo + PIECE_ELEMENTS]).squeeze(1)
        m = int(part.numel())
        if m:
            if lo:
                part += lo
            idx[at : at + m].copy_(part)
            at += m
    if at != k:
        raise RuntimeError(f"found {at} changed elements, counted {k}")
    return idx
