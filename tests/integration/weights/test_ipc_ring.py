"""The same-GPU ring on CPU, through real ZeroMQ sockets between a real publisher and real subscribers (protocol minor
22, `RING_MINOR`): a version larger than the publisher's GPU budget streams through two bucket-sized slots, one
subscriber takes it, the others and every failure take the host path, counted, and nothing is lost.

The device edge is faked (`FakeRingDevice`): the slots are a plain CPU tensor "exported" under a made-up handle that
the subscriber's fake opens in this process; the copies are CPU copies and the checksum is the very `mix64` the GPU
runs. The GPU half is tests/gpu/test_cuda_ipc_gpu.py (`test_the_same_gpu_ring_end_to_end`).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import msgpack  # noqa: E402

from rollpool.protocol import RING_MINOR, decode, encode  # noqa: E402
from rollpool.protocol.messages import CudaIpcBuffer, Manifest, ManifestRequest  # noqa: E402
from rollpool.weights.gpu import mix64_checksum  # noqa: E402
from rollpool.weights.manifest import ring_scratch_bytes  # noqa: E402
from rollpool.weights.memory import SHM_DIR  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")

GPU = "GPU-fake-ring"


class FakeRingDevice:
    """Fake of the ring's device edge (`rollpool.weights.paths.ipc_ring.RingDevice`): CPU tensors for slots, exported
    under a made-up handle looked up in this process; `bad_copies` makes a subscriber's copy of those buckets' slots
    come out wrong (one entry per bad copy)."""

    exported: dict[bytes, torch.Tensor] = {}

    def __init__(self, bad_copies: list[int] | None = None) -> None:
        self.bad_copies = list(bad_copies or [])
        self.fills = 0
        self.copies = 0

    def accepts(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def uuids(self, device: torch.device) -> set[str]:
        return {GPU}

    def allocate(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8)

    def export(self, buf: torch.Tensor) -> CudaIpcBuffer:
        handle = uuid.uuid4().bytes * 4
        FakeRingDevice.exported[handle] = buf
        return CudaIpcBuffer(device_uuid=GPU, handle=handle, storage_bytes=int(buf.numel()))

    def open(self, info: CudaIpcBuffer, device_index: int) -> torch.Tensor:
        return FakeRingDevice.exported[info.handle]

    def mark(self, device: torch.device) -> Any:
        return None

    def fill(self, slot: torch.Tensor, pieces: list[tuple[int, torch.Tensor]], after: Any) -> str:
        from rollpool.weights.bucketing import flat_bytes

        self.fills += 1
        for off, t in pieces:
            src = flat_bytes(t)
            slot[off : off + int(src.numel())].copy_(src)
        return mix64_checksum(slot)

    def copy_out(self, src: torch.Tensor, dst: torch.Tensor) -> str:
        self.copies += 1
        dst.copy_(src)
        if self.bad_copies and self.bad_copies[0] == self.copies:
            self.bad_copies.pop(0)
            dst[0] ^= 0x5A  # torn on the way
        return mix64_checksum(dst)


def model(seed: int) -> dict[str, torch.Tensor]:
    """Six 256 KiB buckets of bf16 (two tensors each) and a small fp32 one: 1.5 MiB, three times the default budget
    of two 256 KiB buckets."""
    g = torch.Generator().manual_seed(seed)
    out = {f"layers.{i}.w": torch.randn(256, 256, generator=g).to(torch.bfloat16) for i in range(12)}
    out["norm"] = torch.randn(1531, generator=g)
    return out


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k].cpu().view(torch.uint8), want[k].view(torch.uint8)) for k in want)


async def ring_publisher(make_publisher: Any, **kw: Any) -> Any:
    kw.setdefault("path", "auto")
    pub = await make_publisher(**kw)
    pub._ipc.ring.device = FakeRingDevice()  # fake of the device edge: the trainer's "GPU" is the CPU here
    # generous on a loaded CI box (a test that wants a time-out sets its own): the claim follows the announce
    pub._ipc.ring.claim_timeout_s = pub._ipc.ring.release_timeout_s = 20.0
    return pub


def ring_subscriber(make_subscriber: Any, pub: Any, device: FakeRingDevice | None = None, **kw: Any) -> Any:
    kw.setdefault("path", "auto")
    sub = make_subscriber(**kw)
    sub.ipc.gpus = {GPU: 0}  # fake of the device edge: the GPU this process would see
    sub.ipc.ring.device = device or FakeRingDevice()
    sub.connect(pub.router_endpoint, pub.pub_endpoint)
    return sub


async def publish_while_fetching(pub: Any, subs: list[Any], w: dict[str, torch.Tensor], v: int) -> tuple[dict[str, torch.Tensor], list[Any]]:
    """Publish `w` as `v` while `subs` fetch it (as workers do on the announce), then change `w` at once (the optimizer
    step); the bytes at publish time and each subscriber's outcome (a version or an exception)."""
    want = {k: t.clone() for k, t in w.items()}

    async def one(sub: Any) -> Any:
        await sub.wait_for_newer(v - 1, timeout_s=10)
        return await sub.fetch(v)

    fetches = [asyncio.ensure_future(one(s)) for s in subs]
    await pub.publish(w, v)
    with torch.no_grad():
        for t in w.values():
            t.add_(1.0)  # the trainer steps once publish returned: the version must not see it
    return want, list(await asyncio.gather(*fetches, return_exceptions=True))


