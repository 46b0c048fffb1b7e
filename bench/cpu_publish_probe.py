"""Probe: what publishing a trainer's CPU tensors costs it, by how the snapshot copies and checksums them.

    python3 bench/cpu_publish_probe.py --gib 13.5 --out DIR

A real `WeightPublisher` (network path, page-locked buckets where CUDA is there, nobody fetching) publishes the 8B
layout's CPU tensors (bench/host_copy_probe.py's) version after version. Per way, the first version is a warm-up, the
next --versions are timed:
    blocked_s   the publish call (what the trainer waits for: the copies into the snapshot)
    ready_s     publish to every bucket checksummed (`wait_ready`: every bucket servable)
    fetched_s   with --fetch: publish to the version fetched and verified by a `WeightSubscriber` in this process over
                tcp (the bulk lane), started once the version is announced, as a worker's fetch begins (not a worker's
                process: its receive shares this process's GIL)
Ways: copy threads (8: the default before; --threads: the default now, up to 16) x checksums summed as buckets land
(folded where a core is spare: before) or held until the version's last copy (`snapshot._SUMS_AFTER_COPIES`: now), each
alone and with the trainer's next step running right after publish returns (`torch._foreach_add_` over every tensor in a
thread, as bench/gpu_weights.py's CPU rows do: 14.5 GB read and written on the host beside the checksums).
Writes cpu_publish_probe.json: medians per way, the host's cores. No GPU used (its driver page-locks the buckets).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.host_copy_probe import layout


def make_tensors(gib: float) -> dict[str, Any]:
    import torch

    out = {}
    for name, shape in layout(gib / 13.5):
        t = torch.empty(shape, dtype=torch.bfloat16)
        t.view(torch.int16).fill_(1)
        out[name] = t
    return out


def step(sd: dict[str, Any], v: int) -> None:
    import torch

    with torch.no_grad():
        torch._foreach_add_(list(sd.values()), 0.01 if v % 2 else -0.01)


class _Timelines(logging.Handler):
    """The subscriber's ``weights fetched`` lines: each version's per-bucket timeline over the bulk lane (ms from the
    transfer's start to each bucket's first chunk, and to it verified)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.by_version: dict[int, Any] = {}

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("weights fetched "):
            line = json.loads(msg[len("weights fetched "):])
            self.by_version[line["version"]] = line.get("timeline")


timelines = _Timelines()


