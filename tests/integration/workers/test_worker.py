"""The worker against a scripted broker: a real ROUTER socket speaking protocol messages."""

from __future__ import annotations

import asyncio
import pathlib
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import msgpack
import numpy as np
import pytest

from rollpool.protocol import PROTOCOL_MINOR, SUPPORTED_MAJORS, decode, encode
from rollpool.protocol.errors import RequestRefusedError, WeightSyncError
from rollpool.protocol.messages import (
    ApplyDone,
    ApplyGrant,
    ApplyRequest,
    BrokerHeartbeat,
    Cancel,
    Credit,
    Feature,
    FinishReason,
    Goodbye,
    Hello,
    Nack,
    Prompt,
    Result,
    SamplingParams,
    Task,
    TaskBatch,
    Trajectory,
    Welcome,
    WorkerHeartbeat,
)
from rollpool.protocol.metrics import MemoryMetricsSink
from rollpool.protocol.sockets import SocketFactory
from rollpool.workers.config import WorkerConfig
from rollpool.workers.engines.base import Engine
from rollpool.workers.engines.sim import SimEngine
from rollpool.workers.worker import Worker

HB = 0.1


class ScriptedBroker:
    """A ROUTER that records what one worker sends and answers only what a test tells it to."""

    def __init__(self, sockets: SocketFactory, endpoint: str) -> None:
        self.sock = sockets.router(endpoint)
        self.identity: bytes | None = None
        self.received: list[tuple[float, Any]] = []
        self.raw: list[list[bytes]] = []
        """Every message's frames as received (the identity left off)."""
        self.welcomed: Hello | None = None
        """The Hello last answered with a Welcome: a repeat of it (the worker said hello again before the
        Welcome reached it, as it does on a loaded machine) is skipped by `expect`."""

    async def recv(self, timeout_s: float = 10.0) -> Any:
        frames = await asyncio.wait_for(self.sock.recv_multipart(), timeout_s)
        self.identity = frames[0]
        self.raw.append(frames[1:])
        msg = decode(frames[1:])
        self.received.append((time.monotonic(), msg))
        return msg

    async def expect(self, kind: type[Any], timeout_s: float = 10.0, skip: tuple[type[Any], ...] = (WorkerHeartbeat, Credit)) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            msg = await self.recv(max(0.01, deadline - time.monotonic()))
            if isinstance(msg, kind):
                return msg
            if isinstance(msg, Hello) and self.welcomed is not None and (msg.worker_id, msg.pid) == (self.welcomed.worker_id, self.welcomed.pid):
                continue
            assert isinstance(msg, skip), f"expected {kind.__name__}, got {msg!r}"

    async def until_inflight(self, *task_ids: str, timeout_s: float = 10.0, skip: tuple[type[Any], ...] = (Credit,)) -> WorkerHeartbeat:
        """The first heartbeat that lists every one of `task_ids` in flight (so their runners have started)."""
        deadline = time.monotonic() + timeout_s
        while True:
            msg = await self.expect(WorkerHeartbeat, max(0.01, deadline - time.monotonic()), skip=skip)
            if set(task_ids) <= set(msg.inflight_task_ids):
                return msg  # type: ignore[no-any-return]

    async def send(self, msg: Any) -> None:
        assert self.identity is not None
        await self.sock.send_multipart([self.identity, *encode(msg)])

    async def welcome(self, epoch: str = "e1", **kw: Any) -> Hello:
        hello = await self.expect(Hello)
        await self.send(Welcome(epoch=epoch, protocol=max(SUPPORTED_MAJORS), heartbeat_interval_s=HB, **kw))
        self.welcomed = hello
        return hello


def task(i: int, n: int = 2, max_new: int = 8, **sampling: Any) -> Task:
    sp = SamplingParams(max_new_tokens=max_new, seed=i, **sampling)
    prompt = Prompt(prompt_id=f"p{i}", input_ids=np.arange(3, 9, dtype=np.int32), group_size=n, sampling=sp, metadata={"answer": i})
    return Task(task_id=f"p{i}@0", prompt=prompt, attempt=0, queued_at=123.0)


