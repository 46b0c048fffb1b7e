"""The garbage collector of a process that runs rollpool's worker side and nothing else: fewer, cheaper collections.

`freeze_start_up_heap`, for `rollpool worker` once its engines are up and for an agent process (``--agent-processes``)
once it has imported its episode functions: everything alive then (torch, the tokenizer, the engine's client: 197,619
objects on the H200 SGLang worker, frozen in 0.1 s) is collected once and frozen out of the collector, so a later full
collection walks only what was made since; and the young generation is collected every 10,000 net allocations instead
of 700, and a full collection is considered every 4,000,000 instead of 70,000 (`GC_THRESHOLDS`, the broker's). Without the freeze, a full collection of that
heap (118 ms on the H200 worker) came due around the first weight version and held the event loop and every thread
that needs the GIL: version 1 of the shared-memory path took 0.43 s against 0.32 s warm (2026-12-05). Without the
thresholds, the modules an agent imports on its first call (an SDK's client and its models: after the freeze) and
the episodes' state were walked by ten full collections over the three phases of bench/gpu_episodes.py (sim, agents
in the worker), each holding the event loop for up to 0.6 s on the 2-core box (one with the thresholds); with them, the worker's CPU per turn was 0.91x (agents in the
worker) and 0.86x (in 4 agent processes) of before, lower in every rep pair
(bench/results/cpu-episodes-gc-simulated.json, simulated). A turn's
objects die by reference count, not by the collector. Not for a worker embedded in another program (its collector is
its own).
"""

from __future__ import annotations

import gc
import logging
import time

__all__ = ["GC_THRESHOLDS", "freeze_start_up_heap"]

log = logging.getLogger(__name__)

GC_THRESHOLDS = (10_000, 20, 20)
"""`gc.set_threshold` of a worker or agent process (the broker's too): young every 10,000 net allocations."""


def freeze_start_up_heap() -> int:
    """Collect, freeze what is alive, set `GC_THRESHOLDS`; returns the objects frozen (see the module docstring)."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    frozen = gc.get_freeze_count()
    log.info("froze %d start-up objects out of the garbage collector in %.3f s", frozen, time.perf_counter() - t0)
    return frozen
