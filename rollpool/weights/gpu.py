"""The same-GPU weight path (CUDA IPC): export, open and checksum device buffers.

The publisher snapshots the trainer's CUDA tensors device-to-device into an arena (one device buffer per
version, `keep_versions` of them, allocated once and reused), exports each arena once with torch's storage
sharing (`export_buffer`: the pieces of ``UntypedStorage._share_cuda_`` as a `CudaIpcBuffer` record, raw
bytes and numbers, never pickled) and checksums each bucket on the GPU (`mix64_checksum`). A subscriber on
the same host that sees the same GPU (by UUID: `device_uuids`) opens the arena (`open_buffer`), copies each
bucket device-to-device into its own reserved device buffer, and verifies the checksum on its copy, the
bytes the engine loads.

``mix64``: the bucket's bytes as little-endian 64-bit words w_i (the tail zero-padded), summed modulo 2^64
after mixing each with its index: ``v = (w_i + i) * C1; v ^= v >> 29 (logical); v *= C2``; the digest is
``mix64:<16 hex>`` of the sum. Word order does not matter to a sum modulo 2^64, so the GPU's reduction order
does not change it; mixing in the index catches moved words, and any single changed word changes the sum
(the multipliers are odd, so the mix is a bijection). It catches corruption on the way, like xxh3; it is
no defence against tampering (CURVE keeps that out). On CUDA one fused pass (`rollpool.weights.mix64_kernel`, a
Triton kernel, compared with the torch ops before its first sum on each device: `self_check`) where it runs, else torch ops in slices of
`MIX64_SLICE_WORDS` to bound temporaries; on the CPU one compiled pass (`rollpool.weights.mix64_native`) where it
builds, else numpy (`_mix64_cpu`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from rollpool.protocol.messages import CudaIpcBuffer
from rollpool.weights import mix64_kernel, mix64_native

__all__ = [
    "MIX64",
    "MIX64_CPU_SLICE_WORDS",
    "MIX64_SLICE_WORDS",
    "ARENA_ALIGN",
    "DeviceSlabs",
    "arena_offsets",
    "device_uuids",
    "export_buffer",
    "mix64_checksum",
    "mix64_format",
    "mix64_partial",
    "mix64_reference",
    "open_buffer",
    "self_check",
    "side_stream",
    "warm_up",
    "warm_up_host_in_background",
    "warm_up_in_background",
]

MIX64 = "mix64"
MIX64_SLICE_WORDS = 8 * 1024 * 1024
"""Words per slice on a GPU (64 MiB): the temporaries of one slice are 2 x 64 MiB."""
MIX64_CPU_SLICE_WORDS = 128 * 1024
"""Words per slice on the CPU (1 MiB): a slice's temporaries stay in the cache across the sum's passes (numpy, one
thread: 5 GB/s on the 2-core box against 0.6 for torch on 64 MiB slices; a trainer publishing 14.5 GB from CPU
tensors over the staged shared-memory path waits for these sums). Smaller slices are faster on one thread (256 KiB:
1.3x on the 2-core box) but take the GIL four times as often, and the publisher sums 8 buckets at once: numpy's small
operations did not scale over two threads on that box (`bench/cpu_mix64.py`); not changed without a many-core run."""
ARENA_ALIGN = 256
"""Every bucket starts at a multiple of this in an arena (so a bucket viewed as int64 words is aligned)."""

_log = logging.getLogger(__name__)
_C1 = 0x9E3779B97F4A7C15
_C2 = 0xBF58476D1CE4E5B9
_MASK64 = (1 << 64) - 1
_SHIFT = 29


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_C1S, _C2S = _signed(_C1), _signed(_C2)
_LOW_MASK = (1 << (64 - _SHIFT)) - 1  # the logical shift: arithmetic shift, then the sign bits cleared
_index_cache: dict[tuple[str, int], torch.Tensor] = {}
_index_lock = threading.Lock()
_checked: set[str] = set()
"""Devices whose fused mix64 has been compared with the torch ops (`self_check`, before the first sum there)."""
_check_lock = threading.Lock()


def _indices(device: torch.device, n: int) -> torch.Tensor:
    """The first `n` word indices on `device` (cached by the next power of two: a few index tensors per device)."""
    size = min(MIX64_SLICE_WORDS, 1 << max(0, n - 1).bit_length()) if n <= MIX64_SLICE_WORDS else n
    return _index_tensor(device, size)[:n]


def _index_tensor(device: torch.device, n: int) -> torch.Tensor:
    key = (str(device), n)
    with _index_lock:
        t = _index_cache.get(key)
        if t is None:
            t = _index_cache[key] = torch.arange(n, dtype=torch.int64, device=device)
        return t


def mix64_checksum(data: torch.Tensor, *, stream: Any = None) -> str:
    """``mix64:<hex>`` of a 1-D uint8 tensor's bytes (CPU or CUDA; on CUDA on `stream` or the current one).

    The tensor must start at an 8-byte aligned address for its word view (an arena bucket does)."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError("mix64_checksum takes a 1-D uint8 tensor")
    if data.is_cuda and stream is not None:
        with torch.cuda.stream(stream):
            return _mix64(data)
    return _mix64(data)


