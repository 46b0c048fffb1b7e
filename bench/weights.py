"""Weight-channel benchmark: rollpool publish + fetch vs raw pyzmq and gloo, per version size and transport.

For each size (``--mib``, default 256 and 1024) and transport (``--transports``, tcp loopback and ipc),
a fresh set of processes, runs interleaved (medians and min..max of ``--reps``; a warm-up of each first):

1. Throughput, one subscriber, checksums on (xxh3_64; crc32 without xxhash): a publisher child
   publishes versions 1..3 of the bf16 tensors (keep 1, so version 3's snapshot reuses version 1's
   buffers: snapshot GB/s fresh and reused are both reported); the main process fetches version 3
   with a long-lived `WeightSubscriber` that recycles its buffers, as a worker does (the first
   fetch, into fresh memory, is reported apart). The limit: raw pyzmq PUSH -> PULL of the same
   bytes in frames of the chunk size, zero-copy send from a child, the receiver copying each frame
   into one buffer. `ratio_vs_raw` = rollpool / raw.
2. Peer, 4 receivers: torch.distributed gloo broadcast of the same tensors from one sender process
   to 4 receiver processes (tcp: gloo has no ipc; receivers reuse preallocated tensors; checked by
   crc32 of a tensor outside the timing) vs 4 rollpool subscriber processes fetching direct from
   the publisher, then (second phase, so 1 GiB x 8 subscribers never share the memory) 4 behind
   one relay process that already holds the version (its upstream fetch is reported apart). Time
   until the last subscriber holds the verified version. `vs_gloo` = gloo_4_s / rollpool_4_s,
   best of direct and relay. Beside each, the CPU seconds all its processes used for one version
   (`gloo_4_cpu_s`, `rollpool_4_cpu_s`; user + system, from /proc): with fewer cores than
   processes the wall times compare the work per version more than its overlap.
3. Checksum cost (xxh3_64 and crc32, one core, s per GB) and in-process fan-out: 8 subscribers
   direct vs behind one relay (publisher bytes served).

Transport ``shm`` is the same-host path: manifests over ipc, bucket bytes copied out of the publisher's
shared-memory segments (raw pyzmq and the relay's downstream stay on ipc, gloo on tcp); the tcp and ipc
rows pin the subscribers to the network path.

On tcp the subscribers take the bulk lane (protocol minor 13) unless ``ROLLPOOL_WEIGHT_BULK=0``
(`rollpool_lane` says which); each set also measures the same one-subscriber fetch with the lane off,
interleaved (`rollpool_router_gbps`, `ratio_vs_raw_router`), so the two lanes compare in one run.

The top-level keys (raw_zmq_gbps, rollpool_gbps, ratio_vs_raw, gloo_4_s, rollpool_4_s, vs_gloo)
are the largest size on tcp; every set is under "rows".

    python bench/weights.py --delta [--delta-mib 64] [--delta-versions 5] [--json PATH]   (the delta rows only)
    python bench/weights.py [--mib 256,1024] [--transports tcp,ipc] [--reps 3] [--chunk-mib 4] [--window 16]
                            [--peers 4] [--no-gloo] [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import platform
import statistics
import sys
import time
import zlib
from typing import Any

import numpy as np

_MiB = 1024 * 1024


def make_tensors(total_mib: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    per = 8 * _MiB // 2  # 8 MiB bf16 tensors
    n = max(1, total_mib // 8)
    return {f"layers.{i}.weight": torch.randn(per, generator=g).to(torch.bfloat16) for i in range(n)}


# --------------------------------------------------------------------------- child processes


VERSION = 3
"""The version every fetch asks for: the publisher publishes 1, 2, 3 (keep 1, so memory stays at 2 versions), so 3 reuses 1's buffers."""


def _endpoint(transport: str, name: str, tmpdir: str) -> str:
    # the shm row's control messages (manifests) travel over ipc; its bucket bytes through shared memory
    return "tcp://127.0.0.1:*" if transport == "tcp" else f"ipc://{tmpdir}/{name}"


def _path(transport: str) -> str:
    """The subscribers' weight path: the tcp and ipc rows measure the network path, the shm row the same-host one."""
    return "auto" if transport == "shm" else "network"


def _subscriber_kwargs(transport: str) -> dict[str, Any]:
    import inspect

    from rollpool.weights.subscriber import WeightSubscriber

    # the branch point's subscriber has no `path` (its A/B runs this same script against it)
    return {"path": _path(transport)} if "path" in inspect.signature(WeightSubscriber).parameters else {}


