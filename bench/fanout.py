"""Weight fan-out over bandwidth-limited links: direct vs one relay per node.

Hosts are Linux network namespaces: ``rp-pub`` (the publisher) and
``rp-node0 .. rp-node{N-1}`` (``--workers-per-node`` subscribers each, plus a
relay in relay mode). Each namespace has one veth link into a bridge in the
root namespace, rate-limited in both directions by a tc token bucket
(``tbf``, ``--link-gbit`` Gbit/s): the link a real node has to its switch.
Inside a node the subscribers reach their relay over the namespace's own
loopback (not limited, as on a real host).

One version of ``--mib`` MiB of bf16 tensors is published with the real
`WeightPublisher`; every subscriber is a real `WeightSubscriber` that fetches
and verifies the whole version (a checksum per bucket: xxh3_64, or crc32 without xxhash) and reports when it holds
it; relays are real `Relay`s. Measured: seconds from the announce to the last
verified copy, (a) every subscriber straight from the publisher, (b) through
one relay per node. The bound the links set: the publisher's link carries
every copy it serves (direct: workers x version; relay: nodes x version), so
``bound = copies x version_bits / link_rate``.

Needs root and ``ip``/``tc``; where namespaces cannot be made it prints why
and exits 0 (``skipped`` in the JSON). Not simulated: real sockets, real
bytes, emulated links.

    sudo python bench/fanout.py [--nodes 4] [--workers-per-node 2] [--mib 256] [--link-gbit 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_MiB = 1024 * 1024
BRIDGE = "rpbr0"
PUB_PORT, ANN_PORT, RELAY_PORT, RELAY_ANN_PORT = 6600, 6601, 6700, 6701


# --------------------------------------------------------------------------- namespaces


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True)


def host_ip(i: int) -> str:
    return f"10.77.0.{10 + i}"


def can_make_namespaces() -> str | None:
    """None when namespaces, veth and tbf work here; else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found"
    r = sh("ip", "netns", "add", "rp-probe", check=False)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    sh("ip", "netns", "del", "rp-probe", check=False)
    return None


