"""A fake engine at the worker's edge for the chaos run: the sim engine with two injectable apply faults.

`ChaosSimEngine` (registered as ``--engine sim-chaos``) is `SimEngine` (every
result it makes is simulated and labelled so) plus:

- a parameter name its model does not have, `POISON_NAME`, is refused with
  `WeightsRefusedError` as a real engine refuses an unknown name (the chaos run's
  "poison version" carries it; every engine, a restarted one too, refuses it);
- a hung apply on demand: SIGUSR1 to the worker process arms it, and the next
  ``update_weights`` waits ``hang_apply_s`` seconds before it proceeds (0:
  forever), as a wedged device copy would. The arming is process-wide, so
  every engine the process makes (a restarted one too) sees it once.

- a request the request checks let through with sampling a real engine cannot compute (a non-finite
  temperature, a seed outside int64) fails the engine, as it failed the `hf` engine's compute thread
  (``torch.multinomial`` on NaN probabilities, a generator seed overflow): the chaos run's poisoned agents
  find out whether the checks stop them first (then no engine is restarted by a request).

Run a worker with it: ``python -m rollpool.chaos worker --engine sim-chaos
--engine-options hang_apply_s=10,... [worker flags]`` (`rollpool.chaos.__main__`
calls `install()`, then hands its arguments to ``rollpool.cli``).
"""

from __future__ import annotations

import asyncio
import math
import signal
from collections.abc import Mapping
from typing import Any

from rollpool.protocol.errors import WeightsRefusedError
from rollpool.protocol.messages import SamplingParams
from rollpool.workers.engines.base import GenerateOutput
from rollpool.workers.engines.sim import SimEngine

__all__ = ["POISON_NAME", "ChaosSimEngine", "arm_hang", "install"]

POISON_NAME = "chaos.poison.not_a_parameter"

_hangs_armed = 0


def arm_hang(*_: Any) -> None:
    """Make the next weight update of this process hang (the SIGUSR1 handler)."""
    global _hangs_armed
    _hangs_armed += 1


class ChaosSimEngine(SimEngine):
    """`SimEngine` that refuses `POISON_NAME` and hangs one apply when armed (see the module docstring)."""

    def __init__(self, *, hang_apply_s: float = 0.0, **options: Any) -> None:
        super().__init__(**options)
        self.hang_apply_s = float(hang_apply_s)
        self.refused_versions: list[int] = []
        self.hung_applies = 0

    async def generate(self, input_ids: Any, n: int, sampling: SamplingParams, request_id: str, **kw: Any) -> GenerateOutput:
        out = await super().generate(input_ids, n, sampling, request_id, **kw)  # the request checks run first, as everywhere
        seed_overflows = sampling.seed is not None and not -(2**63) <= sampling.seed + n - 1 < 2**63
        if not math.isfinite(sampling.temperature) or seed_overflows:
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0 (as the hf engine's compute "
                               "thread failed on this request's sampling)")
        return out

    async def update_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        global _hangs_armed
        if _hangs_armed > 0:
            _hangs_armed -= 1
            self.hung_applies += 1
            if self.hang_apply_s > 0:
                await asyncio.sleep(self.hang_apply_s)
            else:
                await asyncio.Event().wait()
        if POISON_NAME in named_tensors:
            self.refused_versions.append(version)
            raise WeightsRefusedError(f"version {version} names a parameter this model does not have: {POISON_NAME!r}")
        await super().update_weights(named_tensors, version)


def install() -> None:
    """Register ``sim-chaos`` and make SIGUSR1 arm a hung apply (in a worker process, before it starts)."""
    from rollpool.workers.engines.registry import register_engine

    register_engine("sim-chaos", ChaosSimEngine)
    signal.signal(signal.SIGUSR1, arm_hang)
