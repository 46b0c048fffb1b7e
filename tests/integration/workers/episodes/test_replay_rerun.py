"""A worker killed mid-episode: the next attempt is served the turns the dead one finished (real broker, real
`Worker`s, a real `TrainerClient`, zmq over tcp loopback; the sim engine, labelled simulated)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from rollpool import protocol as p
from rollpool.workers import EpisodeContext
from rollpool.workers.engines.sim import SimEngine
from tests.integration.broker.peers import FakeWorker
from tests.integration.reliability.conftest import HB, Pool, wait_until
from tests.integration.workers.episodes.test_worker_episodes import sim_prompt, start_worker

pytest.importorskip("aiohttp")

TURNS = 4
HOLD: list[float] = [0.0]
TOOL_RUNS: list[tuple[int, int]] = []


async def four_turns(ctx: EpisodeContext, prompt: p.Prompt) -> float:
    """Four sampled turns, a deterministic tool between them; the tool after turn 1 can be held (the worker dies there)."""
    for k in range(TURNS):
        await ctx.generate()
        if k < TURNS - 1:
            TOOL_RUNS.append((ctx.sample_index, k))
            if k == 1:
                await asyncio.sleep(HOLD[0])
            ctx.append([100 + k])
    return 1.0


class CountingSim(SimEngine):
    """The sim engine, counting the turns and tokens it sampled (what a re-run costs)."""

    calls = 0
    tokens = 0

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        out = await super().generate(*args, **kwargs)
        CountingSim.calls += 1
        CountingSim.tokens += sum(len(s.output_ids) for s in out.samples)
        return out


def counting_sim() -> SimEngine:
    return CountingSim(decode_s_per_token=0.002, length="fixed", length_median=4, capacity=4, vocab=300)  # as `sim_engine`



async def _kill_after_two_turns(pool: Pool, n: int) -> tuple[Any, dict[int, list[list[int]]]]:
    """A worker runs `n` episodes to the tool after turn 1 and is killed there; the turns the broker kept."""
    await pool.start_broker()
    HOLD[0], TOOL_RUNS[:] = 3600.0, []
    doomed, doomed_task = start_worker(pool, "doomed", {"default": four_turns})
    client = await pool.client(pool.broker.client_endpoint)  # type: ignore[union-attr]
    await client.submit([sim_prompt("p", n=n)])
    st = pool.broker.state  # type: ignore[union-attr]
    assert await wait_until(lambda: st.counters["replay_turns_kept"] == 2 * n, 10), st.counters
    g = st.groups["p"]
    kept = {i: [t.output_ids.tolist() for t in turns] for i, turns in (g.turns or {}).items()}
    doomed_task.cancel()  # killed: no drain, no Goodbye, no hand-back
    await asyncio.gather(doomed_task, return_exceptions=True)
    HOLD[0] = 0.0
    return client, kept


async def test_a_rerun_after_a_worker_death_samples_only_the_turns_the_dead_worker_did_not_finish(pool: Pool) -> None:
    n = 3
    client, kept = await _kill_after_two_turns(pool, n)
    assert sorted(kept) == list(range(n)) and all(len(v) == 2 for v in kept.values())
    CountingSim.calls = CountingSim.tokens = 0
    rescuer, _ = start_worker(pool, "rescuer", {"default": four_turns}, engine_factory=counting_sim)
    (group,) = (await client.get_batch(1, timeout=20)).groups
    assert group.worker_id == "rescuer" and group.attempts == 2
    assert CountingSim.calls == n * (TURNS - 2)  # turns 0 and 1 of every episode came from the record
    for t in group.trajectories:
        sampled = [int(x) for x, m in zip(t.output_ids, t.loss_mask, strict=True) if m]
        first_two = kept[t.sample_index][0] + kept[t.sample_index][1]
        assert sampled[: len(first_two)] == first_two  # the dead worker's tokens, delivered as it sampled them
        assert len(sampled) == len(first_two) + CountingSim.tokens // n
    assert rescuer.episodes is not None and rescuer.episodes.stats.turns_replayed == 2 * n
    assert sorted(TOOL_RUNS).count((0, 0)) == 2  # the agent's own code (its tools) runs again: only sampling is saved
    c = pool.broker.state.counters  # type: ignore[union-attr]
    assert c["tokens_regenerated"] == 0 and c["replay_turns_sent"] == 2 * n and c["workers_lost"] == 1
    await asyncio.sleep(5 * HB)
    with pytest.raises(TimeoutError):
        await client.get_batch(1, timeout=0.5)  # nothing delivered twice
    assert c.get("duplicates", 0) == 0


async def test_with_replay_off_the_rerun_samples_every_turn_again_and_the_broker_counts_them(pool: Pool) -> None:
    n = 2
    client, kept = await _kill_after_two_turns(pool, n)
    CountingSim.calls = CountingSim.tokens = 0
    start_worker(pool, "rescuer", {"default": four_turns}, engine_factory=counting_sim, episode_replay=False)
    (group,) = (await client.get_batch(1, timeout=20)).groups
    assert CountingSim.calls == n * TURNS
    c = pool.broker.state.counters  # type: ignore[union-attr]
    assert c["tokens_regenerated"] == sum(len(turn) for turns in kept.values() for turn in turns)


class PreviousMinorWorker(FakeWorker):
    """A worker of the minor before `REPLAY_MINOR`'s (it does not list `Feature.REPLAY`)."""

    def _hello(self) -> p.Hello:
        return dataclasses.replace(super()._hello(), protocol_minor=p.REPLAY_MINOR - 1, features=(p.Feature.TASK_BATCH,))