def _publisher_child(conn: Any, mib: int, chunk_bytes: int, bucket_mib: int, transport: str = "tcp", tmpdir: str = "") -> None:
    import zmq.asyncio

    from rollpool.protocol.sockets import SocketFactory
    from rollpool.weights.publisher import WeightPublisher

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        pub = WeightPublisher(
            SocketFactory(ctx), chunk_bytes=chunk_bytes, bucket_bytes=bucket_mib * _MiB, keep_versions=1,
            router_endpoint=_endpoint(transport, "pub", tmpdir), pub_endpoint=_endpoint(transport, "pub-announce", tmpdir),
        )
        await pub.start()
        tensors = make_tensors(mib)
        snap_s = []
        for v in range(1, VERSION + 1):
            t0 = time.perf_counter()
            await pub.publish(tensors, v)
            snap_s.append(time.perf_counter() - t0)
        conn.send((pub.router_endpoint, pub.pub_endpoint, snap_s))
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, conn.recv)  # until told to stop
        conn.send(pub.bytes_served)
        await pub.close()
        ctx.destroy(linger=0)

    asyncio.run(main())


def _raw_sender_child(conn: Any, nbytes: int, chunk_bytes: int, transport: str = "tcp", tmpdir: str = "") -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(_endpoint(transport, "raw", tmpdir))
    port = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    buf = np.ones(nbytes, dtype=np.uint8)
    view = memoryview(buf)
    conn.send(port)
    while conn.recv() == "go":
        for off in range(0, nbytes, chunk_bytes):
            sock.send(view[off : off + chunk_bytes], copy=False)
    sock.close(linger=0)
    ctx.term()


def _gloo_child(rank: int, world: int, port: int, mib: int, conn: Any) -> None:
    """Rank 0 sends make_tensors(mib); ranks 1.. receive into preallocated tensors. Rank 0 takes commands."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if rank == 0:
        tensors = list(make_tensors(mib).values())
    else:
        n, per = max(1, mib // 8), 8 * _MiB // 2
        tensors = [torch.empty(per, dtype=torch.bfloat16) for _ in range(n)]
    ctl = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        conn.send("ready")
    while True:
        if rank == 0:
            ctl[0] = 1 if conn.recv() == "go" else 0
        dist.broadcast(ctl, 0)
        if not int(ctl[0]):
            break
        dist.barrier()
        t0 = time.perf_counter()
        for t in tensors:
            dist.broadcast(t, 0)
        dist.barrier()  # every receiver holds every tensor
        dt = time.perf_counter() - t0
        # check, outside the timing: crc32 of the last tensor on every rank equals the sender's
        crc = torch.tensor([zlib.crc32(tensors[-1].view(torch.uint8).numpy())], dtype=torch.int64)
        crcs = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(crcs, crc)
        if rank == 0:
            conn.send((dt, all(int(c[0]) == int(crc[0]) for c in crcs)))
    dist.destroy_process_group()


def _relay_child(conn: Any, upstream_router: str, upstream_pub: str | None, transport: str, tmpdir: str, window: int) -> None:
    """A relay process: fetches the version once from the publisher, then serves it to the subscribers."""
    import zmq.asyncio

    from rollpool.protocol.sockets import SocketFactory
    from rollpool.weights.relay import Relay

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        relay = Relay(
            SocketFactory(ctx), upstream_router=upstream_router, upstream_pub=upstream_pub, window_chunks=window,
            router_endpoint=_endpoint(transport, "relay", tmpdir), pub_endpoint=_endpoint(transport, "relay-announce", tmpdir),
            **_subscriber_kwargs(transport),
        )
        await relay.start()
        task = asyncio.ensure_future(relay.run())
        t0 = time.perf_counter()
        while relay.latest_version < VERSION:  # noqa: ASYNC110 (a bench: the relay exposes no event for it)
            await asyncio.sleep(0.005)
        conn.send((relay.router_endpoint, time.perf_counter() - t0))
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop
        relay.stop()
        await task
        ctx.destroy(linger=0)

    asyncio.run(main())


def _subscriber_child(conn: Any, router: str, window: int, transport: str = "tcp") -> None:
    """One long-lived subscriber process (a worker): fetch the version on each 'go', report when it holds it verified."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with Fetcher(router, window, transport) as f:
            conn.send("ready")
            while await loop.run_in_executor(None, conn.recv) == "go":
                _dt, total = await f.once()
                conn.send((time.perf_counter(), total))

    asyncio.run(main())


# --------------------------------------------------------------------------- measurements


def raw_once(conn: Any, sock: Any, nbytes: int, dst: np.ndarray[Any, Any]) -> float:
    conn.send("go")
    t0 = time.perf_counter()
    off = 0
    while off < nbytes:
        frame = sock.recv(copy=False)
        n = len(frame.buffer)
        dst[off : off + n] = np.frombuffer(frame.buffer, dtype=np.uint8)
        off += n
    return time.perf_counter() - t0