def setup(hosts: list[str], link_gbit: float) -> None:
    teardown(hosts)
    sh("ip", "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "link", "set", BRIDGE, "up")
    rate = f"{link_gbit * 1000:g}mbit"
    for i, h in enumerate(hosts):
        ns, inner, outer = f"rp-{h}", f"rpv{i}i", f"rpv{i}o"
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
        sh("ip", "link", "set", inner, "netns", ns)
        sh("ip", "link", "set", outer, "master", BRIDGE)
        sh("ip", "link", "set", outer, "up")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{host_ip(i)}/24", "dev", inner)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", inner, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        # both directions of the node's link: out of the namespace, and from the bridge into it
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", inner, "root", "tbf", "rate", rate, "burst", "1mb", "latency", "50ms")
        sh("tc", "qdisc", "add", "dev", outer, "root", "tbf", "rate", rate, "burst", "1mb", "latency", "50ms")


def teardown(hosts: list[str]) -> None:
    for h in hosts:
        sh("ip", "netns", "del", f"rp-{h}", check=False)
    sh("ip", "link", "del", BRIDGE, check=False)


# --------------------------------------------------------------------------- roles (run inside a namespace)


def _line(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def role_publisher(mib: int) -> None:
    import torch
    import zmq.asyncio

    from rollpool.protocol.sockets import SocketFactory
    from rollpool.weights.publisher import WeightPublisher

    ctx = zmq.asyncio.Context()
    pub = WeightPublisher(SocketFactory(ctx), router_endpoint=f"tcp://0.0.0.0:{PUB_PORT}", pub_endpoint=f"tcp://0.0.0.0:{ANN_PORT}",
                          keep_versions=1, bucket_bytes=64 * _MiB, path="network")  # network namespaces share /dev/shm: the hosts are simulated
    await pub.start()
    per = 16 * _MiB // 2
    g = torch.Generator().manual_seed(0)
    tensors = {f"layer{i}.weight": torch.randn(per, generator=g).to(torch.bfloat16) for i in range(mib // 16)}
    _line({"ready": True})
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.readline)  # "go"
    t_call = time.time()
    manifest = await pub.publish(tensors, 1)
    _line({"t_call": t_call, "t_announced": time.time(), "version_bytes": int(sum(b.nbytes for b in manifest.buckets))})
    await loop.run_in_executor(None, sys.stdin.readline)  # "stop"
    # the bulk lane's send threads tell the loop what they sent once each send call returns, which can come after the
    # subscriber verified those bytes: the count is read once it settled (0.3 s unchanged), not as "stop" arrives
    served, until = -1, time.time() + 5.0
    while time.time() < until and served != int(pub.bytes_served):
        served = int(pub.bytes_served)
        await asyncio.sleep(0.3)
    _line({"bytes_served": int(pub.bytes_served)})
    await pub.close()
    ctx.destroy(linger=0)


async def role_relay(upstream_ip: str) -> None:
    import zmq.asyncio

    from rollpool.protocol.sockets import SocketFactory
    from rollpool.weights.relay import Relay

    ctx = zmq.asyncio.Context()
    relay = Relay(SocketFactory(ctx), upstream_router=f"tcp://{upstream_ip}:{PUB_PORT}", upstream_pub=f"tcp://{upstream_ip}:{ANN_PORT}",
                  router_endpoint=f"tcp://127.0.0.1:{RELAY_PORT}", pub_endpoint=f"tcp://127.0.0.1:{RELAY_ANN_PORT}", path="network")
    await relay.start()
    task = asyncio.ensure_future(relay.run())
    _line({"ready": True})
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    relay.stop()
    await task
    ctx.destroy(linger=0)


async def role_subscribers(count: int, router: str, announce: str) -> None:
    import zmq.asyncio

    from rollpool.protocol.sockets import SocketFactory
    from rollpool.weights.subscriber import WeightSubscriber

    ctx = zmq.asyncio.Context()
    f = SocketFactory(ctx)
    subs = [WeightSubscriber(f, worker_id=f"{os.getpid()}-{i}", fetch_timeout_s=120, window_chunks=4, path="network") for i in range(count)]
    for s in subs:
        s.connect(router, announce)
    _line({"ready": True})

    async def one(s: WeightSubscriber) -> float:
        await s.wait_for_newer(0, timeout_s=300)
        wv = await s.fetch(1)
        assert int(wv.version) == 1
        return time.time()

    done = await asyncio.gather(*(one(s) for s in subs))
    _line({"done": done})
    for s in subs:
        await s.aclose()
    ctx.destroy(linger=0)


# --------------------------------------------------------------------------- driver (root namespace)


def spawn(ns: str, *role: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, __file__, *role],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def read_json(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"role process {proc.args} exited ({proc.wait()})")
    return dict(json.loads(line))


def say(proc: subprocess.Popen[str], text: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(text + "\n")
    proc.stdin.flush()


def one_run(mode: str, nodes: int, per_node: int, mib: int) -> dict[str, Any]:
    procs: list[subprocess.Popen[str]] = []
    try:
        pub = spawn("rp-pub", "--role", "publisher", "--mib", str(mib))
        procs.append(pub)
        read_json(pub)
        relays = []
        if mode == "relay":
            for n in range(nodes):
                r = spawn(f"rp-node{n}", "--role", "relay", "--upstream-ip", host_ip(0))
                procs.append(r)
                relays.append(r)
            for r in relays:
                read_json(r)
        subs = []
        for n in range(nodes):
            if mode == "relay":
                router, ann = f"tcp://127.0.0.1:{RELAY_PORT}", f"tcp://127.0.0.1:{RELAY_ANN_PORT}"
            else:
                router, ann = f"tcp://{host_ip(0)}:{PUB_PORT}", f"tcp://{host_ip(0)}:{ANN_PORT}"
            s = spawn(f"rp-node{n}", "--role", "subscribers", "--count", str(per_node), "--router", router, "--announce", ann)
            procs.append(s)
            subs.append(s)
        for s in subs:
            read_json(s)
        time.sleep(1.0)  # subscriptions settle (PUB/SUB joins are asynchronous)
        say(pub, "go")
        pubinfo = read_json(pub)
        done = [t for s in subs for t in read_json(s)["done"]]
        say(pub, "stop")
        served = read_json(pub)["bytes_served"]
        for r in relays:
            say(r, "stop")
        return {
            "all_verified_s": max(done) - pubinfo["t_announced"],
            "first_verified_s": min(done) - pubinfo["t_announced"],
            "publish_call_s": pubinfo["t_announced"] - pubinfo["t_call"],
            "version_bytes": pubinfo["version_bytes"],
            "publisher_bytes_served": served,
            "publisher_served_x_version": served / pubinfo["version_bytes"],
        }
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=("publisher", "relay", "subscribers"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--upstream-ip", default="", help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--router", default="", help=argparse.SUPPRESS)
    ap.add_argument("--announce", default="", help=argparse.SUPPRESS)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--workers-per-node", type=int, default=2)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--link-gbit", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="64 MiB")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.role == "publisher":
        asyncio.run(role_publisher(args.mib))
        return 0
    if args.role == "relay":
        asyncio.run(role_relay(args.upstream_ip))
        return 0
    if args.role == "subscribers":
        asyncio.run(role_subscribers(args.count, args.router, args.announce))
        return 0
    if args.quick:
        args.mib = 64
    out: dict[str, Any] = {"simulated": False, "emulated_links": True, "nodes": args.nodes, "workers_per_node": args.workers_per_node,
                           "mib": args.mib, "link_gbit": args.link_gbit, "host": platform.node(), "cpus": os.cpu_count()}
    why = can_make_namespaces()
    if why is not None:
        print(f"SKIPPED: network namespaces cannot be made here: {why}")
        out["skipped"] = why
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        return 0
    hosts = ["pub"] + [f"node{n}" for n in range(args.nodes)]
    workers = args.nodes * args.workers_per_node
    print(f"fan-out: 1 publisher host + {args.nodes} nodes x {args.workers_per_node} workers, every host link {args.link_gbit:g} Gbit/s "
          f"each way (tc tbf on veth), one version of {args.mib} MiB bf16, checksum-verified by every worker")
    setup(hosts, args.link_gbit)
    try:
        runs: dict[str, list[dict[str, Any]]] = {"direct": [], "relay": []}
        for _ in range(args.reps):
            for mode in ("direct", "relay"):
                runs[mode].append(one_run(mode, args.nodes, args.workers_per_node, args.mib))
    finally:
        teardown(hosts)
    vbits = runs["direct"][0]["version_bytes"] * 8
    link_bps = args.link_gbit * 1e9
    bound = {"direct": workers * vbits / link_bps, "relay": args.nodes * vbits / link_bps}
    print(f"{'path':<8}{'all verified s':>16}{'bound s':>9}{'bound/measured':>16}{'publisher served':>18}")
    for mode in ("direct", "relay"):
        ts = sorted(r["all_verified_s"] for r in runs[mode])
        med = ts[len(ts) // 2]
        out[mode] = {"runs": runs[mode], "all_verified_s": med, "bound_s": bound[mode], "of_bound": bound[mode] / med,
                     "publisher_served_x_version": runs[mode][-1]["publisher_served_x_version"]}
        print(f"{mode:<8}{med:>16.2f}{bound[mode]:>9.2f}{bound[mode] / med:>16.2f}{out[mode]['publisher_served_x_version']:>17.1f}x")
    out["relay_speedup"] = out["direct"]["all_verified_s"] / out["relay"]["all_verified_s"]
    print(f"relay speedup over direct: {out['relay_speedup']:.2f}x (bound {bound['direct'] / bound['relay']:.2f}x)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
