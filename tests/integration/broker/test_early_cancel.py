"""Staleness control without wasted generation, on real sockets: a real `Broker`, real `Worker`s on the sim engine
(simulated tokens), a real `TrainerClient` publishing real (zero-byte) weight versions.

* early cancellation: a lease that started more than the trainer's bound behind is cancelled at the
  bump that dooms it, although its worker has caught up (today's rule looked at the worker only); the
  worker aborts it and reports the tokens it had made (wasted, reason cancel); the group runs again at
  the worker's current version; under ``keep`` the trainer's stated bound moves the point;
* a broker cancel of an episode group cancels its episode coroutines and returns its credits.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from rollpool.protocol.messages import Prompt, SamplingParams
from rollpool.workers import EpisodeContext
from tests.integration.reliability.conftest import Pool, sim_engine, wait_until


@pytest.fixture
async def pool(zmq_ctx: Any, tmp_path: Any) -> AsyncIterator[Pool]:
    p = Pool(zmq_ctx, tmp_path)
    try:
        yield p
    finally:
        await p.close()


def long_prompt(pid: str, n: int = 2) -> Prompt:
    return Prompt(prompt_id=pid, input_ids=np.arange(3, 9, dtype=np.int32), group_size=n, sampling=SamplingParams(max_new_tokens=100_000))


async def test_a_doomed_lease_is_cancelled_at_the_bump_that_dooms_it_and_runs_again_fresh(pool: Pool) -> None:
    broker = await pool.start_broker(max_staleness=1, batch_size=100, cancel_stale_inflight=True)
    # 100,000 tokens at 2 ms: the group would run for minutes; only a cancel ends it within the test
    w = await pool.worker(broker.worker_endpoint, "w", engine_factory=lambda: sim_engine(length_median=100_000))
    client = await pool.client(broker.client_endpoint)
    st = broker.state

    async def publish(v: int) -> None:
        await client.publish_weights({}, v)
        assert await wait_until(lambda: "w" in st.workers and st.workers["w"].version == v, 10), f"worker did not apply {v}"

    await publish(0)
    await client.submit([long_prompt("long")])
    assert await wait_until(lambda: st.leased == 1 and w.session.tasks, 5)
    # the trainer keeps up to 2 versions (keep, 2 x eta): said with every version from its next get_batch on
    with pytest.raises(TimeoutError):
        await client.get_batch(1, max_staleness=1, stale_policy="keep", timeout=0.05)
    await publish(1)
    await publish(2)  # staleness 2 <= the keep bound: still consumable
    assert st.trainer_bound == 2 and st.counters["doomed_cancelled"] == 0 and st.groups["long"].attempt == 0
    with pytest.raises(TimeoutError):  # back to drop at eta 1
        await client.get_batch(1, max_staleness=1, timeout=0.05)
    await publish(3)  # started at 0: 3 - 0 > 1, and its worker is current: cancelled now
    assert await wait_until(lambda: st.counters["doomed_cancelled"] == 1, 5)
    # slots and window released, run again at once (the window is not full here, so a worker still applying 3
    # may take it at 2: version-aware dispatch holds only the capacity a bump opens in a full window)
    assert await wait_until(lambda: st.counters["dispatched"] == 2, 5)
    g = st.groups["long"]
    assert g.phase == "leased" and g.task_id == "long@1" and g.start_version >= 2 and g.attempt - g.forgiven == 0
    assert await wait_until(lambda: st.counters["wasted_tokens_cancel"] > 0, 5)  # the worker's abort, from its heartbeat
    assert st.counters["wasted_tokens_cancel"] == w.session.tokens_cancelled
    assert st.wasted_shares()["wasted_share_cancel"] == 1.0  # nothing else generated yet
    status = await client.status()
    assert status["counters"]["doomed_cancelled"] == 1 and status["counters"]["wasted_share"] == 1.0


async def test_a_broker_cancel_cancels_the_groups_episodes_and_returns_their_credits(pool: Pool) -> None:
    pytest.importorskip("aiohttp")
    from tests.integration.workers.episodes.test_worker_episodes import sim_prompt, start_worker

    broker = await pool.start_broker()
    cancelled: list[int] = []

    async def waits_forever(ctx: EpisodeContext, prompt: Prompt) -> float:
        await ctx.generate()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(ctx.sample_index)
            raise
        return 1.0

    w, _task = start_worker(pool, "w", {"default": waits_forever})
    client = await pool.client(broker.client_endpoint)
    await client.submit([sim_prompt("ep")])
    assert await wait_until(lambda: w.episodes is not None and w.episodes.stats.turns == 2, 10)
    full = w.session.capacity
    assert w.session.free_credits() == full - 2
    await client.cancel(["ep"])
    assert await wait_until(lambda: sorted(cancelled) == [0, 1], 5), cancelled
    assert await wait_until(lambda: w.session.free_credits() == full and not w.session.tasks, 5)
    assert await wait_until(lambda: w.episodes is not None and w.episodes.stats.in_flight == 0, 5)
    await client.submit([sim_prompt("next")])  # the credits came back to the broker too
    assert await wait_until(lambda: broker.state.counters["dispatched"] == 2, 5)