class Fetcher:
    """One long-lived subscriber, as in a worker: it recycles the previous version's buffers."""

    def __init__(self, router: str, window: int, transport: str = "tcp", bulk: bool | None = None) -> None:
        self.router, self.window, self.transport, self.bulk = router, window, transport, bulk

    async def __aenter__(self) -> Fetcher:
        import zmq.asyncio

        from rollpool.protocol.sockets import SocketFactory
        from rollpool.weights.subscriber import WeightSubscriber

        self.ctx = zmq.asyncio.Context()
        self.sub = WeightSubscriber(SocketFactory(self.ctx), fetch_timeout_s=30, window_chunks=self.window, bulk=self.bulk,
                                    **_subscriber_kwargs(self.transport))
        self.sub.connect(self.router)
        await self.sub.fetch_manifest(VERSION)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.sub.aclose()
        self.ctx.destroy(linger=0)

    async def once(self, recycle: bool = True) -> tuple[float, int]:
        t0 = time.perf_counter()
        got = await self.sub.fetch(VERSION)
        dt = time.perf_counter() - t0
        if recycle:
            self.sub.recycle(got)
        return dt, got.total_bytes


def checksum_s_per_gb(nbytes: int, algorithm: str) -> float:
    from rollpool.weights.bucketing import checksum

    buf = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    checksum(buf[: 1 << 20], algorithm)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        checksum(buf, algorithm)
        best = min(best, time.perf_counter() - t0)
    return best / (nbytes / 1e9)


async def fanout(mib: int, n_subs: int, chunk_bytes: int) -> dict[str, Any]:
    import zmq.asyncio

    from rollpool.protocol.sockets import SocketFactory
    from rollpool.weights.publisher import WeightPublisher
    from rollpool.weights.relay import Relay
    from rollpool.weights.subscriber import WeightSubscriber

    out: dict[str, Any] = {}
    ctx = zmq.asyncio.Context()
    f = SocketFactory(ctx)
    tensors = make_tensors(mib)
    for mode in ("direct", "relay"):
        pub = WeightPublisher(f, chunk_bytes=chunk_bytes, bucket_bytes=64 * _MiB)
        await pub.start()
        relay = None
        router, announce = pub.router_endpoint, pub.pub_endpoint
        if mode == "relay":
            relay = Relay(f, upstream_router=router, upstream_pub=announce, window_chunks=8, **_subscriber_kwargs("tcp"))
            await relay.start()
            relay_task = asyncio.ensure_future(relay.run())
            router, announce = relay.router_endpoint, relay.pub_endpoint
        subs = [WeightSubscriber(f, fetch_timeout_s=60, window_chunks=4, **_subscriber_kwargs("tcp")) for _ in range(n_subs)]  # fan-out of the network path
        for s in subs:
            s.connect(router, announce)
        manifest = await pub.publish(tensors, 1)
        total = sum(b.nbytes for b in manifest.buckets)
        t0 = time.perf_counter()

        async def one(s: WeightSubscriber) -> None:
            await s.wait_for_newer(0, timeout_s=60)
            await s.fetch(1)

        await asyncio.gather(*(one(s) for s in subs))
        dt = time.perf_counter() - t0
        out[mode] = {
            "publisher_bytes_served": pub.bytes_served,
            "publisher_served_x_version": round(pub.bytes_served / total, 3),
            "all_verified_s": round(dt, 3),
        }
        for s in subs:
            await s.aclose()
        if relay is not None:
            relay.stop()
            await relay_task
        await pub.close()
    out["version_bytes"] = total
    out["subscribers"] = n_subs
    ctx.destroy(linger=0)
    return out


def cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system, every thread) the processes have used so far; NaN where /proc cannot tell (not Linux)."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def spread(xs: list[float]) -> list[float]:
    return [round(min(xs), 3), round(max(xs), 3)]


def median(xs: list[float]) -> float:
    return round(statistics.median(xs), 3)


