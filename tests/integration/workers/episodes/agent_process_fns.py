"""Episode functions imported by path (``--episode``) by the agent-process tests: in the worker and in its agent processes."""

from __future__ import annotations

import asyncio
import gc
import os
import pathlib
import sys
from typing import Any

if os.environ.get("RP_TEST_FAIL_IN_AGENT_PROCESS") and getattr(sys.modules["__main__"].__spec__, "name", "") == (
        "rollpool.workers.episodes.__main__"):
    raise ImportError("this module refuses to load in an agent process (the test's bad environment)")


async def sdk_agent(ctx: Any, prompt: Any) -> float:
    """An unmodified `openai` SDK agent: two chat turns, a user message between them, seeded per sample and turn."""
    import openai

    ctx.metadata["pid"] = os.getpid()
    # one prompt through the context's client (over the process's one HTTP client), the other through a client of its own
    own = "1 plus" not in prompt.text
    client = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key, max_retries=0) if own else ctx.openai_client(max_retries=0)
    async with client as sdk:
        messages: list[Any] = [{"role": "user", "content": prompt.text}]
        for turn in range(2):
            r = await sdk.chat.completions.create(model=ctx.model, messages=messages, max_tokens=4, seed=ctx.sample_index * 10 + turn)
            messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"go on {turn}"}]
    return 1.0 + ctx.sample_index


async def token_agent(ctx: Any, prompt: Any) -> float:
    """Token level: a turn, tokens inserted, a turn on given ids that extend the sequence, then one that rewrites it."""
    ctx.metadata["pid"] = os.getpid()
    first = await ctx.generate(seed=100 + ctx.sample_index)
    ctx.append([5, 6, 7])
    await ctx.generate(seed=200 + ctx.sample_index, max_new_tokens=3)
    await ctx.generate([1, 2, 3], seed=300 + ctx.sample_index)  # not a prefix of the sequence: a second segment
    ctx.metadata["segment"] = ctx.segment_index
    return float(len(first.output_ids))


def sync_agent(ctx: Any, prompt: Any) -> float:
    """A synchronous episode function (a thread): `generate_sync` and `append` from the thread."""
    out = ctx.generate_sync(seed=400 + ctx.sample_index)
    ctx.append([8, 9])
    ctx.generate_sync(seed=500 + ctx.sample_index)
    return float(out.output_ids[0] % 7)


async def failing_agent(ctx: Any, prompt: Any) -> float:
    await ctx.generate(seed=1)
    raise ValueError(f"the tool broke on sample {ctx.sample_index}")


async def held_agent(ctx: Any, prompt: Any) -> float:
    """One turn, then its pid in ``metadata["pid_dir"]``; sample 0 of a prompt with ``hold`` then waits (to be killed)."""
    await ctx.generate(seed=ctx.sample_index)
    ctx.metadata["pid"] = os.getpid()
    ctx.metadata["gc"] = [*gc.get_threshold(), gc.get_freeze_count()]
    pathlib.Path(prompt.metadata["pid_dir"], f"{prompt.prompt_id}-{ctx.sample_index}-{os.getpid()}").touch()  # noqa: ASYNC240 - one tiny file
    if prompt.metadata.get("hold") and ctx.sample_index == 0:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pathlib.Path(prompt.metadata["pid_dir"], f"cancelled-{prompt.prompt_id}-{os.getpid()}").touch()  # noqa: ASYNC240 - one tiny file
            raise
    return 1.0
