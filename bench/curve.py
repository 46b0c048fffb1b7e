"""Throughput cost of CURVE (encryption + ZAP authentication) on rollpool's two kinds of traffic.

Control: small messages (a 200-byte frame, the size of a heartbeat or credit)
DEALER -> ROUTER; weights: 4 MiB frames (one weight chunk) DEALER -> ROUTER.
Both sockets come from `SocketFactory`, plain or with `SecurityConfig.from_dir`
(keys from `rollpool keys gen`), tcp loopback, one process, two threads.
Runs are interleaved (plain, curve, plain, curve, ...) and the medians are
compared as ratios (curve / plain throughput; 1.0 = free).

    python bench/curve.py [--quick] [--json bench/results/curve.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from typing import Any

import zmq

from rollpool.cli.keys import generate
from rollpool.protocol import SecurityConfig, SocketFactory, SocketOptions


def one_run(security: SecurityConfig | None, frame_bytes: int, count: int) -> float:
    """Seconds to move `count` frames of `frame_bytes` from a DEALER to a ROUTER (after the handshake)."""
    ctx = zmq.Context()
    factory = SocketFactory(ctx, SocketOptions(max_msg_bytes=frame_bytes + 1024, send_hwm=1000, recv_hwm=1000), security)
    server = factory.router("tcp://127.0.0.1:*", serves="broker.worker")
    endpoint = server.getsockopt_string(zmq.LAST_ENDPOINT)
    client = factory.dealer(endpoint, identity=b"bench")
    payload = b"x" * frame_bytes
    try:
        client.send(b"hi")
        server.recv_multipart()  # handshake (and ZAP) done
        elapsed: dict[str, float] = {}

        def receive() -> None:
            for _ in range(count):
                server.recv_multipart(copy=False)
            elapsed["t"] = time.perf_counter()

        t = threading.Thread(target=receive)
        t.start()
        t0 = time.perf_counter()
        for _ in range(count):
            client.send(payload, copy=frame_bytes < 65536)
        t.join()
        return elapsed["t"] - t0
    finally:
        client.close(linger=0)
        server.close(linger=0)
        factory.close()
        ctx.term()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    repeats = args.repeats or (3 if args.quick else 5)
    keys = tempfile.mkdtemp(prefix="rollpool-curve-")
    generate(keys)
    curve = SecurityConfig.from_dir(keys, role="worker")
    cases = {
        "control (200 B msgs)": (200, 20_000 if args.quick else 100_000),
        "weights (4 MiB chunks)": (4 << 20, 32 if args.quick else 128),
    }
    results: dict[str, Any] = {}
    for name, (size, count) in cases.items():
        times: dict[str, list[float]] = {"plain": [], "curve": []}
        for _ in range(repeats):
            times["plain"].append(one_run(None, size, count))
            times["curve"].append(one_run(curve, size, count))
        med = {k: statistics.median(v) for k, v in times.items()}
        rate = {k: count / med[k] for k in med}
        gbps = {k: size * count / med[k] / 1e9 for k in med}
        results[name] = {
            "frame_bytes": size, "count": count, "repeats": repeats,
            "plain_msgs_per_s": round(rate["plain"]), "curve_msgs_per_s": round(rate["curve"]),
            "plain_GB_per_s": round(gbps["plain"], 3), "curve_GB_per_s": round(gbps["curve"], 3),
            "ratio_curve_over_plain": round(rate["curve"] / rate["plain"], 3),
            "seconds": {k: [round(x, 4) for x in v] for k, v in times.items()},
        }
    print(f"{'traffic':26} {'plain':>14} {'curve':>14} {'curve/plain':>12}")
    for name, r in results.items():
        if r["frame_bytes"] < 65536:
            print(f"{name:26} {r['plain_msgs_per_s']:>10} m/s {r['curve_msgs_per_s']:>10} m/s {r['ratio_curve_over_plain']:>12}")
        else:
            print(f"{name:26} {r['plain_GB_per_s']:>9} GB/s {r['curve_GB_per_s']:>9} GB/s {r['ratio_curve_over_plain']:>12}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": "2-core shared development box, tcp loopback, medians of interleaved runs", "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
