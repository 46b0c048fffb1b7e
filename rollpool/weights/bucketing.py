"""Bucketing: named tensors <-> contiguous single-dtype byte buckets plus a manifest.

Pure (no I/O): packing, planning, checksums and unpacking are plain functions
and classes, tested without sockets.

Rules
    - Tensors are placed in the order given. Each dtype has one *open* bucket;
      a tensor goes into the open bucket of its dtype, and when it does not
      fit (the bucket would pass `bucket_bytes`) that bucket closes and a new
      one opens. So every bucket holds one dtype (SGLang's flattened buckets
      break on mixed dtypes, and every offset is a multiple of the itemsize),
      and a model whose layers interleave bf16 weights and fp32 norms still
      packs into few buckets. Buckets are numbered in the order they open.
    - A tensor larger than `bucket_bytes` lies alone in its own bucket.
    - Bytes are the tensor's own memory layout (little-endian on every
      platform torch supports), moved as ``tensor.view(torch.uint8)``, so
      every dtype torch has round-trips bit-exactly, bfloat16 and fp8
      included (numpy has neither). Non-contiguous tensors are copied in
      contiguous order; 0-d tensors keep their empty shape.
    - Each bucket carries a checksum ``"<algorithm>:<hex>"``. The default is
      ``"xxh3_64:<16 hex>"`` (the `xxhash` package; about 27 GB/s on one core
      of the development machine, 0.04 s per GB, and it releases the GIL);
      where `xxhash` is not importable the publisher falls back to
      ``"crc32:<8 hex>"`` (zlib; about 4 GB/s, 0.24 s per GB). A subscriber
      verifies both, so old publishers keep working. Both detect corruption
      on the way, not tampering: tampering is kept out by the
      CURVE-authenticated channel the manifest travels on. `xxhash` is
      imported on first use, so rollpool imports without it.

Unpacking (`unpack_bucket`) returns tensors that are views of the received
buffer: no extra copy.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from rollpool.protocol.messages import BucketInfo, TensorInfo
from rollpool.weights import manifest as _manifest
from rollpool.weights.manifest import check_bucket_info, checksum_supported

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_CHUNK_BYTES",
    "CHECKSUM_ALGORITHMS",
    "default_checksum_algorithm",
    "checksum_supported",
    "dtype_name",
    "dtype_from_name",
    "named_tensors_of",
    "BucketPlanner",
    "PackedBucket",
    "BucketPacker",
    "pack_tensors",
    "checksum",
    "Checksummer",
    "verify_checksum",
    "check_bucket_info",
    "unpack_bucket",
    "unpack_buckets",
    "tensor_bytes",
    "flat_bytes",
]

_MiB = 1024 * 1024
DEFAULT_BUCKET_BYTES = 512 * _MiB
DEFAULT_CHUNK_BYTES = 4 * _MiB
CHECKSUM_ALGORITHMS = ("xxh3_64", "crc32")
"""Algorithms a manifest may name, preferred first."""

_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}
for _name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"):
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype):
        _DTYPES[_name] = _dt
_NAMES: dict[torch.dtype, str] = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype (numpy-style: ``float32``, ``bfloat16``)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot travel as weights (supported: {sorted(_DTYPES)})") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown weight dtype {name!r} (this build knows {sorted(_DTYPES)})") from None


def named_tensors_of(source: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a dict, an ``nn.Module`` (state_dict) or an iterable of pairs."""
    if isinstance(source, torch.nn.Module):
        yield from source.state_dict(keep_vars=False).items()
        return
    items: Iterable[Any] = source.items() if isinstance(source, Mapping) else source
    for item in items:
        try:
            name, tensor = item
        except (TypeError, ValueError):
            raise TypeError(f"expected (name, tensor) pairs, got {type(item).__name__}") from None
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected (str, torch.Tensor), got ({type(name).__name__}, {type(tensor).__name__})")
        yield name, tensor


def tensor_bytes(tensor: torch.Tensor) -> int:
    return int(tensor.numel()) * tensor.element_size()


# --------------------------------------------------------------------------- checksums


def default_checksum_algorithm() -> str:
    """``"xxh3_64"`` where `xxhash` is importable, else ``"crc32"``."""
    return "xxh3_64" if _manifest.xxhash_module() is not None else "crc32"


