"""The same-GPU path on CPU, real sockets: the subscriber's hello (its GPUs) reaches the publisher, a manifest asked
with ``wait_ipc`` waits for the GPU checksums only, and a device buffer this process cannot use is a logged, counted
fallback to shared memory (never a failed version). The GPU half (a real export opened in another process, a
corrupted arena refused) is tests/gpu/test_cuda_ipc_gpu.py.

The publisher's device buffer is faked at the device edge (`_offer_fake_buffer`): no CUDA here.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from rollpool.protocol.errors import WeightSyncError  # noqa: E402
from rollpool.protocol.messages import CudaIpcBuffer  # noqa: E402
from rollpool.weights.gpu import arena_offsets  # noqa: E402
from rollpool.weights.memory import SHM_DIR  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"layers.{i}.w": torch.randn(128, 512, generator=g).to(torch.bfloat16) for i in range(3)}
    out["norm"] = torch.randn(512, generator=g)
    return out


def _offer_fake_buffer(pub: Any, version: int, uuid: str, *, checksums: bool = True) -> None:
    """Fake of the device edge: the served version names a device buffer (as `_ipc_begin` does on a GPU) with
    made-up handle bytes; with `checksums` every bucket's GPU checksum is published too."""
    served = pub._server.versions[version]
    offsets, total = arena_offsets([b.nbytes for b in served.buckets])
    served.cuda_ipc = CudaIpcBuffer(device_uuid=uuid, handle=b"\x01" * 64, storage_bytes=total, event_handle=bytes(64))
    served.buckets = tuple(replace(b, ipc_offset=offsets[b.index]) for b in served.buckets)
    if checksums:
        for b in served.buckets:
            pub._server.complete_ipc(version, b.index, "mix64:0000000000000001")


