"""The versioned-service contract on real sockets: a real `Broker`, real `Worker`s on the sim engine (simulated
tokens), a real `TrainerClient` publishing real (zero-byte) weight versions.

* exact-version groups across a version change: each is delivered with every sampled token of its version, or
  FAILED at once with the reason once no worker holds it; none is left waiting;
* version convergence in `status()` and `wait_for_version`;
* fleet activation: the staged workers switch together; a worker that never stages is held out at the
  deadline, counted, and given no work while the others serve the new version;
* a client of the previous protocol minor is served by this broker.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import numpy as np
import pytest

from rollpool import protocol as p
from rollpool.protocol.messages import Prompt, SamplingParams
from rollpool.trainer_client.client import TrainerClient
from tests.integration.broker.peers import OldBroker
from tests.integration.reliability.conftest import Pool, sim_engine, wait_until


@pytest.fixture
async def pool(zmq_ctx: Any, tmp_path: Any) -> AsyncIterator[Pool]:
    pl = Pool(zmq_ctx, tmp_path)
    try:
        yield pl
    finally:
        await pl.close()


def prompt(pid: str, tokens: int = 30) -> Prompt:
    return Prompt(prompt_id=pid, input_ids=np.arange(3, 9, dtype=np.int32), group_size=2, sampling=SamplingParams(max_new_tokens=tokens))


async def collect(client: TrainerClient, ids: set[str], timeout_s: float) -> dict[str, p.GroupResult]:
    """Every group of `ids` in its terminal state (the ones that failed come by `take_ended`, with no DONE one beside them)."""
    got: dict[str, p.GroupResult] = {}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not ids <= got.keys():
        assert loop.time() < deadline, f"stuck: {sorted(ids - got.keys())}"
        for g in await client.take_ended(timeout=0.2):
            got[g.prompt_id] = g
        try:
            batch = await client.get_batch(1, timeout=0.2)
        except TimeoutError:
            continue
        for g in batch.groups + batch.other:
            got[g.prompt_id] = g
    return got


async def test_exact_version_groups_are_served_only_at_their_version_or_fail_at_once_when_it_is_gone(pool: Pool) -> None:
    broker = await pool.start_broker()
    for i in range(2):  # 30 tokens at 2 ms: a group takes about 60 ms, so the version change lands mid-stream
        await pool.worker(broker.worker_endpoint, f"w{i}", engine_factory=lambda: sim_engine(length_median=30, capacity=4))
    client = await pool.client(broker.client_endpoint)
    st = broker.state
    await client.publish_weights({}, 0)
    await client.wait_for_version(0, timeout=10)
    ids = {f"a{i}" for i in range(24)}
    res = await client.submit([prompt(pid) for pid in sorted(ids)], exact_weight_version=0)
    assert sorted(res.accepted) == sorted(ids)
    await asyncio.sleep(0.1)
    await client.publish_weights({}, 1)
    got = await collect(client, ids, 30)
    done = [g for g in got.values() if g.state == p.GroupState.DONE]
    gone = [g for g in got.values() if g.state != p.GroupState.DONE]
    assert done, "no group finished before the change"
    for g in done:
        for t in g.trajectories:
            assert set(t.token_versions.tolist()) == {0} and t.version_start == t.version_end == 0
    for g in gone:
        assert g.state == p.GroupState.FAILED and g.reason.startswith("exact_version_unavailable"), g.reason
    info = await client.wait_for_version(1, fraction=1.0, timeout=10)
    assert info["workers_at"] == info["workers"] == 2
    # now version 0 is gone: refused at submit with the reason, and version 1 is served
    res = await client.submit([prompt("late0")], exact_weight_version=0)
    assert res.rejected == {"late0": "exact_version_unavailable"} and "no longer served" in res.details["late0"]
    res = await client.submit([prompt("b")], exact_weight_version=1)
    [g] = (await collect(client, {"b"}, 10)).values()
    assert g.state == p.GroupState.DONE and all(set(t.token_versions.tolist()) == {1} for t in g.trajectories)
    status = await client.status()
    assert [r["version"] for r in status["versions"]["converged"]][-2:] == [0, 1]
    assert status["counters"]["convergence_last_version"] == 1 and status["counters"]["convergence_p95_s"] > 0
    assert st.queued == 0 and st.leased == 0


async def test_fleet_activation_switches_together_and_holds_out_a_worker_that_never_stages(pool: Pool) -> None:
    broker = await pool.start_broker(activation="fleet", fleet_stage_deadline_s=1.0)
    workers = [await pool.worker(broker.worker_endpoint, f"w{i}", engine_factory=lambda: sim_engine(length_median=4)) for i in range(3)]
    stuck = await pool.fake_worker(broker.worker_endpoint, "stuck", version=0)  # never fetches, never asks to apply
    client = await pool.client(broker.client_endpoint)
    st = broker.state
    assert await wait_until(lambda: len(st.workers) == 4, 5)
    await client.publish_weights({}, 0)  # the sim engines start at version 0
    await client.publish_weights({}, 1)
    # the three real workers stage it and wait; the fake one never does: at the deadline the three switch together
    assert await wait_until(lambda: all(st.workers[f"w{i}"].version == 1 for i in range(3)), 10)
    assert st.counters["fleet_holdouts"] == 1 and st.counters["fleet_deadline_activations"] == 1
    tasks_before = len(stuck.tasks)
    ids = {f"p{i}" for i in range(12)}
    await client.submit([prompt(pid, tokens=4) for pid in sorted(ids)])
    got = await collect(client, ids, 20)
    assert all(g.state == p.GroupState.DONE for g in got.values())
    assert len(stuck.tasks) == tasks_before  # held out: nothing dispatched to the worker on the old version
    assert all(int(t.token_versions.min()) == 1 for g in got.values() for t in g.trajectories)
    status = await client.status()
    assert status["counters"]["fleet_held_out"] == 1 and status["workers"]["stuck"]["held_out"] is True
    # the next version: every live worker stages it (the held-out one left), one activation, no deadline
    await stuck.goodbye()
    assert await wait_until(lambda: "stuck" not in st.workers, 5)
    await client.publish_weights({}, 2)
    assert await wait_until(lambda: all(w.weights.version == 2 for w in workers), 10)
    await client.wait_for_version(2, timeout=5)
    status = await client.status()
    c = status["counters"]
    assert c["activation"] == "fleet" and c["fleet_version"] == 2 and c["fleet_activations"] == 2 and c["fleet_deadline_activations"] == 1
    rounds = status["versions"]["fleet_rounds"]
    assert [r["version"] for r in rounds] == [1, 2] and rounds[0]["held_out"] == ["stuck"] and rounds[1]["switched"] == 3
    assert c["fleet_activation_skew_p95_ms"] >= 0.0 and c["fleet_held_out"] == 0


async def test_a_client_of_the_previous_minor_submits_and_is_served(pool: Pool) -> None:
    broker = await pool.start_broker()
    await pool.worker(broker.worker_endpoint, "w0")
    sock: Any = pool.sockets.dealer(broker.client_endpoint, identity=b"old")
    old = p.PROTOCOL_MINOR - 1

    async def send(msg: Any) -> Any:
        frames = p.encode(msg)
        major, _minor, kind, fields = msgpack.unpackb(frames[0])
        frames[0] = msgpack.packb([major, old, kind, fields], use_bin_type=True)
        await sock.send_multipart(frames)
        return p.decode(await asyncio.wait_for(sock.recv_multipart(), 5))

    try:
        welcome = await send(p.ClientHello(client_id="old", protocol_min=1, protocol_max=1, protocol_minor=old))
        assert isinstance(welcome, p.ClientWelcome) and welcome.protocol_minor == old
        reply = await send(p.Submit(request_id="r1", prompts=(Prompt(prompt_id="q", input_ids=np.arange(3, dtype=np.int32)),)))
        assert isinstance(reply, p.SubmitReply) and reply.accepted == ("q",)
        batch = await send(p.Pull(request_id="r2", max_groups=1, wait_s=5.0))
        assert isinstance(batch, p.Batch) and [g.prompt_id for g in batch.groups] == ["q"]
    finally:
        sock.close(linger=0)


async def test_a_client_refuses_to_send_an_exact_version_to_a_broker_that_would_ignore_it(pool: Pool) -> None:
    """A broker of the minor before `CONTRACT_MINOR` (a ROUTER answering the hello as one) would serve such a group at
    any version: the client raises before sending the prompts, and sends plain ones."""
    old = OldBroker(pool.sockets, p.CONTRACT_MINOR - 1).start()
    submits = old.submits
    try:
        client = await pool.client(old.endpoint)
        with pytest.raises(p.RejectedError, match="exact_weight_version"):
            await client.submit([prompt("x")], exact_weight_version=0)
        assert submits == [] and client.pending() == 0
        res = await client.submit([prompt("y")])
        assert res.accepted == ["y"] and len(submits) == 1
    finally:
        await old.close()


async def test_the_rollout_pool_serves_an_exact_version_and_refuses_one_that_is_gone(pool: Pool) -> None:
    from rollpool.trainer_client.pool import RolloutPool

    broker = await pool.start_broker()
    await pool.worker(broker.worker_endpoint, "w0")
    client = await pool.client(broker.client_endpoint)
    await client.publish_weights({}, 0)
    rp = await asyncio.to_thread(RolloutPool, broker.client_endpoint, timeout_s=20.0)
    try:
        out = await asyncio.to_thread(rp.generate, input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4}, exact_weight_version=0)
        assert isinstance(out, dict) and out["meta_info"]["weight_version_start"] == out["meta_info"]["weight_version_end"] == 0
        await client.publish_weights({}, 1)
        await client.wait_for_version(1, timeout=10)
        with pytest.raises(p.RejectedError, match="exact_version_unavailable.*no longer served"):
            await asyncio.to_thread(rp.generate, input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4}, exact_weight_version=0)
    finally:
        await asyncio.to_thread(rp.shutdown)
