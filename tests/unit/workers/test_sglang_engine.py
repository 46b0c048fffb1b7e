"""The sglang engine on a CPU: its child's answers against SGLang's, the per-launch token, death, refusals, options.

The child here is the engine's real child process with the sim backend (conftest:
`sglang_sim_child`, or launched by the engine itself); the one fake is `_fake_sglang`, an
HTTP server at the process edge that answers like a misbehaving SGLang.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pathlib
import signal
import stat
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("aiohttp")

from rollpool.protocol.errors import ConfigError, EngineError, RequestRefusedError
from rollpool.protocol.messages import FinishReason, SamplingParams
from rollpool.workers.config import WorkerConfig
from rollpool.workers.engines.base import StagingEngine, TokenIds
from rollpool.workers.engines.options import HFOptions, SGLangOptions, SimOptions, parse_options
from rollpool.workers.engines.sglang.engine import SGLangEngine
from rollpool.workers.engines.sglang.http import HttpClient, HttpError, serve_routes
from rollpool.workers.engines.sglang.wire import generate_body, parse_generate_response, sample_rid
from rollpool.workers.engines.sim import SimEngine

from .conftest import SIM_SERVER_ARGS, SimChild

GOLDEN: dict[str, Any] = json.loads((pathlib.Path(__file__).parents[2] / "fixtures" / "sglang" / "golden.json").read_text())


def _client(child: SimChild, token: str | None = None) -> HttpClient:
    host, port = child.url.removeprefix("http://").split(":")
    return HttpClient(host, int(port), token=child.token if token is None else token)


def _shape(value: Any) -> Any:
    """Keys and value types, recursively (lists by their first element): what a parser relies on."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    if isinstance(value, bool) or value is None:
        return type(value).__name__
    if isinstance(value, int | float):
        return "number"
    return type(value).__name__


async def test_the_childs_answers_have_sglangs_shape(sglang_sim_child: SimChild) -> None:
    http = _client(sglang_sim_child)
    prompt = [10, 20, 30, 40, 50, 60]
    counter = iter(range(100))

    def body(sp: SamplingParams) -> dict[str, Any]:
        return generate_body(prompt, sp, rid=sample_rid("shapetst", next(counter), 0, 0), index=0)

    try:
        got: dict[str, Any] = {}
        got["length"] = await http.request("POST", "/generate", body(SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)))
        stop_tok = got["length"]["output_ids"][3]
        got["stop_token"] = await http.request("POST", "/generate", body(SamplingParams(max_new_tokens=60, seed=1, stop_token_ids=(stop_tok,))))
        long_body = body(SamplingParams(max_new_tokens=1500, ignore_eos=True))
        task = asyncio.ensure_future(http.request("POST", "/generate", long_body))
        await asyncio.sleep(0.05)
        await http.request("POST", "/abort_request", {"rid": long_body["rid"], "abort_all": False})
        got["abort"] = await asyncio.wait_for(task, 10)
        got["model_info"] = await http.request("GET", "/model_info")
    finally:
        await http.close()
    for kind in ("length", "stop_token", "abort"):
        want, have = GOLDEN[kind], got[kind]
        assert set(have) == set(want), kind
        assert set(have["meta_info"]) == set(want["meta_info"]), kind
        assert _shape(have["meta_info"]["finish_reason"]) == _shape(want["meta_info"]["finish_reason"]), kind
        for key in ("id", "prompt_tokens", "weight_version", "output_token_logprobs", "completion_tokens"):
            assert _shape(have["meta_info"][key]) == _shape(want["meta_info"][key]), (kind, key)
        assert _shape(have["output_ids"]) == _shape(want["output_ids"])
        a, b = parse_generate_response(have), parse_generate_response(want)
        assert a.finish_reason == b.finish_reason and a.aborted_by_request == b.aborted_by_request, kind
    assert set(GOLDEN["model_info"]) <= set(got["model_info"])
    s = parse_generate_response(got["stop_token"])
    assert s.finish_reason == FinishReason.STOP and s.matched_stop == s.output_ids[-1]
    assert 0 < len(parse_generate_response(got["abort"]).output_ids) < 1500


