"""Episode functions the loader tests import by path."""

from __future__ import annotations

from typing import Any


async def solve(ctx: Any, prompt: Any) -> float:
    await ctx.generate()
    return 1.0


def sync_solve(ctx: Any, prompt: Any) -> float:
    ctx.generate_sync()
    return 0.5


not_callable = 3