async def fake_subscriber(worker: Worker, broker: ScriptedBroker) -> FakeWeightSubscriber:
    """The fake the worker made when it handled the welcome (a heartbeat of the new epoch comes after that)."""
    await broker.expect(WorkerHeartbeat, skip=(Credit,))
    sub = worker.weights.subscriber
    assert isinstance(sub, FakeWeightSubscriber), "the worker made no weight subscriber"
    return sub


class FakeWeightSubscriber:
    """Stands in for rollpool.weights.WeightSubscriber (same methods), serving versions from a dict."""

    def __init__(self, sockets: Any, *, worker_id: str, fetch_timeout_s: float, window_chunks: int, max_refetch: int,
                 pin_memory: bool = False, stage_device: str | None = None, weights: Any = None) -> None:
        self.versions: dict[int, dict[str, Any]] = {}
        self.manifests: dict[int, Any] = {}
        """A version's manifest where a test gives one (an adapter version's carries its `AdapterSpec`)."""
        self.connected: tuple[str, str | None] | None = None
        self.noted: list[int] = []
        self._changed = asyncio.Event()
        self.closed = False
        self.recycled: list[int] = []
        self.fetches: list[int] = []
        self.broken: set[int] = set()
        self.gone: set[int] = set()
        """Versions the fake publisher no longer serves (evicted): their fetch raises `WeightVersionGoneError`."""
        self.fetched = asyncio.Event()

    def connect(self, router_endpoint: str, pub_endpoint: str | None) -> None:
        self.connected = (router_endpoint, pub_endpoint)

    def latest_known(self) -> int:
        return max(self.versions, default=-1)

    def note_version(self, v: int) -> None:
        self.noted.append(v)

    def publish(self, version: int, tensors: dict[str, Any], manifest: Any = None) -> None:
        self.versions[version] = tensors
        self.manifests[version] = manifest
        self._changed.set()

    async def wait_for_newer(self, than: int) -> int:
        while self.latest_known() <= than:
            self._changed.clear()
            await self._changed.wait()
        return self.latest_known()

    async def fetch(self, version: int | None = None, on_bucket: Any = None) -> Any:
        v = self.latest_known() if version is None else version
        self.fetches.append(v)
        self.fetched.set()
        if v in self.broken:
            raise WeightSyncError(f"bucket 0 of version {v} failed verification")
        if v in self.gone:
            from rollpool.weights.paths.base import WeightVersionGoneError

            raise WeightVersionGoneError(v, f"version {v} is no longer served (latest is {self.latest_known()})")
        if on_bucket is not None:
            on_bucket(0, self.versions[v])  # the whole version as one verified bucket

        class WeightVersion:
            pass

        wv = WeightVersion()
        wv.version, wv.tensors, wv.manifest = v, self.versions[v], self.manifests.get(v)  # type: ignore[attr-defined]
        return wv

    def recycle(self, old: Any) -> None:
        self.recycled.append(old.version)

    def forget_newer(self, version: int) -> None:
        pass  # the versions are the test's to publish

    def reserve_in_background(self, total_bytes: int, versions: int = 2) -> None:
        pass

    def close(self) -> None:
        self.closed = True


@pytest.fixture
async def harness(zmq_ctx: Any, ipc_endpoint: Callable[[str], str]) -> AsyncIterator[Callable[..., Any]]:
    sockets = SocketFactory(zmq_ctx)
    made: list[tuple[Worker, asyncio.Task[None], ScriptedBroker]] = []

    async def make(engine_factory: Callable[[], Engine] | None = None, **cfg: Any) -> tuple[Worker, ScriptedBroker, asyncio.Task[None]]:
        endpoint = ipc_endpoint("broker")
        broker = ScriptedBroker(sockets, endpoint)
        options = dict(broker=endpoint, worker_id="w1", heartbeat_interval_s=HB, reconnect_backoff_s=0.2, restart_backoff_s=0.05, drain_timeout_s=5.0, missed_heartbeats=1000)
        options.update(cfg)
        config = WorkerConfig(**options)
        factory = engine_factory or (lambda: SimEngine(decode_s_per_token=0.001, length="fixed", length_median=6, capacity=4, vocab=300))
        worker = Worker(config, sockets, metrics=MemoryMetricsSink(), engine_factory=factory, subscriber_factory=FakeWeightSubscriber)
        run = asyncio.create_task(worker.run())
        made.append((worker, run, broker))
        return worker, broker, run

    yield make
    for worker, run, broker in made:
        worker.stop()
        try:
            await asyncio.wait_for(run, 10)
        except Exception:  # noqa: BLE001 - teardown only
            run.cancel()
        broker.sock.close(linger=0)


