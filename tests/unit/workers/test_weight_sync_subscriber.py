"""Which subscriber the worker makes (a staging device only for an engine that stages bucket by bucket on CUDA; the
weight-path flags), and the page-locked buffers it reserves at engine start."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import zmq.asyncio

from rollpool.protocol.sockets import SocketFactory
from rollpool.weights.config import WeightPathConfig
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


def made_with(engine: FakeEngine, factory: Any, config: WorkerConfig | None = None) -> dict[str, Any]:
    sync = WeightSync.__new__(WeightSync)  # the factory call alone: no link, no sockets
    sync.config = config or WorkerConfig(broker="tcp://127.0.0.1:1", worker_id="w1")
    sync.sockets = None  # type: ignore[assignment]
    sync.worker_id = "w1"
    sync.supervisor = SimpleNamespace(engine=engine)  # type: ignore[assignment]
    sync._subscriber_factory = factory
    return sync._make_subscriber()  # type: ignore[return-value]


def recording(sockets: Any, *, worker_id: str, fetch_timeout_s: float, window_chunks: int, max_refetch: int,
              pin_memory: bool, stage_device: str | None, weights: WeightPathConfig) -> dict[str, Any]:
    return {"pin_memory": pin_memory, "stage_device": stage_device}


def test_a_cuda_engine_that_stages_by_bucket_gets_a_staging_subscriber(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLPOOL_WEIGHT_SHM_TO_DEVICE", raising=False)  # the default
    assert made_with(FakeEngine("cuda:0", stages=True), recording) == {"pin_memory": True, "stage_device": "cuda:0"}


def test_no_staging_device_off_cuda_or_without_the_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLPOOL_WEIGHT_SHM_TO_DEVICE", raising=False)
    assert made_with(FakeEngine("cpu", stages=True), recording) == {"pin_memory": False, "stage_device": None}
    assert made_with(FakeEngine("cuda", stages=False), recording) == {"pin_memory": True, "stage_device": None}


def test_the_staging_subscriber_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLPOOL_WEIGHT_SHM_TO_DEVICE", "0")  # read once, when the worker's config is made
    assert made_with(FakeEngine("cuda:0", stages=True), recording) == {"pin_memory": True, "stage_device": None}
    monkeypatch.delenv("ROLLPOOL_WEIGHT_SHM_TO_DEVICE")
    off = worker_config("--no-weight-shm-to-device")
    assert off.weights.weight_shm_to_device is False
    assert made_with(FakeEngine("cuda:0", stages=True), recording, off) == {"pin_memory": True, "stage_device": None}


# -- the weight-path flags and the reserve at engine start (config and CLI; the first version lands in buffers made
# before it)


def worker_config(*argv: str) -> WorkerConfig:
    import argparse

    from rollpool.cli.worker import add_arguments
    from rollpool.protocol.config import load_config

    p = argparse.ArgumentParser()
    add_arguments(p)
    return load_config(WorkerConfig, p.parse_args(["--broker", "tcp://127.0.0.1:1", "--worker-id", "w1", *argv]), section="worker")


def sync_for(engine: Any, config: WorkerConfig, sockets: Any = None) -> WeightSync:
    sync = WeightSync.__new__(WeightSync)  # the subscriber side alone: no broker link
    sync.config = config
    sync.sockets = sockets
    sync.worker_id = config.worker_id
    sync.supervisor = SimpleNamespace(engine=engine)  # type: ignore[assignment]
    sync._subscriber_factory = None
    sync.subscriber = None
    sync._endpoints = (None, None)
    return sync


class SizedFakeEngine(FakeEngine):
    """Fake of the engine edge that also says how many bytes one weight version of it takes."""

    def __init__(self, device: str, nbytes: int) -> None:
        super().__init__(device, stages=False)
        self.nbytes = nbytes

    def weight_bytes(self) -> int:
        return self.nbytes

    # the rest of the Engine protocol, so `isinstance(e, SizedEngine)` holds as it does for the real engines
    async def start(self) -> None: ...
    async def generate(self, *a: Any, **k: Any) -> Any: ...
    async def abort(self, request_id: str) -> None: ...
    async def pause(self, mode: str) -> None: ...
    async def resume(self) -> None: ...
    async def update_weights(self, named_tensors: Any, version: int) -> None: ...
    async def release_memory(self, tags: Any = ()) -> None: ...
    async def resume_memory(self, tags: Any = ()) -> None: ...
    async def flush_cache(self) -> None: ...
    async def stop(self) -> None: ...


def test_the_worker_flags_choose_the_path_streams_and_budget_of_its_real_subscriber(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")  # a real subscriber
    for var in ("ROLLPOOL_WEIGHT_PATH", "ROLLPOOL_WEIGHT_STREAMS", "ROLLPOOL_PINNED_BUDGET_BYTES"):
        monkeypatch.delenv(var, raising=False)
    config = worker_config("--weight-path", "network", "--weight-streams", "3", "--pinned-budget-bytes", "4096")
    sub = sync_for(FakeEngine("cpu", stages=False), config)._make_subscriber()
    try:
        assert (sub.path, sub.streams, sub.pinned_budget_bytes) == ("network", 3, 4096)  # type: ignore[attr-defined]
    finally:
        sub.close()
    # the same three through the environment, as the relay takes them
    monkeypatch.setenv("ROLLPOOL_WEIGHT_PATH", "shm")
    monkeypatch.setenv("ROLLPOOL_WEIGHT_STREAMS", "2")
    sub = sync_for(FakeEngine("cpu", stages=False), worker_config())._make_subscriber()
    try:
        assert (sub.path, sub.streams, sub.pinned_budget_bytes) == ("shm", 2, None)  # type: ignore[attr-defined]
    finally:
        sub.close()
    with pytest.raises(Exception, match="weight_path"):
        worker_config("--weight-path", "carrier-pigeon")


async def test_an_engine_on_a_gpu_has_its_buffers_reserved_at_start_before_any_version(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")  # a real subscriber
    monkeypatch.delenv("ROLLPOOL_WEIGHT_RESERVE_BYTES", raising=False)
    ctx = zmq.asyncio.Context()
    sync = sync_for(SizedFakeEngine("cuda:0", 3 << 20), worker_config(), SocketFactory(ctx))
    sync._subscriber_ready = asyncio.Event()
    sync.engine_started()
    sub: Any = sync.subscriber
    assert sub is not None, "no subscriber made at engine start"
    try:
        assert not sub.connected  # no publisher named yet: nothing fetched, only the buffers
        await sub.buffers.reserved()  # the reserve runs in a thread (page-locking takes seconds per GB on a GPU host)
        assert sub.buffers_allocated == 2  # two versions (WorkerConfig.weight_reserve_versions)
        assert sorted(sub.buffers.pool.free_sizes()) == [3 << 20, 3 << 20]
        # the broker then names the publisher: the same subscriber connects (real sockets), no second one is made
        sync.note_weights(-1, "tcp://127.0.0.1:9", None)
        assert sync.subscriber is sub and sub.connected
    finally:
        sub.close()
        ctx.destroy(linger=0)


def test_no_reserve_on_the_cpu_when_asked_not_to_or_when_the_engine_does_not_know_its_size() -> None:
    for engine, config in ((SizedFakeEngine("cpu", 1 << 20), worker_config()),
                           (SizedFakeEngine("cuda", 1 << 20), worker_config("--weight-reserve-versions", "0")),
                           (FakeEngine("cuda", stages=True), worker_config())):
        sync = sync_for(engine, config)
        sync.engine_started()
        assert sync.subscriber is None


def test_with_deltas_on_the_gpu_a_cuda_engine_gets_a_subscriber_that_holds_versions_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """`weight_delta_on_device` (on by default with deltas): the staging device is given even with the shared-memory
    staging off, since the GPU keeps the version applied as the next delta's base; off, as before."""
    monkeypatch.setenv("ROLLPOOL_WEIGHT_SHM_TO_DEVICE", "0")
    monkeypatch.setenv("ROLLPOOL_WEIGHT_DELTA", "1")
    assert made_with(FakeEngine("cuda:0", stages=True), recording)["stage_device"] == "cuda:0"
    assert made_with(FakeEngine("cpu", stages=True), recording)["stage_device"] is None
    monkeypatch.setenv("ROLLPOOL_WEIGHT_DELTA_ON_DEVICE", "0")
    assert made_with(FakeEngine("cuda:0", stages=True), recording)["stage_device"] is None