def checksum(data: Any, algorithm: str | None = None) -> str:
    """``"<algorithm>:<hex>"`` of a bytes-like object (default: `default_checksum_algorithm`)."""
    summer = Checksummer(algorithm)
    summer.update(data)
    return summer.hexdigest()


class Checksummer:
    """A running checksum over bytes fed in order (``update`` releases the GIL for both algorithms)."""

    __slots__ = ("algorithm", "_crc", "_xxh")

    def __init__(self, algorithm: str | None = None) -> None:
        self.algorithm = algorithm or default_checksum_algorithm()
        if not checksum_supported(self.algorithm):
            raise ValueError(f"checksum algorithm {self.algorithm!r} is not available here (known: {CHECKSUM_ALGORITHMS}; xxh3_64 needs the xxhash package)")
        self._crc = 0
        self._xxh: Any = _manifest.xxhash_module().xxh3_64() if self.algorithm == "xxh3_64" else None

    @classmethod
    def for_digest(cls, expected: str) -> Checksummer:
        """A running checksum of the algorithm that `expected` (``"<algorithm>:<hex>"``) names."""
        return cls(expected.partition(":")[0])

    def update(self, data: Any) -> None:
        if self._xxh is not None:
            self._xxh.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        if self._xxh is not None:
            return f"xxh3_64:{self._xxh.intdigest():016x}"
        return f"crc32:{self._crc & 0xFFFFFFFF:08x}"


def verify_checksum(expected: str, data: Any = None, *, running: Checksummer | None = None) -> bool:
    """Whether `data` (or a finished running checksum) matches `expected`.

    An unknown or unavailable algorithm is a failure, never a pass.
    """
    algo, _, _digest = expected.partition(":")
    if not checksum_supported(algo):
        return False
    if running is not None:
        return running.algorithm == algo and running.hexdigest() == expected
    return checksum(data, algo) == expected


# --------------------------------------------------------------------------- planning


@dataclass(slots=True)
class _OpenBucket:
    index: int
    dtype: str
    nbytes: int = 0
    tensors: list[TensorInfo] = field(default_factory=list)


