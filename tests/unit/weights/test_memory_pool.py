"""The ZeroMQ I/O threads of a process that fetches weights over several streams."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")

from rollpool.weights.config import weight_io_threads


def test_a_fetching_process_gets_one_io_thread_per_weight_stream(monkeypatch: Any) -> None:
    monkeypatch.setenv("ROLLPOOL_WEIGHT_STREAMS", "8")
    assert weight_io_threads() == 8 and weight_io_threads(3) == 3
    monkeypatch.delenv("ROLLPOOL_WEIGHT_STREAMS")
    assert 1 <= weight_io_threads() <= 4


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