def _mix64(data: torch.Tensor) -> str:
    return mix64_format(int(mix64_partial(data, 0).item()))


def mix64_partial(data: torch.Tensor, base_word: int = 0) -> torch.Tensor:
    """The mix64 sum (an int64 scalar on `data`'s device, not synchronised) of a 1-D uint8 tensor whose first byte is
    word `base_word` of a bucket (its byte offset / 8). The tail is zero-padded, so the parts of a bucket add up
    (modulo 2^64) to the bucket's sum when every part starts at a multiple of 8 bytes and only the last part has a
    tail (`mix64_format` of the total is the digest). On the current stream."""
    n = int(data.numel())
    words = n // 8
    if not data.is_cuda:
        total = _mix64_cpu(data, base_word)
        return torch.tensor(total - (1 << 64) if total >= 1 << 63 else total, dtype=torch.int64)
    acc = _fused(data[: words * 8], base_word) if words else None
    if acc is None:
        acc = torch.zeros((), dtype=torch.int64, device=data.device)
        w = data[: words * 8].view(torch.int64)
        idx = _indices(data.device, min(words, MIX64_SLICE_WORDS))
        for start in range(0, words, MIX64_SLICE_WORDS):
            x = w[start : start + MIX64_SLICE_WORDS]
            acc += _mix_sum(x, idx[: x.numel()], base_word + start)
    tail = n - words * 8
    if tail:
        pad = torch.zeros(8, dtype=torch.uint8, device=data.device)
        pad[:tail] = data[words * 8 :]
        acc += _mix_sum(pad.view(torch.int64), _indices(data.device, 1), base_word + words)
    return acc


def _fused(data: torch.Tensor, base_word: int) -> torch.Tensor | None:
    """The words' sum by the fused kernel, or None where it is off (then, for good, after a failure here)."""
    if not mix64_kernel.enabled():
        return None
    key = str(data.device)
    if key not in _checked:  # the first sum on a device: the kernel compared with the torch ops there first
        with _check_lock:
            if key not in _checked:
                self_check(data.device)
                _checked.add(key)
        if not mix64_kernel.enabled():
            return None
    try:
        return mix64_kernel.mix64_words(data.view(torch.int64), base_word)
    except Exception as e:  # noqa: BLE001 - a kernel that does not build or launch on this device
        mix64_kernel.switch_off(f"{type(e).__name__}: {e}")
        return None


def _mix64_cpu(data: torch.Tensor, base_word: int) -> int:
    """`mix64_partial` of a CPU tensor, as an unsigned int: one compiled pass with the GIL released where it builds
    (`rollpool.weights.mix64_native`; the publisher's checksum threads then sum side by side), else `_mix64_numpy`."""
    import numpy as np

    arr = data.numpy()
    if not (arr.flags.c_contiguous and mix64_native.enabled()):
        return _mix64_numpy(arr, base_word)
    n = int(arr.size)
    words = n // 8
    total = mix64_native.mix_words(arr, words, base_word) if words else 0
    if n > words * 8:  # the tail, zero-padded to a word
        pad = np.zeros(8, dtype=np.uint8)
        pad[: n - words * 8] = arr[words * 8 :]
        total += mix64_native.mix_words(pad, 1, base_word + words)
    return (total * _C2) & _MASK64  # x C2 once on the sum: multiplying is distributive modulo 2^64