async def test_the_child_refuses_requests_without_the_launch_token(sglang_sim_child: SimChild) -> None:
    for token in ("", "not-the-token"):
        http = _client(sglang_sim_child, token=token)
        try:
            for path in ("/health_generate", "/update_weights_from_tensor", "/generate"):
                with pytest.raises(HttpError) as info:
                    await http.request("POST", path, {"serialized_named_tensors": ["x"]})
                assert info.value.status == 401
        finally:
            await http.close()
    engine = SGLangEngine(model=sglang_sim_child.model, url=sglang_sim_child.url, api_key="wrong", device="cpu", start_timeout_s=5)
    with pytest.raises(EngineError, match="refused our token"):
        await engine.start()


async def test_the_hop_answers_as_http_does_and_refuses_calls_without_the_launch_token(sglang_sim_child: SimChild) -> None:
    from rollpool.workers.engines.sglang.hop import HopClient

    body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "sampling_seed": 7},
            "return_logprob": True, "rid": "hop-same-answer"}
    http = _client(sglang_sim_child, token=sglang_sim_child.token)
    hop = HopClient(sglang_sim_child.hop, token=sglang_sim_child.token)
    try:
        by_http, by_hop = await http.request("POST", "/generate", body), await hop.request("POST", "/generate", body)
        assert by_hop["output_ids"] == by_http["output_ids"] and len(by_hop["output_ids"]) == 5
        # the logprobs came as the hop's binary columns, the same entries as the JSON's
        assert type(by_hop["meta_info"]["output_token_logprobs"]).__name__ == "LogprobTriples"
        assert by_hop["meta_info"]["output_token_logprobs"] == by_http["meta_info"]["output_token_logprobs"]
        # a request id without the options byte (an older worker's) gets the answer as JSON alone, in 3 frames
        import zmq
        import zmq.asyncio

        from rollpool.workers.engines.sglang.http import dumps, loads

        ctx = zmq.asyncio.Context()
        old = ctx.socket(zmq.DEALER)
        try:
            old.connect(sglang_sim_child.hop)
            await old.send_multipart([sglang_sim_child.token.encode(), b"\x01" * 8, b"/generate",
                                      dumps({k: v for k, v in body.items() if k != "input_ids"}), struct.pack("<4i", 1, 2, 3, 4)])
            rid, status, answer = await asyncio.wait_for(old.recv_multipart(), 30)
            assert (rid, status) == (b"\x01" * 8, b"200")
            assert loads(answer)["meta_info"]["output_token_logprobs"] == by_http["meta_info"]["output_token_logprobs"]
        finally:
            old.close(linger=0)
            ctx.term()
        # the same ids reached the child: its prefix cache serves the whole prompt but its last token on the second call
        assert by_hop["meta_info"]["prompt_tokens"] == 4 and by_hop["meta_info"]["cached_tokens"] == 3
        for bad, status in (({"input_ids": [1, 2], "sampling_params": {"nope": 1}}, 400), ({}, 400)):
            with pytest.raises(HttpError) as info:
                await hop.request("POST", "/generate", bad)
            assert info.value.status == status
        with pytest.raises(HttpError) as info:
            await hop.request("POST", "/no_such_route", {})
        assert info.value.status == 404
    finally:
        await hop.close()
        await http.close()
    for token in ("", "not-the-token"):
        hop = HopClient(sglang_sim_child.hop, token=token)
        try:
            for path in ("/generate", "/update_weights_from_tensor"):
                with pytest.raises(HttpError) as info:
                    await hop.request("POST", path, {"input_ids": [1, 2], "serialized_named_tensors": ["x"]}, timeout_s=10)
                assert info.value.status == 401
        finally:
            await hop.close()


