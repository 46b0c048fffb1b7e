"""A worker that joins after a whole-model version published over a LoRA adapter version serves the same policy as
the workers that saw both (docs/lora.md, "Late joiners"): a real broker, the trainer client's publisher (real ZeroMQ,
``keep_versions=2``) and hf workers on a real tiny Llama, on CPU.

The engines keep the newest adapter on across a whole-model version, so the policy of whole-model version 3 after
adapter version 1 is base 3 plus adapter 1. The publisher names that adapter version on version 3's manifest
(`Manifest.adapter_on`) and keeps it served past ``keep_versions``; a worker that joins at version 3 fetches and
applies adapter 1 with it. Before, it fetched version 3 alone and served base 3 without the adapter while its tokens
said version 3, as the first worker's did."""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from rollpool.protocol import ADAPTER_ON_MINOR, BASE_ON_MINOR, decode, encode  # noqa: E402
from rollpool.protocol.messages import Manifest, ManifestRequest, SamplingParams  # noqa: E402
from rollpool.workers.engines.hf import HFEngine  # noqa: E402
from tests.integration.reliability.conftest import Pool, pool, wait_until  # noqa: E402
from tests.integration.weights.test_lora import PROMPT, _adapter, _base_version, model_dir  # noqa: E402

__all__ = ["model_dir", "pool"]  # the fixtures, used here by name

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


def _engine(model_dir: pathlib.Path) -> HFEngine:
    return HFEngine(model=str(model_dir), capacity=4, num_threads=1, lora_resident=2, max_lora_rank=8)


async def _serves(worker: Any, version: int) -> None:
    assert await wait_until(lambda: worker.weights.version >= version, 60), f"{worker.worker_id} serves {worker.weights.version}"


@pytest.mark.timeout(120)
async def test_a_worker_that_joins_after_a_whole_model_version_over_an_adapter_serves_the_adapter_too(
        pool: Pool, model_dir: pathlib.Path) -> None:
    broker = await pool.start_broker()
    client = await pool.client(broker.client_endpoint, keep_versions=2)
    first = await pool.worker(broker.worker_endpoint, "w-first", engine_factory=lambda: _engine(model_dir))
    assert await wait_until(lambda: first.engine is not None and first.engine.info() is not None, 60)
    named, spec = _adapter(model_dir, seed=1)
    await client.publish_weights(named, 1, adapter=spec)
    await _serves(first, 1)
    for version in (2, 3):  # two whole-model versions: with keep_versions=2 the adapter version is past the window
        await client.publish_weights(_base_version(model_dir, seed=version), version)
        await _serves(first, version)
    joiner = await pool.worker(broker.worker_endpoint, "w-joiner", engine_factory=lambda: _engine(model_dir))
    await _serves(joiner, 3)
    engines = [first.engine, joiner.engine]
    assert all(isinstance(e, HFEngine) for e in engines)
    assert [(e.version, e.adapter_versions()) for e in engines] == [(3, [1]), (3, [1])]  # type: ignore[union-attr]
    outs = await asyncio.gather(*(e.generate(PROMPT, 1, GREEDY, f"same-{i}") for i, e in enumerate(engines)))  # type: ignore[union-attr]
    a, b = (o.samples[0] for o in outs)
    assert a.token_versions == b.token_versions == [3] * 8
    assert a.output_ids == b.output_ids
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5  # one policy: base 3 + adapter 1
    publisher = client._publisher
    assert publisher is not None and publisher.versions == [1, 2, 3]  # adapter 1 kept while it is on
    manifest = publisher.manifest_of(3)
    assert manifest is not None and manifest.adapter_on == 1 and manifest.adapter is None


