"""A delta made on the publisher's GPU served before its version's host copy is checksummed (minor 28,
`EARLY_DELTA_MINOR`), to the subscribers that verify on their GPU by the mix64 of the resulting bytes.

As in test_delta_gpu.py the GPUs are stood in for by CPU tensors: the publisher makes its deltas "on the device"
(`rollpool.weights.delta_device` on CPU tensors) and the subscriber holds its versions on a CPU `DeviceHeld`. The
publisher's host copy of each version (made from its device base once the trainer is free) is held back by the test
(`_hold_host_copies`) until it lets it go, so "before the host copy" is a state of the server, not a race."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import pytest

torch = pytest.importorskip("torch")

from rollpool import protocol as p  # noqa: E402

from .delta_models import model as _model  # noqa: E402
from .delta_models import published as _published  # noqa: E402
from .delta_models import same as _same  # noqa: E402
from .delta_models import step as _step  # noqa: E402
from .test_delta_gpu import _on_gpu  # noqa: E402

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("deltas_made_on_the_device")]


def _hold_host_copies(pub: Any) -> asyncio.Event:
    """The publisher's host copy of each device-made version waits until the returned event is set."""
    go = asyncio.Event()
    finish = pub._finish_device

    async def held(*args: Any) -> None:
        await go.wait()
        await finish(*args)

    pub._finish_device = held
    return go


async def _until(cond: Any) -> None:
    for _ in range(1000):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the condition never held")


async def _first_version(pub: Any, sub: Any) -> dict[str, torch.Tensor]:
    model = _model()
    await _published(pub, model, 1)
    v1 = await sub.fetch(1)
    assert _same(v1.tensors, model)
    return model


async def test_an_early_delta_is_rebuilt_on_the_gpu_before_the_host_copy_is_checksummed(make_publisher: Any, make_subscriber: Any,
                                                                                         sub_path: str) -> None:
    pub = await make_publisher(path=sub_path)
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint, path=sub_path)
    held = _on_gpu(sub)
    model = _step(await _first_version(pub, sub), 2)
    go = _hold_host_copies(pub)
    await pub.publish(model, 2, wait_ready=False)
    v2 = await asyncio.wait_for(sub.fetch(2), 30)
    served = pub._server.versions[2]
    # rebuilt and verified on the "GPU" while the publisher's host copy of version 2 has not even begun
    assert not served.complete and not any(b.checksum for b in served.buckets)
    assert v2.manifest.delta_base == 1 and _same(v2.tensors, model) and held.holds(pub.publisher_id, 2)
    assert not any(b.checksum for b in v2.manifest.buckets) and all(b.host_mix64 for b in v2.manifest.buckets)
    assert sub.delta_device_versions == 1 and sub.delta_fallbacks == 0 and pub._server.early_deltas_served == 1
    go.set()
    await pub.wait_ready(2)
    await _until(lambda: served.delta_state == "ready")
    # the delta served on is the one served early, its checksums of the resulting bytes in now (and its mix64 the
    # snapshot's of the host copy)
    assert served.delta is not None and all(b.checksum == vb.checksum and b.host_mix64 == vb.host_mix64
                                            for b, vb in zip(served.delta.buckets, served.buckets, strict=True))
    model = _step(model, 3)
    await pub.publish(model, 3, wait_ready=False)
    v3 = await asyncio.wait_for(sub.fetch(3), 30)  # the version rebuilt from the early delta is the next one's base
    assert v3.manifest.delta_base == 2 and _same(v3.tensors, model) and sub.delta_device_versions == 2


async def test_an_asker_that_does_not_verify_on_its_gpu_gets_the_delta_only_once_complete(make_publisher: Any, make_subscriber: Any,
                                                                                           sockets: Any) -> None:
    """A host rebuilder, and a peer of the previous minor (which cannot say it verifies on its GPU), wait for the
    version's checksums as before, though an early delta is there for those that can."""
    pub = await make_publisher(path="network")
    gpu_sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint)
    host_sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint)
    _on_gpu(gpu_sub)
    model = await _first_version(pub, gpu_sub)
    assert _same((await host_sub.fetch(1)).tensors, model)
    model = _step(model, 2)
    go = _hold_host_copies(pub)
    await pub.publish(model, 2, wait_ready=False)
    old = sockets.dealer(pub.router_endpoint, identity=b"old-peer")
    frames = p.encode(p.ManifestRequest(request_id="old", version=2, streamed=True, delta_base=1))
    major, _minor, kind, fields = msgpack.unpackb(frames[0])
    frames[0] = msgpack.packb([major, p.PROTOCOL_MINOR - 1, kind, fields], use_bin_type=True)
    await old.send_multipart(frames)
    on_host = asyncio.ensure_future(host_sub.fetch(2))
    assert _same((await asyncio.wait_for(gpu_sub.fetch(2), 30)).tensors, model)  # the early delta, on the "GPU"
    served = pub._server.versions[2]
    await _until(lambda: len(served.waiting_delta) == 2)
    assert served.early is not None and not served.complete and not on_host.done()
    assert not await old.poll(0)  # the older peer's request waits too
    go.set()
    wv = await asyncio.wait_for(on_host, 30)
    assert wv.manifest.delta_base == 1 and _same(wv.tensors, model) and all(b.checksum for b in wv.manifest.buckets)
    reply = p.decode(await asyncio.wait_for(old.recv_multipart(), 30))
    assert isinstance(reply, p.Manifest) and reply.delta_base == 1 and all(b.checksum for b in reply.buckets)
    assert pub._server.early_deltas_served == 1
    old.close(linger=0)