async def test_many_calls_at_once_on_the_hop_each_get_their_own_answer_and_close_fails_the_rest(sglang_sim_child: SimChild) -> None:
    """Answers drained from the socket as they come (several per wake-up) reach their own callers; calls still waiting
    when the hop closes fail with ConnectionError, and a closed hop refuses new ones."""
    from rollpool.workers.engines.sglang.hop import HopClient

    def body(i: int) -> dict[str, Any]:
        return {"input_ids": [1, 2, 3, 4 + i], "sampling_params": {"max_new_tokens": 1 + i % 7, "temperature": 0.0},
                "return_logprob": True, "rid": f"hop-many-{i}"}

    hop = HopClient(sglang_sim_child.hop, token=sglang_sim_child.token)
    try:
        answers = await asyncio.gather(*(hop.request("POST", "/generate", body(i), timeout_s=30) for i in range(96)))
        assert [len(a["output_ids"]) for a in answers] == [1 + i % 7 for i in range(96)]
        assert [a["meta_info"]["id"] for a in answers] == [f"hop-many-{i}" for i in range(96)]
        slow = {**body(0), "sampling_params": {"max_new_tokens": 100_000, "temperature": 0.0, "ignore_eos": True}, "rid": "hop-slow"}
        waiting = asyncio.ensure_future(hop.request("POST", "/generate", slow, timeout_s=30))
        await asyncio.sleep(0.2)
        assert not waiting.done()
    finally:
        await hop.close()
    with pytest.raises(ConnectionError):
        await waiting
    with pytest.raises(ConnectionError):
        await hop.request("POST", "/generate", body(0))
    http = _client(sglang_sim_child, token=sglang_sim_child.token)
    try:  # the sample the closed hop left in the child
        await http.request("POST", "/abort_request", {"rid": "hop-slow"})
    finally:
        await http.close()


async def test_a_hop_call_past_its_timeout_fails_alone_and_the_soonest_deadline_fires_first(sglang_sim_child: SimChild) -> None:
    """One timer serves every call's timeout: a call with a short timeout made after one with a long timeout still fails
    on time, with TimeoutError; the long one and later calls go on."""
    from rollpool.workers.engines.sglang.hop import HopClient

    def slow(rid: str) -> dict[str, Any]:
        return {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 100_000, "temperature": 0.0, "ignore_eos": True},
                "return_logprob": True, "rid": rid}

    hop = HopClient(sglang_sim_child.hop, token=sglang_sim_child.token)
    long_wait = asyncio.ensure_future(hop.request("POST", "/generate", slow("hop-timeout-long"), timeout_s=60))
    try:
        await asyncio.sleep(0.05)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="no answer within 0.3 s"):
            await hop.request("POST", "/generate", slow("hop-timeout-short"), timeout_s=0.3)
        assert 0.25 <= time.monotonic() - started < 5
        assert not long_wait.done()
        quick = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}, "return_logprob": True,
                 "rid": "hop-timeout-quick"}
        assert len((await hop.request("POST", "/generate", quick, timeout_s=30))["output_ids"]) == 2
    finally:
        long_wait.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await long_wait
        await hop.close()
    http = _client(sglang_sim_child, token=sglang_sim_child.token)
    try:  # the samples the calls left in the child
        for rid in ("hop-timeout-long", "hop-timeout-short"):
            await http.request("POST", "/abort_request", {"rid": rid})
    finally:
        await http.close()


async def test_a_refused_or_failed_generate_is_an_engine_error_not_a_refusal(tiny_model_dir: pathlib.Path) -> None:
    """F5: a 4xx/5xx after rollpool's own checks passed means the engine is broken: restart, don't blame the prompt."""
    answers = iter([(400, {"error": {"message": "ValueError: something inside"}}), (500, {"error": {"message": "KeyError"}})])

    async def ok(b: dict[str, Any]) -> tuple[int, Any]:
        return 200, {"success": True}

    async def generate(b: dict[str, Any]) -> tuple[int, Any]:
        return next(answers)

    port = _free_port()
    runner = await serve_routes({"/health_generate": ok, "/update_weight_version": ok, "/generate": generate}, "127.0.0.1", port, "tok")
    engine = SGLangEngine(model=str(tiny_model_dir), url=f"http://127.0.0.1:{port}", api_key="tok", device="cpu")
    try:
        await engine.start()
        for rid in ("a", "b"):
            with pytest.raises(EngineError) as info:
                await engine.generate([1, 2, 3], 1, SamplingParams(max_new_tokens=4), rid)
            assert not isinstance(info.value, RequestRefusedError), info.value
    finally:
        await engine.stop()
        await runner.cleanup()