def _check_trajectory(t: Trajectory, tk: Task, version: int) -> None:
    n_out = len(t.output_ids)
    assert t.prompt_id == tk.prompt.prompt_id and t.trajectory_id == f"{tk.prompt.prompt_id}:{t.sample_index}"
    assert t.input_ids.tolist() == tk.prompt.input_ids.tolist()  # type: ignore[union-attr]
    assert len(t.output_logprobs) == len(t.token_versions) == len(t.loss_mask) == n_out > 0
    assert set(t.token_versions.tolist()) == {version} and t.loss_mask.tolist() == [1] * n_out
    assert t.finish_reason in FinishReason.ALL and t.worker_id == "w1" and t.attempt == tk.attempt
    assert t.queued_at == 123.0 and 0 < t.started_at <= t.first_token_at <= t.finished_at
    assert t.metadata["answer"] == tk.prompt.metadata["answer"]


async def test_hello_tasks_results_and_credits(harness: Callable[..., Any]) -> None:
    worker, broker, _run = await harness()
    hello = await broker.welcome()
    assert hello.worker_id == "w1" and hello.capacity == 4 and hello.credits == 4
    assert hello.protocol_min <= max(SUPPORTED_MAJORS) <= hello.protocol_max
    assert hello.fingerprint and hello.engine == "sim" and hello.engine_info["simulated"] is True
    credit = hello.credits
    inflight: dict[str, Task] = {}
    sent = 0
    results: dict[str, Result] = {}
    while len(results) < 6:
        while sent < 6 and credit >= 2:
            tk = task(sent)
            await broker.send(tk)
            inflight[tk.task_id] = tk
            credit -= 2
            sent += 1
        msg = await broker.recv()
        if isinstance(msg, Credit):
            credit += msg.credits
        elif isinstance(msg, Result):
            results[msg.task_id] = msg
            inflight.pop(msg.task_id)
        # the broker's view of the credit never exceeds what the engine has free
        assert 0 <= credit <= 4 - worker.session.engine_seqs()
        assert not isinstance(msg, Nack)
    assert credit == 4  # every credit came back (each before its result), none twice
    for task_id, res in results.items():
        tk = task(int(task_id[1:].split("@")[0]))
        assert res.error is None and len(res.trajectories) == 2
        assert sorted(t.sample_index for t in res.trajectories) == [0, 1]
        for t in res.trajectories:
            _check_trajectory(t, tk, 0)
            assert t.metadata["simulated"] is True
    state = worker.metrics.states[("worker", "w1")]  # type: ignore[attr-defined]
    assert {"host", "pid", "engine", "model", "weight_version", "state", "inflight", "credits", "tokens_total", "tokens_per_s", "last_seen"} <= set(state)


async def test_a_task_batch_is_run_as_its_tasks_one_by_one_each_once(harness: Callable[..., Any]) -> None:
    """The worker lists Feature.TASK_BATCH (the broker then sends several tasks to it in one message, as it does to the
    bench's simulated workers): each task of a batch runs once and gives one result, a task sent again is not rerun."""
    worker, broker, _run = await harness()
    hello = await broker.welcome()
    assert Feature.TASK_BATCH in hello.features
    t0, t1 = task(0), task(1)
    await broker.send(TaskBatch(tasks=(t0, t1)))
    await broker.send(TaskBatch(tasks=(t1,)))  # a re-send of one it holds (after a lost heartbeat, say): not run twice
    results: dict[str, Result] = {}
    deadline = time.monotonic() + 10
    while len(results) < 2:
        msg = await broker.expect(Result, max(0.01, deadline - time.monotonic()))
        assert msg.task_id not in results
        results[msg.task_id] = msg
    for tk in (t0, t1):
        res = results[tk.task_id]
        assert res.error is None and sorted(t.sample_index for t in res.trajectories) == [0, 1]
        for t in res.trajectories:
            _check_trajectory(t, tk, 0)
    with pytest.raises(TimeoutError):
        await broker.expect(Result, 0.5)  # no third result


