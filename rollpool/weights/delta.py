"""Delta weight versions: a version sent as the elements that changed against a base version the subscriber holds.

Contract
    - `encode_bucket(new, base, itemsize)` compares one bucket's bytes with the base's, element by element (the
      bucket's dtype item size: bf16 elements are compared as 2-byte words, so a changed element is a changed bf16
      value, bit for bit). It returns the encoding and its payload: ``UNCHANGED`` (no bytes), ``SPARSE`` (the changed
      elements' indices as little-endian int32, then their new values, each of `itemsize` bytes) when that is smaller
      than the bucket, ``GAPS`` (the same with each index as its gap from the one before, minus one, as a 2-byte
      little-endian unsigned) when every gap fits 2 bytes, else ``WHOLE`` (the bucket's bytes).
    - `decode_bucket(encoding, payload, base, out, itemsize)` writes the resulting bytes into `out` from `base` and
      the payload; `rebuild_bucket(..., summer)` does the same and feeds the resulting bytes to a running checksum in
      the same pass. Neither trusts the payload: indices outside the bucket or out of order, or a payload of the wrong
      size, raise `DeltaError`; the caller then verifies `out` against the manifest's checksum of the *resulting*
      bytes, so a reconstruction is bit-identical to the publisher's version or it is not applied.
    - `compute_delta(new, base, buckets, ...)` encodes every bucket in `threads` threads and returns a `DeltaSet`
      (with the seconds of its compare and encode passes), or None when the layouts differ (a bucket's dtype, size or
      tensors changed) or the encoded bytes pass `max_fraction` of the version's bytes: then the version goes out full.
    - Work is done in pieces of `PIECE_BYTES` (numpy, which releases the GIL on these arrays): each piece's changed
      indices are found, then written, independently, so the pieces of every bucket spread over the threads; a
      rebuild copies, scatters into and checksums one piece at a time, while it is in cache. The wire form does not
      depend on the pieces (a gap may span them).

Why position/value pairs: after an RL optimizer step at lr 1e-6..1e-5 a few percent of bf16 elements change,
scattered (no runs to speak of), so a run-length or bitmap form costs at least a bit per element (1/16 of a bf16
bucket: above the 1/20 goal by itself) while gap/value pairs cost 4 bytes per changed bf16 element (2 x the changed
fraction) and index/value pairs 6 (3 x), used when a gap passes 65536 elements.
Decoding is one copy of the base and one scatter. Measured by `bench/weights.py` (``--delta``: the changed fraction
and the bytes of each encoding) and `bench/delta_profile.py` (where a version's time goes).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from rollpool.protocol.messages import BucketInfo

if TYPE_CHECKING:
    import torch

__all__ = ["ENCODED_FRACTION_GUESS", "GAPS", "SPARSE", "UNCHANGED", "WHOLE", "DeltaError", "DeltaSet", "WireSummary", "compute_delta", "decode_bucket", "encode_bucket",
           "in_place_pays", "itemsize_of", "patch_bucket", "payload_offsets", "plan_encoding", "position_bytes", "word_width", "wire_summary"]

ENCODED_FRACTION_GUESS = 0.04
"""A delta's encoded bytes over the version's bytes, guessed before any delta was made, to make page-locked memory
for it ahead (the publisher's `delta_device.PayloadHost`, per bucket; the worker's landing buffer, `paths.delta`): a
bf16 ``gaps`` payload is 4 bytes per changed element, 2 x the changed fraction, so 0.04 is an RL step changing 2% of
the elements (measured at lr 1e-6: 2.15%). A wrong guess costs the memory made for it; the first delta then makes
what it needs, as without the guess."""

WHOLE = "whole"
UNCHANGED = "unchanged"
SPARSE = "sparse"
GAPS = "gaps"
ENCODINGS = (WHOLE, UNCHANGED, SPARSE, GAPS)

_MAX_ELEMENTS = (1 << 31) - 1
"""Element indices travel as int32: a bucket of more elements is sent whole."""

PIECE_BYTES = 16 << 20
"""A bucket is compared, packed and rebuilt in pieces of this many bytes: a piece's temporaries (its comparison mask)
stay cache-sized and are reused instead of a fresh bucket-sized array per step (whose page faults cost more than the
comparison), and `compute_delta` gives each piece to any of its threads, so even one bucket keeps them all busy."""


class DeltaError(ValueError):
    """A delta payload that cannot be decoded (wrong size, index out of range, unknown encoding)."""


def itemsize_of(dtype_name: str) -> int:
    """The element width a bucket of this dtype is compared in (1 for names this build does not know)."""
    import torch

    dt = getattr(torch, dtype_name, None)
    return int(dt.itemsize) if isinstance(dt, torch.dtype) else 1


_WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def word_width(nbytes: int, itemsize: int) -> int:
    """The width a bucket of `nbytes` bytes of `itemsize`-byte elements is compared in: its item size when that is 1, 2,
    4 or 8 and divides the bucket, else 1 (bytes)."""
    return itemsize if itemsize in _WORD and nbytes % itemsize == 0 else 1


def _words(t: torch.Tensor, itemsize: int) -> np.ndarray[Any, Any]:
    """A 1-D uint8 CPU tensor as an array of its elements' bit patterns (bytes when `itemsize` does not divide it)."""
    a = t.numpy()
    word = _WORD.get(itemsize)
    if word is None or a.size % itemsize:
        return a
    return a.view(word)


