"""Delta versions rebuilt where the engine loads from: a base held on the engine's GPU, patched in place.

Contract
    - `DeviceHeld` is one version held on a device in bucket layout (one buffer, each bucket at its
      `rollpool.weights.gpu.arena_offsets` offset, so every bucket's word views are aligned): which version, from which
      publisher, laid out how (`holds`). It is the version the subscriber last handed the engine when it stages to its
      GPU: the copy the engine's update reads (CUDA IPC), kept after the apply as the next delta's base instead of
      dropped. `version` is -1 while it is being written (a full version staged into it, a delta rebuilt in it) and
      after a write that failed: whoever holds tensors of it asks `holds` before using them (`WeightVersion.intact`).
    - `apply_delta(encoding, payload, bucket, itemsize)` patches one bucket in place from its encoded bytes on the
      same device: ``unchanged`` writes nothing, ``whole`` copies the payload, ``gaps`` and ``sparse`` scatter the new
      values at the positions `decode_positions` gives (``gaps``: the prefix sum of gap + 1, less 1; ``sparse``: the
      int32 indices). The result is bit for bit what `rollpool.weights.delta.rebuild_bucket` writes from the same base
      and payload. Neither trusts the payload: a wrong size, an index outside the bucket or out of order raise
      `rollpool.weights.delta.DeltaError` (one device sync per bucket to check the bounds).
    - `rebuild_bucket(info, payload, bucket)` does that from a host payload (copied to the device first) and verifies
      the resulting bytes on the device against `BucketInfo.host_mix64`, the mix64 of the bucket's resulting bytes that
      a delta manifest carries (`rollpool.weights.gpu.mix64_checksum`): a bucket is the version's only when it matches.
      In place means a failure leaves the bucket neither version: the caller drops the base and fetches the version
      whole.
    - torch ops only: the same functions run on CPU tensors (the tests) and CUDA tensors (the engine's GPU).

Memory: the base is the staging copy (1 x the model's bytes on the engine's GPU, outside SGLang's static fraction),
which exists anyway while a version is staged; kept, it stays allocated between versions. A delta's rebuild adds one
bucket's decoded positions (8 bytes per changed element: 46 MiB for a 512 MiB bf16 bucket at 2% changed) and its
payload on the device.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from rollpool.protocol.messages import BucketInfo
from rollpool.weights.delta import (
    GAPS,
    SPARSE,
    UNCHANGED,
    WHOLE,
    DeltaError,
    itemsize_of,
    position_bytes,
    same_layout,
    word_width,
)
from rollpool.weights.gpu import arena_offsets, mix64_checksum

__all__ = ["DeviceHeld", "apply_delta", "decode_positions", "rebuild_bucket", "result_checks"]

_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def decode_positions(encoding: str, payload: torch.Tensor, n: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(element indices as int64, strictly ascending and inside [0, n); the new values as `width`-byte words) of a
    ``gaps`` or ``sparse`` payload (a 1-D uint8 tensor on any device); `DeltaError` for a payload that cannot be right."""
    if encoding not in (GAPS, SPARSE):
        raise DeltaError(f"{encoding!r} carries no positions")
    pos = position_bytes(encoding)
    size = int(payload.numel())
    if size % (pos + width):
        raise DeltaError(f"{encoding} payload of {size} bytes is not whole (position, value) pairs of {pos + width} bytes")
    k = size // (pos + width)
    raw = payload[: pos * k]
    if encoding == SPARSE:
        idx = _aligned(raw, 4).view(torch.int32).to(torch.int64)
        if k > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise DeltaError("sparse payload's indices are not ascending")
    else:  # gap - 1 as a little-endian uint16: ascending by construction
        idx = _aligned(raw, 2).view(torch.int16).to(torch.int64)
        idx.bitwise_and_(0xFFFF)
        idx += 1
        idx.cumsum_(0)
        idx -= 1
    if k:
        lo, hi = (int(x) for x in torch.stack([idx[0], idx[-1]]).tolist())
        if lo < 0 or hi >= n:
            raise DeltaError(f"{encoding} payload names an element outside the bucket ({n} elements)")
    return idx, _aligned(payload[pos * k :], width).view(_WORD.get(width, torch.uint8))