@pytest.mark.parametrize("broker_minor", [0, PROTOCOL_MINOR])
async def test_results_carry_arrays_inline_only_to_a_broker_that_settled_on_minor_12(harness: Callable[..., Any], broker_minor: int) -> None:
    """The worker says its minor in the hello; a Welcome settling on 12 makes its small arrays travel in the header, one
    without a minor (a broker of minor 11, which would refuse them) keeps every array in a frame."""
    worker, broker, _run = await harness()
    hello = await broker.welcome(protocol_minor=broker_minor)
    assert hello.protocol_minor == PROTOCOL_MINOR
    await broker.send(task(0, n=1))
    result = await broker.expect(Result)
    frames = broker.raw[-1]
    assert result.error is None and len(result.trajectories) == 1
    _check_trajectory(result.trajectories[0], task(0, n=1), 0)
    header = msgpack.unpackb(frames[0])[3]["trajectories"][0]
    if broker_minor >= 12:
        assert len(frames) == 1 and type(header["output_ids"]) is bytes and worker.link.inline is not None
    else:
        assert len(frames) == 6 and type(header["output_ids"]) is int and worker.link.inline is None


async def test_task_beyond_capacity_is_handed_back(harness: Callable[..., Any]) -> None:
    _worker, broker, _run = await harness()
    await broker.welcome()
    await broker.send(task(1, n=4, max_new=200, ignore_eos=True))
    await broker.send(task(2, n=1))
    nack = await broker.expect(Nack)
    assert nack.task_ids == ("p2@0",) and nack.reason == "over_credit"


async def test_heartbeats_keep_their_beat_while_the_hf_engine_computes(harness: Callable[..., Any], tiny_model_dir: pathlib.Path) -> None:
    """Heartbeats interleave with the decoding itself: no wall-clock bound, the engine's own step counter is the clock.

    A worker whose loop stalled while the engine computed would send its heartbeats only around the work
    (before the first step, after the last): here they arrive all through it, so no stretch of more than a
    quarter of the decode steps passes without one."""
    from rollpool.workers.engines.hf import HFEngine

    engine = HFEngine(model=str(tiny_model_dir), capacity=8, num_threads=1)
    _worker, broker, _run = await harness(lambda: engine)
    await broker.welcome()
    for i in range(3):
        await broker.send(task(i, n=2, max_new=700, ignore_eos=True, temperature=1.0))
    steps_at_beat: list[int] = []
    results = 0
    while results < 3:
        msg = await broker.recv(10)
        if isinstance(msg, WorkerHeartbeat):
            steps_at_beat.append(engine.stats["decode_steps"])
        elif isinstance(msg, Result):
            assert msg.error is None and all(len(t.output_ids) == 700 for t in msg.trajectories)
            assert all(t.output_text is not None for t in msg.trajectories)
            results += 1
    total = engine.stats["decode_steps"]
    during = sorted({s for s in steps_at_beat if 0 < s < total})
    assert total >= 500 and len(during) >= 4, (total, steps_at_beat)  # 700 tokens: ~700 batched steps
    gaps = np.diff([0, *during, total])
    assert gaps.max() <= total // 4, f"{gaps.max()} of {total} decode steps passed without a heartbeat: {steps_at_beat}"


