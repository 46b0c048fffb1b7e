"""The shared-memory path staged to the engine's GPU on a real GPU (marked gpu; skipped without one).

The publisher (this process, path ``shm``, CUDA tensors: each bucket's `host_mix64` summed on its GPU as it is copied)
and a subscriber in a child process (path ``auto``, ``stage_device="cuda:0"``, as a worker whose SGLang engine stages
to CUDA makes it): the subscriber maps the publisher's segments (registered once, at map time), copies each bucket
host-to-device into its own device buffer and verifies the mix64 of that copy on the GPU. Checked: every version
arrives over ``shm`` staged to the device with the tensors' bytes at publish time (an "optimizer step" changes them
right after ``publish`` returns), no bucket byte on a socket, no fallback, the segments registered; an unaligned
bucket (its mix64 summed on the CPU) too; a corrupted segment is restaged and then refused, never returned; restored,
the same version arrives whole.

Runs under pytest (sync) or directly: ``python tests/gpu/test_shm_device_gpu.py``.
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
    sub = WeightSubscriber(SocketFactory(ctx), worker_id="gpu-child", path="auto", fetch_timeout_s=20, max_refetch=1, stage_device="cuda:0")
    sub.connect(router)
    loop = asyncio.get_running_loop()
    held = []
    gaps = []

    async def ticker():  # how long the event loop stalls while segments are page-locked in the registering thread
        last = loop.time()
        while True:
            await asyncio.sleep(0.005)
            now = loop.time()
            gaps.append(now - last)
            last = now

    tick = asyncio.ensure_future(ticker())
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line.strip():
            break
        if line.strip() == "ahead":
            while sub.segments.ahead_thread is None:
                await asyncio.sleep(0.01)
            await loop.run_in_executor(None, sub.segments.ahead_thread.join)
            print(json.dumps({"ahead": sub.segments_registered_ahead, "maps": sub.segment_maps, "mapped": len(sub.segments.readers),
                              "registered": sum(1 for r in sub.segments.readers.values() if r.registered),
                              "max_loop_gap_s": round(max(gaps, default=0.0), 4)}), flush=True)
            continue
        v = int(line)
        try:
            wv = await sub.fetch(v)
            out = {"ok": True, "version": wv.version, "path": sub.last_path, "fallbacks": sub.fallbacks, "ipc_bytes": sub.ipc_bytes,
                   "bytes_received": sub.bytes_received, "shm_bytes": sub.shm_bytes, "device_stage_bytes": sub.device_stage_bytes,
                   "registered": sum(1 for r in sub.segments.readers.values() if r.registered), "mapped": len(sub.segments.readers),
                   "maps": sub.segment_maps,
                   "devices": sorted({str(t.device) for t in wv.tensors.values()}),
                   "sums": {k: mix64_checksum(flat_bytes(t).clone()) for k, t in wv.tensors.items()}}
            held.append(wv)
            if len(held) > 2:
                sub.recycle(held.pop(0))
        except Exception as exc:
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "refetched": sub.buckets_refetched}
        print(json.dumps(out), flush=True)
    tick.cancel()
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
    from rollpool.weights.gpu import mix64_checksum, mix64_reference
    from rollpool.weights.publisher import WeightPublisher
    from tests.integration.weights.segments import bucket_bytes, flip_byte

    ctx = zmq.asyncio.Context()
    pub = WeightPublisher(SocketFactory(ctx), router_endpoint="tcp://127.0.0.1:*", pub_endpoint=None, path="shm",
                          keep_versions=2, bucket_bytes=8 << 20, pool="gputest")
    await pub.start()
    g = torch.Generator(device="cuda").manual_seed(0)
    w = {f"layers.{i}.w": torch.randn(1024, 1536, device="cuda", generator=g).to(torch.bfloat16) for i in range(8)}
    w["norm"] = torch.randn(1531, device="cuda", generator=g)  # an odd size: an fp32 bucket whose bytes end mid-word
    w["odd.a"] = torch.randn(5, device="cuda", generator=g).to(torch.bfloat16)  # 10 bytes mid-bucket: that bucket is
    w["odd.b"] = torch.randn(3, device="cuda", generator=g).to(torch.bfloat16)  # not word aligned (its mix64 on the CPU)
    pub.reserve(w)  # the segments exist before the subscriber connects: named on its first manifest (minor 11)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", _CHILD, pub.router_endpoint, stdin=asyncio.subprocess.PIPE,
                                                 stdout=asyncio.subprocess.PIPE, env=env)
    assert child.stdin is not None and child.stdout is not None
    report: dict[str, Any] = {"versions": []}

    async def ask(v: int | str) -> dict[str, Any]:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(f"{v}\n".encode())
        await child.stdin.drain()
        line = await asyncio.wait_for(child.stdout.readline(), 120)
        return dict(json.loads(line))

    try:
        ahead = await ask("ahead")  # mapped and page-locked before the first version, in the child's registering thread
        report["ahead"] = ahead
        segments = len(pub._server.shm_reserved)
        assert ahead["ahead"] == ahead["mapped"] == ahead["registered"] == ahead["maps"] == segments > 0, (ahead, segments)
        for v in (1, 2, 3):
            want = {k: mix64_checksum(flat_bytes(t).clone()) for k, t in w.items()}
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            manifest = await pub.publish(w, v)
            blocked = time.perf_counter() - t0
            with torch.no_grad():
                for t in w.values():
                    t.add_(1.0)  # the optimizer step: the published version must not see it
            t1 = time.perf_counter()
            got = await ask(v)
            report["versions"].append({"version": v, "blocked_s": round(blocked, 4), "ask_s": round(time.perf_counter() - t1, 4),
                                       "gpu_mixed_at_return": sum(1 for b in manifest.buckets if b.host_mix64),
                                       **{k: got.get(k) for k in ("ok", "path", "fallbacks", "registered", "mapped")}})
            assert got["ok"], got
            assert got["path"] == "shm" and got["fallbacks"] == {}, got
            assert got["bytes_received"] == 0 and got["device_stage_bytes"] > 0 and got["devices"][0].startswith("cuda"), got
            assert got["registered"] == got["mapped"] > 0, got
            assert got["maps"] == segments, got  # no version mapped a segment: all were mapped ahead
            assert got["sums"] == want, "the bytes the engine gets differ from the tensors at publish time"
        assert pub.bytes_served == 0
        # the published mix64 is that of the host bucket bytes
        m = pub.manifest_of(3)
        assert m is not None
        for b in m.buckets:
            assert b.host_mix64 == mix64_reference(bucket_bytes(b.shm_segment, b.nbytes)), b.index
        # a corrupted segment: restaged, then refused (never returned); restored, the version arrives whole
        want = {k: mix64_checksum(flat_bytes(t).clone()) for k, t in w.items()}
        m4 = await pub.publish(w, 4, wait_ready=True)
        flip_byte(m4.buckets[0].shm_segment, 100)
        bad = await ask(4)
        report["corrupt"] = bad
        assert not bad["ok"] and "checksum" in bad["error"] and bad["refetched"] == 2, bad
        flip_byte(m4.buckets[0].shm_segment, 100)
        good = await ask(4)
        assert good["ok"] and good["path"] == "shm" and good["sums"] == want and good["fallbacks"] == {}, good
        report["restored"] = {k: good[k] for k in ("ok", "path")}
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


def test_the_shm_path_staged_to_the_gpu_end_to_end() -> None:
    if not _has_gpu():
        if pytest is not None:
            pytest.skip("needs an NVIDIA GPU")
        return
    report = asyncio.run(_run())
    print(json.dumps(report))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    out = asyncio.run(_run()) if _has_gpu() else {"skipped": "no GPU"}
    print("SHM_DEVICE_GPU_TEST " + json.dumps(out), flush=True)
