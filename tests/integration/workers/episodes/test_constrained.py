"""Forced tool calls, structured output and the sampling fields, on the real `hf` engine (the random tiny model, xgrammar).

A random model follows no format by itself: every parse below holds only because of the grammar.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from rollpool.protocol.messages import Prompt, SamplingParams
from rollpool.workers import EpisodeContext
from rollpool.workers.episodes import EpisodeConfig, EpisodeRunner
from tests.integration.workers.episodes.test_openai_endpoint import _client, _run

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")
pytest.importorskip("transformers")
pytest.importorskip("xgrammar")

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def hf_engine_factory(tiny_model_dir: pathlib.Path) -> Any:
    from rollpool.workers.engines.hf import HFEngine

    return lambda: HFEngine(model=str(tiny_model_dir), capacity=4, num_threads=1)


async def _episode(engine_factory: Any, agent: Any) -> list[Any]:
    engine = engine_factory()
    await engine.start()
    try:
        async with EpisodeRunner(engine, agent, EpisodeConfig(), worker_id="w") as runner:
            return await runner.run_group(Prompt(prompt_id="c", text="weather?", group_size=1,
                                                 sampling=SamplingParams(max_new_tokens=120)))
    finally:
        await engine.stop()


async def test_forced_tools_and_json_schema_hold_on_the_hf_engine(hf_engine_factory: Any) -> None:
    seen: dict[str, Any] = {}

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> None:
        async with _client(ctx) as client:
            messages: list[Any] = [{"role": "user", "content": "weather in Paris?"}]
            r = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS, tool_choice="required",
                                                     temperature=1.0, seed=1)
            seen["required"] = r.choices[0]
            messages.append(r.choices[0].message)
            messages += [{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in r.choices[0].message.tool_calls or []]
            r = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS, seed=2,
                                                     tool_choice={"type": "function", "function": {"name": "time"}})
            seen["named"] = r.choices[0]
            messages.append(r.choices[0].message)
            messages += [{"role": "tool", "tool_call_id": c.id, "content": "noon"} for c in r.choices[0].message.tool_calls or []]
            r = await client.chat.completions.create(
                model=ctx.model, messages=messages, seed=3, logprobs=True,
                response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": CITY, "strict": True}})
            seen["schema"] = r
            r = await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "json"}], seed=4,
                                                     max_tokens=200, response_format={"type": "json_object"})
            seen["object"] = r.choices[0]

    out = await _episode(hf_engine_factory, agent)
    required = seen["required"]
    assert required.finish_reason == "tool_calls" and len(required.message.tool_calls) == 1
    call = required.message.tool_calls[0].function
    assert call.name in ("weather", "time")
    assert json.loads(call.arguments) in ([{"city": c, "sunny": b} for c in ("Paris", "Rome", "Oslo") for b in (True, False)]
                                          + [{"zone": "UTC"}, {"zone": "CET"}])
    named = seen["named"].message.tool_calls[0].function
    assert named.name == "time" and json.loads(named.arguments)["zone"] in ("UTC", "CET")
    schema = seen["schema"].choices[0]
    answer = json.loads(schema.message.content)
    assert answer["city"] in ("Paris", "Rome", "Oslo") and isinstance(answer["sunny"], bool) and set(answer) == {"city", "sunny"}
    assert all(x.logprob <= 0 for x in schema.logprobs.content)
    if seen["object"].finish_reason == "stop":  # a random model may fill a free object past max_tokens
        assert isinstance(json.loads(seen["object"].message.content), dict)
    # the trajectory marks exactly the tokens sampled under a grammar: here every sampled token
    (first, *rest) = out
    assert first.trajectory_id == "c:0"  # the forced calls went back unchanged: one segment until the fresh json_object prompt
    spans = [tuple(s) for t in out for s in t.metadata["constrained_tokens"]]
    sampled = sum(int(t.loss_mask.sum()) for t in out)
    assert sum(e - s for s, e in spans) == sampled and len(spans) == 4
    for t in out:
        for s, e in t.metadata["constrained_tokens"]:
            assert t.loss_mask[s:e].tolist() == [1] * (e - s)


async def test_an_engine_without_constrained_decoding_answers_400_naming_it(tiny_tokenizer: Any) -> None:
    errors: dict[str, Any] = {}

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> float:
        async with _client(ctx) as client:
            for name, kwargs in {
                "required": {"tools": TOOLS, "tool_choice": "required"},
                "schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": CITY}}},
                "unknown_tool": {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                "logit_bias": {"logit_bias": {"5": 10}},
                "presence_penalty": {"presence_penalty": 0.5},
                "frequency_penalty": {"frequency_penalty": 0.5},
                "top_logprobs": {"logprobs": True, "top_logprobs": 2},
            }.items():
                try:
                    await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "x"}], **kwargs)
                except openai.BadRequestError as exc:
                    errors[name] = exc.body
            r = await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "x"}],
                                                     presence_penalty=0, frequency_penalty=0.0, logit_bias={})
        return 1.0 if r.choices[0].message.content == "fine" else 0.0

    (t,), engine, _ = await _run(tiny_tokenizer, ["fine<|im_end|>"], agent)
    assert set(errors) == {"required", "schema", "unknown_tool", "logit_bias", "presence_penalty", "frequency_penalty", "top_logprobs"}
    assert "scripted engine does not serve" in errors["required"]["message"] and errors["required"]["param"] == "tool_choice"
    assert "scripted engine does not serve" in errors["schema"]["message"] and errors["schema"]["param"] == "response_format"
    assert errors["logit_bias"]["param"] == "logit_bias" and errors["presence_penalty"]["param"] == "presence_penalty"
    assert "top_logprobs is not served by the scripted engine" in errors["top_logprobs"]["message"]
    assert t.reward == 1.0 and len(engine.prompts) == 1 and "constrained_tokens" not in t.metadata


async def test_top_logprobs_are_reported_where_the_engine_can(hf_engine_factory: Any, tiny_model_dir: pathlib.Path) -> None:
    seen: list[Any] = []
    names: list[str] = []

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> None:
        async with _client(ctx) as client:
            names.extend([ctx.model, *(m.id for m in (await client.models.list()).data)])
            r = await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                                     logprobs=True, top_logprobs=3, seed=0)
            seen.extend(r.choices[0].logprobs.content)

    await _episode(hf_engine_factory, agent)
    assert names == [tiny_model_dir.name] * 2  # the served id is the model directory's name, not its path on this host
    assert seen and all(len(x.top_logprobs) == 3 for x in seen)
    for x in seen:
        best = [alt.logprob for alt in x.top_logprobs]
        assert best == sorted(best, reverse=True) and x.logprob <= best[0] + 1e-6


async def test_the_responses_api_forces_tools_and_formats_too(hf_engine_factory: Any) -> None:
    seen: dict[str, Any] = {}
    flat = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]} for t in TOOLS]

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> None:
        async with _client(ctx) as client:
            r = await client.responses.create(model=ctx.model, input="weather?", tools=flat,
                                              tool_choice={"type": "function", "name": "weather"})
            seen["call"] = r.output
            r = await client.responses.create(model=ctx.model, input="weather as JSON",
                                              text={"format": {"type": "json_schema", "name": "w", "schema": CITY}})
            seen["text"] = r.output_text

    out = await _episode(hf_engine_factory, agent)
    (call,) = seen["call"]
    assert call.type == "function_call" and call.name == "weather" and set(json.loads(call.arguments)) == {"city", "sunny"}
    assert json.loads(seen["text"])["city"] in ("Paris", "Rome", "Oslo")
    assert all(t.metadata["constrained_tokens"] for t in out)


async def test_a_constraint_that_cannot_hold_is_refused_and_the_episode_goes_on(hf_engine_factory: Any) -> None:
    errors: list[Any] = []

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> float:
        async with _client(ctx) as client:
            for kwargs in ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}},
                           {"response_format": {"type": "json_object"}, "extra_body": {"ignore_eos": True}}):
                try:
                    await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "x"}], **kwargs)
                except openai.BadRequestError as exc:
                    errors.append(exc.body["message"])
            r = await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "x"}], max_tokens=3)
        return float(r.usage.completion_tokens)

    (t,) = await _episode(hf_engine_factory, agent)
    assert len(errors) == 2 and "does not compile" in errors[0] and "ignore_eos" in errors[1]
    assert t.reward == 3.0 and "constrained_tokens" not in t.metadata


async def test_the_gpu_tests_agent_holds_on_the_sglang_engines_cpu_child(tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """tests/gpu/test_sglang_constrained_gpu.py's agent and checks, on the sglang engine whose child is the sim backend
    (its grammar backend a fake: uniform among the tokens xgrammar allows): the engine's request, the endpoint's
    forced calls and schema, and the trajectory's marks, without a GPU."""
    from rollpool.workers.engines.sglang.engine import SGLangEngine
    from tests.gpu.test_sglang_constrained_gpu import check, run_agent
    from tests.unit.workers.conftest import SIM_SERVER_ARGS

    engine = SGLangEngine(model=str(tiny_model_dir), capacity=4, device="cpu", backend="sim", log_dir=str(tmp_path),
                          start_timeout_s=60, grammar_backend="xgrammar", server_args=json.dumps(SIM_SERVER_ARGS))
    check(await run_agent(engine))