async def test_new_broker_epoch_brings_a_hello_with_the_inflight_tasks(harness: Callable[..., Any]) -> None:
    _worker, broker, _run = await harness()
    await broker.welcome(epoch="e1")
    await broker.send(task(1, n=2, max_new=300, ignore_eos=True))
    await broker.until_inflight("p1@0")
    await broker.send(BrokerHeartbeat(epoch="e2"))
    hello = await broker.expect(Hello, skip=(WorkerHeartbeat, Credit))
    assert [t.task_id for t in hello.inflight] == ["p1@0"] and hello.inflight[0].group_size == 2
    assert hello.credits == 2
    await broker.send(Welcome(epoch="e2", protocol=1, heartbeat_interval_s=HB, adopted=("p1@0",)))
    result = await broker.expect(Result, timeout_s=10)
    assert result.task_id == "p1@0" and len(result.trajectories) == 2


@pytest.mark.parametrize("started", [True, False], ids=["generating", "just-received"])
async def test_cancelled_task_gives_no_result_and_returns_its_credits(harness: Callable[..., Any], started: bool) -> None:
    """A cancel right behind its task (before the runner reached the engine) must stop it too: 100 s of generation otherwise."""
    _worker, broker, _run = await harness()
    await broker.welcome()
    await broker.send(task(1, n=2, max_new=100_000, ignore_eos=True))
    if started:
        await broker.until_inflight("p1@0")
    await broker.send(Cancel(task_ids=("p1@0",)))
    credit = await broker.expect(Credit, skip=(WorkerHeartbeat,))
    assert credit.credits == 2
    await broker.send(task(2, n=1))
    result = await broker.expect(Result, skip=(WorkerHeartbeat, Credit))
    assert result.task_id == "p2@0"


async def test_engine_crash_hands_back_tasks_and_restarts(harness: Callable[..., Any]) -> None:
    engines: list[SimEngine] = []

    def factory() -> SimEngine:
        e = SimEngine(decode_s_per_token=0.001, length="fixed", length_median=6, capacity=4, vocab=300)
        engines.append(e)
        return e

    worker, broker, _run = await harness(factory)
    await broker.welcome()
    await broker.send(task(1, n=2, max_new=5000, ignore_eos=True))
    await broker.until_inflight("p1@0")
    engines[0].inject_crash()
    nack = await broker.expect(Nack)
    assert nack.task_ids == ("p1@0",)
    hello = await broker.welcome()
    assert hello.credits == 4 and hello.inflight == ()
    assert len(engines) == 2 and worker.engine is engines[1] and worker.restarts == 1
    await broker.send(task(2, n=2))
    result = await broker.expect(Result)
    assert result.task_id == "p2@0" and result.error is None


class RefusingSimEngine(SimEngine):
    """A sim engine whose request check refuses ``top_p == 0`` with `RequestRefusedError` (the engine seam's
    refusal), and whose other failures are an engine bug: ``top_p == 0.5`` raises a plain ValueError."""

    async def generate(self, input_ids: Any, n: int, sampling: SamplingParams, request_id: str, **kw: Any) -> Any:
        if sampling.top_p == 0.0:
            raise RequestRefusedError(f"top_p must be in (0, 1], got {sampling.top_p}")
        if sampling.top_p == 0.5:
            raise ValueError("a bug inside the engine")
        return await super().generate(input_ids, n, sampling, request_id, **kw)


def _refusing() -> SimEngine:
    return RefusingSimEngine(decode_s_per_token=0.001, length="fixed", length_median=6, capacity=4, vocab=300)


async def test_refused_prompt_is_a_non_retryable_result(harness: Callable[..., Any]) -> None:
    worker, broker, _run = await harness(_refusing)
    await broker.welcome()
    await broker.send(task(1, n=1, top_p=0.0))
    credit = await broker.expect(Credit)
    result = await broker.expect(Result)
    assert credit.credits == 1
    assert result.error and "top_p" in result.error and result.retryable is False
    assert worker.restarts == 0


