"""The publisher's GPU budget (`GpuBudget`, `gpu_budget_bytes`) and its use by the same-GPU path's arenas: a device
buffer that would pass it is not made, and the reason is said."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")  # the Python 3.12 unit job has no torch

from rollpool.protocol.errors import ConfigError  # noqa: E402 - after the skip
from rollpool.weights.config import WeightPathConfig  # noqa: E402 - after the skip
from rollpool.weights.manifest import GpuBudget, gpu_budget_bytes, ring_scratch_bytes  # noqa: E402 - after the skip
from rollpool.weights.paths.cuda_ipc import IpcArenas  # noqa: E402 - after the skip
from rollpool.weights.publisher import WeightPublisher  # noqa: E402 - after the skip


def test_default_budget_is_two_buckets_and_their_checksum_scratch_and_the_field_is_checked() -> None:
    # two bucket-sized ring slots and what checksumming one takes (two 16 MiB temporaries and 16 MiB of word indices):
    # the ring's GPU bytes, all of them, fit the default (on an H100 its checksum temporaries once passed a budget of
    # the slots alone)
    assert ring_scratch_bytes(512 << 20) == 48 << 20
    assert gpu_budget_bytes(WeightPathConfig(), 512 << 20) == (1 << 30) + (48 << 20)
    # a slot under one part: its checksum's temporaries are of the slot, its indices of the next power of two of words
    assert ring_scratch_bytes(256 << 10) == 3 * (256 << 10) and ring_scratch_bytes(1000) == 2 * 1000 + 8 * 128
    assert ring_scratch_bytes(0) == 0
    assert gpu_budget_bytes(WeightPathConfig(publisher_gpu_budget_bytes=0), 512 << 20) == 0
    with pytest.raises(ConfigError, match="publisher_gpu_budget_bytes"):
        WeightPathConfig(publisher_gpu_budget_bytes=-1)
    cfg = WeightPathConfig.from_env({"ROLLPOOL_PUBLISHER_GPU_BUDGET_BYTES": "123"})
    assert cfg.publisher_gpu_budget_bytes == 123


def test_budget_bookkeeping_and_reasons() -> None:
    b = GpuBudget(1 << 30)
    assert b.free_bytes() == 1 << 30 and b.why_not(1 << 30) == ""
    b.take(600 << 20)
    assert b.free_bytes() == (1 << 30) - (600 << 20)
    why = b.why_not(600 << 20, "a whole-version same-GPU arena")
    assert "a whole-version same-GPU arena of 600.0 MiB would pass the publisher's GPU budget" in why
    with pytest.raises(ValueError, match="publisher_gpu_budget_bytes"):
        b.take(600 << 20)
    b.give(600 << 20)
    assert b.free_bytes() == 1 << 30 and b.peak == 600 << 20


@dataclasses.dataclass(frozen=True)
class _Bucket:
    """A bucket record's fields the arenas read and rewrite (a stand-in for `BucketInfo`)."""

    index: int
    nbytes: int
    ipc_offset: int = 0


class _Served:
    """A served version's fields the arenas read and write (a stand-in for `ServedVersion`)."""

    def __init__(self, version: int, sizes: list[int]) -> None:
        self.version = version
        self.buckets = tuple(_Bucket(i, n) for i, n in enumerate(sizes))
        self.cuda_ipc: object = None


def test_an_arena_past_the_budget_is_not_made_and_says_why() -> None:
    """On the CPU the arena is a CPU tensor (the device edge): the budget decision is the same code the GPU runs."""
    arenas = IpcArenas("p", "h", "cuda_ipc", GpuBudget(2 << 20))
    got = arenas.begin(_Served(1, [3 << 20]), [], torch.device("cpu"))  # type: ignore[arg-type]
    assert got is None and "would pass the publisher's GPU budget" in arenas.why_not
    assert arenas.budget.used == 0 and arenas.slabs.allocations == 0 and not arenas.broken


def test_the_publisher_offers_no_device_buffer_for_cpu_tensors_and_says_why() -> None:
    pub = WeightPublisher(None, keep_versions=1, bucket_bytes=1 << 20, path="cuda_ipc",  # type: ignore[arg-type]
                          weights=WeightPathConfig(publisher_gpu_budget_bytes=5 << 20))
    try:
        assert pub.gpu_budget.budget == 5 << 20 and pub.stats["gpu_budget_bytes"] == 5 << 20
        assert pub._ipc.device_for([("w", torch.zeros(4))]) is None
        assert pub._ipc.why_not == "the tensors are on the CPU"
    finally:
        pub._pools.shutdown()



def test_arenas_within_the_budget_are_made_counted_and_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget of two versions' arenas: versions 1 and 2 get one each (counted), version 3 would need a third and is
    refused with the reason, and once version 1 is released version 3 reuses its arena (nothing more counted). The
    export is faked at the device edge (a CPU tensor cannot be shared by CUDA IPC)."""
    import rollpool.weights.paths.cuda_ipc as cuda_ipc
    from rollpool.protocol.messages import CudaIpcBuffer

    def fake_export(buf: torch.Tensor) -> CudaIpcBuffer:  # the device edge, faked
        return CudaIpcBuffer(device_uuid="GPU-fake", handle=bytes(64), storage_bytes=int(buf.numel()))

    monkeypatch.setattr(cuda_ipc, "export_buffer", fake_export)
    arenas = IpcArenas("p", "h", "cuda_ipc", GpuBudget(2 << 20))

    def begin(v: int) -> object:
        return arenas.begin(_Served(v, [1 << 20]), [], torch.device("cpu"))  # type: ignore[arg-type]

    assert begin(1) is not None and arenas.budget.used == 1 << 20
    assert begin(2) is not None and arenas.budget.used == 2 << 20
    assert begin(3) is None and "would pass the publisher's GPU budget" in arenas.why_not
    arenas.release(1)
    assert begin(3) is not None and arenas.why_not == ""
    assert arenas.budget.used == 2 << 20 and arenas.slabs.allocations == 2 and not arenas.broken
    arenas.close()
    assert arenas.budget.used == 0 and arenas.budget.free_bytes() == 2 << 20  # every arena given back at close
