"""The pure core of the weight channel: manifest checks and the subscriber's path plan (no torch, no I/O).

What it promises
    - `check_manifest(manifest)` returns the manifest when every bucket's index is its place, every tensor lies inside
      its bucket (sized by its shape and dtype, aligned to its item size) and every checksum present names an
      algorithm this process can verify; else `WeightSyncError` naming the version and the fault. A pending checksum
      (``""``, a streamed publish) passes: it follows on the bucket's first chunk.
    - `plan(manifest, facts, config)` lists every transport path in `PATHS` once, in the order a fetch tries them
      (fastest first: `CUDA_IPC`, `SHM_DEVICE`, `SHM`, `BULK`, `NETWORK`), each either to try (`Step.why_not` empty)
      or passed over with the reason. A passed step is `counted` when it is a fallback the user must hear about
      (logged, evented, counted in the subscriber's ``fallbacks``), and quiet when the path does not apply with
      nothing to explain (the configured path excludes it, the version is empty, the publisher offers no device
      buffer on ``auto``). `Plan.refusal` is set when the configured path cannot be honoured at all (``shm`` with no
      shared memory to read): the fetch fails with it and tries nothing.
    - The order a fetch walks: a passed step's reason is reported when the walk reaches it, so a fallback is counted
      only when every faster path before it did not serve the version (as before the plan existed).
    - A path to try may still fail during the fetch (a torn read, a missing GPU checksum, an unreachable lane): the
      fetch reports that as a counted fallback and goes on down the plan; under ``shm`` a failure of the shared-memory
      path ends the fetch (`WeightSyncError`), since nothing below it is allowed.

Adding a path is a file under ``paths/`` and a step here, with its unit tests (tests/unit/weights/test_manifest.py).
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from rollpool.protocol.codec import DELTA_PATHS_MINOR
from rollpool.protocol.errors import WeightSyncError
from rollpool.protocol.messages import BucketInfo, Manifest
from rollpool.weights.config import WeightPathConfig

__all__ = [
    "BULK",
    "CUDA_IPC",
    "MAX_CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "NETWORK",
    "PATHS",
    "SHM",
    "SHM_DEVICE",
    "FetchFacts",
    "GpuBudget",
    "Plan",
    "Step",
    "check_bucket_info",
    "check_manifest",
    "checksum_supported",
    "delta_plan",
    "chunk_bytes_of",
    "dtype_itemsize",
    "gpu_budget_bytes",
    "plan",
    "stream_jobs",
    "total_bytes",
    "xxhash_module",
]

CUDA_IPC = "cuda_ipc"
"""The trainer's GPU buffer copied device-to-device by an engine on the same GPU."""
SHM_DEVICE = "shm_device"
"""The publisher's shared-memory segments copied straight to the engine's GPU and verified there."""
SHM = "shm"
"""The publisher's shared-memory segments copied (and checksummed) on the CPU."""
BULK = "bulk"
"""Plain TCP beside the ROUTER, received straight into the bucket (`rollpool.weights.paths.bulk`)."""
NETWORK = "network"
"""ZeroMQ chunks over the ROUTER: the path every publisher serves."""
PATHS = (CUDA_IPC, SHM_DEVICE, SHM, BULK, NETWORK)
"""Every path, in the order a fetch tries them."""

_MiB = 1024 * 1024
MAX_CHUNK_BYTES = 16 * _MiB
"""The largest chunk a server answers (the manifest's chunk_bytes is the advice)."""
MIN_CHUNK_BYTES = 4096
"""The smallest chunk a subscriber asks for, whatever the manifest advises."""

_ITEMSIZE = {
    "bool": 1, "int8": 1, "uint8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "bfloat16": 2, "float16": 2, "int16": 2, "uint16": 2, "float32": 4, "int32": 4, "uint32": 4,
    "float64": 8, "int64": 8, "uint64": 8, "complex64": 8, "complex128": 16,
}


def dtype_itemsize(name: str) -> int:
    """Bytes per element of a wire dtype name; ValueError for a name no build knows."""
    try:
        return _ITEMSIZE[name]
    except KeyError:
        raise ValueError(f"unknown weight dtype {name!r} (this build knows {sorted(_ITEMSIZE)})") from None


@functools.cache
def xxhash_module() -> Any:
    """The `xxhash` module, or None where it is not installed (imported once, on first use)."""
    try:
        import xxhash
    except ImportError:
        return None
    return xxhash


def checksum_supported(algorithm: str) -> bool:
    """Whether this process can compute (and so verify) `algorithm`."""
    if algorithm == "crc32":
        return True
    return algorithm == "xxh3_64" and xxhash_module() is not None


