"""Delta versions rebuilt where the engine loads from (`rollpool.weights.delta_gpu`), over real sockets and shared memory.

The engine's GPU is stood in for by CPU tensors: the subscriber is given a CPU `DeviceHeld` (test-only: a worker gets a
CUDA one when its engine stages to CUDA), so the same staging, in-place rebuild and mix64 checks run. The publisher makes
its deltas "on the device" (`rollpool.weights.delta_device` on these CPU tensors, as tests/integration/weights/
test_delta.py does), so its network versions carry the mix64 of every bucket's bytes too (minor 27)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from rollpool.protocol import RESULT_MIX64_MINOR  # noqa: E402
from rollpool.weights.delta_gpu import DeviceHeld  # noqa: E402

from .delta_models import model as _model  # noqa: E402
from .delta_models import published as _published  # noqa: E402
from .delta_models import same as _same  # noqa: E402
from .delta_models import step as _step  # noqa: E402

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("deltas_made_on_the_device")]


def _on_gpu(sub: Any) -> DeviceHeld:
    """The subscriber holds versions on its "GPU" (CPU tensors here; test-only)."""
    held = DeviceHeld("cpu")
    sub.delta.device = held
    return held


def _views_of(tensors: dict[str, torch.Tensor], held: DeviceHeld) -> bool:
    assert held.slab is not None
    lo, hi = held.slab.data_ptr(), held.slab.data_ptr() + int(held.slab.numel())
    return all(lo <= t.data_ptr() < hi for t in tensors.values())


async def test_versions_are_staged_once_then_rebuilt_in_place_on_the_device_bit_for_bit(make_publisher: Any, make_subscriber: Any,
                                                                                         sub_path: str) -> None:
    # over the network from a publisher that keeps no shared memory: the mix64 of each bucket's bytes comes with the
    # deltas made (minor 27); on shm it comes with every shared-memory version (minor 10)
    pub = await make_publisher(path=sub_path)
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint, path=sub_path)
    held = _on_gpu(sub)
    handed: dict[int, dict[str, torch.Tensor]] = {}
    model = _model()
    await _published(pub, model, 1)
    served = await sub.fetch(1, on_bucket=lambda i, t: handed.__setitem__(i, t))
    # a full version: fetched into host buffers, staged to the device as each bucket verified; the engine gets the
    # device's tensors, and the device holds the version as the next delta's base
    assert _same(served.tensors, model) and _views_of(served.tensors, held) and held.holds(pub.publisher_id, 1)
    assert all(_views_of(t, held) for t in handed.values()) and len(handed) == len(served.manifest.buckets)
    slab = held.slab
    for version in (2, 3, 4):
        model = _step(model, version)
        await _published(pub, model, version)
        handed.clear()
        wv = await sub.fetch(version, on_bucket=lambda i, t: handed.__setitem__(i, t))
        assert wv.manifest.delta_base == version - 1 and all(b.host_mix64 for b in wv.manifest.buckets)
        assert _same(wv.tensors, model) and _views_of(wv.tensors, held) and held.slab is slab  # in place: no second copy
        assert len(handed) == len(wv.manifest.buckets) and all(_views_of(t, held) for t in handed.values())
        assert held.holds(pub.publisher_id, version) and wv.intact
        assert not served.intact  # the version before was written over: never given to an engine again
        assert sub.delta.base is None  # no host buffer is a base now: the host copy holds an older version
        assert sub.delta.base_version() == version
        sub.recycle(served)
        served = wv
    assert sub.delta_device_versions == 3 and sub.delta_versions == 3 and sub.delta_fallbacks == 0
    assert held.slab is slab


async def test_a_device_base_that_is_not_what_the_worker_thought_ends_in_the_full_version_staged_whole(
        make_publisher: Any, make_subscriber: Any, sub_path: str) -> None:
    pub = await make_publisher()
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint, path=sub_path)
    held = _on_gpu(sub)
    m1 = _model()
    await _published(pub, m1, 1)
    v1 = await sub.fetch(1)
    m2 = _step(m1, 2)
    await _published(pub, m2, 2)
    v2 = await sub.fetch(2)
    assert sub.delta_device_versions == 1 and _same(v2.tensors, m2)
    sub.recycle(v1)
    held.views[1][::97] ^= 0x10  # the device base is not version 2 any more (something wrote it)
    m3 = _step(m2, 3)
    await _published(pub, m3, 3)
    v3 = await sub.fetch(3)
    # the rebuild's check on the device refused it: the base dropped, the version fetched whole and staged afresh
    assert _same(v3.tensors, m3) and v3.manifest.delta_base == -1
    assert sub.delta_fallbacks == 1 and sub.delta_device_versions == 1 and held.holds(pub.publisher_id, 3)
    assert not v2.intact
    sub.recycle(v2)
    m4 = _step(m3, 4)
    await _published(pub, m4, 4)
    v4 = await sub.fetch(4)  # the next delta is rebuilt on the device again
    assert _same(v4.tensors, m4) and sub.delta_device_versions == 2 and sub.delta_fallbacks == 1


async def test_a_publisher_of_the_previous_minor_sends_no_result_checksum_and_the_delta_is_rebuilt_on_the_host(
        make_publisher: Any, make_subscriber: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server of `RESULT_MIX64_MINOR - 1` puts no mix64 on its network versions: a worker holding the base on its GPU
    rebuilds each delta on the host, as before (and lets the GPU copy go); nothing is lost and no wrong tensor comes."""
    from rollpool.weights import serving, snapshot

    monkeypatch.setattr(serving, "PROTOCOL_MINOR", RESULT_MIX64_MINOR - 1)
    monkeypatch.setattr(snapshot.Snapshot, "mix_for_deltas", lambda self, wanted=True: False)  # what the older server does not compute
    pub = await make_publisher(path="network")
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint)
    held = _on_gpu(sub)
    model = _model()
    await _published(pub, model, 1)
    served = await sub.fetch(1)
    assert held.holds(pub.publisher_id, 1) and sub.delta.base is not None  # the host copy is a base too
    for version in (2, 3):
        model = _step(model, version)
        await _published(pub, model, version)
        wv = await sub.fetch(version)
        assert wv.manifest.delta_base == version - 1 and not any(b.host_mix64 for b in wv.manifest.buckets)
        assert _same(wv.tensors, model) and wv.held is None and not wv.tensors["norm"].data_ptr() == 0
        assert "mix64" in sub.delta.why_not_device or "holds version" in sub.delta.why_not_device
        sub.recycle(served)
        served = wv
    assert sub.delta_versions == 2 and sub.delta_device_versions == 0 and sub.delta_fallbacks == 0
    assert held.slab is None  # let go: the host rebuilt the version, the engine stages it itself