async def test_request_checks_use_the_checkpoints_limits(sglang_sim_child: SimChild) -> None:
    engine = SGLangEngine(model=sglang_sim_child.model, url=sglang_sim_child.url, api_key=sglang_sim_child.token, device="cpu")
    await engine.start()
    try:
        with pytest.raises(RequestRefusedError, match="token ids must be in \\[0, 320\\)"):
            await engine.generate([5, 320], 1, SamplingParams(), "vocab")
        for ids in ([-1, 5], np.array([5, 400], dtype=np.int32),  # a list (one int64 array) and an array of another width
                    TokenIds([5, 400]), TokenIds([5, 400], bounds=(5, 400)), TokenIds([-1, 5], bounds=(-1, 5))):
            with pytest.raises(RequestRefusedError, match="token ids must be in \\[0, 320\\)"):
                await engine.generate(ids, 1, SamplingParams(), "vocab")
        with pytest.raises(RequestRefusedError, match="context of 2048"):
            await engine.generate([5] * 100, 1, SamplingParams(max_new_tokens=1948), "ctx")
        with pytest.raises(EngineError, match="in_place is refused"):
            await engine.pause("in_place")
    finally:
        await engine.stop()


async def test_sglangs_cached_tokens_reach_the_sample(sglang_sim_child: SimChild) -> None:
    # SGLang reports the prompt tokens its radix cache served as meta_info.cached_tokens; the sim child's
    # prefix cache is simulated (the longest prefix among recent sequences, less the last sampled token)
    engine = SGLangEngine(model=sglang_sim_child.model, url=sglang_sim_child.url, api_key=sglang_sim_child.token, device="cpu")
    await engine.start()
    try:
        prompt = [301, 17, 299, 3, 250, 41]
        first = (await engine.generate(prompt, 1, SamplingParams(max_new_tokens=8, ignore_eos=True), "cache-1")).samples[0]
        assert first.cached_tokens == 0
        again = prompt + first.output_ids + [7, 8]
        second = (await engine.generate(again, 1, SamplingParams(max_new_tokens=4, ignore_eos=True), "cache-2")).samples[0]
        assert second.cached_tokens == len(prompt) + len(first.output_ids) - 1
    finally:
        await engine.stop()


async def test_an_interrupt_update_uses_sglangs_update_without_pause(sglang_sim_child: SimChild) -> None:
    # SGLang 0.5.14's pause_generation(abort) re-checks for running calls only once a second; with every sample
    # aborted and back, the update needs no pause: it takes the model-update lock at once (nothing generating) and
    # flushes an idle cache. The sim child counts the control calls and the updates that found samples generating.
    import torch

    engine = SGLangEngine(model=sglang_sim_child.model, url=sglang_sim_child.url, api_key=sglang_sim_child.token, device="cpu",
                          capacity=8)
    await engine.start()
    try:
        before = (await engine._post("/model_info", method="GET"))["control_calls"]
        v0 = engine.version
        sp = SamplingParams(max_new_tokens=60, ignore_eos=True, seed=5)
        running = asyncio.create_task(engine.generate([5, 6, 7, 8], 4, sp, "running"))
        for _ in range(2000):  # every sample sent
            if engine.stats["attempts"] >= 4 and engine._in_sglang == 4:
                break
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)  # some tokens decoded on v0
        await engine.pause("interrupt")
        new = {k: torch.zeros(shape) for k, (_dt, shape) in engine._params.items()}
        await engine.update_weights(new, v0 + 1)
        await engine.resume()
        out = await asyncio.wait_for(running, 30)
        after = (await engine._post("/model_info", method="GET"))["control_calls"]
        assert after["updates_while_generating"] == before["updates_while_generating"]  # nothing was in SGLang
        assert after["pause_generation"] == before["pause_generation"]
        assert after["continue_generation"] == before["continue_generation"]
        assert engine.stats["resubmits"] >= 4
        for s in out.samples:  # per-token versions stay exact: v0 before the update, v0 + 1 after
            assert len(s.output_ids) == 60
            assert s.token_versions[0] == v0 and s.token_versions[-1] == v0 + 1
            assert s.token_versions == sorted(s.token_versions)
        assert engine.last_update["stopped_s"] >= engine.last_update["pause_s"] > 0
    finally:
        await engine.stop()


