"""Each agent library of docs/episodes.md's table, unmodified, run as an episode: one test per row.

The libraries come from the ``agents`` dependency group (each test skips without its library). The
engine is `ScriptedEngine`, a FAKE at the process edge that answers a tool call, then the answer
(see test_openai_endpoint.py), with the tiny model's real tokenizer and chat template; the
structured-output row runs on the real `hf` engine (the random tiny model, held by the grammar).
What each test checks is what a porting user relies on: the library's own agent loop completes
(a real tool round trip), its history stays one segment, and the trained tokens are the sampled ones.
"""

from __future__ import annotations

import gc
import pathlib
from typing import Any

import pytest

from rollpool.protocol.messages import Prompt, SamplingParams
from rollpool.workers import EpisodeContext
from rollpool.workers.episodes import EpisodeConfig, EpisodeRunner
from tests.integration.workers.episodes.test_openai_endpoint import CALL, _run

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")

ANSWER = "It is 42.<|im_end|>"
added: list[tuple[int, int]] = []


def add(a: int, b: int) -> int:
    """Add two integers."""
    added.append((a, b))
    return a + b


def _one_segment(out: list[Any], engine: Any, turns: int) -> None:
    (t,) = out
    assert t.trajectory_id == "p:0" and len(engine.prompts) == turns
    full = t.input_ids.tolist() + t.output_ids.tolist()
    for p in engine.prompts:  # each turn's prompt holds the earlier sampled ids exactly
        assert full[: len(p)] == p


@pytest.fixture(autouse=True)
def _clear() -> Any:
    added.clear()
    # what lives before the test (torch, the tokenizer, the libraries already imported) is left out of the collection
    # below: a full collection of that heap took 1-4 s a test, and a client the test left open is made in the test
    gc.freeze()
    try:
        yield
        gc.collect()  # a client a library left open warns here, in the test that opened it
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("api", ["responses", "chat", "responses-streamed"])
async def test_openai_agents(tiny_tokenizer: Any, api: str) -> None:
    agents = pytest.importorskip("agents")

    agents.set_tracing_disabled(True)
    seen: dict[str, Any] = {}

    async def episode(ctx: EpisodeContext, prompt: Prompt) -> float:
        client = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key, max_retries=0)
        model_cls = agents.OpenAIChatCompletionsModel if api == "chat" else agents.OpenAIResponsesModel
        agent = agents.Agent(name="adder", instructions="You add numbers.", tools=[agents.function_tool(add)],
                             model=model_cls(model=ctx.model, openai_client=client))
        if api.endswith("streamed"):
            streamed = agents.Runner.run_streamed(agent, "What is 19 + 23?")
            seen["events"] = [e.type async for e in streamed.stream_events()]
            seen["output"] = streamed.final_output
        else:
            result = await agents.Runner.run(agent, "What is 19 + 23?")
            seen["output"] = result.final_output
        await client.close()
        return 1.0

    out, engine, runner = await _run(tiny_tokenizer, [CALL, ANSWER], episode)
    assert seen["output"] == "It is 42." and added == [(19, 23)]
    assert "events" not in seen or "raw_response_event" in seen["events"]  # streamed: the Responses events reached the agent
    _one_segment(out, engine, 2)


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_pydantic_ai(tiny_tokenizer: Any, api: str) -> None:
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    seen: dict[str, Any] = {}

    async def episode(ctx: EpisodeContext, prompt: Prompt) -> float:
        async with openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key, max_retries=0) as client:
            model = (OpenAIChatModel if api == "chat" else OpenAIResponsesModel)(ctx.model, provider=OpenAIProvider(openai_client=client))
            agent = Agent(model, instructions="You add numbers.", tools=[add])
            result = await agent.run("What is 19 + 23?")
        seen["output"] = result.output
        return 1.0

    out, engine, _ = await _run(tiny_tokenizer, [CALL, ANSWER], episode)
    assert seen["output"] == "It is 42." and added == [(19, 23)]
    _one_segment(out, engine, 2)  # pydantic-ai sends the call back with its arguments re-serialised


