"""The sglang engine across several GPUs, on a CPU: tensor-parallel ranks and data-parallel replicas.

The engine launches its real child with the sim backend (conftest: `SIM_SERVER_ARGS`), which pretends to be
``tp_size`` ranks the way SGLang's update sees them: one payload per rank, each decoded on its own, the version
on every rank or on none, and a stand-in process per rank whose exit takes the server down (server.py `SimRanks`).
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("aiohttp")

from rollpool.protocol.errors import ConfigError, EngineError
from rollpool.protocol.messages import SamplingParams
from rollpool.workers.config import WorkerConfig
from rollpool.workers.engines.sglang.engine import SGLangEngine, engine_gpu_plan
from rollpool.workers.engines.sglang.ranks import plan_gpus, visible_from_env
from rollpool.workers.engines.sglang.tensors import load_cpu_payload, serialize_ranks

from .conftest import SIM_SERVER_ARGS

torch: Any = pytest.importorskip("torch")


def _engine(model: pathlib.Path, tmp_path: pathlib.Path, **kw: Any) -> SGLangEngine:
    server_args = {**SIM_SERVER_ARGS, "decode_s_per_token": 0.01, **kw.pop("server_args", {})}
    return SGLangEngine(model=str(model), capacity=8, device="cpu", backend="sim", log_dir=str(tmp_path),
                        server_args=json.dumps(server_args), start_timeout_s=60, **kw)


def _weights(engine: SGLangEngine, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=g) * 0.2 for k, (_dt, shape) in engine._params.items()}


async def _model_info(engine: SGLangEngine, replica: int) -> dict[str, Any]:
    info: dict[str, Any] = await engine._post("/model_info", method="GET", replica=replica)
    return info


@pytest.fixture
async def tp2dp2(tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> AsyncIterator[SGLangEngine]:
    """tp_size 2 x dp_size 2: two children, each pretending two ranks (CUDA_VISIBLE_DEVICES unset: a CPU engine)."""
    engine = _engine(tiny_model_dir, tmp_path, tp_size=2, dp_size=2, server_args={"rank_refuses": [1, 5]})
    await engine.start()
    yield engine
    await engine.stop()


async def test_every_rank_of_every_replica_gets_its_payload_and_the_same_version(tp2dp2: SGLangEngine) -> None:
    engine = tp2dp2
    assert len(engine._children) == 2 and engine.info().extra["tp_size"] == 2 and engine.info().extra["dp_size"] == 2
    assert [engine.replica_capacity(d) for d in (0, 1)] == [4, 4] and engine.info().capacity == 8
    for d in (0, 1):
        info = await _model_info(engine, d)
        assert info["tp_size"] == 2 and info["rank_versions"] == [0, 0] and len(info["rank_pids"]) == 2
    sent = _weights(engine, 3)
    await engine.pause("interrupt")
    await engine.update_weights(sent, 3)
    await engine.resume()
    assert engine.last_update["ranks"] == 4.0
    for d in (0, 1):
        assert (await _model_info(engine, d))["rank_versions"] == [3, 3]
        name = "model.layers.0.self_attn.q_proj.weight"
        got = await engine._post("/get_weights_by_name", {"name": name, "truncate_size": 2}, replica=d)
        assert torch.allclose(torch.tensor(got), sent[name][:2])
    # two groups at once go to the two replicas (each group whole on one), and every token carries version 3
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True, seed=1)
    outs = await asyncio.gather(engine.generate([1, 2, 3], 2, sp, "a"), engine.generate([4, 5, 6], 2, sp, "b"))
    assert all(v == 3 for o in outs for s in o.samples for v in s.token_versions)


async def test_a_version_one_rank_refuses_changes_no_rank_and_is_a_clear_error(tp2dp2: SGLangEngine) -> None:
    engine = tp2dp2
    await engine.pause("drain")
    await engine.update_weights(_weights(engine, 4), 4)
    with pytest.raises(EngineError, match="refused version 5.*rank 1 refused weight_version 5; no rank changed"):
        await engine.update_weights(_weights(engine, 5), 5)
    assert engine.version == 4  # the worker restarts the engine whole and gives it its version again
    for d in (0, 1):
        assert (await _model_info(engine, d))["rank_versions"] == [4, 4]
    await engine.update_weights(_weights(engine, 6), 6)  # the next version lands everywhere
    await engine.resume()
    assert [(await _model_info(engine, d))["rank_versions"] for d in (0, 1)] == [[6, 6], [6, 6]]


async def test_a_rank_that_dies_takes_the_engine_down_and_fails_running_work(tp2dp2: SGLangEngine) -> None:
    engine = tp2dp2
    pid = (await _model_info(engine, 1))["rank_pids"][1]
    running = asyncio.create_task(engine.generate([1, 2, 3], 2, SamplingParams(max_new_tokens=2000, ignore_eos=True), "long"))
    await asyncio.sleep(0.1)
    os.kill(pid, signal.SIGKILL)  # as a crashing SGLang scheduler of rank 1 of replica 1
    with pytest.raises(EngineError, match="exited"):
        await asyncio.wait_for(running, 10)
    with pytest.raises(EngineError, match="replica 1 of 2: SGLang server exited"):
        await engine.generate([1, 2, 3], 1, SamplingParams(max_new_tokens=2), "after")


async def test_more_ranks_than_the_workers_gpus_is_a_config_error_before_any_child(
        tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    engine = _engine(tiny_model_dir, tmp_path, tp_size=2)
    with pytest.raises(ConfigError, match=r"needs tp_size x dp_size = 2 x 1 = 2 GPUs; this worker has 1 \(CUDA_VISIBLE_DEVICES='3'\)"):
        await engine.start()
    assert engine._children == []  # no child was started


def test_the_gpu_plan_places_replicas_on_consecutive_gpus() -> None:
    assert visible_from_env({}) is None
    assert visible_from_env({"CUDA_VISIBLE_DEVICES": "4,5, 6,7"}) == ("4", "5", "6", "7")
    assert visible_from_env({"CUDA_VISIBLE_DEVICES": "0,-1,2"}) == ("0",)  # CUDA stops at the first invalid entry
    assert visible_from_env({"CUDA_VISIBLE_DEVICES": ""}) == ()
    plan = plan_gpus(2, 2, ("4", "5", "6", "7"), where="test")
    assert [plan.base_gpu_id(d) for d in (0, 1)] == [0, 2]
    assert plan.devices(1) == ("cuda:2", "cuda:3") and plan.gpus_needed == 4
    with pytest.raises(ConfigError, match="needs tp_size x dp_size = 4 x 2 = 8 GPUs; this worker has 4 .*--gpus-per-worker 8"):
        plan_gpus(4, 2, ("4", "5", "6", "7"), where="test")
    # a CPU engine (sim backend) needs no GPU unless the environment names some; real SGLang always does
    from rollpool.workers.engines.options import SGLangOptions

    sim = SGLangOptions(model="m", backend="sim", tp_size=4)
    assert engine_gpu_plan(sim, "cpu", {}) is None and engine_gpu_plan(sim, "cpu", {"CUDA_VISIBLE_DEVICES": ""}) is None
    with pytest.raises(ConfigError, match="this worker has 2"):
        engine_gpu_plan(sim, "cpu", {"CUDA_VISIBLE_DEVICES": "0,1"})
    with pytest.raises(ConfigError, match="this worker has 0"):
        engine_gpu_plan(SGLangOptions(model="m"), "cpu", {"CUDA_VISIBLE_DEVICES": ""})


def test_each_rank_gets_its_own_payload_of_the_full_tensors() -> None:
    named = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    for per_rank in (True, False):
        out = serialize_ranks(named, [["cpu", "cpu", "cpu"], ["cpu", "cpu", "cpu"]], per_rank=per_rank)
        assert out.ranks == 6 and [len(p) for p in out.payloads] == [3, 3]
        for replica in out.payloads:
            for payload in replica:
                got = dict(load_cpu_payload(payload))
                assert list(got) == ["a", "b"] and all(torch.equal(got[k], named[k]) for k in named)


def test_worker_flags_reach_the_engine_and_refuse_other_engines() -> None:
    cfg = WorkerConfig(engine="sglang", model="/m", tp_size=2, dp_size=3, capacity=6)
    assert cfg.engine_kwargs() == {"model": "/m", "capacity": 6, "tp_size": 2, "dp_size": 3}
    with pytest.raises(ConfigError, match="need engine sglang, got 'hf'"):
        WorkerConfig(engine="hf", model="/m", tp_size=2)
    with pytest.raises(ConfigError, match="tp_size is 2 but engine_options says tp_size=4"):
        WorkerConfig(engine="sglang", model="/m", tp_size=2, engine_options="tp_size=4")
    with pytest.raises(ConfigError, match="capacity must be >= dp_size"):
        WorkerConfig(engine="sglang", model="/m", dp_size=4, capacity=2)
    with pytest.raises(ConfigError, match="dp_size must be 1 with url="):
        WorkerConfig(engine="sglang", model="/m", dp_size=2, engine_options="url=http://h:1")


def test_an_engine_device_names_its_first_gpu() -> None:
    from rollpool.workers.engines.options import SGLangOptions

    plan = engine_gpu_plan(SGLangOptions(model="m", tp_size=2), "cuda:2", {"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert plan is not None and plan.base_gpu_id(0) == 2 and plan.devices(0) == ("cuda:2", "cuda:3")
    with pytest.raises(ConfigError, match="2 GPUs from cuda:3 \\(SGLangOptions.device\\) on; this worker has 4"):
        engine_gpu_plan(SGLangOptions(model="m", tp_size=2), "cuda:3", {"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
