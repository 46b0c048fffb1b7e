"""How many weight streams (and ZeroMQ I/O threads) a fetching process uses, and the buffer pool's page-locked budget."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")

from rollpool.protocol.errors import ConfigError
from rollpool.weights.config import WeightPathConfig


def test_a_fetching_process_gets_one_io_thread_per_weight_stream() -> None:
    assert WeightPathConfig.from_env({"ROLLPOOL_WEIGHT_STREAMS": "8"}).streams == 8
    assert WeightPathConfig(weight_streams=3).streams == 3
    with pytest.raises(ConfigError, match="ROLLPOOL_WEIGHT_STREAMS: cannot parse 'eight'"):
        WeightPathConfig.from_env({"ROLLPOOL_WEIGHT_STREAMS": "eight"})
    with pytest.raises(ConfigError, match=r"weight_streams must be in \[0, 16\]"):
        WeightPathConfig(weight_streams=17)
    assert 1 <= WeightPathConfig.from_env({}).streams <= 4


def test_a_dropped_registered_segment_gives_its_bytes_back_to_the_pinned_budget(monkeypatch: Any) -> None:
    """A page-locked shared-memory segment the pool drops no longer counts against `pinned_budget_bytes`, so a later
    buffer within the budget is page-locked again (the pool counted a dropped segment as pinned for ever)."""
    from rollpool.weights import memory

    # the CUDA edge faked (this CPU build has none): registration succeeds, unregistration does nothing
    monkeypatch.setattr(memory.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(memory, "_cuda_register", lambda t, flags=0: True)
    monkeypatch.setattr(memory, "_cuda_unregister", lambda t: None)
    pool = memory.BufferPool(kind="shm", pin=True, pinned_budget_bytes=3 << 20, pool="test", owner_id="budget")
    try:
        a = pool.take(2 << 20)
        assert pool.pinned_bytes == 2 << 20
        pool.give([a])
        pool.trim(0)
        assert pool.pinned_bytes == 0
        pool.take(2 << 20)
        assert pool.pinned_bytes == 2 << 20 and pool.unpinned_over_budget == 0
    finally:
        pool.close()


def test_dropping_page_locked_host_buffers_empties_torchs_pinned_cache(monkeypatch: Any) -> None:
    """Host buffers page-locked by torch's allocator go back to the system when the pool drops them: torch keeps freed
    pinned blocks cached for reuse, so a dropped version (`trim_spares` after a path switch) freed nothing until its
    cache is emptied (at 8B a version's 14.5 GB stayed beside the next path's segments). Dropping unpinned buffers does
    not touch the cache."""
    from rollpool.weights import memory

    emptied: list[int] = []
    # the CUDA edge faked (this CPU build has none): CUDA initialised, every host buffer page-locked, the cache observed
    monkeypatch.setattr(memory.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(memory.torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(memory.torch.Tensor, "is_pinned", lambda self, *a: True)
    monkeypatch.setattr(memory.torch._C, "_host_emptyCache", lambda: emptied.append(1), raising=False)
    monkeypatch.setattr(memory.torch._C, "_accelerator_emptyHostCache", lambda: emptied.append(1), raising=False)
    monkeypatch.setattr(memory.torch, "accelerator", None, raising=False)
    pool = memory.BufferPool(kind="host", pin=False, pool="test", owner_id="pinned-cache")
    try:
        bufs = [memory.torch.empty(1 << 20, dtype=memory.torch.uint8) for _ in range(2)]
        pool.drop(bufs, background=False)
        assert emptied == [1] and bufs == []
        monkeypatch.setattr(memory.torch.Tensor, "is_pinned", lambda self, *a: False)
        pool.drop([memory.torch.empty(1 << 20, dtype=memory.torch.uint8)], background=False)
        assert emptied == [1]
    finally:
        pool.close()


def test_the_shared_memory_reaper_is_reaped_at_a_normal_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite ended with `ResourceWarning: subprocess ... is still running`: the reaper child outlived its handle."""
    from rollpool.weights import memory

    reaper = memory._Reaper()  # a reaper of this test's own, as the module's is at exit
    monkeypatch.setattr(memory, "_reaper", reaper)
    monkeypatch.setattr(memory, "_live", {})
    monkeypatch.setattr(memory, "_owner", memory._Owner())  # this process's own owner lock stays held
    reaper.track("rollpool-exit-check", True)
    reaper.track("rollpool-exit-check", False)
    proc = reaper._proc
    assert proc is not None and proc.poll() is None
    memory._unlink_all()  # what atexit runs
    assert proc.poll() == 0  # the reaper exited and was reaped, not left running


def test_a_subscriber_reserves_one_version_on_its_device_and_two_on_the_host() -> None:
    """At 8B on one 80 GB card the worker held two reserved device slabs (2 x 14.5 GB, idle on the network path) beside
    the engine's staging copy, and its own next allocation ran out of memory: one device slab is reserved, a second is
    made only while two versions are on the device at once."""
    from rollpool.weights import memory
    from rollpool.weights.gpu import DeviceSlabs

    slabs = DeviceSlabs()
    buffers = memory.VersionBuffers(pin=False, pinned_budget_bytes=None, slabs=slabs)
    try:
        assert buffers.reserve(1 << 20, 2, "cpu") == 2 << 20
        assert slabs.allocations == 1
        assert sorted(buffers.pool.free_sizes()) == [1 << 20, 1 << 20]
        first = slabs.take_at_least(1 << 20, "cpu")
        assert slabs.allocations == 1  # the reserved one
        slabs.take_at_least(1 << 20, "cpu")  # a second version on the device at once: made on demand
        assert slabs.allocations == 2 and first.numel() >= 1 << 20
    finally:
        buffers.pool.close()


def test_a_buffer_being_made_in_one_thread_does_not_hold_up_another_taking_and_giving(monkeypatch: Any) -> None:
    """The publisher's spare delta segment is made and touched in a thread while the event loop gives segments back and
    the delta writer takes one: the pool's lists are locked, but making a buffer (a segment of a gigabyte: tenths of a
    second) happens outside that lock, and what the others take and give is not lost."""
    import threading

    import torch

    from rollpool.weights import memory

    pool = memory.BufferPool()
    pool.give([torch.zeros(64, dtype=torch.uint8), torch.zeros(128, dtype=torch.uint8)])
    entered, release = threading.Event(), threading.Event()
    real_empty = torch.empty

    def slow_empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        if threading.current_thread().name == "maker":
            entered.set()
            assert release.wait(10)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(memory.torch, "empty", slow_empty)
    maker = threading.Thread(target=pool.reserve, args=([256],), name="maker")
    maker.start()
    try:
        assert entered.wait(10)
        # the maker is inside its allocation: the others go on at once
        got = pool.take_at_least(100)
        assert int(got.numel()) == 128 and pool.free_sizes() == [64]
        pool.give([got])
        pool.trim(128)  # (drops the largest first: only 64 stays)
        assert pool.free_sizes() == [64]
    finally:
        release.set()
        maker.join(10)
    assert sorted(pool.free_sizes()) == [64, 256] and pool.allocations == 1
