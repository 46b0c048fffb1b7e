"""SyncTrainerClient and RolloutPool against a real broker and sim workers (real processes, real sockets)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

from rollpool.protocol import GroupState, SamplingParams
from rollpool.trainer_client import RolloutPool, SyncTrainerClient, TrainerClientConfig


def _client(pool: Any) -> SyncTrainerClient:
    return SyncTrainerClient(pool.client_ep, config=TrainerClientConfig(broker=pool.client_ep, request_timeout_s=3.0, request_retries=10))


def test_500_prompts_each_trajectory_exactly_once_across_a_broker_restart(pool_factory: Any) -> None:
    pool = pool_factory()
    pool.start_broker()
    pool.start_sim_workers()
    client = _client(pool)
    try:
        accepted = client.submit([[1, 2, 3, i] for i in range(500)], group_size=4, sampling=SamplingParams(max_new_tokens=8))
        assert len(accepted.accepted) == 500 and not accepted.rejected
        prompt_ids = set(accepted.accepted)
        seen_groups: dict[str, int] = {}
        seen_traj: dict[str, int] = {}
        restarted = False
        deadline = time.monotonic() + 90
        while len(seen_groups) < 500:
            assert time.monotonic() < deadline, pool.logs()
            batch = client.get_batch(min(50, 500 - len(seen_groups)), timeout=60)
            assert not batch.other, [(g.prompt_id, g.state, g.reason) for g in batch.other]
            for g in batch.groups:
                assert g.state == GroupState.DONE and len(g.trajectories) == 4
                seen_groups[g.prompt_id] = seen_groups.get(g.prompt_id, 0) + 1
                for t in g.trajectories:
                    seen_traj[t.trajectory_id] = seen_traj.get(t.trajectory_id, 0) + 1
            if not restarted and len(seen_groups) >= 150:
                pool.kill_broker()  # SIGKILL: everything held in the broker is gone
                pool.start_broker()  # same endpoints, new epoch
                restarted = True
        assert restarted
        assert set(seen_groups) == prompt_ids  # nothing lost
        assert set(seen_groups.values()) == {1}  # each group once
        assert len(seen_traj) == 2000 and set(seen_traj.values()) == {1}  # each trajectory once
        assert client.counters["broker_restarts"] >= 1
        assert client.pending() == 0
    finally:
        client.close()


def test_stale_groups_are_dropped_and_counted_and_free_capacity(pool_factory: Any) -> None:
    pool = pool_factory()
    pool.start_broker()
    pool.start_sim_workers(count=2)
    client = _client(pool)
    try:
        client.set_version(5)  # no weights are published: the sim workers stay at version 0
        client.submit([[7, i] for i in range(10)], group_size=2, sampling=SamplingParams(max_new_tokens=4))
        with pytest.raises(TimeoutError):
            client.get_batch(1, max_staleness=2, timeout=5)  # every group is 5 versions old
        assert client.counters["dropped_stale"] == 10
        assert client.counters["groups_delivered"] == 0
        deadline = time.monotonic() + 10
        while client.status()["counters"].get("accepted_samples", 0) != 0:  # the drops were acknowledged as stale
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        client.close()


def test_rolloutpool_generate_async_yields_each_index_once_as_groups_complete(pool_factory: Any) -> None:
    pool = pool_factory()
    pool.start_broker()
    pool.start_sim_workers(count=2, options="decode_s_per_token=0.01,length=uniform,length_min=1,length_median=20,capacity=64")
    rp = RolloutPool(pool.client_ep, config=TrainerClientConfig(broker=pool.client_ep, request_timeout_s=3.0, request_retries=10),
                     timeout_s=30)

    async def collect() -> list[tuple[int, dict[str, Any], float]]:
        out = []
        async for index, result in rp.generate_async(input_ids=[[1, 2, i] for i in range(12)],
                                                     sampling_params={"max_new_tokens": 40, "n": 2}, return_logprob=True):
            out.append((index, result, time.time()))
        return out

    try:
        got = asyncio.run(collect())
        indices = [i for i, _, _ in got]
        assert sorted(indices) == list(range(24))  # 12 prompts x n=2, prompt-major, each once
        for _, res, _ in got:
            meta = res["meta_info"]
            assert len(meta["output_token_logprobs"]) == len(res["output_ids"]) == meta["completion_tokens"]
        # streamed as groups complete: the first result arrives before the slowest group has even finished
        last_finished = max(res["meta_info"]["finished_at"] for _, res, _ in got)
        assert got[0][2] < last_finished
        # plain generate returns SGLang-shaped results in input order
        res = rp.generate(input_ids=[[5, 6], [7, 8]], sampling_params={"max_new_tokens": 3})
        assert [len(r["output_ids"]) > 0 for r in res] == [True, True]
    finally:
        rp.shutdown()


def test_update_weights_from_disk_reaches_every_worker(pool_factory: Any, tmp_path: Any) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    from rollpool.workers.engines.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "m", hidden=32, layers=1, heads=2, kv_heads=1)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    tensors = load_file(str(model / "model.safetensors"))
    save_file({k: torch.zeros_like(v) if "lm_head" in k else v for k, v in tensors.items()}, str(ckpt / "model.safetensors"))
    pool = pool_factory()
    pool.start_broker()
    pool.start_hf_worker(str(model))
    rp = RolloutPool(pool.client_ep, config=TrainerClientConfig(broker=pool.client_ep, request_timeout_s=5.0, request_retries=10),
                     timeout_s=60)
    try:
        deadline = time.monotonic() + 60
        while not rp.worker_urls():
            assert time.monotonic() < deadline, pool.logs()
            time.sleep(0.2)
        version = rp.update_weights_from_disk(str(ckpt))
        assert version == 1
        res = rp.generate(input_ids=[[1, 2, 3]], sampling_params={"max_new_tokens": 4, "temperature": 1.0}, return_logprob=True)
        # a zero lm_head gives uniform logits: every logprob is -log(vocab)
        lps = [lp for lp, _, _ in res[0]["meta_info"]["output_token_logprobs"]]
        vocab = tensors["lm_head.weight"].shape[0] if "lm_head.weight" in tensors else None
        assert vocab is not None
        assert all(abs(lp + float(np.log(vocab))) < 1e-3 for lp in lps), lps
        assert res[0]["meta_info"]["token_versions"] == [1] * len(lps)
    finally:
        rp.shutdown()
