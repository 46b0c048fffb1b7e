"""The chaos run with agents that send poisoned requests: one bad agent cannot take down a worker.

Broker, relay, two workers running episodes on the `sim-chaos` engine (simulated generation; a request whose
sampling it cannot compute fails it, as it failed the hf engine's compute thread) and Redis are child
processes, under worker kills and pauses. A quarter of the prompts' agents send a NaN and an infinite
temperature, a seed past int64 and a top-k past int32 before their real turn. Each is refused alone: nothing
lost or duplicated, every poisoned group delivered with its refusals counted, and no engine restarted. Before
the shared sampling checks the same run restarted engines 27 times and delivered nothing in 120 s.
"""

from __future__ import annotations

import json
import os

import pytest

from rollpool.chaos.agents import POISONED
from rollpool.chaos.runner import ChaosConfig, run_chaos
from rollpool.monitor.embedded import find_redis_server

pytestmark = [
    pytest.mark.chaos,
    pytest.mark.timeout(180),
    pytest.mark.skipif(find_redis_server() is None, reason="needs a Redis-compatible server binary"),
]


async def test_poisoned_agents_restart_no_engine_and_lose_nothing(tmp_path: os.PathLike[str]) -> None:
    cfg = ChaosConfig(prompts=40, seed=3, workers=2, faults=("kill_worker", "stop_worker"), fault_interval_s=1.0,
                      poisoned_agents=0.25, deadline_s=120, drain_s=20, workdir=str(tmp_path))
    result = await run_chaos(cfg)
    (tmp_path / "chaos.json").write_text(json.dumps(result, indent=1))  # type: ignore[operator]
    assert result["lost"] == 0, result["lost_ids"]
    assert result["duplicated"] == 0
    assert result["engine_restarts"] == 0
    poisoned = result["poisoned_agents"]
    assert poisoned["prompts"] == 10 and poisoned["delivered"] == 10
    assert poisoned["requests_refused"] == len(POISONED) * cfg.group_size * poisoned["delivered"]