async def test_a_version_past_the_budget_streams_through_two_slots_and_arrives_whole(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await ring_publisher(make_publisher, pool="tring1")
    sub = ring_subscriber(make_subscriber, pub)
    await sub.fetch_manifest()  # its hello: a subscriber on this host sees the trainer's GPU
    w = model(1)
    for v in (1, 2, 3):
        want, (got,) = await publish_while_fetching(pub, [sub], w, v)
        assert not isinstance(got, BaseException), got
        assert same(got.tensors, want), "the bytes the engine gets differ from the tensors at publish time"
        assert sub.last_path == "cuda_ipc_ring" and sub.fallbacks == {}
        note = pub.path_note
        assert note["offered"] == "cuda_ipc_ring" and "budget" in note["why_not_cuda_ipc"] and note["why_not_ring"] == ""
        sub.recycle(got)
    total = sum(b.nbytes for b in pub.manifest_of(3).buckets)
    assert sub.bytes_received == 0 and sub.shm_bytes == 0 and sub.ipc_bytes == 3 * total  # no bucket byte on a socket
    stats = pub.stats
    assert stats["ipc_ring_versions"] == 3 and stats["ipc_arenas"] == 0 and stats["ipc_ring_abandoned"] == 0
    # the ring is 2 slots of the largest bucket and their checksum's scratch, within the default budget (two buckets and
    # that scratch): the budget's peak is the ring, no more
    assert pub._ipc.ring.slots == 2 and stats["ipc_ring_bytes"] == 2 * 256 * 1024 + ring_scratch_bytes(256 * 1024) == pub.gpu_budget.budget
    assert pub.gpu_budget.peak == stats["ipc_ring_bytes"]
    assert pub.path_note["last_ring"]["released"] == len(pub.manifest_of(3).buckets) and not pub.path_note["last_ring"]["abandoned"]
    # an ended ring's version names no device buffer (its slots carry the next version)
    assert pub.manifest_of(3).cuda_ipc is None


async def test_a_budget_of_two_slots_without_their_checksum_scratch_gets_no_ring(make_publisher: Any, make_subscriber: Any) -> None:
    """The ring's checksums allocate beside its slots (`ring_scratch_bytes`): a budget holding two slots and not that
    is not passed; the version goes over the host path whole and the publisher says why."""
    from rollpool.weights.config import WeightPathConfig

    pub = await ring_publisher(make_publisher, pool="tring0", weights=WeightPathConfig(publisher_gpu_budget_bytes=2 * 256 * 1024))
    sub = ring_subscriber(make_subscriber, pub)
    await sub.fetch_manifest()
    w = model(2)
    want, (got,) = await publish_while_fetching(pub, [sub], w, 1)
    assert not isinstance(got, BaseException), got
    assert same(got.tensors, want) and sub.last_path != "cuda_ipc_ring"
    assert pub.gpu_budget.peak == 0 and pub.stats["ipc_ring_versions"] == 0
    assert f"and {ring_scratch_bytes(256 * 1024)} bytes to checksum them would pass" in pub.path_note["why_not_ring"]


async def test_one_subscriber_takes_the_ring_and_another_on_the_gpu_takes_the_host_path_counted(make_publisher: Any,
                                                                                                   make_subscriber: Any) -> None:
    pub = await ring_publisher(make_publisher, pool="tring2")
    subs = [ring_subscriber(make_subscriber, pub) for _ in range(2)]
    for s in subs:
        await s.fetch_manifest()
    want, got = await publish_while_fetching(pub, subs, model(2), 1)
    assert all(not isinstance(g, BaseException) and same(g.tensors, want) for g in got), got
    assert sorted(s.last_path for s in subs) == ["cuda_ipc_ring", "shm"]
    host = next(s for s in subs if s.last_path == "shm")
    assert any("not this subscriber's" in why for why in host.fallbacks), host.fallbacks


async def test_a_taker_that_releases_nothing_times_out_and_the_version_is_served_from_host(make_publisher: Any,
                                                                                            make_subscriber: Any) -> None:
    pub = await ring_publisher(make_publisher, pool="tring3")
    pub._ipc.ring.release_timeout_s = 0.3
    dead = ring_subscriber(make_subscriber, pub)
    await dead.fetch_manifest()
    w = model(3)
    want = {k: t.clone() for k, t in w.items()}
    publishing = asyncio.ensure_future(pub.publish(w, 1))
    await dead.wait_for_newer(0, timeout_s=10)
    claimed = await dead.fetch_manifest(1, ring_done=0)  # claims the ring, then dies: no release ever comes
    assert claimed.cuda_ipc is not None and claimed.cuda_ipc.ring_slots == 2
    await asyncio.wait_for(publishing, 10)  # the trainer is free once the ring is abandoned
    last = pub.path_note["last_ring"]
    assert "released no ring slot" in last["abandoned"] and last["released"] == 0 and pub.stats["ipc_ring_abandoned"] == 1
    late = ring_subscriber(make_subscriber, pub)
    got = await late.fetch(1)  # nothing lost: the host buckets hold the version whole
    assert same(got.tensors, want) and late.last_path == "shm" and late.fallbacks == {}  # on auto: no device buffer, nothing to explain
    # the next version's ring is offered again and taken
    want, (got2,) = await publish_while_fetching(pub, [late], w, 2)
    assert not isinstance(got2, BaseException) and same(got2.tensors, want) and late.last_path == "cuda_ipc_ring"


async def test_no_claim_abandons_the_ring_and_it_is_offered_again_once_a_subscriber_asks(make_publisher: Any,
                                                                                          make_subscriber: Any) -> None:
    pub = await ring_publisher(make_publisher, pool="tring4", path="cuda_ipc")
    pub._ipc.ring.claim_timeout_s = 0.2
    w = model(4)
    await asyncio.wait_for(pub.publish(w, 1), 10)  # nobody takes it: the trainer waits the claim time-out, no more
    assert "no subscriber claimed" in pub.path_note["last_ring"]["abandoned"]
    await asyncio.wait_for(pub.publish(w, 2), 10)
    assert pub.path_note["offered"] == "host" and "no subscriber claimed the last" in pub.path_note["why_not_ring"]
    sub = ring_subscriber(make_subscriber, pub)
    got = await sub.fetch(2)  # over the host path; its requests say it takes rings
    assert sub.last_path == "shm" and same(got.tensors, w)
    want, (got3,) = await publish_while_fetching(pub, [sub], w, 3)
    assert pub.path_note["offered"] == "cuda_ipc_ring"
    assert not isinstance(got3, BaseException) and same(got3.tensors, want) and sub.last_path == "cuda_ipc_ring"


async def test_a_bad_copy_is_copied_again_from_its_slot_and_one_that_stays_bad_falls_back_whole(make_publisher: Any,
                                                                                                 make_subscriber: Any) -> None:
    pub = await ring_publisher(make_publisher, pool="tring5")
    sub = ring_subscriber(make_subscriber, pub, FakeRingDevice(bad_copies=[2]), max_refetch=2)
    await sub.fetch_manifest()
    w = model(5)
    want, (got,) = await publish_while_fetching(pub, [sub], w, 1)
    assert not isinstance(got, BaseException) and same(got.tensors, want)
    assert sub.last_path == "cuda_ipc_ring" and sub.buckets_refetched == 1  # the second copy (bucket 1) again, from its slot
    sub.recycle(got)
    sub.ipc.ring.device = FakeRingDevice(bad_copies=[1, 2, 3])  # bucket 0 bad 3 times: past max_refetch
    want, (got,) = await publish_while_fetching(pub, [sub], w, 2)
    assert not isinstance(got, BaseException) and same(got.tensors, want)
    assert sub.last_path == "shm" and any("failed its checksum 3 times in the same-GPU ring" in why for why in sub.fallbacks)
    assert "left the ring" in pub.path_note["last_ring"]["abandoned"]  # the taker said so: the publisher did not wait out a time-out


async def test_a_subscriber_of_the_previous_minor_is_never_shown_the_ring(make_publisher: Any, make_subscriber: Any, zmq_ctx: Any) -> None:
    import zmq

    pub = await ring_publisher(make_publisher, pool="tring6", path="cuda_ipc")
    w = model(6)
    publishing = asyncio.ensure_future(pub.publish(w, 1))  # its ring waits for a taker
    while pub._server.versions.get(1) is None:  # noqa: ASYNC110 - the publisher has no event for "version added"
        await asyncio.sleep(0.01)
    dealer = zmq_ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.router_endpoint)

    async def ask(minor: int, **fields: Any) -> Manifest:
        frames = encode(ManifestRequest(request_id=f"m{minor}", version=1, streamed=True, host_key=pub.host_key, gpu_uuids=(GPU,), **fields))
        header = msgpack.unpackb(frames[0])
        header[1] = minor
        await dealer.send_multipart([msgpack.packb(header), *frames[1:]])
        reply = decode(await asyncio.wait_for(dealer.recv_multipart(), 5))
        assert isinstance(reply, Manifest)
        return reply

    try:
        old = await ask(RING_MINOR - 1)  # an older subscriber knows no `ring`: it would read the slots as an arena
        assert old.cuda_ipc is None and all(b.ipc_offset == -1 for b in old.buckets)
        new = await ask(RING_MINOR, ring=True)
        assert new.cuda_ipc is not None and new.cuda_ipc.ring_slots == 2
    finally:
        dealer.close(linger=0)
    sub = ring_subscriber(make_subscriber, pub)
    got = await sub.fetch(1)
    await asyncio.wait_for(publishing, 10)
    assert sub.last_path == "cuda_ipc_ring" and same(got.tensors, {k: t for k, t in w.items()})