class BucketPlanner:
    """Places tensors into buckets by the rules in the module docstring (pure bookkeeping).

    `place` returns ``(bucket index, offset, closed)`` where `closed` lists the
    indices of buckets that this placement closed (no later tensor goes there).
    """

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.buckets: list[_OpenBucket] = []
        self._open: dict[str, int] = {}
        self._names: set[str] = set()

    def place(self, name: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> tuple[int, int, list[int]]:
        if name in self._names:
            raise ValueError(f"tensor name {name!r} given twice")
        self._names.add(name)
        closed: list[int] = []
        idx = self._open.get(dtype)
        if idx is not None:
            b = self.buckets[idx]
            if b.nbytes + nbytes > self.bucket_bytes and b.nbytes > 0:
                closed.append(idx)
                idx = None
        if idx is None:
            idx = len(self.buckets)
            self.buckets.append(_OpenBucket(idx, dtype))
            self._open[dtype] = idx
        b = self.buckets[idx]
        offset = b.nbytes
        b.tensors.append(TensorInfo(name=name, dtype=dtype, shape=shape, offset=offset, nbytes=nbytes))
        b.nbytes += nbytes
        if b.nbytes >= self.bucket_bytes:
            closed.append(idx)  # full (or an oversize tensor alone): nothing else goes here
            del self._open[dtype]
        return idx, offset, closed


# --------------------------------------------------------------------------- packing


@dataclass(frozen=True, slots=True)
class PackedBucket:
    info: BucketInfo
    data: torch.Tensor
    """1-D uint8 CPU tensor of exactly ``info.nbytes`` bytes."""


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a 1-D uint8 view (contiguous tensors) or copy."""
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.reshape(-1).view(torch.uint8)


class BucketPacker:
    """Snapshots named tensors into its own CPU buckets as they are added (streaming).

    The buffer of an open bucket grows by doubling (capped at the bucket
    size), so a stream of tensors is copied about once; a closed bucket whose
    buffer is much larger than its content is trimmed.
    """

    _FIRST_CAPACITY = 16 * _MiB

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, pin_memory: bool = False, checksum_algorithm: str | None = None) -> None:
        self.planner = BucketPlanner(bucket_bytes)
        self.pin_memory = pin_memory
        self.checksum_algorithm = checksum_algorithm or default_checksum_algorithm()
        Checksummer(self.checksum_algorithm)  # fail early on an unavailable algorithm
        self._buffers: dict[int, torch.Tensor] = {}
        self._sums: dict[int, Checksummer] = {}
        self._done: dict[int, PackedBucket] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        dtype = dtype_name(tensor.dtype)
        nbytes = tensor_bytes(tensor)
        idx, offset, closed = self.planner.place(name, dtype, tuple(int(s) for s in tensor.shape), nbytes)
        if nbytes:
            buf = self._reserve(idx, offset, offset + nbytes)
            dst = buf[offset : offset + nbytes]
            src = flat_bytes(tensor)
            dst.copy_(src, non_blocking=False)
            self._sums.setdefault(idx, Checksummer(self.checksum_algorithm)).update(dst.numpy())
        for c in closed:
            self._close(c)

    def finish(self) -> list[PackedBucket]:
        for b in self.planner.buckets:
            if b.index not in self._done:
                self._close(b.index)
        return [self._done[i] for i in range(len(self.planner.buckets))]

    def _reserve(self, idx: int, used: int, needed: int) -> torch.Tensor:
        """A buffer for bucket `idx` of at least `needed` bytes whose first `used` bytes are kept."""
        buf = self._buffers.get(idx)
        cap = 0 if buf is None else int(buf.numel())
        if buf is not None and needed <= cap:
            return buf
        limit = max(self.planner.bucket_bytes, needed)
        new = torch.empty(min(limit, max(needed, 2 * cap, self._FIRST_CAPACITY)), dtype=torch.uint8, pin_memory=self.pin_memory)
        if buf is not None and used:
            new[:used].copy_(buf[:used])
        self._buffers[idx] = new
        return new

    def _close(self, idx: int) -> None:
        b = self.planner.buckets[idx]
        buf = self._buffers.pop(idx, None)
        if buf is None:
            buf = torch.empty(0, dtype=torch.uint8)
        data = buf[: b.nbytes]
        if int(buf.numel()) - b.nbytes > max(_MiB, b.nbytes // 4):
            data = data.clone()
        summer = self._sums.pop(idx, None) or Checksummer(self.checksum_algorithm)
        digest = summer.hexdigest()
        info = BucketInfo(index=idx, dtype=b.dtype, nbytes=b.nbytes, checksum=digest, tensors=tuple(b.tensors))
        self._done[idx] = PackedBucket(info=info, data=data)


def pack_tensors(source: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, checksum_algorithm: str | None = None) -> list[PackedBucket]:
    """Snapshot a dict, a module or an iterable of (name, tensor) into packed buckets."""
    packer = BucketPacker(bucket_bytes, checksum_algorithm=checksum_algorithm)
    for name, tensor in named_tensors_of(source):
        packer.add(name, tensor)
    return packer.finish()


# --------------------------------------------------------------------------- unpacking


def unpack_bucket(info: BucketInfo, data: torch.Tensor) -> dict[str, torch.Tensor]:
    """Named tensors that are views of `data` (a 1-D uint8 tensor of the bucket's bytes).

    Raises ValueError when the manifest does not fit the buffer (never reads
    out of bounds).
    """
    if data.dtype != torch.uint8 or data.dim() != 1 or int(data.numel()) != info.nbytes:
        raise ValueError(f"bucket {info.index}: buffer of {data.numel()} bytes, manifest says {info.nbytes}")
    check_bucket_info(info)
    out: dict[str, torch.Tensor] = {}
    for t in info.tensors:
        piece = data[t.offset : t.offset + t.nbytes]
        out[t.name] = piece.view(dtype_from_name(t.dtype)).reshape(t.shape)
    return out


def unpack_buckets(buckets: Iterable[tuple[BucketInfo, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for info, data in buckets:
        for name, tensor in unpack_bucket(info, data).items():
            if name in out:
                raise ValueError(f"tensor name {name!r} appears in two buckets")
            out[name] = tensor
    return out
