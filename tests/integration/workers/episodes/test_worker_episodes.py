"""Episodes through the worker: a real broker, real `Worker`s, a real `TrainerClient`, on zmq tcp loopback.

The engines are the sim engine (labelled simulated: its tokens are random) and, for the
`openai` SDK test, the `hf` engine on the random tiny model.
"""

from __future__ import annotations

import asyncio
import pathlib
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pytest

from rollpool.protocol import MemoryMetricsSink
from rollpool.protocol.messages import FinishReason, Prompt, SamplingParams
from rollpool.workers import EpisodeContext
from rollpool.workers.config import WorkerConfig
from rollpool.workers.worker import Worker
from tests.integration.reliability.conftest import HB, Pool, sim_engine, wait_until

pytest.importorskip("aiohttp")



def start_worker(p: Pool, worker_id: str, episodes: Mapping[str, Any] | None, *, engine_factory: Callable[[], Any] | None = None,
                 metrics: MemoryMetricsSink | None = None, **kw: Any) -> tuple[Worker, asyncio.Task[None]]:
    """A real worker with episode functions; `kill()` of the returned task is a death (no drain, no Goodbye)."""
    assert p.broker is not None
    opts: dict[str, Any] = dict(broker=p.broker.worker_endpoint, worker_id=worker_id, heartbeat_interval_s=HB, reconnect_backoff_s=0.1,
                                reconnect_backoff_max_s=0.5, drain_timeout_s=0.2, send_timeout_s=1.0)
    opts.update(kw)
    w = Worker(WorkerConfig(**opts), p.sockets, engine_factory=engine_factory or sim_engine, episodes=episodes, metrics=metrics)
    task = asyncio.create_task(w.run(), name=f"worker.{worker_id}")

    async def close() -> None:
        if not task.done():
            w.stop()
            try:
                await asyncio.wait_for(task, 5)
            except Exception:  # noqa: BLE001 - teardown
                task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    p._closers.append(close)
    return w, task


def sim_prompt(pid: str, n: int = 2, **metadata: Any) -> Prompt:
    return Prompt(prompt_id=pid, input_ids=np.arange(3, 9, dtype=np.int32), group_size=n,
                  sampling=SamplingParams(max_new_tokens=4), metadata=metadata)


def broker_counters(p: Pool) -> dict[str, int]:
    assert p.broker is not None
    return dict(p.broker.state.counters)


async def test_a_sync_episode_with_a_five_second_tool_keeps_its_heartbeat(pool: Pool) -> None:
    """The tool sleeps 5 s in the episode's thread; heartbeats go on, so the broker never declares the worker dead.

    Heartbeats every 0.5 s, dead after 1.5 s of silence: a loop blocked by the 5 s tool would be declared dead,
    and the margin holds on a loaded 2-core machine (0.1 s / 0.3 s did not)."""
    await pool.start_broker(heartbeat_interval_s=0.5)
    calls: list[float] = []

    def agent(ctx: EpisodeContext, prompt: Prompt) -> float:
        ctx.generate_sync()
        time.sleep(5)  # a slow synchronous tool, inside a synchronous agent
        calls.append(time.monotonic())
        ctx.append([7, 7])
        ctx.generate_sync()
        return 1.0

    metrics = MemoryMetricsSink()
    start_worker(pool, "w", {"default": agent}, metrics=metrics, heartbeat_interval_s=0.5)
    client = await pool.client(pool.broker.client_endpoint)  # type: ignore[union-attr]
    await client.submit([sim_prompt("p")])
    batch = await client.get_batch(1, timeout=30)
    (group,) = batch.groups
    assert group.state == "done" and group.attempts == 1 and len(calls) == 2
    assert sorted(t.trajectory_id for t in group.trajectories) == ["p:0", "p:1"]
    for t in group.trajectories:
        assert t.reward == 1.0 and t.finish_reason != FinishReason.ERROR
        assert t.loss_mask.tolist().count(0) == 2  # the appended tool tokens are not trained
    c = broker_counters(pool)
    assert c.get("workers_lost", 0) == 0 and c.get("requeued", 0) == 0, c
    # the runner's stats travel with the worker's monitoring state
    assert await wait_until(lambda: metrics.states[("worker", "w")].get("episodes_finished") == 2, 5)
    state = metrics.states[("worker", "w")]
    assert state["episodes_finished"] == 2 and state["episodes_turns"] == 4, state