async def test_the_sglang_engine_without_a_grammar_backend_answers_400_naming_it(tiny_model_dir: pathlib.Path,
                                                                                   tmp_path: pathlib.Path) -> None:
    """Its SGLang runs with grammar_backend none: a constrained request is a 400 naming the engine and records
    nothing, and the episode goes on."""
    from rollpool.workers.engines.sglang.engine import SGLangEngine
    from rollpool.workers.engines.tokenizer import load_tokenizer
    from tests.unit.workers.conftest import SIM_SERVER_ARGS

    errors: list[Any] = []

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> None:
        async with _client(ctx) as client:
            try:
                await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "x"}], tools=TOOLS,
                                                     tool_choice="required")
            except openai.BadRequestError as exc:
                errors.append(exc.body)
            await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "x"}], max_tokens=4)

    engine = SGLangEngine(model=str(tiny_model_dir), capacity=4, device="cpu", backend="sim", log_dir=str(tmp_path),
                          start_timeout_s=60, grammar_backend="none", server_args=json.dumps(SIM_SERVER_ARGS))
    await engine.start()
    try:
        async with EpisodeRunner(engine, agent, EpisodeConfig(), tokenizer=load_tokenizer(str(tiny_model_dir)), worker_id="w") as runner:
            (t,) = await runner.run_group(Prompt(prompt_id="c", text="x", group_size=1, sampling=SamplingParams(max_new_tokens=8)))
    finally:
        await engine.stop()
    assert len(errors) == 1 and "not served by the sglang engine here" in errors[0]["message"], errors
    assert "constrained_tokens" not in t.metadata and int(t.loss_mask.sum()) == 4
