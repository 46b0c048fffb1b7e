"""Where a delta version's time goes, on CPU: the real publisher -> subscriber delta path, phase by phase.

One process, tcp loopback, network path: a `WeightPublisher` (keep_versions=2, deltas on, `--bucket-mib` buckets) and
one `WeightSubscriber` (deltas on) that keeps the version it serves and recycles the one before, as a worker does.
The model is `--mib` of bf16 tensors; version 1 goes out full, then every version is a `sparse_step` (`--fraction` of
the bf16 elements move by one ulp, scattered: what bench/gpu_weights.py's delta rows do, the changed fraction AdamW
at lr 1e-6 gave in bench/weights.py --delta). Per version, from the moment `publish` is called:

- ``publish_s``: publish returned (the trainer's blocked time);
- ``delta_ready_s``: the server's delta was made (its version left ``pending``);
- ``manifest_s``: the subscriber held the delta manifest (its request waited for the delta);
- ``fetched_s``: the subscriber returned the rebuilt, verified version (publish -> fetched);
- the server's phases (``server``): the delta's own timers where the code reports them (`WeightServer.last_delta`),
  else the wall time of `WeightServer._build_delta`;
- the subscriber's phases (``subscriber``): the payload fetch (`DeltaPath.fetch_payloads`) and the rebuild with its
  verify (`DeltaPath.rebuild`), timed around those calls, and the subscriber's own timers where the code reports them
  (the ``weights fetched`` log line).

Every fetched tensor is compared with the trainer's, bit for bit (outside the timings). ``--kernel`` adds a
single-threaded cProfile of one bucket's encode, decode and checksum (the op-level split).

``--device`` compares, in one process, the publisher's two ways of making a delta on the same versions: the host
path (numpy in ``--threads`` threads after the full copy) and the device path (`rollpool.weights.delta_device`, torch
against a base held on the tensors' device; here that device is the CPU, so it is labelled ``cpu``: no GPU claim).
Two publishers take each version in turn (the order alternating by version); per version and side, ``publish_s``
(the trainer's wait) and ``delta_ready_s`` (publish -> the delta served), and every version's served delta is checked
byte for byte (manifest entries and encoded bytes) between the two sides. On the device side also ``host_copy_ready_s``
(publish -> the version's host copy checksummed) and ``early_ready_s`` (publish -> its delta served early, to subscribers
that verify on their GPU: minor 28), summarised in ``summary.device_early``:

    PYTHONPATH=$PWD python bench/delta_profile.py --device --mib 512 --bucket-mib 128 --versions 4 --json bench/results/cpu-delta-device.json

``--path shm`` puts the publisher's versions in shared memory and the subscriber on ``auto`` on the same host (a tree of
minor 26 reads a delta's encoded bytes there; an older one fetches them over the ROUTER); ``--copy-rebuild`` rebuilds
every delta by a copy of the base (no in-place rebuild). ``--rebuild-kernel FRACTIONS`` times the subscriber's rebuild
alone (copy with 16 and 4 MiB pieces, in place), without the publisher beside it:

    PYTHONPATH=$PWD python bench/delta_profile.py --rebuild-kernel 0.0025,0.005,0.01,0.0215 --mib 1024 --bucket-mib 128 --reps 7

``--ab TREE`` runs this script alternately against TREE (another checkout's root: its ``rollpool``) and this tree,
``--reps`` times each, one at a time, and writes both sides' runs and the ratios of their medians (this tree over
TREE) to ``--json``:

    PYTHONPATH=$PWD python bench/delta_profile.py [--mib 2048] [--bucket-mib 512] [--versions 4] [--kernel] [--json PATH]
    PYTHONPATH=$PWD python bench/delta_profile.py --ab /path/to/other/tree --reps 3 --json bench/results/cpu-delta-profile.json

With ``--ab-copy`` a third side, C, is this tree with ``--copy-rebuild``; with ``--pyspy PY_SPY`` one more run of each
side runs under py-spy and its samples are summarised by thread and innermost frame (the JSON's ``profiles``). The
figures of bench/results/cpu-delta-rebuild.json:

    PYTHONPATH=$PWD python bench/delta_profile.py --ab /tmp/main --ab-copy --reps 3 --mib 1024 --bucket-mib 128 --versions 5 \
        --fraction 0.005 --path shm --pyspy "$(which py-spy)" --json /tmp/shm.json
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import logging
import os
import platform
import pstats
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

_MiB = 1024 * 1024
ROOT = Path(__file__).resolve().parents[1]


def make_model(mib: int, n_tensors: int = 16) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    per = mib * _MiB // 2 // n_tensors
    return {f"layer{i}.weight": (torch.randn(per, generator=g) * 0.02).to(torch.bfloat16) for i in range(n_tensors)}


def sparse_step(sd: dict[str, Any], v: int, fraction: float) -> None:
    """`fraction` of each tensor's bf16 elements, scattered at random, move by one ulp (+-1 alternating by version)."""
    import torch

    g = torch.Generator().manual_seed(v)
    with torch.no_grad():
        for t in sd.values():
            w = t.view(torch.int16)
            mask = torch.rand(w.shape, generator=g) < fraction
            w[mask] += 1 if v % 2 else -1