async def test_an_exception_in_the_episode_is_that_sample_s_error(pool: Pool) -> None:
    await pool.start_broker()

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> float:
        await ctx.generate()
        if ctx.sample_index == 1:
            raise ValueError("the environment broke")
        return 1.0

    start_worker(pool, "w", {"default": agent})
    client = await pool.client(pool.broker.client_endpoint)  # type: ignore[union-attr]
    await client.submit([sim_prompt("p")])
    (group,) = (await client.get_batch(1, timeout=20)).groups
    by_index = {t.sample_index: t for t in group.trajectories}
    assert by_index[0].finish_reason != FinishReason.ERROR and by_index[0].reward == 1.0
    assert by_index[1].finish_reason == FinishReason.ERROR and by_index[1].reward is None
    assert by_index[1].metadata["episode_error"] == "ValueError: the environment broke"
    assert group.attempts == 1  # a per-sample outcome, not a retry


async def test_a_prompt_picks_its_episode_function_and_reward_applies_only_when_it_returns_none(pool: Pool) -> None:
    await pool.start_broker()

    async def scored(ctx: EpisodeContext, prompt: Prompt) -> float:
        await ctx.generate()
        return 0.25

    async def unscored(ctx: EpisodeContext, prompt: Prompt) -> None:
        await ctx.generate()

    w = Worker(WorkerConfig(broker=pool.broker.worker_endpoint, worker_id="w", heartbeat_interval_s=HB,  # type: ignore[union-attr]
                            drain_timeout_s=0.2, reward="tests.integration.workers.episodes.test_worker_episodes:reward_one"),
               pool.sockets, engine_factory=sim_engine, episodes={"scored": scored, "unscored": unscored})
    task = asyncio.create_task(w.run())
    try:
        client = await pool.client(pool.broker.client_endpoint)  # type: ignore[union-attr]
        await client.submit([sim_prompt("a", episode="scored"), sim_prompt("b", episode="unscored")])
        batch = await client.get_batch(2, timeout=20)
        rewards = {g.prompt_id: {t.reward for t in g.trajectories} for g in batch.groups}
        assert rewards == {"a": {0.25}, "b": {1.0}}
    finally:
        w.stop()
        await asyncio.wait_for(task, 5)


def reward_one(metadata: Any, trajectory: Any) -> float:
    return 1.0


HOLD: list[float] = [3600.0]
RUNS: list[tuple[str, int]] = []


async def held_agent(ctx: EpisodeContext, prompt: Prompt) -> float:
    out = await ctx.generate()
    RUNS.append((prompt.prompt_id, ctx.sample_index))
    await asyncio.sleep(HOLD[0])
    ctx.append([5])
    await ctx.generate()
    return float(len(out.output_ids))


async def test_a_worker_killed_mid_episode_has_its_group_rerun_elsewhere_and_delivered_once(pool: Pool) -> None:
    await pool.start_broker()
    HOLD[0], RUNS[:] = 3600.0, []
    doomed, doomed_task = start_worker(pool, "doomed", {"default": held_agent})
    client = await pool.client(pool.broker.client_endpoint)  # type: ignore[union-attr]
    await client.submit([sim_prompt("p", n=3)])
    assert await wait_until(lambda: len(RUNS) == 3, 10), RUNS
    assert doomed.episodes is not None and doomed.episodes.stats.in_flight == 3
    doomed_task.cancel()  # killed: no drain, no Goodbye, no hand-back
    await asyncio.gather(doomed_task, return_exceptions=True)
    HOLD[0] = 0.0
    start_worker(pool, "rescuer", {"default": held_agent})
    (group,) = (await client.get_batch(1, timeout=20)).groups
    assert group.worker_id == "rescuer" and group.attempts == 2
    assert sorted(t.trajectory_id for t in group.trajectories) == ["p:0", "p:1", "p:2"]
    assert {t.worker_id for t in group.trajectories} == {"rescuer"} and {t.attempt for t in group.trajectories} == {1}
    assert sorted(RUNS) == sorted([("p", i) for i in range(3)] * 2)  # every episode re-run from the start
    await asyncio.sleep(5 * HB)
    with pytest.raises(TimeoutError):
        await client.get_batch(1, timeout=0.5)  # nothing delivered twice
    c = broker_counters(pool)
    assert c["workers_lost"] == 1 and c.get("duplicates", 0) == 0


