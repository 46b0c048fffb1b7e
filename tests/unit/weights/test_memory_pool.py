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
