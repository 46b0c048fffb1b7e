"""What the delta tests share: a small model, an optimizer-like step of it, a bit-for-bit comparison, a publish that waits
for the delta (the fixtures they share are in conftest.py: `sub_path`, `deltas_made_on_the_device`)."""

from __future__ import annotations

import asyncio
from typing import Any

import torch


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.w": torch.randn(256, 256, generator=g).to(torch.bfloat16) for i in range(3)} | {
        "norm": torch.randn(256, generator=g)}


def step(weights: dict[str, torch.Tensor], seed: int, frac: float = 0.01) -> dict[str, torch.Tensor]:
    """A version where `frac` of each tensor's elements changed."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        t = t.clone()
        flat = t.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: max(1, int(flat.numel() * frac))]
        flat[idx] = (flat[idx].float() + 0.5).to(t.dtype)
        out[name] = t
    return out


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[n].view(torch.uint8), want[n].contiguous().view(torch.uint8)) for n in want)


async def published(pub: Any, weights: dict[str, torch.Tensor], version: int) -> None:
    """Publish and wait until the server has made (or given up) the version's delta: the delta follows the checksums."""
    await pub.publish(weights, version, wait_ready=True)
    for _ in range(500):
        if pub._server.versions[version].delta_state != "pending":
            return
        await asyncio.sleep(0.01)
