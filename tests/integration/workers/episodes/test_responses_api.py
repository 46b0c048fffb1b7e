"""The Responses API (``/v1/responses``) and the endpoint's errors, driven by the real `openai` SDK.

The engine is `ScriptedEngine`, a FAKE at the process edge (see test_openai_endpoint.py); the
tokenizer and chat template are the tiny model's real ones.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from rollpool.protocol.messages import Prompt
from rollpool.workers import EpisodeContext
from tests.integration.workers.episodes.test_openai_endpoint import CALL, _client, _prompt, _run, _sampled
from tests.unit.workers.episodes.scripted_engine import ScriptedEngine

openai = pytest.importorskip("openai")
aiohttp = pytest.importorskip("aiohttp")

TOOLS = [{"type": "function", "name": "add", "description": "add two integers", "strict": False,
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}]


async def test_a_responses_tool_round_trip_is_one_segment_with_exact_tokens(tiny_tokenizer: Any) -> None:
    tok = tiny_tokenizer
    seen: dict[str, Any] = {}

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> float:
        async with _client(ctx) as client:
            items: list[Any] = [{"role": "user", "content": "What is 19 + 23?"}]
            r = await client.responses.create(model=ctx.model, instructions="You add numbers.", input=items, tools=TOOLS)
            (call,) = r.output
            assert call.type == "function_call" and call.name == "add" and json.loads(call.arguments) == {"a": 19, "b": 23}
            items += [call.model_dump(exclude_none=True),  # the SDK's item, sent back as the agents libraries do
                      {"type": "function_call_output", "call_id": call.call_id, "output": "42"}]
            r2 = await client.responses.create(model=ctx.model, instructions="You add numbers.", input=items, tools=TOOLS)
            assert r2.output_text == "It is 42."
            items += [o.model_dump(exclude_none=True) for o in r2.output] + [{"role": "user", "content": [{"type": "input_text", "text": "Thanks."}]}]
            r3 = await client.responses.create(model=ctx.model, instructions="You add numbers.", input=items, tools=TOOLS,
                                               max_output_tokens=3)
            seen.update(usage=[r.usage, r2.usage, r3.usage], status=r3.status, reason=r3.incomplete_details)
        return 1.0

    out, engine, runner = await _run(tok, [CALL, "It is 42.<|im_end|>", "You are welcome.<|im_end|>"], agent)
    (t,) = out  # one segment for three turns
    usage = seen["usage"]
    assert sum(u.output_tokens for u in usage) == int(t.loss_mask.sum())
    assert [u.input_tokens for u in usage] == [len(p) for p in engine.prompts]
    assert usage[1].input_tokens_details.cached_tokens == len(engine.prompts[0]) + usage[0].output_tokens
    full = t.input_ids.tolist() + t.output_ids.tolist()
    for p in engine.prompts:  # every turn's prompt holds the earlier sampled ids exactly
        assert full[: len(p)] == p
    first = tok.decode(engine.prompts[0], skip_special_tokens=False)
    assert first.startswith("<|im_start|>system\nYou add numbers.\nTools:\n") and '"name": "add"' in first
    assert seen["status"] == "incomplete" and seen["reason"].reason == "max_output_tokens"
    assert runner.stats.tool_calls == 1 and runner.stats.segments == 1
    assert _sampled(t)[: usage[0].output_tokens] == engine.prompts[1][len(engine.prompts[0]):][: usage[0].output_tokens]


async def test_responses_stream_events_and_previous_response_id(tiny_tokenizer: Any) -> None:
    seen: dict[str, Any] = {}

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> None:
        async with _client(ctx) as client:
            stream = await client.responses.create(model=ctx.model, input="add 19 and 23", tools=TOOLS, stream=True)
            kinds, done = [], None
            async for event in stream:
                kinds.append(event.type)
                if event.type == "response.completed":
                    done = event.response
            assert done is not None
            (call,) = done.output
            seen["kinds"] = kinds
            seen["first_output_tokens"] = done.usage.output_tokens
            # only the new items, chained by id (what openai-agents does with previous_response_id)
            stream = await client.responses.create(
                model=ctx.model, previous_response_id=done.id, tools=TOOLS, stream=True,
                input=[{"type": "function_call_output", "call_id": call.call_id, "output": "42"}])
            text = ""
            async for event in stream:
                if event.type == "response.output_text.delta":
                    text += event.delta
                if event.type == "response.completed":
                    seen["usage"] = event.response.usage
            seen["text"] = text
            with pytest.raises(openai.NotFoundError):
                await client.responses.create(model=ctx.model, previous_response_id="resp_unknown", input="x")

    (t,), engine, _ = await _run(tiny_tokenizer, [CALL, "It is 42.<|im_end|>"], agent)
    assert seen["kinds"] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.function_call_arguments.delta", "response.function_call_arguments.done",
                             "response.output_item.done", "response.completed"]
    assert seen["text"] == "It is 42."
    assert t.segment_index == 0 and len(engine.prompts) == 2  # the chained request extended the segment
    assert seen["usage"].input_tokens_details.cached_tokens == len(engine.prompts[0]) + seen["first_output_tokens"]


async def test_responses_fields_that_are_not_served_get_a_400_naming_them(tiny_tokenizer: Any) -> None:
    errors: dict[str, Any] = {}

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> None:
        async with _client(ctx) as client:
            for name, kwargs in {
                "web_search": {"tools": [{"type": "web_search"}]},
                "background": {"background": True},
                "reasoning": {"reasoning": {"effort": "high"}},
                "image": {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
            }.items():
                kwargs.setdefault("input", "x")
                try:
                    await client.responses.create(model=ctx.model, **kwargs)
                except openai.BadRequestError as exc:
                    errors[name] = exc.body

    await _run(tiny_tokenizer, [], agent)
    assert set(errors) == {"web_search", "background", "reasoning", "image"}
    assert "only function tools" in errors["web_search"]["message"] and errors["background"]["param"] == "background"


async def test_every_unknown_route_answers_in_the_openai_error_shape_naming_the_routes(tiny_tokenizer: Any) -> None:
    seen: dict[str, Any] = {}

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> None:
        async with _client(ctx) as client:
            with pytest.raises(openai.NotFoundError) as info:
                await client.embeddings.create(model=ctx.model, input="x")
            seen["embeddings"] = info.value
            seen["model"] = await client.models.retrieve(ctx.model)
            with pytest.raises(openai.NotFoundError) as info:
                await client.models.retrieve("gpt-4o")
            seen["other_model"] = info.value
        async with aiohttp.ClientSession() as http, http.get(
                ctx.openai_base_url + "/chat/completions", headers={"Authorization": f"Bearer {ctx.api_key}"}) as r:
            seen["method"] = (r.status, await r.json())

    await _run(tiny_tokenizer, [], agent)
    exc = seen["embeddings"]
    assert exc.status_code == 404 and exc.body["type"] == "invalid_request_error"
    assert "/v1/embeddings is not served" in exc.body["message"] and "POST /v1/responses" in exc.body["message"]
    assert seen["model"].id == "scripted"
    assert seen["other_model"].body["code"] == "model_not_found"
    status, body = seen["method"]
    assert status == 405 and "POST /v1/chat/completions" in body["error"]["message"]


async def test_a_plain_chat_agent_still_sees_data_only_stream_lines(tiny_tokenizer: Any) -> None:
    lines: list[str] = []

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> None:
        async with aiohttp.ClientSession() as http, http.post(
                ctx.openai_base_url + "/chat/completions", headers={"Authorization": f"Bearer {ctx.api_key}"},
                json={"messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
            lines.extend(line for line in (await r.text()).splitlines() if line)

    engine = ScriptedEngine(["hey<|im_end|>"], tokenizer=tiny_tokenizer)
    from rollpool.workers.episodes import EpisodeConfig, EpisodeRunner

    async with EpisodeRunner(engine, agent, EpisodeConfig(), tokenizer=tiny_tokenizer) as runner:
        await runner.run_group(_prompt())
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"


class TokenizeResponse(openai.BaseModel):
    """The shape verifiers' token client reads /tokenize's answer into (vLLM's)."""

    count: int
    max_model_len: int
    tokens: list[int]


async def test_prime_rl_token_in_token_out_client_records_one_exact_segment(tiny_tokenizer: Any) -> None:
    """What verifiers' OpenAIChatCompletionsTokenClient sends: return_token_ids, /tokenize (at the base without /v1),
    then /chat/completions/tokens with the prompt it stitched from the ids it was given."""
    tok = tiny_tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    sent: list[list[int]] = []

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> None:
        async with _client(ctx) as client:
            token_client = client.with_options(base_url=ctx.openai_base_url.removesuffix("/v1"))
            messages: list[Any] = [{"role": "user", "content": "Say fine."}]
            r = await client.chat.completions.create(model=ctx.model, messages=messages, logprobs=True,
                                                     extra_body={"return_token_ids": True})
            prev = list(r.prompt_token_ids) + list(r.choices[0].token_ids)
            assert len(r.choices[0].token_ids) == len(r.choices[0].logprobs.content) == r.usage.completion_tokens
            for turn in range(2):
                messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": f"again {turn}"}]

                async def tokenize(**body: Any) -> list[int]:
                    out = await token_client.post("/tokenize", body={"model": ctx.model, **body}, cast_to=TokenizeResponse)
                    assert out.count == len(out.tokens)
                    return list(out.tokens)

                content = await tokenize(prompt="World!")
                dummy = await tokenize(messages=[{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "World!"}],
                                       add_generation_prompt=False)
                suffix = dummy[len(dummy) - dummy[::-1].index(content[-1]):]
                overlap = max((k for k in range(len(suffix) + 1) if k == 0 or prev[-k:] == suffix[:k]), default=0)
                stitched = prev + suffix[overlap:]
                full = await tokenize(messages=messages)
                ids = stitched + full[len(stitched):]
                sent.append(ids)
                r = await client.post("/chat/completions/tokens", cast_to=openai.types.chat.ChatCompletion,
                                      body={"model": ctx.model, "messages": messages, "tokens": ids, "logprobs": True,
                                            "return_token_ids": True, "max_completion_tokens": 8})
                assert r.prompt_token_ids == ids
                prev = ids + list(r.choices[0].token_ids)

    fine = tok.encode("fine", add_special_tokens=False) + [im_end]
    out, engine, runner = await _run(tok, [fine, fine, fine], agent)
    (t,) = out  # one segment: every stitched prompt extended the recorded sequence
    assert engine.prompts[1:] == sent
    full = t.input_ids.tolist() + t.output_ids.tolist()
    for p in engine.prompts:
        assert full[: len(p)] == p
    assert _sampled(t) == fine * 3 and runner.stats.segments == 1
