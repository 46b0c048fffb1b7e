"""Delta weight versions: a version sent as the elements that changed against a base version the subscriber holds.

Contract
    - `encode_bucket(new, base, itemsize)` compares one bucket's bytes with the base's, element by element (the
      bucket's dtype item size: bf16 elements are compared as 2-byte words, so a changed element is a changed bf16
      value, bit for bit). It returns the encoding and its payload: ``UNCHANGED`` (no bytes), ``SPARSE`` (the changed
      elements' indices as little-endian int32, then their new values, each of `itemsize` bytes) when that is smaller
      than the bucket, ``GAPS`` (the same with each index as its gap from the one before, minus one, as a 2-byte
      little-endian unsigned) when every gap fits 2 bytes, else ``WHOLE`` (the bucket's bytes).
    - `decode_bucket(encoding, payload, base, out, itemsize)` writes the resulting bytes into `out` from `base` and
      the payload. It never trusts the payload: indices outside the bucket or a payload of the wrong size raise
      `DeltaError`; the caller then verifies `out` against the manifest's checksum of the *resulting* bytes, so a
      reconstruction is bit-identical to the publisher's version or it is not applied.
    - `compute_delta(new, base, buckets, ...)` encodes every bucket in `threads` threads (torch's comparison,
      nonzero and gather release the GIL) and returns a `DeltaSet`, or None when the layouts differ (a bucket's
      dtype, size or tensors changed) or the encoded bytes pass `max_fraction` of the version's bytes: then the
      version goes out full.

Why position/value pairs: after an RL optimizer step at lr 1e-6..1e-5 a few percent of bf16 elements change,
scattered (no runs to speak of), so a run-length or bitmap form costs at least a bit per element (1/16 of a bf16
bucket: above the 1/20 goal by itself) while gap/value pairs cost 4 bytes per changed bf16 element (2 x the changed
fraction) and index/value pairs 6 (3 x), used when a gap passes 65536 elements.
Decoding is one copy of the base and one scatter, the same op on the CPU and the GPU. Measured by `bench/weights.py`
(``--delta``), which reports the changed fraction and the bytes of each encoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollpool.protocol.messages import BucketInfo

if TYPE_CHECKING:
    import torch

__all__ = ["GAPS", "SPARSE", "UNCHANGED", "WHOLE", "DeltaError", "DeltaSet", "WireSummary", "compute_delta", "decode_bucket", "encode_bucket",
           "itemsize_of", "wire_summary"]

WHOLE = "whole"
UNCHANGED = "unchanged"
SPARSE = "sparse"
GAPS = "gaps"
ENCODINGS = (WHOLE, UNCHANGED, SPARSE, GAPS)

_MAX_ELEMENTS = (1 << 31) - 1
"""Element indices travel as int32: a bucket of more elements is sent whole."""


class DeltaError(ValueError):
    """A delta payload that cannot be decoded (wrong size, index out of range, unknown encoding)."""


def itemsize_of(dtype_name: str) -> int:
    """The element width a bucket of this dtype is compared in (1 for names this build does not know)."""
    import torch

    dt = getattr(torch, dtype_name, None)
    return int(dt.itemsize) if isinstance(dt, torch.dtype) else 1


def _words(t: torch.Tensor, itemsize: int) -> torch.Tensor:
    import torch

    word = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(itemsize)
    if word is None or t.numel() % itemsize:
        return t
    return t.view(word)


def encode_bucket(new: torch.Tensor, base: torch.Tensor, itemsize: int) -> tuple[str, torch.Tensor | None, int]:
    """(encoding, payload or None for unchanged, changed elements) of one bucket (1-D uint8 tensors of one size)."""
    import torch

    if new.numel() != base.numel():
        raise DeltaError(f"bucket of {new.numel()} bytes against a base of {base.numel()}")
    a, b = _words(new, itemsize), _words(base, itemsize)
    if a.dtype == torch.uint8:
        itemsize = 1
    idx = torch.ne(a, b).nonzero().squeeze(1)
    k = int(idx.numel())
    if k == 0:
        return UNCHANGED, None, 0
    if k * (2 + itemsize) >= new.numel() or a.numel() > _MAX_ELEMENTS:
        return WHOLE, new, k
    gaps = torch.diff(idx, prepend=idx.new_full((1,), -1))
    if int(gaps.max()) <= 0xFFFF:
        # every gap between changed elements fits 2 bytes (the common case: changes are dense enough to be worth a delta)
        payload = torch.empty(k * (2 + itemsize), dtype=torch.uint8, device=new.device)
        payload[: 2 * k].view(torch.int16).copy_((gaps - 1).to(torch.int32).to(torch.int16))
        payload[2 * k :].view(a.dtype).copy_(a[idx])
        return GAPS, payload, k
    if k * (4 + itemsize) >= new.numel():
        return WHOLE, new, k
    payload = torch.empty(k * (4 + itemsize), dtype=torch.uint8, device=new.device)
    payload[: 4 * k].view(torch.int32).copy_(idx)
    payload[4 * k :].view(a.dtype).copy_(a[idx])
    return SPARSE, payload, k


def decode_bucket(encoding: str, payload: torch.Tensor | None, base: torch.Tensor, out: torch.Tensor, itemsize: int) -> None:
    """Write the resulting bucket into `out` (may be `base` itself); raises `DeltaError` on a payload that cannot be right."""

    n = int(out.numel())
    if encoding == UNCHANGED:
        if base.numel() != n:
            raise DeltaError(f"unchanged bucket of {n} bytes against a base of {base.numel()}")
        if out.data_ptr() != base.data_ptr():
            out.copy_(base)
        return
    if payload is None:
        raise DeltaError(f"{encoding!r} bucket without its bytes")
    if encoding == WHOLE:
        if payload.numel() != n:
            raise DeltaError(f"whole bucket of {payload.numel()} bytes, expected {n}")
        out.copy_(payload)
        return
    if encoding not in (SPARSE, GAPS):
        raise DeltaError(f"unknown bucket encoding {encoding!r}")
    if base.numel() != n:
        raise DeltaError(f"sparse bucket of {n} bytes against a base of {base.numel()}")
    o = _words(out, itemsize)
    idx, values = _positions(encoding, payload, o)
    if out.data_ptr() != base.data_ptr():
        out.copy_(base)
    o[idx] = values


def _positions(encoding: str, payload: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(element indices, new values) of a ``sparse`` or ``gaps`` payload against the words `o` it applies to."""
    import torch

    width = o.element_size()
    pos = 4 if encoding == SPARSE else 2
    if payload.numel() % (pos + width):
        raise DeltaError(f"{encoding} payload of {payload.numel()} bytes is not whole (position, value) pairs of {pos + width} bytes")
    k = payload.numel() // (pos + width)
    if payload.storage_offset() % 8:
        payload = payload.clone()  # the index and value views need their element alignment
    if encoding == SPARSE:
        idx = payload[: 4 * k].view(torch.int32).to(torch.int64)
    else:  # gap - 1 as uint16 (stored in int16 bits)
        idx = (payload[: 2 * k].view(torch.int16).to(torch.int64) & 0xFFFF).add_(1).cumsum_(0).sub_(1)
    if k and (int(idx.min()) < 0 or int(idx.max()) >= o.numel()):
        raise DeltaError(f"{encoding} payload names an element outside the bucket ({o.numel()} elements)")
    return idx, payload[pos * k :].view(o.dtype)