async def test_a_worker_of_the_previous_minor_reruns_the_group_whole_and_it_is_delivered_once(pool: Pool) -> None:
    client, _ = await _kill_after_two_turns(pool, 2)
    old = await PreviousMinorWorker(pool.sockets, pool.broker.worker_endpoint, "old").start()  # type: ignore[union-attr]
    try:
        (group,) = (await client.get_batch(1, timeout=20)).groups
        assert group.worker_id == "old" and [t.replay for t in old.tasks] == [()]  # no turns sent to a worker that cannot read them
    finally:
        await old.close()


async def test_every_turn_is_streamed_to_the_broker_before_its_groups_result(pool: Pool) -> None:
    await pool.start_broker()
    HOLD[0], TOOL_RUNS[:] = 0.0, []
    start_worker(pool, "steady", {"default": four_turns})
    client = await pool.client(pool.broker.client_endpoint)  # type: ignore[union-attr]
    await client.submit([sim_prompt("q", n=2)])
    (group,) = (await client.get_batch(1, timeout=20)).groups
    c = pool.broker.state.counters  # type: ignore[union-attr]
    # the turns are gathered before they are sent, and a group's last ones are sent before its result: none arrives
    # for a group already done (ignored), none is dropped
    assert (c["replay_turns_kept"], c["replay_turns_ignored"]) == (2 * TURNS, 0), c


async def test_a_draining_worker_streams_its_last_turns_before_it_hands_the_episodes_back(pool: Pool) -> None:
    """A worker told to stop right after its episodes' second turns (inside the turns' gathering window), whose drain
    ends before the episodes do: the turns they finished reach the broker before the hand-back, so the re-run elsewhere
    samples only the rest (before, the stream's loop was cancelled with those turns still gathering)."""
    await pool.start_broker()
    HOLD[0], TOOL_RUNS[:] = 3600.0, []
    stopping: list[Any] = []

    async def stop_after_two_turns(ctx: EpisodeContext, prompt: p.Prompt) -> float:
        for k in range(TURNS):
            await ctx.generate()
            if k == 1:
                if len([1 for i, j in TOOL_RUNS if j == 1]) == prompt.group_size - 1:
                    stopping[0].stop()  # the last episode's second turn: the worker drains from here
                TOOL_RUNS.append((ctx.sample_index, k))
                await asyncio.sleep(HOLD[0])
            ctx.append([100 + k])
        return 1.0

    n = 3
    worker, task = start_worker(pool, "leaving", {"default": stop_after_two_turns}, drain_timeout_s=0.0)
    stopping.append(worker)
    client = await pool.client(pool.broker.client_endpoint)  # type: ignore[union-attr]
    await client.submit([sim_prompt("d", n=n)])
    await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 10)
    st = pool.broker.state  # type: ignore[union-attr]
    assert st.counters["replay_turns_kept"] == 2 * n, st.counters
    HOLD[0] = 0.0
    CountingSim.calls = 0
    start_worker(pool, "rescuer", {"default": four_turns}, engine_factory=counting_sim)
    (group,) = (await client.get_batch(1, timeout=20)).groups
    assert group.worker_id == "rescuer" and CountingSim.calls == n * (TURNS - 2)
