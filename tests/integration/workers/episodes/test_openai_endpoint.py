"""The episode endpoint driven by the real `openai` SDK over loopback HTTP.

The engine is `ScriptedEngine`, a FAKE at the process edge: it answers each turn from a script and
encodes text one character at a time, so its sampled ids are not the tokenizer's canonical encoding
(re-tokenizing would change them). The tokenizer and chat template are the tiny model's real ones.
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import numpy as np
import pytest

from rollpool.protocol.messages import Prompt, SamplingParams
from rollpool.workers import EpisodeContext
from rollpool.workers.episodes import EpisodeConfig, EpisodeRunner
from tests.unit.workers.episodes.scripted_engine import ScriptedEngine

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")

TOOLS = [{"type": "function", "function": {"name": "add", "description": "add two integers",
                                            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
CALL = '<tool_call>{"name":"add","arguments":{"a":19,"b":23}}</tool_call><|im_end|>'  # compact JSON: the template re-formats it


def _prompt(n: int = 1) -> Prompt:
    return Prompt(prompt_id="p", text="unused", group_size=n, sampling=SamplingParams(max_new_tokens=64))


def _client(ctx: EpisodeContext) -> Any:
    return openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key, max_retries=0, timeout=30)


async def _run(tok: Any, script: list[Any], agent: Any, n: int = 1, **cfg: Any) -> tuple[list[Any], ScriptedEngine, EpisodeRunner]:
    engine = ScriptedEngine(script, tokenizer=tok, version=3)
    runner = EpisodeRunner(engine, agent, EpisodeConfig(**cfg), tokenizer=tok, worker_id="w")
    async with runner:
        out = await runner.run_group(_prompt(n))
    return out, engine, runner


def _sampled(t: Any) -> list[int]:
    return [int(x) for x, m in zip(t.output_ids, t.loss_mask, strict=True) if m]


async def test_an_agent_sending_its_history_back_unchanged_gives_one_segment(tiny_tokenizer: Any) -> None:
    tok = tiny_tokenizer
    usages: list[Any] = []

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> float:
        async with _client(ctx) as client:
            messages: list[Any] = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 19 + 23?"}]
            r = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS)
            usages.append(r.usage)
            msg = r.choices[0].message
            assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
            call = msg.tool_calls[0]
            assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 19, "b": 23}
            messages.append(msg)  # the SDK's own message object, content null + tool_calls, sent back unchanged
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "42"})
            r = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS)
            usages.append(r.usage)
            assert r.choices[0].message.content == "It is 42."
            messages.append(r.choices[0].message.model_dump(exclude_none=True))  # as a plain dict, also unchanged
            messages.append({"role": "user", "content": "And 1 + 1?"})
            r = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS, max_tokens=2)
            usages.append(r.usage)
            assert r.choices[0].finish_reason == "length"  # cut: the template's end-of-turn is inserted next turn
            messages.append(r.choices[0].message)
            messages.append({"role": "user", "content": "Thanks."})
            r = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS)
            usages.append(r.usage)
        return 1.0

    out, engine, runner = await _run(tok, [CALL, "It is 42.<|im_end|>", "2 is the answer<|im_end|>", "You are welcome.<|im_end|>"], agent)
    (t,) = out  # ONE segment for four turns
    first_prompt = tok.decode(engine.prompts[0], skip_special_tokens=False)
    assert "Tools:\n" in first_prompt and '"description": "add two integers"' in first_prompt  # tools rendered by the template
    assert t.trajectory_id == "p:0" and t.segment_index == 0 and t.reward == 1.0
    assert sum(int(t.loss_mask.sum()) for t in out) == sum(u.completion_tokens for u in usages)
    assert [u.prompt_tokens for u in usages] == [len(p) for p in engine.prompts]
    # each turn's prompt holds the earlier turns' sampled ids exactly (not a re-tokenization of their text)
    full = t.input_ids.tolist() + t.output_ids.tolist()
    for prompt in engine.prompts:
        assert full[: len(prompt)] == prompt
    first = engine.prompts[1][len(engine.prompts[0]):][: usages[0].completion_tokens]
    assert tok.encode(tok.decode(first), add_special_tokens=False) != first  # the check above could fail
    # the cut turn (2 tokens, no end-of-turn sampled) is followed by the template's end-of-turn, mask 0
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    cut_at = len(engine.prompts[2]) - len(t.input_ids) + 2
    assert t.output_ids[cut_at] == im_end and t.loss_mask[cut_at] == 0 and t.loss_mask[cut_at - 1] == 1
    assert t.token_versions.tolist() == [3] * len(t.output_ids)
    assert np.all(t.output_logprobs[t.loss_mask == 0] == 0.0) and np.all(t.output_logprobs[t.loss_mask == 1] == -0.5)
    assert runner.stats.tool_calls == 1 and runner.stats.segments == 1 and runner.stats.turns == 4
    reused = [len(engine.prompts[i]) + usages[i].completion_tokens for i in range(3)]
    assert [u.prompt_tokens_details.cached_tokens for u in usages] == [0, *reused]
    assert runner.stats.reused_prefix_tokens == sum(reused)


async def test_a_rewritten_history_starts_a_new_segment(tiny_tokenizer: Any) -> None:
    async def agent(ctx: EpisodeContext, prompt: Prompt) -> float:
        async with _client(ctx) as client:
            messages: list[Any] = [{"role": "user", "content": "Say hi."}]
            r = await client.chat.completions.create(model=ctx.model, messages=messages)
            messages.append(r.choices[0].message)
            messages.append({"role": "user", "content": "Again."})
            await client.chat.completions.create(model=ctx.model, messages=messages)
            assert ctx.segment_index == 0
            messages[0] = {"role": "user", "content": "Say hello."}  # the agent edits its history
            r = await client.chat.completions.create(model=ctx.model, messages=messages)
            assert ctx.segment_index == 1
            messages = [messages[0], {"role": "user", "content": "dropped the reply"}]  # and drops a message
            await client.chat.completions.create(model=ctx.model, messages=messages)
        return 0.5

    out, engine, _ = await _run(tiny_tokenizer, ["hi<|im_end|>", "hi again<|im_end|>", "hello<|im_end|>", "ok<|im_end|>"], agent)
    assert [t.trajectory_id for t in out] == ["p:0", "p:0:1", "p:0:2"]
    assert [t.segment_index for t in out] == [0, 1, 2]
    assert all(t.reward == 0.5 for t in out)
    assert out[1].input_ids.tolist() == engine.prompts[2] and out[2].input_ids.tolist() == engine.prompts[3]


async def test_streaming_chat_and_logprobs(tiny_tokenizer: Any) -> None:
    seen: dict[str, Any] = {}

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> None:
        async with _client(ctx) as client:
            stream = await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "hi"}], stream=True,
                                                          stream_options={"include_usage": True})
            text, reasons, usage = "", [], None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    reasons.append(chunk.choices[0].finish_reason)
                if chunk.usage is not None:
                    usage = chunk.usage
            seen.update(text=text, reasons=reasons, usage=usage)
            r = await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                                     temperature=0.7, top_p=0.9, seed=5, stop=["zzz"])
            seen["logprobs"] = r.choices[0].logprobs.content
            seen["completion_tokens"] = r.usage.completion_tokens

    out, engine, _ = await _run(tiny_tokenizer, ["Hello there.<|im_end|>", "ab<|im_end|>"], agent)
    assert seen["text"] == "Hello there." and seen["reasons"][-1] == "stop"
    assert seen["usage"].completion_tokens == len("Hello there.") + 1
    assert len(seen["logprobs"]) == seen["completion_tokens"] == 3
    assert [x.logprob for x in seen["logprobs"]] == [-0.5] * 3 and seen["logprobs"][-1].token == "<|im_end|>"


async def test_streamed_tool_calls(tiny_tokenizer: Any) -> None:
    calls: list[Any] = []

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> None:
        async with _client(ctx) as client:
            stream = await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "add"}], tools=TOOLS, stream=True)
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.tool_calls:
                    calls.extend(chunk.choices[0].delta.tool_calls)

    await _run(tiny_tokenizer, [CALL], agent)
    assert len(calls) == 1 and calls[0].function.name == "add" and json.loads(calls[0].function.arguments) == {"a": 19, "b": 23}


async def test_completions_extend_the_segment_and_stream(tiny_tokenizer: Any) -> None:
    tok = tiny_tokenizer
    seen: dict[str, Any] = {}

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> None:
        async with _client(ctx) as client:
            r = await client.completions.create(model=ctx.model, prompt="1 + 1 =", max_tokens=8, logprobs=1)
            text = "1 + 1 =" + r.choices[0].text
            seen["first"] = r
            stream = await client.completions.create(model=ctx.model, prompt=text + " and 2 + 2 =", max_tokens=8, stream=True,
                                                     stream_options={"include_usage": True})
            streamed, usage = "", None
            async for chunk in stream:
                if chunk.choices:
                    streamed += chunk.choices[0].text
                if chunk.usage is not None:
                    usage = chunk.usage
            seen.update(streamed=streamed, usage=usage)

    out, engine, _ = await _run(tok, [" 2<|eos|>", " 4<|eos|>"], agent)
    (t,) = out
    first = seen["first"]
    assert first.choices[0].text == " 2" and first.choices[0].finish_reason == "stop"
    assert first.choices[0].logprobs.token_logprobs == [-0.5] * 3
    assert seen["streamed"] == " 4" and seen["usage"].completion_tokens == 3
    assert engine.prompts[1][: len(engine.prompts[0]) + 3] == engine.prompts[0] + _sampled(t)[:3]
    assert int(t.loss_mask.sum()) == 6


async def test_a_malformed_request_gets_a_4xx_and_the_episode_goes_on(tiny_tokenizer: Any) -> None:
    errors: dict[str, Any] = {}

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> float:
        async with _client(ctx) as client:
            for name, kwargs in {
                "no_messages": {"messages": []},
                "bad_role": {"messages": [{"role": "wizard", "content": "x"}]},
                "n": {"messages": [{"role": "user", "content": "x"}], "n": 2},
                "temperature": {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
                "top_logprobs": {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 3},
            }.items():
                try:
                    await client.chat.completions.create(model=ctx.model, **kwargs)
                except openai.BadRequestError as exc:
                    errors[name] = exc
            try:
                await client.post("/chat/completions", body=None, cast_to=object, options={"headers": {"Content-Type": "application/json"}})
            except openai.BadRequestError as exc:
                errors["not_json"] = exc
            r = await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "x"}])
        return 1.0 if r.choices[0].message.content == "fine" else 0.0

    (t,), engine, _ = await _run(tiny_tokenizer, ["fine<|im_end|>"], agent)
    assert set(errors) == {"no_messages", "bad_role", "n", "temperature", "top_logprobs", "not_json"}
    assert all(e.status_code == 400 for e in errors.values())
    assert errors["n"].body["param"] == "n" and "n must be 1" in errors["n"].body["message"]
    assert errors["bad_role"].body["type"] == "invalid_request_error"
    assert t.reward == 1.0 and len(engine.prompts) == 1


async def test_a_request_the_engine_refuses_gets_a_400_and_the_episode_goes_on(tiny_tokenizer: Any) -> None:
    # seen with the sglang engine: a prompt id past the model's vocabulary answered 500 (RequestRefusedError is not a ValueError)
    from rollpool.protocol.errors import RequestRefusedError

    refused: list[Any] = []

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> float:
        async with _client(ctx) as client:
            try:
                await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "x"}])
            except openai.BadRequestError as exc:
                refused.append(exc)
            r = await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "x"}])  # the same history: one segment
        return 1.0 if r.choices[0].message.content == "fine" else 0.0

    out, _, _ = await _run(tiny_tokenizer, [RequestRefusedError("prompt token ids must be in [0, 384)"), "fine<|im_end|>"], agent)
    (t,) = out  # one segment: the refused turn left nothing behind, so the retry continued it
    assert t.segment_index == 0 and list(t.loss_mask) == [1] * len(t.output_ids)
    (exc,) = refused
    assert exc.status_code == 400 and "prompt token ids must be in [0, 384)" in exc.body["message"]
    assert exc.body["type"] == "invalid_request_error"
    assert t.reward == 1.0


async def test_a_wrong_key_gets_401_and_records_nothing(tiny_tokenizer: Any) -> None:
    async def agent(ctx: EpisodeContext, prompt: Prompt) -> None:
        async with _client(ctx) as good:
            assert [m.id for m in (await good.models.list()).data] == [ctx.model] == ["scripted"]
        client = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key="rp-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "x"}])
        assert info.value.status_code == 401
        other = openai.AsyncOpenAI(base_url=ctx.openai_base_url.replace("/episodes/", "/episodes/x"), api_key=ctx.api_key, max_retries=0)
        with pytest.raises(openai.NotFoundError):
            await other.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "x"}])
        await client.close()
        await other.close()

    (t,), engine, runner = await _run(tiny_tokenizer, [], agent)
    assert engine.prompts == [] and t.output_ids.tolist() == [] and runner.stats.turns == 0


async def test_a_model_without_a_chat_template_gets_a_400_that_says_so(tiny_tokenizer: Any) -> None:
    bare = copy.deepcopy(tiny_tokenizer)
    bare.chat_template = None

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> None:
        async with _client(ctx) as client:
            with pytest.raises(openai.BadRequestError, match="no chat template"):
                await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "x"}])
            r = await client.completions.create(model=ctx.model, prompt="still works", max_tokens=4)
            assert r.choices[0].text == "ok"

    engine = ScriptedEngine(["ok<|eos|>"], tokenizer=bare)
    async with EpisodeRunner(engine, agent, EpisodeConfig(), tokenizer=bare) as runner:
        (t,) = await runner.run_group(_prompt())
    assert t.finish_reason == "stop" and "episode_error" not in t.metadata


async def test_a_sync_agent_with_the_sync_sdk_runs_in_a_thread(tiny_tokenizer: Any) -> None:
    def agent(ctx: EpisodeContext, prompt: Prompt) -> float:
        client = openai.OpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key, max_retries=0)
        r = client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "x"}])
        client.close()
        return 1.0 if r.choices[0].message.content == "sync" else 0.0

    out, _, _ = await _run(tiny_tokenizer, ["sync<|im_end|>"] * 3, agent, n=3)
    assert [t.reward for t in out] == [1.0, 1.0, 1.0]


async def test_context_exceeded_answers_400_and_ends_the_episode_with_length(tiny_tokenizer: Any) -> None:
    async def agent(ctx: EpisodeContext, prompt: Prompt) -> None:
        async with _client(ctx) as client:
            messages: list[Any] = [{"role": "user", "content": "x"}]
            r = await client.chat.completions.create(model=ctx.model, messages=messages)
            messages += [r.choices[0].message, {"role": "user", "content": "a much longer message " * 8}]
            try:
                await client.chat.completions.create(model=ctx.model, messages=messages)
            except openai.BadRequestError as exc:
                assert exc.body["code"] == "context_length_exceeded"
                raise

    (t,), _, _ = await _run(tiny_tokenizer, ["y<|im_end|>"], agent, max_context_tokens=40)
    assert t.finish_reason == "length" and "BadRequestError" in t.metadata["episode_error"]


async def test_a_request_after_the_episode_ended_gets_410_and_records_nothing(tiny_tokenizer: Any) -> None:
    kept: list[EpisodeContext] = []

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> float:
        kept.append(ctx)
        return 1.0

    engine = ScriptedEngine(["late<|im_end|>"], tokenizer=tiny_tokenizer)
    async with EpisodeRunner(engine, agent, EpisodeConfig(), tokenizer=tiny_tokenizer) as runner:
        (t,) = await runner.run_group(_prompt())
        async with _client(kept[0]) as client:  # e.g. a tool thread that outlived its episode
            with pytest.raises(openai.APIStatusError) as info:
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 410 and engine.prompts == [] and t.output_ids.tolist() == []


async def test_http_layer_failures_get_4xx_in_the_openai_shape_without_a_traceback(tiny_tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Failures before a handler runs: a body over the limit (the SDK does not retry a 413, it would resend a 500),
    JSON nested too deeply, an unknown path, a wrong method. Each is a 4xx with the OpenAI error body; nothing is
    logged as an endpoint failure, nothing is recorded, and the episode goes on."""
    import aiohttp

    answers: dict[str, tuple[int, Any]] = {}
    sdk_413: list[Any] = []

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> float:
        auth = {"Authorization": f"Bearer {ctx.api_key}", "Content-Type": "application/json"}
        url = f"{ctx.openai_base_url}/chat/completions"
        async with aiohttp.ClientSession(headers=auth) as http:
            for name, method, where, data in [
                ("too_large", "POST", url, json.dumps({"messages": [{"role": "user", "content": "x" * 300_000}]})),
                ("too_deep", "POST", url, "[" * 100_000 + "]" * 100_000),
                ("no_route", "POST", f"{ctx.openai_base_url}/embeddings", "{}"),
                ("method", "GET", url, None),
            ]:
                async with http.request(method, where, data=data) as resp:
                    answers[name] = (resp.status, await resp.json())
        async with openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key, max_retries=2, timeout=30) as client:
            try:
                await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "y" * 300_000}])
            except openai.APIStatusError as exc:
                sdk_413.append(exc)
            r = await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "x"}])
        return 1.0 if r.choices[0].message.content == "fine" else 0.0

    (t,), engine, _ = await _run(tiny_tokenizer, ["fine<|im_end|>"], agent, max_request_bytes=256 * 1024)
    assert {k: v[0] for k, v in answers.items()} == {"too_large": 413, "too_deep": 400, "no_route": 404, "method": 405}
    for _status, body in answers.values():
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["type"] == "invalid_request_error"
    assert answers["too_large"][1]["error"]["code"] == "request_too_large" and "262144" in answers["too_large"][1]["error"]["message"]
    assert "nested too deeply" in answers["too_deep"][1]["error"]["message"]
    (exc,) = sdk_413
    assert exc.status_code == 413
    assert not [r for r in caplog.records if r.levelname == "ERROR" or r.exc_info]
    assert t.reward == 1.0 and len(engine.prompts) == 1