async def test_top_or_prompt_logprobs_on_an_engine_that_does_not_report_them_are_refused_not_ignored(harness: Callable[..., Any]) -> None:
    worker, broker, _run = await harness()  # the sim engine: no top logprobs
    await broker.welcome()
    await broker.send(task(1, n=2, top_logprobs_num=3))
    credit = await broker.expect(Credit)
    result = await broker.expect(Result)
    assert credit.credits == 2 and not result.trajectories and result.retryable is False
    assert result.error and "top_logprobs_num=3" in result.error and "sim engine" in result.error
    await broker.send(task(2, n=1, logprob_start_len=0))
    refused = await broker.expect(Result)
    assert refused.error and "logprob_start_len=0" in refused.error and "prompt logprobs" in refused.error
    await broker.send(task(3, n=1))  # and it keeps serving
    assert (await broker.expect(Result)).trajectories


async def test_any_other_engine_exception_is_an_engine_failure_not_a_refusal(harness: Callable[..., Any]) -> None:
    worker, broker, _run = await harness(_refusing)
    await broker.welcome()
    await broker.send(task(1, n=1, top_p=0.5))
    nack = await broker.expect(Nack)
    assert nack.task_ids == ("p1@0",) and nack.reason.startswith("engine_failed: ValueError")
    hello = await broker.welcome()
    assert worker.restarts == 1 and hello.credits == 4


async def test_stop_drains_then_hands_back_the_rest_and_says_goodbye(harness: Callable[..., Any]) -> None:
    worker, broker, run = await harness(drain_timeout_s=0.5)
    await broker.welcome()
    await broker.send(task(1, n=1, max_new=50, ignore_eos=True))  # ~50 ms: finishes within the drain
    await broker.send(task(2, n=1, max_new=100_000, ignore_eos=True))  # cannot finish
    await broker.until_inflight("p2@0", skip=(Credit, Result))  # p1 was sent first: both runners started
    worker.stop()
    await broker.send(task(3, n=1))  # arrives while draining
    await broker.expect(Goodbye, skip=(WorkerHeartbeat, Credit, Result, Nack))
    await asyncio.wait_for(run, 5)
    seen: dict[type[Any], list[Any]] = {}
    for _t, msg in broker.received:
        seen.setdefault(type(msg), []).append(msg)
    assert [r.task_id for r in seen[Result]] == ["p1@0"]
    handed = {tid for n in seen[Nack] for tid in n.task_ids}
    assert handed == {"p2@0", "p3@0"}
    assert worker.stopped_cleanly


async def test_weight_version_is_fetched_granted_applied_and_tagged(harness: Callable[..., Any]) -> None:
    worker, broker, _run = await harness()
    await broker.welcome(weight_endpoint="tcp://fake:1", announce_endpoint="tcp://fake:2", weight_version=-1)
    sub = await fake_subscriber(worker, broker)
    assert sub.connected == ("tcp://fake:1", "tcp://fake:2")
    sub.publish(1, {})
    req = await broker.expect(ApplyRequest)
    assert req.version == 1 and worker.weight_version == 0  # nothing applied before the grant
    await broker.send(ApplyGrant(version=1))
    done = await broker.expect(ApplyDone)
    assert done.ok and done.version == 1
    await broker.send(task(1))
    result = await broker.expect(Result)
    assert all(set(t.token_versions.tolist()) == {1} for t in result.trajectories)
    beat = await broker.expect(WorkerHeartbeat, skip=(Credit,))
    assert beat.weight_version == 1