async def test_the_apply_record_says_where_a_delta_version_was_rebuilt(sglang_sim_child: SimChild) -> None:
    """The worker tells the engine how a version was fetched (`note_fetch`): its apply record (``sglang apply``) carries
    where a delta was rebuilt and the GPU's seconds for it, for that version only."""
    import torch

    engine = SGLangEngine(model=sglang_sim_child.model, url=sglang_sim_child.url, api_key=sglang_sim_child.token, device="cpu")
    await engine.start()
    try:
        new = {k: torch.zeros(shape) for k, (_dt, shape) in engine._params.items()}
        v = engine.version
        engine.note_fetch(v + 1, {"path": "network", "delta_base": v, "delta_rebuilt_on": "device", "device_rebuild_s": 0.012})
        await engine.pause("interrupt")
        await engine.update_weights(new, v + 1)
        await engine.resume()
        assert engine.last_update["delta_rebuilt_on"] == "device" and engine.last_update["delta_device_rebuild_s"] == 0.012
        assert engine.last_update["delta_base"] == v
        engine.note_fetch(v + 5, {"delta_rebuilt_on": "host"})  # another version's note: not this apply's
        await engine.pause("interrupt")
        await engine.update_weights(new, v + 2)
        await engine.resume()
        assert "delta_rebuilt_on" not in engine.last_update and "h2d_s" in engine.last_update
    finally:
        await engine.stop()