def _mix64_numpy(arr: Any, base_word: int) -> int:
    """The same sum of a uint8 numpy array in numpy, on cache-sized slices with temporaries made once per call (one
    thread each, the GIL taken in and out of every operation: on the H100 host 1.2 GB/s a checksum thread)."""
    import numpy as np

    n = int(arr.size)
    words = n // 8
    step = max(1, min(MIX64_SLICE_WORDS, MIX64_CPU_SLICE_WORDS))
    room = max(1, min(words, step))
    idx = np.arange(room, dtype=np.uint64)
    v = np.empty(room, dtype=np.uint64)
    t = np.empty(room, dtype=np.uint64)

    def mix(x: Any, base: int) -> int:  # the slice's words, the first one's index in the bucket; the sum before x C2
        vv, tt = v[: x.size], t[: x.size]
        np.add(x, idx[: x.size], out=vv)
        vv += np.uint64(base & _MASK64)
        vv *= np.uint64(_C1)
        np.right_shift(vv, np.uint64(_SHIFT), out=tt)
        vv ^= tt
        return int(vv.sum(dtype=np.uint64))

    total = 0
    with np.errstate(over="ignore"):
        w = arr[: words * 8].view("<u8")
        for start in range(0, words, step):
            total += mix(w[start : start + step], base_word + start)
        if n > words * 8:  # the tail, zero-padded to a word
            pad = np.zeros(8, dtype=np.uint8)
            pad[: n - words * 8] = arr[words * 8 :]
            total += mix(pad.view("<u8"), base_word + words)
    # the last step, x C2, taken once for the whole sum: multiplying is distributive modulo 2^64 (one pass of six saved)
    return (total * _C2) & _MASK64


def mix64_format(total: int) -> str:
    """The digest of a mix64 sum (`mix64_partial`'s value, or several parts' added)."""
    return f"{MIX64}:{total & _MASK64:016x}"


def _mix_sum(x: torch.Tensor, idx: torch.Tensor, base: int) -> torch.Tensor:
    v = x + idx
    if base:
        v.add_(base)
    v.mul_(_C1S)
    t = torch.bitwise_right_shift(v, _SHIFT)
    t.bitwise_and_(_LOW_MASK)
    v.bitwise_xor_(t)
    del t
    v.mul_(_C2S)
    return v.sum()


def mix64_reference(data: bytes) -> str:
    """The same digest in numpy (unsigned arithmetic), the specification the torch version is tested against."""
    import numpy as np

    buf = bytes(data) + b"\0" * (-len(data) % 8)
    w = np.frombuffer(buf, dtype="<u8")
    with np.errstate(over="ignore"):
        v = (w + np.arange(len(w), dtype=np.uint64)) * np.uint64(_C1)
        v ^= v >> np.uint64(_SHIFT)
        v *= np.uint64(_C2)
        total = int(v.sum(dtype=np.uint64)) if len(v) else 0
    return f"{MIX64}:{total & _MASK64:016x}"


_streams: dict[str, Any] = {}


def side_stream(device: torch.device | str) -> Any:
    """One side stream per device for the whole process. The caching allocator keeps freed blocks per stream, so
    temporaries made on a fresh stream every version would not be reused (torch recycles a pool of 32 streams: up to
    32 versions' worth of cached memory)."""
    key = str(torch.device(device))
    with _index_lock:
        s = _streams.get(key)
        if s is None:
            s = _streams[key] = torch.cuda.Stream(device=torch.device(device))  # type: ignore[no-untyped-call]
        return s


_warmed: set[str] = set()


def warm_up(device: torch.device | str) -> None:
    """Run the checksum and a device copy once on a small buffer of `device` (on its side stream), so the first
    version does not pay the kernels' first load and the index and stream set-up (call it in a thread)."""
    key = str(torch.device(device))
    if key in _warmed:
        return
    _warmed.add(key)
    stream = side_stream(device)
    with torch.cuda.stream(stream):
        buf = torch.zeros(1 << 20, dtype=torch.uint8, device=device)
        torch.empty_like(buf).copy_(buf, non_blocking=True)
        mix64_checksum(buf)  # (the fused kernel built and checked on this device, `_fused`)
        _indices(buf.device, MIX64_SLICE_WORDS)  # the index of a full slice, made once
    stream.synchronize()


def warm_up_in_background(device: torch.device | str) -> None:
    """`warm_up` in a thread of its own (a failure logged at debug: the first version then pays the kernels' load);
    nothing where it ran already."""
    if str(torch.device(device)) in _warmed:
        return

    def warm() -> None:
        try:
            warm_up(device)
        except Exception:  # noqa: BLE001 - only the first version's time is at stake
            _log.debug("warming the checksum kernels up on %s failed", device, exc_info=True)

    threading.Thread(target=warm, name="weights-gpu-warm", daemon=True).start()


def warm_up_host_in_background() -> None:
    """The compiled CPU mix64 built and checked (`mix64_native`: a compiler's run the first time on a machine) in a
    thread of its own, so a publisher's first version of CPU tensors does not wait for it; nothing after the first call."""
    if _host_warmed.is_set():
        return
    _host_warmed.set()
    threading.Thread(target=mix64_native.enabled, name="weights-mix64-build", daemon=True).start()