class BucketStagingSim(SimEngine):
    """A sim engine with the SGLang engine's `stage_bucket` hook (records what it was given; `fail` makes it raise)."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__(decode_s_per_token=0.001, length="fixed", length_median=6, capacity=4, vocab=300)
        self.staged_buckets: list[tuple[int, list[str]]] = []
        self.fail = fail

    def stage_bucket(self, version: int, tensors: dict[str, Any]) -> None:
        self.staged_buckets.append((version, sorted(tensors)))
        if self.fail:
            raise RuntimeError("device copy failed")


@pytest.mark.parametrize("fail", [False, True])
async def test_each_verified_bucket_is_handed_to_the_engines_stage_bucket_during_the_fetch(harness: Callable[..., Any], fail: bool) -> None:
    engines: list[BucketStagingSim] = []

    def make() -> BucketStagingSim:
        engines.append(BucketStagingSim(fail=fail))
        return engines[-1]

    worker, broker, _run = await harness(engine_factory=make)
    await broker.welcome(weight_endpoint="tcp://fake:1", announce_endpoint="tcp://fake:2", weight_version=-1)
    sub = await fake_subscriber(worker, broker)
    sub.publish(1, {})
    req = await broker.expect(ApplyRequest)
    assert req.version == 1 and engines[-1].staged_buckets == [(1, [])]  # staged before the grant was even asked for
    await broker.send(ApplyGrant(version=1))
    done = await broker.expect(ApplyDone)
    assert done.ok and done.version == 1  # a staging hook that raises only costs the overlap


async def test_failed_apply_restarts_the_engine_and_applies_the_whole_version(harness: Callable[..., Any]) -> None:
    engines: list[SimEngine] = []

    def factory() -> SimEngine:
        e = SimEngine(decode_s_per_token=0.001, length="fixed", length_median=6, capacity=4, vocab=300)
        engines.append(e)
        return e

    worker, broker, _run = await harness(factory)
    await broker.welcome(weight_endpoint="tcp://fake:1")
    engines[0].inject_apply_failure()
    (await fake_subscriber(worker, broker)).publish(3, {"w": np.zeros(4, dtype=np.float32)})
    await broker.expect(ApplyRequest)
    await broker.send(ApplyGrant(version=3))
    done = await broker.expect(ApplyDone)
    assert not done.ok and done.error
    hello = await broker.welcome()
    assert hello.weight_version == 3
    assert len(engines) == 2 and engines[1].version == 3 and engines[1].applied_bytes == 16
    assert worker.weight_version == 3


async def test_reward_function_scores_and_its_failure_is_data(harness: Callable[..., Any]) -> None:
    _worker, broker, _run = await harness(reward=f"{__name__}:length_reward")
    await broker.welcome()
    await broker.send(task(1, n=2))
    await broker.send(task(2, n=2))
    results = [await broker.expect(Result), await broker.expect(Result)]
    by_id = {r.task_id: r for r in results}
    for t in by_id["p1@0"].trajectories:
        assert t.reward == float(len(t.output_ids))
    for t in by_id["p2@0"].trajectories:
        assert t.reward is None and "boom" in t.metadata["reward_error"]


def length_reward(metadata: Mapping[str, Any], trajectory: Trajectory) -> float:
    if metadata["answer"] == 2:
        raise RuntimeError("boom")
    return float(len(trajectory.output_ids))


class StagingSimEngine(SimEngine):
    """A sim engine that also stages versions (like the sglang engine), recording the order of calls."""

    def __init__(self, events: list[tuple[str, int]], **kw: Any) -> None:
        super().__init__(**kw)
        self.events = events

    async def stage_weights(self, named_tensors: Any, version: int) -> None:
        self.events.append(("stage", version))

    async def pause(self, mode: str) -> None:
        self.events.append(("pause", self.version))
        await super().pause(mode)

    async def update_weights(self, named_tensors: Any, version: int) -> None:
        self.events.append(("update", version))
        await super().update_weights(named_tensors, version)


async def test_versions_are_staged_before_the_pause_and_old_buffers_recycled(harness: Callable[..., Any]) -> None:
    events: list[tuple[str, int]] = []
    worker, broker, _run = await harness(lambda: StagingSimEngine(events, decode_s_per_token=0.001, length="fixed", length_median=6, capacity=4, vocab=300))
    await broker.welcome(weight_endpoint="tcp://fake:1", weight_version=-1)
    sub = await fake_subscriber(worker, broker)
    for v in (1, 2):
        sub.publish(v, {"w": np.full(4, v, dtype=np.float32)})
        req = await broker.expect(ApplyRequest)
        assert req.version == v and ("stage", v) in events  # staged while still generating, before any grant
        await broker.send(ApplyGrant(version=v))
        assert (await broker.expect(ApplyDone)).ok
    assert events == [("stage", 1), ("pause", 0), ("update", 1), ("stage", 2), ("pause", 1), ("update", 2)]
    assert sub.recycled == [1]  # version 2 is applied: version 1's buffers go back, version 2's are kept for restarts
    assert worker.weight_version == 2


async def test_a_version_whose_grant_never_comes_is_skipped_after_bounded_asks(harness: Callable[..., Any]) -> None:
    worker, broker, _run = await harness(apply_grant_timeout_s=0.05, weight_retries=2)
    await broker.welcome(weight_endpoint="tcp://fake:1", weight_version=-1)
    sub = await fake_subscriber(worker, broker)
    sub.publish(1, {})
    asks = [await broker.expect(ApplyRequest), await broker.expect(ApplyRequest)]
    assert [a.version for a in asks] == [1, 1]
    gave_up = await broker.expect(ApplyDone)  # the worker gives up on 1 (no third ask) and tells the broker why
    assert gave_up.version == 1 and gave_up.skipped and not gave_up.ok and "no apply grant for version 1 after 2 asks" in (gave_up.error or "")
    sub.publish(2, {})  # and follows the next version
    req = await broker.expect(ApplyRequest)
    assert req.version == 2 and worker.weights.skipped == 1 and worker.weight_version == 0
    await broker.send(ApplyGrant(version=2))
    assert (await broker.expect(ApplyDone)).ok and worker.weight_version == 2


async def test_a_version_that_fails_on_a_restarted_engine_too_is_skipped_and_the_last_good_one_kept(harness: Callable[..., Any]) -> None:
    engines: list[SimEngine] = []

    def factory() -> SimEngine:
        e = SimEngine(decode_s_per_token=0.001, length="fixed", length_median=6, capacity=4, vocab=300)
        if len(engines) == 1:
            e.inject_apply_failure()  # the first restarted engine cannot take the new version either
        engines.append(e)
        return e

    worker, broker, _run = await harness(factory)
    await broker.welcome(weight_endpoint="tcp://fake:1", weight_version=-1)
    sub = await fake_subscriber(worker, broker)
    sub.publish(1, {"w": np.ones(4, dtype=np.float32)})
    await broker.expect(ApplyRequest)
    await broker.send(ApplyGrant(version=1))
    assert (await broker.expect(ApplyDone)).ok
    engines[0].inject_apply_failure()
    sub.publish(2, {"w": np.full(4, 2, dtype=np.float32)})
    await broker.expect(ApplyRequest)
    await broker.send(ApplyGrant(version=2))
    failed = await broker.expect(ApplyDone)
    assert not failed.ok and not failed.skipped  # the serving engine's failure: the restarted engine tries again
    gave_up = await broker.expect(ApplyDone)
    assert gave_up.version == 2 and gave_up.skipped and "failed to apply on the serving engine and on a restarted one" in (gave_up.error or "")
    hello = await broker.welcome()
    assert hello.weight_version == 1 and worker.weight_version == 1 and worker.weights.skipped == 2
    assert len(engines) == 3 and engines[2].version == 1  # the third engine took the last good version
    await broker.send(task(1))
    result = await broker.expect(Result)
    assert all(set(t.token_versions.tolist()) == {1} for t in result.trajectories)


async def test_a_version_that_cannot_be_fetched_is_skipped_after_bounded_retries(harness: Callable[..., Any]) -> None:
    worker, broker, _run = await harness(weight_retries=3, reconnect_backoff_s=0.01)
    await broker.welcome(weight_endpoint="tcp://fake:1", weight_version=-1)
    sub = await fake_subscriber(worker, broker)
    sub.broken.add(1)
    sub.publish(1, {})
    while len(sub.fetches) < 3:
        sub.fetched.clear()
        await asyncio.wait_for(sub.fetched.wait(), 10)
    assert worker.weights.skipped == 1 and sub.fetches == [1, 1, 1]  # weight_retries fetches, then it gives up
    gave_up = await broker.expect(ApplyDone)
    assert gave_up.version == 1 and gave_up.skipped and "fetch failed 3 times" in (gave_up.error or "")
    sub.publish(2, {})
    req = await broker.expect(ApplyRequest)
    assert req.version == 2
    await broker.send(ApplyGrant(version=2))
    assert (await broker.expect(ApplyDone)).ok and worker.weight_version == 2 and sub.fetches == [1, 1, 1, 2]
