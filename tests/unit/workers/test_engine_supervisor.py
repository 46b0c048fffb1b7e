"""The engine supervisor: one restart per failure, a bounded backoff, `max_restarts`, re-apply before service (no sockets)."""

from __future__ import annotations

import asyncio

import pytest

from rollpool.protocol.errors import EngineError
from rollpool.protocol.metrics import MemoryMetricsSink
from rollpool.workers.config import WorkerConfig
from rollpool.workers.engine_supervisor import EngineSupervisor
from rollpool.workers.engines.base import Engine, EngineInfo
from rollpool.workers.engines.sim import SimEngine


class FailingStartEngine(SimEngine):
    async def start(self) -> None:
        raise EngineError("no device")


def config(**kw: object) -> WorkerConfig:
    options: dict[str, object] = {"worker_id": "w1", "restart_backoff_s": 0.001, "restart_backoff_max_s": 0.004, "max_restarts": 3}
    options.update(kw)
    return WorkerConfig(**options)  # type: ignore[arg-type]


def test_the_backoff_doubles_from_the_second_attempt_and_is_capped() -> None:
    sup = EngineSupervisor(config(restart_backoff_s=1.0, restart_backoff_max_s=5.0), SimEngine, MemoryMetricsSink())
    assert [sup.backoff_s(a) for a in range(1, 7)] == [0.0, 1.0, 2.0, 4.0, 5.0, 5.0]


async def test_one_failure_one_hand_back_and_the_new_engine_is_given_the_weights_before_service() -> None:
    events: list[str] = []
    made: list[SimEngine] = []
    up = asyncio.Event()

    def factory() -> SimEngine:
        made.append(SimEngine(capacity=2))
        return made[-1]

    async def on_down(reason: str) -> None:
        events.append(f"down:{reason}")

    async def on_up(info: EngineInfo) -> None:
        events.append(f"up:{info.weight_version}")
        up.set()

    async def reapply(engine: Engine) -> None:
        assert not sup.ok.is_set()  # before the engine takes work
        events.append("reapply")
        await engine.update_weights({}, 7)

    sup = EngineSupervisor(config(), factory, MemoryMetricsSink(), on_down=on_down, on_up=on_up)
    sup.reapply = reapply
    await sup.start()
    loop = asyncio.create_task(sup.run())
    assert await sup.fail("boom") is True
    assert await sup.fail("boom again") is False  # the same failure, reported by a second task
    await asyncio.wait_for(up.wait(), 5)
    assert events == ["down:boom", "reapply", "up:7"]
    assert len(made) == 2 and sup.engine is made[1] and sup.restarts == 1
    loop.cancel()
    await sup.stop()


async def test_an_engine_that_cannot_start_is_given_up_after_max_restarts() -> None:
    made: list[SimEngine] = []

    def factory() -> SimEngine:
        made.append(FailingStartEngine() if made else SimEngine())
        return made[-1]

    sup = EngineSupervisor(config(max_restarts=3), factory, MemoryMetricsSink())
    await sup.start()
    await sup.fail("boom")
    with pytest.raises(EngineError, match="3 times in a row"):
        await asyncio.wait_for(sup.run(), 5)
    assert len(made) == 1 + 3 and not sup.ok.is_set()


class BrokenConstrainedEngine(SimEngine):
    """A sim engine whose constrained turns fail as a dead engine does."""

    async def generate_constrained(self, *args: object, **kwargs: object) -> object:
        raise EngineError("the engine died mid-turn")


async def test_a_constrained_turn_that_fails_is_an_engine_failure_as_a_plain_turn_is() -> None:
    """The episodes' view of the engine forwards `generate_constrained` only where the engine has it, and a failure of
    it (not a refusal) fails the engine, as a failed `generate` does."""
    from rollpool.protocol.messages import SamplingParams
    from rollpool.workers.engines.base import OutputConstraint, can_constrain
    from rollpool.workers.worker import _SupervisedEngine

    downs: list[str] = []

    async def on_down(reason: str) -> None:
        downs.append(reason)

    sup = EngineSupervisor(config(), BrokenConstrainedEngine, MemoryMetricsSink(), on_down=on_down)
    await sup.start()
    watched = _SupervisedEngine(sup)
    assert can_constrain(watched)  # what the endpoint asks (a runtime-protocol isinstance misses the proxy on 3.12)
    with pytest.raises(EngineError, match="died mid-turn"):
        await watched.generate_constrained([1, 2], 1, SamplingParams(max_new_tokens=2), "r", OutputConstraint())
    assert downs == ["EngineError: the engine died mid-turn"]
    await sup.stop()
    plain = EngineSupervisor(config(), SimEngine, MemoryMetricsSink())
    await plain.start()
    assert not can_constrain(_SupervisedEngine(plain))  # the endpoint then answers 400 naming the engine
    await plain.stop()
