"""Which subscriber the worker makes: a staging device only for an engine that stages bucket by bucket on CUDA."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from rollpool.workers.config import WorkerConfig
from rollpool.workers.weight_sync import WeightSync


class FakeEngine:
    """Fake of the engine edge: only `info().device` and, where given, a `stage_bucket` hook."""

    def __init__(self, device: str, stages: bool) -> None:
        self.device = device
        if stages:
            self.stage_bucket = lambda version, tensors: None

    def info(self) -> Any:
        return SimpleNamespace(device=self.device)


def made_with(engine: FakeEngine, factory: Any) -> dict[str, Any]:
    sync = WeightSync.__new__(WeightSync)  # the factory call alone: no link, no sockets
    sync.config = WorkerConfig(broker="tcp://127.0.0.1:1", worker_id="w1")
    sync.sockets = None  # type: ignore[assignment]
    sync.worker_id = "w1"
    sync.supervisor = SimpleNamespace(engine=engine)  # type: ignore[assignment]
    sync._subscriber_factory = factory
    return sync._make_subscriber()  # type: ignore[return-value]


def recording(sockets: Any, *, worker_id: str, fetch_timeout_s: float, window_chunks: int, max_refetch: int,
              pin_memory: bool = False, stage_device: str | None = None) -> dict[str, Any]:
    return {"pin_memory": pin_memory, "stage_device": stage_device}


def without_stage_device(sockets: Any, *, worker_id: str, fetch_timeout_s: float, window_chunks: int, max_refetch: int,
                         pin_memory: bool = False) -> dict[str, Any]:
    return {"pin_memory": pin_memory}


def test_a_cuda_engine_that_stages_by_bucket_gets_a_staging_subscriber(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLPOOL_WEIGHT_SHM_TO_DEVICE", raising=False)  # the default
    assert made_with(FakeEngine("cuda:0", stages=True), recording) == {"pin_memory": True, "stage_device": "cuda:0"}


def test_no_staging_device_off_cuda_without_the_hook_or_for_an_older_factory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLPOOL_WEIGHT_SHM_TO_DEVICE", raising=False)
    assert made_with(FakeEngine("cpu", stages=True), recording) == {"pin_memory": False, "stage_device": None}
    assert made_with(FakeEngine("cuda", stages=False), recording) == {"pin_memory": True, "stage_device": None}
    assert made_with(FakeEngine("cuda", stages=True), without_stage_device) == {"pin_memory": True}


def test_the_staging_subscriber_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLPOOL_WEIGHT_SHM_TO_DEVICE", "0")
    assert made_with(FakeEngine("cuda:0", stages=True), recording) == {"pin_memory": True, "stage_device": None}
