"""Version convergence and fleet activation skew, rolling vs fleet side by side (sim workers: SIMULATED).

    python bench/convergence.py --workers 16 --versions 12 --json bench/results/convergence-sim16.json

With a real engine (one worker on the GPU: its versions carry no bytes, so the figures are the pool's own
activation path on a real engine, not a weight transfer): ``--engine sglang --model DIR --workers 1
--engine-options capacity=64,mem_fraction_static=0.5``.

For each activation mode (``rolling``: apply slots, ``--max-applying`` at once; ``fleet``: every worker
stages the version while serving and all switch together), one run: a broker process, one process
hosting ``--workers`` sim workers (simulated tokens, zero-byte weight versions), and a `TrainerClient`
here that keeps plain and exact-version prompt groups flowing while it publishes ``--versions``
versions one after another (waiting for each to reach every worker). Figures, per mode:

* ``convergence_p50_s`` / ``convergence_p95_s``: from publish until every live worker serves the version,
  as the broker recorded it (`status()["versions"]["converged"]`); the slowest worker of each;
* ``fleet_activation_skew_p95_ms`` (fleet): last switch minus first of the workers activated together, in
  broker time (ApplyDone as read; an upper bound of the true skew by the spread of one-way delays);
* the exact-version contract: groups naming version v delivered with a sampled token of another version
  (must be 0), groups failed at once with the reason (their version gone), groups never terminal (stuck,
  must be 0) after a drain.

The top level repeats the fleet run's three headline figures. On the 2-core box the broker, 16 workers and
the client share two cores: the absolute times are of that box, the side-by-side ratio is the claim.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return float(s[max(1, math.ceil(q * len(s))) - 1])  # nearest rank


async def run_mode(mode: str, workers: int, versions: int, groups_per_version: int, log_dir: Path, max_applying: int,
                   decode_s: float, tokens: int, deadline_s: float, change_after_s: float,
                   engine: str = "sim", model: str | None = None, engine_options: str | None = None) -> dict[str, Any]:
    from rollpool.protocol import GroupState, Prompt, SamplingParams
    from rollpool.trainer_client.client import TrainerClient, TrainerClientConfig

    bw, bc = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}"
    py = [sys.executable, "-m", "rollpool.cli", "--log-level", "WARNING"]
    broker = _spawn([*py, "broker", "--worker-endpoint", bw, "--client-endpoint", bc, "--activation", mode,
                     "--max-applying", str(max_applying), "--heartbeat-interval-s", "0.2",
                     "--fleet-stage-deadline-s", str(deadline_s)], log_dir / f"convergence-{mode}-broker.log")
    options = engine_options if engine_options is not None else (
        f"decode_s_per_token={decode_s},length=fixed,length_median={tokens},capacity=8" if engine == "sim" else "capacity=64")
    real = [] if engine == "sim" else ["--model", str(model)]
    common = ["--broker", bw, "--heartbeat-interval-s", "0.2", "--apply-mode", "interrupt", "--drain-timeout-s", "0.5",
              "--engine-options", options]
    if engine == "sim":  # one process hosts them all
        procs = [_spawn([*py, "worker", "--engine", engine, "--count", str(workers), "--worker-id", f"conv-{mode}", *common],
                        log_dir / f"convergence-{mode}-workers.log")]
    else:  # a real engine is one worker per process
        procs = [_spawn([*py, "worker", "--engine", engine, *real, "--worker-id", f"conv-{mode}-{i}", *common],
                        log_dir / f"convergence-{mode}-worker{i}.log") for i in range(workers)]
    all_in = asyncio.Event()
    exact_sent: dict[str, int] = {}
    results: dict[str, Any] = {}
    wrong: list[str] = []
    failed_reasons: dict[str, str] = {}
    converged: dict[int, dict[str, Any]] = {}
    rounds: dict[int, dict[str, Any]] = {}
    t_start = time.monotonic()
    try:
        client = TrainerClient(config=TrainerClientConfig(broker=bc, client_id=f"conv-{mode}", pull_wait_s=0.2))
        await client.connect()
        await client.publish_weights({}, 0)  # hosts the publisher; the sim engines start at version 0
        for _ in range(300):
            st = await client.status()
            if st["counters"].get("workers_alive", 0) >= workers:
                break
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a worker process exited (rc {[p.poll() for p in procs]}): see its log under {log_dir}")
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError(f"only {st['counters'].get('workers_alive')} of {workers} workers joined")
        await asyncio.sleep(1.0)  # a few heartbeats: every worker has the publisher's endpoints
        stop = asyncio.Event()

        def note(g: Any) -> None:
            results[g.prompt_id] = g
            if set(exact_sent) <= results.keys():
                all_in.set()
            v = exact_sent.get(g.prompt_id)
            if v is None:
                return
            if g.state == GroupState.DONE:
                if any(set(t.token_versions.tolist()) != {v} for t in g.trajectories):
                    wrong.append(g.prompt_id)
            else:
                failed_reasons[g.prompt_id] = g.reason

        async def drain() -> None:
            while not stop.is_set():
                for g in await client.take_ended(timeout=0.05):
                    note(g)
                try:  # everything buffered at once: one group per call falls behind a long run
                    batch = await client.get_batch(max(1, client.ledger.ready), timeout=0.1)
                except TimeoutError:
                    continue
                for g in batch.groups + batch.other:
                    note(g)

        drainer = asyncio.create_task(drain())
        sampling = SamplingParams(max_new_tokens=tokens)
        n = 0
        for v in range(1, versions + 1):
            plain = [Prompt(prompt_id=f"{mode}-p{n + i}", input_ids=[1, 2, 3, i], group_size=2, sampling=sampling) for i in range(groups_per_version)]
            exact = [Prompt(prompt_id=f"{mode}-e{v - 1}-{i}", input_ids=[4, 5, i], group_size=2, sampling=sampling,
                            exact_weight_version=v - 1) for i in range(groups_per_version)]
            n += groups_per_version
            res = await client.submit(plain + exact)
            for p in exact:
                if p.prompt_id in res.accepted:
                    exact_sent[p.prompt_id] = v - 1
            await asyncio.sleep(change_after_s)  # the change lands while the last of them are being generated
            await client.publish_weights({}, v)
            await client.wait_for_version(v, timeout=60)
            for _ in range(100):  # the record lands with the last worker's report; read it before it scrolls off
                st = await client.status()
                for r in st["versions"].get("converged", []):
                    converged[r["version"]] = r
                for r in st["versions"].get("fleet_rounds", []):
                    if r["switched"] + r["failed"] >= r["workers"]:
                        rounds[r["version"]] = r
                if v in converged and (mode != "fleet" or v in rounds):
                    break
                await asyncio.sleep(0.05)
        # a last exact batch at the newest version, then drain: every exact group terminal
        last = [Prompt(prompt_id=f"{mode}-e{versions}-{i}", input_ids=[6, i], group_size=2, sampling=sampling,
                       exact_weight_version=versions) for i in range(groups_per_version)]
        res = await client.submit(last)
        for p in last:
            if p.prompt_id in res.accepted:
                exact_sent[p.prompt_id] = versions
        all_in.clear()
        if not set(exact_sent) <= results.keys():
            try:
                await asyncio.wait_for(all_in.wait(), 30)
            except TimeoutError:
                pass  # counted as stuck below
        stop.set()
        await drainer
        counters = (await client.status())["counters"]
        await client.close()
    finally:
        for proc in (*procs, broker):
            proc.terminate()
        for proc in (*procs, broker):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
    secs = [r["converged_s"] for v, r in sorted(converged.items()) if v >= 1]
    skews = [r["skew_ms"] for v, r in sorted(rounds.items()) if v >= 1]
    stuck = sorted(set(exact_sent) - results.keys())
    out: dict[str, Any] = {
        "mode": mode,
        "versions": versions,
        "convergence_p50_s": round(_pct(secs, 0.5), 4),
        "convergence_p95_s": round(_pct(secs, 0.95), 4),
        "convergence_max_s": round(max(secs), 4) if secs else 0.0,
        "convergence_per_version_s": [round(x, 4) for x in secs],
        "slowest_workers": [r["slowest_worker"] for v, r in sorted(converged.items()) if v >= 1],
        "exact_groups": len(exact_sent),
        "exact_delivered": sum(1 for pid in exact_sent if pid in results and results[pid].state == "done"),
        "exact_wrong_version": len(wrong),
        "exact_failed_at_once": len(failed_reasons),
        "exact_failed_reasons": sorted({r.split(":")[0] for r in failed_reasons.values()}),
        "exact_stuck": len(stuck),
        "broker_queued_at_end": counters.get("queued", -1),
        "broker_leased_at_end": counters.get("leased", -1),
        "exact_off_version_handed_back": counters.get("exact_off_version", 0),
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    if mode == "fleet":
        out.update({
            "fleet_activation_skew_p50_ms": round(_pct(skews, 0.5), 3),
            "fleet_activation_skew_p95_ms": round(_pct(skews, 0.95), 3),
            "fleet_activation_skew_max_ms": round(max(skews), 3) if skews else 0.0,
            "fleet_activation_skew_per_version_ms": skews,
            "fleet_holdouts": counters.get("fleet_holdouts", 0),
            "fleet_deadline_activations": counters.get("fleet_deadline_activations", 0),
        })
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--versions", type=int, default=12)
    ap.add_argument("--groups-per-version", type=int, default=16)
    ap.add_argument("--max-applying", type=int, default=1, help="rolling mode's apply slots (the broker's default: 1)")
    ap.add_argument("--decode-s-per-token", type=float, default=0.002)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--fleet-stage-deadline-s", type=float, default=10.0)
    ap.add_argument("--change-after-s", type=float, default=None,
                    help="publish each version this long after submitting the groups (default: one group's generation time)")
    ap.add_argument("--modes", default="rolling,fleet")
    ap.add_argument("--engine", default="sim", help="the workers' engine: sim (SIMULATED), or hf / sglang with --model")
    ap.add_argument("--model", default=None, help="the model directory for a real engine (e.g. a 1p4 model of bench/gpu_weights.py)")
    ap.add_argument("--engine-options", default=None, help="the workers' --engine-options (default: the sim workload, or capacity=64)")
    ap.add_argument("--log-dir", default=os.environ.get("TMPDIR", "/tmp"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.engine != "sim" and not args.model:
        ap.error(f"--engine {args.engine} needs --model")
    sim = args.engine == "sim"
    runs: dict[str, Any] = {}
    for mode in args.modes.split(","):
        runs[mode] = asyncio.run(run_mode(mode, args.workers, args.versions, args.groups_per_version, Path(args.log_dir),
                                          args.max_applying, args.decode_s_per_token, args.tokens, args.fleet_stage_deadline_s,
                                          args.tokens * args.decode_s_per_token if args.change_after_s is None else args.change_after_s,
                                          args.engine, args.model, args.engine_options))
    what = "SIMULATED: sim workers" if sim else f"MEASURED: {args.engine} workers on {args.model}"
    print(f"{what}, {args.workers} of them, {args.versions} versions, apply mode interrupt")
    cols = ("convergence_p50_s", "convergence_p95_s", "convergence_max_s", "fleet_activation_skew_p95_ms", "exact_groups",
            "exact_delivered", "exact_failed_at_once", "exact_wrong_version", "exact_stuck")
    print(f"{'':28}" + "".join(f"{m:>12}" for m in runs))
    for c in cols:
        print(f"{c:28}" + "".join(f"{runs[m].get(c, '-')!s:>12}" for m in runs))
    out: dict[str, Any] = {"simulated": sim, "engine": args.engine, "model": args.model, "workers": args.workers, "versions": args.versions,
                           "groups_per_version": args.groups_per_version, "max_applying": args.max_applying, "runs": runs}
    head = runs.get("fleet") or next(iter(runs.values()))
    for key in ("convergence_p50_s", "convergence_p95_s", "fleet_activation_skew_p95_ms"):
        out[key] = head.get(key, 0.0)
    out["headline_mode"] = head["mode"]
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