def run_set(mib: int, transport: str, args: argparse.Namespace, tmpdir: str) -> dict[str, Any]:
    """One size on one transport: raw, rollpool x1, gloo x peers, rollpool x peers direct and via a relay, interleaved."""
    import zmq

    chunk = args.chunk_mib * _MiB
    nbytes = mib * _MiB
    mpctx = mp.get_context("spawn")
    procs: list[Any] = []
    peer_pids: dict[int, int] = {}

    def start(target: Any, *a: Any) -> Any:
        parent, child = mpctx.Pipe()
        p = mpctx.Process(target=target, args=(child, *a), daemon=True)
        p.start()
        procs.append(p)
        peer_pids[id(parent)] = p.pid
        return parent

    pub_conn = start(_publisher_child, mib, chunk, args.bucket_mib, transport, tmpdir)
    router, announce, snap_s = pub_conn.recv()
    raw_conn = start(_raw_sender_child, nbytes, chunk, transport, tmpdir)
    raw_ep = raw_conn.recv()
    zctx = zmq.Context()
    pull = zctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.connect(raw_ep)
    dst = np.empty(nbytes, dtype=np.uint8)
    relay_conn = start(_relay_child, router, announce, transport, tmpdir, args.window)
    relay_router, relay_first_s = relay_conn.recv()

    gloo_conn = None
    gloo_procs: list[Any] = []
    if not args.no_gloo:
        import socket

        with socket.socket() as so:
            so.bind(("127.0.0.1", 0))
            gport = so.getsockname()[1]
        gloo_conn, gchild = mpctx.Pipe()
        gloo_procs = [
            mpctx.Process(target=_gloo_child, args=(r, args.peers + 1, gport, mib, gchild if r == 0 else None), daemon=True)
            for r in range(args.peers + 1)
        ]
        for p in gloo_procs:
            p.start()
    direct = [start(_subscriber_child, router, args.window, transport) for _ in range(args.peers)]
    via_relay: list[Any] = []
    if gloo_conn is not None:
        assert gloo_conn.recv() == "ready"
    for c in direct:
        assert c.recv() == "ready"

    # CPU seconds of every process taking part in one 4-peer version (this box may have fewer cores than processes:
    # then the wall times compare how much work each system does per version as much as how it overlaps it)
    cpu: dict[str, list[float]] = {"gloo": [], "direct": [], "relay": []}

    def gloo_once() -> float:
        assert gloo_conn is not None
        pids = [p.pid for p in gloo_procs]
        c0 = cpu_s(pids)
        gloo_conn.send("go")
        dt, ok = gloo_conn.recv()
        cpu["gloo"].append(cpu_s(pids) - c0)
        if not ok:
            raise RuntimeError("gloo receivers' bytes differ from the sender's")
        return float(dt)

    def peers_once(conns: list[Any], serving: Any, kind: str | None) -> float:
        pids = [peer_pids[id(c)] for c in [serving, *conns]]
        c0 = cpu_s(pids)
        t0 = time.perf_counter()
        for c in conns:
            c.send("go")
        got = [c.recv() for c in conns]
        if kind is not None:
            cpu[kind].append(cpu_s(pids) - c0)
        if any(total != nbytes for _t, total in got):
            raise RuntimeError(f"subscriber got {[t for _, t in got]} bytes, expected {nbytes}")
        return max(t for t, _ in got) - t0

    m: dict[str, list[float]] = {k: [] for k in ("raw", "rp", "ratio", "rp_router", "ratio_router", "gloo", "direct", "relay", "vs_gloo_direct",
                                                 "vs_gloo_relay", "vs_gloo")}
    loop = asyncio.new_event_loop()
    fetcher = Fetcher(router, args.window, transport)
    # the same subscriber with the bulk lane off (every chunk over the ROUTER, as before protocol minor 13), interleaved
    router_fetcher = Fetcher(router, args.window, transport, bulk=False)
    try:
        loop.run_until_complete(fetcher.__aenter__())
        loop.run_until_complete(router_fetcher.__aenter__())
        loop.run_until_complete(router_fetcher.once())  # its first fetch (fresh memory) is not measured
        raw_once(raw_conn, pull, nbytes, dst)  # warm-up (and the raw receiver's buffer is faulted in)
        dt, total = loop.run_until_complete(fetcher.once())  # first fetch: fresh memory
        first_fetch_gbps = total / dt / 1e9
        gloo_first_s = gloo_once() if gloo_conn is not None else float("nan")
        cpu["gloo"].clear()  # the first version is reported apart
        direct_first_s = peers_once(direct, pub_conn, None)
        for _ in range(args.reps):
            r = nbytes / raw_once(raw_conn, pull, nbytes, dst) / 1e9
            dt, total = loop.run_until_complete(fetcher.once())
            g = total / dt / 1e9
            m["raw"].append(r)
            m["rp"].append(g)
            m["ratio"].append(g / r)
            dt, total = loop.run_until_complete(router_fetcher.once())
            m["rp_router"].append(total / dt / 1e9)
            m["ratio_router"].append(total / dt / 1e9 / r)
            gs = gloo_once() if gloo_conn is not None else float("nan")
            ds = peers_once(direct, pub_conn, "direct")
            m["gloo"].append(gs)
            m["direct"].append(ds)
            m["vs_gloo_direct"].append(gs / ds)
        lane_bytes = fetcher.sub.bulk_bytes
        loop.run_until_complete(fetcher.__aexit__())
        loop.run_until_complete(router_fetcher.__aexit__())
        # phase 2: the direct subscribers leave, 4 behind the relay take their place (interleaved with gloo again)
        for c in direct:
            c.send("stop")
        direct = []
        via_relay = [start(_subscriber_child, relay_router, args.window, transport) for _ in range(args.peers)]
        for c in via_relay:
            assert c.recv() == "ready"
        relay_first4_s = peers_once(via_relay, relay_conn, None)
        for i in range(args.reps):
            gs = gloo_once() if gloo_conn is not None else float("nan")
            rs = peers_once(via_relay, relay_conn, "relay")
            m["gloo"].append(gs)
            m["relay"].append(rs)
            m["vs_gloo_relay"].append(gs / rs)
            m["vs_gloo"].append(max(m["vs_gloo_direct"][i], gs / rs))
    finally:
        if gloo_conn is not None:
            gloo_conn.send("stop")
        for c in direct + via_relay:
            c.send("stop")
        relay_conn.send("stop")
        raw_conn.send("stop")
        pub_conn.send("stop")
        served = pub_conn.recv()
        for p in gloo_procs + procs:
            p.join(20)
        pull.close(linger=0)
        zctx.term()
        loop.close()
    row: dict[str, Any] = {"mib": mib, "transport": transport}
    for key, name in (("raw", "raw_zmq_gbps"), ("rp", "rollpool_gbps"), ("ratio", "ratio_vs_raw"), ("rp_router", "rollpool_router_gbps"),
                      ("ratio_router", "ratio_vs_raw_router"), ("gloo", "gloo_4_s"), ("direct", "rollpool_4_direct_s"),
                      ("relay", "rollpool_4_relay_s"), ("vs_gloo_direct", "vs_gloo_direct"), ("vs_gloo_relay", "vs_gloo_relay"), ("vs_gloo", "vs_gloo")):
        if not args.no_gloo or key in ("raw", "rp", "ratio", "rp_router", "ratio_router", "direct", "relay"):
            row[name] = median(m[key])
            row[name + "_spread"] = spread(m[key])
    best = "direct" if statistics.median(m["direct"]) <= statistics.median(m["relay"]) else "relay"
    row["rollpool_4_s"] = median(m[best])
    row["rollpool_4_s_spread"] = spread(m[best])
    row["rollpool_4_mode"] = best
    for kind, name in (("gloo", "gloo_4_cpu_s"), ("direct", "rollpool_4_direct_cpu_s"), ("relay", "rollpool_4_relay_cpu_s")):
        if cpu[kind] and not any(x != x for x in cpu[kind]):
            row[name] = median(cpu[kind])
    if cpu[best]:
        row["rollpool_4_cpu_s"] = row.get(f"rollpool_4_{best}_cpu_s")
    row["cpus"] = mp.cpu_count()
    row["rollpool_lane"] = "bulk" if lane_bytes else "router"  # what the measured subscriber used (ROLLPOOL_WEIGHT_BULK, the transport)
    row["rollpool_4_gbps_per_subscriber"] = round(nbytes / statistics.median(m[best]) / 1e9, 3)
    if not args.no_gloo:
        row["gloo_4_gbps_per_receiver"] = round(nbytes / statistics.median(m["gloo"]) / 1e9, 3)
        row["gloo_4_first_s"] = round(gloo_first_s, 3)
    row["rollpool_first_fetch_gbps"] = round(first_fetch_gbps, 3)
    row["rollpool_4_direct_first_s"] = round(direct_first_s, 3)
    row["rollpool_4_relay_first_s"] = round(relay_first4_s, 3)
    row["relay_upstream_fetch_s"] = round(relay_first_s, 3)
    row["publish_snapshot_s"] = round(snap_s[0], 3)
    row["publish_snapshot_gbps"] = round(nbytes / snap_s[0] / 1e9, 3)
    row["publish_snapshot_reused_s"] = round(snap_s[-1], 3)
    row["publish_snapshot_reused_gbps"] = round(nbytes / snap_s[-1] / 1e9, 3)
    row["publisher_bytes_served_total"] = served
    return row


