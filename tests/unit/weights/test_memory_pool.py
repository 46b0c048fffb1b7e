"""Host buffer pool: large page-locked buffers registered piece by piece; the ZeroMQ I/O threads of a fetching process."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")

from rollpool.weights.config import weight_io_threads


def test_a_large_page_locked_host_buffer_is_registered_piece_by_piece_and_unregistered_when_dropped(monkeypatch: Any) -> None:
    """The CUDA edge faked (no GPU here): `_cuda_register` / `_cuda_unregister_ptr` record the pieces."""
    from rollpool.weights import memory

    registered: dict[int, int] = {}
    monkeypatch.setattr(memory.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(memory, "_cuda_register", lambda t, flags=0: registered.setdefault(t.data_ptr(), t.numel()) > 0)
    monkeypatch.setattr(memory, "_cuda_unregister_ptr", lambda ptr: registered.pop(ptr))
    pool = memory.BufferPool(kind="host", pin=True)
    pool.register_from_bytes, pool.register_piece_bytes = 1 << 20, 256 << 10
    (buf,) = pool.reserve([(1 << 20) + 1000])
    base = buf.data_ptr()
    assert sorted(registered) == [base + i * (256 << 10) for i in range(5)]  # 4 whole pieces and the tail
    assert sum(registered.values()) == buf.numel() and pool.pinned_bytes == buf.numel()
    pool.trim(0)  # dropped: every piece unregistered before the memory can be freed
    assert registered == {} and pool.pinned_bytes == 0


def test_a_fetching_process_gets_one_io_thread_per_weight_stream(monkeypatch: Any) -> None:
    monkeypatch.setenv("ROLLPOOL_WEIGHT_STREAMS", "8")
    assert weight_io_threads() == 8 and weight_io_threads(3) == 3
    monkeypatch.delenv("ROLLPOOL_WEIGHT_STREAMS")
    assert 1 <= weight_io_threads() <= 4