REBUILD_PIECE_BYTES = 4 << 20
"""A rebuild writes, scatters into and checksums a bucket this many bytes at a time: small enough that a piece written by
each of two threads is still in the last-level cache when it is scattered into and checksummed (on the 2-core box 4 MiB
pieces took 0.75-0.91x the time of 16 MiB ones, bench/results/cpu-delta-rebuild.json)."""


def _pieces(n: int, width: int, piece_bytes: int = PIECE_BYTES) -> list[tuple[int, int]]:
    """[lo, hi) element ranges of at most `piece_bytes` bytes covering `n` elements of `width` bytes."""
    step = max(1, piece_bytes // width)
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)] or [(0, 0)]


def scan_piece(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any], lo: int, hi: int) -> np.ndarray[Any, Any]:
    """The indices (int64, ascending) of the elements in [lo, hi) where `a` and `b` differ bit for bit."""
    idx = np.flatnonzero(a[lo:hi] != b[lo:hi])
    idx += lo
    return idx


@dataclass(slots=True)
class _Packing:
    """One bucket's encoding, planned from its pieces' changed indices, and its payload (being) written."""

    encoding: str
    changed: int
    width: int
    parts: list[np.ndarray[Any, Any]]
    payload: np.ndarray[Any, Any] | None = None


def _plan(parts: list[np.ndarray[Any, Any]], n: int, width: int) -> _Packing:
    """UNCHANGED, WHOLE, GAPS or SPARSE for a bucket of `n` elements of `width` bytes whose changed indices are `parts`
    (ascending, piece by piece); for GAPS and SPARSE an empty payload of the right size."""
    k = sum(int(p.size) for p in parts)
    enc = plan_encoding(k, n, width, None)
    if enc is None:
        widest, last = 0, -1
        for p in parts:
            if p.size:
                widest = max(widest, int(p[0]) - last, int(np.diff(p).max()) if p.size > 1 else 0)
                last = int(p[-1])
        enc = plan_encoding(k, n, width, widest)
    if enc in (GAPS, SPARSE):
        return _Packing(enc, k, width, parts, np.empty(k * (position_bytes(enc) + width), dtype=np.uint8))
    return _Packing(enc or WHOLE, k, width, parts)


def position_bytes(encoding: str) -> int:
    """Bytes of one changed element's position in a ``gaps`` (2) or ``sparse`` (4) payload."""
    return 2 if encoding == GAPS else 4


def plan_encoding(k: int, n: int, width: int, widest: int | None) -> str | None:
    """The encoding of a bucket of `n` elements of `width` bytes of which `k` changed, the widest distance between
    consecutive changed elements being `widest` (the first counted from position -1); None when that depends on
    `widest` and it is not given yet (so a caller finds the positions only when they are needed). The one rule every
    maker of deltas follows (`encode_bucket`, `compute_delta`, the device's `rollpool.weights.delta_device`), so the
    same versions give the same bytes wherever they were compared."""
    if k == 0:
        return UNCHANGED
    if k * (2 + width) >= n * width or n > _MAX_ELEMENTS:
        return WHOLE
    if widest is None:
        return None
    if widest <= 0x10000:
        # every gap between changed elements fits 2 bytes (the common case: changes are dense enough to be worth a delta)
        return GAPS
    if k * (4 + width) >= n * width:
        return WHOLE
    return SPARSE


