"""The CI chaos run: 2,000 prompts through a real pool under seeded random faults.

Broker, relay, four sim workers and Redis are child processes; faults are
SIGKILL and SIGSTOP/SIGCONT of workers, broker kill and restart, relay kill,
Redis stop/start, and link delay/loss windows (message-level proxy). The
trainer's view must show nothing lost, nothing duplicated, and nothing
consumed beyond the staleness bound. ``rollpool chaos --prompts 10000`` is
the long mode (bench/results/chaos_10000.json).
"""

from __future__ import annotations

import json
import os

import pytest

from rollpool.chaos.runner import ChaosConfig, run_chaos
from rollpool.monitor.embedded import find_redis_server

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(400)]

PROMPTS = int(os.environ.get("ROLLPOOL_CHAOS_PROMPTS", "2000"))


@pytest.mark.skipif(find_redis_server() is None, reason="needs a Redis-compatible server binary")
async def test_chaos_run_loses_and_duplicates_nothing(tmp_path: os.PathLike[str]) -> None:
    result = await run_chaos(ChaosConfig(prompts=PROMPTS, seed=7, workdir=str(tmp_path), deadline_s=360))
    (tmp_path / "chaos.json").write_text(json.dumps(result, indent=1))  # type: ignore[operator]
    assert result["prompts_submitted"] == PROMPTS
    assert result["lost"] == 0, result["lost_ids"]
    assert result["duplicated"] == 0
    assert result["staleness_violations"] == 0
    assert sum(result["terminal"].values()) == PROMPTS
    assert result["faults_injected"] >= 5
    kinds = set(result["faults_by_kind"])
    assert kinds & {"kill_worker", "stop_worker"} and "kill_broker" in kinds, kinds
