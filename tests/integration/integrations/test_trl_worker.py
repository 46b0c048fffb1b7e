"""rollpool.integrations.trl against a real broker and sim workers (real processes, real sockets), with a
real TRL `AsyncGRPOConfig` and the demo's real tokenizer: the rollout worker's flow, its bad inputs, the
weight transfer's versions."""

from __future__ import annotations

import pathlib
import queue
import threading
import time
from typing import Any

import pytest

pytest.importorskip("trl")
torch = pytest.importorskip("torch")

from datasets import Dataset, IterableDataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from trl.experimental.async_grpo import AsyncGRPOConfig  # noqa: E402

from rollpool.demo import task  # noqa: E402
from rollpool.integrations.trl import TRLRolloutConfig, rollpool_backend  # noqa: E402
from rollpool.protocol import ConfigError  # noqa: E402
from rollpool.trainer_client import SyncTrainerClient, TrainerClientConfig  # noqa: E402

SIM = "decode_s_per_token=0.0005,length_median=3,capacity=64"
FAST = TRLRolloutConfig(pull_timeout_s=0.3, put_timeout_s=0.1, status_interval_s=0.2, no_workers_timeout_s=3.0, stop_timeout_s=10.0)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    d = task.build_demo_model(tmp_path_factory.mktemp("model"), hidden=8, layers=1, heads=2)
    return AutoTokenizer.from_pretrained(d)


def _args(tmp: pathlib.Path, **kw: Any) -> AsyncGRPOConfig:
    base: dict[str, Any] = dict(output_dir=str(tmp / "out"), per_device_train_batch_size=16, num_generations=4,
                                max_completion_length=4, max_staleness=2, token_budget=0, report_to="none", use_cpu=True)
    return AsyncGRPOConfig(**{**base, **kw})


def _dataset(n: int = 50) -> Dataset:
    return Dataset.from_dict({"prompt": [f"<s> {i % 10} {(i * 3) % 10} <sep>" for i in range(n)], "answer_id": [5 + i % 10 for i in range(n)]})


def _client(pool: Any) -> SyncTrainerClient:
    return SyncTrainerClient(pool.client_ep, config=TrainerClientConfig(broker=pool.client_ep, request_timeout_s=3.0, request_retries=5))


def _wait_workers(client: SyncTrainerClient, n: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(client.status()["workers"]) < n:
        assert time.monotonic() < deadline, f"fewer than {n} workers joined within {timeout_s} s"
        time.sleep(0.1)


def _take(buf: queue.Queue[Any], n: int, timeout_s: float = 30.0) -> list[Any]:
    out = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n:
        out.append(buf.get(timeout=max(0.1, deadline - time.monotonic())))
    return out


def _rollout_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "rollpool-trl-rollouts"]


def test_groups_become_samples_versions_follow_trl_and_stop_cancels_what_is_in_flight(pool_factory: Any, tokenizer: Any, tmp_path: pathlib.Path) -> None:
    pool = pool_factory()
    pool.start_broker()
    pool.start_sim_workers(count=2, options=SIM)
    client = _client(pool)
    _wait_workers(client, 2)
    try:
        worker, transfer = rollpool_backend(client, train_dataset=_dataset(), args=_args(tmp_path), processing_class=tokenizer,
                                            reward_funcs=lambda completion_ids, **_: [float(len(c)) for c in completion_ids], config=FAST)
        transfer.init_weight_transfer()
        transfer.pause()
        transfer.send_weights(iter([("w", torch.ones(3)), ("b", torch.zeros(2))]))  # TRL's cold sync
        transfer.resume()
        worker.update_model_version(1)
        assert transfer.published == [1] and client.version == 1
        worker.start()
        samples = _take(worker.rollout_buffer, 40)
        worker.check_health(60.0)
        by_group: dict[int, list[Any]] = {}
        for s in samples:
            by_group.setdefault(s.group_id, []).append(s)
            n_prompt = int((s.completion_mask == 0).sum())
            assert s.input_ids[:n_prompt].tolist()[0] == task.BOS_ID
            assert int(s.completion_mask.sum()) == len(s.input_ids) - n_prompt >= 1
            assert s.model_version in (0, 1)  # sim workers fetch version 1 or are still at 0
        whole = [g for g, ss in by_group.items() if len(ss) == 4]
        assert whole and all(isinstance(g, int) for g in by_group)
        transfer.send_weights(iter([("w", torch.full((3,), 2.0)), ("b", torch.zeros(2))]))
        worker.update_model_version(2)
        assert client.version == 2 and transfer.published == [1, 2]
        worker.stop()
        transfer.destroy()
        assert not _rollout_threads()
        assert client.pending() == 0  # every group still in flight was cancelled and reported
        c = worker.counters
        assert c["duplicated"] == 0 and c["groups_submitted"] == c["groups_delivered"] + c["groups_cancelled"] + c["groups_done_after_stop"]
    finally:
        client.close()