# --------------------------------------------------------------------------- delta versions (--delta)


class AdamWTrainer:
    """A realistic RL trainer step for the delta rows: fp32 master weights (init 0.02 * randn, as LLM layers are),
    torch AdamW (betas 0.9/0.999, weight decay 0.01) at `lr`, gradients of unit global norm (what gradient clipping at
    1.0 leaves; per element about 1/sqrt(n)), cast to bf16 for publishing."""

    def __init__(self, mib: int, lr: float, seed: int = 0) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        n_tensors = 8
        per = mib * _MiB // 2 // n_tensors  # bf16 elements per tensor
        self.params = [torch.nn.Parameter(torch.randn(per, generator=g) * 0.02) for _ in range(n_tensors)]
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.01)
        self.gen = g

    def step(self, worst_case: bool = False) -> dict[str, Any]:
        import torch

        grads = [torch.randn(p.shape, generator=self.gen) for p in self.params]
        norm = torch.sqrt(sum((x * x).sum() for x in grads))
        for p, x in zip(self.params, grads, strict=True):
            p.grad = x / norm
        self.opt.step()
        with torch.no_grad():
            if worst_case:  # every element moves by far more than a bf16 ulp
                for p in self.params:
                    p.mul_(1.5).add_(0.01)
            return {f"layer{i}.weight": p.detach().to(torch.bfloat16) for i, p in enumerate(self.params)}