async def test_sigterm_drains_then_cancels_running_episodes_and_their_tools_and_hands_them_back(pool: Pool) -> None:
    await pool.start_broker()
    cancelled: list[int] = []

    async def slow_tool(i: int) -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    stopping = asyncio.Event()

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> float:
        await ctx.generate()
        if prompt.prompt_id == "slow":
            await slow_tool(ctx.sample_index)
        await stopping.wait()  # "quick" ends during the drain
        await asyncio.sleep(0.05)
        return 1.0

    w, task = start_worker(pool, "w", {"default": agent}, drain_timeout_s=1.0)
    client = await pool.client(pool.broker.client_endpoint)  # type: ignore[union-attr]
    await client.submit([sim_prompt("slow"), sim_prompt("quick")])
    assert await wait_until(lambda: w.episodes is not None and w.episodes.stats.turns == 4, 10)
    w.stop()  # what SIGTERM does
    stopping.set()
    await asyncio.wait_for(task, 10)
    assert sorted(cancelled) == [0, 1] and w.stopped_cleanly
    (quick,) = (await client.get_batch(1, timeout=5)).groups  # finished within the drain deadline: delivered
    assert quick.prompt_id == "quick" and quick.worker_id == "w" and quick.attempts == 1
    assert w.episodes is not None and w.episodes.stats.in_flight == 0
    c = broker_counters(pool)
    assert c.get("workers_lost", 0) == 0 and c["requeued"] == 1  # handed back, not lost
    start_worker(pool, "next", {"default": fast_agent})
    (group,) = (await client.get_batch(1, timeout=20)).groups
    assert group.prompt_id == "slow" and group.worker_id == "next" and group.attempts == 2 and len(group.trajectories) == 2


async def fast_agent(ctx: EpisodeContext, prompt: Prompt) -> float:
    await ctx.generate()
    return 1.0


async def test_an_unmodified_openai_sdk_agent_through_the_worker_on_the_tiny_model(pool: Pool, tiny_model_dir: pathlib.Path) -> None:
    openai = pytest.importorskip("openai")
    pytest.importorskip("transformers")
    from rollpool.workers.engines.hf import HFEngine

    await pool.start_broker()

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> float:
        async with openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key, max_retries=0) as sdk:
            messages: list[Any] = [{"role": "user", "content": prompt.text}]
            for turn in range(2):
                r = await sdk.chat.completions.create(model=ctx.model, messages=messages, max_tokens=4, seed=ctx.sample_index * 10 + turn)
                messages += [r.choices[0].message, {"role": "user", "content": "go on"}]
        return 1.0

    start_worker(pool, "w", {"default": agent}, engine="hf", model=str(tiny_model_dir),
                 engine_factory=lambda: HFEngine(model=str(tiny_model_dir), capacity=4, num_threads=1))
    client = await pool.client(pool.broker.client_endpoint)  # type: ignore[union-attr]
    await client.submit([Prompt(prompt_id="chat", text="What is 2 plus 2?", group_size=2, sampling=SamplingParams(max_new_tokens=8))])
    (group,) = (await client.get_batch(1, timeout=60)).groups
    assert sorted(t.trajectory_id for t in group.trajectories) == ["chat:0", "chat:1"]  # one segment per episode
    for t in group.trajectories:
        assert t.reward == 1.0 and len(t.loss_mask) == len(t.output_ids)
        assert 0 < int(t.loss_mask.sum()) <= 8  # two turns of at most 4 sampled tokens
        assert (t.loss_mask == 0).any()  # the user turn between them, inserted, not trained


