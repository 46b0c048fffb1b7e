"""Monitoring sink benchmark: what one reporting call costs the caller, Redis up vs Redis down.

Three sides report the same stream of calls (per round: a worker state, an
event, a staleness observation): `NullMetricsSink` (the floor), a
`RedisMetricsSink` on a live embedded server, and a `RedisMetricsSink` whose
server has been stopped. Reported per side: median and p99 of the time one
round takes in the caller, and the slowest round. The writer thread's own work
is not on the caller's path; its batches and drops are reported too.

    python bench/monitor_sink.py [--rounds 20000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from typing import Any

from rollpool.monitor.embedded import EmbeddedRedis
from rollpool.monitor.sink import RedisMetricsSink
from rollpool.protocol.metrics import MetricsSink, NullMetricsSink


def run_side(sink: MetricsSink, rounds: int) -> dict[str, float]:
    times: list[float] = []
    fields: dict[str, Any] = {"host": "h", "engine": "sim", "state": "generating", "inflight": 8, "tokens_per_s": 800.0}
    for i in range(rounds):
        t0 = time.perf_counter()
        fields["tokens_total"] = i
        sink.publish_state("worker", "w1", fields, ttl_s=3.0)
        sink.event("task_requeued", {"task_id": f"p{i}@1"})
        sink.observe("staleness", i % 4)
        times.append(time.perf_counter() - t0)
    times.sort()
    return {
        "median_us": statistics.median(times) * 1e6,
        "p99_us": times[int(len(times) * 0.99)] * 1e6,
        "max_us": times[-1] * 1e6,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20_000)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    results["null"] = run_side(NullMetricsSink(), args.rounds)
    with EmbeddedRedis() as server:
        sink = RedisMetricsSink(server.url, "bench-up")
        results["redis_up"] = run_side(sink, args.rounds)
        sink.flush(10)
        results["redis_up"].update({k: v for k, v in sink.stats().items() if k in ("flushes", "dropped")})
        sink.close()
        down = RedisMetricsSink(server.url, "bench-down", socket_timeout_s=0.5)
        server.stop()
        results["redis_down"] = run_side(down, args.rounds)
        results["redis_down"].update({k: v for k, v in down.stats().items() if k in ("failed_flushes", "dropped")})
        down.close()
    print(f"{'side':<12} {'median us':>10} {'p99 us':>10} {'max us':>10}  writer")
    for side, r in results.items():
        extra = ", ".join(f"{k} {r[k]}" for k in ("flushes", "failed_flushes", "dropped") if k in r)
        print(f"{side:<12} {r['median_us']:>10.2f} {r['p99_us']:>10.2f} {r['max_us']:>10.1f}  {extra}")
    if args.json:
        meta = {"python": sys.version.split()[0], "machine": platform.machine(), "rounds": args.rounds}
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "results": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