async def test_a_version_whose_gpu_buffers_hold_a_newer_one_is_never_given_to_an_engine() -> None:
    """A version held on the GPU is written over in place by the next one (staged or rebuilt there): a restarted engine
    is not given it again (it serves its checkpoint as version -1 until the next version), an intact one is; and the
    serving engine is never given such a version either."""
    from rollpool.protocol.errors import WeightSyncError
    from rollpool.protocol.metrics import MemoryMetricsSink
    from rollpool.workers.engines.sim import SimEngine
    from rollpool.workers.weight_sync import _Version

    finished: list[int | None] = []
    served = [5]
    sup = SimpleNamespace(reapply=None, engine=None, ok=asyncio.Event())
    sync = WeightSync(WorkerConfig(broker="tcp://127.0.0.1:1", worker_id="w1"), None, None, sup, MemoryMetricsSink(),  # type: ignore[arg-type]
                      served_version=lambda: served[0], on_apply_finished=finished.append)
    engine = SimEngine()
    await engine.start()
    try:
        sync._served = _Version({}, 5, fetched=SimpleNamespace(version=5, tensors={}, intact=False))
        await sync._reapply(engine)
        assert finished == [-1] and engine.info().weight_version != 5 and sync._served is None
        sync._served = _Version({}, 5, fetched=SimpleNamespace(version=5, tensors={}, intact=True))
        await sync._reapply(engine)
        assert finished[-1] == 5 and engine.info().weight_version == 5
        sup.engine = engine
        sup.ok.set()
        with pytest.raises(WeightSyncError, match="newer version"):
            await sync.apply({}, 6, fetched=SimpleNamespace(version=6, tensors={}, intact=False))  # type: ignore[arg-type]
        assert engine.info().weight_version == 5
    finally:
        await engine.stop()