async def _ask_as_minor(endpoint: str, minor: int, zmq_ctx: Any) -> Manifest:
    """The latest manifest, asked for by a raw DEALER whose message says it is of `minor`."""
    import msgpack
    import zmq

    frames = encode(ManifestRequest(request_id=f"m{minor}", streamed=True))
    header = msgpack.unpackb(frames[0])
    header[1] = minor
    dealer = zmq_ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([msgpack.packb(header), *frames[1:]])
        reply = decode(await asyncio.wait_for(dealer.recv_multipart(), 5))
    finally:
        dealer.close(linger=0)
    assert isinstance(reply, Manifest)
    return reply


async def test_the_adapter_on_is_kept_past_keep_versions_and_a_relay_that_joins_late_serves_it_too(
        model_dir: pathlib.Path, make_publisher: Any, make_subscriber: Any, make_relay: Any, zmq_ctx: Any) -> None:
    """The publisher keeps the adapter version on (one adapter's bytes besides its `keep_versions`) until a newer adapter
    version replaces it; a relay that starts after the whole-model versions fetches the adapter version on under the
    latest too, and serves both to the workers behind it, the field passed through."""
    pub = await make_publisher(keep_versions=2)
    named, spec = _adapter(model_dir, seed=1)
    await pub.publish(named, 1, adapter=spec, wait_ready=True)
    for version in (2, 3):
        manifest = await pub.publish(_base_version(model_dir, seed=version), version, wait_ready=True)
        assert manifest.adapter_on == 1
    assert pub.versions == [1, 2, 3] and pub.adapter_on == 1
    old = await _ask_as_minor(pub.router_endpoint, ADAPTER_ON_MINOR - 1, zmq_ctx)  # a subscriber of the previous minor
    assert (old.version, len(old.buckets)) == (3, len(manifest.buckets))  # answered as before (it ignores adapter_on)
    relay = await make_relay(upstream_router=pub.router_endpoint, upstream_pub=pub.pub_endpoint, keep_versions=1)
    assert await wait_until(lambda: relay.latest_version == 3, 30)
    relayed = make_subscriber(relay.router_endpoint, relay.pub_endpoint)
    latest = await relayed.fetch()
    assert (latest.version, latest.manifest.adapter_on, latest.manifest.adapter) == (3, 1, None)
    assert sorted(relay._server.versions) == [1, 3]  # keep_versions=1 and the adapter version on under the latest
    relayed.recycle(latest)
    adapter = await relayed.fetch(1)
    assert adapter.manifest.adapter == spec and all(torch.equal(adapter.tensors[k], v) for k, v in named.items())
    # a newer adapter version replaces it: version 1 is evicted like any version past the window
    named4, spec4 = _adapter(model_dir, seed=4)
    await pub.publish(named4, 4, adapter=spec4, wait_ready=True)
    assert pub.versions == [3, 4] and pub.adapter_on == 4
    manifest = await pub.publish(_base_version(model_dir, seed=5), 5, wait_ready=True)
    assert manifest.adapter_on == 4 and pub.versions == [4, 5]
    assert await wait_until(lambda: relay.latest_version == 5, 30)
    assert sorted(relay._server.versions) == [4, 5]  # the relay dropped adapter 1 too, and holds adapter 4 under 5


