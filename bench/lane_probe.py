"""The bulk lane beside a busy trainer: one subscriber fetches a version over tcp while the publisher's process runs
Python in other threads, as a trainer does (its loop, a data loader, logging).

The publisher, its loop and the lane's connection threads share the trainer's interpreter lock. A thread that gives
the lock up (a socket call, a trip to the loop) waits for it again behind whatever Python runs beside, up to the
switch interval (5 ms) each time, so what the lane costs a chunk in lock hand-offs sets its speed there. Rows, each a
median of ``--reps`` fetches of the same version (the subscriber, a process of its own, recycles its buffers):

- ``idle``: nothing else runs in the publisher's process (the limit);
- ``busy``: ``--busy`` threads run pure Python beside it (the worst case of a trainer's other threads); with
  ``--side subscriber`` in the subscriber's process instead (a worker whose engine's Python runs while it fetches);
- ``idle2`` / ``busy2``: the same again, interleaved, so drift shows.

``busy_over_idle`` = busy GB/s over idle GB/s. With ``ROLLPOOL_WEIGHT_BULK=0`` the chunks come over the ROUTER (ZeroMQ,
served on the publisher's loop) instead. Run it on two checkouts (``--label``) to compare a change; the lane's
own counters (chunks looked up on the loop, chunks served, chunks sent by the compiled loop) come with it where the
checkout has them; ``ROLLPOOL_LANE_NATIVE=0`` turns the compiled send loop off (`rollpool.weights.paths.lane_native`).

    python bench/lane_probe.py [--mib 512] [--reps 5] [--busy 1] [--chunk-mib 8] [--label now] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.weights import VERSION, _MiB, make_tensors


def _subscriber(conn: Any, router: str, window: int) -> None:
    """The subscriber's process (a worker): fetch the version on each "go", with `n` busy threads beside on ("go", n)."""
    from bench.weights import Fetcher

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with Fetcher(router, window, "tcp") as f:
            conn.send("ready")
            while (msg := await loop.run_in_executor(None, conn.recv)) != "stop":
                stop = threading.Event()
                threads = [threading.Thread(target=busy, args=(stop,), daemon=True) for _ in range(msg[1])]
                for t in threads:
                    t.start()
                _dt, total = await f.once()
                stop.set()
                for t in threads:
                    t.join()
                conn.send((time.perf_counter(), total))

    asyncio.run(main())


def busy(stop: threading.Event) -> None:
    """Pure Python until told to stop: holds the interpreter lock but at the switch interval."""
    x = 0
    while not stop.is_set():
        for i in range(2000):
            x += i


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import zmq.asyncio

    from rollpool.protocol.sockets import SocketFactory
    from rollpool.weights.publisher import WeightPublisher

    ctx = zmq.asyncio.Context()
    pub = WeightPublisher(SocketFactory(ctx), chunk_bytes=args.chunk_mib * _MiB, bucket_bytes=args.bucket_mib * _MiB,
                          keep_versions=1, router_endpoint="tcp://127.0.0.1:*", pub_endpoint="tcp://127.0.0.1:*")
    await pub.start()
    tensors = make_tensors(args.mib)
    for v in range(1, VERSION + 1):
        await pub.publish(tensors, v)
    loop = asyncio.get_running_loop()
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=_subscriber, args=(child, pub.router_endpoint, args.window))
    proc.start()
    await loop.run_in_executor(None, parent.recv)
    lane = pub._server.bulk
    rows: dict[str, Any] = {}
    total = 0
    sub_side = args.side == "subscriber"
    for label, n in (("warmup", 0), ("idle", 0), ("busy", args.busy), ("idle2", 0), ("busy2", args.busy)):
        stop = threading.Event()
        threads = [threading.Thread(target=busy, args=(stop,), daemon=True) for _ in range(0 if sub_side else n)]
        for t in threads:
            t.start()
        times = []
        lookups0, chunks0 = getattr(lane, "loop_lookups", None), (lane.chunks_served if lane is not None else None)
        native0 = getattr(lane, "native_chunks", None)
        for _ in range(1 if label == "warmup" else args.reps):
            t0 = time.perf_counter()
            parent.send(("go", n if sub_side else 0))
            _t, total = await loop.run_in_executor(None, parent.recv)
            times.append(time.perf_counter() - t0)
        stop.set()
        for t in threads:
            t.join()
        if label == "warmup":
            continue
        med = statistics.median(times)
        rows[label] = {"busy_threads": n, "fetch_s": [round(x, 4) for x in times], "median_s": round(med, 4),
                       "gbps": round(total / med / 1e9, 3), "lane": lane is not None,
                       "chunks_served": None if chunks0 is None else lane.chunks_served - chunks0,
                       "loop_lookups": None if lookups0 is None else lane.loop_lookups - lookups0,
                       "native_chunks": None if native0 is None else lane.native_chunks - native0}
        print(label, rows[label], flush=True)
    parent.send("stop")
    proc.join(10)
    await pub.close()
    ctx.destroy(linger=0)
    idle = statistics.median([rows["idle"]["gbps"], rows["idle2"]["gbps"]])
    busy_gbps = statistics.median([rows["busy"]["gbps"], rows["busy2"]["gbps"]])
    return {"label": args.label, "machine": f"{platform.node()} ({mp.cpu_count()} cores)", "version_bytes": total,
            "params": vars(args), "rows": rows, "idle_gbps": idle, "busy_gbps": busy_gbps,
            "busy_over_idle": round(busy_gbps / idle, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--bucket-mib", type=int, default=128)
    ap.add_argument("--chunk-mib", type=int, default=8)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--busy", type=int, default=1, help="pure-Python threads beside the publisher in the busy rows")
    ap.add_argument("--side", choices=("publisher", "subscriber"), default="publisher",
                    help="whose process the busy threads run in (the subscriber's: a worker generating while it fetches)")
    ap.add_argument("--label", default="now")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = asyncio.run(run(args))
    print(json.dumps({k: out[k] for k in ("label", "idle_gbps", "busy_gbps", "busy_over_idle")}))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
