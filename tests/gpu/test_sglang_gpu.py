"""The engine contract and the wire format on real SGLang (H200; marked gpu + sglang, skipped elsewhere).

One SGLang server for the module (started once: ~1 min, with a per-launch token
in its environment as the engine starts it); each test attaches a fresh
`SGLangEngine` to it with ``url=`` and that token. The worker-owned
child-process path runs in bench/gpu_sglang.py (which also runs these tests
directly, as the H200 has no pytest-asyncio). With ``ROLLPOOL_SGLANG_GOLDEN_DIR`` set, the raw
``/generate`` answers are written there (tests/fixtures/sglang is made from them).
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import secrets
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from rollpool.protocol.errors import EngineError
from rollpool.protocol.messages import FinishReason, SamplingParams
from rollpool.workers.engines.sglang.engine import SGLangEngine
from rollpool.workers.engines.sglang.http import TOKEN_ENV, HttpClient
from rollpool.workers.engines.sglang.wire import generate_body, parse_generate_response, sample_rid
from tests.unit.workers.test_engine_contract import (  # noqa: F401 - the contract suite, collected here again
    EngineCase,
    test_abort_keeps_partial_output,
    test_apply_mode_tags_later_tokens_with_the_new_version,
    test_generate_returns_n_complete_samples,
    test_generate_waits_while_paused,
    test_info_declares_capacity_modes_and_fingerprint,
    test_refuses_bad_requests_with_request_refused_error,
    test_request_joins_while_another_decodes,
)

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]


@pytest.fixture(scope="module")
def sglang_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    model = os.environ.get("ROLLPOOL_SGLANG_TEST_MODEL")
    if not model:
        from rollpool.workers.engines.tiny_model import build_tiny_model

        model = str(build_tiny_model(tmp_path_factory.mktemp("sg") / "model", vocab=1024, hidden=256, layers=2, heads=4, kv_heads=2))
    port = 30000 + os.getpid() % 1000
    eng = SGLangEngine(model=model, port=port, capacity=64, mem_fraction_static=0.15, cuda_graph_max_bs=16)
    log_path = pathlib.Path(os.environ.get("ROLLPOOL_SGLANG_LOG_DIR", str(tmp_path_factory.mktemp("log")))) / "sglang-test-server.log"
    token = secrets.token_urlsafe(32)
    with log_path.open("ab") as fh:
        proc = subprocess.Popen(eng.command(), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, TOKEN_ENV: token})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 400
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"SGLang exited {proc.returncode}: {log_path.read_text()[-3000:]}")
            try:
                req = urllib.request.Request(url + "/health_generate", headers={"Authorization": f"Bearer {token}"})
                with urllib.request.urlopen(req, timeout=30) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("SGLang did not start")
            time.sleep(1)
        yield url, model, token
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


async def make_case(url: str, model: str, token: str) -> EngineCase:
    engine = SGLangEngine(model=model, url=url, api_key=token, capacity=64)
    await engine.start()

    def new_weights() -> dict[str, Any]:
        import torch

        g = torch.Generator(device="cuda").manual_seed(7)
        return {k: (torch.randn(shape, generator=g, device="cuda") * 0.05).to(torch.bfloat16)
                for k, (_dt, shape) in engine._params.items()}

    async def progressed() -> None:
        # no token counts come back before a non-streaming request ends: 50 ms is ~25 decode steps of the small model
        await asyncio.sleep(0.05)

    # warm up: the first request after a (re)start can wait in SGLang's queue well past 50 ms, and an abort that
    # finds a request still queued returns no tokens ("Abort in waiting queue", API-NOTES 4.4)
    await engine.generate([10, 20, 30, 40, 50], 2, SamplingParams(max_new_tokens=16, ignore_eos=True), "warmup")
    return EngineCase("sglang", engine, new_weights, progressed, [10, 20, 30, 40, 50])


@pytest.fixture
async def case(sglang_server: tuple[str, str, str]) -> AsyncIterator[EngineCase]:
    c = await make_case(*sglang_server)
    yield c
    await c.engine.stop()


async def test_same_seed_same_output() -> None:
    """Kept as a named skip so the gap is visible in the contract run."""
    pytest.skip("SGLang 0.5.14 does not reproduce a seeded sample without enable_deterministic_inference (seen on the H200)")


async def test_in_place_is_refused_clearly(case: EngineCase) -> None:
    with pytest.raises(EngineError, match="in_place is refused on SGLang 0.5.14"):
        await case.engine.pause("in_place")


async def test_misspelt_weight_name_fails_loudly(case: EngineCase) -> None:
    import torch

    with pytest.raises(EngineError, match="unknown parameter"):
        await case.engine.update_weights({"model.layers.0.self_attn.q_projj.weight": torch.zeros(2, 2)}, 99)


async def test_live_responses_parse_and_record(sglang_server: tuple[str, str, str]) -> None:
    url, _model, token = sglang_server
    host, port = url.removeprefix("http://").split(":")
    http = HttpClient(host, int(port), token=token)
    golden: dict[str, Any] = {}
    prompt = [10, 20, 30, 40, 50, 60]
    rid = iter(range(1000))

    def body(sp: SamplingParams) -> dict[str, Any]:
        return generate_body(prompt, sp, rid=sample_rid("goldenab", next(rid), 0, 0), index=0)

    golden["length"] = await http.request("POST", "/generate", body(SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)))
    p = parse_generate_response(golden["length"])
    assert p.finish_reason == FinishReason.LENGTH and len(p.output_ids) == len(p.logprobs) == 8
    stop_tok = p.output_ids[3]
    golden["stop_token"] = await http.request("POST", "/generate", body(SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=(stop_tok,))))
    q = parse_generate_response(golden["stop_token"])
    assert q.finish_reason == FinishReason.STOP and q.matched_stop == stop_tok and q.output_ids[-1] == stop_tok
    text = p.text or ""
    if len(text) >= 4:
        stop_s = text[len(text) // 2 : len(text) // 2 + 2]
        golden["stop_string"] = await http.request("POST", "/generate", body(SamplingParams(max_new_tokens=16, temperature=0.0, stop=(stop_s,))))
        r = parse_generate_response(golden["stop_string"])
        assert r.finish_reason == FinishReason.STOP and r.matched_stop == stop_s
        golden["stop_string_asked"] = stop_s
    long_body = body(SamplingParams(max_new_tokens=1500, ignore_eos=True, temperature=1.0))
    task = asyncio.ensure_future(http.request("POST", "/generate", long_body))
    await asyncio.sleep(0.3)
    await http.request("POST", "/abort_request", {"rid": long_body["rid"], "abort_all": False})
    golden["abort"] = await asyncio.wait_for(task, 30)
    a = parse_generate_response(golden["abort"])
    assert a.finish_reason == FinishReason.ABORT and 0 < len(a.output_ids) < 1500 and len(a.output_ids) == len(a.logprobs)
    golden["model_info"] = await http.request("GET", "/model_info")
    out = os.environ.get("ROLLPOOL_SGLANG_GOLDEN_DIR")
    if out:
        pathlib.Path(out).mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - test output
        (pathlib.Path(out) / "golden.json").write_text(json.dumps(golden, indent=1))
    await http.close()


async def test_the_server_refuses_a_request_without_the_token(sglang_server: tuple[str, str, str]) -> None:
    from rollpool.workers.engines.sglang.http import HttpError

    url, _model, _token = sglang_server
    host, port = url.removeprefix("http://").split(":")
    http = HttpClient(host, int(port))
    try:
        with pytest.raises(HttpError) as info:
            await http.request("POST", "/update_weights_from_tensor", {"serialized_named_tensors": ["x"]})
        assert info.value.status == 401
    finally:
        await http.close()