def _pack_piece(plan: _Packing, a: np.ndarray[Any, Any], j: int) -> None:
    """Write piece `j`'s positions and values into `plan.payload` (pieces are independent: any order, any thread)."""
    p, payload = plan.parts[j], plan.payload
    if payload is None or not p.size:
        return
    at = sum(int(x.size) for x in plan.parts[:j])
    k, m = plan.changed, int(p.size)
    pos = 2 if plan.encoding == GAPS else 4
    if plan.encoding == GAPS:
        prev = next((int(x[-1]) for x in reversed(plan.parts[:j]) if x.size), -1)
        gaps = payload[: 2 * k].view(np.uint16)
        gaps[at] = int(p[0]) - prev - 1
        if m > 1:
            np.subtract(p[1:], p[:-1], out=gaps[at + 1 : at + m], casting="unsafe")
            gaps[at + 1 : at + m] -= 1
    else:
        payload[: 4 * k].view(np.int32)[at : at + m] = p
    np.take(a, p, out=payload[pos * k :].view(a.dtype)[at : at + m])


def encode_bucket(new: torch.Tensor, base: torch.Tensor, itemsize: int) -> tuple[str, torch.Tensor | None, int]:
    """(encoding, payload or None for unchanged, changed elements) of one bucket (1-D uint8 tensors of one size)."""

    if new.numel() != base.numel():
        raise DeltaError(f"bucket of {new.numel()} bytes against a base of {base.numel()}")
    a, b = _words(new, itemsize), _words(base, itemsize)
    ranges = _pieces(a.size, a.itemsize)
    plan = _plan([scan_piece(a, b, lo, hi) for lo, hi in ranges], a.size, a.itemsize)
    for j in range(len(ranges)):
        _pack_piece(plan, a, j)
    return _result(plan, new)


def _result(plan: _Packing, new: torch.Tensor) -> tuple[str, torch.Tensor | None, int]:
    import torch

    if plan.encoding == UNCHANGED:
        return UNCHANGED, None, 0
    if plan.encoding == WHOLE:
        return WHOLE, new, plan.changed
    assert plan.payload is not None
    return plan.encoding, torch.from_numpy(plan.payload), plan.changed