async def test_an_early_delta_that_fails_its_gpu_check_ends_in_the_verified_full_version(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher(path="network")
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint)
    held = _on_gpu(sub)
    model = _step(await _first_version(pub, sub), 2)
    mix64s = pub._delta_base.mix64s
    # the mix64 of bucket 0's resulting bytes is not what the rebuilt bytes give (a corrupt delta, or a wrong proof)
    pub._delta_base.mix64s = lambda places: ["mix64:0000000000000bad", *mix64s(places)[1:]]
    go = _hold_host_copies(pub)
    await pub.publish(model, 2, wait_ready=False)
    fetching = asyncio.ensure_future(sub.fetch(2))
    await _until(lambda: sub.delta_fallbacks == 1)  # refused on the "GPU": the full version is asked for
    assert pub._server.early_deltas_served == 1 and not fetching.done()  # which waits for the host copy
    go.set()
    v2 = await asyncio.wait_for(fetching, 30)
    assert v2.manifest.delta_base == -1 and all(b.checksum for b in v2.manifest.buckets)
    assert _same(v2.tensors, model) and held.holds(pub.publisher_id, 2) and sub.delta_device_versions == 0


async def test_the_host_copy_begins_once_the_early_delta_is_served(make_publisher: Any, make_subscriber: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The version's host copy from the device base waits for the early delta to be served (issuing the whole model's
    copies took the event loop and the GIL beside the early delta's parts at 8B); a delta that is not served early
    holds it at most `EARLY_FIRST_S`."""
    from rollpool.weights import publisher as publisher_mod
    from rollpool.weights.snapshot import Snapshot

    pub = await make_publisher()
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint)
    _on_gpu(sub)
    model = _step(await _first_version(pub, sub), 2)
    seen: list[tuple[int, int]] = []
    copy = Snapshot.copy

    async def watched(self: Snapshot, items: Any) -> None:
        seen.append((self.version, pub._server.early_deltas))
        await copy(self, items)

    monkeypatch.setattr(Snapshot, "copy", watched)
    await pub.publish(model, 2, wait_ready=True)
    assert seen == [(2, 1)]  # served early before the host copy began
    # an early delta that never comes (its task never ends) holds the host copy EARLY_FIRST_S at most
    monkeypatch.setattr(publisher_mod, "EARLY_FIRST_S", 0.05)
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    pub._base_mixer = never
    await asyncio.wait_for(pub._early_first(), 5)
    assert not never.done()
    never.cancel()


async def test_the_next_versions_payload_blocks_are_made_once_the_host_copy_landed(make_publisher: Any, make_subscriber: Any,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Making page-locked blocks ahead (`PayloadHost.warm_for`) takes the CUDA driver for tenths of a second when new
    ones are made: started right after the diff it held up the early delta on an H200 at 8B, so it starts once the
    version's host copy has landed, with the sizes the last diff gave."""
    from rollpool.weights.delta_device import PayloadHost
    from rollpool.weights.snapshot import Snapshot

    pub = await make_publisher()
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint)
    _on_gpu(sub)
    model = _step(await _first_version(pub, sub), 2)
    events: list[str] = []
    copy = Snapshot.copy

    async def watched(self: Snapshot, items: Any) -> None:
        events.append("copy begins")
        await copy(self, items)
        events.append("copy landed")

    monkeypatch.setattr(Snapshot, "copy", watched)
    monkeypatch.setattr(PayloadHost, "warm_for", lambda _self, sizes: events.append(f"warm {list(sizes)}"))
    pub._delta_base.payload_sizes = [123, 456]  # (CPU tensors make no device payloads: sizes as a GPU diff would give)
    orig_diff = pub._delta_base.diff

    def diff(*a: Any, **kw: Any) -> Any:
        out = orig_diff(*a, **kw)
        pub._delta_base.payload_sizes = [123, 456]
        return out

    monkeypatch.setattr(pub._delta_base, "diff", diff)
    await pub.publish(model, 2, wait_ready=True)
    assert events == ["copy begins", "copy landed", "warm [123, 456]"]
