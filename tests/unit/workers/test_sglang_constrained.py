"""Constrained decoding on the sglang engine, on a CPU: the engine's real child with the sim backend.

What is real: the engine, its child process and the grammar it sends (xgrammar EBNF, compiled in the child by
xgrammar for the model's tokenizer, as SGLang's grammar backend compiles it). What is a fake, named in
server.py: `SimGrammar` draws each token uniformly among those the grammar allows (no model), so every parse
below holds only because of the grammar. Real SGLang runs the same path in tests/gpu/test_sglang_constrained_gpu.py.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

pytest.importorskip("aiohttp")
pytest.importorskip("xgrammar")
pytest.importorskip("transformers")

from rollpool.protocol.errors import RequestRefusedError
from rollpool.protocol.messages import FinishReason, SamplingParams
from rollpool.workers.engines.base import ConstrainedEngine, OutputConstraint
from rollpool.workers.engines.sglang.engine import SGLangEngine
from rollpool.workers.engines.sglang.http import HttpError
from rollpool.workers.episodes.toolcalls import HermesToolCallParser

from .conftest import SIM_SERVER_ARGS

# one child with a grammar backend for the module (its first grammar request imports xgrammar and torch: seconds)
pytestmark = pytest.mark.asyncio(loop_scope="module")

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"], "additionalProperties": False}


async def _engine(model: pathlib.Path, log_dir: pathlib.Path, grammar_backend: str, decode_s: float = 0.002) -> SGLangEngine:
    engine = SGLangEngine(model=str(model), capacity=8, device="cpu", backend="sim", log_dir=str(log_dir), start_timeout_s=60,
                          grammar_backend=grammar_backend, server_args=json.dumps({**SIM_SERVER_ARGS, "decode_s_per_token": decode_s}))
    await engine.start()
    return engine


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def grammar_engine(tiny_model_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SGLangEngine]:
    engine = await _engine(tiny_model_dir, tmp_path_factory.mktemp("grammar"), "auto", decode_s=0.01)  # auto: xgrammar imports here
    yield engine
    await engine.stop()


@pytest.fixture(scope="module")
def tok(tiny_model_dir: pathlib.Path) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir)


def _sampling(tok: Any, **kw: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=kw.pop("max_new_tokens", 200), stop_token_ids=(tok.convert_tokens_to_ids("<|im_end|>"),), **kw)


async def test_a_forced_call_and_a_schema_hold_and_end_with_the_requests_stop_token(grammar_engine: SGLangEngine, tok: Any) -> None:
    assert isinstance(grammar_engine, ConstrainedEngine) and grammar_engine.info().extra["grammar_backend"] == "xgrammar"
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    served = (await grammar_engine._post("/model_info", method="GET"))["grammar_requests"]
    tools = {"weather": CITY, "time": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}
    call = HermesToolCallParser().call_constraint(tools)
    out = await grammar_engine.generate_constrained([5, 6, 7], 3, _sampling(tok, seed=3), "call", call)
    for s in out.samples:
        assert s.finish_reason == FinishReason.STOP and s.output_ids[-1] == im_end  # the end-of-turn ends the grammar
        text = tok.decode(s.output_ids[:-1])
        content, calls = HermesToolCallParser().parse(text)
        assert content == "" and len(calls) == 1 and calls[0].name in tools, text
        args = json.loads(calls[0].arguments)
        assert args in ([{"city": c, "sunny": b} for c in ("Paris", "Rome", "Oslo") for b in (True, False)]
                        + [{"zone": "UTC"}, {"zone": "CET"}])
        assert len(s.logprobs) == len(s.output_ids) == len(s.token_versions)
    schema = OutputConstraint(json_schema=json.dumps(CITY))
    (s,) = (await grammar_engine.generate_constrained([5, 6, 7], 1, _sampling(tok, seed=4), "schema", schema)).samples
    answer = json.loads(tok.decode(s.output_ids[:-1]))
    assert answer["city"] in ("Paris", "Rome", "Oslo") and isinstance(answer["sunny"], bool) and set(answer) == {"city", "sunny"}
    info = await grammar_engine._post("/model_info", method="GET")
    assert info["grammar_requests"] - served == 4  # every sample went to the child's grammar backend
    # an unconstrained request on the same engine is not held to anything
    plain = await grammar_engine.generate([5, 6, 7], 1, SamplingParams(max_new_tokens=8, ignore_eos=True), "plain")
    assert len(plain.samples[0].output_ids) == 8
    assert (await grammar_engine._post("/model_info", method="GET"))["grammar_requests"] - served == 4


async def test_without_a_grammar_backend_the_engine_refuses_naming_itself(tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path,
                                                                          tok: Any) -> None:
    engine = await _engine(tiny_model_dir, tmp_path, "none")
    try:
        assert engine.info().extra["grammar_backend"] == "none"
        with pytest.raises(RequestRefusedError, match="not served by the sglang engine here: its SGLang runs without a grammar backend"):
            await engine.generate_constrained([5, 6, 7], 1, _sampling(tok), "r", OutputConstraint())
        with pytest.raises(RequestRefusedError, match="ignore_eos cannot be combined"):
            engine.grammar_backend = "xgrammar"  # past the first check: the second is the engine's own
            await engine.generate_constrained([5, 6, 7], 1, SamplingParams(max_new_tokens=4, ignore_eos=True), "r", OutputConstraint())
        # the child itself refuses a grammar as SGLang without a backend does (400, never a sample)
        with pytest.raises(HttpError, match="grammar-backend none") as err:
            await engine._post("/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4, "ebnf": 'root ::= "a"'},
                                             "return_logprob": True, "rid": "x"})
        assert err.value.status == 400
        plain = await engine.generate([5, 6, 7], 1, SamplingParams(max_new_tokens=3, ignore_eos=True), "plain")
        assert len(plain.samples[0].output_ids) == 3
    finally:
        await engine.stop()


async def test_a_schema_that_does_not_compile_is_refused_before_anything_is_sent(grammar_engine: SGLangEngine, tok: Any) -> None:
    bad = OutputConstraint(json_schema='{"type": "object", "properties": {"a": {"type": "no-such-type"}}}')
    attempts = grammar_engine.stats["attempts"]
    with pytest.raises(RequestRefusedError, match="does not compile"):
        await grammar_engine.generate_constrained([5, 6, 7], 1, _sampling(tok), "bad", bad)
    assert grammar_engine.stats["attempts"] == attempts


async def test_an_interrupt_update_lets_a_constrained_sample_finish_on_its_version(grammar_engine: SGLangEngine, tok: Any) -> None:
    """A grammar cannot resume inside a partial output: the interrupt aborts and resubmits the unconstrained sample,
    and waits for the constrained one, whose every token keeps the version it began on."""
    schema = OutputConstraint(json_schema=json.dumps(CITY))
    await grammar_engine.generate_constrained([5, 6, 7], 1, _sampling(tok, seed=5), "warm", schema)  # the child's compiler is ready
    before = dict(grammar_engine.stats)
    held = asyncio.create_task(grammar_engine.generate_constrained([5, 6, 7], 1, _sampling(tok, seed=5), "held", schema))
    free = asyncio.create_task(grammar_engine.generate([5, 6, 7], 1, SamplingParams(max_new_tokens=120, ignore_eos=True), "free"))
    await asyncio.sleep(0.08)
    assert not held.done() and not free.done()
    await grammar_engine.pause("interrupt")
    assert held.done()  # the pause returned only once the constrained sample had finished
    await grammar_engine.update_weights({}, 1)
    await grammar_engine.resume()
    (h,), (f,) = (await held).samples, (await free).samples
    assert h.finish_reason == FinishReason.STOP and set(h.token_versions) == {0}
    assert json.loads(tok.decode(h.output_ids[:-1]))["city"] in ("Paris", "Rome", "Oslo")
    assert len(f.output_ids) == 120 and f.token_versions[0] == 0 and f.token_versions[-1] == 1
    assert grammar_engine.stats["resubmits"] - before["resubmits"] == 1 and grammar_engine.stats["restarts"] == before["restarts"]


async def test_a_constrained_sample_aborted_by_someone_else_starts_over(grammar_engine: SGLangEngine, tok: Any) -> None:
    schema = OutputConstraint(json_schema=json.dumps(CITY))
    await grammar_engine.generate_constrained([5, 6, 7], 1, _sampling(tok, seed=6), "warm", schema)  # the child's compiler is ready
    before = dict(grammar_engine.stats)
    task = asyncio.create_task(grammar_engine.generate_constrained([5, 6, 7], 1, _sampling(tok, seed=6), "again", schema))
    await asyncio.sleep(0.05)
    await grammar_engine._post("/abort_request", {"rid": "", "abort_all": True})  # not the engine's own pause
    (s,) = (await task).samples
    assert grammar_engine.stats["restarts"] - before["restarts"] == 1 and grammar_engine.stats["attempts"] - before["attempts"] == 2
    answer = json.loads(tok.decode(s.output_ids[:-1]))  # the whole output is one run of the grammar
    assert set(answer) == {"city", "sunny"}


async def test_the_grammar_backend_option_is_checked_and_reaches_the_child() -> None:
    from rollpool.protocol.errors import ConfigError
    from rollpool.workers.config import WorkerConfig

    with pytest.raises(ConfigError, match="SGLangOptions.grammar_backend must be one of"):
        WorkerConfig(engine="sglang", model="/m", engine_options="grammar_backend=xgrammer")
    cmd = SGLangEngine(model="/m", grammar_backend="none").command()
    assert json.loads(cmd[cmd.index("--engine-kwargs") + 1])["grammar_backend"] == "none"
    cmd = SGLangEngine(model="/m").command()
    assert json.loads(cmd[cmd.index("--engine-kwargs") + 1])["grammar_backend"] == "auto"  # the child resolves it
