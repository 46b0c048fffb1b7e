"""The CI chaos run: 2,000 prompts through a real pool under the message-level faults, checked end to end.

Broker, relay, four sim workers (simulated generation, `sim-chaos` engine) and Redis are child processes;
the faults are every kind of `ISSUE20_FAULTS`: per-message drop, duplicate, delay and reorder and
connection resets on every port in both directions (`FaultyZmtpProxy`, a fake link at the edge), broker
SIGSTOP of 3-5 s, client calls cancelled at random, a publisher restarted on new ports, a poison version
and a hung apply. One run checks both the instrument and the pool:

- every fault kind was injected; the run reports per port, direction and message type what was dropped,
  duplicated, delayed and reordered, and each of the four is above 0;
- the trainer's view: lost 0, duplicated 0, consumed staleness above the bound 0, stuck 0;
- the terminal bound, as behaviour (not a wall-clock assertion on the test): for every prompt open when a
  fault cleared, the time to terminal less its own generation time is within
  ``5 x heartbeat_interval_s + apply_slot_deadline_s`` (``terminal_bound``).

``rollpool chaos --faults issue20 --prompts 10000`` is the long mode (bench/results/chaos-issue20-10k.json).
"""

from __future__ import annotations

import json
import os

import pytest

from rollpool.chaos.runner import ISSUE20_FAULTS, MESSAGE_FAULTS, ChaosConfig, run_chaos
from rollpool.monitor.embedded import find_redis_server

pytestmark = [
    pytest.mark.chaos,
    pytest.mark.slow,
    pytest.mark.timeout(400),
    pytest.mark.skipif(find_redis_server() is None, reason="needs a Redis-compatible server binary"),
]

PROMPTS = int(os.environ.get("ROLLPOOL_CHAOS_PROMPTS", "2000"))


async def test_the_pool_survives_the_issue20_faults_within_the_terminal_bound(tmp_path: os.PathLike[str]) -> None:
    cfg = ChaosConfig(prompts=PROMPTS, seed=12, faults=ISSUE20_FAULTS, fault_interval_s=0.8, deadline_s=300,
                      broker_stop_s=(3.0, 5.0), hung_apply_s=3.0, workdir=str(tmp_path), min_faults=len(ISSUE20_FAULTS))
    result = await run_chaos(cfg)
    (tmp_path / "chaos.json").write_text(json.dumps(result, indent=1))  # type: ignore[operator]

    by_kind = result["faults_by_kind"]
    assert set(ISSUE20_FAULTS) <= set(by_kind), sorted(set(ISSUE20_FAULTS) - set(by_kind))
    stops = [r["pause_s"] for r in result["fault_log"] if r["kind"] == "broker_stop"]
    assert stops and all(3.0 <= s <= 5.0 for s in stops), stops
    totals = result["message_fault_totals"]
    assert all(totals[a] > 0 for a in ("dropped", "duplicated", "delayed", "reordered")), totals
    ports = result["message_faults"]
    assert set(ports) == {"broker:worker", "broker:client", "publisher:router", "publisher:pub", "relay:router", "relay:pub"}
    touched = {name for name, rep in ports.items()
               if any(n for d in rep["by_type"].values() for acts in d.values() for a, n in acts.items() if a != "forwarded")}
    assert {"broker:worker", "broker:client"} <= touched, touched
    assert result["connection_resets"] >= 1 and result["cancelled_calls"] >= 1
    assert {k for k in by_kind if k in MESSAGE_FAULTS} == set(MESSAGE_FAULTS)

    assert result["prompts_submitted"] == PROMPTS and sum(result["terminal"].values()) == PROMPTS
    assert result["lost"] == 0, result["lost_ids"]
    assert result["duplicated"] == 0
    assert result["staleness_violations"] == 0
    bound = result["terminal_bound"]
    faults = [(r["kind"], r.get("started_at_s"), r.get("cleared_at_s")) for r in result["fault_log"]]
    assert result["stuck"] == 0, json.dumps({"worst": bound["worst_cases"], "never": bound["never_terminal"],
                                             "bound_s": bound["bound_s"], "faults": faults})
    assert bound["checked"] > 0 and bound["within_bound"], bound