async def test_keep_versions_0_the_ring_alone_carries_the_version_and_the_trainer_waits_for_its_taker(make_publisher: Any,
                                                                                                       make_subscriber: Any) -> None:
    """keep_versions=0 on the same GPU: no host copy at all; publish returns once the taker copied every bucket out,
    then the version's bytes are gone from the publisher (as after any keep_versions=0 release)."""
    pub = await ring_publisher(make_publisher, pool="tring7", keep_versions=0)
    sub = ring_subscriber(make_subscriber, pub)
    await sub.fetch_manifest()
    w = model(7)
    for v in (1, 2):
        want, (got,) = await publish_while_fetching(pub, [sub], w, v)
        assert not isinstance(got, BaseException) and same(got.tensors, want), got
        assert sub.last_path == "cuda_ipc_ring" and sub.fallbacks == {}
        assert pub.path_note["offered"] == "cuda_ipc_ring" and pub.path_note["last_ring"]["released"] == len(got.manifest.buckets)
        sub.recycle(got)
    assert pub.bytes_served == 0 and pub.stats["ipc_ring_versions"] == 2 and pub.gpu_budget.peak == pub.stats["ipc_ring_bytes"]
    late = ring_subscriber(make_subscriber, pub)
    from rollpool.weights.paths.base import WeightVersionGoneError

    with pytest.raises(WeightVersionGoneError):
        await late.fetch(2)  # nothing else holds it: the ring carried it to its one taker


async def test_keep_versions_0_a_dead_taker_leaves_the_host_copy_of_the_unchanged_tensors(make_publisher: Any,
                                                                                          make_subscriber: Any) -> None:
    pub = await ring_publisher(make_publisher, pool="tring8", keep_versions=0, release_idle_s=5.0)
    pub._ipc.ring.release_timeout_s = 0.3
    dead = ring_subscriber(make_subscriber, pub)
    await dead.fetch_manifest()
    w = model(8)
    want = {k: t.clone() for k, t in w.items()}
    publishing = asyncio.ensure_future(pub.publish(w, 1, expected_fetchers=1))
    await dead.wait_for_newer(0, timeout_s=10)
    await dead.fetch_manifest(1, ring_done=0)  # claims, then dies
    late = ring_subscriber(make_subscriber, pub)
    got = await late.fetch(1)  # waits for the host copy the abandoned ring leaves behind
    assert same(got.tensors, want) and late.last_path == "network"
    assert "released no ring slot" in pub.path_note["last_ring"]["abandoned"]
    await asyncio.wait_for(publishing, 10)  # released once its one expected fetcher had every byte