async def test_a_device_path_takes_the_held_buffers_and_a_delta_then_finds_no_base(make_publisher: Any, make_subscriber: Any) -> None:
    """When the GPU's copy is let go (a device path fetches the next version into a slab of its own), no host buffer
    stands in for it: the next delta is refused here and the version comes whole, never from an older host copy."""
    pub = await make_publisher()
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint)
    held = _on_gpu(sub)
    model = _model()
    await _published(pub, model, 1)
    v1 = await sub.fetch(1)
    model = _step(model, 2)
    await _published(pub, model, 2)
    v2 = await sub.fetch(2)
    assert sub.delta_device_versions == 1 and sub.delta.base is None
    sub.recycle(v1)
    sub.delta.release_device(sub.buffers.slabs)  # as before a same-GPU or staged shared-memory fetch
    assert not v2.intact and sub.delta.base_version() == -1
    model = _step(model, 3)
    await _published(pub, model, 3)
    v3 = await sub.fetch(3)
    assert _same(v3.tensors, model) and v3.manifest.delta_base == -1 and held.holds(pub.publisher_id, 3)


async def test_a_version_the_shared_memory_path_staged_on_the_device_is_the_base_of_the_next_delta(make_publisher: Any,
                                                                                                   make_subscriber: Any, sub_path: str) -> None:
    """The staged shared-memory path copies a whole version to the engine's device and verifies it there (`FakeDevice`:
    CPU tensors); the subscriber holds that copy as the base, in the same buffers, and the next delta (its encoded bytes
    in the publisher's shared memory) is rebuilt there in place."""
    if sub_path != "shm":
        pytest.skip("the staged shared-memory path only")
    from .test_shm_device import FakeDevice

    pub = await make_publisher()
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint, path="auto")
    sub.stage_device = "fake:0"
    sub.device_ops = FakeDevice
    held = _on_gpu(sub)
    model = _model()
    await _published(pub, model, 1)
    v1 = await sub.fetch(1)
    assert _same(v1.tensors, model) and sub.device_stage_bytes > 0 and held.holds(pub.publisher_id, 1) and v1.slab is held.slab
    slab = held.slab
    model = _step(model, 2)
    await _published(pub, model, 2)
    v2 = await sub.fetch(2)
    assert _same(v2.tensors, model) and v2.manifest.delta_base == 1 and sub.delta_device_versions == 1 and held.slab is slab
    sub.recycle(v1)  # the held buffers are not given back by the recycle of the version they held before
    assert held.slab is slab and held.holds(pub.publisher_id, 2)


