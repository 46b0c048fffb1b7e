"""`TurnRecordBatch` (protocol 1.29, `TURN_BATCH_MINOR`) on real sockets: the broker keeps each record of a batch as it
keeps the same `TurnRecords` sent alone (its lease's turns kept, another lease's ignored, a gap refused), and a worker of
the previous minor (which lists no `Feature.TURN_BATCH` and sends one `TurnRecords` per task) is kept as before."""

from __future__ import annotations

from typing import Any

import numpy as np

from rollpool import protocol as p
from tests.integration.broker.peers import make_prompt
from tests.integration.broker.test_broker_wire import RawWorker


def _turn(sample_index: int, turn: int) -> p.RecordedTurn:
    return p.RecordedTurn(sample_index=sample_index, turn=turn, request_digest=turn, output_ids=np.array([5, 6], dtype=np.int32),
                          logprobs=np.zeros(2, dtype=np.float32), token_versions=np.zeros(2, dtype=np.int32), finish_reason="stop")


async def test_a_batch_is_kept_record_by_record_as_the_messages_would_be_and_a_previous_minor_worker_still_streams(
        start_broker: Any) -> None:
    h = await start_broker(heartbeat_interval_s=0.2)
    c = await h.client()
    new = RawWorker(h, "new", minor=p.PROTOCOL_MINOR, capacity=4, features=p.FEATURES)
    old = RawWorker(h, "old", minor=p.TURN_BATCH_MINOR - 1, capacity=2,
                    features=tuple(f for f in p.FEATURES if f != p.Feature.TURN_BATCH))
    try:
        assert p.Feature.TURN_BATCH in (await new.hello()).features
        await c.submit([make_prompt(f"q{i}", group_size=2) for i in range(2)])
        tasks = (await new.recv(p.TaskBatch)).tasks
        await old.hello()
        await c.submit([make_prompt("r", group_size=2)])
        other = await old.recv(p.Task)
        a, b = tasks
        await new.send(p.TurnRecordBatch(records=(
            p.TurnRecords(task_id=a.task_id, prompt_id=a.prompt.prompt_id, turns=(_turn(0, 0), _turn(1, 0))),
            p.TurnRecords(task_id=b.task_id, prompt_id=b.prompt.prompt_id, turns=(_turn(0, 0),)),
            p.TurnRecords(task_id=other.task_id, prompt_id=other.prompt.prompt_id, turns=(_turn(0, 0),)),  # not its lease
            p.TurnRecords(task_id=b.task_id, prompt_id=b.prompt.prompt_id, turns=(_turn(0, 2),)),  # a gap: refused
        )))
        await old.send(p.TurnRecords(task_id=other.task_id, prompt_id=other.prompt.prompt_id, turns=(_turn(1, 0), _turn(1, 1))))
        st = h.broker.state
        await h.wait_for(lambda: st.counters["replay_turns_kept"] == 5)
        assert st.counters["replay_turns_ignored"] == 1 and st.counters["replay_turns_refused"] == 1
        kept = {pid: {i: [t.turn for t in ts] for i, ts in (st.groups[pid].turns or {}).items()} for pid in ("q0", "q1", "r")}
        assert kept == {a.prompt.prompt_id: {0: [0], 1: [0]}, b.prompt.prompt_id: {0: [0]}, "r": {1: [0, 1]}}
        assert st.counters.get("protocol_errors", 0) == 0
    finally:
        new.close()
        old.close()