def check_bucket_info(info: BucketInfo) -> None:
    """Raise ValueError unless every tensor of `info` lies inside the bucket, aligned and sized by its shape."""
    if info.nbytes < 0:
        raise ValueError(f"bucket {info.index}: negative size {info.nbytes}")
    for t in info.tensors:
        itemsize = dtype_itemsize(t.dtype)
        numel = 1
        for s in t.shape:
            if s < 0:
                raise ValueError(f"tensor {t.name!r}: negative dimension in shape {t.shape}")
            numel *= s
        if numel * itemsize != t.nbytes or t.offset < 0 or t.offset + t.nbytes > info.nbytes:
            raise ValueError(f"tensor {t.name!r}: shape {t.shape} x {t.dtype} does not fit {t.nbytes} bytes at offset {t.offset}")
        if t.offset % itemsize:
            raise ValueError(f"tensor {t.name!r}: offset {t.offset} is not aligned to {itemsize}")


def check_manifest(manifest: Manifest) -> Manifest:
    """`manifest` when it can be fetched and verified here, else `WeightSyncError` (see the module docstring)."""
    try:
        for i, b in enumerate(manifest.buckets):
            if b.index != i:
                raise ValueError(f"bucket {i} has index {b.index}")
            check_bucket_info(b)
            if not b.checksum:
                continue  # a streamed publish: the checksum follows on the bucket's chunks
            algo = b.checksum.partition(":")[0]
            if not checksum_supported(algo):
                raise ValueError(f"bucket {i}: checksum algorithm {algo!r} cannot be verified here (xxh3_64 needs the xxhash package)")
    except ValueError as exc:
        raise WeightSyncError(f"manifest of version {manifest.version} is invalid: {exc}") from exc
    return manifest


def total_bytes(manifest: Manifest) -> int:
    return sum(b.nbytes for b in manifest.buckets)


def chunk_bytes_of(manifest: Manifest) -> int:
    """The chunk size a subscriber asks for: the manifest's advice, within [MIN_CHUNK_BYTES, MAX_CHUNK_BYTES]."""
    return min(max(manifest.chunk_bytes, MIN_CHUNK_BYTES), MAX_CHUNK_BYTES)


# ---------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True, slots=True)
class FetchFacts:
    """What the subscriber knows of itself when a manifest arrives (its side of the hello)."""

    host_key: str
    """This process's host and /dev/shm (`rollpool.weights.memory.host_key`)."""
    gpu_uuids: Collection[str] = ()
    """The GPUs this process sees, by UUID (empty without CUDA, or where the path cannot be the same-GPU one)."""
    stage_device: bool = False
    """The engine loads from a GPU and takes device tensors: shared memory may be staged straight to it."""
    lane_host: str | None = None
    """The host of the ROUTER endpoint, where a bulk lane would be (None: not TCP)."""
    unreachable_lanes: Collection[tuple[str, int]] = field(default=frozenset())
    """Lanes that could not be connected to at all before (a firewall stays shut): not tried again."""


@dataclass(frozen=True, slots=True)
class Step:
    path: str
    why_not: str = ""
    """Empty: try this path. Else why it was passed over."""
    counted: bool = False
    """For a passed step: a fallback that is logged and counted (else the path does not apply, nothing to explain)."""


@dataclass(frozen=True, slots=True)
class Plan:
    steps: tuple[Step, ...]
    refusal: str = ""
    """Set: the configured path cannot serve this version at all; the fetch fails with this, trying nothing."""

    @property
    def to_try(self) -> tuple[str, ...]:
        return tuple(s.path for s in self.steps if not s.why_not)

    def step(self, path: str) -> Step:
        return next(s for s in self.steps if s.path == path)


def _ipc_step(m: Manifest, facts: FetchFacts, path: str) -> Step:
    if path not in ("auto", CUDA_IPC):
        return Step(CUDA_IPC, f"the weight path is {path!r}")
    if not m.buckets or total_bytes(m) == 0:
        return Step(CUDA_IPC, "the version has no bytes")
    if m.cuda_ipc is None:
        # on auto nothing to explain: the publisher offers a device buffer once a subscriber on its host said it sees the GPU
        if path == CUDA_IPC:
            return Step(CUDA_IPC, "the publisher offers no device buffer for this version", counted=True)
        return Step(CUDA_IPC, "the publisher offers no device buffer for this version")
    if not m.host_key or m.host_key != facts.host_key:
        return Step(CUDA_IPC, "the publisher's GPU buffer is on another host", counted=True)
    if m.cuda_ipc.device_uuid not in facts.gpu_uuids:
        return Step(CUDA_IPC, "the publisher's GPU is not visible to this process", counted=True)
    if any(b.ipc_offset < 0 for b in m.buckets):
        return Step(CUDA_IPC, "a bucket is missing from the publisher's device buffer", counted=True)
    return Step(CUDA_IPC)


