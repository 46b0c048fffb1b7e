"""Optional reward functions, given by import path (``package.module:function``).

The function is called as ``fn(metadata, trajectory)`` with the prompt's
metadata map and the finished `Trajectory` (reward not yet set); it may be
sync (run in a thread, so it never blocks the event loop) or async, and
returns a number. A failure of any kind (import error at call time,
exception, timeout, a value that is not a number) becomes data:
`score` returns ``(None, "why")`` and the caller logs it; it never raises.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

from rollpool.protocol.errors import ConfigError
from rollpool.protocol.messages import Trajectory

__all__ = ["RewardFn", "load_reward", "score"]

log = logging.getLogger(__name__)

RewardFn = Callable[[Mapping[str, Any], Trajectory], Any]


def load_reward(spec: str) -> RewardFn:
    """Import ``module:function``; `ConfigError` names what was not found."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"reward must look like package.module:function, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"reward {spec!r}: cannot import {module_name}: {exc}") from exc
    fn: object = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ConfigError(f"reward {spec!r}: {module_name} has no {attr}")
    if not callable(fn):
        raise ConfigError(f"reward {spec!r} is not callable")
    reward: RewardFn = fn
    return reward


async def score(fn: RewardFn, metadata: Mapping[str, Any], trajectory: Trajectory, timeout_s: float) -> tuple[float | None, str | None]:
    """(reward, None) or (None, error message); never raises (except cancellation)."""
    try:
        if inspect.iscoroutinefunction(fn):
            value = await asyncio.wait_for(fn(metadata, trajectory), timeout_s)
        else:
            value = await asyncio.wait_for(asyncio.to_thread(fn, metadata, trajectory), timeout_s)
            if inspect.isawaitable(value):
                value = await asyncio.wait_for(value, timeout_s)
    except asyncio.CancelledError:
        raise
    except TimeoutError:
        return None, f"reward timed out after {timeout_s}s"
    except Exception as exc:  # noqa: BLE001 - a user function's failure is data
        return None, f"reward raised {type(exc).__name__}: {exc}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None, f"reward returned {type(value).__name__}, not a number"
    if not math.isfinite(float(value)):
        return None, f"reward returned {value}"
    return float(value), None
