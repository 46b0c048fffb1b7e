"""``rollpool chaos --prompts N --json PATH``: run the pool under seeded random faults and check it.

Exit status 0 when nothing was lost, duplicated or stuck (over the terminal
bound) and every consumed trajectory was within the staleness bound; 1
otherwise. See
`rollpool.chaos.runner` for what runs and what is injected.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from rollpool.chaos.runner import CLASSIC_FAULTS, FAULT_KINDS, ISSUE20_FAULTS, ChaosConfig, run_chaos

__all__ = ["HELP", "add_arguments", "run"]

HELP = "run broker, sim workers, relay, publisher and trainer under seeded random faults; report lost/duplicated"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ChaosConfig()
    parser.add_argument("--prompts", type=int, default=d.prompts, help="prompts to push through (CI: 2000; long mode: 10000)")
    parser.add_argument("--seed", type=int, default=d.seed, help=f"seed of the fault schedule and the prompts (default {d.seed})")
    parser.add_argument("--workers", type=int, default=d.workers, help=f"sim worker processes (default {d.workers})")
    parser.add_argument("--group-size", type=int, default=d.group_size, help=f"samples per prompt group (default {d.group_size})")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="B: samples per trainer step (a version per step)")
    parser.add_argument("--max-staleness", type=int, default=d.max_staleness, help="eta: the staleness bound the trainer and broker keep")
    parser.add_argument("--fault-interval-s", type=float, default=d.fault_interval_s, help="mean seconds between faults")
    parser.add_argument("--faults", default=",".join(CLASSIC_FAULTS),
                        help="comma-separated subset of " + ",".join(FAULT_KINDS) + "; 'all' for every kind, 'issue20' for "
                        + ",".join(ISSUE20_FAULTS) + " (default: the classic kinds the pool survives today)")
    parser.add_argument("--broker-stop-s", default=f"{d.broker_stop_s[0]},{d.broker_stop_s[1]}",
                        help="broker_stop: SIGSTOP lasts uniformly LOW,HIGH seconds")
    parser.add_argument("--hung-apply-s", type=float, default=d.hung_apply_s, help="hung_apply: how long the apply hangs")
    parser.add_argument("--apply-slot-deadline-s", type=float, default=d.apply_slot_deadline_s,
                        help="the broker's apply slot deadline (a term of the terminal bound)")
    parser.add_argument("--deadline-s", type=float, default=d.deadline_s, help="give up (and report lost) after this long")
    parser.add_argument("--drain-s", type=float, default=d.drain_s,
                        help="take no new prompts this long before the deadline (a run cut short stays whole: cut_short)")
    parser.add_argument("--poisoned-agents", type=float, default=d.poisoned_agents,
                        help="share of prompts whose agent sends poisoned requests first (the workers then run episodes)")
    parser.add_argument("--workdir", default=None, help="where process logs go (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the result JSON here")


def run(args: argparse.Namespace) -> int:
    aliases = {"all": FAULT_KINDS, "issue20": ISSUE20_FAULTS, "classic": CLASSIC_FAULTS}
    faults = tuple(k for f in args.faults.split(",") if f for k in aliases.get(f, (f,)))
    unknown = set(faults) - set(FAULT_KINDS)
    if unknown:
        print(f"unknown fault kinds: {sorted(unknown)}", file=sys.stderr)
        return 2
    cfg = ChaosConfig(
        prompts=args.prompts, seed=args.seed, workers=args.workers, group_size=args.group_size,
        batch_size=args.batch_size, max_staleness=args.max_staleness, fault_interval_s=args.fault_interval_s,
        faults=faults, deadline_s=args.deadline_s, drain_s=args.drain_s, workdir=args.workdir,
        broker_stop_s=tuple(float(x) for x in args.broker_stop_s.split(",")),  # type: ignore[arg-type]
        hung_apply_s=args.hung_apply_s, apply_slot_deadline_s=args.apply_slot_deadline_s,
        poisoned_agents=args.poisoned_agents,
    )
    result = asyncio.run(run_chaos(cfg))
    text = json.dumps(result, indent=2, sort_keys=True)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    summary = {k: result[k] for k in ("prompts_requested", "prompts_submitted", "cut_short", "lost", "duplicated", "staleness_violations", "dropped_stale", "stuck",
                                      "faults_injected", "elapsed_s", "message_fault_totals", "cancelled_calls", "terminal_s")}
    tb = result["terminal_bound"]
    summary["terminal_bound"] = {k: tb[k] for k in ("bound_s", "checked", "worst_excess_s", "over_bound", "within_bound")}
    print(json.dumps(summary))
    print(json.dumps(result["faults_by_kind"], indent=1))
    ok = result["lost"] == 0 and result["duplicated"] == 0 and result["staleness_violations"] == 0 and result["stuck"] == 0
    return 0 if ok else 1