class _Timed:
    """Wall time of each call of a coroutine method or function, by name (patched on the class or module)."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = {}

    def wrap_async(self, owner: Any, attr: str, name: str) -> None:
        orig = getattr(owner, attr)

        async def timed(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return await orig(*a, **kw)
            finally:
                self.calls.setdefault(name, []).append(time.perf_counter() - t)

        setattr(owner, attr, timed)

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        orig = getattr(owner, attr)

        def timed(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                self.calls.setdefault(name, []).append(time.perf_counter() - t)

        setattr(owner, attr, timed)

    def take(self) -> dict[str, float]:
        out = {k: round(sum(v), 4) for k, v in self.calls.items()}
        self.calls = {}
        return out


class _FetchedLog(logging.Handler):
    """The subscriber's ``weights fetched {json}`` lines, as the GPU bench reads them from a worker's log."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("weights fetched "):
            self.lines.append(json.loads(msg[len("weights fetched "):]))


def kernel_profile(bucket_mib: int, fraction: float) -> dict[str, Any]:
    """cProfile of one bucket's encode, decode and checksum, single-threaded (torch and numpy held to one thread)."""
    import torch

    from rollpool.weights.bucketing import checksum
    from rollpool.weights.delta import decode_bucket, encode_bucket

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = bucket_mib * _MiB
        g = torch.Generator().manual_seed(1)
        base = torch.randint(-30000, 30000, (n // 2,), dtype=torch.int16, generator=g)
        new = base.clone()
        new[torch.rand(n // 2, generator=g) < fraction] += 1
        out = torch.empty(n, dtype=torch.uint8)
        out.fill_(0)  # touched, as a subscriber's reserved buffers are
        b8, n8 = base.view(torch.uint8), new.view(torch.uint8)
        prof = cProfile.Profile()
        t = {}
        prof.enable()
        t0 = time.perf_counter()
        enc, payload, _k = encode_bucket(n8, b8, 2)
        t["encode_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        decode_bucket(enc, payload, b8, out, 2)
        t["decode_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        checksum(out.numpy().data)
        t["checksum_s"] = time.perf_counter() - t0
        prof.disable()
        assert torch.equal(out, n8)
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
        return {"bucket_mib": bucket_mib, "encoding": enc, **{k: round(v, 4) for k, v in t.items()},
                "top_tottime": [ln.strip() for ln in s.getvalue().splitlines() if ln.strip()][-16:]}
    finally:
        torch.set_num_threads(threads)


def rebuild_kernel(mib: int, bucket_mib: int, fractions: list[float], threads: int, reps: int) -> dict[str, Any]:
    """The subscriber's rebuild alone, without the publisher beside it (`--rebuild-kernel`): `mib` of bf16 in
    `bucket_mib` buckets, three versions v0 -> v1 -> v2 each a `fraction` step, every bucket rebuilt in `threads`
    threads with its xxh3 in the same pass, three ways interleaved rep by rep: ``copy_16mib`` (the base v1 copied, v2's
    delta scattered, 16 MiB pieces: the code before), ``copy_4mib`` (the same, 4 MiB pieces) and ``in_place_4mib`` (a
    buffer holding v0 patched with both deltas, no copy). Medians of `reps` wall seconds and their ratios; every result
    compared with v2."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from rollpool.weights import delta as delta_mod
    from rollpool.weights.bucketing import Checksummer
    from rollpool.weights.delta import encode_bucket, patch_bucket, rebuild_bucket

    n = bucket_mib * _MiB
    out: dict[str, Any] = {"mib": mib, "bucket_mib": bucket_mib, "threads": threads, "reps": reps, "by_fraction": {}}
    for fraction in fractions:
        g = torch.Generator().manual_seed(7)
        buckets = []
        for _ in range(max(1, mib // bucket_mib)):
            v0 = torch.randint(-30000, 30000, (n // 2,), dtype=torch.int16, generator=g)
            v1 = v0.clone()
            v1[torch.rand(n // 2, generator=g) < fraction] += 1
            v2 = v1.clone()
            v2[torch.rand(n // 2, generator=g) < fraction] -= 1
            b0, b1, b2 = v0.view(torch.uint8), v1.view(torch.uint8), v2.view(torch.uint8)
            e1, p1, _ = encode_bucket(b1, b0, 2)
            e2, p2, _ = encode_bucket(b2, b1, 2)
            target = torch.empty(n, dtype=torch.uint8)
            target.copy_(b0)  # touched, as a subscriber's reserved buffers are
            buckets.append((b0, b1, b2, (e1, p1), (e2, p2), target))

        def copy_one(item: Any) -> None:
            _b0, b1, _b2, _d1, (e2, p2), target = item
            rebuild_bucket(e2, p2, b1, target, 2, Checksummer("xxh3_64"))

        def in_place_one(item: Any) -> None:
            _b0, _b1, _b2, d1, d2, target = item
            patch_bucket([d1, d2], target, 2, Checksummer("xxh3_64"))

        times: dict[str, list[float]] = {"copy_16mib": [], "copy_4mib": [], "in_place_4mib": []}
        piece = delta_mod.REBUILD_PIECE_BYTES
        with ThreadPoolExecutor(threads) as ex:
            for rep in range(reps):
                modes = list(times) if rep % 2 == 0 else list(times)[::-1]
                for mode in modes:
                    for item in buckets:  # the target holds v0 before each way (outside the timing)
                        item[5].copy_(item[0])
                    delta_mod.REBUILD_PIECE_BYTES = 16 * _MiB if mode == "copy_16mib" else 4 * _MiB
                    t = time.perf_counter()
                    list(ex.map(in_place_one if mode == "in_place_4mib" else copy_one, buckets))
                    times[mode].append(time.perf_counter() - t)
                    for item in buckets:
                        assert torch.equal(item[5], item[2]), f"{mode}: a rebuilt bucket differs from v2"
        delta_mod.REBUILD_PIECE_BYTES = piece
        med = {k: round(statistics.median(v), 4) for k, v in times.items()}
        out["by_fraction"][str(fraction)] = {"median_s": med, "runs_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
                                             "copy_4mib_over_copy_16mib": round(med["copy_4mib"] / med["copy_16mib"], 3),
                                             "in_place_over_copy_4mib": round(med["in_place_4mib"] / med["copy_4mib"], 3),
                                             "in_place_over_copy_16mib": round(med["in_place_4mib"] / med["copy_16mib"], 3)}
        print(f"  fraction {fraction}: {json.dumps(out['by_fraction'][str(fraction)]['median_s'])}", file=sys.stderr, flush=True)
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import zmq.asyncio

    from rollpool.protocol.sockets import SocketFactory
    from rollpool.weights.config import WeightPathConfig
    from rollpool.weights.paths.delta import DeltaPath
    from rollpool.weights.publisher import WeightPublisher
    from rollpool.weights.serving import WeightServer
    from rollpool.weights.subscriber import WeightSubscriber

    timed = _Timed()
    timed.wrap_async(DeltaPath, "fetch_payloads", "fetch_payloads_s")
    if hasattr(DeltaPath, "read_payloads"):  # (a tree whose deltas travel over shared memory too)
        timed.wrap_async(DeltaPath, "read_payloads", "read_payloads_s")
    timed.wrap_async(DeltaPath, "rebuild", "rebuild_call_s")
    timed.wrap(WeightServer, "_build_delta", "build_delta_s")
    fetched_log = _FetchedLog()
    logging.getLogger("rollpool.weights.subscriber").addHandler(fetched_log)
    logging.getLogger("rollpool.weights.subscriber").setLevel(logging.INFO)

    sd = make_model(args.mib)
    model_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    # --path shm: the publisher's versions in shared memory and the subscriber on auto, on the same host (a tree that
    # carries deltas there reads them there; an older one fetches them over the network)
    cfg = WeightPathConfig(weight_path="network" if args.path == "network" else "auto", weight_delta=True, weight_copy_threads=args.threads)
    ctx = zmq.asyncio.Context()
    sockets = SocketFactory(ctx)
    pub = WeightPublisher(sockets, router_endpoint="tcp://127.0.0.1:*", pub_endpoint="tcp://127.0.0.1:*", keep_versions=2,
                          bucket_bytes=args.bucket_mib * _MiB, chunk_bytes=4 * _MiB, weights=cfg)
    pub.reserve(sd)
    await pub.start()
    sub = WeightSubscriber(sockets, worker_id="prof0", weights=cfg, fetch_timeout_s=120.0)
    if args.copy_rebuild and hasattr(sub.delta, "in_place"):
        sub.delta.in_place = False  # every delta rebuilt by a copy of the base (the comparison for the in-place rebuild)
    sub.reserve(total_bytes=model_bytes)
    sub.connect(pub.router_endpoint, pub.pub_endpoint)
    rows: list[dict[str, Any]] = []
    served = None
    try:
        for v in range(1, args.versions + 2):
            if v > 1:
                sparse_step(sd, v, args.fraction)
            timed.take()
            cpu0 = time.process_time()
            t0 = time.perf_counter()
            await pub.publish(sd, v)
            t_ret = time.perf_counter()
            ready: dict[str, float] = {}

            async def watch_delta(v: int = v, t0: float = t0, ready: dict[str, float] = ready) -> None:
                while True:
                    sv = pub._server.versions.get(v)
                    if sv is None or sv.delta_state != "pending":
                        ready["delta_ready_s"] = time.perf_counter() - t0
                        return
                    await asyncio.sleep(0.001)

            watcher = asyncio.ensure_future(watch_delta())
            manifest_at: dict[str, float] = {}
            orig_fm = sub.fetch_manifest

            async def fm(*a: Any, _orig: Any = orig_fm, _t0: float = t0, _at: dict[str, float] = manifest_at, **kw: Any) -> Any:
                m = await _orig(*a, **kw)
                _at.setdefault("manifest_s", time.perf_counter() - _t0)
                return m

            sub.fetch_manifest = fm  # type: ignore[method-assign]
            got = await sub.fetch(v)
            t_fetched = time.perf_counter()
            del sub.fetch_manifest
            await watcher
            cpu = time.process_time() - cpu0
            for k, t in sd.items():
                assert torch.equal(got.tensors[k].view(torch.int16), t.view(torch.int16)), f"v{v} {k} differs from the trainer's"
            if served is not None:
                sub.recycle(served)  # the engine took the new one: the one it served goes back (the base is held)
            served = got
            line = fetched_log.lines[-1] if fetched_log.lines else {}
            calls = timed.take()
            sv = pub._server.versions.get(v)
            d = sv.delta if sv is not None else None
            row: dict[str, Any] = {
                "version": v, "delta": line.get("delta_base", -1) >= 0, "path": line.get("path"), "in_place": line.get("in_place", False),
                "fetched_after_manifest_s": round(t_fetched - t0 - manifest_at.get("manifest_s", float("nan")), 4),
                "publish_s": round(t_ret - t0, 4), "delta_ready_s": round(ready.get("delta_ready_s", float("nan")), 4),
                "manifest_s": round(manifest_at.get("manifest_s", float("nan")), 4), "fetched_s": round(t_fetched - t0, 4),
                "process_cpu_s": round(cpu, 3),
                "changed_fraction": round(d.changed_fraction, 6) if d is not None else None,
                "delta_bytes_fraction": round(d.wire_bytes / model_bytes, 6) if d is not None else None,
                "server": {**{k: calls[k] for k in ("build_delta_s",) if k in calls},
                           **{k: x for k, x in pub._server.last_delta.items() if k.endswith("_s")}} if d is not None else {},
                "subscriber": {**{k: calls[k] for k in ("fetch_payloads_s", "rebuild_call_s") if k in calls},
                               **{k: x for k, x in line.items() if k.endswith("_s") and k != "at"}},
            }
            rows.append(row)
            print(f"  v{v} {json.dumps(row)}", file=sys.stderr, flush=True)
    finally:
        sub.close()
        await pub.close()
        ctx.destroy(linger=0)
    steady = [r for r in rows if r["delta"]]

    def med(get: Any) -> float | None:
        xs = [x for x in (get(r) for r in steady) if isinstance(x, (int, float))]
        return round(statistics.median(xs), 4) if xs else None

    keys = ("publish_s", "delta_ready_s", "manifest_s", "fetched_s", "fetched_after_manifest_s", "process_cpu_s", "changed_fraction",
            "delta_bytes_fraction")
    summary: dict[str, Any] = {k: med(lambda r, k=k: r[k]) for k in keys}
    summary["paths"] = sorted({str(r["path"]) for r in steady})
    summary["in_place_versions"] = sum(1 for r in steady if r["in_place"])
    for side in ("server", "subscriber"):
        names = sorted({k for r in steady for k in r[side]})
        summary[side] = {k: med(lambda r, k=k, side=side: r[side].get(k)) for k in names}
    out: dict[str, Any] = {"summary": summary, "versions": rows, "model_bytes": model_bytes}
    if args.kernel:
        out["kernel"] = kernel_profile(args.bucket_mib, args.fraction)
    return out


def _busy_trainer(seconds: float) -> None:
    """A stand-in for the trainer's next step (`--busy-trainer`): small torch ops from Python for `seconds`, the way a
    forward pass launches kernels, holding the GIL between them."""
    import torch

    xs = [torch.randn(64, 64) for _ in range(32)]
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for x in xs:
            x.mul_(0.999).add_(0.001)


async def device_compare(args: argparse.Namespace) -> dict[str, Any]:
    """`--device`: the host path and the device path (on CPU tensors) side by side, their served deltas compared."""
    import dataclasses

    import zmq.asyncio

    from rollpool.protocol.sockets import SocketFactory
    from rollpool.weights import delta_device
    from rollpool.weights.config import WeightPathConfig
    from rollpool.weights.publisher import WeightPublisher

    delta_device.DEVICE_TYPES = (*delta_device.DEVICE_TYPES, "cpu")  # the device path's torch code, run on the CPU
    sd = make_model(args.mib)
    model_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    cfg = WeightPathConfig(weight_path="network", weight_delta=True, weight_copy_threads=args.threads)
    ctx = zmq.asyncio.Context()
    sockets = SocketFactory(ctx)
    pubs = {side: WeightPublisher(sockets, router_endpoint="tcp://127.0.0.1:*", pub_endpoint="tcp://127.0.0.1:*", keep_versions=2,
                                  bucket_bytes=args.bucket_mib * _MiB, chunk_bytes=4 * _MiB,
                                  weights=dataclasses.replace(cfg, publisher_gpu_budget_bytes=(0 if side == "host" else 4 * model_bytes + (1 << 30))))
            for side in ("host", "device")}
    for pub in pubs.values():
        pub.reserve(sd)
        await pub.start()
    rows: list[dict[str, Any]] = []

    async def one(side: str, v: int) -> dict[str, Any]:
        pub = pubs[side]
        cpu0, t0, wall0 = time.process_time(), time.perf_counter(), time.time()
        await pub.publish(sd, v)
        t_ret = time.perf_counter()
        busy = None
        if args.busy_trainer:  # the trainer's next step right after publish returns: Python-heavy torch work in a thread
            busy = threading.Thread(target=_busy_trainer, args=(args.busy_trainer,), daemon=True)
            busy.start()
        await pub.wait_ready(v)
        t_host = time.perf_counter()
        for _ in range(600_000):  # the delta follows the checksums (polled: the server sets no event for it)
            if pub._server.versions[v].delta_state != "pending":
                break
            await asyncio.sleep(0.001)
        t_ready = time.perf_counter()
        if busy is not None:
            busy.join()
        d = pub._server.versions[v].delta
        early = d.timings.get("early_at") if d is not None else None
        stamps = {f"early_{k[:-3]}_s": round(d.timings[k] - wall0, 4) for k in ("called_at", "landed_at", "parts_at")
                  if d is not None and d.timings.get(k)}
        return {**stamps, "publish_s": round(t_ret - t0, 4), "delta_ready_s": round(t_ready - t0, 4),
                "host_copy_ready_s": round(t_host - t0, 4), "early_ready_s": round(early - wall0, 4) if early is not None else None,
                "early_mix_s": d.timings.get("early_mix_s") if d is not None else None,
                "process_cpu_s": round(time.process_time() - cpu0, 3),
                "made_on": pub.path_note.get("delta_made_on"), "why_not_device": pub.path_note.get("why_not_delta_on_device")}

    def served(pub: Any, v: int) -> tuple[Any, list[bytes]]:
        d = pub._server.versions[v].delta
        if d is None:
            return None, []
        keys = [(b.index, b.checksum, b.encoding, b.delta_nbytes, b.delta_checksum) for b in d.buckets]
        return keys, [bytes(src.read(0, b.nbytes)) for b, src in zip(d.payload.buckets, d.payload.sources, strict=True)]

    try:
        for v in range(1, args.versions + 2):
            if v > 1:
                sparse_step(sd, v, args.fraction)
            row: dict[str, Any] = {"version": v}
            for side in ("host", "device") if v % 2 else ("device", "host"):
                row[side] = await one(side, v)
            (hk, hb), (dk, db) = served(pubs["host"], v), served(pubs["device"], v)
            row["same_served_bytes"] = hk == dk and hb == db
            if v > 1 and not row["same_served_bytes"]:
                raise AssertionError(f"v{v}: the device path's served delta differs from the host path's")
            d = pubs["device"]._server.versions[v].delta
            row["changed_fraction"] = round(d.changed_fraction, 6) if d is not None else None
            row["delta_bytes_fraction"] = round(d.wire_bytes / model_bytes, 6) if d is not None else None
            row["device_phases"] = {k: x for k, x in pubs["device"]._server.last_delta.items() if k.endswith("_s")} if d is not None else {}
            row["host_phases"] = {k: x for k, x in pubs["host"]._server.last_delta.items() if k.endswith("_s")}
            rows.append(row)
            print(f"  v{v} {json.dumps(row)}", file=sys.stderr, flush=True)
    finally:
        for pub in pubs.values():
            await pub.close()
        ctx.destroy(linger=0)
    steady = rows[1:]
    summary: dict[str, Any] = {"label": "cpu: the device path's torch code on CPU tensors, not a GPU figure",
                               "all_served_bytes_identical": all(r["same_served_bytes"] for r in steady),
                               "made_on": {side: sorted({str(r[side]["made_on"]) for r in steady}) for side in ("host", "device")}}
    for k in ("publish_s", "delta_ready_s", "process_cpu_s"):
        h = statistics.median(r["host"][k] for r in steady)
        dv = statistics.median(r["device"][k] for r in steady)
        summary[k] = {"host": round(h, 4), "device_cpu": round(dv, 4), "device_over_host": round(dv / h, 3) if h else None}
    # the device side's delta served early (minor 28: before the version's host copy is checksummed, to subscribers that
    # verify on their GPU) beside the host copy's checksums and the complete delta, publish -> each
    early = [r["device"]["early_ready_s"] for r in steady if r["device"].get("early_ready_s") is not None]
    summary["device_early"] = {"served_early": f"{len(early)} of {len(steady)}",
                               "early_ready_s": round(statistics.median(early), 4) if early else None,
                               "host_copy_ready_s": round(statistics.median(r["device"]["host_copy_ready_s"] for r in steady), 4),
                               "early_mix_s": round(statistics.median(x["device"]["early_mix_s"] for x in steady if x["device"].get("early_mix_s") is not None), 4) if early else None,
                               "delta_ready_s": summary["delta_ready_s"]["device_cpu"]}
    # after the trainer's return: the early delta's steps (the mix64 in hand, the last payload landed, every part
    # checksummed, served), medians over the steady versions
    for k in ("early_called_s", "early_landed_s", "early_parts_s", "early_ready_s"):
        after = [r["device"][k] - r["device"]["publish_s"] for r in steady if r["device"].get(k) is not None]
        summary["device_early"][f"{k[:-2]}_after_return_s"] = round(statistics.median(after), 4) if after else None
    summary["device_early"]["busy_trainer_s"] = args.busy_trainer
    return {"summary": summary, "versions": rows, "model_bytes": model_bytes}


PHASE_KEYS = ("publish_s", "delta_ready_s", "manifest_s", "fetched_s", "fetched_after_manifest_s", "process_cpu_s")


def ab(args: argparse.Namespace) -> dict[str, Any]:
    """This script against `args.ab` (A) and this tree (B), alternately, `args.reps` times each; with `--ab-copy` a third
    side, C: this tree with every delta rebuilt by a copy of the base (`--copy-rebuild`). With `--pyspy`, one more run of
    each side under py-spy, its samples summarised (`pyspy_summary`)."""
    trees = {"A": str(Path(args.ab).resolve()), "B": str(ROOT)}
    sides: dict[str, tuple[str, list[str]]] = {"A": (trees["A"], []), "B": (str(ROOT), [])}
    if args.ab_copy:
        sides["C"] = (str(ROOT), ["--copy-rebuild"])
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    order = list(sides)
    for rep in range(args.reps):
        for side in order if rep % 2 == 0 else order[::-1]:
            runs[side].append(_one_run(args, side, rep, *sides[side]))

    def med(side: str, get: Any) -> float | None:
        xs = [x for x in (get(r["summary"]) for r in runs[side]) if isinstance(x, (int, float))]
        return statistics.median(xs) if xs else None

    pairs = [("B", "A")] + ([("C", "A"), ("B", "C")] if "C" in sides else [])
    ratios: dict[str, Any] = {}
    for k in PHASE_KEYS + ("subscriber.delta_total_s", "subscriber.rebuild_s"):
        get = (lambda s, k=k: s["subscriber"].get(k.split(".", 1)[1])) if k.startswith("subscriber.") else (lambda s, k=k: s[k])
        vals = {side: med(side, get) for side in sides}
        ratios[k] = {side: round(x, 4) if x else x for side, x in vals.items()}
        for a, b in pairs:
            x, y = vals[a], vals[b]
            ratios[k][f"{a}_over_{b}"] = round(x / y, 3) if x and y else None
    out: dict[str, Any] = {"trees": trees, "sides": {k: {"tree": t, "flags": f} for k, (t, f) in sides.items()},
                           "ratios": ratios, "runs": runs}
    if args.pyspy:
        out["profiles"] = {side: _one_run(args, side, -1, *sides[side], pyspy=args.pyspy).get("pyspy") for side in sides}
    return out


def _one_run(args: argparse.Namespace, side: str, rep: int, tree: str, flags: list[str], pyspy: str | None = None) -> dict[str, Any]:
    out = Path(f"/tmp/delta-profile-{os.getpid()}-{side}{rep}.json")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--mib", str(args.mib), "--bucket-mib", str(args.bucket_mib),
           "--versions", str(args.versions), "--fraction", str(args.fraction), "--threads", str(args.threads),
           "--json", str(out), *flags]
    if args.path != "network":
        cmd += ["--path", args.path]
    if args.kernel:
        cmd.append("--kernel")
    raw = Path(f"/tmp/delta-profile-{os.getpid()}-{side}.pyspy.txt")
    if pyspy:
        cmd = [pyspy, "record", "--rate", "250", "--format", "raw", "--threads", "-o", str(raw), "--", *cmd]
    env = {**os.environ, "PYTHONPATH": tree}
    print(f"[{side}{rep}] {tree} {' '.join(flags)}", file=sys.stderr, flush=True)
    subprocess.run(cmd, env=env, check=True, cwd=tree)
    got: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    if pyspy:
        got = {"pyspy": {**pyspy_summary(raw), "summary_of_that_run": got["summary"]}}
        raw.unlink()
    return got


_IDLE = ("concurrent/futures/thread.py:8", "threading.py:", "selectors.py:", "asyncio/base_events.py:", "queue.py:")
"""Frames where a thread waits (py-spy reports some waits as samples): left out of the shares."""


def pyspy_summary(raw: Path, top: int = 12) -> dict[str, Any]:
    """py-spy's raw stacks (``--threads``) -> per thread kind (its name without the number) its busy samples, and for the
    subscriber's rebuild threads and the whole process the busy samples by innermost frame (function and line), shares
    of the busy total. Samples whose innermost frame is a wait (`_IDLE`) are not counted."""
    import re
    from collections import Counter

    threads: Counter[str] = Counter()
    frames: dict[str, Counter[str]] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        parts = stack.split(";")
        leaf = parts[-1]
        if any(mark in leaf for mark in _IDLE):
            continue
        kind = re.sub(r"\(\d+\)|_\d+$|\d+", "", parts[0].split(":", 1)[-1]).strip() or "?"
        threads[kind] += int(n)
        frames.setdefault(kind, Counter())[leaf] += int(n)
        total += int(n)

    def shares(c: Counter[str]) -> list[tuple[str, float]]:
        busy = sum(c.values())
        return [(k, round(v / busy, 3)) for k, v in c.most_common(top)] if busy else []

    rebuild = Counter[str]()
    for kind, c in frames.items():
        if "rebuild" in kind:
            rebuild.update(c)
    return {"busy_samples": total, "threads_share": shares(threads), "rebuild_threads_by_frame": shares(rebuild),
            "subscriber_loop_and_others_by_frame": shares(sum((c for k, c in frames.items() if "rebuild" not in k), Counter()))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=2048, help="model size (bf16)")
    ap.add_argument("--bucket-mib", type=int, default=512)
    ap.add_argument("--versions", type=int, default=4, help="delta versions after the first (full) one")
    ap.add_argument("--fraction", type=float, default=0.0215, help="changed fraction of bf16 elements per version")
    ap.add_argument("--threads", type=int, default=2, help="weight_copy_threads on both sides (the delta's and the rebuild's)")
    ap.add_argument("--kernel", action="store_true", help="add a single-threaded cProfile of one bucket's encode/decode/checksum")
    ap.add_argument("--ab", default=None, help="another tree's root: run it and this tree alternately (--reps each)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--path", choices=("network", "shm"), default="network",
                    help="network: publisher and subscriber on the network path; shm: the publisher's versions in shared memory, the subscriber on auto on this host")
    ap.add_argument("--copy-rebuild", action="store_true", help="every delta rebuilt by a copy of the base (no in-place rebuild)")
    ap.add_argument("--ab-copy", action="store_true", help="with --ab: a third side, this tree with --copy-rebuild")
    ap.add_argument("--pyspy", default=None, help="with --ab: the py-spy binary; one more run of each side under it, summarised")
    ap.add_argument("--device", action="store_true", help="the host path and the device path (on CPU tensors) side by side, their served deltas compared")
    ap.add_argument("--rebuild-kernel", default=None, metavar="FRACTIONS",
                    help="the subscriber's rebuild alone at these changed fractions (comma-separated): copy (16 and 4 MiB pieces) vs in place")
    ap.add_argument("--busy-trainer", type=float, default=0.0, metavar="S",
                    help="with --device: a thread does small torch ops for S seconds after each publish returns (the trainer's next step)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.rebuild_kernel:
        result: dict[str, Any] = {"summary": rebuild_kernel(args.mib, args.bucket_mib, [float(x) for x in args.rebuild_kernel.split(",")],
                                                            args.threads, args.reps)}
    elif args.device:
        result = asyncio.run(device_compare(args))
    elif args.ab:
        result = ab(args)
    else:
        result = asyncio.run(run(args))
    result["params"] = {k: getattr(args, k) for k in ("mib", "bucket_mib", "versions", "fraction", "threads", "reps", "path", "copy_rebuild")}
    result["machine"] = {"python": platform.python_version(), "cpus": os.cpu_count()}
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(json.dumps(result.get("ratios") or result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