def _shm_reason(m: Manifest, facts: FetchFacts) -> str:
    """Why shared memory cannot serve `m` here ("" : it can)."""
    if not m.host_key or not all(b.shm_segment for b in m.buckets):
        return "the publisher offers no shared memory for this version"
    if m.host_key != facts.host_key:
        return "the publisher is on another host (or another /dev/shm)"
    return ""


def bulk_step(m: Manifest, facts: FetchFacts, config: WeightPathConfig) -> Step:
    """Whether the network path takes the server's bulk lane for `m` (never a counted reason: the ROUTER serves alike)."""
    if not m.bulk_port:
        return Step(BULK, "the server offers no bulk lane (CURVE, not TCP, or switched off there)")
    if facts.lane_host is None:
        return Step(BULK, "the ROUTER endpoint is not TCP")
    if not config.weight_bulk:
        return Step(BULK, "the bulk lane is switched off here")
    if (facts.lane_host, m.bulk_port) in facts.unreachable_lanes:
        return Step(BULK, "the bulk lane could not be reached before")
    return Step(BULK)


def plan(manifest: Manifest, facts: FetchFacts, config: WeightPathConfig) -> Plan:
    """The paths to try for `manifest`, in order, and why each other one was passed over (module docstring)."""
    path = config.weight_path
    ipc = _ipc_step(manifest, facts, path)
    empty = not manifest.buckets or total_bytes(manifest) == 0
    refusal = ""
    if path == NETWORK:
        shm = Step(SHM, "the weight path is 'network'")
    elif empty:
        shm = Step(SHM, "the version has no bytes")
    else:
        why = _shm_reason(manifest, facts)
        if why and path == SHM:
            refusal = f"weight path 'shm': {why}"
        shm = Step(SHM, why, counted=bool(why))
    if not facts.stage_device:
        shm_device = Step(SHM_DEVICE, "the engine does not stage to a GPU")
    elif path not in ("auto", SHM):
        shm_device = Step(SHM_DEVICE, f"the weight path is {path!r}")
    else:
        # the reasons against shared memory are the CPU path's to report (once, at its step)
        shm_device = Step(SHM_DEVICE, shm.why_not)
    if path == SHM:
        network = Step(NETWORK, "the weight path is 'shm'")
        bulk = Step(BULK, "the weight path is 'shm'")
    else:
        network = Step(NETWORK)
        bulk = bulk_step(manifest, facts, config)
    return Plan(steps=(ipc, shm_device, shm, bulk, network), refusal=refusal)


def delta_plan(manifest: Manifest, facts: FetchFacts, config: WeightPathConfig) -> Plan:
    """Where a delta manifest's encoded bytes are read (the rebuild is the same whichever): `SHM` (the publisher's
    segment, `Manifest.delta_shm`), `BULK` (where `bulk_step` takes the lane and the server's lane serves deltas: minor
    `DELTA_PATHS_MINOR`) or `NETWORK` (the ROUTER), in that order, each to try or passed over with the reason. Passing shared memory over is never a counted fallback here (a
    relay or an older publisher offers none, and the network serves the same bytes); under ``shm`` a delta that is not
    in shared memory on this host is a refusal (the caller then fetches the full version, which shared memory serves)."""
    path = config.weight_path
    refusal = ""
    if path == NETWORK:
        shm = Step(SHM, "the weight path is 'network'")
    elif manifest.delta_shm is None or not manifest.host_key:
        shm = Step(SHM, "the publisher offers no shared memory for this delta")
    elif manifest.host_key != facts.host_key:
        shm = Step(SHM, "the publisher is on another host (or another /dev/shm)")
    else:
        shm = Step(SHM)
    if path == SHM:
        refusal = f"weight path 'shm': {shm.why_not}" if shm.why_not else ""
        network = Step(NETWORK, "the weight path is 'shm'")
        bulk = Step(BULK, "the weight path is 'shm'")
    else:
        network = Step(NETWORK)
        bulk = bulk_step(manifest, facts, config)
        if not bulk.why_not and manifest.protocol_minor < DELTA_PATHS_MINOR:
            bulk = Step(BULK, f"the server's bulk lane serves no deltas (minor {manifest.protocol_minor} < {DELTA_PATHS_MINOR})")
    return Plan(steps=(shm, bulk, network), refusal=refusal)


