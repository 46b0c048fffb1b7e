"""A worker whose sglang engine serves LoRA adapter versions (the sim child and its `SimLora` fake), against a
scripted broker: an adapter version is applied without pausing generation, so a running sample is neither aborted
nor resubmitted and finishes on the version it started on, while the next task runs on the adapter. The same for the
hf engine, and without an apply slot where the broker says an adapter version needs none (`Feature.ADAPTER_NO_GRANT`)."""

from __future__ import annotations

import asyncio
import json
import pathlib
import types
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("aiohttp")

from rollpool.protocol import ADAPTER_GRANT_MINOR, ADAPTER_ON_MINOR, BASE_ON_MINOR, PROTOCOL_MINOR, decode
from rollpool.protocol.messages import (
    FEATURES,
    ApplyDone,
    ApplyGrant,
    ApplyRequest,
    Credit,
    Feature,
    Manifest,
    Result,
    WorkerHeartbeat,
)
from rollpool.workers.engines.sglang.engine import SGLangEngine
from tests.unit.workers.conftest import SIM_SERVER_ARGS
from tests.unit.workers.test_sglang_lora import _adapter

from .test_worker import fake_subscriber, harness, task

__all__ = ["harness"]  # the fixture, used here by name


@pytest.mark.timeout(90)  # one launch of the sim child (about 2 s on a loaded 2-core box)
async def test_an_adapter_version_reaches_a_running_sglang_engine_without_a_pause(
        harness: Callable[..., Any], tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    engines: list[SGLangEngine] = []

    def factory() -> SGLangEngine:
        e = SGLangEngine(model=str(tiny_model_dir), capacity=4, device="cpu", backend="sim", log_dir=str(tmp_path),
                         lora=True, lora_dir=str(tmp_path / "lora"), start_timeout_s=60,
                         server_args=json.dumps({**SIM_SERVER_ARGS, "decode_s_per_token": 0.005}))
        engines.append(e)
        return e

    _worker, broker, _run = await harness(factory, apply_mode="interrupt")
    await broker.welcome(weight_endpoint="tcp://fake:1", announce_endpoint="tcp://fake:2", weight_version=-1)
    sub = await fake_subscriber(worker=_worker, broker=broker)
    await broker.send(task(1, n=2, max_new=300, ignore_eos=True))
    await broker.until_inflight("p1@0")
    named, spec = _adapter(tiny_model_dir)
    sub.publish(1, named, manifest=types.SimpleNamespace(adapter=spec))
    assert (await broker.expect(ApplyRequest)).version == 1
    await broker.send(ApplyGrant(version=1))
    done = await broker.expect(ApplyDone)
    assert done.ok and done.version == 1
    await broker.send(task(2, n=1, max_new=5, ignore_eos=True))
    results = {r.task_id: r for r in (await broker.expect(Result, timeout_s=30), await broker.expect(Result, timeout_s=30))}
    assert all(t.token_versions.tolist() == [0] * 300 for t in results["p1@0"].trajectories)  # began on the base, ran on
    assert all(t.token_versions.tolist() == [1] * 5 for t in results["p2@0"].trajectories)
    assert engines[0].stats["resubmits"] == 0 and len(engines) == 1  # nothing aborted, no restart
    # an adapter the engine cannot serve: refused by name, reported, and the worker serves on with version 1
    big, big_spec = _adapter(tiny_model_dir, rank=128)
    sub.publish(2, big, manifest=types.SimpleNamespace(adapter=big_spec))
    assert (await broker.expect(ApplyRequest)).version == 2
    await broker.send(ApplyGrant(version=2))
    refused = await broker.expect(ApplyDone)
    assert not refused.ok and "max_lora_rank 64" in (refused.error or "")
    await broker.send(task(3, n=1, max_new=4, ignore_eos=True))
    after = await broker.expect(Result, timeout_s=30, skip=(WorkerHeartbeat, Credit, ApplyDone))  # and the skip notice
    assert after.error is None and all(t.token_versions.tolist() == [1] * 4 for t in after.trajectories) and len(engines) == 1


@pytest.mark.timeout(90)
async def test_an_adapter_version_reaches_the_hf_engine_without_interrupting_a_running_sample(
        harness: Callable[..., Any], tiny_model_dir: pathlib.Path) -> None:
    """In ``interrupt`` mode too: the running sample is not re-prefilled onto the new adapter (it finishes on the version
    it began on, every token saying so) and the next sample runs on the adapter."""
    from rollpool.workers.engines.hf import HFEngine

    engine = HFEngine(model=str(tiny_model_dir), capacity=4, num_threads=1)
    _worker, broker, _run = await harness(lambda: engine, apply_mode="interrupt")
    await broker.welcome(weight_endpoint="tcp://fake:1", announce_endpoint="tcp://fake:2", weight_version=-1)
    sub = await fake_subscriber(worker=_worker, broker=broker)
    await broker.send(task(1, n=1, max_new=400, ignore_eos=True))
    await broker.until_inflight("p1@0")
    for _ in range(3000):  # until the sample is decoding
        if engine.stats["decode_steps"] >= 5:
            break
        await asyncio.sleep(0.01)
    named, spec = _adapter(tiny_model_dir)
    sub.publish(1, named, manifest=types.SimpleNamespace(adapter=spec))
    assert (await broker.expect(ApplyRequest)).version == 1
    await broker.send(ApplyGrant(version=1))
    done = await broker.expect(ApplyDone)
    assert done.ok and done.version == 1
    steps_at_apply = engine.stats["decode_steps"]
    await broker.send(task(2, n=1, max_new=5, ignore_eos=True))
    results = {r.task_id: r for r in (await broker.expect(Result, timeout_s=60), await broker.expect(Result, timeout_s=60))}
    assert steps_at_apply < 400  # applied while the first sample ran
    assert [t.token_versions.tolist() for t in results["p1@0"].trajectories] == [[0] * 400]
    assert [t.token_versions.tolist() for t in results["p2@0"].trajectories] == [[1] * 5]


OLD_BROKER_FEATURES = tuple(f for f in FEATURES if f != Feature.ADAPTER_NO_GRANT)
"""What a broker of the previous minor lists: every feature but the one it does not know."""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("broker", ["lists_it", "fleet", "previous_minor"])
async def test_an_adapter_version_needs_no_apply_slot_only_when_the_broker_says_so(
        harness: Callable[..., Any], tiny_model_dir: pathlib.Path, broker: str) -> None:
    """A broker that lists `Feature.ADAPTER_NO_GRANT` (minor `ADAPTER_GRANT_MINOR`, rolling activation) gets no
    ApplyRequest for an adapter version, only its ApplyDone; a fleet-activation broker (same minor, not listed) and a
    broker of the previous minor are asked as before. The tokens' versions are exact across the switch either way."""
    from rollpool.workers.engines.hf import HFEngine

    engine = HFEngine(model=str(tiny_model_dir), capacity=4, num_threads=1)
    worker, scripted, _run = await harness(lambda: engine, apply_mode="interrupt")
    minor = ADAPTER_GRANT_MINOR - 1 if broker == "previous_minor" else PROTOCOL_MINOR
    features = FEATURES if broker == "lists_it" else OLD_BROKER_FEATURES
    await scripted.welcome(weight_endpoint="tcp://fake:1", announce_endpoint="tcp://fake:2", weight_version=-1,
                           protocol_minor=minor, features=features)
    sub = await fake_subscriber(worker=worker, broker=scripted)
    await scripted.send(task(1, n=1, max_new=400, ignore_eos=True))
    for _ in range(3000):  # until the sample is decoding
        if engine.stats["decode_steps"] >= 5:
            break
        await asyncio.sleep(0.01)
    named, spec = _adapter(tiny_model_dir)
    sub.publish(1, named, manifest=types.SimpleNamespace(adapter=spec))
    if broker == "lists_it":
        done = await scripted.expect(ApplyDone, timeout_s=30, skip=(WorkerHeartbeat, Credit))  # an ApplyRequest fails here
    else:
        assert (await scripted.expect(ApplyRequest, timeout_s=30)).version == 1
        await scripted.send(ApplyGrant(version=1))
        done = await scripted.expect(ApplyDone, timeout_s=30)
    assert done.ok and done.version == 1
    await scripted.send(task(2, n=1, max_new=5, ignore_eos=True))
    results = {r.task_id: r for r in (await scripted.expect(Result, timeout_s=60), await scripted.expect(Result, timeout_s=60))}
    asks = sum(isinstance(m, ApplyRequest) for _, m in scripted.received)
    dones = sum(isinstance(m, ApplyDone) for _, m in scripted.received)
    assert (asks, dones) == ((0, 1) if broker == "lists_it" else (1, 1))
    assert worker.weights.grants_skipped == (1 if broker == "lists_it" else 0)
    assert [t.token_versions.tolist() for t in results["p1@0"].trajectories] == [[0] * 400]  # began on the base
    assert [t.token_versions.tolist() for t in results["p2@0"].trajectories] == [[1] * 5]


@pytest.mark.timeout(90)
async def test_a_whole_model_version_still_asks_for_an_apply_slot_from_a_broker_that_lists_it(
        harness: Callable[..., Any], tiny_model_dir: pathlib.Path) -> None:
    """The same hf engine (it serves adapters without a pause) pauses for a whole-model version: that takes a slot."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollpool.workers.engines.hf import HFEngine

    engine = HFEngine(model=str(tiny_model_dir), capacity=4, num_threads=1)
    worker, scripted, _run = await harness(lambda: engine)
    await scripted.welcome(weight_endpoint="tcp://fake:1", announce_endpoint="tcp://fake:2", weight_version=-1,
                           protocol_minor=PROTOCOL_MINOR, features=FEATURES)
    sub = await fake_subscriber(worker=worker, broker=scripted)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    sub.publish(1, {k: v.detach().clone() for k, v in model.named_parameters()})
    assert (await scripted.expect(ApplyRequest)).version == 1
    await scripted.send(ApplyGrant(version=1))
    done = await scripted.expect(ApplyDone)
    assert done.ok and done.version == 1 and worker.weights.grants_skipped == 0


async def _hf_worker_on_a_fake_publisher(harness: Callable[..., Any], tiny_model_dir: pathlib.Path,
                                         engine_class: type[Any]) -> tuple[list[Any], Any, Any]:
    """A worker whose hf engines are `engine_class` on the tiny model (each restart appends one), welcomed by the scripted
    broker with a fake publisher: (the engines, the broker, the fake subscriber)."""
    engines: list[Any] = []

    def factory() -> Any:
        engines.append(engine_class(model=str(tiny_model_dir), capacity=4, num_threads=1))
        return engines[-1]

    worker, broker, _run = await harness(factory, apply_mode="interrupt")
    await broker.welcome(weight_endpoint="tcp://fake:1", announce_endpoint="tcp://fake:2", weight_version=-1)
    return engines, broker, await fake_subscriber(worker=worker, broker=broker)


@pytest.mark.timeout(120)
async def test_a_restarted_engine_gets_the_adapter_that_is_on_under_a_whole_model_version(
        harness: Callable[..., Any], tiny_model_dir: pathlib.Path) -> None:
    """The engines keep the newest adapter on across a whole-model version (docs/lora.md), so an engine restarted to
    apply one must get that adapter too: adapter version 1, then whole-model version 2 whose apply fails on the serving
    engine (a fault injected at the engine's edge): the restarted engine is given adapter 1 and then version 2; then
    version 3 fails the same way and the engine restarted again is given adapter 1 under it as well. Before, a restarted
    engine served the whole-model version alone while its tokens claimed the policy of base and adapter."""
    import torch
    from safetensors.torch import load_file

    from rollpool.protocol.errors import EngineError
    from rollpool.workers.engines.hf import HFEngine

    fail_once = {2, 3}

    class FailsOnce(HFEngine):
        async def update_weights(self, named_tensors: Any, version: int) -> None:
            if version in fail_once:
                fail_once.discard(version)
                raise EngineError(f"injected: the update to version {version} failed on this engine")
            await super().update_weights(named_tensors, version)

    engines, broker, sub = await _hf_worker_on_a_fake_publisher(harness, tiny_model_dir, FailsOnce)
    named, spec = _adapter(tiny_model_dir)
    sub.publish(1, named, manifest=types.SimpleNamespace(adapter=spec))
    assert (await broker.expect(ApplyRequest)).version == 1
    await broker.send(ApplyGrant(version=1))
    assert (await broker.expect(ApplyDone)).ok
    norm = next(k for k in load_file(str(tiny_model_dir / "model.safetensors")) if k.endswith("norm.weight"))
    for version in (2, 3):
        sub.publish(version, {norm: torch.full((32,), float(version))}, manifest=types.SimpleNamespace(adapter=None))
        assert (await broker.expect(ApplyRequest)).version == version
        await broker.send(ApplyGrant(version=version))
        failed = await broker.expect(ApplyDone)
        assert not failed.ok and "injected" in (failed.error or "")
        hello = await broker.welcome()  # the restarted engine was given the version before the worker says hello again
        assert hello.weight_version == version and len(engines) == version
        assert engines[-1].adapter_versions() == [1] and engines[-1].version == version  # adapter 1 on the new base
        await broker.send(task(version * 10, n=1, max_new=4, ignore_eos=True))
        result = await broker.expect(Result, timeout_s=30)
        assert [t.token_versions.tolist() for t in result.trajectories] == [[version] * 4]


@pytest.mark.timeout(120)
async def test_a_restarted_engine_gets_the_whole_model_version_under_the_adapter_it_serves(
        harness: Callable[..., Any], tiny_model_dir: pathlib.Path) -> None:
    """The other way round: whole-model version 1, then adapter version 2 over it (`Manifest.base_on` 1); adapter
    version 3 fails on every engine (a fault injected at the engine's edge), so the worker restarts its engine, tries
    3 on the fresh one, restarts again and gives the engine it keeps what the failed one served: version 1's weights
    under adapter 2, and 2's tokens sampled there. Before, a restarted engine got adapter 2 alone, over the base it
    loaded from disk, while its tokens claimed the policy of version 1 plus that adapter."""
    from rollpool.protocol.errors import EngineError
    from rollpool.workers.engines.hf import HFEngine

    class FailsAdapter3(HFEngine):
        async def update_adapter(self, named_tensors: Any, spec: Any, version: int) -> None:
            if version == 3:
                raise EngineError("injected: adapter version 3 failed on this engine")
            await super().update_adapter(named_tensors, spec, version)

    engines, broker, sub = await _hf_worker_on_a_fake_publisher(harness, tiny_model_dir, FailsAdapter3)
    base = _whole_model(tiny_model_dir, 7)  # the final norm at 7.0 (the model on disk has it at 1.0)
    sub.publish(1, base, manifest=types.SimpleNamespace(adapter=None))
    assert (await broker.expect(ApplyRequest)).version == 1
    await broker.send(ApplyGrant(version=1))
    assert (await broker.expect(ApplyDone)).ok
    for version in (2, 3):
        named, spec = _adapter(tiny_model_dir)
        sub.publish(version, named, manifest=types.SimpleNamespace(adapter=spec, base_on=1))
        assert (await broker.expect(ApplyRequest)).version == version
        await broker.send(ApplyGrant(version=version))
        done = await broker.expect(ApplyDone)
        assert done.ok is (version == 2)
    skipped = await broker.expect(ApplyDone, timeout_s=30)  # the skip notice: it failed on a fresh engine too
    assert skipped.version == 3 and skipped.skipped
    hello = await broker.welcome()  # the engine it keeps was given what the failed one served before the hello
    assert hello.weight_version == 2 and len(engines) == 3
    kept = engines[-1]
    (norm, value), = base.items()
    assert kept.adapter_versions() == [2]
    assert kept._model.state_dict()[norm].float().tolist() == value.tolist()  # version 1's weights, not the disk's
    await broker.send(task(20, n=1, max_new=4, ignore_eos=True))
    result = await broker.expect(Result, timeout_s=30)
    assert [t.token_versions.tolist() for t in result.trajectories] == [[2] * 4]


def _whole_model(tiny_model_dir: pathlib.Path, version: int) -> dict[str, Any]:
    """A whole-model version: the final norm's weight, set to `version`."""
    import torch
    from safetensors.torch import load_file

    norm = next(k for k in load_file(str(tiny_model_dir / "model.safetensors")) if k.endswith("norm.weight"))
    return {norm: torch.full((32,), float(version))}


async def _skips_version_2_for_a_gone_version_1(harness: Callable[..., Any], engine: Any, version_1: tuple[Any, Any],
                                                version_2: tuple[Any, Any], names: str) -> tuple[Any, Any, Any]:
    """A joining worker is published version 2 (tensors, manifest), which needs version 1 (tensors, manifest) that the
    publisher no longer serves: version 2 is skipped, reported naming `names` and "no longer served", nothing applied,
    and a task still runs on the engine's version 0. (worker, broker, the fake subscriber)."""
    worker, broker, _run = await harness(lambda: engine)
    await broker.welcome(weight_endpoint="tcp://fake:1", announce_endpoint="tcp://fake:2", weight_version=-1)
    sub = await fake_subscriber(worker=worker, broker=broker)
    sub.gone.add(1)
    sub.versions[1], sub.manifests[1] = version_1
    sub.publish(2, version_2[0], manifest=version_2[1])
    skipped = await broker.expect(ApplyDone, timeout_s=30)  # no ApplyRequest: nothing to apply
    assert (skipped.version, skipped.ok, skipped.skipped) == (2, False, True)
    assert names in (skipped.error or "") and "no longer served" in (skipped.error or "")
    assert sub.fetches == [2, 1] and worker.weights.skipped == 2
    assert engine.adapter_versions() == [] and engine.version == 0
    await broker.send(task(1, n=1, max_new=4, ignore_eos=True))
    result = await broker.expect(Result, timeout_s=30)
    assert [t.token_versions.tolist() for t in result.trajectories] == [[0] * 4]  # its version, said exactly
    return worker, broker, sub


@pytest.mark.timeout(90)
async def test_a_joiner_that_cannot_get_the_adapter_on_under_a_version_skips_it_saying_why_and_serves_on(
        harness: Callable[..., Any], tiny_model_dir: pathlib.Path) -> None:
    """A worker joins at whole-model version 2, whose manifest names adapter version 1 as on under it
    (`Manifest.adapter_on`), and the publisher no longer serves version 1 (evicted): version 2 is not served without
    the adapter (its tokens would name a policy they were not sampled under). It is skipped, reported with the reason,
    counted; the worker serves its version on and applies the next one it can."""
    from rollpool.workers.engines.hf import HFEngine

    engine = HFEngine(model=str(tiny_model_dir), capacity=4, num_threads=1)
    named, spec = _adapter(tiny_model_dir)
    worker, broker, sub = await _skips_version_2_for_a_gone_version_1(
        harness, engine, (named, types.SimpleNamespace(adapter=spec)),
        (_whole_model(tiny_model_dir, 2), types.SimpleNamespace(adapter=None, adapter_on=1)), "adapter version 1")
    assert worker.weights.adapter_on_fallbacks == 1
    # the next adapter version is served (a newer adapter replaces the one that was on)
    named3, spec3 = _adapter(tiny_model_dir)
    sub.publish(3, named3, manifest=types.SimpleNamespace(adapter=spec3))
    assert (await broker.expect(ApplyRequest, timeout_s=30)).version == 3
    await broker.send(ApplyGrant(version=3))
    assert (await broker.expect(ApplyDone, timeout_s=30)).ok
    assert engine.adapter_versions() == [3]


@pytest.mark.timeout(90)
async def test_a_broker_and_a_publisher_of_the_previous_minor_work_with_a_joiner_as_before(
        harness: Callable[..., Any], tiny_model_dir: pathlib.Path) -> None:
    """Peers of the minor before `ADAPTER_ON_MINOR`: a broker of that minor, and a publisher whose manifests carry no
    `adapter_on` (decoded here from its wire form). The joining worker applies the whole-model version as before,
    fetching nothing else; the adapter version, also served, is not looked for."""
    import msgpack

    from rollpool.workers.engines.hf import HFEngine

    engine = HFEngine(model=str(tiny_model_dir), capacity=4, num_threads=1)
    worker, broker, _run = await harness(lambda: engine)
    await broker.welcome(weight_endpoint="tcp://fake:1", announce_endpoint="tcp://fake:2", weight_version=-1,
                         protocol_minor=PROTOCOL_MINOR - 1)
    sub = await fake_subscriber(worker=worker, broker=broker)
    fields = {"request_id": "m", "version": 2, "buckets": []}
    old = decode([msgpack.packb([1, ADAPTER_ON_MINOR - 1, "manifest", fields], use_bin_type=True)])
    assert isinstance(old, Manifest) and old.adapter_on == -1 and old.adapter is None
    named, spec = _adapter(tiny_model_dir)
    sub.versions[1], sub.manifests[1] = named, types.SimpleNamespace(adapter=spec)
    sub.publish(2, _whole_model(tiny_model_dir, 2), manifest=old)
    assert (await broker.expect(ApplyRequest, timeout_s=30)).version == 2
    await broker.send(ApplyGrant(version=2))
    assert (await broker.expect(ApplyDone, timeout_s=30)).ok
    assert sub.fetches == [2] and engine.adapter_versions() == [] and engine.version == 2
    await broker.send(task(1, n=1, max_new=4, ignore_eos=True))
    result = await broker.expect(Result, timeout_s=30)
    assert [t.token_versions.tolist() for t in result.trajectories] == [[2] * 4]


@pytest.mark.timeout(90)  # one launch of the sim child
async def test_a_joiner_on_the_sglang_engine_loads_the_adapter_on_under_the_version_it_joins_at(
        harness: Callable[..., Any], tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """The sglang engine (its sim child and `SimLora`): a worker joining at whole-model version 2, whose manifest names
    adapter version 1 as on under it, loads adapter 1 and then version 2 in one pause; its samples run on adapter 1
    and carry version 2, as on a worker that applied both in turn."""
    engine = SGLangEngine(model=str(tiny_model_dir), capacity=4, device="cpu", backend="sim", log_dir=str(tmp_path),
                          lora=True, lora_dir=str(tmp_path / "lora"), start_timeout_s=60,
                          server_args=json.dumps({**SIM_SERVER_ARGS, "decode_s_per_token": 0.002}))
    worker, broker, _run = await harness(lambda: engine, apply_mode="interrupt")
    await broker.welcome(weight_endpoint="tcp://fake:1", announce_endpoint="tcp://fake:2", weight_version=-1)
    sub = await fake_subscriber(worker=worker, broker=broker)
    named, spec = _adapter(tiny_model_dir)
    sub.versions[1], sub.manifests[1] = named, types.SimpleNamespace(adapter=spec)
    sub.publish(2, _whole_model(tiny_model_dir, 2), manifest=types.SimpleNamespace(adapter=None, adapter_on=1))
    assert (await broker.expect(ApplyRequest, timeout_s=30)).version == 2
    await broker.send(ApplyGrant(version=2))
    done = await broker.expect(ApplyDone, timeout_s=30)
    assert done.ok and done.version == 2 and sub.fetches == [2, 1] and worker.weights.adapters_joined == 1
    assert sorted(engine._adapters) == [1] and engine.version == 2
    await broker.send(task(1, n=1, max_new=4, ignore_eos=True))
    result = await broker.expect(Result, timeout_s=30)
    assert [t.token_versions.tolist() for t in result.trajectories] == [[2] * 4]
    assert engine.stats["resubmits"] == 0


@pytest.mark.timeout(120)
async def test_a_joiner_whose_engine_refuses_the_version_after_its_adapter_is_restarted_without_the_adapter(
        harness: Callable[..., Any], tiny_model_dir: pathlib.Path) -> None:
    """The adapter on under version 2 is given to the engine first; if the engine then refuses version 2 itself (a
    tensor it does not have), the adapter is on over the base it served, which no version names: the engine is
    replaced, and the fresh one (given version 2 once more, refused again) serves its last good version without the
    adapter; version 2 is skipped and the tokens say the version they were sampled under."""
    import torch

    from rollpool.workers.engines.hf import HFEngine

    engines: list[HFEngine] = []

    def factory() -> HFEngine:
        engines.append(HFEngine(model=str(tiny_model_dir), capacity=4, num_threads=1))
        return engines[-1]

    worker, broker, _run = await harness(factory)
    await broker.welcome(weight_endpoint="tcp://fake:1", announce_endpoint="tcp://fake:2", weight_version=-1)
    sub = await fake_subscriber(worker=worker, broker=broker)
    named, spec = _adapter(tiny_model_dir)
    sub.versions[1], sub.manifests[1] = named, types.SimpleNamespace(adapter=spec)
    sub.publish(2, {"model.no_such_layer.weight": torch.zeros(4)}, manifest=types.SimpleNamespace(adapter=None, adapter_on=1))
    assert (await broker.expect(ApplyRequest, timeout_s=30)).version == 2
    await broker.send(ApplyGrant(version=2))
    failed = await broker.expect(ApplyDone, timeout_s=30)
    assert not failed.ok and "restarted without it" in (failed.error or "")
    skipped = await broker.expect(ApplyDone, timeout_s=30)  # refused again on the fresh engine: given up, reported
    assert skipped.skipped and skipped.version == 2 and "restarted one" in (skipped.error or "")
    await broker.welcome()  # the engine was replaced
    assert await _until(lambda: worker.weights.skipped == 2 and len(engines) >= 2 and worker.supervisor.ok.is_set())
    assert engines[-1].adapter_versions() == [] and engines[-1].version == 0
    await broker.send(task(1, n=1, max_new=4, ignore_eos=True))
    result = await broker.expect(Result, timeout_s=30, skip=(WorkerHeartbeat, Credit, ApplyDone))
    assert [t.token_versions.tolist() for t in result.trajectories] == [[0] * 4]


async def _until(pred: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    for _ in range(int(timeout_s / 0.02)):
        if pred():
            return True
        await asyncio.sleep(0.02)
    return pred()


@pytest.mark.timeout(90)
async def test_a_joiner_that_cannot_get_the_base_of_an_adapter_version_skips_it_saying_why_and_serves_on(
        harness: Callable[..., Any], tiny_model_dir: pathlib.Path) -> None:
    """A worker joins at adapter version 2, whose manifest names whole-model version 1 as its base (`Manifest.base_on`),
    and the publisher no longer serves version 1: adapter version 2 is not served over the engine's model from disk (its
    tokens would name a policy they were not sampled under). It is skipped, reported with the reason, counted; the
    worker serves its version on and applies the next one it can."""
    from rollpool.workers.engines.hf import HFEngine

    engine = HFEngine(model=str(tiny_model_dir), capacity=4, num_threads=1)
    named, spec = _adapter(tiny_model_dir)
    worker, broker, sub = await _skips_version_2_for_a_gone_version_1(
        harness, engine, (_whole_model(tiny_model_dir, 1), types.SimpleNamespace(adapter=None)),
        (named, types.SimpleNamespace(adapter=spec, base_on=1)), "version 1")
    assert worker.weights.base_on_fallbacks == 1
    # the next whole-model version is served, and an adapter version over it needs nothing fetched besides
    sub.publish(3, _whole_model(tiny_model_dir, 3), manifest=types.SimpleNamespace(adapter=None))
    assert (await broker.expect(ApplyRequest, timeout_s=30)).version == 3
    await broker.send(ApplyGrant(version=3))
    assert (await broker.expect(ApplyDone, timeout_s=30)).ok
    named4, spec4 = _adapter(tiny_model_dir)
    sub.publish(4, named4, manifest=types.SimpleNamespace(adapter=spec4, base_on=3))
    assert (await broker.expect(ApplyRequest, timeout_s=30)).version == 4
    await broker.send(ApplyGrant(version=4))
    assert (await broker.expect(ApplyDone, timeout_s=30)).ok
    assert sub.fetches == [2, 1, 3, 4] and engine.adapter_versions() == [4] and worker.weights.bases_joined == 0


@pytest.mark.timeout(90)
async def test_a_publisher_of_the_previous_minor_gives_a_joiner_adapter_versions_as_before(
        harness: Callable[..., Any], tiny_model_dir: pathlib.Path) -> None:
    """A publisher of the minor before `BASE_ON_MINOR`, whose adapter manifests carry no `base_on` (decoded here from
    its wire form), and a broker of that minor: the joining worker applies the adapter version over its engine's base as
    before, fetching nothing else."""
    import msgpack

    from rollpool.workers.engines.hf import HFEngine

    engine = HFEngine(model=str(tiny_model_dir), capacity=4, num_threads=1)
    worker, broker, _run = await harness(lambda: engine)
    await broker.welcome(weight_endpoint="tcp://fake:1", announce_endpoint="tcp://fake:2", weight_version=-1,
                         protocol_minor=BASE_ON_MINOR - 1)
    sub = await fake_subscriber(worker=worker, broker=broker)
    named, spec = _adapter(tiny_model_dir)
    fields = {"request_id": "m", "version": 2, "buckets": [], "adapter": {"rank": spec.rank, "alpha": spec.alpha,
                                                                           "target_modules": list(spec.target_modules)}}
    old = decode([msgpack.packb([1, BASE_ON_MINOR - 1, "manifest", fields], use_bin_type=True)])
    assert isinstance(old, Manifest) and old.base_on == -1 and old.adapter is not None
    sub.versions[1], sub.manifests[1] = _whole_model(tiny_model_dir, 1), types.SimpleNamespace(adapter=None)
    sub.publish(2, named, manifest=old)
    assert (await broker.expect(ApplyRequest, timeout_s=30)).version == 2
    await broker.send(ApplyGrant(version=2))
    assert (await broker.expect(ApplyDone, timeout_s=30)).ok
    assert sub.fetches == [2] and engine.adapter_versions() == [2] and worker.weights.bases_joined == 0


@pytest.mark.timeout(90)  # one launch of the sim child
async def test_a_joiner_on_the_sglang_engine_applies_the_base_of_the_adapter_version_it_joins_at(
        harness: Callable[..., Any], tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """The sglang engine (its sim child and `SimLora`), which takes adapter versions without a pause: a worker joining
    at adapter version 2, whose manifest names whole-model version 1 as its base, asks for the apply slot and gives the
    engine version 1 and then adapter 2 in one pause; its samples run on adapter 2 and carry version 2."""
    engine = SGLangEngine(model=str(tiny_model_dir), capacity=4, device="cpu", backend="sim", log_dir=str(tmp_path),
                          lora=True, lora_dir=str(tmp_path / "lora"), start_timeout_s=60,
                          server_args=json.dumps({**SIM_SERVER_ARGS, "decode_s_per_token": 0.002}))
    worker, broker, _run = await harness(lambda: engine, apply_mode="interrupt")
    await broker.welcome(weight_endpoint="tcp://fake:1", announce_endpoint="tcp://fake:2", weight_version=-1)
    sub = await fake_subscriber(worker=worker, broker=broker)
    sub.versions[1], sub.manifests[1] = _whole_model(tiny_model_dir, 1), types.SimpleNamespace(adapter=None)
    named, spec = _adapter(tiny_model_dir)
    sub.publish(2, named, manifest=types.SimpleNamespace(adapter=spec, base_on=1))
    assert (await broker.expect(ApplyRequest, timeout_s=30)).version == 2  # a pause: it takes the slot
    await broker.send(ApplyGrant(version=2))
    done = await broker.expect(ApplyDone, timeout_s=30)
    assert done.ok and done.version == 2 and sub.fetches == [2, 1] and worker.weights.bases_joined == 1
    assert sorted(engine._adapters) == [2] and engine.version == 2
    await broker.send(task(1, n=1, max_new=4, ignore_eos=True))
    result = await broker.expect(Result, timeout_s=30)
    assert [t.token_versions.tolist() for t in result.trajectories] == [[2] * 4]