_host_warmed = threading.Event()


def self_check(device: torch.device) -> bool:
    """Compare the fused kernel (`rollpool.weights.mix64_kernel`) with the torch path on random bytes of `device` (at a
    word offset, as a bucket's middle) and switch the kernel off if they differ: every side of a version must
    compute the same function, or every version would fail its checks. True when the kernel is on after the check."""
    if not mix64_kernel.enabled():
        return False
    data = torch.randint(0, 256, (3 << 17,), dtype=torch.uint8, device=device)  # 48 Ki words: 6 programs
    plain = int(_mix_sum(data.view(torch.int64), _indices(data.device, data.numel() // 8), 12345).item())
    try:
        fused = int(mix64_kernel.mix64_words(data.view(torch.int64), 12345).item())
    except Exception as e:  # noqa: BLE001 - a kernel that does not build or launch on this device
        mix64_kernel.switch_off(f"{type(e).__name__}: {e}")
        return False
    if fused != plain:
        mix64_kernel.switch_off(f"its sum differs from the torch path's on {device} ({fused} != {plain})")
        return False
    return True


def arena_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """(each bucket's offset in an arena, the arena's size): buckets in order, each aligned to `ARENA_ALIGN`."""
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += (n + ARENA_ALIGN - 1) // ARENA_ALIGN * ARENA_ALIGN
    return offsets, max(pos, ARENA_ALIGN)


def device_uuids() -> dict[str, int]:
    """The UUID of every GPU this process sees -> its device index here (empty without CUDA)."""
    if not torch.cuda.is_available():
        return {}
    out: dict[str, int] = {}
    for i in range(torch.cuda.device_count()):
        try:
            out[str(torch.cuda.get_device_properties(i).uuid)] = i
        except (AttributeError, RuntimeError):  # an old torch without .uuid: the path is not offered
            continue
    return out


def export_buffer(buf: torch.Tensor) -> CudaIpcBuffer:
    """Export a CUDA buffer's storage once (`_share_cuda_`; calling it again would re-wrap the storage)."""
    if not buf.is_cuda:
        raise ValueError("export_buffer needs a CUDA tensor")
    uuid = str(torch.cuda.get_device_properties(buf.device).uuid)
    storage = buf.untyped_storage()
    (_device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = storage._share_cuda_()  # type: ignore[no-untyped-call]
    return CudaIpcBuffer(device_uuid=uuid, handle=bytes(handle), storage_bytes=int(size), storage_offset=int(offset),
                         ref_counter_handle=bytes(ref_handle), ref_counter_offset=int(ref_offset),
                         event_handle=bytes(event_handle or b""), event_sync_required=bool(event_sync))


def open_buffer(info: CudaIpcBuffer, device_index: int) -> torch.Tensor:
    """Open an exported buffer in this process: a 1-D uint8 CUDA tensor over its storage (another process only;
    CUDA refuses to open a handle in the process that made it)."""
    with torch.cuda.device(device_index):
        storage = torch.UntypedStorage._new_shared_cuda(
            device_index, info.handle, info.storage_bytes, info.storage_offset, info.ref_counter_handle,
            info.ref_counter_offset, info.event_handle, info.event_sync_required)
        return torch.empty(0, dtype=torch.uint8, device=f"cuda:{device_index}").set_(storage)


class DeviceSlabs:
    """Reused device buffers (a subscriber's versions, a publisher's arenas): taken, given back, never freed per version."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self.allocations = 0
        self._lock = threading.Lock()

    def take_at_least(self, nbytes: int, device: torch.device | str) -> torch.Tensor:
        with self._lock:
            fits = [i for i, t in enumerate(self._free) if t.numel() >= nbytes and t.device == torch.device(device)]
            if fits:
                best = min(fits, key=lambda i: self._free[i].numel())
                return self._free.pop(best)
        self.allocations += 1
        return torch.empty(max(nbytes, ARENA_ALIGN), dtype=torch.uint8, device=device)

    def fits(self, nbytes: int, device: torch.device | str) -> bool:
        """Whether `take_at_least(nbytes, device)` would reuse a free slab (allocate nothing)."""
        with self._lock:
            return any(t.numel() >= nbytes and t.device == torch.device(device) for t in self._free)

    def give(self, slab: torch.Tensor) -> None:
        with self._lock:
            if all(s is not slab for s in self._free):
                self._free.append(slab)

    def trim(self, keep: int) -> None:
        with self._lock:
            while len(self._free) > keep:
                self._free.pop(0)

    @property
    def free_bytes(self) -> int:
        return sum(int(t.numel()) for t in self._free)