def stream_jobs(sizes: list[int], chunk_bytes: int, streams: int) -> tuple[list[tuple[int, list[tuple[int, int]]]], list[int], list[bool]]:
    """The bulk lane's jobs for a version of buckets of `sizes`: ``(jobs, parts per bucket, folded per bucket)``.

    A job is (bucket, its chunks as (offset, nbytes)), in bucket order, for `streams` threads to take one by one. A
    bucket with at least `streams` times its bytes left from its start to the version's end is one job (fetched and
    checksummed in order, in cache: "folded"); nearer the end a bucket is cut into about streams * its bytes / bytes
    left jobs (the last one into `streams`), so the streams finish together. Taken in order from one queue, the
    streams work on the buckets a streamed publish makes ready first (contiguous spans per stream, the first design,
    left the later streams waiting for their first bucket: up to a whole snapshot's copy, 0.28 s on the H200). Empty
    buckets get no job."""
    left = sum(sizes)
    k = max(1, streams)
    jobs: list[tuple[int, list[tuple[int, int]]]] = []
    parts = [0] * len(sizes)
    folded = [True] * len(sizes)
    for i, n in enumerate(sizes):
        if n == 0:
            continue
        chunks = [(off, min(chunk_bytes, n - off)) for off in range(0, n, chunk_bytes)]
        pieces = 1 if left >= k * n else min(len(chunks), -(-k * n // left))
        per = -(-len(chunks) // pieces)
        cut = [chunks[j : j + per] for j in range(0, len(chunks), per)]
        jobs.extend((i, part) for part in cut)
        parts[i] = len(cut)
        folded[i] = len(cut) == 1
        left -= n
    return jobs, parts, folded


# --------------------------------------------------------------------------- the publisher's GPU budget


RING_CHECKSUM_PART_BYTES = 16 << 20
"""A same-GPU ring slot's checksum is summed in parts of this size (`rollpool.weights.paths.ipc_ring.parted_mix64`)."""


def ring_scratch_bytes(slot_bytes: int) -> int:
    """GPU bytes a same-GPU ring needs beside its slots to checksum one: two temporaries of one part and the cached word
    indices of one part (rounded up to a power of two), where a part is `RING_CHECKSUM_PART_BYTES` or the whole slot
    when smaller. Counted in the budget with the slots, so the budget bounds what the ring really allocates."""
    if slot_bytes <= 0:
        return 0
    part = min(RING_CHECKSUM_PART_BYTES, slot_bytes)
    words = -(-part // 8)
    return 2 * part + 8 * (1 << (words - 1).bit_length())


def gpu_budget_bytes(config: WeightPathConfig, bucket_bytes: int) -> int:
    """The publisher's GPU budget: `config.publisher_gpu_budget_bytes`, or, when it is None, two buckets and what the
    same-GPU ring needs beside two bucket-sized slots to checksum them (`ring_scratch_bytes`: 48 MiB beside 512 MiB
    buckets)."""
    if config.publisher_gpu_budget_bytes is not None:
        return config.publisher_gpu_budget_bytes
    return 2 * bucket_bytes + ring_scratch_bytes(bucket_bytes)


class GpuBudget:
    """The GPU memory a publisher may allocate on the trainer's GPU, shared by every user of it there (the same-GPU
    path's arenas; a delta encoding on the GPU draws from the same budget). Pure bookkeeping of bytes allocated and
    given back; thread-safe enough for one publisher's loop and its threads (ints under the GIL, one writer at a time).

    `why_not(nbytes)` is "" when `nbytes` more fit, else the reason (said in the log and `path_note`)."""

    def __init__(self, budget: int) -> None:
        if budget < 0:
            raise ValueError(f"a GPU budget must be >= 0, got {budget}")
        self.budget = budget
        self.used = 0
        """Bytes allocated against the budget and not given back (held or kept for reuse)."""
        self.peak = 0

    def free_bytes(self) -> int:
        """Bytes of the budget not allocated."""
        return max(0, self.budget - self.used)

    def why_not(self, nbytes: int, what: str = "a device buffer") -> str:
        if nbytes <= self.free_bytes():
            return ""
        return (f"{what} of {_fmt(nbytes)} would pass the publisher's GPU budget ({_fmt(self.used)} of {_fmt(self.budget)} "
                f"in use; publisher_gpu_budget_bytes)")

    def take(self, nbytes: int, what: str = "a device buffer") -> None:
        """Count `nbytes` allocated; ValueError (with the reason) when they do not fit."""
        why = self.why_not(nbytes, what)
        if why:
            raise ValueError(why)
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def give(self, nbytes: int) -> None:
        """`nbytes` freed (the caller dropped its buffer)."""
        self.used = max(0, self.used - nbytes)


def _fmt(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"
