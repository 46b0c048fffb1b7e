"""An adapter version from CUDA tensors to the hf engine's `LoraBank` on the GPU, as a worker receives it (marked gpu;
skipped without one).

The publisher (network path, the adapter's matrices on the GPU: its checksums folded as the device-to-host copies land)
and a subscriber made as a worker on a GPU makes it (``pin_memory=True``): every version arrives verified, in
page-locked receive buffers (so the bank's host-to-device copy runs at DMA speed), and the bank holds the matrices as
they were when ``publish`` returned (an "optimizer step" changes them right after).

Runs under pytest (sync: no pytest-asyncio needed) or directly: ``python tests/gpu/test_lora_receive_gpu.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

try:
    import pytest

    pytestmark = pytest.mark.gpu
except ImportError:  # the device machine may run this file as a script without pytest
    pytest = None  # type: ignore[assignment]


async def _run() -> dict[str, Any]:
    import torch
    import zmq.asyncio

    from rollpool.protocol.sockets import SocketFactory
    from rollpool.weights import snapshot
    from rollpool.weights.adapters import adapter_spec
    from rollpool.weights.publisher import WeightPublisher
    from rollpool.weights.subscriber import WeightSubscriber
    from rollpool.workers.engines.lora import LoraBank

    layers, hidden, mlp, rank = 8, 2048, 5632, 16  # 10 MB in bf16
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    io = {"q_proj": (hidden, hidden), "k_proj": (hidden, hidden), "v_proj": (hidden, hidden), "o_proj": (hidden, hidden),
          "gate_proj": (hidden, mlp), "up_proj": (hidden, mlp), "down_proj": (mlp, hidden)}
    with torch.device("meta"):
        model = torch.nn.Module()
        named: dict[str, torch.Tensor] = {}
        for i in range(layers):
            layer = torch.nn.Module()
            model.add_module(f"l{i}", layer)
            for m, (fin, fout) in io.items():
                layer.add_module(m, torch.nn.Linear(fin, fout, bias=False))
    g = torch.Generator(device="cuda").manual_seed(0)
    for i in range(layers):
        for m, (fin, fout) in io.items():
            named[f"base_model.model.l{i}.{m}.lora_A.weight"] = torch.randn(rank, fin, generator=g, device="cuda", dtype=torch.bfloat16)
            named[f"base_model.model.l{i}.{m}.lora_B.weight"] = torch.randn(fout, rank, generator=g, device="cuda", dtype=torch.bfloat16)
    spec = adapter_spec(rank, 2 * rank, targets, base_model="gpu-test")
    bank = LoraBank(model, resident=2)
    ctx = zmq.asyncio.Context()
    sockets = SocketFactory(ctx)
    pub = WeightPublisher(sockets, path="network", keep_versions=2, bucket_bytes=4 << 20)  # 3 buckets, each folded
    await pub.start()
    sub = WeightSubscriber(sockets, worker_id="gpu-lora", path="network", pin_memory=True)  # as WeightSync makes it on CUDA
    sub.connect(pub.router_endpoint, pub.pub_endpoint)
    out: dict[str, Any] = {"versions": []}
    folds = 0
    fold = snapshot.Snapshot._fold

    def counted(self: Any, idx: int, rng: Any) -> None:
        nonlocal folds
        folds += 1
        fold(self, idx, rng)

    snapshot.Snapshot._fold = counted  # type: ignore[method-assign]
    try:
        for v in (1, 2, 3):
            await pub.publish(named, v, adapter=spec)
            expected = {k: t.clone() for k, t in named.items()}
            for t in named.values():
                t.add_(1.0)  # the optimizer step right after publish returned
            wv = await sub.fetch(v)
            bank.add(v, wv.tensors, spec, dtype=torch.bfloat16, device="cuda")
            torch.cuda.synchronize()
            same = all(torch.equal(_held(bank.versions[v], k), t) for k, t in expected.items())
            out["versions"].append({"version": v, "pinned": all(b.is_pinned() for b in wv.buffers), "bank_equal": same,
                                    "buckets": len(wv.manifest.buckets), "folds": folds})
            sub.recycle(wv)
            bank.evict(())
    finally:
        snapshot.Snapshot._fold = fold  # type: ignore[method-assign]
        sub.close()
        await pub.close()
        ctx.term()
    return out


def _held(weights: dict[str, Any], name: str) -> Any:
    """The bank's copy of PEFT's matrix `name` (``base_model.model.<module>.lora_A.weight`` or ``lora_B``)."""
    module, _, which = name.removeprefix("base_model.model.").rpartition(".lora_")
    a, b, _scale = weights[module]
    return a if which.startswith("A") else b


def test_an_adapter_version_lands_page_locked_and_intact_in_the_bank() -> None:
    import torch

    if not torch.cuda.is_available():
        if pytest is not None:
            pytest.skip("needs a GPU")
        raise SystemExit("needs a GPU")
    got = asyncio.run(_run())
    print(got)
    for row in got["versions"]:
        assert row["buckets"] > 1, row
        assert row["pinned"], row
        assert row["bank_equal"], row
    assert got["versions"][-1]["folds"] >= 3 * len(got["versions"])  # each bucket's checksum folded as its copies landed


if __name__ == "__main__":
    test_an_adapter_version_lands_page_locked_and_intact_in_the_bank()
    print("ok")
