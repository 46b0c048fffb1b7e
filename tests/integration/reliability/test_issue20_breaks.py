"""The seven ways exactly-once broke when messages were lost, each reproduced on real sockets.

Each test states the behaviour the trainer relies on and failed on the code
before its fix (its strict xfail mark, removed when the fix landed). Message losses are
made by `FaultyZmtpProxy` (a fake link at the process edge: it drops one
chosen message on a live connection); stalls by SIGSTOP of a broker child
process; engines that hang or refuse a parameter are fakes at the engine
edge, named so. Settings a fix is expected to add (``apply_slot_deadline_s``)
are passed only where the config has them (`conftest.config`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from rollpool.chaos.zmtp_proxy import FaultRule
from rollpool.protocol import Credit, EngineError, Result, Task, WeightsRefusedError, trajectory_staleness
from rollpool.weights.config import WeightPathConfig
from rollpool.workers.engines.sim import SimEngine
from tests.integration.broker.peers import make_group, make_prompt
from tests.integration.reliability.conftest import Pool, sim_engine, wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(60)]


def _tensors(torch: Any, value: float, extra: bool = False) -> dict[str, Any]:
    t = {"w": torch.full((64,), value)}
    if extra:
        t["not.a.parameter"] = torch.zeros(4)
    return t


# ---------------------------------------------------------------------------------------------- break 1


@pytest.mark.parametrize("how", ["get_batch_cancelled", "batch_reply_dropped"])
async def test_break1_a_batch_for_an_abandoned_pull_still_reaches_the_trainer(pool: Pool, how: str) -> None:
    broker = await pool.start_broker(result_resend_s=1.0)  # a lost Batch is sent again with a pull 1 s on
    endpoint = broker.client_endpoint
    if how == "batch_reply_dropped":
        proxy = await pool.proxy("broker:client", endpoint)
        endpoint = proxy.endpoint
    await pool.fake_worker(broker.worker_endpoint, "w1", delay_s=0.3)
    client = await pool.client(endpoint, pull_wait_s=1.0, request_timeout_s=0.5)
    res = await client.submit([[1, 2, 3]], group_size=1)
    if how == "get_batch_cancelled":
        with pytest.raises(TimeoutError):  # the pull is parked at the broker; the group completes after
            await asyncio.wait_for(client.get_batch(1), 0.1)
    else:
        proxy.rules.append(FaultRule("batch", "drop", "down"))  # the Batch carrying the group is lost
    batch = await client.get_batch(1, timeout=3)
    assert [g.prompt_id for g in batch.groups] == res.accepted


# ---------------------------------------------------------------------------------------------- break 2


@pytest.mark.parametrize("lost", ["task", "credit"])
async def test_break2_a_lost_task_or_credit_is_reconciled_by_heartbeats(pool: Pool, lost: str) -> None:
    broker = await pool.start_broker()  # task_timeout_s stays at its default (600 s)
    proxy = await pool.proxy("broker:worker", broker.worker_endpoint)
    proxy.rules.append(FaultRule("task", "drop", "down") if lost == "task" else FaultRule("credit", "drop", "up"))
    # a one-worker pool, one sequence at a time; a worker that scores, so its credits go ahead of its results as
    # messages of their own (without scoring they travel inside the results: a lost Result is the test below)
    await pool.worker(proxy.endpoint, "w1", capacity=1, reward="rollpool.demo.task:reward")
    assert await wait_until(lambda: "w1" in broker.state.workers, 10)
    client = await pool.client(broker.client_endpoint)
    await client.submit([[1, 2, 3], [4, 5, 6]], group_size=1)
    batch = await client.get_batch(2, timeout=3)
    assert len(batch.groups) == 2
    assert proxy.total("dropped") == 1


async def test_a_lost_result_is_found_by_the_held_digest_and_reconciled(pool: Pool) -> None:
    # a heartbeat's size must not grow with what the worker holds: a real worker's heartbeats carry a count and a
    # digest of what it holds, not the list; a Result lost
    # on the live connection makes the digests disagree, the broker asks for the list, and the lease is requeued
    broker = await pool.start_broker()
    proxy = await pool.proxy("broker:worker", broker.worker_endpoint)
    proxy.rules.append(FaultRule("result", "drop", "up"))
    await pool.worker(proxy.endpoint, "w1", capacity=1)
    assert await wait_until(lambda: "w1" in broker.state.workers, 10)
    client = await pool.client(broker.client_endpoint)
    await client.submit([[1, 2, 3], [4, 5, 6]], group_size=1)
    batch = await client.get_batch(2, timeout=5)
    assert len(batch.groups) == 2 and proxy.total("dropped") == 1
    counters = broker.state.counters
    assert counters["held_checks"] >= 1 and counters["held_mismatches"] >= 1 and counters["held_lists"] >= 1
    assert counters["leases_reconciled"] == 1


async def test_a_worker_without_scoring_sends_its_credits_in_its_results(pool: Pool) -> None:
    # one message per finished task, not a Credit and a Result (fewer messages per round trip); a one-sequence worker
    # only gets its next task when the broker read the credit inside the result
    broker = await pool.start_broker()
    proxy = await pool.proxy("broker:worker", broker.worker_endpoint)
    await pool.worker(proxy.endpoint, "w1", capacity=1)
    assert await wait_until(lambda: "w1" in broker.state.workers, 10)
    client = await pool.client(broker.client_endpoint)
    await client.submit([[1, 2, 3], [4, 5, 6], [7, 8, 9]], group_size=1)
    batch = await client.get_batch(3, timeout=5)
    assert len(batch.groups) == 3
    assert proxy.total("forwarded", "up", "result") == 3 and proxy.total("forwarded", "up", "credit") == 0


# ---------------------------------------------------------------------------------------------- break 3


async def test_break3_workers_follow_the_publisher_to_its_new_endpoint(pool: Pool) -> None:
    torch = pytest.importorskip("torch")
    broker = await pool.start_broker()
    worker = await pool.worker(broker.worker_endpoint, "w1")
    trainer = await pool.fake_client(broker.client_endpoint)
    first = await pool.publisher()
    await first.publish(_tensors(torch, 1.0), 1)
    await trainer.set_version(1, first.router_endpoint, first.pub_endpoint)
    assert await wait_until(lambda: worker.weight_version == 1, 10)
    old_endpoint = first.router_endpoint
    await first.close()  # the trainer restarts: its publisher comes back on new ports

    second = await pool.publisher()
    assert second.router_endpoint != old_endpoint
    await second.publish(_tensors(torch, 2.0), 2)
    await trainer.set_version(2, second.router_endpoint, second.pub_endpoint)
    assert await wait_until(lambda: worker.weight_version == 2, 3), f"worker still at v{worker.weight_version}"


async def test_a_worker_reports_how_its_weights_arrived(pool: Pool) -> None:
    # rollpool top and the exporter read these from the worker's state: the path, the bytes per lane, the fallbacks
    torch = pytest.importorskip("torch")
    broker = await pool.start_broker()
    worker = await pool.worker(broker.worker_endpoint, "w1", weights=WeightPathConfig(weight_path="network"))  # on this host auto would take shm
    trainer = await pool.fake_client(broker.client_endpoint)
    pub = await pool.publisher()
    manifest = await pub.publish(_tensors(torch, 1.0), 1)
    await trainer.set_version(1, pub.router_endpoint, pub.pub_endpoint)
    assert await wait_until(lambda: worker.weight_version == 1, 10)
    state = worker._state_fields("ready")
    nbytes = sum(b.nbytes for b in manifest.buckets)
    assert state["weights_last_path"] == "network" and state["weights_fallbacks"] == 0
    assert state["weights_network_bytes"] == state["weights_bulk_bytes"] == nbytes  # tcp: over the bulk lane
    assert state["held_lists_sent"] == 0


async def test_a_worker_reports_each_version_s_bytes_on_the_wire_by_encoding_and_the_changed_fraction(
        pool: Pool, monkeypatch: pytest.MonkeyPatch) -> None:
    # status, top and the exporter read these: a delta version's bytes by encoding, the changed fraction it carried
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("ROLLPOOL_WEIGHT_DELTA", "1")  # the publisher's, read when it is made
    broker = await pool.start_broker()
    worker = await pool.worker(broker.worker_endpoint, "w1", weights=WeightPathConfig(weight_path="network", weight_delta=True))
    trainer = await pool.fake_client(broker.client_endpoint)
    pub = await pool.publisher()
    v1 = {"w": torch.arange(1024, dtype=torch.float32)}
    manifest = await pub.publish(v1, 1, wait_ready=True)
    await trainer.set_version(1, pub.router_endpoint, pub.pub_endpoint)
    assert await wait_until(lambda: worker.weight_version == 1, 10)
    nbytes = sum(b.nbytes for b in manifest.buckets)
    state = worker._state_fields("ready")
    assert state["weights_wire_version"] == 1 and state["weights_wire_full_bytes"] == state["weights_wire_bytes"] == nbytes
    v2 = {"w": v1["w"].clone()}
    v2["w"][[3, 500]] += 0.5  # 2 of 1024 elements change
    await pub.publish(v2, 2, wait_ready=True)
    await trainer.set_version(2, pub.router_endpoint, pub.pub_endpoint)
    assert await wait_until(lambda: worker.weight_version == 2, 10)
    state = worker._state_fields("ready")
    assert state["weights_wire_version"] == 2 and state["weights_wire_model_bytes"] == nbytes
    assert state["weights_wire_gaps_bytes"] == 2 * (2 + 4) == state["weights_wire_bytes"]  # two (gap, fp32 value) pairs
    assert state["weights_wire_changed_fraction"] == round(2 / 1024, 6) and state["weights_delta_versions"] == 1


# ---------------------------------------------------------------------------------------------- break 4


async def test_break4_a_broker_stall_is_not_worker_silence(pool: Pool) -> None:
    hb = 0.25  # dead after 3 x 0.25 = 0.75 s; each stall below is 1.5 s
    bp = pool.broker_process("--heartbeat-interval-s", str(hb), "--task-timeout-s", "60", "--drain-timeout-s", "0")
    slow = {"decode_s_per_token": 0.2, "length_median": 60}  # each group takes ~12 s: in flight across the stalls
    for i in range(2):
        await pool.worker(bp.worker_endpoint, f"w{i}", heartbeat_interval_s=hb, engine_factory=lambda: sim_engine(**slow))
    trainer = await pool.fake_client(bp.client_endpoint)

    async def counters() -> dict[str, Any]:
        return dict((await trainer.status()).counters)

    for _ in range(200):
        if (await counters())["workers_alive"] == 2:
            break
        await asyncio.sleep(0.05)
    await trainer.submit([make_prompt(f"p{i}") for i in range(4)])
    for _ in range(200):
        if (await counters())["leased"] == 4:
            break
        await asyncio.sleep(0.05)
    before = await counters()
    assert before["leased"] == 4 and before["workers_alive"] == 2
    # Whether the resumed broker reads the queued heartbeats before its lease timer fires is a race
    # (after SIGCONT its epoll_wait returns EINTR and the timers are due): four stalls make it a sure thing.
    for stall in range(4):
        bp.signal(signal.SIGSTOP)  # GC, a slow disk, a debugger: the broker reads nothing
        await asyncio.sleep(1.5)
        bp.signal(signal.SIGCONT)
        await asyncio.sleep(0.5)
        after = await counters()
        assert after["workers_lost"] == 0, (stall, after)
        assert after["requeued"] == 0, (stall, after)  # no attempt burned by the broker's own stall


# ---------------------------------------------------------------------------------------------- break 5


class HangingApplyEngine(SimEngine):
    """A fake engine at the edge: its weight update never returns (a wedged device copy)."""

    async def update_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        await asyncio.Event().wait()


@pytest.mark.parametrize("how", ["hung_apply", "grant_lost"])
async def test_break5_apply_slots_have_a_deadline_and_grants_are_answered_again(pool: Pool, how: str) -> None:
    torch = pytest.importorskip("torch")
    broker = await pool.start_broker(max_applying=1, apply_slot_deadline_s=2.0)
    trainer = await pool.fake_client(broker.client_endpoint)
    pub = await pool.publisher()
    await pub.publish(_tensors(torch, 1.0), 1)
    await trainer.set_version(1, pub.router_endpoint, pub.pub_endpoint)
    if how == "hung_apply":
        await pool.worker(broker.worker_endpoint, "hung", engine_factory=lambda: HangingApplyEngine(decode_s_per_token=0.002))
        assert await wait_until(lambda: broker.state.applying == {"hung"}, 10)  # it holds the one slot
        good = await pool.worker(broker.worker_endpoint, "good", apply_grant_timeout_s=0.5)
    else:
        proxy = await pool.proxy("broker:worker", broker.worker_endpoint)
        proxy.rules.append(FaultRule("apply_grant", "drop", "down"))
        good = await pool.worker(proxy.endpoint, "good", apply_grant_timeout_s=0.5)  # asks again after 0.5 s
    assert await wait_until(lambda: good.weight_version == 1, 4), f"{good.worker_id} still at v{good.weight_version}"


# ---------------------------------------------------------------------------------------------- break 6


class StrictNamesEngine(SimEngine):
    """A fake engine at the edge: like a real one, it refuses a parameter name its model does not have."""

    refused: list[int] = []

    async def update_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        unknown = sorted(set(named_tensors) - {"w"})
        if unknown:
            StrictNamesEngine.refused.append(version)
            raise EngineError(f"version {version}: unknown parameter names {unknown}")
        await super().update_weights(named_tensors, version)


async def test_break6_a_poison_version_is_skipped_and_the_next_one_applied(pool: Pool) -> None:
    torch = pytest.importorskip("torch")
    StrictNamesEngine.refused = []
    broker = await pool.start_broker()
    worker = await pool.worker(broker.worker_endpoint, "w1", engine_factory=lambda: StrictNamesEngine(decode_s_per_token=0.002))
    trainer = await pool.fake_client(broker.client_endpoint)
    pub = await pool.publisher()
    await pub.publish(_tensors(torch, 1.0), 1)
    await trainer.set_version(1, pub.router_endpoint, pub.pub_endpoint)
    assert await wait_until(lambda: worker.weight_version == 1, 10)
    await pub.publish(_tensors(torch, 2.0, extra=True), 2)  # the poison
    await trainer.set_version(2)
    assert await wait_until(lambda: 2 in StrictNamesEngine.refused, 10)
    await pub.publish(_tensors(torch, 3.0), 3)
    await trainer.set_version(3)
    assert await wait_until(lambda: worker.weight_version == 3, 3), f"worker at v{worker.weight_version}"
    await trainer.submit([make_prompt("after-poison")])
    (group,) = await trainer.collect(1, timeout_s=5)
    assert {int(v) for t in group.trajectories for v in t.token_versions} == {3}


class RefusingEngine(SimEngine):
    """A fake engine at the edge: it checks names before writing anything and says so (`WeightsRefusedError`),
    as the HF and SGLang engines do."""

    async def update_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        unknown = sorted(set(named_tensors) - {"w"})
        if unknown:
            raise WeightsRefusedError(f"update_weights: unknown parameter {unknown[0]!r}")
        await super().update_weights(named_tensors, version)


async def test_break6_a_refused_version_costs_no_restart_and_no_task_in_flight(pool: Pool) -> None:
    """A poison version the engine refuses before writing: reported and skipped, the engine resumed as it was.
    Before, every worker restarted its engine (backoff growing with each poison version) and handed its
    tasks back; with every worker refusing the same version at once the pool stood still."""
    torch = pytest.importorskip("torch")
    broker = await pool.start_broker()
    worker = await pool.worker(broker.worker_endpoint, "w1", engine_factory=lambda: RefusingEngine(decode_s_per_token=0.05,
                                                                                                   length_median=40))
    trainer = await pool.fake_client(broker.client_endpoint)
    pub = await pool.publisher()
    await pub.publish(_tensors(torch, 1.0), 1)
    await trainer.set_version(1, pub.router_endpoint, pub.pub_endpoint)
    assert await wait_until(lambda: worker.weight_version == 1, 10)
    await trainer.submit([make_prompt("in-flight")])
    assert await wait_until(lambda: broker.state.leased == 1, 5)
    await pub.publish(_tensors(torch, 2.0, extra=True), 2)  # the poison, while the group generates (~2 s)
    await trainer.set_version(2)
    assert await wait_until(lambda: broker.state.counters["versions_failed"] == 1, 10)
    (group,) = await trainer.collect(1, timeout_s=10)
    assert group.state == "done" and group.attempts == 1
    assert worker.supervisor.restarts == 0 and broker.state.counters["requeued"] == 0
    assert {int(v) for t in group.trajectories for v in t.token_versions} == {1} and worker.weight_version == 1


# ---------------------------------------------------------------------------------------------- break 7


@pytest.mark.parametrize("case", ["left_from_timed_out_get_batch", "empty_token_versions"])
async def test_break7_the_hard_bound_holds_for_every_group_get_batch_returns(pool: Pool, case: str) -> None:
    broker = await pool.start_broker()
    held: list[Task] = []
    fw = await pool.fake_worker(broker.worker_endpoint, "w1", version=0, auto_complete=case != "empty_token_versions",
                                on_task=held.append)
    client = await pool.client(broker.client_endpoint)
    if case == "left_from_timed_out_get_batch":
        await client.submit([[1, 2], [3, 4], [5, 6]], group_size=1)
        with pytest.raises(TimeoutError):  # 3 of 5 arrive (fresh at version 0) and stay buffered
            await client.get_batch(5, timeout=1.5)
        await client.set_version(5)
    else:
        await client.set_version(5)
        await client.submit([[1, 2]], group_size=1)
        assert await wait_until(lambda: len(held) == 1, 5)
        task = fw.inflight.pop(held[0].task_id)
        trajs = tuple(dataclasses.replace(t, token_versions=np.zeros(0, dtype=np.int32)) for t in make_group(task, "w1", 0))
        assert all(len(t.output_ids) > 0 for t in trajs)  # tokens, but no record of the version that sampled them
        await fw._send(Result(task_id=task.task_id, prompt_id=task.prompt.prompt_id, trajectories=trajs))
        await fw._send(Credit(credits=1))
    try:
        batch = await client.get_batch(1 if case == "empty_token_versions" else 3, max_staleness=1, timeout=1.5)
    except TimeoutError:
        return  # every group over the bound (or of unknown staleness) was dropped: what the trainer relies on
    for g in batch.groups:
        for t in g.trajectories:
            assert len(t.token_versions) == len(t.output_ids), "a trajectory whose staleness cannot be checked was returned"
            assert trajectory_staleness(client.version, t.token_versions) <= 1, f"staleness {trajectory_staleness(client.version, t.token_versions)}"


async def test_break5_a_hung_apply_is_bounded_on_the_worker_too(pool: Pool) -> None:
    """The worker side of break 5: a hung update_weights ends after apply_timeout_s, is reported as a
    failed apply (the slot comes back long before the broker's deadline) and the engine is restarted."""
    torch = pytest.importorskip("torch")
    broker = await pool.start_broker(max_applying=1, apply_slot_deadline_s=60.0)
    trainer = await pool.fake_client(broker.client_endpoint)
    pub = await pool.publisher()
    await pub.publish(_tensors(torch, 1.0), 1)
    await trainer.set_version(1, pub.router_endpoint, pub.pub_endpoint)
    await pool.worker(broker.worker_endpoint, "hung", apply_timeout_s=0.5,
                      engine_factory=lambda: HangingApplyEngine(decode_s_per_token=0.002))
    assert await wait_until(lambda: broker.state.counters["versions_failed"] >= 1, 10)
    assert broker.state.counters["apply_slots_expired"] == 0  # the worker gave the slot back itself
    assert await wait_until(lambda: not broker.state.applying, 5)