async def ways_of(sd: dict[str, Any], threads: int, args: argparse.Namespace, v0: int) -> list[dict[str, Any]]:
    """One publisher with `threads` copy threads; each way's versions in turn (the switch is read at each copy)."""
    import zmq.asyncio

    from rollpool.protocol.sockets import SocketFactory
    from rollpool.weights import snapshot
    from rollpool.weights.config import WeightPathConfig
    from rollpool.weights.publisher import WeightPublisher
    from rollpool.weights.subscriber import WeightSubscriber

    ctx = zmq.asyncio.Context(io_threads=2)
    cfg = WeightPathConfig(weight_path="network", weight_copy_threads=threads)
    pub = WeightPublisher(SocketFactory(ctx), router_endpoint="tcp://127.0.0.1:*", pub_endpoint="tcp://127.0.0.1:*", keep_versions=2,
                          bucket_bytes=args.bucket_mib << 20, chunk_bytes=8 << 20, weights=cfg)
    t = time.perf_counter()
    pub.reserve(sd)
    reserve_s = time.perf_counter() - t
    await pub.start()
    sub = None
    if args.fetch:
        sub = WeightSubscriber(SocketFactory(ctx), worker_id="probe0", fetch_timeout_s=120.0,
                               weights=WeightPathConfig(weight_path="network", weight_early_bytes=args.early_bytes != "off",
                                                        weight_streams=args.sub_streams))
        sub_log = logging.getLogger("rollpool.weights.subscriber")
        sub_log.addHandler(timelines)
        sub_log.setLevel(logging.INFO)
        sub.reserve(total_bytes=sum(t.numel() * t.element_size() for t in sd.values()))
        sub.connect(pub.router_endpoint, pub.pub_endpoint)
    held: Any = None
    out, v = [], v0
    early0 = 0  # the lane's chunks sent before their bucket's checksum, so far
    try:
        for after in (False, True):
            for with_step in (False, True):
                snapshot._SUMS_AFTER_COPIES = after
                rows = []
                for i in range(args.versions + 1):
                    v += 1
                    t0 = time.perf_counter()
                    publishing = asyncio.ensure_future(pub.publish(list(sd.items()), v))
                    fetching = None
                    if sub is not None:
                        while True:  # announced (at once, before the copies): the fetch begins
                            if v in pub._server.versions or publishing.done():
                                break
                            await asyncio.sleep(0.001)
                        fetching = asyncio.ensure_future(sub.fetch(v))
                    await publishing
                    blocked = time.perf_counter() - t0
                    stepping = asyncio.ensure_future(asyncio.to_thread(step, sd, v)) if with_step else None
                    await pub.wait_ready(v)
                    ready = time.perf_counter() - t0
                    fetched = None
                    if fetching is not None:
                        got = await fetching
                        fetched = time.perf_counter() - t0
                        if held is not None:
                            sub.recycle(held)
                        held = got
                    if stepping is not None:
                        await stepping
                    lane = pub._server.bulk
                    early_chunks, early0 = (lane.early_chunks - early0, lane.early_chunks) if lane is not None else (0, 0)
                    if i:  # the way's first version is a warm-up
                        rows.append({"blocked_s": round(blocked, 4), "ready_s": round(ready, 4), "phases": dict(pub.last_phases),
                                     "early_chunks": early_chunks, "fetch_timeline": timelines.by_version.get(v),
                                     **({"fetched_s": round(fetched, 4)} if fetched is not None else {})})
                way = {"threads": threads, "sums": "after the last copy" if after else "as buckets land", "with_step": with_step,
                       "blocked_s": round(statistics.median(r["blocked_s"] for r in rows), 4),
                       "ready_s": round(statistics.median(r["ready_s"] for r in rows), 4), "runs": rows, "reserve_s": round(reserve_s, 2)}
                if sub is not None:
                    way["fetched_s"] = round(statistics.median(r["fetched_s"] for r in rows), 4)
                print(json.dumps({k: way[k] for k in ("threads", "sums", "with_step", "blocked_s", "ready_s", "fetched_s") if k in way}), flush=True)
                out.append(way)
    finally:
        snapshot._SUMS_AFTER_COPIES = None
        if sub is not None:
            sub.close()
        await pub.close()
        ctx.term()
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from rollpool.weights.config import default_host_copy_threads

    sd = make_tensors(args.gib)
    total = sum(t.numel() * t.element_size() for t in sd.values())
    now = args.threads or default_host_copy_threads()
    ways: list[dict[str, Any]] = []
    for threads in sorted({now} if args.only_now else {8, now}):
        ways += await ways_of(sd, threads, args, len(ways) * 100)
    return {"cores": os.cpu_count(), "bytes": total, "tensors": len(sd), "torch": torch.__version__, "cuda": torch.cuda.is_available(),
            "bucket_mib": args.bucket_mib, "versions_timed": args.versions, "fetch": args.fetch,
            "early_bytes": args.early_bytes if args.fetch else None, "ways": ways}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=13.5, help="about this many GiB of bf16 (13.5: the 8B layout)")
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="the copy threads of the 'now' ways (0: the default)")
    ap.add_argument("--only-now", action="store_true", help="only the default copy threads (not 8 beside them)")
    ap.add_argument("--early-bytes", choices=("on", "off"), default="on",
                    help="--fetch: the subscriber takes a bucket's bytes before its checksum (WeightPathConfig.weight_early_bytes), "
                         "from the version's last copy on")
    ap.add_argument("--sub-streams", type=int, default=0, help="--fetch: the subscriber's streams (0: its default, one per two cores)")
    ap.add_argument("--bucket-mib", type=int, default=512)
    ap.add_argument("--fetch", action="store_true", help="a subscriber in this process fetches each version as it is published (fetched_s)")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    out = asyncio.run(run(args))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "cpu_publish_probe.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
