"""Soak: many prompts through a broker and sim workers; the broker's memory at start, along the way and at the end.

    python bench/soak.py --prompts 1000000 --json bench/results/soak.json   # the long mode, run by hand

A broker process (``rollpool broker``), one process hosting ``--workers`` sim
workers (zero-latency-ish decode), and a `TrainerClient` here that keeps a
window of prompts in flight, pulls and acknowledges. Samples the broker's
resident memory (VmRSS, /proc) and its status counters every ``--every``
prompts. Flat memory and flat per-peer state (workers, held, queued) are the
pass criteria; the dedup window of forgotten ids grows until ``dedup_window``
(default 1,000,000) and is then bounded, so the broker is started with
``--dedup-window`` small enough for the run to reach the bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return -1.0


async def soak(prompts: int, workers: int, window: int, every: int, dedup_window: int) -> dict[str, Any]:
    from rollpool.trainer_client.client import TrainerClient, TrainerClientConfig

    bw, bc = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}"
    py = [sys.executable, "-m", "rollpool.cli", "--log-level", "WARNING"]
    broker = subprocess.Popen([*py, "broker", "--worker-endpoint", bw, "--client-endpoint", bc, "--dedup-window", str(dedup_window)])  # noqa: ASYNC220 (start-up only)
    pool = subprocess.Popen([*py, "worker", "--engine", "sim", "--broker", bw, "--count", str(workers), "--worker-id", "soak",  # noqa: ASYNC220
                             "--engine-options", "decode_s_per_token=0.0001,length_median=4"])
    samples: list[dict[str, Any]] = []
    t0 = time.monotonic()
    try:
        client = TrainerClient(config=TrainerClientConfig(broker=bc, client_id="soak", pull_wait_s=0.5))
        await client.connect()
        submitted = done = 0
        next_sample = 0
        while done < prompts:
            if submitted < prompts and submitted - done < window:
                n = min(window - (submitted - done), prompts - submitted, 512)
                await client.submit([[1, 2, 3, submitted + i] for i in range(n)], group_size=1, sampling={"max_new_tokens": 8})
                submitted += n
            batch = await client.get_batch(min(256, submitted - done))
            done += len(batch.groups) + len(batch.other)
            if done >= next_sample or done >= prompts:
                st = await client.status()
                c = st["counters"]
                samples.append({"prompts_done": done, "elapsed_s": round(time.monotonic() - t0, 1), "broker_rss_mib": round(_rss_mib(broker.pid), 1),
                                **{k: c.get(k) for k in ("queued", "leased", "held", "workers_alive", "duplicates", "acked")},
                                "workers_listed": len(st["workers"])})
                print(samples[-1], flush=True)
                next_sample += every
        await client.close()
    finally:
        for p in (pool, broker):
            p.terminate()
            p.wait(10)
    first, last = samples[0], samples[-1]
    return {"prompts": prompts, "workers": workers, "window": window, "dedup_window": dedup_window,
            "elapsed_s": round(time.monotonic() - t0, 1), "prompts_per_s": round(prompts / (time.monotonic() - t0)),
            "broker_rss_mib_start": first["broker_rss_mib"], "broker_rss_mib_end": last["broker_rss_mib"],
            "broker_rss_mib_max": max(s["broker_rss_mib"] for s in samples), "samples": samples}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--every", type=int, default=None, help="sample every this many prompts (default prompts/20)")
    ap.add_argument("--dedup-window", type=int, default=100_000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.setdefault("PYTHONPATH", os.getcwd())
    result = asyncio.run(soak(args.prompts, args.workers, args.window, args.every or max(1, args.prompts // 20), args.dedup_window))
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