class _WatchedTokenizer:
    """The tiny model's tokenizer, recording the longest text it was asked to render or encode (a test double over
    the real one: every call goes through)."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.longest = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def apply_chat_template(self, conversation: Any, **kw: Any) -> Any:
        self.longest = max(self.longest, sum(len(m.get("content") or "") for m in conversation))
        return self._tok.apply_chat_template(conversation, **kw)

    def encode(self, text: str, **kw: Any) -> Any:
        self.longest = max(self.longest, len(text))
        return self._tok.encode(text, **kw)


async def test_a_message_larger_than_the_context_can_hold_is_refused_before_it_is_rendered(tiny_tokenizer: Any) -> None:
    """400 context_length_exceeded, decided from the text's length alone (no token stands for more characters than the
    tokenizer's longest token): a 400,000-character message is never rendered nor tokenized (it stalled every episode of
    the worker on the one tokenizer thread). The body limit that context gives (64 bytes a token, at least 1 MiB)
    lets it in; a completion prompt the same."""
    tok = _WatchedTokenizer(tiny_tokenizer)
    codes: list[Any] = []

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> None:
        async with _client(ctx) as client:
            try:
                await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "x" * 400_000}])
            except openai.BadRequestError as exc:
                codes.append(exc.body["code"])
            try:
                await client.completions.create(model=ctx.model, prompt="y" * 400_000)
            except openai.BadRequestError as exc:
                codes.append(exc.body["code"])

    engine = ScriptedEngine([], tokenizer=tok)
    async with EpisodeRunner(engine, agent, EpisodeConfig(max_context_tokens=2048), tokenizer=tok) as runner:
        assert runner.server.max_request_bytes == 1 << 20
        (t,) = await runner.run_group(_prompt())
    assert codes == ["context_length_exceeded", "context_length_exceeded"]
    assert tok.longest < 1000 and engine.prompts == [] and t.output_ids.tolist() == []


async def _tool_round_trip(tok: Any, resend: Any) -> tuple[list[Any], ScriptedEngine]:
    """Two tool round trips; `resend(message_dict)` is how an agent library sends each assistant message back."""
    async def agent(ctx: EpisodeContext, prompt: Prompt) -> None:
        async with _client(ctx) as client:
            messages: list[Any] = [{"role": "user", "content": "What is 19 + 23, then + 1?"}]
            for _ in range(3):
                r = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS)
                msg = r.choices[0].message
                messages.append(resend(msg.model_dump(exclude_none=True)))
                messages += [{"role": "tool", "tool_call_id": c.id, "content": "42"} for c in msg.tool_calls or []]

    out, engine, _ = await _run(tok, [CALL, CALL, "It is 43.<|im_end|>"], agent)
    return out, engine


async def test_tool_call_arguments_re_serialised_compactly_keep_one_segment(tiny_tokenizer: Any) -> None:
    # pydantic-ai sends a tool call back with its arguments re-serialised ({"a":19} for {"a": 19}); the
    # template renders both alike, so the history is unchanged for the engine
    def pydantic_ai(msg: dict[str, Any]) -> dict[str, Any]:
        for call in msg.get("tool_calls", []):
            call["function"]["arguments"] = json.dumps(json.loads(call["function"]["arguments"]), separators=(",", ":"))
        return msg

    out, engine = await _tool_round_trip(tiny_tokenizer, pydantic_ai)
    assert [t.trajectory_id for t in out] == ["p:0"] and len(engine.prompts) == 3


async def test_an_assistant_name_the_template_does_not_render_keeps_one_segment(tiny_tokenizer: Any) -> None:
    # LangGraph's create_react_agent(name=...) adds `name` to every assistant message it sends back
    out, engine = await _tool_round_trip(tiny_tokenizer, lambda msg: {**msg, "name": "math_agent"})
    assert [t.trajectory_id for t in out] == ["p:0"] and len(engine.prompts) == 3


async def test_changed_tool_call_arguments_still_start_a_new_segment(tiny_tokenizer: Any) -> None:
    def edit(msg: dict[str, Any]) -> dict[str, Any]:
        for call in msg.get("tool_calls", []):
            call["function"]["arguments"] = '{"a": 19, "b": 24}'
        return msg

    out, _ = await _tool_round_trip(tiny_tokenizer, edit)
    assert [t.trajectory_id for t in out] == ["p:0", "p:0:1", "p:0:2"]


async def test_an_sdk_agent_rerun_after_a_worker_death_is_served_its_finished_turns(tiny_tokenizer: Any) -> None:
    """The chat endpoint's turns replay like token-level ones: the agent gets the same replies (tool call parsed)."""
    tok = tiny_tokenizer
    replies: list[list[Any]] = []

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> float:
        got: list[Any] = []
        async with _client(ctx) as client:
            messages: list[Any] = [{"role": "user", "content": "What is 19 + 23?"}]
            for content in ("42", "ok"):
                r = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS)
                msg = r.choices[0].message
                got.append((r.choices[0].finish_reason, msg.content, [c.function.arguments for c in msg.tool_calls or []]))
                messages.append(msg)
                messages.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": content} if msg.tool_calls
                                else {"role": "user", "content": content})
            r = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS)
            got.append((r.choices[0].finish_reason, r.choices[0].message.content, []))
        replies.append(got)
        return 1.0

    script = [CALL, "It is 42.<|im_end|>", "Bye.<|im_end|>"]
    recorded: list[Any] = []
    engine = ScriptedEngine(list(script), tokenizer=tok, version=3)
    async with EpisodeRunner(engine, agent, EpisodeConfig(), tokenizer=tok, worker_id="w") as runner:
        (whole,) = await runner.run_group(_prompt(), on_turn=recorded.append)
    again = ScriptedEngine(script[2:], tokenizer=tok, version=4)
    async with EpisodeRunner(again, agent, EpisodeConfig(), tokenizer=tok, worker_id="w") as runner:
        (t,) = await runner.run_group(_prompt(), attempt=1, replay=recorded[:2])
    assert replies[0] == replies[1] and replies[0][0][0] == "tool_calls"
    assert again.prompts == engine.prompts[2:] and runner.stats.turns_replayed == 2
    assert t.output_ids.tolist() == whole.output_ids.tolist() and t.loss_mask.tolist() == whole.loss_mask.tolist()


