"""The same-GPU weight path on a real GPU (marked gpu; skipped without one): the whole-version arena, and the ring a
version larger than the publisher's GPU budget streams through (`test_the_same_gpu_ring_end_to_end`).

The publisher (this process, path ``cuda_ipc``, CUDA tensors) and a subscriber in a child process (path ``auto``,
as a worker runs it): the subscriber opens the publisher's exported arena, copies device-to-device into its own
device buffers and verifies the GPU checksum of its copy. Checked: every version arrives over ``cuda_ipc`` with
the tensors' bytes at publish time (an "optimizer step" changes them right after ``publish`` returns), no
bucket byte on a socket, no fallback; a corrupted arena is refetched and then refused, never returned; restored,
the same version arrives whole.

Runs under pytest (sync: no pytest-asyncio needed) or directly: ``python tests/gpu/test_cuda_ipc_gpu.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

try:
    import pytest

    pytestmark = pytest.mark.gpu
except ImportError:  # the device machine may run this file as a script without pytest
    pytest = None  # type: ignore[assignment]

ROOT = Path(__file__).resolve().parents[2]

_CHILD = r"""
import asyncio, json, sys
import torch, zmq.asyncio
from rollpool.protocol.sockets import SocketFactory
from rollpool.weights.subscriber import WeightSubscriber
from rollpool.weights.gpu import mix64_checksum
from rollpool.weights.bucketing import flat_bytes

async def main(router):
    ctx = zmq.asyncio.Context()
    sub = WeightSubscriber(SocketFactory(ctx), worker_id="gpu-child", path="auto", fetch_timeout_s=20, max_refetch=1)
    sub.connect(router)
    loop = asyncio.get_running_loop()
    held = []
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line.strip():
            break
        v = int(line)
        try:
            wv = await sub.fetch(v)
            out = {"ok": True, "version": wv.version, "path": sub.last_path, "fallbacks": sub.fallbacks, "ipc_bytes": sub.ipc_bytes,
                   "bytes_received": sub.bytes_received, "shm_bytes": sub.shm_bytes,
                   "devices": sorted({str(t.device) for t in wv.tensors.values()}),
                   "sums": {k: mix64_checksum(flat_bytes(t).clone()) for k, t in wv.tensors.items()}}
            held.append(wv)
            if len(held) > 2:
                sub.recycle(held.pop(0))
        except Exception as exc:
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "refetched": sub.buckets_refetched}
        print(json.dumps(out), flush=True)
    sub.close()
    ctx.destroy(linger=0)

asyncio.run(main(sys.argv[1]))
"""


def _has_gpu() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


async def _run() -> dict[str, Any]:
    import torch
    import zmq.asyncio

    from rollpool.protocol.sockets import SocketFactory
    from rollpool.weights.bucketing import flat_bytes
    from rollpool.weights.gpu import mix64_checksum
    from rollpool.weights.publisher import WeightPublisher

    ctx = zmq.asyncio.Context()
    from rollpool.weights.config import WeightPathConfig

    # a budget that holds two whole-version arenas (2 x 24 MiB): the default (two 8 MiB buckets) would take the ring
    pub = WeightPublisher(SocketFactory(ctx), router_endpoint="tcp://127.0.0.1:*", pub_endpoint=None, path="cuda_ipc",
                          keep_versions=2, bucket_bytes=8 << 20, pool="gputest",
                          weights=WeightPathConfig(publisher_gpu_budget_bytes=256 << 20))
    await pub.start()
    g = torch.Generator(device="cuda").manual_seed(0)
    w = {f"layers.{i}.w": torch.randn(1024, 1536, device="cuda", generator=g).to(torch.bfloat16) for i in range(8)}
    w["norm"] = torch.randn(1531, device="cuda", generator=g)  # an odd size: an fp32 bucket whose bytes end mid-word
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", _CHILD, pub.router_endpoint, stdin=asyncio.subprocess.PIPE,
                                                 stdout=asyncio.subprocess.PIPE, env=env)
    assert child.stdin is not None and child.stdout is not None
    report: dict[str, Any] = {"versions": []}

    async def ask(v: int) -> dict[str, Any]:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(f"{v}\n".encode())
        await child.stdin.drain()
        line = await asyncio.wait_for(child.stdout.readline(), 120)
        return dict(json.loads(line))

    try:
        for v in (1, 2, 3):
            want = {k: mix64_checksum(flat_bytes(t).clone()) for k, t in w.items()}
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            await pub.publish(w, v)
            blocked = time.perf_counter() - t0
            with torch.no_grad():
                for t in w.values():
                    t.add_(1.0)  # the optimizer step: the published version must not see it
            got = await ask(v)
            report["versions"].append({"version": v, "blocked_s": round(blocked, 4), **{k: got.get(k) for k in ("ok", "path", "fallbacks")}})
            assert got["ok"], got
            assert got["path"] == "cuda_ipc" and got["fallbacks"] == {}, got
            assert got["bytes_received"] == 0 and got["shm_bytes"] == 0 and got["devices"][0].startswith("cuda"), got
            assert got["sums"] == want, "the bytes the engine gets differ from the tensors at publish time"
        assert pub.stats["ipc_versions"] == 3 and pub.bytes_served == 0
        # a corrupted arena: refetched, then refused (never returned); restored, the version arrives whole
        want = {k: mix64_checksum(flat_bytes(t).clone()) for k, t in w.items()}
        await pub.publish(w, 4, wait_ready=True)
        arena = pub._ipc.of_version[4]
        arena[100] = arena[100] ^ 0x5A
        torch.cuda.synchronize()
        bad = await ask(4)
        report["corrupt"] = bad
        assert not bad["ok"] and "checksum" in bad["error"] and bad["refetched"] == 2, bad
        arena[100] = arena[100] ^ 0x5A
        torch.cuda.synchronize()
        good = await ask(4)
        assert good["ok"] and good["path"] == "cuda_ipc" and good["sums"] == want, good
        report["restored"] = {k: good[k] for k in ("ok", "path")}
        report["arenas"] = pub.stats["ipc_arenas"]
        assert pub.stats["ipc_arenas"] == 2  # keep_versions arenas, reused
    finally:
        if child.stdin is not None:
            child.stdin.write(b"\n")
            with _suppress():
                await child.stdin.drain()
        try:
            await asyncio.wait_for(child.wait(), 30)
        except TimeoutError:
            child.kill()
        await pub.close()
        ctx.destroy(linger=0)
    return report


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return True


_RING_CHILD = r"""
import asyncio, json, sys
import torch, zmq.asyncio
from rollpool.protocol.sockets import SocketFactory
from rollpool.weights.subscriber import WeightSubscriber
from rollpool.weights.gpu import mix64_checksum
from rollpool.weights.bucketing import flat_bytes

