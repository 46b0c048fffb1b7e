"""How many weight streams (and ZeroMQ I/O threads) a fetching process uses, and the buffer pool's page-locked budget."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")

from rollpool.weights.config import weight_streams


def test_a_fetching_process_gets_one_io_thread_per_weight_stream(monkeypatch: Any) -> None:
    monkeypatch.setenv("ROLLPOOL_WEIGHT_STREAMS", "8")
    assert weight_streams() == 8 and weight_streams(3) == 3
    monkeypatch.setenv("ROLLPOOL_WEIGHT_STREAMS", "eight")
    with pytest.raises(ValueError, match="ROLLPOOL_WEIGHT_STREAMS must be an integer"):
        weight_streams()
    with pytest.raises(ValueError, match=r"streams must be in \[1, 16\]"):
        weight_streams(17)
    monkeypatch.delenv("ROLLPOOL_WEIGHT_STREAMS")
    assert 1 <= weight_streams() <= 4


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