@dataclass(slots=True)
class DeltaSet:
    """One version's delta against `base`: per bucket its encoding and payload (None: unchanged)."""

    base: int
    encodings: list[str]
    payloads: list[torch.Tensor | None]
    changed_elements: int
    total_elements: int

    @property
    def wire_bytes(self) -> int:
        return sum(int(p.numel()) for p in self.payloads if p is not None)

    @property
    def changed_fraction(self) -> float:
        return self.changed_elements / self.total_elements if self.total_elements else 0.0

    def bytes_by_encoding(self) -> dict[str, int]:
        out = dict.fromkeys(ENCODINGS, 0)
        for enc, p in zip(self.encodings, self.payloads, strict=True):
            out[enc] += int(p.numel()) if p is not None else 0
        return out


@dataclass(frozen=True, slots=True)
class WireSummary:
    """What one version cost on the wire, read from its manifest alone (a subscriber or relay that got it knows no more):
    bytes by encoding (``full``: a version sent whole, not as a delta) and the fraction of elements it carried as changed
    (a ``whole`` bucket counts all of its elements, so over a delta this is an upper bound of the changed fraction)."""

    version: int
    model_bytes: int
    bytes_by_encoding: dict[str, int]
    changed_fraction: float

    @property
    def wire_bytes(self) -> int:
        return sum(self.bytes_by_encoding.values())


def wire_summary(version: int, buckets: Sequence[BucketInfo], delta_base: int) -> WireSummary:
    """The `WireSummary` of a manifest's buckets (`delta_base` < 0: a full version)."""
    model = sum(b.nbytes for b in buckets)
    if delta_base < 0:
        return WireSummary(version, model, {"full": model}, 1.0 if model else 0.0)
    by = dict.fromkeys(ENCODINGS, 0)
    changed = total = 0
    for b in buckets:
        size = itemsize_of(b.dtype)
        total += b.nbytes // size
        by[b.encoding] = by.get(b.encoding, 0) + b.delta_nbytes
        if b.encoding == WHOLE:
            changed += b.nbytes // size
        elif b.encoding in (SPARSE, GAPS):
            changed += b.delta_nbytes // ((4 if b.encoding == SPARSE else 2) + size)
    return WireSummary(version, model, by, changed / total if total else 0.0)


def same_layout(a: Sequence[BucketInfo], b: Sequence[BucketInfo]) -> bool:
    """Whether two versions' buckets line up (same count, dtype, size and tensors): only then is a delta meaningful."""
    return len(a) == len(b) and all(x.dtype == y.dtype and x.nbytes == y.nbytes and x.tensors == y.tensors for x, y in zip(a, b, strict=True))


def compute_delta(new: Sequence[torch.Tensor], base: Sequence[torch.Tensor], buckets: Sequence[BucketInfo], base_buckets: Sequence[BucketInfo],
                  *, base_version: int, threads: int = 2, max_fraction: float = 0.5) -> DeltaSet | None:
    """The delta of `new` against `base` (per bucket 1-D uint8 tensors), or None when a full version is cheaper or the
    layouts differ (see the module docstring)."""
    if not same_layout(buckets, base_buckets):
        return None
    sizes = [itemsize_of(b.dtype) for b in buckets]

    def one(i: int) -> tuple[str, Any, int]:
        return encode_bucket(new[i], base[i], sizes[i])

    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="weights-delta") as ex:
        results = list(ex.map(one, range(len(buckets))))
    total = sum(b.nbytes for b in buckets)
    ds = DeltaSet(base=base_version, encodings=[r[0] for r in results], payloads=[r[1] for r in results],
                  changed_elements=sum(r[2] for r in results), total_elements=sum(b.nbytes // s for b, s in zip(buckets, sizes, strict=True)))
    if total and ds.wire_bytes > max_fraction * total:
        return None
    return ds
