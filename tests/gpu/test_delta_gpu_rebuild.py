"""Delta versions rebuilt on the engine's GPU, on a real GPU (marked gpu; skipped without one).

A publisher (CUDA tensors, path ``network``, deltas made on its GPU) and a subscriber as a worker whose SGLang engine
stages to CUDA makes it (``stage_device="cuda:0"``, deltas on, `weight_delta_on_device` by default), in one process
over loopback tcp: the first version is fetched whole into page-locked host buffers and staged bucket by bucket into the
buffers the subscriber keeps on the GPU; each later version (a sparse step of the bf16 elements) comes as a delta whose
encoded bytes are copied to the GPU, decoded and scattered there in place, and every bucket verified there against the
manifest's mix64 of its resulting bytes (`rollpool.weights.delta_gpu`). Checked: every version's tensors are the
trainer's at publish time bit for bit and live on the GPU in the same buffers, the deltas were rebuilt there (none on
the host, no fallback); a corrupted device base ends in the version fetched whole and staged afresh, never a wrong
tensor; the next delta is rebuilt on the GPU again.

Runs under pytest (sync: no pytest-asyncio needed) or directly: ``python tests/gpu/test_delta_gpu_rebuild.py``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

try:
    import pytest

    pytestmark = pytest.mark.gpu
except ImportError:  # the device machine may run this file as a script without pytest
    pytest = None  # type: ignore[assignment]

ROOT = Path(__file__).resolve().parents[2]


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


async def _run() -> dict[str, Any]:
    import torch
    import zmq.asyncio

    from rollpool.protocol.sockets import SocketFactory
    from rollpool.weights.config import WeightPathConfig
    from rollpool.weights.publisher import WeightPublisher
    from rollpool.weights.subscriber import WeightSubscriber

    g = torch.Generator(device="cuda").manual_seed(0)
    model = {f"layers.{i}.w": (torch.randn(1024, 1024, generator=g, device="cuda") * 0.02).to(torch.bfloat16) for i in range(6)}
    model["norm.weight"] = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    ctx = zmq.asyncio.Context()
    sockets = SocketFactory(ctx)
    pub = WeightPublisher(sockets, router_endpoint="tcp://127.0.0.1:*", pub_endpoint="tcp://127.0.0.1:*", keep_versions=2,
                          bucket_bytes=4 << 20, chunk_bytes=1 << 20,
                          weights=WeightPathConfig(weight_path="network", weight_delta=True, publisher_gpu_budget_bytes=1 << 30))
    await pub.start()
    sub = WeightSubscriber(sockets, worker_id="gpu-delta", fetch_timeout_s=20, pin_memory=True, stage_device="cuda:0",
                           weights=WeightPathConfig(weight_path="network", weight_delta=True))
    sub.connect(pub.router_endpoint, pub.pub_endpoint)
    report: dict[str, Any] = {"versions": []}
    try:
        held = sub.delta.device
        assert held is not None and held.device.type == "cuda", "a CUDA subscriber with deltas on holds versions on its GPU"

        def step(v: int) -> dict[str, torch.Tensor]:
            gs = torch.Generator(device="cuda").manual_seed(v)
            for t in model.values():
                w = t.view(torch.int16).view(-1)
                w[torch.rand(w.shape, generator=gs, device="cuda") < 0.02] += 1 if v % 2 else -1
            return {k: t.clone() for k, t in model.items()}  # the bytes at publish time

        async def publish(v: int) -> dict[str, torch.Tensor]:
            want = step(v)
            await pub.publish(model, v, wait_ready=True)
            for _ in range(500):
                if pub._server.versions[v].delta_state != "pending":
                    break
                await asyncio.sleep(0.01)
            return want

        served = None
        slab = None
        for v in range(1, 6):
            want = await publish(v)
            wv = await sub.fetch(v)
            same = all(torch.equal(wv.tensors[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)
            on_gpu = all(t.is_cuda for t in wv.tensors.values())
            slab = slab if slab is not None else held.slab
            report["versions"].append({"version": v, "same": same, "on_gpu": on_gpu, "delta_base": wv.manifest.delta_base,
                                       "rebuilt_on": wv.details.get("delta_rebuilt_on"), "device_rebuild_s": wv.details.get("device_rebuild_s"),
                                       "in_place": held.slab is slab})
            assert same and on_gpu and held.slab is slab, report
            if v > 1:
                assert wv.manifest.delta_base == v - 1 and wv.details.get("delta_rebuilt_on") == "device", report
            if served is not None:
                sub.recycle(served)
            served = wv
        assert sub.delta_device_versions == 4 and sub.delta_fallbacks == 0, report
        # the device base is not what the worker thinks: the version comes whole, staged afresh, never wrong
        held.views[0][::4099] ^= 0x20
        want = await publish(6)
        wv = await sub.fetch(6)
        report["corrupt"] = {"delta_base": wv.manifest.delta_base, "fallbacks": sub.delta_fallbacks,
                             "same": all(torch.equal(wv.tensors[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)}
        assert report["corrupt"]["same"] and wv.manifest.delta_base == -1 and sub.delta_fallbacks == 1, report
        sub.recycle(served)
        want = await publish(7)
        wv7 = await sub.fetch(7)
        assert all(torch.equal(wv7.tensors[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want), report
        assert sub.delta_device_versions == 5, report
        report["ok"] = True
    finally:
        await sub.aclose()
        await pub.close()
        ctx.destroy(linger=0)
    return report


def test_delta_versions_are_rebuilt_and_verified_on_the_gpu() -> None:
    if not _has_gpu():
        if pytest is not None:
            pytest.skip("needs an NVIDIA GPU")
        return
    print(json.dumps(asyncio.run(_run())))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    out = asyncio.run(_run()) if _has_gpu() else {"skipped": "no GPU"}
    print("DELTA_GPU_REBUILD_TEST " + json.dumps(out), flush=True)