def _positions(encoding: str, payload: torch.Tensor, n: int, width: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """(element indices, strictly ascending and inside [0, n); new values) of a ``sparse`` or ``gaps`` payload."""
    pos = 4 if encoding == SPARSE else 2
    raw = payload.numpy()
    if raw.size % (pos + width):
        raise DeltaError(f"{encoding} payload of {raw.size} bytes is not whole (position, value) pairs of {pos + width} bytes")
    k = raw.size // (pos + width)
    if encoding == SPARSE:
        idx = raw[: 4 * k].view(np.int32).astype(np.int64)
        if k > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise DeltaError("sparse payload's indices are not ascending")
    else:  # gap - 1 as uint16: ascending by construction
        idx = raw[: 2 * k].view(np.uint16).astype(np.int64)
        idx += 1
        np.cumsum(idx, out=idx)
        idx -= 1
    if k and (int(idx[0]) < 0 or int(idx[-1]) >= n):
        raise DeltaError(f"{encoding} payload names an element outside the bucket ({n} elements)")
    return idx, raw[pos * k :].view(_WORD.get(width, np.uint8))


def rebuild_bucket(encoding: str, payload: torch.Tensor | None, base: torch.Tensor, out: torch.Tensor, itemsize: int,
                   summer: Any = None) -> None:
    """Write the resulting bucket into `out` (may be `base` itself) and feed its bytes to `summer` (a running checksum,
    `rollpool.weights.bucketing.Checksummer`) in the same pass, piece by piece while each is in cache; raises
    `DeltaError` on a payload that cannot be right (the caller then refuses `out`: a failed checksum is its to judge)."""
    n = int(out.numel())
    same = out.data_ptr() == base.data_ptr()
    if encoding == UNCHANGED or encoding in (SPARSE, GAPS):
        if base.numel() != n:
            raise DeltaError(f"{encoding} bucket of {n} bytes against a base of {base.numel()}")
    elif encoding == WHOLE:
        if payload is None or payload.numel() != n:
            raise DeltaError(f"whole bucket of {0 if payload is None else payload.numel()} bytes, expected {n}")
    else:
        raise DeltaError(f"unknown bucket encoding {encoding!r}")
    o, b = _words(out, itemsize), _words(base, itemsize)
    src = b if encoding != WHOLE else _words(payload, itemsize)  # type: ignore[arg-type]
    idx = values = None
    if encoding in (SPARSE, GAPS):
        if payload is None:
            raise DeltaError(f"{encoding!r} bucket without its bytes")
        idx, values = _positions(encoding, payload, o.size, o.itemsize)
    ranges = _pieces(o.size, o.itemsize, REBUILD_PIECE_BYTES)
    cuts = np.searchsorted(idx, [hi for _lo, hi in ranges]) if idx is not None else None
    start = 0
    for j, (lo, hi) in enumerate(ranges):
        if not same or encoding == WHOLE:
            np.copyto(o[lo:hi], src[lo:hi])
        if idx is not None and values is not None and cuts is not None:
            end = int(cuts[j])
            if end > start:
                o[idx[start:end]] = values[start:end]
            start = end
        if summer is not None:
            summer.update(o[lo:hi].view(np.uint8))


IN_PLACE_MAX_FRACTION = 0.01
"""A bucket is rebuilt in place (`patch_bucket`: the delta before applied again, then this one, no copy of the base) only
when the delta before changed at most this fraction of its elements: that scatter then costs less than the copy it
saves. On the 2-core box (`bench/delta_profile.py --rebuild-kernel`, bench/results/cpu-delta-rebuild.json) a changed
element costs about 60 times a copied bf16 element: in place took 0.54x of the copy's time at 0.5% changed, 0.78x at
1%, 0.96-1.13x at 2.15%."""


def in_place_pays(before: BucketInfo) -> bool:
    """Whether a bucket whose delta before was `before` (a delta manifest's entry) is cheaper rebuilt in place than by a
    copy of the base: unchanged then, or changed in at most `IN_PLACE_MAX_FRACTION` of its elements; never ``whole``."""
    if before.encoding == UNCHANGED:
        return True
    if before.encoding not in (SPARSE, GAPS):
        return False
    width = word_width(before.nbytes, itemsize_of(before.dtype))
    elements = before.nbytes // width
    changed = before.delta_nbytes // (position_bytes(before.encoding) + width)
    return changed <= IN_PLACE_MAX_FRACTION * elements


def patch_bucket(patches: Sequence[tuple[str, torch.Tensor | None]], out: torch.Tensor, itemsize: int, summer: Any = None) -> None:
    """Apply `patches` (``(encoding, payload)``, each ``sparse``, ``gaps`` or ``unchanged``, in order) to the bytes
    already in `out`, in place, and feed the resulting bytes to `summer` in the same pass, piece by piece: a bucket that
    holds the version two before rebuilt with the delta before and this one, with no copy of the base. Raises
    `DeltaError` on a payload that cannot be right (as `rebuild_bucket`); the caller verifies `out`."""
    o = _words(out, itemsize)
    decoded = []
    for encoding, payload in patches:
        if encoding == UNCHANGED:
            continue
        if encoding not in (SPARSE, GAPS) or payload is None:
            raise DeltaError(f"a {encoding!r} bucket cannot be applied in place")
        decoded.append(_positions(encoding, payload, o.size, o.itemsize))
    ranges = _pieces(o.size, o.itemsize, REBUILD_PIECE_BYTES)
    his = [hi for _lo, hi in ranges]
    cuts = [np.searchsorted(idx, his) for idx, _values in decoded]
    starts = [0] * len(decoded)
    for j, (lo, hi) in enumerate(ranges):
        for k, (idx, values) in enumerate(decoded):
            end = int(cuts[k][j])
            if end > starts[k]:
                o[idx[starts[k] : end]] = values[starts[k] : end]
            starts[k] = end
        if summer is not None:
            summer.update(o[lo:hi].view(np.uint8))


def decode_bucket(encoding: str, payload: torch.Tensor | None, base: torch.Tensor, out: torch.Tensor, itemsize: int) -> None:
    """Write the resulting bucket into `out` (may be `base` itself); raises `DeltaError` on a payload that cannot be right."""
    rebuild_bucket(encoding, payload, base, out, itemsize)


@dataclass(slots=True)
class DeltaSet:
    """One version's delta against `base`: per bucket its encoding and payload (None: unchanged)."""

    base: int
    encodings: list[str]
    payloads: list[torch.Tensor | None]
    changed_elements: int
    total_elements: int
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds of each phase: ``compare_s`` (finding the changed elements), ``encode_s`` (writing positions and values;
    a delta made on a GPU also ``pin_s``, of it: allocating the page-locked host buffer its payload is copied into)."""

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


def payload_offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where each of a delta's carried buckets' encoded bytes (`sizes`, in bucket order) starts in one buffer holding them
    all, each at a multiple of 8 bytes (decoded through int32 and element views), and the buffer's size: the layout of
    the subscriber's scratch and of the publisher's shared-memory segment (`Manifest.delta_shm`) alike."""
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += -(-n // 8) * 8
    return offsets, at


def same_layout(a: Sequence[BucketInfo], b: Sequence[BucketInfo]) -> bool:
    """Whether two versions' buckets line up (same count, dtype, size and tensors): only then is a delta meaningful."""
    return len(a) == len(b) and all(x.dtype == y.dtype and x.nbytes == y.nbytes and x.tensors == y.tensors for x, y in zip(a, b, strict=True))


def compute_delta(new: Sequence[torch.Tensor], base: Sequence[torch.Tensor], buckets: Sequence[BucketInfo], base_buckets: Sequence[BucketInfo],
                  *, base_version: int, threads: int = 2, max_fraction: float = 0.5) -> DeltaSet | None:
    """The delta of `new` against `base` (per bucket 1-D uint8 tensors), or None when a full version is cheaper or the
    layouts differ (see the module docstring). Every bucket's pieces are compared, then packed, in `threads` threads."""
    if not same_layout(buckets, base_buckets):
        return None
    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="weights-delta") as ex:
        return encode_buckets(new, base, buckets, base_version=base_version, run=ex.map, max_fraction=max_fraction)


def encode_buckets(new: Sequence[torch.Tensor], base: Sequence[torch.Tensor], buckets: Sequence[BucketInfo], *, base_version: int,
                   run: Any = map, max_fraction: float = 1.0) -> DeltaSet | None:
    """`compute_delta`'s work, with `run` (a ``map``: an executor's spreads the pieces over its threads) for both passes;
    the layouts must line up (`same_layout`)."""
    sizes = [itemsize_of(b.dtype) for b in buckets]
    words = [(_words(n, s), _words(o, s)) for n, o, s in zip(new, base, sizes, strict=True)]
    for (a, b), bi in zip(words, buckets, strict=True):
        if a.size != b.size:
            raise DeltaError(f"bucket {bi.index}: {a.nbytes} bytes against a base of {b.nbytes}")
    items = [(i, j, lo, hi) for i, (a, _b) in enumerate(words) for j, (lo, hi) in enumerate(_pieces(a.size, a.itemsize))]
    t0 = time.perf_counter()
    found = list(run(lambda it: scan_piece(words[it[0]][0], words[it[0]][1], it[2], it[3]), items))
    parts: list[list[np.ndarray[Any, Any]]] = [[] for _ in buckets]
    for it, idx in zip(items, found, strict=True):
        parts[it[0]].append(idx)
    plans = [_plan(p, a.size, a.itemsize) for p, (a, _b) in zip(parts, words, strict=True)]
    t1 = time.perf_counter()
    list(run(lambda it: _pack_piece(plans[it[0]], words[it[0]][0], it[1]), [it for it in items if plans[it[0]].payload is not None]))
    t2 = time.perf_counter()
    results = [_result(plan, n) for plan, n in zip(plans, new, strict=True)]
    total = sum(b.nbytes for b in buckets)
    ds = DeltaSet(base=base_version, encodings=[r[0] for r in results], payloads=[r[1] for r in results],
                  changed_elements=sum(r[2] for r in results), total_elements=sum(b.nbytes // s for b, s in zip(buckets, sizes, strict=True)),
                  timings={"compare_s": round(t1 - t0, 4), "encode_s": round(t2 - t1, 4)})
    if total and ds.wire_bytes > max_fraction * total:
        return None
    return ds
