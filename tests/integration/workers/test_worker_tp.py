"""A worker whose sglang engine spans ranks (the sim child pretending two), against a scripted broker.

A rank that dies takes its SGLang server down; the worker hands the engine's leases back at once (Nack),
restarts the engine whole and serves again. (A version one rank refuses raises `EngineError` from
``update_weights`` with nothing applied, tests/unit/workers/test_sglang_tp.py; the worker's handling of a failed
apply, restart whole, reapply, skip, is the engine-independent path of test_worker.py.)
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("aiohttp")

from rollpool.protocol.messages import Nack, Result
from rollpool.workers.engines.sglang.engine import SGLangEngine
from tests.unit.workers.conftest import SIM_SERVER_ARGS

from .test_worker import harness, task

torch: Any = pytest.importorskip("torch")

__all__ = ["harness"]  # the fixture, used here by name


def _tp_factory(model: pathlib.Path, log_dir: pathlib.Path, engines: list[SGLangEngine], **server: Any) -> Callable[[], SGLangEngine]:
    def factory() -> SGLangEngine:
        e = SGLangEngine(model=str(model), capacity=4, device="cpu", backend="sim", tp_size=2, log_dir=str(log_dir),
                         server_args=json.dumps({**SIM_SERVER_ARGS, "decode_s_per_token": 0.005, **server}), start_timeout_s=60)
        engines.append(e)
        return e

    return factory


@pytest.mark.timeout(120)  # two launches of the sim child (about 2 s each on a loaded 2-core box)
async def test_a_dead_rank_returns_the_leases_and_the_engine_restarts_whole(
        harness: Callable[..., Any], tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    engines: list[SGLangEngine] = []
    worker, broker, _run = await harness(_tp_factory(tiny_model_dir, tmp_path, engines))
    hello = await broker.welcome()
    assert hello.credits == 4
    await broker.send(task(1, n=2, max_new=2000, ignore_eos=True))
    await broker.until_inflight("p1@0")
    pids = (await engines[0]._post("/model_info", method="GET"))["rank_pids"]
    os.kill(pids[1], signal.SIGKILL)  # rank 1's scheduler dies: SGLang takes its whole server down
    nack = await broker.expect(Nack)
    assert nack.task_ids == ("p1@0",)  # the lease goes back at once, not at its deadline
    hello = await broker.welcome()
    assert hello.credits == 4 and hello.inflight == ()
    assert len(engines) == 2 and worker.engine is engines[1] and worker.restarts == 1
    assert (await engines[1]._post("/model_info", method="GET"))["rank_versions"] == [0, 0]
    await broker.send(task(2, n=2))
    result = await broker.expect(Result)
    assert result.task_id == "p2@0" and result.error is None