def test_a_dataset_without_prompts_is_refused_and_rows_without_one_are_counted_skips(pool_factory: Any, tokenizer: Any, tmp_path: pathlib.Path) -> None:
    pool = pool_factory()
    pool.start_broker()
    pool.start_sim_workers(count=1, options=SIM)
    client = _client(pool)
    _wait_workers(client, 1)
    try:
        with pytest.raises(ConfigError, match="no 'prompt' column"):
            rollpool_backend(client, train_dataset=Dataset.from_dict({"question": ["a"]}), args=_args(tmp_path),
                             processing_class=tokenizer, config=FAST)
        with pytest.raises(ConfigError, match="repetition_penalty"):
            rollpool_backend(client, train_dataset=_dataset(), args=_args(tmp_path, repetition_penalty=1.2),
                             processing_class=tokenizer, config=FAST)
        with pytest.raises(NotImplementedError, match="episodes"):
            rollpool_backend(client, train_dataset=_dataset(), args=_args(tmp_path), processing_class=tokenizer,
                             tools=[print], config=FAST)

        def rows() -> Any:
            for i in range(1000):
                yield {"prompt": "<s> 1 2 <sep>", "answer_id": 6} if i % 2 else {"question": "no prompt here"}

        worker, transfer = rollpool_backend(client, train_dataset=IterableDataset.from_generator(rows), args=_args(tmp_path),
                                            processing_class=tokenizer, config=FAST)
        worker.start()
        _take(worker.rollout_buffer, 8)
        worker.check_health(60.0)
        worker.stop()
        transfer.destroy()
        assert worker.counters["rows_without_prompt"] >= 2 and worker.counters["groups_delivered"] >= 2
    finally:
        client.close()


def test_a_reward_function_that_raises_skips_its_group_counted_and_the_rest_flows(pool_factory: Any, tokenizer: Any, tmp_path: pathlib.Path) -> None:
    pool = pool_factory()
    pool.start_broker()
    pool.start_sim_workers(count=2, options=SIM)
    client = _client(pool)
    _wait_workers(client, 2)
    calls = iter(range(1_000_000))

    def flaky(completion_ids: list[list[int]], **_: Any) -> list[float]:
        if next(calls) % 2 == 0:
            raise RuntimeError("judge unavailable")
        return [1.0] * len(completion_ids)

    try:
        worker, transfer = rollpool_backend(client, train_dataset=_dataset(), args=_args(tmp_path), processing_class=tokenizer,
                                            reward_funcs=flaky, config=FAST)
        worker.start()
        _take(worker.rollout_buffer, 12)
        worker.check_health(60.0)  # a reward error is a counted skip, not a failure
        worker.stop()
        transfer.destroy()
        assert worker.counters["reward_errors"] >= 3
        assert worker.counters["samples_delivered"] == 4 * (worker.counters["groups_delivered"]) >= 12
    finally:
        client.close()


def test_a_pool_that_loses_every_worker_fails_check_health_in_bounded_time(pool_factory: Any, tokenizer: Any, tmp_path: pathlib.Path) -> None:
    pool = pool_factory()
    pool.start_broker()
    pool.start_sim_workers(count=2, options=SIM)
    client = _client(pool)
    _wait_workers(client, 2)
    try:
        worker, transfer = rollpool_backend(client, train_dataset=_dataset(), args=_args(tmp_path), processing_class=tokenizer, config=FAST)
        worker.start()
        _take(worker.rollout_buffer, 4)
        pool.procs["workers"].kill()  # SIGKILL: both sim workers gone
        pool.procs["workers"].wait(10)
        deadline = time.monotonic() + 30
        with pytest.raises(RuntimeError, match="no live worker"):
            while time.monotonic() < deadline:
                worker.check_health(60.0)
                time.sleep(0.2)
        worker.stop()
        transfer.destroy()
        assert not _rollout_threads()
        assert client.pending() == 0  # the groups left in the broker were cancelled and reported at stop
    finally:
        client.close()


def test_a_trainer_stopped_mid_step_stops_a_worker_blocked_on_a_full_buffer(pool_factory: Any, tokenizer: Any, tmp_path: pathlib.Path) -> None:
    pool = pool_factory()
    pool.start_broker()
    pool.start_sim_workers(count=2, options=SIM)
    client = _client(pool)
    _wait_workers(client, 2)
    try:
        worker, transfer = rollpool_backend(client, train_dataset=_dataset(), args=_args(tmp_path, queue_maxsize=6),
                                            processing_class=tokenizer, config=FAST)
        worker.start()
        deadline = time.monotonic() + 30
        while not worker.rollout_buffer.full():  # nobody consumes: the loop blocks on put
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
        worker.check_health(60.0)  # blocked on the trainer is not a hang
        t0 = time.monotonic()
        worker.stop()
        transfer.destroy()
        assert time.monotonic() - t0 < 20
        assert not _rollout_threads()
        assert client.pending() == 0
        assert worker.counters["samples_not_put_at_stop"] >= 1
    finally:
        client.close()


def test_send_weights_refuses_an_empty_or_ambiguous_stream(pool_factory: Any, tokenizer: Any, tmp_path: pathlib.Path) -> None:
    pool = pool_factory()
    pool.start_broker()
    client = _client(pool)
    try:
        _worker, transfer = rollpool_backend(client, train_dataset=_dataset(), args=_args(tmp_path), processing_class=tokenizer, config=FAST)
        with pytest.raises(ValueError, match="no tensors"):
            transfer.send_weights(iter([]))
        with pytest.raises(ValueError, match="twice"):
            transfer.send_weights(iter([("w", torch.ones(1)), ("w", torch.ones(1))]))
        assert transfer.published == [] and client.version == 0
    finally:
        client.close()