async def main(router, pub):
    ctx = zmq.asyncio.Context()
    sub = WeightSubscriber(SocketFactory(ctx), worker_id="gpu-ring-child", path="auto", fetch_timeout_s=20, max_refetch=1)
    sub.connect(router, pub)
    await sub.fetch_manifest()  # the hello (CUDA initialised, the GPUs named) before the first version
    print(json.dumps({"ready": True}), flush=True)
    loop = asyncio.get_running_loop()
    held = []
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line.strip():
            break
        v = int(line)
        try:
            await sub.wait_for_newer(v - 1, timeout_s=60)  # as a worker: the announce, then the fetch
            wv = await sub.fetch(v)
            out = {"ok": True, "version": wv.version, "path": sub.last_path, "fallbacks": sub.fallbacks, "ipc_bytes": sub.ipc_bytes,
                   "bytes_received": sub.bytes_received, "shm_bytes": sub.shm_bytes,
                   "devices": sorted({str(t.device) for t in wv.tensors.values()}),
                   "sums": {k: mix64_checksum(flat_bytes(t).clone()) for k, t in wv.tensors.items()}}
            held.append(wv)
            if len(held) > 2:
                sub.recycle(held.pop(0))
        except Exception as exc:
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "refetched": sub.buckets_refetched}
        print(json.dumps(out), flush=True)
    sub.close()
    ctx.destroy(linger=0)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def _run_ring() -> dict[str, Any]:
    """A model three times the publisher's GPU budget (two 8 MiB buckets) through the ring: every byte, the budget's
    peak, the path taken."""
    import torch
    import zmq.asyncio

    from rollpool.protocol.sockets import SocketFactory
    from rollpool.weights.bucketing import flat_bytes
    from rollpool.weights.gpu import mix64_checksum
    from rollpool.weights.publisher import WeightPublisher

    ctx = zmq.asyncio.Context()
    pub = WeightPublisher(SocketFactory(ctx), router_endpoint="tcp://127.0.0.1:*", pub_endpoint="tcp://127.0.0.1:*", path="cuda_ipc",
                          keep_versions=2, bucket_bytes=8 << 20, pool="gpuring")
    await pub.start()
    g = torch.Generator(device="cuda").manual_seed(1)
    w = {f"layers.{i}.w": torch.randn(1024, 1536, device="cuda", generator=g).to(torch.bfloat16) for i in range(16)}
    w["norm"] = torch.randn(1531, device="cuda", generator=g)
    model_bytes = sum(t.numel() * t.element_size() for t in w.values())
    from rollpool.weights.manifest import ring_scratch_bytes

    # the default budget: two buckets and the ring's checksum scratch; no whole-version arena fits
    assert model_bytes > pub.gpu_budget.budget == 2 * pub.bucket_bytes + ring_scratch_bytes(pub.bucket_bytes)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", _RING_CHILD, pub.router_endpoint, str(pub.pub_endpoint),
                                                 stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
    assert child.stdin is not None and child.stdout is not None
    report: dict[str, Any] = {"model_bytes": model_bytes, "budget_bytes": pub.gpu_budget.budget, "versions": []}
    ready = json.loads(await asyncio.wait_for(child.stdout.readline(), 120))  # its imports and CUDA start are done
    assert ready == {"ready": True}, ready
    pub._ipc.ring.claim_timeout_s = 5.0  # the child claims on the announce; slack for a loaded machine, not the point here

    async def ask(v: int) -> dict[str, Any]:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(f"{v}\n".encode())
        await child.stdin.drain()
        line = await asyncio.wait_for(child.stdout.readline(), 120)
        return dict(json.loads(line))

    try:
        for v in (1, 2, 3, 4):
            want = {k: mix64_checksum(flat_bytes(t).clone()) for k, t in w.items()}
            torch.cuda.synchronize()
            fetching = asyncio.ensure_future(ask(v))  # the child waits for the announce, then fetches while we publish
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            await pub.publish(w, v)
            blocked = time.perf_counter() - t0
            with torch.no_grad():
                for t in w.values():
                    t.add_(1.0)  # the optimizer step: the published version must not see it
            got = await fetching
            await pub.wait_ready(v)
            extra = torch.cuda.max_memory_allocated() - before
            report["versions"].append({"version": v, "blocked_s": round(blocked, 4), "extra_gpu_bytes": int(extra),
                                       **{k: got.get(k) for k in ("ok", "path", "fallbacks")}, "offered": pub.path_note.get("offered")})
            assert got["ok"], got
            assert got["path"] == "cuda_ipc_ring" and got["fallbacks"] == {}, got
            assert got["bytes_received"] == 0 and got["shm_bytes"] == 0 and got["devices"][0].startswith("cuda"), got
            assert got["sums"] == want, "the bytes the engine gets differ from the tensors at publish time"
        stats = pub.stats
        report["stats"] = {k: stats[k] for k in ("ipc_ring_versions", "ipc_ring_abandoned", "ipc_ring_bytes", "ipc_arenas",
                                                 "gpu_budget_bytes", "gpu_budget_used_bytes")}
        report["budget_peak_bytes"] = pub.gpu_budget.peak
        report["last_ring"] = pub.path_note.get("last_ring")
        assert stats["ipc_ring_versions"] == 4 and stats["ipc_arenas"] == 0 and stats["ipc_ring_abandoned"] == 0, stats
        assert pub.gpu_budget.peak <= stats["ipc_ring_bytes"] <= pub.gpu_budget.budget, report
        # what the trainer's GPU really gave the publish, checksum temporaries included, within the budget
        assert max(r["extra_gpu_bytes"] for r in report["versions"]) <= pub.gpu_budget.budget, report
        assert pub.bytes_served == 0  # the only subscriber took the ring: no bucket byte on a socket
        # keep_versions=0: the ring alone, no host copy; publish returns once the child copied every bucket out
        pub.keep_versions = 0
        report["ring_only"] = []
        for v in (5, 6):
            want = {k: mix64_checksum(flat_bytes(t).clone()) for k, t in w.items()}
            torch.cuda.synchronize()
            fetching = asyncio.ensure_future(ask(v))
            t0 = time.perf_counter()
            await pub.publish(w, v)
            blocked = time.perf_counter() - t0
            with torch.no_grad():
                for t in w.values():
                    t.add_(1.0)
            got = await fetching
            report["ring_only"].append({"version": v, "blocked_s": round(blocked, 4), **{k: got.get(k) for k in ("ok", "path", "fallbacks")}})
            assert got["ok"] and got["path"] == "cuda_ipc_ring" and got["fallbacks"] == {}, got
            assert got["sums"] == want, "the bytes the engine gets differ from the tensors at publish time"
        assert pub.bytes_served == 0 and pub.stats["ipc_ring_versions"] == 6
    finally:
        if child.stdin is not None:
            child.stdin.write(b"\n")
            with _suppress():
                await child.stdin.drain()
        try:
            await asyncio.wait_for(child.wait(), 30)
        except TimeoutError:
            child.kill()
        await pub.close()
        ctx.destroy(linger=0)
    return report


def test_the_same_gpu_ring_end_to_end() -> None:
    if not _has_gpu():
        if pytest is not None:
            pytest.skip("needs an NVIDIA GPU")
        return
    report = asyncio.run(_run_ring())
    print(json.dumps(report))


def test_the_same_gpu_path_end_to_end() -> None:
    if not _has_gpu():
        if pytest is not None:
            pytest.skip("needs an NVIDIA GPU")
        return
    report = asyncio.run(_run())
    print(json.dumps(report))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    out = asyncio.run(_run()) if _has_gpu() else {"skipped": "no GPU"}
    print("CUDA_IPC_GPU_TEST " + json.dumps(out), flush=True)
    ring = asyncio.run(_run_ring()) if _has_gpu() else {"skipped": "no GPU"}
    print("CUDA_IPC_RING_GPU_TEST " + json.dumps(ring), flush=True)
