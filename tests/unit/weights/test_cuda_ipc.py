"""The same-GPU path's pieces that run on CPU: the GPU checksum (torch ops, the same on CPU), the handle record on
the wire (raw bytes, never pickled; a minor-8 peer's manifest reads as "no device buffer"). The path choice is
tested in test_manifest.py."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import msgpack
import pytest

torch = pytest.importorskip("torch")

from rollpool.protocol import PROTOCOL_MINOR, decode, encode  # noqa: E402
from rollpool.protocol.messages import BucketInfo, CudaIpcBuffer, Manifest, ManifestRequest, TensorInfo  # noqa: E402
from rollpool.weights import gpu as cuda_ipc  # noqa: E402
from rollpool.weights.gpu import arena_offsets, mix64_checksum, mix64_reference  # noqa: E402


def _u8(data: bytes) -> Any:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4096, 4099, 100_003])
def test_mix64_in_torch_matches_its_numpy_specification(n: int, monkeypatch: Any) -> None:
    monkeypatch.setattr(cuda_ipc, "MIX64_SLICE_WORDS", 1000)  # several slices, and a partial last one
    data = os.urandom(n)
    assert mix64_checksum(_u8(data)) == mix64_reference(data)
    assert mix64_reference(data).startswith("mix64:") and len(mix64_reference(data)) == len("mix64:") + 16


def test_mix64_on_the_cpu_in_its_own_slices_matches_the_specification() -> None:
    """CPU tensors are summed in slices of `MIX64_CPU_SLICE_WORDS` (cache-sized), CUDA ones in `MIX64_SLICE_WORDS`:
    the digest is the same whatever the slicing."""
    from rollpool.weights import gpu

    data = os.urandom(gpu.MIX64_CPU_SLICE_WORDS * 8 * 2 + 8 * 1000 + 5)  # two full slices, a partial one, a tail
    assert gpu.MIX64_CPU_SLICE_WORDS < gpu.MIX64_SLICE_WORDS
    assert mix64_checksum(_u8(data)) == mix64_reference(data)


def test_mix64_parts_of_a_cpu_bucket_add_up_to_its_digest() -> None:
    from rollpool.weights import gpu

    data = os.urandom(gpu.MIX64_CPU_SLICE_WORDS * 8 + 4096 + 3)
    cut = gpu.MIX64_CPU_SLICE_WORDS * 8 - 64  # every part but the last starts and ends on a word
    whole = _u8(data)
    parts = int(gpu.mix64_partial(whole[:cut], 0).item()) + int(gpu.mix64_partial(whole[cut:], cut // 8).item())
    assert gpu.mix64_format(parts) == mix64_reference(data)


def test_mix64_catches_a_flipped_bit_and_swapped_words() -> None:
    data = bytearray(os.urandom(64 * 1024))
    base = mix64_checksum(_u8(bytes(data)))
    flipped = bytearray(data)
    flipped[12345] ^= 0x01
    assert mix64_checksum(_u8(bytes(flipped))) != base
    swapped = bytearray(data)
    swapped[0:8], swapped[8:16] = data[8:16], data[0:8]
    assert bytes(swapped) != bytes(data) and mix64_checksum(_u8(bytes(swapped))) != base
    tail = bytearray(data) + b"\x01"
    assert mix64_checksum(_u8(bytes(tail))) != mix64_checksum(_u8(bytes(data) + b"\x02"))


def test_arena_offsets_align_every_bucket() -> None:
    offsets, total = arena_offsets([10, 256, 300, 0, 8])
    assert offsets == [0, 256, 512, 1024, 1024] and total == 1280
    assert all(o % cuda_ipc.ARENA_ALIGN == 0 for o in offsets)


def _ipc_manifest(**kw: Any) -> Manifest:
    handle = bytes(range(64))
    fields: dict[str, Any] = {
        "request_id": "m", "version": 3, "publisher_id": "pub", "host_key": "boot/shm", "pool": "p",
        "cuda_ipc": CudaIpcBuffer(device_uuid="GPU-a", handle=handle, storage_bytes=4096, storage_offset=512,
                                  ref_counter_handle=b"/torch_1_2", ref_counter_offset=1, event_handle=bytes(64), event_sync_required=True),
        "buckets": (BucketInfo(index=0, dtype="float32", nbytes=32, checksum="", ipc_offset=0, ipc_checksum="mix64:00000000000000ff",
                               tensors=(TensorInfo(name="w", dtype="float32", shape=(8,), offset=0, nbytes=32),)),),
    }
    fields.update(kw)
    return Manifest(**fields)


def test_the_handle_travels_as_raw_bytes_and_round_trips() -> None:
    m = _ipc_manifest()
    frames = encode(m)
    header = msgpack.unpackb(bytes(frames[0]), raw=False)
    assert header[1] == PROTOCOL_MINOR >= 9
    ipc = header[3]["cuda_ipc"]
    assert isinstance(ipc["handle"], bytes) and ipc["handle"] == bytes(range(64))  # msgpack bin: the bytes themselves
    back = decode(frames)
    assert back == m and isinstance(back.cuda_ipc.handle, bytes)
    req = decode(encode(ManifestRequest(request_id="r", version=3, streamed=True, host_key="boot/shm", gpu_uuids=("GPU-a",), wait_ipc=True)))
    assert req.gpu_uuids == ("GPU-a",) and req.wait_ipc


def test_a_minor8_manifest_reads_as_no_device_buffer() -> None:
    fields = {"request_id": "m", "version": 3, "buckets": [{"index": 0, "dtype": "float32", "nbytes": 32, "checksum": "crc32:00000000"}]}
    old = decode([msgpack.packb([1, 8, "manifest", fields], use_bin_type=True)])
    assert old.cuda_ipc is None and old.buckets[0].ipc_offset == -1 and old.buckets[0].ipc_checksum == ""
    req = decode([msgpack.packb([1, 8, "manifest_request", {"request_id": "r", "streamed": True}], use_bin_type=True)])
    assert req.gpu_uuids == () and not req.wait_ipc


def test_a_minor9_manifest_reads_as_no_host_mix64() -> None:
    """A publisher of minor 9 sends no `host_mix64`: a staging subscriber reads "none" (and falls back, counted)."""
    bucket = {"index": 0, "dtype": "float32", "nbytes": 32, "checksum": "xxh3_64:0000000000000000", "shm_segment": "rollpool-p-x-1-1"}
    old = decode([msgpack.packb([1, 9, "manifest", {"request_id": "m", "version": 3, "host_key": "boot/shm", "buckets": [bucket]}],
                                use_bin_type=True)])
    assert old.buckets[0].host_mix64 == "" and old.buckets[0].shm_segment == "rollpool-p-x-1-1"
    new = decode(encode(replace(old, buckets=(replace(old.buckets[0], host_mix64="mix64:0123456789abcdef"),))))
    assert new.buckets[0].host_mix64 == "mix64:0123456789abcdef"


def test_parts_of_a_bucket_add_up_to_its_mix64() -> None:
    """The publisher sums a bucket tensor by tensor (each at its word offset, the last one with a tail)."""
    from rollpool.weights.gpu import mix64_format, mix64_partial
    from rollpool.weights.snapshot import word_aligned as _word_aligned

    data = torch.randint(0, 256, (4096 + 24 + 13,), dtype=torch.uint8)
    cuts = [0, 4096, 4096 + 24, data.numel()]
    total = sum(int(mix64_partial(data[a:b].clone(), a // 8).item()) for a, b in zip(cuts, cuts[1:], strict=False))
    assert mix64_format(total) == mix64_reference(bytes(data.numpy())) == mix64_checksum(data)
    t = [TensorInfo(name=str(i), dtype="uint8", shape=(b - a,), offset=a, nbytes=b - a) for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False))]
    assert _word_aligned(t)
    assert not _word_aligned([TensorInfo(name="a", dtype="uint8", shape=(13,), offset=0, nbytes=13), t[1]])  # a tail mid-bucket
    assert not _word_aligned([TensorInfo(name="a", dtype="uint8", shape=(8,), offset=4, nbytes=8)])