async def delta_compare(mib: int, lr: float, versions: int, n_subs: int, chunk_bytes: int) -> dict[str, Any]:
    """Delta vs full versions side by side, one process, tcp loopback, network path: one publisher (deltas on) feeds two
    relays, one with deltas off (it and its `n_subs` subscribers take full versions) and one with deltas on (it gets the
    changed elements from upstream, rebuilds and verifies the version, and forwards the delta to its `n_subs`
    subscribers). Per version: publish, then each relay follows (its time, process CPU and upstream bytes), then each
    group fetches (their order alternating), timed until its last subscriber holds the verified version, with its bytes
    received and the process CPU seconds. The last version is a worst case (every element changes): the delta side must
    get the full version with no loss against the full side."""
    import torch
    import zmq.asyncio

    from rollpool.protocol.sockets import SocketFactory
    from rollpool.weights.config import WeightPathConfig
    from rollpool.weights.publisher import WeightPublisher
    from rollpool.weights.relay import Relay
    from rollpool.weights.subscriber import WeightSubscriber

    ctx = zmq.asyncio.Context()
    sockets = SocketFactory(ctx)
    cfg = {"delta": WeightPathConfig(weight_path="network", weight_delta=True), "full": WeightPathConfig(weight_path="network", weight_delta=False)}
    pub = WeightPublisher(sockets, router_endpoint="tcp://127.0.0.1:*", pub_endpoint="tcp://127.0.0.1:*", keep_versions=2,
                          bucket_bytes=64 * _MiB, chunk_bytes=chunk_bytes, weights=cfg["delta"])
    await pub.start()
    relays = {name: Relay(sockets, upstream_router=pub.router_endpoint, upstream_pub=pub.pub_endpoint, router_endpoint="tcp://127.0.0.1:*",
                          pub_endpoint="tcp://127.0.0.1:*", weights=c, fetch_timeout_s=60.0, relay_id=f"relay-{name}") for name, c in cfg.items()}
    for r in relays.values():
        await r.start()
    groups = {name: [WeightSubscriber(sockets, worker_id=f"{name}{i}", weights=cfg[name], fetch_timeout_s=60.0) for i in range(n_subs)]
              for name in ("full", "delta")}
    for name, subs in groups.items():
        for s in subs:
            s.connect(relays[name].router_endpoint, relays[name].pub_endpoint)
    trainer = AdamWTrainer(mib, lr)
    model_bytes = mib * _MiB
    rows: list[dict[str, Any]] = []
    try:
        for version in range(1, versions + 2):
            worst = version == versions + 1
            t_step = time.perf_counter()
            model = trainer.step(worst_case=worst)
            step_s = time.perf_counter() - t_step
            t0 = time.perf_counter()
            await pub.publish(model, version, wait_ready=True)
            while pub._server.versions[version].delta_state == "pending":  # noqa: ASYNC110 - the delta has no event
                await asyncio.sleep(0.001)
            row: dict[str, Any] = {"version": version, "worst_case": worst, "step_s": round(step_s, 3),
                                   "publish_and_delta_s": round(time.perf_counter() - t0, 4)}
            d = pub._server.versions[version].delta
            row["delta_offered"] = d is not None
            if d is not None:
                row.update({"changed_fraction": round(d.changed_fraction, 6), "delta_wire_bytes": d.wire_bytes,
                            "delta_bytes_fraction": round(d.wire_bytes / model_bytes, 6), "bytes_by_encoding": d.bytes_by_encoding})
            order = ("full", "delta") if version % 2 else ("delta", "full")
            for name in order:
                relay = relays[name]
                before = relay.upstream_bytes
                cpu0, t0 = time.process_time(), time.perf_counter()
                await relay.follow_latest()
                while relay._server.versions[version].delta_state == "pending":  # noqa: ASYNC110 - a relay-made delta
                    await asyncio.sleep(0.001)
                row[f"relay_{name}_s"] = round(time.perf_counter() - t0, 4)
                row[f"relay_{name}_cpu_s"] = round(time.process_time() - cpu0, 4)
                row[f"relay_{name}_upstream_bytes"] = relay.upstream_bytes - before
            row["relay_delta_rebuilt"] = relays["delta"].delta_versions
            for name in order:
                subs = groups[name]
                before = sum(s.bytes_received for s in subs)
                cpu0, t0 = time.process_time(), time.perf_counter()
                got = await asyncio.gather(*(s.fetch(version) for s in subs))
                row[f"{name}_s"] = round(time.perf_counter() - t0, 4)
                row[f"{name}_cpu_s"] = round(time.process_time() - cpu0, 4)
                row[f"{name}_bytes"] = sum(s.bytes_received for s in subs) - before
                for w in got:
                    for k, t in model.items():
                        assert torch.equal(w.tensors[k].view(torch.int16), t.view(torch.int16)), f"{name} {k} differs"
                for s, w in zip(subs, got, strict=True):
                    s.recycle(w)
            for name in ("full", "delta"):  # the version from the publisher to the last subscriber of the node
                row[f"{name}_node_s"] = round(row[f"relay_{name}_s"] + row[f"{name}_s"], 4)
                row[f"{name}_node_cpu_s"] = round(row[f"relay_{name}_cpu_s"] + row[f"{name}_cpu_s"], 4)
                row[f"{name}_node_bytes"] = row[f"relay_{name}_upstream_bytes"] + row[f"{name}_bytes"]
            if version > 1 and row["full_bytes"]:
                row["bytes_ratio"] = round(row["delta_bytes"] / row["full_bytes"], 4)
                row["time_ratio"] = round(row["delta_s"] / row["full_s"], 4)
                row["cpu_ratio"] = round(row["delta_cpu_s"] / row["full_cpu_s"], 4) if row["full_cpu_s"] else None
                row["node_bytes_ratio"] = round(row["delta_node_bytes"] / row["full_node_bytes"], 4)
                row["node_time_ratio"] = round(row["delta_node_s"] / row["full_node_s"], 4)
                row["node_cpu_ratio"] = round(row["delta_node_cpu_s"] / row["full_node_cpu_s"], 4) if row["full_node_cpu_s"] else None
            rows.append(row)
            print(f"  [delta lr {lr:g} v{version}] {json.dumps(row)}", file=sys.stderr, flush=True)
    finally:
        for subs in groups.values():
            for s in subs:
                await s.aclose()
        for r in relays.values():
            await r.close()
        await pub.close()
        ctx.term()
    steady = [r for r in rows if r["version"] > 1 and not r["worst_case"]]
    worst = rows[-1]

    def med(key: str) -> float | None:
        xs = [r[key] for r in steady if r.get(key) is not None]
        return round(statistics.median(xs), 6) if xs else None

    keys = ("changed_fraction", "delta_bytes_fraction", "bytes_ratio", "time_ratio", "cpu_ratio", "node_bytes_ratio", "node_time_ratio",
            "node_cpu_ratio", "full_s", "delta_s", "full_cpu_s", "delta_cpu_s", "full_node_s", "delta_node_s", "full_node_cpu_s",
            "delta_node_cpu_s", "relay_full_s", "relay_delta_s", "relay_full_upstream_bytes", "relay_delta_upstream_bytes")
    return {"lr": lr, "mib": mib, "subscribers_per_group": n_subs, "steady_versions": len(steady), **{k: med(k) for k in keys},
            "relay_delta_rebuilt": worst.get("relay_delta_rebuilt"),
            "worst_case": {k: worst.get(k) for k in ("delta_offered", "full_s", "delta_s", "full_bytes", "delta_bytes", "time_ratio", "bytes_ratio",
                                                     "relay_full_upstream_bytes", "relay_delta_upstream_bytes", "node_time_ratio")},
            "rows": rows}


