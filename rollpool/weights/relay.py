"""`Relay`: one node's weight server, fed by one upstream fetch per version.

The relay subscribes upstream (a `WeightSubscriber`: announcements, "latest"
on connect and every `poll_interval_s`), and for each new version allocates
the buckets, announces the version downstream at once and fetches it from
upstream exactly once. Local workers fetch from the relay with the same
protocol (its own ROUTER + PUB): a downstream fetch of bytes that have
arrived is answered from the relay's buffer (zero-copy), one of bytes still
on the way is parked and answered as they arrive. So the upstream publisher
serves each version once per node, not once per worker, and relays chain.

Verification stays end to end: the relay verifies each bucket (refetching a
bad one) and passes the upstream manifest (checksums and publisher id)
through unchanged, so every worker verifies what it receives too. A version
the relay cannot complete is withdrawn: its parked and later fetches answer
``unavailable``/``gone`` and the worker keeps its old weights. A full version's
chunks are served downstream as they arrive, before their bucket is verified
here: safe because a downstream subscriber verifies every bucket against the
publisher's checksum itself (a bad chunk costs it a refetch, never a wrong
tensor), and it lets the version flow through the node at wire speed. A bucket whose
checksum is still pending upstream (a trainer's CPU tensors, minor 30) comes
before its checksum too: its chunks go on to the subscribers that ask for that
(``RPBE``) and wait for the checksum for the rest (`_FillingSource`).

Delta versions (``weight_delta`` on): a relay holding the version before the
upstream's latest names it as its base, gets the changed elements, rebuilds the
version from its own copy of the base and verifies every bucket against the
checksum of the resulting bytes *before* it announces the version downstream
(a delta is small: waiting for it costs little). It then serves both: the
upstream's encoded buckets as they came (its subscribers holding the base get
the same delta, checksums and all) and the full version to the rest. A delta it
cannot rebuild (a corrupt payload, another publisher's base, an evicted delta)
is counted in `delta_fallbacks` and the full version fetched instead. A relay
that missed the base (it holds no version right before the latest) gets the
full version; once it holds two consecutive versions it computes the delta
between them itself, so its subscribers holding the earlier one still get one.

A whole-model version that names an adapter version on under it (`Manifest.adapter_on`, passed through) is
relayed with that adapter version: fetched first when the relay does not hold it (a relay that started late), and
kept past `keep_versions` while the latest names it, so the workers behind the relay that join get both. One the
upstream no longer serves is counted (`adapter_on_missing`) and the whole-model version relayed all the same.
The other way round, an adapter version names the whole-model version it applies over (`Manifest.base_on`, passed
through): held the same way (fetched first when missing, kept while the latest names it, `base_on_missing` counted).

``rollpool relay`` (or ``python -m rollpool.weights``) runs one; its flags are `RelayConfig`'s.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

import torch

from rollpool.protocol.errors import WeightSyncError
from rollpool.protocol.messages import BucketInfo, Manifest
from rollpool.protocol.metrics import MetricsSink, NullMetricsSink
from rollpool.protocol.sockets import SocketFactory
from rollpool.weights.config import WeightPathConfig, with_overrides
from rollpool.weights.delta import DeltaError, same_layout, wire_summary
from rollpool.weights.manifest import check_manifest
from rollpool.weights.memory import sweep_stale_segments
from rollpool.weights.paths.base import WeightVersionGoneError
from rollpool.weights.serving import (
    MAX_CHUNK_BYTES,
    DeltaServed,
    ServedVersion,
    ServingFace,
    TensorSource,
    WeightServer,
    new_server_id,
)
from rollpool.weights.subscriber import WeightSubscriber

__all__ = ["Relay"]

log = logging.getLogger(__name__)


class _FillingSource:
    """A bucket still arriving: a read is served once every chunk it touches has arrived and the bucket's checksum is
    known (`checksummed`: from the upstream manifest, or from the first reply that carried it); `read_early` (a
    downstream ``RPBE``, minor 30) serves arrived chunks before it, as a publisher's `GatedSource` does its landed
    bytes, so a relay whose upstream sends a bucket's bytes before its checksum forwards them to the subscribers that
    asked for that, and the rest wait for the checksum."""

    __slots__ = ("view", "chunk", "have", "checksummed")

    def __init__(self, data: torch.Tensor, chunk: int, checksummed: bool = True) -> None:
        n = int(data.numel())
        self.view = data.numpy().data if n else memoryview(b"")
        self.chunk = chunk
        self.have = bytearray(-(-n // chunk))
        self.checksummed = checksummed

    def read(self, offset: int, nbytes: int) -> Any:
        return self.read_early(offset, nbytes) if self.checksummed else None

    def read_early(self, offset: int, nbytes: int) -> Any:
        first, last = offset // self.chunk, (offset + nbytes - 1) // self.chunk
        if first == last:
            if not self.have[first]:
                return None
        elif not all(self.have[first : last + 1]):
            return None
        return self.view[offset : offset + nbytes]

    def mark(self, offset: int, nbytes: int) -> None:
        for i in range(offset // self.chunk, -(-(offset + nbytes) // self.chunk)):
            self.have[i] = 1

    def reset(self) -> None:
        self.have = bytearray(len(self.have))


class _Forwarder:
    """TransferSink: marks arrived chunks and wakes the parked downstream fetches."""

    def __init__(self, server: WeightServer, version: int, sources: list[_FillingSource]) -> None:
        self.server = server
        self.version = version
        self.sources = sources

    def on_chunk(self, bucket: int, offset: int, nbytes: int) -> None:
        self.sources[bucket].mark(offset, nbytes)
        self.server.notify_arrived(self.version)

    def on_bucket_reset(self, bucket: int) -> None:
        self.sources[bucket].reset()

    def on_checksum(self, bucket: int, checksum: str) -> None:
        # a streamed upstream manifest's checksum: downstream chunks carry it from now on (and every subscriber is
        # served the bucket's arrived chunks, not only those asking for bytes before the checksum)
        self.sources[bucket].checksummed = True
        self.server.complete_bucket(self.version, bucket, checksum)


class Relay(ServingFace):
    """Serves local workers from one upstream fetch per version."""

    def __init__(
        self,
        sockets: SocketFactory,
        *,
        upstream_router: str,
        upstream_pub: str | None = None,
        router_endpoint: str = "tcp://127.0.0.1:*",
        pub_endpoint: str | None = "tcp://127.0.0.1:*",
        keep_versions: int = 2,
        window_chunks: int = 16,
        fetch_timeout_s: float = 30.0,
        max_refetch: int = 3,
        poll_interval_s: float = 5.0,
        announce_interval_s: float = 1.0,
        relay_id: str | None = None,
        metrics: MetricsSink | None = None,
        weights: WeightPathConfig | None = None,
        path: str | None = None,
        streams: int | None = None,
        pinned_budget_bytes: int | None = None,
    ) -> None:
        """`weights`: the weight-path knobs of the upstream fetch and of the server (None: from the environment, read
        once here); `path`, `streams`, `pinned_budget_bytes` override one field each."""
        if keep_versions < 1:
            raise ValueError(f"a relay keeps at least one version, got keep_versions={keep_versions}")
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s}")
        self.relay_id = relay_id or f"relay-{new_server_id()}"
        self.keep_versions = keep_versions
        self.poll_interval_s = poll_interval_s
        self.metrics: MetricsSink = metrics or NullMetricsSink()
        self.upstream_router = upstream_router
        self.upstream_pub = upstream_pub
        cfg = with_overrides(weights, weight_path=path, weight_streams=streams, pinned_budget_bytes=pinned_budget_bytes)
        self.upstream = WeightSubscriber(
            sockets,
            worker_id=self.relay_id,
            fetch_timeout_s=fetch_timeout_s,
            window_chunks=window_chunks,
            max_refetch=max_refetch,
            metrics=self.metrics,
            weights=cfg,
        )
        self._server = WeightServer(
            sockets,
            router_endpoint=router_endpoint,
            pub_endpoint=pub_endpoint,
            name="relay",
            announce_interval_s=announce_interval_s,
            metrics=self.metrics,
            weights=cfg,
        )
        self._delta_on = cfg.weight_delta
        self._latest = -1
        self._held: dict[int, list[torch.Tensor]] = {}
        """The bucket buffers of each version served (the base a delta is rebuilt from)."""
        self.versions_fetched = 0
        self.delta_versions = 0
        """Versions received as a delta from upstream, rebuilt and verified here."""
        self.delta_fallbacks = 0
        """Upstream deltas that could not be rebuilt here: the full version was fetched instead."""
        self.adapter_on_missing = 0
        """Whole-model versions relayed without the adapter version on under them (upstream no longer served it)."""
        self.base_on_missing = 0
        """Adapter versions relayed without the whole-model version they apply over (upstream no longer served it)."""
        self._started = False
        self._stop = asyncio.Event()

    @property
    def stats(self) -> dict[str, int]:
        """What the relay fetched and served (its server's `stats`: bytes and chunks served, those before their
        checksum, deltas), as a publisher's `stats`."""
        return {"latest_version": self._latest, **self._server.stats(), "versions_fetched": self.versions_fetched,
                "delta_versions": self.delta_versions, "delta_fallbacks": self.delta_fallbacks,
                "adapter_on_missing": self.adapter_on_missing, "base_on_missing": self.base_on_missing}

    # -- lifecycle

    async def start(self) -> None:
        sweep_stale_segments()  # segments of publishers gone from this host (judged by their owners' locks)
        await self._server.start()
        self.upstream.connect(self.upstream_router, self.upstream_pub)
        self._started = True
        log.info("relay %s: upstream %s, serving on %s, announcing on %s", self.relay_id, self.upstream_router, self.router_endpoint, self.pub_endpoint)

    async def run(self) -> None:
        """Start (if not started), follow upstream until `stop()`, then close."""
        if not self._started:
            await self.start()
        try:
            async with asyncio.TaskGroup() as tg:
                follow = tg.create_task(self._follow_loop(), name="Relay._follow_loop")
                await self._stop.wait()
                follow.cancel()
        finally:
            await self.close()

    def stop(self) -> None:
        self._stop.set()

    async def close(self) -> None:
        await self.upstream.aclose()
        await self._server.close()

    @property
    def upstream_bytes(self) -> int:
        """Bytes received from upstream."""
        return self.upstream.bytes_received

    def note_version(self, version: int) -> None:
        self.upstream.note_version(version)

    # -- following upstream

    async def _follow_loop(self) -> None:
        while True:
            try:
                await self.upstream.wait_for_newer(self._latest, timeout_s=self.poll_interval_s)
            except WeightSyncError:
                self.upstream.note_version(self._latest + 1)  # nothing heard: ask for the latest again
                continue
            try:
                await self.follow_latest()
            except WeightSyncError as exc:
                log.warning("relay %s: could not relay the latest weight version: %s", self.relay_id, exc)
                await asyncio.sleep(min(self.poll_interval_s, 1.0))

    def _delta_base(self) -> ServedVersion | None:
        """The version a delta from upstream would be rebuilt from: the newest held, complete, when deltas are on."""
        if not self._delta_on:
            return None
        v = self._server.versions.get(self._latest)
        return v if v is not None and v.complete and not v.released and self._latest in self._held else None

    async def follow_latest(self) -> int:
        """Fetch the upstream's latest version if it is new, serving it downstream as it arrives (a delta: once rebuilt
        and verified)."""
        base = self._delta_base()
        manifest = check_manifest(await self.upstream.fetch_manifest(None, delta_base=base.version if base is not None else -1))
        version = manifest.version
        if version <= self._latest:
            return self._latest
        await self._hold_under(manifest)
        if manifest.delta_base >= 0:
            try:
                return await self._follow_delta(manifest, base)
            except (WeightSyncError, DeltaError) as exc:
                self.delta_fallbacks += 1
                log.warning("relay %s: delta of version %d against %d not rebuilt (%s); fetching it full", self.relay_id, version,
                            manifest.delta_base, exc)
                manifest = check_manifest(await self.upstream.fetch_manifest(version, delta=False))
                return await self._follow_full(manifest, declined=False)
        # upstream answered a request naming the base right before with the full version: it judged the delta no cheaper
        # (or had none), and the same bytes compared here would judge the same, so none is computed here
        return await self._follow_full(manifest, declined=base is not None and base.version == version - 1)

    async def _hold_under(self, manifest: Manifest) -> None:
        """Before a version that names the version it is served with: a whole-model version the adapter version on under
        it (`Manifest.adapter_on`), an adapter version the whole-model version it applies over (`Manifest.base_on`).
        That version is held and served here too (a worker joining behind this relay applies it first), kept past
        `keep_versions` while the latest names it. One the upstream no longer serves is counted (`adapter_on_missing`,
        `base_on_missing`) and `manifest` relayed all the same (its joining workers then skip it, saying why)."""
        is_adapter = manifest.adapter is not None
        wanted = manifest.base_on if is_adapter else manifest.adapter_on
        what = "whole-model version" if is_adapter else "adapter version"
        if wanted < 0 or wanted in self._server.versions:
            return
        try:
            got = check_manifest(await self.upstream.fetch_manifest(wanted, delta=False))
        except WeightVersionGoneError as exc:
            if is_adapter:
                self.base_on_missing += 1
            else:
                self.adapter_on_missing += 1
            log.warning("relay %s: version %d is served with %s %d, which upstream no longer serves (%s); its joining "
                        "workers will skip version %d", self.relay_id, manifest.version, what, wanted, exc, manifest.version)
            return
        if got.version != wanted or (got.adapter is not None) == is_adapter:
            raise WeightSyncError(f"version {manifest.version} names {what} {wanted} as served with it, and upstream "
                                  f"answered version {got.version}, which is not that {what}")
        await self._follow_full(got, declined=True, latest=False)
        log.info("relay %s: holds %s %d, served with version %d", self.relay_id, what, wanted, manifest.version)

    async def _follow_delta(self, manifest: Manifest, base: ServedVersion | None) -> int:
        """Rebuild `manifest`'s version from the base held here and the upstream's encoded buckets, verify it, then serve
        it: the full version, and the same delta to the subscribers holding the base."""
        version = manifest.version
        if base is None or base.version != manifest.delta_base or base.version not in self._held:
            raise WeightSyncError(f"the base {manifest.delta_base} is not held here")
        if base.publisher_id != manifest.publisher_id:
            raise WeightSyncError(f"the base came from publisher {base.publisher_id!r}, the delta from {manifest.publisher_id!r}")
        if not same_layout(manifest.buckets, base.buckets):
            raise WeightSyncError("the base's buckets do not line up with the delta's")
        base_buffers = self._held[base.version]
        payloads, carried = await self.upstream.delta.fetch_payloads(manifest)
        buffers = [torch.empty(b.nbytes, dtype=torch.uint8) for b in manifest.buckets]
        await self.upstream.delta.rebuild(manifest, payloads, base_buffers, buffers)
        chunk = min(max(manifest.chunk_bytes, 4096), MAX_CHUNK_BYTES)
        sources = [_FillingSource(b, chunk) for b in buffers]
        for src, b in zip(sources, manifest.buckets, strict=True):
            src.mark(0, b.nbytes)  # rebuilt and verified: every byte is here
        # the full version's buckets as the publisher's (encodings off), its segments and device buffer not ours to name
        plain = tuple(replace(b, shm_segment="", ipc_offset=-1, ipc_checksum="", encoding="", delta_nbytes=0, delta_checksum="")
                      for b in manifest.buckets)
        served = ServedVersion(version=version, publisher_id=manifest.publisher_id, buckets=plain, sources=list(sources),
                               chunk_bytes=manifest.chunk_bytes, adapter=manifest.adapter, adapter_on=manifest.adapter_on,
                               base_on=manifest.base_on)
        summary = wire_summary(version, manifest.buckets, manifest.delta_base)
        payload = ServedVersion(version=version, publisher_id=manifest.publisher_id, chunk_bytes=manifest.chunk_bytes,
                                buckets=tuple(BucketInfo(index=i, dtype="uint8", nbytes=b.delta_nbytes, checksum=b.delta_checksum)
                                              for i, b in enumerate(carried)),
                                sources=[TensorSource(p) for p in (payloads[b.index] for b in carried) if p is not None])
        served.delta = DeltaServed(base=base.version, buckets=tuple(replace(b, shm_segment="", ipc_offset=-1, ipc_checksum="") for b in manifest.buckets),
                                   payload=payload, changed_fraction=summary.changed_fraction,
                                   bytes_by_encoding={k: n for k, n in summary.bytes_by_encoding.items() if k != "full"})
        served.delta_state = "ready"
        self.delta_versions += 1
        self._server.note_delta(served)
        self._serve(served, buffers)
        return version

    async def _follow_full(self, manifest: Manifest, *, declined: bool, latest: bool = True) -> int:
        """Fetch a full version, serving its chunks downstream as they arrive; the delta against the version before it
        is computed here once it is all here, unless upstream `declined` to send one. `latest` False: an older version
        fetched besides the latest (the adapter version on under it), not announced."""
        version = manifest.version
        chunk = min(max(manifest.chunk_bytes, 4096), MAX_CHUNK_BYTES)
        buffers = [torch.empty(b.nbytes, dtype=torch.uint8) for b in manifest.buckets]
        sources = [_FillingSource(buf, chunk, checksummed=bool(b.checksum)) for buf, b in zip(buffers, manifest.buckets, strict=True)]
        served = ServedVersion(
            version=version,
            publisher_id=manifest.publisher_id,
            # checksums and publisher id pass through; the publisher's segments and device buffer do not (we serve from our memory)
            buckets=tuple(replace(b, shm_segment="", ipc_offset=-1, ipc_checksum="") for b in manifest.buckets),
            sources=list(sources),
            chunk_bytes=manifest.chunk_bytes,
            adapter=manifest.adapter,
            adapter_on=manifest.adapter_on,
            base_on=manifest.base_on,
        )
        if self._delta_on and not declined:
            self._server.expect_delta(served)  # its subscribers holding the version before get the changed elements
        self._server.add_version(served, announce=latest)
        try:
            await self.upstream.fetch_into(manifest, buffers, sink=_Forwarder(self._server, version, sources))
        except BaseException:
            self._server.drop_version(version, code="unavailable")
            raise
        # bytes all here now; recomputed from the two versions the relay holds, so a relay that missed the base
        # (it holds no version before this one) serves full versions only
        self._server.start_delta(version)
        self._held[version] = buffers
        if latest:
            self._done(served)
        return version

    def _serve(self, served: ServedVersion, buffers: list[torch.Tensor]) -> None:
        """A version rebuilt and verified here: served and announced downstream."""
        self._server.add_version(served)
        self._held[served.version] = buffers
        self._done(served)

    def _done(self, served: ServedVersion) -> None:
        version = served.version
        self._latest = version
        self.versions_fetched += 1
        for old in sorted(self._server.versions)[: -self.keep_versions]:
            if old not in (served.adapter_on, served.base_on):  # the adapter on under the latest, or its base: kept
                self._server.drop_version(old)
        for old in [v for v in self._held if v not in self._server.versions]:
            del self._held[old]
        self.metrics.event("version_relayed", {"relay": self.relay_id, "version": version, "bytes": served.total_bytes})
        log.info("relay %s: version %d complete (%d bytes)", self.relay_id, version, served.total_bytes)