async def test_the_hello_tells_the_publisher_which_gpus_a_subscriber_on_its_host_sees(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher()
    await pub.publish(model(1), 1, wait_ready=True)
    near = make_subscriber(path="auto")
    near.ipc.gpus = {"GPU-near": 0}  # fake of the device edge: the GPUs this process would see
    near.connect(pub.router_endpoint)
    await near.fetch_manifest(1)
    far = make_subscriber(path="auto")
    far.ipc.gpus = {"GPU-far": 0}
    far.host_key = "another-boot/another-shm"
    far.connect(pub.router_endpoint)
    await far.fetch_manifest(1)
    assert pub._ipc.peers == {"GPU-near"}  # only a subscriber on this host makes `auto` export to its GPU
    # CPU tensors are never exported, whatever the path says
    assert pub._ipc.device_for(list(model(2).items())) is None


async def test_a_wait_ipc_manifest_waits_for_the_gpu_checksums_only(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher()
    await pub.publish(model(2), 1, wait_ready=True)
    _offer_fake_buffer(pub, 1, "GPU-x", checksums=False)
    sub = make_subscriber(pub.router_endpoint, path="auto")
    asked = asyncio.ensure_future(sub.fetch_manifest(1, wait_ipc=True))
    await asyncio.sleep(0.2)
    assert not asked.done()  # parked: the host checksums exist, the GPU ones do not yet
    served = pub._server.versions[1]
    for b in served.buckets:
        pub._server.complete_ipc(1, b.index, f"mix64:{b.index:016x}")
    m = await asyncio.wait_for(asked, 2)
    assert m.cuda_ipc is not None and [b.ipc_checksum for b in m.buckets] == [f"mix64:{i:016x}" for i in range(len(m.buckets))]
    # a version evicted while a request waits answers `gone`
    await pub.publish(model(3), 2, wait_ready=True)
    _offer_fake_buffer(pub, 2, "GPU-x", checksums=False)
    asked = asyncio.ensure_future(sub.fetch_manifest(2, wait_ipc=True))
    await asyncio.sleep(0.1)
    await pub.publish(model(4), 3, wait_ready=True)
    await pub.publish(model(5), 4, wait_ready=True)  # keep_versions=2: version 2 is evicted
    with pytest.raises(WeightSyncError, match="gone"):
        await asyncio.wait_for(asked, 2)


async def test_a_device_buffer_this_process_cannot_use_falls_back_to_shared_memory_counted(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher()
    w = model(6)
    await pub.publish(w, 1, wait_ready=True)
    _offer_fake_buffer(pub, 1, "GPU-x")
    # its GPU is not one this process sees
    blind = make_subscriber(path="auto")
    blind.ipc.gpus = {"GPU-other": 0}
    blind.connect(pub.router_endpoint)
    got = await blind.fetch(1)
    assert blind.last_path == "shm" and all(torch.equal(got.tensors[k], t) for k, t in w.items())
    assert blind.fallbacks == {"the publisher's GPU is not visible to this process": 1} and blind.ipc_bytes == 0
    # it sees the GPU, but the buffer cannot be opened (no CUDA here; a stale handle on a GPU host)
    sees = make_subscriber(path="cuda_ipc")
    sees.ipc.gpus = {"GPU-x": 0}
    sees.connect(pub.router_endpoint)
    got = await sees.fetch(1)
    assert sees.last_path == "shm" and all(torch.equal(got.tensors[k], t) for k, t in w.items())
    [(why, n)] = sees.fallbacks.items()
    assert why.startswith("cannot open the publisher's GPU buffer") and n == 1
    assert pub.bytes_served == 0  # no bucket byte crossed a socket on either fallback


async def test_an_arena_that_cannot_be_exported_leaves_the_host_path_serving(make_publisher: Any, make_subscriber: Any,
                                                                               monkeypatch: Any) -> None:
    pub = await make_publisher()
    # fake of the device edge: the publisher believes these (CPU) tensors are to be exported; export_buffer refuses
    monkeypatch.setattr(pub._ipc, "device_for", lambda items: torch.device("cpu"))
    w = model(7)
    m = await pub.publish(w, 1, wait_ready=True)
    assert m.cuda_ipc is None and pub._ipc.broken.startswith("ValueError") and pub._ipc.of_version == {}
    sub = make_subscriber(pub.router_endpoint, path="auto")
    got = await sub.fetch(1)
    assert sub.last_path == "shm" and all(torch.equal(got.tensors[k], t) for k, t in w.items())
    monkeypatch.undo()
    assert pub._ipc.device_for(list(w.items())) is None  # never offered again by this publisher


async def test_a_version_past_the_gpu_budget_gets_no_arena_and_the_publisher_says_why(make_publisher: Any, make_subscriber: Any,
                                                                                     monkeypatch: Any, caplog: Any) -> None:
    """A budget smaller than this version and than two of its buckets: no arena and no ring is made (nothing allocated,
    the path not broken), the host path serves it, and the publisher's log and `path_note` say which path it offers and
    why (a budget of two buckets streams it through the ring: tests/integration/weights/test_ipc_ring.py)."""
    from rollpool.weights.config import WeightPathConfig

    pub = await make_publisher(path="auto", weights=WeightPathConfig(publisher_gpu_budget_bytes=192 * 1024), bucket_bytes=128 * 1024)
    # fake of the device edge: the publisher believes these (CPU) tensors are to be exported to a same-GPU peer
    monkeypatch.setattr(pub._ipc, "device_for", lambda items: torch.device("cpu"))
    w = model(8)
    assert pub.gpu_budget.budget < 2 * pub.bucket_bytes < sum(t.numel() * t.element_size() for t in w.values())
    with caplog.at_level("INFO", logger="rollpool.weights"):
        m = await pub.publish(w, 1, wait_ready=True)
    assert m.cuda_ipc is None and not pub._ipc.broken and pub._ipc.slabs.allocations == 0 and pub.gpu_budget.used == 0
    note = pub.path_note
    assert note["offered"] == "host" and "would pass the publisher's GPU budget" in note["why_not_cuda_ipc"]
    assert "a same-GPU ring of 2 slots" in note["why_not_ring"] and not pub._ipc.ring.broken
    assert "host buckets only (no same-GPU buffer: a whole-version same-GPU arena" in caplog.text and "; no ring: " in caplog.text
    sub = make_subscriber(pub.router_endpoint, path="auto")
    got = await sub.fetch(1)
    assert sub.last_path == "shm" and all(torch.equal(got.tensors[k], t) for k, t in w.items())
