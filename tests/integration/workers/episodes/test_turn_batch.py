"""Finished episode turns streamed several tasks to a message (protocol 1.29, `TURN_BATCH_MINOR`): a real broker and a
real `Worker` (the sim engine, labelled simulated): a broker that lists `Feature.TURN_BATCH` gets `TurnRecordBatch`es, one
of the previous minor (that does not list it) one `TurnRecords` per task. The broker's side, and a worker of the previous
minor, on raw sockets: tests/integration/broker/test_turn_batch_wire.py."""

from __future__ import annotations

import pytest

from rollpool import protocol as p
from rollpool.protocol.errors import MessageTooLargeError
from rollpool.workers import EpisodeContext
from tests.integration.reliability.conftest import Pool, wait_until
from tests.integration.workers.episodes.test_worker_episodes import sim_prompt, start_worker

pytest.importorskip("aiohttp")

TURNS = 3


async def three_turns(ctx: EpisodeContext, prompt: p.Prompt) -> float:
    for k in range(TURNS):
        await ctx.generate()
        if k < TURNS - 1:
            ctx.append([100 + k])
    return 1.0



async def _run_groups(pool: Pool, *, broker_lists_it: bool, batch_too_large: bool = False) -> tuple[dict[str, int], list[str]]:
    broker = await pool.start_broker()
    if not broker_lists_it:  # a broker of the previous minor: it lists no TURN_BATCH
        broker._welcome_features = tuple(f for f in broker._welcome_features if f != p.Feature.TURN_BATCH)
    worker, _ = start_worker(pool, "w", {"default": three_turns})
    sent: list[str] = []
    link_send = worker.link.send

    async def spy(msg: object) -> bool:
        if type(msg) in (p.TurnRecords, p.TurnRecordBatch):
            sent.append(type(msg).__name__)
            if batch_too_large and type(msg) is p.TurnRecordBatch:  # as the link refuses one over the broker's limits
                raise MessageTooLargeError("turn_record_batch", 1 << 20, 1 << 10)
        return await link_send(msg)

    worker.link.send = spy  # type: ignore[method-assign]
    client = await pool.client(broker.client_endpoint)
    groups, n = 4, 2
    await client.submit([sim_prompt(f"g{i}", n=n) for i in range(groups)])
    batch = await client.get_batch(groups, timeout=20)
    assert sorted(g.prompt_id for g in batch.groups) == [f"g{i}" for i in range(groups)]
    c = broker.state.counters
    assert await wait_until(lambda: c["replay_turns_kept"] == groups * n * TURNS, 5), dict(c)
    assert c.get("replay_turns_refused", 0) == 0 and c.get("replay_turns_ignored", 0) == 0
    return dict(c), sent


async def test_a_worker_streams_several_tasks_turns_in_one_message_and_the_broker_keeps_every_turn(pool: Pool) -> None:
    _, sent = await _run_groups(pool, broker_lists_it=True)
    assert "TurnRecordBatch" in sent  # four groups' turns end together: several tasks in a pass


async def test_to_a_broker_of_the_previous_minor_the_worker_sends_one_turn_records_per_task(pool: Pool) -> None:
    _, sent = await _run_groups(pool, broker_lists_it=False)
    assert sent and set(sent) == {"TurnRecords"}


async def test_a_batch_over_the_brokers_limits_goes_task_by_task_and_every_turn_is_kept(pool: Pool) -> None:
    _, sent = await _run_groups(pool, broker_lists_it=True, batch_too_large=True)
    assert "TurnRecordBatch" in sent and "TurnRecords" in sent  # refused as one message, sent as one per task