@pytest.mark.timeout(120)
async def test_a_worker_that_joins_after_adapter_versions_over_a_whole_model_version_serves_them_over_that_version(
        pool: Pool, model_dir: pathlib.Path) -> None:
    """The reverse case: whole-model version 1, then adapter versions 2 and 3 over it (with ``keep_versions=2`` version 1
    is past the window). The publisher names version 1 on adapter 3's manifest as its base (`Manifest.base_on`) and keeps
    it served; a worker that joins at version 3 applies version 1 then adapter 3 in one pause. Before, it applied adapter
    3 over its engine's model from disk, and its tokens said version 3 as the first worker's did."""
    broker = await pool.start_broker()
    client = await pool.client(broker.client_endpoint, keep_versions=2)
    first = await pool.worker(broker.worker_endpoint, "w-first", engine_factory=lambda: _engine(model_dir))
    assert await wait_until(lambda: first.engine is not None and first.engine.info() is not None, 60)
    await client.publish_weights(_base_version(model_dir, seed=1), 1)
    await _serves(first, 1)
    for version in (2, 3):
        named, spec = _adapter(model_dir, seed=version)
        await client.publish_weights(named, version, adapter=spec)
        await _serves(first, version)
    joiner = await pool.worker(broker.worker_endpoint, "w-joiner", engine_factory=lambda: _engine(model_dir))
    await _serves(joiner, 3)
    engines = [first.engine, joiner.engine]
    assert all(isinstance(e, HFEngine) for e in engines)
    served = [(e._base_version, e.adapter_versions()[-1:]) for e in engines]  # type: ignore[union-attr]
    assert served == [(1, [3]), (1, [3])]
    outs = await asyncio.gather(*(e.generate(PROMPT, 1, GREEDY, f"same-{i}") for i, e in enumerate(engines)))  # type: ignore[union-attr]
    a, b = (o.samples[0] for o in outs)
    assert a.token_versions == b.token_versions == [3] * 8
    assert a.output_ids == b.output_ids
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5  # one policy: base 1 + adapter 3
    assert joiner.weights.bases_joined == 1
    publisher = client._publisher
    assert publisher is not None and publisher.versions == [1, 2, 3]  # version 1 kept while it is the adapters' base
    manifest = publisher.manifest_of(3)
    assert manifest is not None and manifest.base_on == 1 and manifest.adapter is not None


async def test_the_base_of_the_newest_adapter_is_kept_past_keep_versions_and_a_relay_that_joins_late_serves_it_too(
        model_dir: pathlib.Path, make_publisher: Any, make_subscriber: Any, make_relay: Any, zmq_ctx: Any) -> None:
    """The publisher keeps the whole-model version the newest adapter versions apply over (one whole model's bytes
    besides its `keep_versions`, once they have pushed it out) until a newer whole-model version replaces it; a relay that
    starts after the adapter versions fetches that base too and serves both, the field passed through."""
    pub = await make_publisher(keep_versions=2)
    base = _base_version(model_dir, seed=1)
    await pub.publish(base, 1, wait_ready=True)
    for version in (2, 3, 4):
        named, spec = _adapter(model_dir, seed=version)
        manifest = await pub.publish(named, version, adapter=spec, wait_ready=True)
        assert manifest.base_on == 1
    assert pub.versions == [1, 3, 4] and pub.base_on == 1
    old = await _ask_as_minor(pub.router_endpoint, BASE_ON_MINOR - 1, zmq_ctx)  # a subscriber of the previous minor
    assert (old.version, len(old.buckets)) == (4, len(manifest.buckets))  # answered as before (it ignores base_on)
    relay = await make_relay(upstream_router=pub.router_endpoint, upstream_pub=pub.pub_endpoint, keep_versions=1)
    assert await wait_until(lambda: relay.latest_version == 4, 30)
    relayed = make_subscriber(relay.router_endpoint, relay.pub_endpoint)
    latest = await relayed.fetch()
    assert (latest.version, latest.manifest.base_on, latest.manifest.adapter) == (4, 1, spec)
    assert sorted(relay._server.versions) == [1, 4]  # keep_versions=1 and the base of the latest
    relayed.recycle(latest)
    got = await relayed.fetch(1)
    assert got.manifest.adapter is None and all(torch.equal(got.tensors[k], v) for k, v in base.items())
    # a newer whole-model version replaces it: version 1 is evicted like any version past the window
    manifest = await pub.publish(_base_version(model_dir, seed=5), 5, wait_ready=True)
    assert manifest.adapter_on == 4 and manifest.base_on == -1 and pub.versions == [4, 5] and pub.base_on == 5
    assert await wait_until(lambda: relay.latest_version == 5, 30)
    assert sorted(relay._server.versions) == [4, 5]  # the relay dropped version 1 too