async def test_episode_clients_share_one_http_client_and_closing_one_leaves_the_others_working(tiny_tokenizer: Any) -> None:
    """``ctx.openai_client()``: each episode's requests record into that episode, over one HTTP client per event loop
    (one TLS context and connection pool per process, not one per episode); an episode that closes its client (as
    ``async with`` does) does not close it for the episodes still running; the runner's close does."""
    from rollpool.workers.episodes import sdk

    http_clients: list[Any] = []
    first_closed = asyncio.Event()

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> float:
        async with ctx.openai_client(max_retries=0, timeout=30) as client:
            http_clients.append(client._client)
            if ctx.sample_index != 0:
                await first_closed.wait()  # the others ask only after episode 0 closed its client
            r = await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": f"hi {ctx.sample_index}"}])
            assert r.choices[0].message.content == "ok"
        if ctx.sample_index == 0:
            first_closed.set()
        return float(ctx.sample_index)

    out, engine, runner = await _run(tiny_tokenizer, ["ok<|im_end|>"] * 4, agent, n=4)
    assert sorted(t.reward for t in out) == [0.0, 1.0, 2.0, 3.0] and runner.stats.turns == 4
    for t in out:  # each episode's one turn is in its own trajectory, with its own user message
        assert f"hi {int(t.reward)}" in tiny_tokenizer.decode(t.input_ids.tolist())
    assert len(http_clients) == 4 and all(c is http_clients[0] for c in http_clients)
    # the runner's close closed it (its kept-alive connections with it); the next episode makes a new one
    assert http_clients[0].is_closed and asyncio.get_running_loop() not in sdk._CLIENTS
    with pytest.raises(TypeError, match="no http_client"):
        sdk.episode_client("http://127.0.0.1/v1", "k", http_client=http_clients[0])


