"""A server's byte counters, read once they settle: the bulk lane counts a chunk on the event loop after the lane
thread sent it, so a subscriber's fetch may return before the server counted its last chunk."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def settled(read: Callable[[], int], want: int, timeout_s: float = 5.0) -> int:
    """`read()` once it equals `want`, else what it is after `timeout_s` (for the test's assertion to show)."""
    deadline = time.monotonic() + timeout_s
    while (got := read()) != want and time.monotonic() < deadline:  # noqa: ASYNC110 - a counter has no event
        await asyncio.sleep(0.01)
    return got
