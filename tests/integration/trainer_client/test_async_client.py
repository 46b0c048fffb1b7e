"""The asyncio `TrainerClient` against a real broker on real ipc sockets (in process) and scripted workers.

These reach the client's own paths (acknowledgement after return, the stale bound and regeneration,
a broker restart seen as a new epoch, timeouts, an absent broker) while the test can look at both
ends: what the broker holds and what a worker was sent.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import pytest

from rollpool import protocol as p
from rollpool.protocol import BrokerUnavailableError, GroupState, Prompt, SamplingParams
from rollpool.trainer_client import TrainerClient, TrainerClientConfig, UnfillableBatchError
from tests.integration.broker.peers import FakeWorker, make_group

SAMPLING = SamplingParams(max_new_tokens=7, temperature=0.3, top_p=0.9, top_k=5, stop=("\n",), seed=11)


def differing_fields(a: Prompt, b: Prompt) -> list[str]:
    """The fields other than prompt_id in which two prompts differ."""
    out = []
    for f in dataclasses.fields(Prompt):
        x, y = getattr(a, f.name), getattr(b, f.name)
        same = np.array_equal(x, y) if isinstance(x, np.ndarray) or isinstance(y, np.ndarray) else x == y
        if f.name != "prompt_id" and not same:
            out.append(f.name)
    return out


class TaggingWorker(FakeWorker):
    """A scripted worker whose trajectories carry keys of its own in their metadata, as real workers add them."""

    async def complete(self, task_id: str, *, version: int | None = None, credit: bool = True) -> None:
        task = self.inflight.pop(task_id)
        group = make_group(task, self.worker_id, self.version if version is None else version)
        tagged = tuple(dataclasses.replace(t, metadata={**task.prompt.metadata, "simulated": True, "reward_error": "x"}) for t in group)
        await self._send(p.Result(task_id=task_id, prompt_id=task.prompt.prompt_id, trajectories=tagged))
        if credit:
            await self._send(p.Credit(credits=task.prompt.group_size))


async def test_groups_come_back_whole_once_and_are_acknowledged_only_after_return(inproc_pool: Any) -> None:
    await inproc_pool.worker(capacity=8)
    client = await inproc_pool.client()
    broker = inproc_pool.broker
    result = await client.submit([[1, 2, i] for i in range(6)], group_size=3, sampling=SAMPLING)
    assert len(result.accepted) == 6 and not result.rejected and client.pending() == 6
    seen: list[str] = []
    first = await client.get_batch(4, timeout=10)
    assert all(g.state == GroupState.DONE and len(g.trajectories) == 3 for g in first.groups)
    seen += [t.trajectory_id for t in first.trajectories]
    assert broker.state.counters["acked"] == 0  # returned, not yet acknowledged: a crash now gets them redelivered
    second = await client.get_batch(2, timeout=10)
    seen += [t.trajectory_id for t in second.trajectories]
    assert broker.state.counters["acked"] == 4  # the first batch went with the next pull
    assert len(seen) == 18 and len(set(seen)) == 18 and client.pending() == 0
    assert client.counters["groups_delivered"] == 6 and second.stats["rollout/groups"] == 2.0
    await client.close()  # the last batch is acknowledged at close
    await inproc_pool.wait_for(lambda: broker.state.counters["acked"] == 6 and broker.state.held == 0)


async def test_regenerate_stale_resubmits_the_original_prompt(inproc_pool: Any) -> None:
    """F3: the resubmission was rebuilt from a trajectory (default sampling, no priority, no text or
    chat-template flag, no evaluation flag, the worker's metadata keys leaking in)."""
    originals = {
        q.prompt_id: q
        for q in (
            Prompt(prompt_id="by-ids", input_ids=np.array([4, 5, 6], np.int32), group_size=2, sampling=SAMPLING, priority=3,
                   metadata={"answer": "42"}, exempt_from_staleness=True),
            Prompt(prompt_id="by-text", text="2+2?", apply_chat_template=True, group_size=2, sampling=SAMPLING,
                   metadata={"answer": "4"}),
        )
    }
    again: list[p.Task] = []

    def on_task(task: p.Task) -> None:
        if task.prompt.prompt_id not in originals:
            again.append(task)
            worker.version = 5  # the regenerated groups come back fresh

    worker = await inproc_pool.worker(kind=TaggingWorker, capacity=8, on_task=on_task)
    client = await inproc_pool.client(stale_policy="regenerate")
    await client.set_version(5)  # the worker is at version 0: the first results are 5 versions old
    assert (await client.submit(list(originals.values()))).accepted == list(originals)
    batch = await client.get_batch(2, max_staleness=2, timeout=10)
    assert client.counters["dropped_stale"] == 2 and client.counters["regenerated_stale"] == 2
    assert sorted(g.prompt_id for g in batch.groups) == sorted(t.prompt.prompt_id for t in again)
    assert len(again) == 2
    by_answer = {q.metadata["answer"]: q for q in originals.values()}
    for task in again:
        original = by_answer[task.prompt.metadata["answer"]]
        assert differing_fields(original, task.prompt) == [], (original, task.prompt)
    assert client.pending() == 0
    # every prompt is told of once: the stale originals beside the batch, each naming its successor
    regenerated_as = {r.prompt_id: r.regenerated_as for r in batch.reports if r.state == "dropped_stale"}
    assert sorted(regenerated_as) == sorted(originals) and sorted(regenerated_as.values()) == sorted(g.prompt_id for g in batch.groups)
    # the stale originals were released as dropped_stale; of the regenerated groups only the one that is not an
    # evaluation prompt (exempt_from_staleness) uses admission capacity, as its original did
    await inproc_pool.wait_for(lambda: inproc_pool.broker.state.staleness.accepted == 2)


async def test_keep_delivers_stale_groups_with_their_staleness_and_they_keep_their_capacity(inproc_pool: Any) -> None:
    await inproc_pool.worker(kind=TaggingWorker, capacity=8)  # at version 0
    client = await inproc_pool.client(stale_policy="keep", max_staleness_keep=4)
    await client.set_version(3)
    await client.submit([Prompt(prompt_id=f"k{i}", input_ids=np.array([i, 1], np.int32), group_size=2, sampling=SAMPLING)
                         for i in range(2)])
    batch = await client.get_batch(2, max_staleness=1, timeout=10)
    assert sorted(g.prompt_id for g in batch.groups) == ["k0", "k1"] and batch.other == []
    assert batch.kept_stale == 4 and client.counters["kept_stale"] == 4 and client.counters["dropped_stale"] == 0
    assert [s.staleness for s in batch.samples()] == [3, 3, 3, 3] and batch.version == 3
    assert [r.staleness for r in batch.reports] == [3, 3]
    # per call, drop overrides keep: a later group this stale is dropped and reported
    await client.submit([Prompt(prompt_id="d0", input_ids=np.array([9, 1], np.int32), group_size=2, sampling=SAMPLING),
                         Prompt(prompt_id="d1", input_ids=np.array([8, 1], np.int32), group_size=2, sampling=SAMPLING)])
    with pytest.raises(TimeoutError):
        await client.get_batch(1, max_staleness=1, timeout=1.0, stale_policy="drop")
    assert client.counters["dropped_stale"] == 2
    await client.close()
    # kept groups were trained on: acknowledged plainly, their samples stay in the broker's accepted count
    await inproc_pool.wait_for(lambda: inproc_pool.broker.state.staleness.accepted == 4)


async def test_a_broker_restart_resubmits_every_undelivered_prompt_whole(inproc_pool: Any) -> None:
    lost = await inproc_pool.worker("lost", auto_complete=False, capacity=8)
    client = await inproc_pool.client()
    prompts = [Prompt(prompt_id=f"r{i}", input_ids=np.array([i, 1], np.int32), group_size=2, sampling=SAMPLING,
                      priority=i, metadata={"i": i}) for i in range(3)]
    await client.set_version(3)
    await client.submit(prompts)
    await inproc_pool.wait_for(lambda: len(lost.inflight) == 3)
    first_epoch = client.epoch
    await lost.vanish()  # the worker and everything the broker held are gone
    await inproc_pool.stop_broker()
    await inproc_pool.start_broker()  # same endpoints, a new epoch
    fresh = await inproc_pool.worker("fresh", capacity=8)
    batch = await client.get_batch(3, timeout=15)
    assert client.epoch != first_epoch and client.counters["broker_restarts"] == 1
    assert client.counters["resubmitted"] == 3
    assert inproc_pool.broker.state.version == 3  # the trainer's version was announced to the new broker
    assert sorted(g.prompt_id for g in batch.groups) == ["r0", "r1", "r2"]
    assert len({t.trajectory_id for t in batch.trajectories}) == 6
    sent = {t.prompt.prompt_id: t.prompt for t in fresh.tasks}
    for q in prompts:
        assert differing_fields(q, sent[q.prompt_id]) == []


async def test_a_get_batch_timeout_loses_nothing(inproc_pool: Any) -> None:
    worker = await inproc_pool.worker(auto_complete=False, capacity=8)
    client = await inproc_pool.client()
    await client.submit([[1], [2]], group_size=1)
    await inproc_pool.wait_for(lambda: len(worker.inflight) == 2)
    first, second = list(worker.inflight)
    await worker.complete(first)
    with pytest.raises(TimeoutError):
        await client.get_batch(2, timeout=0.3)
    await worker.complete(second)
    batch = await client.get_batch(2, timeout=10)
    assert len(batch.groups) == 2 and client.pending() == 0


async def test_failed_groups_come_back_beside_the_next_batch(inproc_pool: Any) -> None:
    worker = await inproc_pool.worker(auto_complete=False, capacity=8)
    client = await inproc_pool.client()
    result = await client.submit([[1], [2]], group_size=1)
    await inproc_pool.wait_for(lambda: len(worker.inflight) == 2)
    by_prompt = {t.prompt.prompt_id: tid for tid, t in worker.inflight.items()}
    bad, good = result.accepted
    await worker.fail(by_prompt[bad], error="refused: too long", retryable=False)
    await worker.complete(by_prompt[good])
    batch = await client.get_batch(1, timeout=10)
    assert [g.prompt_id for g in batch.groups] == [good]
    assert [(g.prompt_id, g.state) for g in batch.other] == [(bad, GroupState.FAILED)] and "too long" in batch.other[0].reason
    assert client.counters["failed"] == 1 and client.pending() == 0


async def test_status_and_control_reach_the_workers(inproc_pool: Any) -> None:
    await inproc_pool.worker("w0")
    client = await inproc_pool.client()
    status = await client.status()
    assert status["epoch"] == inproc_pool.broker.epoch and "w0" in status["workers"] and status["client"]["submitted"] == 0
    replies = await client.sleep()
    assert replies["w0"]["ok"] is True and replies["w0"]["op"] == "sleep"


async def test_an_absent_broker_raises_broker_unavailable(zmq_ctx: Any, ipc_endpoint: Any) -> None:
    client = TrainerClient(config=TrainerClientConfig(broker=ipc_endpoint("nobody"), request_timeout_s=0.05, request_retries=2),
                           sockets=p.SocketFactory(zmq_ctx))
    try:
        with pytest.raises(BrokerUnavailableError, match="did not answer after 2 attempts"):
            await client.connect()
    finally:
        await client.close()


async def test_publish_weights_hosts_the_publisher_and_names_it_to_the_broker(inproc_pool: Any) -> None:
    torch = pytest.importorskip("torch")
    client = await inproc_pool.client()
    manifest = await client.publish_weights({"w": torch.arange(4, dtype=torch.float32)}, version=1)
    assert manifest.version == 1 and client.version == 1
    broker = inproc_pool.broker
    assert broker.state.version == 1 and broker.weight_endpoint and broker.weight_endpoint.startswith("tcp://127.0.0.1:")
    # a new broker epoch learns the version and the publisher's endpoints again from the client
    await inproc_pool.stop_broker()
    fresh = await inproc_pool.start_broker()
    await client.status()
    assert fresh.state.version == 1 and fresh.weight_endpoint == broker.weight_endpoint


async def test_cancel_ends_live_groups_cancelled_reported_once_beside_a_later_batch(inproc_pool: Any) -> None:
    client = await inproc_pool.client()
    result = await client.submit([[1, 2, i] for i in range(3)], group_size=2, sampling=SAMPLING)
    ids = result.accepted
    out = await client.cancel(ids[:2] + ["never-submitted"])
    assert sorted(out["cancelled"]) == sorted(ids[:2]) and out["not_cancelled"] == ["never-submitted"]
    with pytest.raises(TimeoutError):
        await client.get_batch(1, timeout=0.5)  # no worker: nothing DONE, but the cancellations arrive
    assert client.pending_ids() == [ids[2]] and client.counters["cancelled"] == 2
    await inproc_pool.worker(capacity=8)
    batch = await client.get_batch(1, timeout=10)
    assert [g.prompt_id for g in batch.groups] == [ids[2]]
    assert sorted(g.prompt_id for g in batch.other) == sorted(ids[:2]) and {g.state for g in batch.other} == {GroupState.CANCELLED}
    assert client.pending() == 0
    await client.close()


async def test_reserve_weights_at_set_up_leaves_the_publishes_nothing_to_allocate(inproc_pool: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.delenv("ROLLPOOL_WEIGHT_PATH", raising=False)
    from rollpool.weights.config import WeightPathConfig

    client = await inproc_pool.client(weights=WeightPathConfig(weight_path="network", pinned_budget_bytes=0), pool="p7")
    tensors = {"w": torch.arange(1024, dtype=torch.float32), "b": torch.zeros(8, dtype=torch.bfloat16)}
    nbytes = 1024 * 4 + 8 * 2
    assert await client.reserve_weights(tensors) == 2 * nbytes  # keep_versions versions of the layout
    pub = client.publisher
    assert pub is not None and pub.path == "network"  # the config's path, not the environment's
    made = pub.stats["buffers_allocated"]
    for v in (1, 2, 3):
        tensors["w"].add_(1)
        await client.publish_weights(tensors, version=v)
    assert pub.stats["buffers_allocated"] == made and pub.stats["pinned_bytes"] == 0
    with pytest.raises(Exception, match="weight_path"):
        await inproc_pool.client(weights=WeightPathConfig(weight_path="smoke-signals"))


@pytest.mark.parametrize("broker_minor", [0, p.PROTOCOL_MINOR])
async def test_prompts_travel_inline_only_to_a_broker_that_settled_on_minor_12(zmq_ctx: Any, ipc_endpoint: Any, broker_minor: int) -> None:
    """The client says its minor in its hello; a ClientWelcome settling on 12 makes a prompt's token ids travel in the
    Submit's header, one without a minor (a broker of minor 11, which would refuse them) keeps them in a frame."""
    import asyncio

    import msgpack

    sockets = p.SocketFactory(zmq_ctx)
    endpoint = ipc_endpoint("raw-broker")
    router = sockets.router(endpoint)
    client = TrainerClient(config=TrainerClientConfig(broker=endpoint, request_timeout_s=5.0, request_retries=1), sockets=sockets)

    async def broker() -> list[bytes]:
        ident, *frames = await router.recv_multipart()
        hello = p.decode(frames)
        assert type(hello) is p.ClientHello and hello.protocol_minor == p.PROTOCOL_MINOR
        await router.send_multipart([ident, *p.encode(p.ClientWelcome(epoch="e1", protocol=1, protocol_minor=broker_minor))])
        ident, *frames = await router.recv_multipart()
        sub = p.decode(frames)
        assert type(sub) is p.Submit
        await router.send_multipart([ident, *p.encode(p.SubmitReply(request_id=sub.request_id, epoch="e1",
                                                                  accepted=tuple(x.prompt_id for x in sub.prompts)))])
        return [bytes(f) for f in frames]

    served = asyncio.create_task(broker())
    try:
        await client.connect()
        result = await client.submit([[5, 6, 7]])
        frames = await asyncio.wait_for(served, 10)
        assert len(result.accepted) == 1
        ids = msgpack.unpackb(frames[0])[3]["prompts"][0]["input_ids"]
        if broker_minor >= 12:
            assert len(frames) == 1 and ids == np.array([5, 6, 7], "<i4").tobytes()
        else:
            assert len(frames) == 2 and ids == 1 and frames[1] == np.array([5, 6, 7], "<i4").tobytes()
    finally:
        served.cancel()
        await client.close()
        router.close(linger=0)


async def test_a_prompt_with_unservable_sampling_is_rejected_before_it_is_sent(inproc_pool: Any) -> None:
    client = await inproc_pool.client()
    result = await client.submit([[1, 2, 3]], sampling={"temperature": float("nan")})
    ok = await client.submit([[1, 2, 3]], sampling=SAMPLING)
    ((pid, reason),) = result.rejected.items()
    assert not result.accepted and reason.startswith("invalid_sampling: temperature")
    assert len(ok.accepted) == 1 and inproc_pool.broker.state.counters["submitted"] == 1
    assert client.pending() == 1 and pid not in ok.accepted


class EpochWorker(FakeWorker):
    """Stamps its trajectories with the version epoch of its weights (`version_epoch`), as a worker of protocol
    `EPOCH_MINOR` does; with ``previous_minor`` it sends its results as a worker of the minor before does: that
    minor's number in the header and no ``version_epoch`` on a trajectory."""

    version_epoch = 0
    previous_minor = False

    async def complete(self, task_id: str, *, version: int | None = None, credit: bool = True) -> None:
        import msgpack

        task = self.inflight.pop(task_id)
        group = tuple(dataclasses.replace(t, version_epoch=self.version_epoch)
                      for t in make_group(task, self.worker_id, self.version if version is None else version))
        frames = p.encode(p.Result(task_id=task_id, prompt_id=task.prompt.prompt_id, trajectories=group))
        if self.previous_minor:
            header = msgpack.unpackb(frames[0])
            header[1] = p.EPOCH_MINOR - 1
            for t in header[3]["trajectories"]:
                del t["version_epoch"]
            frames = [msgpack.packb(header), *frames[1:]]
        await self.sock.send_multipart(frames)
        if credit:
            await self._send(p.Credit(credits=task.prompt.group_size))


async def _held(inproc_pool: Any, n: int) -> None:
    await inproc_pool.wait_for(lambda: inproc_pool.broker.state.held == n)


async def test_after_a_rebase_groups_made_on_the_abandoned_run_come_back_as_other_not_as_fresh(inproc_pool: Any) -> None:
    """The run reached version 5 with groups held for the trainer; it rebases to 2 (a checkpoint) and goes on. The
    held groups were made by version 5 of the abandoned run: reported in ``other`` (abandoned_run), never in
    ``groups``, where the new run's version 3 would make their staleness read -2 today. What the new run makes is
    delivered; so is what a worker of the previous minor sends (it does not say its run: judged by staleness)."""
    worker = await inproc_pool.worker(kind=EpochWorker, version=5, capacity=8)
    client = await inproc_pool.client()
    await client.set_version(5)
    first = await client.submit([[1, 2, i] for i in range(3)], group_size=2, sampling=SAMPLING)
    await _held(inproc_pool, 3)
    await client.rebase_version(2)
    epoch = inproc_pool.broker.state.version_epoch
    worker.version, worker.version_epoch = 3, epoch  # applied the new run's version 3
    fresh = await client.submit([[9, 9, 9]], group_size=2, sampling=SAMPLING)
    batch = await client.get_batch(1, timeout=10)
    assert [g.prompt_id for g in batch.groups] == fresh.accepted
    assert {t.version_epoch for t in batch.trajectories} == {epoch} and {int(v) for t in batch.trajectories for v in t.token_versions} == {3}
    assert sorted(g.prompt_id for g in batch.other) == sorted(first.accepted)
    assert all(g.state == GroupState.DROPPED_STALE and g.reason.startswith("abandoned_run") for g in batch.other)
    assert client.counters["dropped_abandoned"] == 3
    # a worker of the previous minor: its trajectories say no epoch (-1), so the trainer judges them by staleness only
    worker.previous_minor = True
    old = await client.submit([[8, 8, 8]], group_size=2, sampling=SAMPLING)
    batch = await client.get_batch(1, timeout=10)
    assert [g.prompt_id for g in batch.groups] == old.accepted and {t.version_epoch for t in batch.trajectories} == {-1}
    await client.close()
    await inproc_pool.wait_for(lambda: inproc_pool.broker.state.held == 0)  # the abandoned ones were released too


async def test_get_batch_raises_at_once_when_more_groups_are_asked_for_than_can_ever_arrive(inproc_pool: Any) -> None:
    """Submitting 3 prompts and asking for 8 hung forever (no timeout given) without a word."""
    await inproc_pool.worker(capacity=8)
    client = await inproc_pool.client()
    await client.submit([[1, 2, i] for i in range(3)], group_size=2, sampling=SAMPLING)
    with pytest.raises(UnfillableBatchError, match=r"get_batch\(8\) can never be filled") as info:
        await client.get_batch(8)  # no timeout: it must not wait for what cannot come
    assert "Submit more prompts, or ask for fewer" in str(info.value)
    batch = await client.get_batch(3, timeout=10)  # nothing was lost: the 3 groups are still delivered
    assert len(batch.groups) == 3 and client.pending() == 0
    with pytest.raises(UnfillableBatchError, match=r"0 groups here, 0 of this client's prompts pending"):
        await client.get_batch(1)


async def test_get_batch_waits_for_groups_another_client_submitted_and_says_so_periodically(
        inproc_pool: Any, caplog: pytest.LogCaptureFixture) -> None:
    worker = await inproc_pool.worker(capacity=8, auto_complete=False)  # leases them and stays silent
    submitter = await inproc_pool.client(client_id="submitter")
    consumer = await inproc_pool.client(client_id="consumer", wait_log_s=0.2)
    await submitter.submit([[1, 2, i] for i in range(2)], group_size=1, sampling=SAMPLING)
    await inproc_pool.wait_for(lambda: len(worker.inflight) == 2)
    caplog.set_level(logging.WARNING, logger="rollpool.trainer_client.client")
    # nothing pending for the consumer, but the broker holds 2 leased groups that may still come: it waits
    with pytest.raises(TimeoutError):
        await consumer.get_batch(2, timeout=1.5)
    waiting = [r.getMessage() for r in caplog.records if "is waiting" in r.getMessage()]
    assert len(waiting) >= 2, waiting
    assert "get_batch(2) is waiting after" in waiting[0] and "2 leased" in waiting[0]
