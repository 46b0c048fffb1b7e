"""Episodes on the real `hf` engine (the random tiny model), through the real `openai` SDK."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from rollpool.protocol.messages import Prompt, SamplingParams
from rollpool.workers import EpisodeContext
from rollpool.workers.episodes import EpisodeConfig, EpisodeRunner

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")
pytest.importorskip("transformers")


async def test_multi_turn_chat_on_the_tiny_model_is_one_segment_per_episode(tiny_model_dir: pathlib.Path) -> None:
    from rollpool.workers.engines.hf import HFEngine

    engine = HFEngine(model=str(tiny_model_dir), capacity=8, num_threads=1)
    await engine.start()
    usages: dict[int, list[Any]] = {}

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> float:
        usages[ctx.sample_index] = []
        async with openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key, max_retries=0) as client:
            messages: list[Any] = [{"role": "user", "content": prompt.text}]
            for turn in range(3):
                r = await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=6, temperature=1.0,
                                                         seed=ctx.sample_index * 10 + turn, logprobs=True)
                usages[ctx.sample_index].append(r.usage)
                assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
                messages += [r.choices[0].message, {"role": "user", "content": f"turn {turn} done, go on"}]
        return 1.0

    try:
        async with EpisodeRunner(engine, agent, EpisodeConfig(), worker_id="w") as runner:
            out = await runner.run_group(Prompt(prompt_id="g", text="What is 12 plus 30?", group_size=2,
                                                sampling=SamplingParams(max_new_tokens=16)))
    finally:
        await engine.stop()
    assert [t.trajectory_id for t in out] == ["g:0", "g:1"]  # one segment per episode, three turns each
    tok = engine.tokenizer
    for t in out:
        sampled = t.loss_mask == 1
        assert int(sampled.sum()) == sum(u.completion_tokens for u in usages[t.sample_index])
        assert (t.output_logprobs[sampled] < 0).all() and (t.output_logprobs[~sampled] == 0).all()
        assert t.token_versions.tolist() == [0] * len(t.output_ids)
        # what was inserted is the chat template's text for the new turns, not model output
        inserted = tok.decode(t.output_ids[~sampled].tolist(), skip_special_tokens=False)
        assert "<|im_start|>user\nturn 0 done, go on<|im_end|>" in inserted and "<|im_start|>assistant\n" in inserted
    assert runner.stats.turns == 6 and runner.stats.segments == 2
    assert runner.stats.as_dict()["reused_prefix_share"] > 0.5
