"""Deltas made on the trainer's device (`rollpool.weights.delta_device`) over real sockets: the same manifest, checksums
and served bytes as the host path's for the same versions, a subscriber rebuilds the trainer's tensors, and a budget
that does not allow the device base, or a device that fails, falls back to the host path with the reason said.

The device path's torch code runs on CPU tensors here (`delta_device.DEVICE_TYPES` extended to the CPU) and on CUDA
tensors where there is a GPU (the ``gpu`` variant)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from rollpool.weights import delta_device  # noqa: E402
from rollpool.weights.config import WeightPathConfig  # noqa: E402

pytestmark = pytest.mark.asyncio

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")])]


@pytest.fixture(autouse=True)
def _deltas_on_and_the_cpu_as_a_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLPOOL_WEIGHT_DELTA", "1")
    monkeypatch.setattr(delta_device, "DEVICE_TYPES", ("cuda", "cpu"))


def _model(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd = {f"layer{i}.w": torch.randn(256, 256, generator=g).to(torch.bfloat16) for i in range(3)}
    sd |= {"far": torch.randn(150_000, generator=g).to(torch.bfloat16), "norm": torch.randn(256, generator=g)}
    return {k: v.to(device) for k, v in sd.items()}


def _step_in_place(model: dict[str, torch.Tensor], seed: int) -> None:
    """What a trainer's optimizer step does right after publish returns: its tensors change in place (1% of each
    matrix's elements, two elements far apart, the norm whole)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.items():
            flat = t.view(-1)
            if name == "far":
                flat[[7, 7 + 140_000]] += 1
            elif name == "norm":
                flat += 1
            else:
                idx = torch.randperm(flat.numel(), generator=g)[: flat.numel() // 100].to(t.device)
                flat[idx] = (flat[idx].float() + 0.5).to(t.dtype)


async def _delta_made(pub: Any, version: int) -> Any:
    await pub.wait_ready(version)
    for _ in range(500):
        v = pub._server.versions[version]
        if v.delta_state != "pending":
            return v
        await asyncio.sleep(0.01)
    raise AssertionError(f"no delta for version {version}")


def _served_bytes(v: Any) -> list[bytes]:
    """A delta's encoded bytes as served, bucket by bucket."""
    d = v.delta
    return [bytes(src.read(0, b.nbytes)) for b, src in zip(d.payload.buckets, d.payload.sources, strict=True)]


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[n].view(torch.uint8), want[n].cpu().view(torch.uint8)) for n in want)


@pytest.mark.parametrize("device", DEVICES)
async def test_a_device_made_delta_serves_the_host_paths_bytes_and_the_trainers_tensors(device: str, make_publisher: Any,
                                                                                         make_subscriber: Any) -> None:
    """One trainer, two publishers: one whose GPU budget holds the device base (the delta found on the tensors' device),
    one whose default budget (two buckets) does not (the host path, the reason said). Every version's manifests, the
    delta's encodings, checksums and served bytes are the same; the trainer's tensors change in place right after each
    publish returns, and a subscriber of the device publisher still rebuilds each version as published."""
    on_host = await make_publisher()
    on_device = await make_publisher(weights=dataclasses.replace(WeightPathConfig.from_env(), publisher_gpu_budget_bytes=1 << 30))
    sub = make_subscriber(on_device.router_endpoint, on_device.pub_endpoint)
    model = _model(device)
    for version in range(1, 5):
        want = {k: t.clone() for k, t in model.items()}
        await on_host.publish(model, version, wait_ready=True)
        await on_device.publish(model, version)
        _step_in_place(model, version)  # the trainer goes on at once
        v_dev, v_host = await _delta_made(on_device, version), await _delta_made(on_host, version)
        assert [_key(b) for b in v_dev.buckets] == [_key(b) for b in v_host.buckets]  # the full version's checksums
        if version > 1:
            assert v_dev.delta is not None and v_host.delta is not None
            # the encodings, encoded sizes and checksums, and the checksums of the resulting bytes
            assert [_key(b) for b in v_dev.delta.buckets] == [_key(b) for b in v_host.delta.buckets]
            assert _served_bytes(v_dev) == _served_bytes(v_host)
            assert {b.encoding for b in v_dev.delta.buckets} >= {"gaps", "sparse", "whole"}
        wv = await sub.fetch(version)
        assert _same(wv.tensors, want)
        assert wv.manifest.delta_base == (version - 1 if version > 1 else -1)
        sub.recycle(wv)
    assert on_device.path_note["delta_made_on"] == "device" and on_device.path_note["why_not_delta_on_device"] == ""
    assert on_device.path_note["delta_compared_by"] == ("kernels" if device == "cuda" else "torch ops (not a CUDA device)")
    assert on_host.path_note["delta_made_on"] == "host" and on_host.path_note["delta_compared_by"] == ""
    assert "publisher_gpu_budget_bytes" in on_host.path_note["why_not_delta_on_device"]
    assert on_device.stats["delta_device_versions"] == 3 and on_host.stats["delta_device_versions"] == 0
    assert sub.delta_versions == 3 and sub.delta_fallbacks == 0
    assert on_device.gpu_budget.used == delta_device.DeviceBase.need_bytes(on_device._server.versions[4].buckets)
    assert on_host.gpu_budget.used == 0
    on_device.config = dataclasses.replace(on_device.config, weight_delta=False)  # deltas turned off: the base goes back
    await on_device.publish(model, 5, wait_ready=True)
    assert on_device.gpu_budget.used == 0 and on_device.path_note["delta_made_on"] == ""


def _key(b: Any) -> tuple[Any, ...]:
    """What a bucket's manifest entry says of its bytes (not where this publisher keeps them: its segment's name)."""
    return (b.index, b.dtype, b.nbytes, b.checksum, b.tensors, b.encoding, b.delta_nbytes, b.delta_checksum)


async def test_a_device_that_fails_leaves_the_host_path_with_the_reason_said(make_publisher: Any, make_subscriber: Any,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A diff that raises part way (the base half written): the trainer's tensors, unchanged, are copied as on the host
    path, the delta is made there, the device is not tried again, and `path_note` says why."""
    pub = await make_publisher(weights=dataclasses.replace(WeightPathConfig.from_env(), publisher_gpu_budget_bytes=1 << 30))
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint)
    model = _model("cpu")
    real = delta_device.DeviceBase.diff
    calls = []

    def failing(self: Any, version: int, *a: Any, **kw: Any) -> Any:
        calls.append(version)
        if version == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(self, version, *a, **kw)

    monkeypatch.setattr(delta_device.DeviceBase, "diff", failing)
    for version in (1, 2, 3):
        want = {k: t.clone() for k, t in model.items()}
        await pub.publish(model, version)
        _step_in_place(model, version)
        v = await _delta_made(pub, version)
        wv = await sub.fetch(version)
        assert _same(wv.tensors, want)
        if version > 1:
            assert v.delta is not None and wv.manifest.delta_base == version - 1  # made on the host
        sub.recycle(wv)
    assert calls == [1, 2]
    assert pub.path_note["delta_made_on"] == "host" and "illegal memory access" in pub.path_note["why_not_delta_on_device"]
    assert pub.stats["delta_device_versions"] == 0 and pub.gpu_budget.used == 0