async def test_an_engine_failure_inside_an_episode_restarts_the_engine_and_reruns_the_group(pool: Pool) -> None:
    """Not an episode error: the engine failed, so the group is handed back and re-run whole."""
    await pool.start_broker()
    made: list[Any] = []

    def factory() -> Any:
        engine = sim_engine()
        if not made:
            async def broken(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("CUDA error: device lost")
            engine.generate = broken  # type: ignore[method-assign]
        made.append(engine)
        return engine

    w, _ = start_worker(pool, "w", {"default": fast_agent}, engine_factory=factory, restart_backoff_s=0.05, restart_backoff_max_s=0.2)
    client = await pool.client(pool.broker.client_endpoint)  # type: ignore[union-attr]
    await client.submit([sim_prompt("p")])
    (group,) = (await client.get_batch(1, timeout=20)).groups
    assert w.restarts == 1 and len(made) == 2 and group.attempts >= 2  # handed back (a task that came in while restarting is too)
    assert {t.finish_reason for t in group.trajectories} != {FinishReason.ERROR} and {t.reward for t in group.trajectories} == {1.0}


async def test_a_history_rewrite_delivers_both_segments_of_the_episode_through_the_broker(pool: Pool) -> None:
    await pool.start_broker()

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> float:
        await ctx.generate()
        if ctx.sample_index == 0:
            await ctx.generate([11, 12, 13])  # not an extension of the sequence: a rewrite, a new segment
        return 1.0

    start_worker(pool, "w", {"default": agent})
    client = await pool.client(pool.broker.client_endpoint)  # type: ignore[union-attr]
    await client.submit([sim_prompt("p")])
    (group,) = (await client.get_batch(1, timeout=20)).groups
    assert sorted(t.trajectory_id for t in group.trajectories) == ["p:0", "p:0:1", "p:1"] and group.attempts == 1
    assert broker_counters(pool).get("invalid_results", 0) == 0


async def test_an_engine_without_a_tokenizer_gets_the_model_directory_s(pool: Pool, tiny_model_dir: pathlib.Path) -> None:
    """As for sglang (its tokenizer lives in its child): the worker loads the model directory's for the endpoint."""
    pytest.importorskip("transformers")
    await pool.start_broker()
    engine = sim_engine()
    assert getattr(engine, "tokenizer", None) is None
    w, _ = start_worker(pool, "w", {"default": fast_agent}, model=str(tiny_model_dir), engine_factory=lambda: engine)
    assert await wait_until(lambda: w.episodes is not None, 10)
    assert w.episodes is not None and w.episodes.tokenizer is not None
    assert w.episodes.tokenizer.name_or_path == str(tiny_model_dir)


async def test_an_agent_sending_poisoned_sampling_gets_400s_and_restarts_nothing(pool: Pool, tiny_model_dir: pathlib.Path) -> None:
    """One agent sends NaN and infinite temperatures and a seed past int64 on every run; the other behaves. The
    poisoned requests are refused at the edge (400), the engine is never restarted, the group is delivered once."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("transformers")
    from rollpool.workers.engines.hf import HFEngine

    await pool.start_broker()
    refused: list[tuple[int, Any]] = []

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> float:
        import json

        import aiohttp

        messages: list[Any] = [{"role": "user", "content": prompt.text}]
        if ctx.sample_index == 0:  # raw JSON: the SDK's encoder refuses NaN, a hand-written agent's need not
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ctx.api_key}"}) as http:
                for bad in ({"temperature": float("nan")}, {"temperature": float("inf")}, {"seed": 2**64}, {"top_p": float("nan")}):
                    body = json.dumps({"model": ctx.model, "messages": messages, "max_tokens": 4, **bad})
                    async with http.post(f"{ctx.openai_base_url}/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"}) as resp:
                        refused.append((resp.status, (await resp.json())["error"]["param"]))
        async with openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key, max_retries=0) as sdk:
            r = await sdk.chat.completions.create(model=ctx.model, messages=messages, max_tokens=4, seed=1)
        return 1.0 if r.choices[0].message is not None else 0.0

    w, _ = start_worker(pool, "w", {"default": agent}, engine="hf", model=str(tiny_model_dir),
                        engine_factory=lambda: HFEngine(model=str(tiny_model_dir), capacity=4, num_threads=1))
    client = await pool.client(pool.broker.client_endpoint)  # type: ignore[union-attr]
    await client.submit([Prompt(prompt_id="p", text="hi", group_size=2, sampling=SamplingParams(max_new_tokens=8))])
    (group,) = (await client.get_batch(1, timeout=30)).groups
    assert refused == [(400, "temperature"), (400, "temperature"), (400, "seed"), (400, "top_p")]
    assert w.restarts == 0 and group.attempts == 1
    assert [t.reward for t in sorted(group.trajectories, key=lambda t: t.sample_index)] == [1.0, 1.0]