def _aligned(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` (1-D uint8) where a `width`-byte view of it is allowed: itself when its start is aligned, else a copy."""
    if width <= 1 or (t.storage_offset() % width == 0 and t.data_ptr() % width == 0):
        return t
    return t.clone()


def apply_delta(encoding: str, payload: torch.Tensor | None, bucket: torch.Tensor, itemsize: int) -> None:
    """Patch `bucket` (1-D uint8, holding the base's bytes, on the payload's device) in place into the resulting bucket
    (see the module docstring); `DeltaError` for a payload that cannot be right."""
    n_bytes = int(bucket.numel())
    if encoding == UNCHANGED:
        return
    if encoding == WHOLE:
        if payload is None or int(payload.numel()) != n_bytes:
            raise DeltaError(f"whole bucket of {0 if payload is None else payload.numel()} bytes, expected {n_bytes}")
        bucket.copy_(payload)
        return
    if encoding not in (GAPS, SPARSE):
        raise DeltaError(f"unknown bucket encoding {encoding!r}")
    if payload is None:
        raise DeltaError(f"{encoding!r} bucket without its bytes")
    width = word_width(n_bytes, itemsize)
    if bucket.data_ptr() % width:
        raise DeltaError(f"a bucket of {width}-byte elements must start at a multiple of {width} bytes to be patched on its device")
    idx, values = decode_positions(encoding, payload, n_bytes // width, width)
    if idx.numel():
        bucket.view(_WORD.get(width, torch.uint8)).index_copy_(0, idx, values)


def rebuild_bucket(info: BucketInfo, payload: torch.Tensor | None, bucket: torch.Tensor) -> tuple[bool, float, float]:
    """Bucket `info` of a delta manifest rebuilt in place in `bucket` (the base's bytes, on the engine's device) from
    `payload` (its encoded bytes, verified, on the host or the device) and verified there against `info.host_mix64`:
    (whether the resulting bytes match, seconds of the patch, seconds of the checksum). Raises `DeltaError` for a
    payload that cannot be right; a bucket without a mix64 never passes."""
    t0 = time.perf_counter()
    if not info.host_mix64:
        return False, 0.0, 0.0
    if info.encoding == WHOLE and payload is not None and payload.device != bucket.device and int(payload.numel()) == int(bucket.numel()):
        bucket.copy_(payload, non_blocking=True)  # straight into the bucket: no device copy of the payload first
    else:
        dev = payload.to(bucket.device, non_blocking=True) if payload is not None and payload.device != bucket.device else payload
        apply_delta(info.encoding, dev, bucket, itemsize_of(info.dtype))
    t1 = time.perf_counter()
    ok = mix64_checksum(bucket) == info.host_mix64
    return ok, t1 - t0, time.perf_counter() - t1


def result_checks(buckets: Sequence[BucketInfo]) -> str:
    """"" when every bucket of a delta manifest carries the mix64 of its resulting bytes (`BucketInfo.host_mix64`), so
    it can be rebuilt and verified on a device; else why not (a publisher that computes none for this version, or
    one older than `rollpool.protocol.codec.RESULT_MIX64_MINOR` on a network version)."""
    missing = [b.index for b in buckets if not b.host_mix64]
    if missing:
        return f"the delta carries no mix64 of the resulting bytes for {len(missing)} of {len(buckets)} buckets"
    return ""


class DeviceHeld:
    """One version held on a device in bucket layout (see the module docstring)."""

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self.slab: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        self.buckets: tuple[BucketInfo, ...] = ()
        self.publisher_id = ""
        self.version = -1
        """The version whose verified bytes `views` hold; -1: none (being written, or a write failed)."""

    @staticmethod
    def need_bytes(buckets: Sequence[BucketInfo]) -> int:
        """The device bytes a version of this layout takes here (its buckets, each aligned)."""
        return arena_offsets([b.nbytes for b in buckets])[1]

    def holds(self, publisher_id: str, version: int) -> bool:
        """Whether the buffers hold `version` of `publisher_id`, whole and verified."""
        return self.version >= 0 and self.version == version and self.publisher_id == publisher_id and self.slab is not None

    def lines_up(self, buckets: Sequence[BucketInfo]) -> bool:
        return self.slab is not None and same_layout(self.buckets, buckets)

    def begin(self, buckets: Sequence[BucketInfo], take: Any = None, give: Any = None) -> list[torch.Tensor]:
        """The buffers a version of this layout is written into: the ones held when the layout lines up (their version
        is forgotten: they are being written), else a slab of its size (`take(nbytes, device)`, or a fresh one; the
        slab held before goes to `give`)."""
        self.version = -1
        if not self.lines_up(buckets):
            old = self.drop()
            if old is not None and give is not None:
                give(old)
            need = self.need_bytes(buckets)
            self.slab = take(need, self.device) if take is not None else torch.empty(need, dtype=torch.uint8, device=self.device)
            offsets, _total = arena_offsets([b.nbytes for b in buckets])
            self.views = [self.slab[at : at + b.nbytes] for at, b in zip(offsets, buckets, strict=True)]
            self.buckets = tuple(buckets)
        return self.views

    def done(self, publisher_id: str, version: int, buckets: Sequence[BucketInfo]) -> None:
        """The buffers hold `version` now, every bucket verified."""
        self.publisher_id, self.version, self.buckets = publisher_id, version, tuple(buckets)

    def adopt(self, slab: torch.Tensor, views: Sequence[torch.Tensor], buckets: Sequence[BucketInfo], publisher_id: str, version: int) -> None:
        """Hold a version a device path already put (and verified) on this device, in buffers of its own."""
        self.slab, self.views = slab, list(views)
        self.done(publisher_id, version, buckets)

    def drop(self) -> torch.Tensor | None:
        """Forget the version (and the buffers: returned, for the caller's pool)."""
        slab, self.slab, self.views, self.buckets, self.version = self.slab, None, [], (), -1
        return slab