@pytest.mark.timeout(120)  # the hf engine on the tiny model; about 10 s on a loaded 2-core box
async def test_pydantic_ai_structured_output_on_the_hf_engine(tiny_model_dir: pathlib.Path) -> None:
    pytest.importorskip("pydantic_ai")
    pytest.importorskip("xgrammar")
    from typing import Literal

    from pydantic import BaseModel
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    from rollpool.workers.engines.hf import HFEngine

    class Weather(BaseModel):
        city: Literal["Paris", "Rome"]
        sunny: bool

    seen: dict[str, Any] = {}

    async def episode(ctx: EpisodeContext, prompt: Prompt) -> float:
        async with openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key, max_retries=0) as client:
            agent = Agent(OpenAIChatModel(ctx.model, provider=OpenAIProvider(openai_client=client)), output_type=Weather)  # a forced final_result tool
            seen["output"] = (await agent.run("Weather in Paris?")).output
        return 1.0

    engine = HFEngine(model=str(tiny_model_dir), capacity=2, num_threads=1)
    await engine.start()
    try:
        async with EpisodeRunner(engine, episode, EpisodeConfig(), worker_id="w") as runner:
            (t,) = await runner.run_group(Prompt(prompt_id="s", text="x", sampling=SamplingParams(max_new_tokens=96, seed=0)))
    finally:
        await engine.stop()
    assert isinstance(seen["output"], Weather)  # a random model, held by the grammar to the tool's schema
    (span,) = t.metadata["constrained_tokens"]
    assert span[1] - span[0] == int(t.loss_mask.sum()) and "episode_error" not in t.metadata


@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")  # LangGraph 1.x still ships it; users still write it
@pytest.mark.parametrize("responses_api", [False, True])
async def test_langgraph_named_react_agent(tiny_tokenizer: Any, responses_api: bool) -> None:
    pytest.importorskip("langgraph")
    pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    seen: dict[str, Any] = {}

    async def episode(ctx: EpisodeContext, prompt: Prompt) -> float:
        llm = ChatOpenAI(model=ctx.model, base_url=ctx.openai_base_url, api_key=ctx.api_key, max_retries=0,
                         use_responses_api=responses_api)
        graph = create_react_agent(llm, tools=[tool(add)], name="math_agent")  # named: what supervisors and swarms need
        state = await graph.ainvoke({"messages": [("user", "What is 19 + 23?")]})
        seen["output"] = state["messages"][-1].text
        await llm.root_async_client.close()
        return 1.0

    out, engine, _ = await _run(tiny_tokenizer, [CALL, ANSWER], episode)
    assert seen["output"] == "It is 42." and added == [(19, 23)]
    _one_segment(out, engine, 2)  # the named agent's assistant messages carry `name`


@pytest.mark.filterwarnings("ignore::UserWarning")  # litellm's own imports warn (pydantic ReadOnly TypedDicts)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("api", ["completion", "responses"])
async def test_litellm(tiny_tokenizer: Any, api: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import
    litellm = pytest.importorskip("litellm")
    import json

    tools = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
    seen: dict[str, Any] = {}

    async def episode(ctx: EpisodeContext, prompt: Prompt) -> float:
        where = {"model": f"openai/{ctx.model}", "api_base": ctx.openai_base_url, "api_key": ctx.api_key}
        if api == "completion":
            messages: list[Any] = [{"role": "user", "content": "What is 19 + 23?"}]
            r = await litellm.acompletion(messages=messages, tools=tools, **where)
            msg = r.choices[0].message
            call = msg.tool_calls[0]
            messages += [msg.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": str(add(**json.loads(call.function.arguments)))}]
            r = await litellm.acompletion(messages=messages, tools=tools, **where)
            seen["output"] = r.choices[0].message.content
        else:
            flat = [{"type": "function", **t["function"]} for t in tools]
            items: list[Any] = [{"role": "user", "content": "What is 19 + 23?"}]
            r = await litellm.aresponses(input=items, tools=flat, **where)
            call = next(o for o in r.output if o.type == "function_call")
            items += [call.model_dump(exclude_none=True),
                      {"type": "function_call_output", "call_id": call.call_id, "output": str(add(**json.loads(call.arguments)))}]
            r = await litellm.aresponses(input=items, tools=flat, **where)
            seen["output"] = r.output[0].content[0].text
        await litellm.close_litellm_async_clients()
        return 1.0

    out, engine, _ = await _run(tiny_tokenizer, [CALL, ANSWER], episode)
    assert seen["output"] == "It is 42." and added == [(19, 23)]
    _one_segment(out, engine, 2)

