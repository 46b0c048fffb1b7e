"""Forced tool calls and structured output through the episode endpoint on real SGLang (marked gpu + sglang).

The worker's path: an `SGLangEngine` that launches SGLang as its child (grammar backend xgrammar) on a tiny random
Llama, an `EpisodeRunner` over it, and an agent on the real ``openai`` SDK. A random model follows no format, so
every parse below holds only because SGLang's grammar backend held the tokens to the grammar the engine sent.

The device kit has no xgrammar: add it first (tests/gpu/xgrammar_kit.sh), else this skips, saying so. With
``ROLLPOOL_SGLANG_LOG_DIR`` the SGLang child's log is written there. The tests are
plain functions around ``asyncio.run`` (the device has no pytest-asyncio); ``python3 tests/gpu/test_sglang_constrained_gpu.py``
runs them without pytest too. What runs on a CPU against the sim child is in tests/unit/workers/test_sglang_constrained.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import pathlib
import sys
import tempfile
import time
from typing import Any

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.sglang, pytest.mark.timeout(900)]

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"], "additionalProperties": False}
ZONE = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "time", "parameters": ZONE}}]


def _valid_city(value: Any) -> bool:
    """`value` validates against CITY (the schema is small enough to check by hand: no jsonschema on the device)."""
    return (isinstance(value, dict) and set(value) == {"city", "sunny"} and value["city"] in ("Paris", "Rome", "Oslo")
            and isinstance(value["sunny"], bool))


def _valid_zone(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"zone"} and value["zone"] in ("UTC", "CET")


def gpu_engine(model: pathlib.Path, log_dir: pathlib.Path) -> Any:
    """The worker's engine: SGLang launched as its child, on the GPU, with xgrammar as its grammar backend."""
    from rollpool.workers.engines.sglang.engine import SGLangEngine

    log_dir = pathlib.Path(os.environ.get("ROLLPOOL_SGLANG_LOG_DIR") or log_dir)  # $OUT on the device: the child's log comes back
    return SGLangEngine(model=str(model), capacity=8, mem_fraction_static=0.15, cuda_graph_max_bs=16, log_dir=str(log_dir),
                        grammar_backend="xgrammar")


async def run_agent(engine: Any) -> dict[str, Any]:
    """Three constrained turns of one episode on `engine` (not started): what the agent and the trainer saw."""
    import openai

    from rollpool.protocol.messages import Prompt, SamplingParams
    from rollpool.workers.engines.tokenizer import load_tokenizer
    from rollpool.workers.episodes import EpisodeConfig, EpisodeRunner

    seen: dict[str, Any] = {}

    async def agent(ctx: Any, prompt: Prompt) -> None:
        async with openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key, max_retries=0, timeout=120) as client:
            messages: list[Any] = [{"role": "user", "content": "weather in Paris?"}]
            r = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS, tool_choice="required",
                                                     seed=1, max_tokens=120)
            seen["required"] = r.choices[0]
            messages.append(r.choices[0].message)
            messages += [{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in r.choices[0].message.tool_calls or []]
            r = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS, seed=2, max_tokens=120,
                                                     tool_choice={"type": "function", "function": {"name": "time"}})
            seen["named"] = r.choices[0]
            messages.append(r.choices[0].message)
            messages += [{"role": "tool", "tool_call_id": c.id, "content": "noon"} for c in r.choices[0].message.tool_calls or []]
            r = await client.chat.completions.create(
                model=ctx.model, messages=messages, tools=TOOLS, seed=3, logprobs=True, max_tokens=120,  # same tools: same segment
                response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": CITY, "strict": True}})
            seen["schema"] = r.choices[0]

    t0 = time.monotonic()
    await engine.start()
    seen["start_s"] = time.monotonic() - t0
    seen["grammar_backend"] = engine.info().extra["grammar_backend"]
    try:
        # the worker's tokenizer for an engine without a public one: the model directory's
        tokenizer = await asyncio.to_thread(load_tokenizer, engine.model_path)
        async with EpisodeRunner(engine, agent, EpisodeConfig(), tokenizer=tokenizer, worker_id="gpu") as runner:
            seen["trajectories"] = await runner.run_group(Prompt(prompt_id="c", text="weather?", group_size=1,
                                                                 sampling=SamplingParams(max_new_tokens=120)))
        seen["stats"] = dict(engine.stats)
    finally:
        await engine.stop()
    return seen


def check(seen: dict[str, Any]) -> None:
    assert seen["grammar_backend"] == "xgrammar"
    required = seen["required"]
    assert required.finish_reason == "tool_calls" and len(required.message.tool_calls) == 1, required
    call = required.message.tool_calls[0].function
    args = json.loads(call.arguments)
    assert (call.name == "weather" and _valid_city(args)) or (call.name == "time" and _valid_zone(args)), call
    named = seen["named"]
    assert named.finish_reason == "tool_calls" and len(named.message.tool_calls) == 1, named
    assert named.message.tool_calls[0].function.name == "time" and _valid_zone(json.loads(named.message.tool_calls[0].function.arguments))
    schema = seen["schema"]
    assert _valid_city(json.loads(schema.message.content)), schema.message.content
    assert schema.logprobs.content and all(x.logprob <= 1e-6 for x in schema.logprobs.content)
    # the trajectory marks the tokens sampled under a grammar: here every sampled token, in one segment per turn
    (t,) = seen["trajectories"]
    spans = [tuple(s) for s in t.metadata["constrained_tokens"]]
    assert len(spans) == 3 and sum(e - s for s, e in spans) == int(t.loss_mask.sum()), (spans, int(t.loss_mask.sum()))
    for s, e in spans:
        assert t.loss_mask[s:e].tolist() == [1] * (e - s)
    assert seen["stats"]["restarts"] == 0


def _model(where: pathlib.Path) -> pathlib.Path:
    from rollpool.workers.engines.tiny_model import build_tiny_model

    env = os.environ.get("ROLLPOOL_SGLANG_TEST_MODEL")
    return pathlib.Path(env) if env else build_tiny_model(where / "model", vocab=1024, hidden=256, layers=2, heads=4, kv_heads=2)


def test_forced_tools_and_a_json_schema_hold_on_real_sglang(tmp_path: pathlib.Path) -> None:
    if importlib.util.find_spec("xgrammar") is None:
        pytest.skip("xgrammar is not importable: the device kit has none; add it with tests/gpu/xgrammar_kit.sh (see its header)")
    pytest.importorskip("openai")
    seen = asyncio.run(run_agent(gpu_engine(_model(tmp_path), tmp_path / "log")))
    check(seen)
    print(f"sglang constrained: start {seen['start_s']:.1f} s, stats {seen['stats']}, "
          f"spans {seen['trajectories'][0].metadata['constrained_tokens']}")


if __name__ == "__main__":  # without pytest: python3 tests/gpu/test_sglang_constrained_gpu.py
    sys.path.insert(0, str(pathlib.Path(__file__).parents[2]))
    with tempfile.TemporaryDirectory() as tmp:
        out = asyncio.run(run_agent(gpu_engine(_model(pathlib.Path(tmp)), pathlib.Path(tmp) / "log")))
        check(out)
        print("PASS", json.dumps({"start_s": round(out["start_s"], 1), "stats": out["stats"],
                                  "constrained_tokens": out["trajectories"][0].metadata["constrained_tokens"]}))