def delta_main(args: argparse.Namespace) -> int:
    out: dict[str, Any] = {
        "machine": {"python": platform.python_version(), "platform": platform.platform(), "cpus": mp.cpu_count()},
        "params": {"mib": args.delta_mib, "versions": args.delta_versions, "subscribers": args.peers, "chunk_mib": args.chunk_mib,
                   "setup": "one process: publisher (deltas on); a relay with deltas off and its 4 subscribers (full versions) beside "
                            "a relay with deltas on (the delta from upstream, rebuilt and verified, forwarded) and its 4 subscribers; "
                            "tcp loopback, network path",
                   "how": "python bench/weights.py --delta --delta-mib MIB --json PATH (CPU, the 2-core development box)"},
        "runs": [asyncio.run(delta_compare(args.delta_mib, lr, args.delta_versions, args.peers, args.chunk_mib * _MiB))
                 for lr in (1e-6, 1e-5)],
    }
    for r in out["runs"]:
        print(json.dumps({k: v for k, v in r.items() if k != "rows"}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", default="256,1024", help="version sizes in MiB, comma-separated (the headline keys are the largest, tcp)")
    ap.add_argument("--transports", default="tcp,ipc", help="comma-separated: tcp (loopback), ipc, shm (same-host shared memory; raw and gloo as ipc/tcp)")
    ap.add_argument("--chunk-mib", type=int, default=4)
    ap.add_argument("--bucket-mib", type=int, default=512)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fanout-mib", type=int, default=32)
    ap.add_argument("--fanout-subs", type=int, default=8)
    ap.add_argument("--peers", type=int, default=4, help="receivers for the gloo vs rollpool comparison")
    ap.add_argument("--no-gloo", action="store_true", help="skip the gloo peer (no torch.distributed)")
    ap.add_argument("--quick", action="store_true", help="64 MiB, fan-out 16 MiB (--mib given explicitly wins)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--delta", action="store_true", help="only the delta rows: delta vs full versions behind a relay, AdamW at lr 1e-6 and 1e-5")
    ap.add_argument("--delta-mib", type=int, default=64, help="model size of the delta rows")
    ap.add_argument("--delta-versions", type=int, default=5, help="versions of the delta rows (the first full, then steady; a worst case after)")
    args = ap.parse_args()
    if args.delta:
        return delta_main(args)
    if args.quick:
        if "--mib" not in sys.argv:
            args.mib = "64"
        args.fanout_mib = 16
    sizes = [int(x) for x in str(args.mib).split(",")]
    transports = [t.strip() for t in args.transports.split(",")]
    if any(t not in ("tcp", "ipc", "shm") for t in transports):
        ap.error("--transports takes tcp, ipc and/or shm")

    import tempfile

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rollpool-bench-") as tmpdir:
        for mib in sizes:
            for transport in transports:
                t0 = time.perf_counter()
                rows.append(run_set(mib, transport, args, tmpdir))
                print(f"  [{mib} MiB {transport}: {time.perf_counter() - t0:.0f} s] {json.dumps(rows[-1])}", file=sys.stderr, flush=True)

    from rollpool.weights.bucketing import checksum_supported, default_checksum_algorithm

    algo = default_checksum_algorithm()
    sums_s_per_gb = {a: round(checksum_s_per_gb(256 * _MiB, a), 4) for a in ("xxh3_64", "crc32") if checksum_supported(a)}
    fan = asyncio.run(fanout(args.fanout_mib, args.fanout_subs, args.chunk_mib * _MiB))

    tcp_rows = [r for r in rows if r["transport"] == "tcp"] or rows
    head = max(tcp_rows, key=lambda r: r["mib"])
    headline_keys = ("raw_zmq_gbps", "rollpool_gbps", "ratio_vs_raw", "gloo_4_s", "rollpool_4_s", "rollpool_4_mode", "vs_gloo",
                     "gloo_4_cpu_s", "rollpool_4_cpu_s",
                     "publish_snapshot_gbps", "publish_snapshot_reused_gbps", "rollpool_first_fetch_gbps")
    result: dict[str, Any] = {
        "machine": {"python": platform.python_version(), "platform": platform.platform(), "cpus": mp.cpu_count()},
        "params": {"peers": args.peers, "mib": sizes, "transports": transports, "chunk_mib": args.chunk_mib, "bucket_mib": args.bucket_mib,
                   "window_chunks": args.window, "reps": args.reps, "dtype": "bfloat16", "headline": f"{head['mib']} MiB {head['transport']}"},
    }
    for k in headline_keys:
        if k in head:
            result[k] = head[k]
            if k + "_spread" in head:
                result[k + "_spread"] = head[k + "_spread"]
    result.update({
        "checksum": algo,
        "checksum_s_per_gb": sums_s_per_gb[algo],
        "checksum_gbps": round(1 / sums_s_per_gb[algo], 2),
        "checksum_s_per_gb_by_algorithm": sums_s_per_gb,
        "rows": rows,
        "fanout": fan,
    })
    cols = ("raw_zmq_gbps", "rollpool_gbps", "ratio_vs_raw", "ratio_vs_raw_router", "gloo_4_s", "rollpool_4_direct_s", "rollpool_4_relay_s", "vs_gloo", "publish_snapshot_gbps", "publish_snapshot_reused_gbps")
    print(f"{'':14}" + "".join(f"{c[:22]:>24}" for c in cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            sp = r.get(c + "_spread")
            cells.append("-" if v is None else (f"{v} {sp[0]}..{sp[1]}" if sp else f"{v}"))
        print(f"{str(r['mib']) + ' MiB ' + r['transport']:14}" + "".join(f"{x:>24}" for x in cells))
    for a, spg in sums_s_per_gb.items():
        print(f"{a}: {spg} s per GB, one core")
    print(f"fan-out, {fan['subscribers']} subscribers, {fan['version_bytes'] / _MiB:.0f} MiB, one process: publisher served "
          f"{fan['direct']['publisher_served_x_version']}x the version direct ({fan['direct']['all_verified_s']} s) vs "
          f"{fan['relay']['publisher_served_x_version']}x behind one relay ({fan['relay']['all_verified_s']} s)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
            fh.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
