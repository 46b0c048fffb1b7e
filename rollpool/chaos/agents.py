"""Episode functions for the chaos run (`ChaosConfig.poisoned_agents`): agents that send poisoned requests.

`chaos_agent` plays one turn on the episode's sequence. For a prompt with ``metadata["poison"]`` it first
sends every request of `POISONED` (a NaN or infinite temperature, a seed past int64, a top-k past int32:
values a naive range check lets through) and counts the refusals in ``ctx.metadata["poison_refused"]``
(echoed on the trajectory). A refusal is the promised outcome; anything else escaping the engine (an engine
failure) restarts the worker's engine and re-runs every group on it, which the chaos run counts from the
workers' logs. The engine is the worker's own (sim-chaos: simulated).
"""

from __future__ import annotations

import math
from typing import Any

from rollpool.protocol.errors import RequestRefusedError
from rollpool.protocol.messages import Prompt
from rollpool.workers.episodes.episode import EpisodeContext

__all__ = ["POISONED", "chaos_agent"]

POISONED: tuple[dict[str, Any], ...] = (
    {"temperature": math.nan},
    {"temperature": math.inf},
    {"seed": 2**64},
    {"top_k": 2**40},
)


async def chaos_agent(ctx: EpisodeContext, prompt: Prompt) -> float | None:
    if isinstance(prompt.metadata, dict) and prompt.metadata.get("poison"):
        refused = 0
        for bad in POISONED:
            try:
                await ctx.generate(max_new_tokens=4, **bad)
            except RequestRefusedError:
                refused += 1
        ctx.metadata["poison_refused"] = refused
    await ctx.generate()
    return None
