"""The three seed APIs (shared/seeds/) run on a real pool: a broker and an hf worker on CPU (real processes, real sockets).

LightRFT's documented code blocks run as written, adapted only by the import line, the constructor's
``broker=`` keyword and the process-group setup (gloo on one CPU rank instead of nccl). NeMo-RL's and
AReaL's public methods are called with their documented arguments. One pool (one worker, a tiny model of
hidden size 768, as LightRFT's update_weights_from_tensor example needs) serves the whole module.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import pathlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest

from rollpool.protocol import ConfigError, RejectedError, WeightSyncError
from rollpool.trainer_client.pool import UnsupportedParameterError
from tests.integration.trainer_client.conftest import Pool

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

# the module-scoped pool starts inside the first test (~40 s measured, ~65 s with that test)
pytestmark = pytest.mark.timeout(180)

HIDDEN = 768


@dataclasses.dataclass
class Served:
    pool: Pool
    model: pathlib.Path
    zero_head_ckpt: pathlib.Path
    vocab: int
    tmp: pathlib.Path


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    from safetensors.torch import load_file, save_file

    from rollpool.workers.engines.tiny_model import build_tiny_model

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="rp-compat-", dir="/tmp"))
    model = build_tiny_model(tmp / "m", hidden=HIDDEN, layers=1, heads=12, kv_heads=4, intermediate=256)
    tensors = load_file(str(model / "model.safetensors"))
    ckpt = tmp / "zero-head"
    ckpt.mkdir()
    save_file({"lm_head.weight": torch.zeros_like(tensors["lm_head.weight"])}, str(ckpt / "model.safetensors"))
    pool = Pool(dir=str(tmp), worker_ep=f"ipc://{tmp}/w", client_ep=f"ipc://{tmp}/c")
    pool.start_broker()
    pool.start_hf_worker(str(model))
    # Every adapter of this module hosts its own weight publisher on ports of its own (the default, as a porting user
    # gets it): the broker names each new publisher to the worker, which follows it (a worker that kept its first
    # subscriber stayed on the first publisher's versions).
    try:
        from rollpool.trainer_client import SyncTrainerClient

        with SyncTrainerClient(pool.client_ep) as probe:
            deadline = time.monotonic() + 90
            while not probe.status()["workers"]:
                assert time.monotonic() < deadline, pool.logs()
                time.sleep(0.2)
        yield Served(pool=pool, model=model, zero_head_ckpt=ckpt, vocab=int(tensors["lm_head.weight"].shape[0]), tmp=tmp)
    finally:
        pool.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _uniform(logprobs: list[float], vocab: int) -> bool:
    return bool(logprobs) and all(abs(lp + math.log(vocab)) < 1e-3 for lp in logprobs)


# --------------------------------------------------------------------------- LightRFT


@pytest.fixture
def tp_group(served: Served) -> Iterator[Any]:
    import torch.distributed as dist

    # the process-group setup of the page, on CPU: gloo and one rank instead of nccl
    dist.init_process_group("gloo", init_method=f"file://{served.tmp}/pg-{time.monotonic_ns()}", rank=0, world_size=1)
    try:
        yield dist.new_group()
    finally:
        dist.destroy_process_group()


def test_lightrft_code_blocks_run_as_documented(served: Served, tp_group: Any) -> None:
    from rollpool.trainer_client.compat.lightrft import RLGenerationEngine  # the import line

    # the page's constructor, model name included (not a local directory: the pool warns it cannot check it)
    engine = RLGenerationEngine(
        tp_group_cpu=tp_group,
        num_gpu_per_node=8,
        model="llama2-7b",
        broker=served.pool.client_ep,
    )
    try:
        # >>> result = engine.generate(prompt=..., sampling_params={"temperature": 0.7, "max_tokens": 50}); print(result["text"])
        result = engine.generate(
            prompt="Translate this to French: Hello, world!",
            sampling_params={"temperature": 0.7, "max_tokens": 50},
        )
        print(result["text"])
        assert isinstance(result, dict) and isinstance(result["text"], str)
        assert 1 <= result["meta_info"]["completion_tokens"] <= 50

        # >>> # Batch generation with different parameters
        results = engine.generate(
            prompt=["Hello", "Goodbye"],
            sampling_params=[{"temperature": 0.5}, {"temperature": 0.9}],
            return_logprob=True,
        )
        assert isinstance(results, list) and len(results) == 2
        for r in results:
            lps = r["meta_info"]["output_token_logprobs"]
            assert [tok for _, tok, _ in lps] == r["output_ids"] and all(lp <= 0.0 for lp, _, _ in lps)

        # >>> engine.sleep(); ...; engine.wake_up(); result = engine.generate("Hello world")
        engine.sleep()
        with pytest.raises(RuntimeError, match="call wake_up"):  # not part of the page: generate before wake_up fails at once
            engine.generate("Hello world")
        engine.wake_up()
        result = engine.generate("Hello world")
        assert isinstance(result, dict) and result["output_ids"]
        # >>> engine.sleep(release_weights=True); engine.wake_up(release_weights=True)
        engine.sleep(release_weights=True)
        engine.wake_up(release_weights=True)

        # >>> new_weights = torch.randn(768, 768); engine.update_weights_from_tensor("...q_proj.weight", new_weights, flush_cache=True)
        before = engine.pool.version
        new_weights = torch.randn(768, 768)
        engine.update_weights_from_tensor(
            "model.layers.0.self_attn.q_proj.weight",
            new_weights,
            flush_cache=True,
        )
        # synchronous, as SGLang's engine: the next generation is served at the new version only
        after = engine.generate("Hello", sampling_params={"max_new_tokens": 4})
        assert isinstance(after, dict)
        assert engine.pool.version > before
        assert after["meta_info"]["weight_version"] == str(engine.pool.version)
        assert set(after["meta_info"]["token_versions"]) == {engine.pool.version}
        # >>> try: results = engine.generate("Hello") finally: engine.shutdown()
        results = engine.generate("Hello")
        assert isinstance(results, dict) and isinstance(results["text"], str)
    finally:
        engine.shutdown()


def test_lightrft_mismatched_shape_fails_fast_and_publishes_nothing(served: Served) -> None:
    from rollpool.trainer_client.compat._model import model_fingerprint
    from rollpool.trainer_client.compat.lightrft import RLGenerationEngine

    engine = RLGenerationEngine(tp_group_cpu=None, model=str(served.model), broker=served.pool.client_ep)
    try:
        # the local model directory is the workers' model: the same fingerprint, and its shapes are known
        assert engine.pool.status()["workers"]["hf0"]["fingerprint"] == model_fingerprint(served.model)
        broker_version = engine.pool.status()["counters"]["version"]
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"q_proj.weight has shape \(64, 64\), the pool's model has \(768, 768\)"):
            engine.update_weights_from_tensor("model.layers.0.self_attn.q_proj.weight", torch.randn(64, 64))
        with pytest.raises(WeightSyncError, match="not a parameter of the pool's model"):
            engine.update_weights_from_tensor("model.layers.9.mlp.no_such.weight", torch.randn(2, 2))
        assert time.monotonic() - t0 < 5  # refused at the call, not after a timeout
        with pytest.raises(UnsupportedParameterError, match="load_format"):
            engine.update_weights_from_tensor("lm_head.weight", torch.zeros(1), load_format="flattened_bucket")
        res = engine.generate("Hello", sampling_params={"max_new_tokens": 2})  # nothing was staged: served as before
        assert isinstance(res, dict) and res["output_ids"]
        # per-prompt return_logprob, as SGLang's GenerateReqInput allows
        pair = engine.generate(prompt=["a", "b"], sampling_params={"max_new_tokens": 2}, return_logprob=[True, False])
        assert isinstance(pair, list) and "output_token_logprobs" in pair[0]["meta_info"]
        assert "output_token_logprobs" not in pair[1]["meta_info"]
        assert engine.pool.status()["counters"]["version"] == broker_version
    finally:
        engine.shutdown()


def test_top_logprobs_num_is_honoured_by_the_hf_workers(served: Served) -> None:
    from rollpool.trainer_client.compat.lightrft import RLGenerationEngine

    engine = RLGenerationEngine(tp_group_cpu=None, broker=served.pool.client_ep)
    try:
        greedy = engine.generate(prompt=["Hello", "Goodbye"], sampling_params={"temperature": 0.0, "max_new_tokens": 5},
                                 return_logprob=True, top_logprobs_num=[3, 1])
        assert isinstance(greedy, list)
        for r, k in zip(greedy, (3, 1), strict=True):
            tops, chosen = r["meta_info"]["output_top_logprobs"], r["meta_info"]["output_token_logprobs"]
            assert len(tops) == len(chosen) == len(r["output_ids"]) >= 1
            for row, (lp, tok, _) in zip(tops, chosen, strict=True):
                assert len(row) == k and [x[0] for x in row] == sorted((x[0] for x in row), reverse=True)
                assert row[0][1] == tok and abs(row[0][0] - lp) < 1e-5  # greedy: the chosen token is the most likely
        sampled = engine.generate("Hello", sampling_params={"temperature": 1.0, "max_new_tokens": 6}, return_logprob=True,
                                  top_logprobs_num=4)
        assert isinstance(sampled, dict)
        for row, (lp, tok, _) in zip(sampled["meta_info"]["output_top_logprobs"], sampled["meta_info"]["output_token_logprobs"], strict=True):
            assert row[0][0] >= lp - 1e-6  # nothing sampled is more likely than the top one
            if tok in [t for _, t, _ in row]:
                assert abs(dict((t, v) for v, t, _ in row)[tok] - lp) < 1e-5  # the same logprob, both ways
        plain = engine.generate("Hello", sampling_params={"max_new_tokens": 2}, top_logprobs_num=3)  # without return_logprob
        assert isinstance(plain, dict) and "output_top_logprobs" not in plain["meta_info"]
        with pytest.raises(UnsupportedParameterError, match="top_logprobs_num"):
            engine.generate("Hello", return_logprob=True, top_logprobs_num=1000)
    finally:
        engine.shutdown()


def test_logprob_start_len_gives_the_prompts_logprobs_and_they_agree_with_the_sampled_ones(served: Served) -> None:
    from rollpool.trainer_client.compat.lightrft import RLGenerationEngine

    engine = RLGenerationEngine(tp_group_cpu=None, broker=served.pool.client_ep)
    greedy = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
    try:
        prompt = [5, 6, 7, 8, 9]
        first = engine.generate(input_ids=prompt, sampling_params=greedy, return_logprob=True, logprob_start_len=0)
        assert isinstance(first, dict)
        inputs = first["meta_info"]["input_token_logprobs"]
        assert [tok for _, tok, _ in inputs] == prompt and inputs[0][0] is None and all(lp <= 0.0 for lp, _, _ in inputs[1:])
        # the generated tokens fed back as a prompt: their prompt logprobs are the logprobs they were sampled with
        again = engine.generate(input_ids=prompt + first["output_ids"], sampling_params=greedy, return_logprob=True,
                                logprob_start_len=len(prompt))
        assert isinstance(again, dict)
        fed = again["meta_info"]["input_token_logprobs"]
        assert [tok for _, tok, _ in fed] == first["output_ids"]
        sampled = [lp for lp, _, _ in first["meta_info"]["output_token_logprobs"]]
        assert all(abs(a - b) < 1e-3 for (a, _, _), b in zip(fed, sampled, strict=True)), (fed, sampled)
        plain = engine.generate(input_ids=prompt, sampling_params=greedy, logprob_start_len=0)  # without return_logprob
        assert isinstance(plain, dict) and "input_token_logprobs" not in plain["meta_info"]
    finally:
        engine.shutdown()


def test_lightrft_model_that_is_not_the_pools_is_refused_and_a_hub_name_is_warned_about(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    from rollpool.trainer_client.compat.lightrft import RLGenerationEngine
    from rollpool.workers.engines.tiny_model import build_tiny_model

    other = build_tiny_model(served.tmp / "other", hidden=32, layers=1, heads=2, kv_heads=1)
    with pytest.raises(ConfigError, match="is not the model the pool's workers serve"):
        RLGenerationEngine(tp_group_cpu=None, model=str(other), broker=served.pool.client_ep)
    with pytest.raises(ConfigError, match="broker="):
        RLGenerationEngine(tp_group_cpu=None, model=str(served.model))
    with caplog.at_level(logging.WARNING):
        engine = RLGenerationEngine(tp_group_cpu=None, model="llama2-7b", broker=served.pool.client_ep)
    engine.shutdown()
    assert any("'llama2-7b' is not a local directory" in r.getMessage() for r in caplog.records)


def test_a_version_no_worker_reaches_fails_the_wait_with_the_workers_versions(served: Served) -> None:
    from rollpool.trainer_client.compat.lightrft import RLGenerationEngine

    engine = RLGenerationEngine(tp_group_cpu=None, model=str(served.model), broker=served.pool.client_ep, weight_timeout_s=2.0)
    try:
        engine.pool.require_version(10_000)  # as if another process had published it and no worker applied it
        with pytest.raises(WeightSyncError, match=r"no worker served weight version 10000 within 2.0 s .*hf0"):
            engine.generate("Hello", sampling_params={"max_new_tokens": 2})
    finally:
        engine.shutdown()


def test_a_version_the_workers_cannot_apply_fails_the_wait_at_once_with_the_workers_error(served: Served) -> None:
    from rollpool.trainer_client.compat.lightrft import RLGenerationEngine

    # a hub name: the pool cannot read the model's shapes, so a wrong shape reaches the worker, which gives the version up
    # (its serving engine and a restarted one both refuse it). The wait must end on that report, not at its timeout.
    engine = RLGenerationEngine(tp_group_cpu=None, model="llama2-7b", broker=served.pool.client_ep, weight_timeout_s=60.0)
    try:
        engine.update_weights_from_tensor("model.layers.0.self_attn.q_proj.weight", torch.randn(64, 64))
        with pytest.raises(WeightSyncError) as err:
            engine.generate("Hello", sampling_params={"max_new_tokens": 2})
        bad = engine.pool.version
        message = str(err.value)
        assert f"weight version {bad} cannot be applied" in message, message
        assert "hf0" in message and r"q_proj.weight has shape (64, 64), the model has (768, 768)" in message, message
        status = engine.pool.status()
        assert status["workers"]["hf0"]["skipped_version"] == bad and status["counters"]["versions_skipped"] >= 1
        # the failed call's prompt was cancelled, not left waiting for a version nobody serves
        assert status["counters"]["queued"] == 0
        # the worker kept its last good version; a good update afterwards is served as usual
        engine.update_weights_from_tensor("model.layers.0.self_attn.q_proj.weight", torch.randn(768, 768))
        res = engine.generate("Hello", sampling_params={"max_new_tokens": 2})
        assert isinstance(res, dict) and res["meta_info"]["weight_version"] == str(engine.pool.version) and engine.pool.version > bad
    finally:
        engine.shutdown()


# --------------------------------------------------------------------------- NeMo-RL


def _nemo_config(served: Served, **over: Any) -> dict[str, Any]:
    cfg = {"backend": "sglang", "model_name": str(served.model), "max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0,
           "top_k": None, "stop_token_ids": None, "stop_strings": None, "colocated": {"enabled": True}, "_pad_token_id": 0,
           "sglang_cfg": {"enable_memory_saver": False}}
    cfg.update(over)
    return cfg


def _batched(rows: list[list[int]], pad: int = 0) -> dict[str, Any]:
    width = max(map(len, rows))
    return {"input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long),
            "input_lengths": torch.tensor([len(r) for r in rows], dtype=torch.long),
            "idx": list(range(len(rows)))}  # a key of the caller's, not read


def test_nemo_rl_generate_takes_the_batched_dict_and_returns_its_output_spec(served: Served) -> None:
    from rollpool.trainer_client.compat.nemo_rl import TOP_K_THRESHOLD, TOP_P_THRESHOLD, SGLangGeneration, logger

    assert (TOP_K_THRESHOLD, TOP_P_THRESHOLD) == (8000, 0.99) and isinstance(logger, logging.Logger)  # the module's Data
    gen = SGLangGeneration(object(), _nemo_config(served), name_prefix="sglang_policy", workers_per_node=None,
                           broker=served.pool.client_ep)
    try:
        rows = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
        data = _batched(rows)
        out = gen.generate(data, greedy=False)
        assert sorted(out) == ["generation_lengths", "logprobs", "output_ids", "unpadded_sequence_lengths"]
        ids, lps, glen, ulen = out["output_ids"], out["logprobs"], out["generation_lengths"], out["unpadded_sequence_lengths"]
        assert isinstance(ids, torch.Tensor) and ids.dtype == torch.long and lps.dtype == torch.float32
        assert ids.shape == lps.shape and ids.shape[0] == 3 and ids.shape[1] == 5 + int(glen.max())
        for i, r in enumerate(rows):
            n, g = len(r), int(glen[i])
            assert 1 <= g <= 6 and int(ulen[i]) == n + g
            assert ids[i, :n].tolist() == r  # the prompt, unpadded, then its generation, then padding
            assert ids[i, n + g :].tolist() == [0] * (ids.shape[1] - n - g)
            assert lps[i, :n].abs().sum() == 0 and lps[i, n + g :].abs().sum() == 0
            assert bool((lps[i, n : n + g] < 0).all())
        # greedy=True samples at temperature 0: the same batch twice gives the same tokens
        g1, g2 = gen.generate(data, greedy=True), gen.generate(data, greedy=True)
        assert torch.equal(g1["output_ids"], g2["output_ids"])
        # the pool refuses the same dict where text is expected, instead of generating from its key names
        with pytest.raises(TypeError, match="NeMo-RL's batched data"):
            gen.pool.generate(prompt=data)  # type: ignore[arg-type]
        # numpy in, numpy out; per-sample stop strings are accepted
        np_out = gen.generate({"input_ids": data["input_ids"].numpy(), "input_lengths": data["input_lengths"].numpy(),
                               "stop_strings": [["\n"], None, ["."]]})
        assert type(np_out["output_ids"]).__module__ == "numpy" and np_out["output_ids"].shape[0] == 3
        with pytest.raises(ValueError, match="input_lengths"):
            gen.generate({"input_ids": data["input_ids"]})
    finally:
        assert gen.shutdown() is True


def test_nemo_rl_generate_async_yields_each_sample_once_as_a_batch_of_one(served: Served) -> None:
    from rollpool.trainer_client.compat.nemo_rl import SGLangGeneration

    gen = SGLangGeneration(None, _nemo_config(served), broker=served.pool.client_ep)
    rows = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]

    async def collect() -> list[tuple[int, dict[str, Any]]]:
        return [item async for item in gen.generate_async(_batched(rows), greedy=False)]

    try:
        got = asyncio.run(collect())
        assert sorted(i for i, _ in got) == [0, 1, 2]
        for i, res in got:
            assert res["output_ids"].shape[0] == 1
            n, g = len(rows[i]), int(res["generation_lengths"][0])
            assert res["output_ids"][0, :n].tolist() == rows[i] and int(res["unpadded_sequence_lengths"][0]) == n + g
    finally:
        gen.shutdown()


def test_nemo_rl_refit_calls_publish_by_value_and_the_next_generate_is_at_the_new_weights(served: Served) -> None:
    from rollpool.trainer_client.compat.nemo_rl import SGLangGeneration

    gen = SGLangGeneration(None, _nemo_config(served), broker=served.pool.client_ep)
    head = "lm_head.weight"
    try:
        assert gen.init_collective("127.0.0.1", 29500, 2, train_world_size=1) == []
        shape = (served.vocab, HIDDEN)
        assert gen.prepare_refit_info({head: (torch.Size(shape), torch.float32)}) is None
        with pytest.raises(WeightSyncError, match="nothing to publish"):
            gen.update_weights_via_ipc_zmq()
        with pytest.raises(WeightSyncError, match="has shape"):
            gen.prepare_refit_info({head: ((3, 3), torch.float32)})
        with pytest.raises(WeightSyncError, match="has shape"):
            gen.stage_weights({head: torch.zeros(3, 3)})
        data = _batched([[5, 6, 7], [8, 9]])
        # zero logits head: uniform next-token distribution, every logprob -log(vocab) once it is applied
        gen.stage_weights({head: torch.zeros(shape)})
        assert gen.update_weights_via_ipc_zmq() == [True]
        out = gen.generate(data)
        for i in range(2):
            n, g = int(data["input_lengths"][i]), int(out["generation_lengths"][i])
            assert _uniform(out["logprobs"][i, n : n + g].tolist(), served.vocab), out["logprobs"][i]
        # the collective path publishes the same way (here: the head back to random values)
        gen.stage_weights({head: torch.randn(shape) * 8})
        assert gen.update_weights_from_collective() == [True]
        out = gen.generate(data)
        n, g = int(data["input_lengths"][0]), int(out["generation_lengths"][0])
        assert not _uniform(out["logprobs"][0, n : n + g].tolist(), served.vocab)
    finally:
        gen.shutdown()


def test_nemo_rl_servers_memory_and_cache_calls_return_what_nemo_returns(served: Served) -> None:
    from rollpool.trainer_client.compat.nemo_rl import SGLangGeneration

    gen = SGLangGeneration(None, _nemo_config(served), broker=served.pool.client_ep)
    saver = SGLangGeneration(None, _nemo_config(served, sglang_cfg={"enable_memory_saver": True}), broker=served.pool.client_ep)
    try:
        assert gen.get_sglang_server_urls() == ["hf0"]
        assert gen.get_sglang_url_to_gpu_uuids() == {"hf0": []}
        assert gen.invalidate_kv_cache() is True
        # memory saver off: no-ops that keep the prefix cache warm
        assert gen.finish_generation() is True and gen.prepare_for_generation() is True
        assert gen.pool.status()["workers"]["hf0"]["state"] == "ready"
        # memory saver on: the worker releases everything, then resumes weights and KV cache separately
        assert saver.finish_generation() is True
        deadline = time.monotonic() + 10
        while saver.pool.status()["workers"]["hf0"]["state"] != "sleeping":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with pytest.raises(RuntimeError, match="call wake_up\\(\\) \\(or prepare_for_generation\\(\\)\\) first"):
            saver.generate(_batched([[5, 6]]))  # fails at once instead of waiting for a sleeping pool
        assert saver.prepare_for_generation(tags=["weights"]) is True
        assert saver.prepare_for_generation(tags=["kv_cache"]) is True
        with pytest.raises(UnsupportedParameterError, match="only tags= is honoured"):
            saver.prepare_for_generation(mode="x")
        res = saver.generate(_batched([[5, 6]]))
        assert int(res["generation_lengths"][0]) >= 1
        with pytest.raises(UnsupportedParameterError, match="vllm_gpu_util"):
            SGLangGeneration(None, _nemo_config(served, vllm_gpu_util=0.5), broker=served.pool.client_ep)
    finally:
        assert saver.shutdown() is True
        assert gen.shutdown() is True


# --------------------------------------------------------------------------- AReaL


@dataclasses.dataclass
class SequenceSampleStandIn:
    """Shaped like realhf's data_api.SequenceSample (packed): a stand-in at the framework edge, not AReaL's class."""

    ids: list[str]
    seqlens: dict[str, list[list[int]]]
    data: dict[str, Any]

    @property
    def bs(self) -> int:
        return len(self.ids)

    @classmethod
    def of(cls, rows: list[list[int]]) -> SequenceSampleStandIn:
        return cls(ids=[f"q{i}" for i in range(len(rows))], seqlens={"packed_input_ids": [[len(r)] for r in rows]},
                   data={"packed_input_ids": torch.tensor([t for r in rows for t in r], dtype=torch.long)})


@dataclasses.dataclass
class GenerationHyperparametersStandIn:
    """The fields of realhf's GenerationHyperparameters (a stand-in, not AReaL's class)."""

    n: int = 1
    max_new_tokens: int = 256
    min_new_tokens: int = 0
    greedy: bool = False
    top_p: float = 1.0
    top_k: int = int(1e8)
    temperature: float = 1.0
    use_cuda_graph: bool = True
    force_cudagraph_recapture: bool = True
    force_no_logits_mask: bool = True


def test_areal_engine_public_methods_with_their_documented_arguments(served: Served) -> None:
    from transformers import AutoTokenizer

    from rollpool.trainer_client.compat.areal import SGLangGenerationEngine

    tokenizer = AutoTokenizer.from_pretrained(served.model)
    server_args_dict = {"host": "localhost", "port": 30000, "model_path": str(served.model), "tokenizer_path": str(served.model),
                        "tp_size": 1, "skip_tokenizer_init": True, "enable_metrics": False}
    engine = SGLangGenerationEngine(server_args_dict, hybrid_train=False, request_timeout=60, broker=served.pool.client_ep)
    try:
        assert engine.train() is engine and engine.train(False) is engine and engine.eval() is engine
        assert engine.wait_server() is None
        rows = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
        gconfig = GenerationHyperparametersStandIn(n=2, max_new_tokens=6)
        ids, lps, mask = engine.generate(SequenceSampleStandIn.of(rows), mb_spec=None, tokenizer=tokenizer, gconfig=gconfig)
        assert mask is None and ids.dtype == torch.long and lps.dtype == torch.float32
        assert ids.shape == lps.shape and ids.shape[0] == 6 and 1 <= ids.shape[1] <= 6  # n=2 per sequence, generated part only
        for row, lp in zip(ids.tolist(), lps.tolist(), strict=True):
            stop = next((j for j, t in enumerate(row) if t in (tokenizer.eos_token_id, tokenizer.pad_token_id)), None)
            if stop is not None:  # padded with pad_token_id after the stop token, logprobs 0 there
                assert all(t == tokenizer.pad_token_id for t in row[stop + 1 :]) and all(x == 0.0 for x in lp[stop + 1 :])
        ids2, lps2, _ = asyncio.run(engine.async_generate(SequenceSampleStandIn.of(rows), None, tokenizer,
                                                          GenerationHyperparametersStandIn(n=1, max_new_tokens=3, greedy=True),
                                                          stream=False, disable_tqdm=True))
        assert ids2.shape[0] == 3 and ids2.shape[1] <= 3
        # AReaL's unfilled default gconfig (a dataclasses.field) means the defaults
        ids3, _, _ = engine.generate(SequenceSampleStandIn.of([[5, 6]]), None, tokenizer, dataclasses.field(default_factory=dict))
        assert ids3.shape[0] == 1
        with pytest.raises(RuntimeError, match="min_new_tokens"):
            engine.generate(SequenceSampleStandIn.of(rows), None, tokenizer, GenerationHyperparametersStandIn(min_new_tokens=4))
        grouped = SequenceSampleStandIn(ids=["g"], seqlens={"packed_input_ids": [[2, 2]]},
                                        data={"packed_input_ids": torch.tensor([5, 6, 7, 8])})
        with pytest.raises(RuntimeError, match="grouped generation"):
            engine.generate(grouped, None, tokenizer, gconfig)
        with pytest.raises(UnsupportedParameterError, match="stream"):
            asyncio.run(engine.async_generate(SequenceSampleStandIn.of(rows), None, tokenizer, gconfig, stream=True))

        # update_weights_from_disk: every worker loads it, the next generation is served at it (uniform logits)
        version = engine.pool.status()["counters"]["version"]
        engine.update_weights_from_disk(str(served.zero_head_ckpt))
        assert engine.pool.status()["counters"]["version"] > version
        _, lps4, _ = engine.generate(SequenceSampleStandIn.of([[5, 6, 7]]), None, tokenizer,
                                     GenerationHyperparametersStandIn(max_new_tokens=3))
        assert _uniform([x for x in lps4[0].tolist() if x != 0.0], served.vocab)
        # a path the workers cannot load fails at once and announces no version
        version = engine.pool.status()["counters"]["version"]
        with pytest.raises(RejectedError, match="update_weights_from_disk"):
            engine.update_weights_from_disk(str(served.tmp / "no-such-checkpoint"))
        assert engine.pool.status()["counters"]["version"] == version
    finally:
        engine.__del__()
    assert engine.pool._closed  # __del__ closed the client


def _peft_dir(root: pathlib.Path, model: pathlib.Path, seed: int) -> tuple[pathlib.Path, dict[str, Any]]:
    """A LoRA adapter directory as PEFT's save_pretrained writes it (config and safetensors, PEFT's names)."""
    import json

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    outs = {"q_proj": HIDDEN, "v_proj": 256}
    tensors = {}
    for m, out in outs.items():
        tensors[f"base_model.model.model.layers.0.self_attn.{m}.lora_A.weight"] = torch.randn(2, HIDDEN, generator=g)
        tensors[f"base_model.model.model.layers.0.self_attn.{m}.lora_B.weight"] = torch.randn(out, 2, generator=g)
    root.mkdir()
    save_file(tensors, str(root / "adapter_model.safetensors"))
    (root / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": list(outs),
                                                          "base_model_name_or_path": str(model)}))
    return root, tensors


def test_lightrft_lora_path_serves_the_adapter_and_bad_adapters_are_refused_by_name(served: Served) -> None:
    from rollpool.protocol.errors import WeightsRefusedError
    from rollpool.trainer_client.compat.lightrft import RLGenerationEngine
    from rollpool.weights.adapters import adapter_spec

    engine = RLGenerationEngine(tp_group_cpu=None, model=str(served.model), broker=served.pool.client_ep)
    greedy = {"max_new_tokens": 4, "temperature": 0.0}
    try:
        # the model's own weights first: an earlier test of this module loads a checkpoint whose head is zero (uniform
        # logits, which no adapter on the attention projections can change)
        engine.pool.update_weights_from_disk(str(served.model))
        base = engine.generate("Hello", sampling_params=greedy, return_logprob=True)
        adir, tensors = _peft_dir(served.tmp / f"adapter-{time.monotonic_ns()}", served.model, seed=1)
        # the seed's documented call: per-prompt adapter paths (a PEFT directory, loaded and published on first use)
        res = engine.generate(prompt=["Hello"], sampling_params=greedy, return_logprob=True, lora_path=[str(adir)])
        version = engine.pool.version
        assert int(res[0]["meta_info"]["weight_version"]) >= version
        assert res[0]["meta_info"]["output_token_logprobs"] != base["meta_info"]["output_token_logprobs"]  # the adapter is on
        assert res[0]["meta_info"]["policy"] == str(adir)  # the entry named the adapter's policy (its name: the path)
        with pytest.raises(UnsupportedParameterError, match=r"lora_path.*unknown adapter 'nope'"):
            engine.generate("Hello", sampling_params=greedy, lora_path=["nope"])
        assert engine.pool.status()["counters"]["queued"] == 0  # refused before anything was submitted
        spec = adapter_spec(2, 4, ["q_proj", "v_proj"], base_fingerprint="ffffffffffffffff", base_model="other-8b")
        with pytest.raises(WeightsRefusedError, match=r"base other-8b \(fingerprint ffffffffffffffff\), the pool's workers serve fingerprint.*hf0.*nothing was published"):
            engine.pool.load_lora_adapter("other", tensors=tensors, spec=spec)
        again = engine.generate("Hello", sampling_params=greedy, lora_path=[str(adir)])  # the pool serves on
        assert again["output_ids"] and engine.pool.version == version
    finally:
        engine.shutdown()


def test_an_adapter_for_another_base_is_refused_by_the_workers_naming_both(served: Served) -> None:
    from rollpool.trainer_client import SyncTrainerClient
    from rollpool.weights.adapters import adapter_spec

    # a trainer client publishing directly (no facade check before it): the workers are the ones to refuse
    with SyncTrainerClient(served.pool.client_ep) as client:
        _, tensors = _peft_dir(served.tmp / f"adapter-{time.monotonic_ns()}", served.model, seed=2)
        spec = adapter_spec(2, 4, ["q_proj", "v_proj"], base_fingerprint="ffffffffffffffff", base_model="other-8b")
        bad = client.status()["counters"]["version"] + 1
        client.publish_weights(tensors, bad, adapter=spec)
        with pytest.raises(WeightSyncError) as err:
            client.wait_for_version(bad, timeout=60)
        message = str(err.value)
        assert "hf0" in message and "other-8b (fingerprint ffffffffffffffff)" in message, message
        assert f"fingerprint {_fingerprint(served.model)}" in message, message
        worker = client.status()["workers"]["hf0"]
        assert worker["skipped_version"] == bad and worker["state"] == "ready"  # it serves its last good version on


def _fingerprint(model: pathlib.Path) -> str:
    from rollpool.protocol.fingerprint import model_fingerprint

    return model_fingerprint(model)
