"""Delta versions (protocol minor 18): a version carried as its changed bytes against a base the subscriber holds.

Both ends: the server end is `rollpool.weights.serving.WeightServer.make_delta` (a version's delta against the one
before it, computed from the host copies, answered to a manifest request that names the base it holds); this file
holds the subscriber's end, `DeltaPath`: the base it holds and the rebuild of a version from it.

What it promises
    - The base is the newest version fetched, when it was fetched whole into host buffers (`hold`); it is held until
      the next version is verified, so its buffer goes back to the subscriber's buffers then, not when its caller
      recycles it (`holds` tells the caller so). A version that lands on a device (the same GPU, shared memory staged
      to a GPU) leaves no base: the host copy of the version before it is stale (servers offer a delta against the
      version just before only), so no request names it and its buffer goes back.
    - A delta's encoded buckets travel on the network path (`NetworkPath`, each payload verified against its own
      checksum); each rebuilt bucket is verified against the checksum of the resulting bytes, so a rebuilt version is
      bit-identical to the full one or refused.
    - Anything that keeps the version from being rebuilt (no base, another publisher's base, buckets that do not line
      up, a corrupt delta) raises `WeightSyncError` or `rollpool.weights.delta.DeltaError`, and the caller fetches
      the full version instead (counted). Nothing is handed to ``on_bucket`` before every bucket verified.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch

from rollpool.protocol.errors import WeightSyncError
from rollpool.protocol.messages import BucketInfo, Manifest
from rollpool.weights.bucketing import unpack_buckets, verify_checksum
from rollpool.weights.delta import UNCHANGED, decode_bucket, itemsize_of, same_layout
from rollpool.weights.manifest import NETWORK, check_manifest
from rollpool.weights.memory import VersionBuffers
from rollpool.weights.paths.base import BucketCallback, Fetched, FetchJob, WeightVersion
from rollpool.weights.paths.network import NetworkPath

__all__ = ["DeltaPath"]


class DeltaPath:
    """The subscriber's end of delta versions (see the module docstring)."""

    def __init__(self, network: NetworkPath, buffers: VersionBuffers, *, enabled: bool, threads: int) -> None:
        self.network = network
        self.buffers = buffers
        self.enabled = enabled
        """`WeightPathConfig.weight_delta`: off, no base is held (and none asked for)."""
        self.threads = threads
        self.base: WeightVersion | None = None
        """The newest version fetched into host buffers: the base a delta version is rebuilt from."""
        self._base_recycled = False
        self.versions = 0
        """Versions rebuilt from a delta."""
        self.fallbacks = 0
        """Delta versions that could not be rebuilt (no base, a corrupt or evicted delta): fetched full instead."""
        self._pool: ThreadPoolExecutor | None = None

    def base_version(self) -> int:
        """The version a manifest request names as its base (-1: none held)."""
        return self.base.version if self.base is not None else -1

    def hold(self, wv: WeightVersion, *, on_device: bool = False) -> WeightVersion:
        """A version just fetched: in host buffers, it becomes the base of the next delta; on a device (`on_device`),
        no base is held after it. The previous base's buffer goes back to the buffers if its caller already recycled it
        (else when it does)."""
        if not self.enabled:
            return wv
        host = wv.slab is not None and not on_device and not wv.slab.is_cuda
        old, recycled = self.base, self._base_recycled
        self.base, self._base_recycled = (wv if host else None), False
        if old is not None and recycled and old.slab is not None:
            self.buffers.give(old.slab)
        return wv

    def holds(self, old: WeightVersion) -> bool:
        """`old` is being recycled: True (and noted) when it is still the base, whose buffer goes back later."""
        if self.base is not None and old.slab is not None and old.slab is self.base.slab:
            self._base_recycled = True
            return True
        return False

    def close(self) -> None:
        self.base = None
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    async def fetch(self, manifest: Manifest, on_bucket: BucketCallback | None) -> Fetched:
        """Rebuild `manifest`'s version from the base held here and the encoded buckets (fetched over the network
        path), each bucket verified against the checksum of its resulting bytes; raises `WeightSyncError` or
        `DeltaError` (the caller then fetches the full version)."""
        base = self.base
        if base is None or base.version != manifest.delta_base:
            held = "none" if base is None else str(base.version)
            raise WeightSyncError(f"the base is not held here (holding {held})")
        if base.manifest.publisher_id != manifest.publisher_id:
            raise WeightSyncError(f"the base came from publisher {base.manifest.publisher_id!r}, the delta from {manifest.publisher_id!r}")
        if not same_layout(manifest.buckets, base.manifest.buckets):
            raise WeightSyncError("the base's buckets do not line up with the delta's")
        payloads, _carried = await self.fetch_payloads(manifest)
        await self.buffers.reserved()
        slab, buffers = self.buffers.take([b.nbytes for b in manifest.buckets], manifest.version)
        try:
            await self.rebuild(manifest, payloads, base.buffers, buffers)
        except BaseException:
            self.buffers.pool.give([slab])
            raise
        self.versions += 1
        tensors_of = unpack_buckets(zip(manifest.buckets, buffers, strict=True))
        if on_bucket is not None:
            for b in manifest.buckets:
                names = {t.name for t in b.tensors}
                res = on_bucket(b.index, {n: tensors_of[n] for n in names})
                if asyncio.iscoroutine(res):
                    await res
        return Fetched(manifest, buffers, slab, NETWORK, {"delta_base": manifest.delta_base, "delta_bytes": sum(b.delta_nbytes for b in manifest.buckets)})

    async def fetch_payloads(self, manifest: Manifest) -> tuple[list[torch.Tensor | None], list[BucketInfo]]:
        """A delta manifest's encoded buckets over the network path, each verified against its own checksum: per bucket
        its payload (None: unchanged), and the buckets that carry bytes (the payload's dense numbering, as served)."""
        carried = [b for b in manifest.buckets if b.encoding != UNCHANGED]
        payload_manifest = replace(manifest, buckets=tuple(BucketInfo(index=i, dtype="uint8", nbytes=b.delta_nbytes, checksum=b.delta_checksum)
                                                           for i, b in enumerate(carried)), host_key="", cuda_ipc=None, bulk_port=0)
        scratch = torch.empty(sum(-(-b.delta_nbytes // 8) * 8 for b in carried), dtype=torch.uint8)
        views, at = [], 0
        for b in carried:  # each payload 8-byte aligned: decoded through int32 and element views
            views.append(scratch[at : at + b.delta_nbytes])
            at += -(-b.delta_nbytes // 8) * 8
        if carried:
            await self.network.fetch(FetchJob(check_manifest(payload_manifest), buffers=views, slab=scratch))
        payloads: list[torch.Tensor | None] = [None] * len(manifest.buckets)
        for b, view in zip(carried, views, strict=True):
            payloads[b.index] = view
        return payloads, carried

    async def rebuild(self, manifest: Manifest, payloads: Sequence[torch.Tensor | None], base: Sequence[torch.Tensor],
                      out: Sequence[torch.Tensor]) -> None:
        """Write each bucket of `manifest`'s version into `out` from `base` and its payload (in `threads` threads) and
        verify it against the checksum of the resulting bytes; `WeightSyncError` or `DeltaError` if any does not match."""
        if len(base) != len(manifest.buckets) or len(out) != len(manifest.buckets):
            raise WeightSyncError("the base's buckets do not line up with the delta's")

        def one(i: int) -> bool:
            b = manifest.buckets[i]
            decode_bucket(b.encoding, payloads[i], base[i], out[i], itemsize_of(b.dtype))
            return verify_checksum(b.checksum, out[i].numpy().data if b.nbytes else b"")

        oks = await asyncio.to_thread(lambda: list(self._threads().map(one, range(len(manifest.buckets)))))
        bad = [i for i, ok in enumerate(oks) if not ok]
        if bad:
            raise WeightSyncError(f"buckets {bad} rebuilt from the delta do not match their checksums")

    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="weights-rebuild")
        return self._pool