@pytest.fixture
async def owned(tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> AsyncIterator[SGLangEngine]:
    """An engine that launches its own child (the worker's path), sim backend."""
    engine = SGLangEngine(model=str(tiny_model_dir), capacity=8, device="cpu", backend="sim", log_dir=str(tmp_path),
                          server_args=json.dumps({**SIM_SERVER_ARGS, "decode_s_per_token": 0.01}), start_timeout_s=60)
    await engine.start()
    yield engine
    await engine.stop()


async def test_the_launch_token_is_fresh_private_and_gone_after_stop(owned: SGLangEngine) -> None:
    assert owned.token_path is not None and owned.token_path.read_text() == owned.token and len(owned.token) >= 32
    assert stat.S_IMODE(owned.token_path.stat().st_mode) == 0o600
    assert owned.token not in " ".join(owned.command())  # argv is readable by every local user
    path = owned.token_path
    out = await owned.generate([1, 2, 3], 2, SamplingParams(max_new_tokens=5, ignore_eos=True), "r")
    assert [len(s.output_ids) for s in out.samples] == [5, 5] and out.simulated and owned.info().simulated
    await owned.stop()
    assert not path.exists()


async def test_a_dead_child_fails_running_and_later_calls_at_once(owned: SGLangEngine) -> None:
    task = asyncio.create_task(owned.generate([1, 2, 3], 2, SamplingParams(max_new_tokens=1000, ignore_eos=True), "long"))
    await asyncio.sleep(0.1)
    assert owned._proc is not None
    os.killpg(owned._proc.pid, signal.SIGKILL)  # what a crashing SGLang scheduler does to its tree
    with pytest.raises(EngineError, match="exited"):
        await asyncio.wait_for(task, 10)
    with pytest.raises(EngineError, match="not running"):
        await owned.generate([1, 2, 3], 1, SamplingParams(max_new_tokens=2), "after")


class _HeldClient:
    """A hop client whose calls wait until the test answers them."""

    def __init__(self) -> None:
        self.calls: list[asyncio.Future[Any]] = []
        self.arrived = asyncio.Event()

    async def request(self, method: str, path: str, body: Any = None, timeout_s: float | None = None) -> Any:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.calls.append(fut)
        self.arrived.set()
        return await fut

    async def held(self, n: int) -> None:
        """Until `n` calls wait here."""
        while len(self.calls) < n:
            self.arrived.clear()
            await self.arrived.wait()


def _engine_on(client: _HeldClient) -> SGLangEngine:
    """An engine's `_post` state around a held client (no child process)."""
    engine = SGLangEngine.__new__(SGLangEngine)
    engine._dead = None
    engine._died = asyncio.get_running_loop().create_future()
    engine._gate = asyncio.Event()
    engine._children = [type("Child", (), {"hop": client, "http": client})()]  # type: ignore[list-item]
    return engine


async def test_a_death_fails_a_running_post_and_a_callers_cancel_stays_a_cancel() -> None:
    client = _HeldClient()
    engine = _engine_on(client)
    running = asyncio.create_task(engine._post("/generate", {}))
    cancelled = asyncio.create_task(engine._post("/generate", {}))
    await client.held(2)
    engine._mark_dead("SGLang server exited with code -9")
    cancelled.cancel()  # the caller's cancel in the same pass of the loop as the death: it stays a cancel
    with pytest.raises(EngineError, match="exited"):
        await running
    with pytest.raises(asyncio.CancelledError):
        await cancelled


async def test_a_death_after_a_post_ended_cancels_nothing_later() -> None:
    client = _HeldClient()
    engine = _engine_on(client)

    async def call_then_wait() -> str:
        assert await engine._post("/generate", {}) == "answer"
        await asyncio.sleep(0.05)  # the death's callback, scheduled before the call's end was seen, runs here
        return "done"

    task = asyncio.create_task(call_then_wait())
    await client.held(1)
    client.calls[0].set_result("answer")
    engine._mark_dead("SGLang server exited with code -9")  # in the same pass of the loop as the answer
    assert await task == "done"


async def test_the_warm_up_update_loads_back_the_values_sglang_holds(owned: SGLangEngine, caplog: pytest.LogCaptureFixture) -> None:
    """The engine's warm-up (run at start on CUDA, so the first version does not pay SGLang's first update) writes
    the smallest 1-D parameter back with the values SGLang answers: an update happens and no weight changes."""
    torch = pytest.importorskip("torch")
    ones = sorted((shape[0], name) for name, (_d, shape) in owned._params.items() if len(shape) == 1)
    n, name = ones[0]
    want = torch.randn(n).to(torch.bfloat16)
    await owned.pause("drain")
    await owned.update_weights({name: want}, 3)  # the sim child answers only for weights it was sent
    await owned.resume()
    with caplog.at_level(logging.INFO, logger="rollpool.workers.engines.sglang.engine"):
        await owned._warm_update()
    assert any(f"warm-up update of {name} ({n} values, the same ones) done" in r.getMessage() for r in caplog.records), caplog.text
    got = await owned._post("/get_weights_by_name", {"name": name, "truncate_size": n})
    assert torch.equal(torch.tensor(got, dtype=torch.float32).to(torch.bfloat16), want)
    assert owned.version == 3


async def test_a_model_sglang_cannot_read_back_takes_versions_confirmed_by_sglangs_answer(tiny_model_dir: pathlib.Path,
                                                                                          tmp_path: pathlib.Path,
                                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """SGLang 0.5.14 reads a weight back (``get_weights_by_name``) only for Llama, OPT, Granite and Exaone4: for a
    Qwen-family model or Qwen2-VL it answers 400 with null. Seen on an H100 with Qwen2-VL: every version failed its
    check ("cannot confirm ... landed"), restarted the engine and was skipped. The child says so in ``/model_info``
    (the sim child's ``weights_readable`` false is its stand-in) and the version applies, confirmed by SGLang's
    success answer; a model that can be read back is still checked."""
    import torch

    args = {**SIM_SERVER_ARGS, "decode_s_per_token": 0.001, "weights_readable": False}
    engine = SGLangEngine(model=str(tiny_model_dir), capacity=4, device="cpu", backend="sim", log_dir=str(tmp_path),
                          server_args=json.dumps(args), start_timeout_s=60)
    with caplog.at_level(logging.WARNING, logger="rollpool.workers.engines.sglang.engine"):
        await engine.start()
    try:
        new = {k: torch.full(shape, 0.5) for k, (_dt, shape) in engine._params.items()}
        await engine.pause("drain")
        await engine.update_weights(new, engine.version + 1)
        await engine.resume()
        out = await engine.generate([5, 6, 7], 1, SamplingParams(max_new_tokens=4, ignore_eos=True, seed=1), "after")
        assert out.samples[0].token_versions == [engine.version] * 4
        assert engine.update_check == "sglang answer" and engine.info().extra["update_check"] == "sglang answer"
        assert "cannot read a weight back" in caplog.text
    finally:
        await engine.stop()


async def test_a_model_sglang_reads_back_is_checked_against_what_was_sent(owned: SGLangEngine) -> None:
    assert owned.weights_readable is True and owned.update_check == "read back"


def test_the_sglang_engine_declares_staging() -> None:
    assert isinstance(SGLangEngine(model="m"), StagingEngine)
    assert not isinstance(SimEngine(), StagingEngine)


def test_options_are_typed_by_field_and_errors_name_the_field() -> None:
    o = parse_options(SGLangOptions, "model=/m,capacity=8,verify_updates=false,server_cmd=1,url=none,mem_fraction_static=0.3")
    assert (o.capacity, o.verify_updates, o.server_cmd, o.url, o.mem_fraction_static, o.hop) == (8, False, "1", None, 0.3, "auto")
    assert parse_options(SGLangOptions, "model=/m,url=http://h:1,hop=ipc:///tmp/h").hop == "ipc:///tmp/h"
    assert parse_options(HFOptions, "model=/m,num_threads=2").num_threads == 2
    assert parse_options(SimOptions, "length=fixed,decode_s_per_token=0.01").decode_s_per_token == 0.01
    cases = [
        ("sglang", "capacity=0", "SGLangOptions.capacity must be >= 1"),
        ("sglang", "port=abc", "SGLangOptions.port must be an integer"),
        ("sglang", "prot=1", "SGLangOptions has no option 'prot'"),
        ("sglang", "server_args=[1]", "SGLangOptions.server_args must be a JSON object"),
        ("sglang", "backend=vllm", "SGLangOptions.backend must be one of"),
        ("sglang", "verify_updates=maybe", "SGLangOptions.verify_updates must be true or false"),
        ("sglang", "hop=ipc:///tmp/x", "SGLangOptions.hop must be auto, off, or \\(with url=\\)"),  # an endpoint needs url=
        ("sglang", "hop=on", "SGLangOptions.hop must be auto, off"),
        ("sim", "length=weird", "SimOptions.length must be one of"),
        ("hf", "dtype=float8", "HFOptions.dtype must be one of"),
    ]
    for engine, text, message in cases:
        with pytest.raises(ConfigError, match=f"^WorkerConfig.engine_options: {message}"):
            WorkerConfig(engine=engine, model="/m", engine_options=text)
    cfg = WorkerConfig(engine="sglang", model="/m", capacity=4, engine_options="port=31000,verify_updates=no")
    assert cfg.engine_kwargs() == {"port": 31000, "verify_updates": False, "model": "/m", "capacity": 4}
    with pytest.raises(ConfigError, match="HFOptions.model is needed"):
        WorkerConfig(engine="hf")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_only_the_child_module_imports_sglang() -> None:
    import ast

    root = pathlib.Path(__file__).parents[3] / "rollpool"
    importers = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "sglang" or n.startswith("sglang.") for n in names):
                importers.add(path.relative_to(root).as_posix())
    assert importers == {"workers/engines/sglang/server.py"}


def test_token_ids_hold_the_ids_that_follow_in_their_array_too() -> None:
    """`TokenIds(ids, more=...)` is the list of both; its array, when not given, is made of both as well (it was made of
    `ids` alone, so an engine sending the array would have sent a shorter prompt than the list says)."""
    both = TokenIds([1, 2], more=[3, 4])
    assert list(both) == [1, 2, 3, 4] and both.array.tolist() == [1, 2, 3, 4] and both.int32().tolist() == [1, 2, 3, 4]
    given = TokenIds([1, 2], np.array([1, 2, 3], dtype=np.int64), more=[3])
    assert list(given) == given.array.tolist() == [1, 2, 3]
    with pytest.raises(ValueError):
        TokenIds([1, 2], np.array([1, 2], dtype=np.int64), more=[3])  # an array that is not the ids