async def test_turns_tokenized_on_the_large_lane_record_the_same_tokens(tiny_tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request past `TokenizerLane.LARGE_CHARS` is rendered and tokenized on a thread of its own with a copy of the
    runner's tokenizer (so one agent's huge message does not hold the other episodes' turns): every turn sent there
    (the bound lowered to 64 characters) gives the trajectory the shared lane gives."""
    from rollpool.workers.episodes.episode import TokenizerLane

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> float:
        async with _client(ctx) as client:
            messages: list[Any] = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 19 + 23?"}]
            r = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS)
            messages.append(r.choices[0].message)
            messages.append({"role": "tool", "tool_call_id": r.choices[0].message.tool_calls[0].id, "content": "42"})
            await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS)
        return 1.0

    script = [CALL, "It is 42.<|im_end|>"]
    (shared,), _, _ = await _run(tiny_tokenizer, list(script), agent)
    large_calls: list[int] = []
    shutdown = TokenizerLane.shutdown

    def counted(lane: TokenizerLane) -> None:
        large_calls.append(lane.large_calls)
        shutdown(lane)

    monkeypatch.setattr(TokenizerLane, "LARGE_CHARS", 64)
    monkeypatch.setattr(TokenizerLane, "shutdown", counted)
    (large,), _, runner = await _run(tiny_tokenizer, list(script), agent)
    assert large_calls and large_calls[0] >= 2  # both turns' renderings went to the large lane
    assert large.output_ids.tolist() == shared.output_ids.tolist() and large.input_ids.tolist() == shared.input_ids.tolist()
    assert large.loss_mask.tolist() == shared.loss_mask.tolist() and runner.stats.segments == 1