async def test_a_worker_that_skipped_a_version_gets_it_whole_staged_into_the_same_device_buffers(make_publisher: Any,
                                                                                                 make_subscriber: Any) -> None:
    pub = await make_publisher(path="network")
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint)
    held = _on_gpu(sub)
    model = _model()
    await _published(pub, model, 1)
    v1 = await sub.fetch(1)
    slab = held.slab
    for version in (2, 3):  # the worker skips version 2: its request names base 1, the server's delta of 3 is against 2
        model = _step(model, version)
        await _published(pub, model, version)
    v3 = await sub.fetch(3)
    assert _same(v3.tensors, model) and v3.manifest.delta_base == -1 and sub.delta_fallbacks == 0
    assert held.slab is slab and held.holds(pub.publisher_id, 3) and not v1.intact


class _RecordingSim:
    """The sim engine (no model), keeping a copy of the bytes each update gave it (fake of the engine edge)."""

    @staticmethod
    def make() -> Any:
        from tests.integration.reliability.conftest import sim_engine

        engine = sim_engine()
        got: dict[int, dict[str, torch.Tensor]] = {}
        update = engine.update_weights

        async def update_weights(named: Any, version: int) -> None:
            got[version] = {k: t.clone() for k, t in named.items()}
            await update(named, version)

        engine.update_weights = update_weights  # type: ignore[method-assign]
        engine.got = got  # type: ignore[attr-defined]
        return engine


@pytest.mark.timeout(60)
async def test_a_worker_applies_every_version_from_the_buffers_its_gpu_holds(zmq_ctx: Any, tmp_path: Any, sub_path: str,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the worker's one apply path (a real broker and trainer client, real sockets): the subscriber it makes
    holds versions on the "GPU" (a CPU `DeviceHeld`, test-only), the engine is given the held buffers' tensors, and
    every version it applied is the trainer's bit for bit, the later ones rebuilt there from deltas."""
    from rollpool.weights.subscriber import WeightSubscriber
    from tests.integration.reliability.conftest import Pool, wait_until

    monkeypatch.setenv("ROLLPOOL_WEIGHT_PATH", sub_path)  # the trainer client's publisher and the worker alike
    made: list[WeightSubscriber] = []

    def on_gpu(sockets: Any, **kw: Any) -> WeightSubscriber:
        sub = WeightSubscriber(sockets, **kw)
        sub.delta.device = DeviceHeld("cpu")  # test-only: CPU tensors stand in for the engine's GPU
        made.append(sub)
        return sub

    pool = Pool(zmq_ctx, tmp_path)
    try:
        broker = await pool.start_broker()
        client = await pool.client(broker.client_endpoint, keep_versions=2)
        engines: list[Any] = []
        worker = await pool.worker(broker.worker_endpoint, "w-gpu", engine_factory=lambda: engines.append(_RecordingSim.make()) or engines[-1],
                                   subscriber_factory=on_gpu)
        model = _model()
        published = {}
        for version in (1, 2, 3, 4):
            model = _step(model, version) if version > 1 else model
            published[version] = {k: t.clone() for k, t in model.items()}
            await client.publish_weights(model, version)
            assert await wait_until(lambda v=version: worker.weights.version >= v, 30), f"serves {worker.weights.version}"
        engine = engines[-1]
        assert sorted(engine.got) == [1, 2, 3, 4]
        for version, want in published.items():
            assert _same(engine.got[version], want), version
        sub = made[-1]
        assert sub.delta_device_versions == 3 and sub.delta_fallbacks == 0 and sub.last_path == sub_path
    finally:
        await pool.close()


async def test_a_failed_gpu_rebuild_lets_its_buffers_go_only_once_no_bucket_is_being_patched(make_subscriber: Any) -> None:
    """The full version that follows a failed rebuild is staged into the same buffers: they are let go only once the
    bucket the GPU thread may still be patching is done, so it can never write over the staged version."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from rollpool.protocol.messages import BucketInfo

    sub = make_subscriber()
    held = _on_gpu(sub)
    held.begin([BucketInfo(index=0, dtype="uint8", nbytes=1024, checksum="")])
    held.done("p", 3, held.buckets)
    slab = held.slab
    gate = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        patching = pool.submit(lambda: (gate.wait(5), (True, 0.0, 0.0))[1])
        queued = pool.submit(lambda: (True, 0.0, 0.0))
        abandon = asyncio.ensure_future(sub.delta._abandon_device([patching, queued]))
        await asyncio.sleep(0.05)
        assert not abandon.done() and held.slab is slab and not held.holds("p", 3)  # waits for the bucket being patched
        gate.set()
        await asyncio.wait_for(abandon, 5)
    assert queued.cancelled() and held.slab is None and sub.buffers.slabs.fits(1024, "cpu")  # back for the next version
