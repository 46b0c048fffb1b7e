"""`WeightSync`: the worker's one weight apply path.

    fetch -> stage -> ApplyRequest / ApplyGrant -> pause(mode), update_weights, resume -> ApplyDone

- Fetch: a `WeightSubscriber` (from `rollpool.weights`, or the injected factory) fetches
  a newer version whole and verified while generation goes on. The broker names its
  endpoint (or ``weight_endpoint`` names a node-local relay). Each welcome and broker
  heartbeat names the newest version (`note_weights`).
- Stage: an engine that can (`StagingEngine`) copies the version to its device before
  the pause. A staging failure is logged; the apply copies during the pause instead.
- Grant: the broker grants apply slots, so only a bounded number of workers pause at
  once. The ask is repeated after ``apply_grant_timeout_s``, the wait doubling up to
  4x that, at most ``weight_retries`` times. A version whose grant never comes is skipped.
  An adapter version for an engine that serves it without a pause (``adapters_without_pause``)
  asks for no slot when the broker said it needs none (``adapters_need_grant``,
  `Feature.ADAPTER_NO_GRANT`: not in fleet activation); its `ApplyDone` is sent all the same.
- Apply and done: pause in the configured mode (or the engine's first mode), update,
  resume, then `ApplyDone` with the outcome.
- A version the engine refuses after checking it, before writing anything
  (`WeightsRefusedError`: an unknown parameter name, a shape mismatch) is reported
  (`ApplyDone` with the error), skipped and never retried; the engine is resumed and
  keeps serving its version, no restart.
- Any other failed apply takes the engine out of service (`EngineSupervisor.fail`). The restart
  gives the fresh engine the whole version through this same path, without grant and
  done, since that engine serves nothing yet. If that fails too, the next attempt gives
  it the last good version, and the bad version is skipped: reported, never retried
  forever: the broker is told (`ApplyDone(skipped=True)` with the reason). The worker then follows
  the next version.
- An apply (pause, update, resume) longer than ``apply_timeout_s`` counts as failed (the
  engine is restarted); the broker frees a slot held past its ``apply_slot_deadline_s``
  anyway, and answers a repeated ApplyRequest from the slot's holder with the grant again.
- The subscriber follows the publisher: when a welcome or heartbeat names other
  endpoints than it is connected to (a trainer restarted its publisher on new ports),
  it reconnects there.
- A fetch that fails is retried with a backoff (``reconnect_backoff_s`` doubling to
  ``reconnect_backoff_max_s``), at most ``weight_retries`` times, then the version is skipped.
- A whole-model version whose manifest names an adapter version on under it
  (`Manifest.adapter_on`) that the engine does not have on (the worker joined after
  it) is applied with that adapter version: fetched and verified like any version,
  given to the engine first inside the same pause (no sample runs on that adapter over
  the old base), counted in ``adapters_joined``. One that cannot be fetched (evicted) or
  that the engine refuses: the whole-model version is skipped (reported, counted in
  ``adapter_on_fallbacks``), never served without the adapter its tokens would claim. A
  whole-model version the engine refuses after that adapter was given to it takes the
  engine out of service (the adapter is on over a base no version names).
- The other way round, an adapter version whose manifest names the whole-model version it
  applies over (`Manifest.base_on`) that the engine does not serve (the worker joined
  after adapter versions over it) is applied with that whole-model version: fetched and
  verified like any version, given to the engine first inside the same pause, counted
  in ``bases_joined``. One that cannot be fetched or that the engine refuses: the
  adapter version is skipped (reported, counted in ``base_on_fallbacks``), never served
  over another base. An adapter refused after its base was given to the engine takes
  the engine out of service.
- Memory: at most two versions are held, the one served (kept to re-apply after a
  restart) and the one being fetched, plus, while a whole-model version is served over a
  LoRA adapter version, that adapter version (the engines keep it on across whole-model
  versions, docs/lora.md): a restarted engine is given it first, then the whole-model
  version, so it serves what the engine it replaces served. The other way round, while an
  adapter version is served over a whole-model version, that whole-model version stays held
  (the same bytes as while it was served) and a restarted engine is given it under the
  adapter, never the adapter over the model it loaded from disk. Once a newer version is served,
  the previous one's buffers go back to the subscriber for the next fetch.
- The served version has one owner, the worker's session (`WorkerSession.version`): this
  class reads it through the ``served_version`` hook and reports each change through
  ``on_apply_finished``; it keeps no copy of its own.

Imports `engine_supervisor`, `link`, `engines` (the seam) and `config`; never the session.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

from rollpool.protocol.errors import EngineError, WeightsRefusedError, WeightSyncError
from rollpool.protocol.messages import ApplyDone, ApplyRequest
from rollpool.protocol.metrics import MetricsSink
from rollpool.protocol.sockets import SocketFactory
from rollpool.weights.config import WeightPathConfig
from rollpool.weights.paths.base import WeightVersionGoneError
from rollpool.workers.config import WorkerConfig
from rollpool.workers.engine_supervisor import EngineSupervisor
from rollpool.workers.engines.base import AdapterEngine, Engine, SizedEngine, StagingEngine
from rollpool.workers.link import BrokerLink

__all__ = ["BucketHook", "BucketStagingEngine", "FetchNotingEngine", "FetchedVersion", "Subscriber", "SubscriberFactory", "WeightSync"]

log = logging.getLogger(__name__)


class FetchedVersion(Protocol):
    """A complete, verified version (`rollpool.weights.WeightVersion`)."""

    @property
    def version(self) -> int: ...

    @property
    def tensors(self) -> Mapping[str, Any]: ...


BucketHook = Callable[[int, Mapping[str, Any]], Any]
"""``on_bucket(index, tensors)``: one bucket of the version being fetched verified (the version is not whole yet)."""


class Subscriber(Protocol):
    """What the worker uses of `rollpool.weights.WeightSubscriber`."""

    def connect(self, router_endpoint: str, pub_endpoint: str | None = None) -> None: ...

    def note_version(self, version: int) -> None: ...

    def forget_newer(self, version: int) -> None:
        """The pool was rebased to `version`: versions known above it are forgotten."""

    async def wait_for_newer(self, than: int) -> int: ...

    async def fetch(self, version: int | None = None, *, on_bucket: BucketHook | None = None) -> FetchedVersion: ...

    def recycle(self, old: Any) -> None: ...

    def reserve_in_background(self, total_bytes: int, versions: int = 2) -> None:
        """Allocate buffers for `versions` versions of `total_bytes` in a thread; the next fetch waits for it."""

    def close(self) -> None: ...


class SubscriberFactory(Protocol):
    """Makes the worker's subscriber (`rollpool.weights.WeightSubscriber` itself, or a fake of that edge).

    ``pin_memory``: the engine is on a GPU (page-locked buckets). ``stage_device``: its CUDA device, when the engine
    stages bucket by bucket (`BucketStagingEngine`) and `WeightPathConfig.weight_shm_to_device` is on: shared-memory
    buckets are then copied straight to it. ``weights``: `WorkerConfig.weights`, every weight-path knob."""

    def __call__(self, sockets: SocketFactory, *, worker_id: str, fetch_timeout_s: float, window_chunks: int, max_refetch: int,
                 pin_memory: bool, stage_device: str | None, weights: WeightPathConfig) -> Subscriber: ...


@runtime_checkable
class FetchNotingEngine(Protocol):
    """An engine whose apply record says how the version was fetched (the SGLang engine: where a delta was rebuilt)."""

    def note_fetch(self, version: int, details: Mapping[str, Any]) -> None: ...


@runtime_checkable
class BucketStagingEngine(Protocol):
    """An engine that copies each verified bucket to its device while the next one arrives (the SGLang engine)."""

    def stage_bucket(self, version: int, tensors: Mapping[str, Any]) -> None: ...


@dataclass(frozen=True, slots=True)
class _Version:
    tensors: Mapping[str, Any]
    version: int
    fetched: FetchedVersion | None = None
    """The subscriber's version object holding the buffers (None for tensors given directly)."""
    under: _Version | None = None
    """Applied first, in the same pause. A whole-model version: the adapter version its manifest names as on under it
    (`Manifest.adapter_on`), fetched because this worker did not have it on. An adapter version: the whole-model version
    its manifest names as its base (`Manifest.base_on`), fetched because the engine did not serve it."""


def _adapter_of(version: _Version) -> Any:
    """The version's `AdapterSpec` when it is a LoRA adapter version, else None."""
    return getattr(getattr(version.fetched, "manifest", None), "adapter", None)


def _adapter_on_of(fetched: FetchedVersion) -> int:
    """The adapter version a fetched whole-model version names as on under it (`Manifest.adapter_on`), else -1."""
    manifest = getattr(fetched, "manifest", None)
    if getattr(manifest, "adapter", None) is not None:
        return -1
    return int(getattr(manifest, "adapter_on", -1))


def _base_on_of(fetched: FetchedVersion) -> int:
    """The whole-model version a fetched adapter version names as its base (`Manifest.base_on`), else -1."""
    manifest = getattr(fetched, "manifest", None)
    if getattr(manifest, "adapter", None) is None:
        return -1
    return int(getattr(manifest, "base_on", -1))


def _intact(version: _Version) -> bool:
    """Whether a version's tensors (and those of the version applied with it) still hold it: a version held on the
    engine's GPU is written over in place by the next one (`rollpool.weights.WeightVersion.intact`)."""
    if not bool(getattr(version.fetched, "intact", True)):
        return False
    return version.under is None or _intact(version.under)


async def _import_subscriber_module() -> None:
    # importing the weight channel imports torch (seconds): off the loop, so heartbeats keep their beat
    await asyncio.to_thread(importlib.import_module, "rollpool.weights.subscriber")


class WeightSync:
    """Follows the newest weight version and applies it (see the module docstring)."""

    def __init__(
        self,
        config: WorkerConfig,
        sockets: SocketFactory,
        link: BrokerLink,
        supervisor: EngineSupervisor,
        metrics: MetricsSink,
        *,
        served_version: Callable[[], int],
        subscriber_factory: SubscriberFactory | None = None,
        on_apply_started: Callable[[], None] = lambda: None,
        on_apply_finished: Callable[[int | None], None] = lambda version: None,
        adapters_need_grant: Callable[[], bool] = lambda: True,
    ) -> None:
        self.config = config
        self.worker_id = config.worker_id
        self.sockets = sockets
        self.link = link
        self.supervisor = supervisor
        self.metrics = metrics
        self.on_apply_started = on_apply_started
        self.on_apply_finished = on_apply_finished
        """Told the version served after each apply (None: the apply failed): how the served version's owner learns it."""
        self._served_version = served_version
        self.adapters_need_grant = adapters_need_grant
        """Whether an adapter version asks for an apply slot (False: the broker said it needs none, `Feature.ADAPTER_NO_GRANT`)."""
        self.grants_skipped = 0
        """Adapter versions applied without asking for an apply slot."""
        self.adapters_joined = 0
        """Adapter versions fetched and applied with a whole-model version whose manifest names them as on under it
        (`Manifest.adapter_on`): this worker did not have them on (it joined, or missed them)."""
        self.adapter_on_fallbacks = 0
        """Whole-model versions skipped because the adapter version on under them could not be fetched (evicted) or
        was refused: never served without it (their tokens would name a policy they were not sampled under)."""
        self.bases_joined = 0
        """Whole-model versions fetched and applied with an adapter version whose manifest names them as its base
        (`Manifest.base_on`): the engine did not serve them (this worker joined after them, or missed them)."""
        self.base_on_fallbacks = 0
        """Adapter versions skipped because the whole-model version they apply over could not be fetched (evicted) or
        was refused: never served over another base (their tokens would name a policy they were not sampled under)."""
        self.skipped = -1
        """The newest version given up on (its fetch, grant or apply kept failing)."""
        self.subscriber: Subscriber | None = None
        self._subscriber_factory = subscriber_factory
        self._subscriber_ready = asyncio.Event()
        self._endpoints: tuple[str | None, str | None] = (None, None)
        """(weight endpoint, announce endpoint) the subscriber is connected to."""
        self._served: _Version | None = None
        self._adapter_on: _Version | None = None
        """The adapter version still on under `_served` when that is a whole-model version applied after it."""
        self._base_under = -1
        """The whole-model version the engine serves under `_served` when that is an adapter version (-1: its model
        from disk)."""
        self._base_held: _Version | None = None
        """That whole-model version itself (its buffers kept), so a restarted engine is given it under the adapter."""
        self._reapply_target: _Version | None = None
        self._served_abandoned = False
        """`_served` is of an abandoned run (`rebase`): served again to a fresh engine, it counts as version -1."""
        self._lock = asyncio.Lock()
        self._grants: dict[int, asyncio.Future[None]] = {}
        self._paused_for_apply = False
        """The apply in progress paused the engine (an adapter version for an `adapters_without_pause` engine does not)."""
        supervisor.reapply = self._reapply

    @property
    def version(self) -> int:
        """The version the engine serves (read from its owner, the worker's session)."""
        return self._served_version()

    async def prepare(self) -> None:
        """Import the real subscriber's module (torch) off the event loop, before the first hello."""
        if self._subscriber_factory is None:
            await _import_subscriber_module()

    # ------------------------------------------------------------------ broker side

    def engine_started(self) -> None:
        """The engine is up. On a GPU, with `weight_bytes` known, the subscriber is made now (connected when the broker
        names a publisher) and page-locks its buffers for `weight_reserve_versions` versions in a thread: a trainer's
        first version then finds them ready, instead of waiting seconds per GB for them (docs/weights.md, "No cold version")."""
        versions = self.config.weight_reserve_versions
        engine = self.supervisor.engine
        if self.subscriber is not None or versions < 1 or engine is None:
            return
        if not str(engine.info().device or "").startswith("cuda") or not isinstance(engine, SizedEngine):
            return
        try:
            nbytes = int(engine.weight_bytes())
        except Exception:  # an estimate only: the first fetch allocates instead
            log.warning("weight sync: the engine's weight_bytes() failed; buffers are allocated at the first fetch",
                        exc_info=True, extra={"worker": self.worker_id})
            return
        sub = self._make_subscriber()
        self.subscriber = sub
        if self.config.weights.weight_reserve_bytes:
            return  # an explicit size: the subscriber reserved that at its making
        if nbytes > 0:
            log.info("weight sync: reserving buffers for %d versions of %.2f GB at engine start", versions, nbytes / 1e9,
                     extra={"worker": self.worker_id})
            sub.reserve_in_background(nbytes, versions)

    def note_weights(self, version: int, endpoint: str | None, announce: str | None) -> None:
        """The broker named the newest version and the publisher's endpoints (welcome, heartbeat)."""
        if self.config.weight_endpoint:  # a node-local relay overrides what the broker names
            endpoint, announce = self.config.weight_endpoint, self.config.weight_announce_endpoint
        if endpoint and self._endpoints[0] is None:
            if self.subscriber is None:
                self.subscriber = self._make_subscriber()
            self.subscriber.connect(endpoint, announce)
            self._endpoints = (endpoint, announce)
            self._subscriber_ready.set()
        elif endpoint and self.subscriber is not None and (endpoint, announce) != self._endpoints:
            # the publisher came back elsewhere (a trainer restart): follow the endpoint the broker names now
            log.warning("weight publisher moved %s -> %s; reconnecting the subscriber", self._endpoints[0], endpoint,
                        extra={"worker": self.worker_id})
            self.metrics.event("weight_publisher_moved", {"worker_id": self.worker_id, "from": self._endpoints[0], "to": endpoint})
            self._endpoints = (endpoint, announce)
            self.subscriber.connect(endpoint, announce)
        if self.subscriber is not None and version >= 0:
            self.subscriber.note_version(version)

    def rebase(self, version: int) -> None:
        """The pool was rebased to `version` (a trainer resumed from a checkpoint): a version above it, served,
        skipped or known to the subscriber, is of an abandoned run. Forgotten, so the next version the publisher
        offers is applied whatever its number; the engine serves the old weights until then (the broker gives
        this worker nothing meanwhile when a staleness bound is set). The served version itself was forgotten by its
        owner, the session, which asked for this rebase."""
        if self.skipped > version or version < -1:
            self.skipped = -1
        if self._reapply_target is not None and (self._reapply_target.version > version or version < -1):
            self._reapply_target = None
        if self._served is not None and (self._served.version > version or version < -1):
            self._served_abandoned = True  # a fresh engine still gets these weights, but not their number
        if self.subscriber is not None:
            self.subscriber.forget_newer(version)

    def on_grant(self, version: int) -> None:
        fut = self._grants.get(version)
        if fut is not None and not fut.done():
            fut.set_result(None)

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        """Fetch every newer version and apply it; bounded retries, then the version is skipped."""
        await self._subscriber_ready.wait()
        sub = self.subscriber
        assert sub is not None
        failures = 0
        while True:
            target = await sub.wait_for_newer(max(self.version, self.skipped))
            if target <= max(self.version, self.skipped):
                continue
            try:
                fetched = await self._fetch(sub, target)
            except WeightSyncError as exc:
                failures += 1
                if failures >= self.config.weight_retries:
                    await self._skip(target, f"fetch failed {failures} times: {exc}")
                    failures = 0
                    continue
                delay = self.fetch_backoff_s(failures)
                log.warning("weight version %d not fetched (%s); retrying in %.1fs", target, exc, delay, extra={"worker": self.worker_id})
                await asyncio.sleep(delay)
                continue
            try:
                under = await (self._fetch_base_on(sub, fetched) if _base_on_of(fetched) >= 0 else self._fetch_adapter_on(sub, fetched))
            except WeightVersionGoneError as exc:  # not served any more: retrying cannot help
                failures = 0
                await self._under_missing(fetched, f"the publisher no longer serves it ({exc})")
                continue
            except WeightSyncError as exc:
                failures += 1
                if failures >= self.config.weight_retries:
                    failures = 0
                    await self._under_missing(fetched, f"its fetch failed {self.config.weight_retries} times ({exc})")
                    continue
                self._recycle(fetched)
                delay = self.fetch_backoff_s(failures)
                log.warning("version %d (applied with version %d) not fetched (%s); retrying in %.1fs",
                            max(_adapter_on_of(fetched), _base_on_of(fetched)), target, exc, delay, extra={"worker": self.worker_id})
                await asyncio.sleep(delay)
                continue
            failures = 0
            try:
                await self.apply(fetched.tensors, int(fetched.version), fetched=fetched, under=under)
            except WeightSyncError as exc:
                await self._skip(int(fetched.version), str(exc))

    def _adapter_on_now(self) -> int:
        """The adapter version the engine has on now (the served version, or the one under it), else -1."""
        if self._served is not None and _adapter_of(self._served) is not None:
            return self._served.version
        return self._adapter_on.version if self._adapter_on is not None else -1

    async def _fetch_adapter_on(self, sub: Subscriber, fetched: FetchedVersion) -> _Version | None:
        """The adapter version `fetched` names as on under it (`Manifest.adapter_on`), fetched and verified like any
        version, when the engine does not have it on (a late joiner); None when nothing is to be fetched."""
        wanted = _adapter_on_of(fetched)
        if wanted < 0 or wanted == self._adapter_on_now():
            return None
        got = await sub.fetch(wanted)
        if int(got.version) != wanted or getattr(getattr(got, "manifest", None), "adapter", None) is None:
            self._recycle(got)
            raise WeightSyncError(f"version {fetched.version} names adapter version {wanted} as on under it, and the publisher "
                                  f"served version {got.version}, which is not that adapter")
        log.info("weight version %d runs on adapter version %d, which this worker does not have on: fetched, applied with it",
                 fetched.version, wanted, extra={"worker": self.worker_id})
        return _Version(got.tensors, wanted, got)

    def _base_now(self) -> int:
        """The whole-model version the engine serves now (the served version, or the one under it), else -1 (its model
        from disk)."""
        if self._served is None:
            return -1
        return self._base_under if _adapter_of(self._served) is not None else self._served.version

    async def _fetch_base_on(self, sub: Subscriber, fetched: FetchedVersion) -> _Version | None:
        """The whole-model version adapter version `fetched` names as its base (`Manifest.base_on`), fetched and verified
        like any version, when the engine does not serve it (a late joiner); None when nothing is to be fetched."""
        wanted = _base_on_of(fetched)
        if wanted < 0 or wanted == self._base_now():
            return None
        got = await sub.fetch(wanted)
        if int(got.version) != wanted or getattr(getattr(got, "manifest", None), "adapter", None) is not None:
            self._recycle(got)
            raise WeightSyncError(f"adapter version {fetched.version} names version {wanted} as its base, and the publisher "
                                  f"served version {got.version}, which is not that whole-model version")
        log.info("adapter version %d applies over version %d, which this worker's engine does not serve: fetched, applied "
                 "first", fetched.version, wanted, extra={"worker": self.worker_id})
        return _Version(got.tensors, wanted, got)

    async def _under_missing(self, fetched: FetchedVersion, why: str) -> None:
        """`fetched` is served with a version this worker cannot get (`_Version.under`): an adapter version over the
        whole-model version it applies over (`Manifest.base_on`), or a whole-model version with the adapter version on
        under it (`Manifest.adapter_on`). Skipped (reported, the last good version served on), never served without it."""
        version, base = int(fetched.version), _base_on_of(fetched)
        if base >= 0:
            self.base_on_fallbacks += 1
            event, key, wanted = "base_on_missing", "base_version", base
            said = (f"it applies over version {base} (Manifest.base_on), which this worker's engine does not serve and "
                    f"could not get: {why}; not served over another base")
        else:
            self.adapter_on_fallbacks += 1
            event, key, wanted = "adapter_on_missing", "adapter_version", _adapter_on_of(fetched)
            said = (f"it runs on adapter version {wanted} (Manifest.adapter_on), which this worker does not have on and "
                    f"could not get: {why}; not served without it")
        self.metrics.event(event, {"worker_id": self.worker_id, "version": version, key: wanted, "why": why})
        self._recycle(fetched)
        await self._skip(version, said)

    def _recycle(self, fetched: Any) -> None:
        if fetched is not None and self.subscriber is not None:
            self.subscriber.recycle(fetched)

    async def _fetch(self, sub: Subscriber, target: int) -> FetchedVersion:
        """Fetch `target`; an engine that stages bucket by bucket (`BucketStagingEngine`) gets each bucket as it
        verifies, so its copy to the device overlaps the fetch of the next one."""
        engine = self.supervisor.engine
        if not isinstance(engine, BucketStagingEngine):
            return await sub.fetch(target)
        hook = engine.stage_bucket
        broken = False

        def on_bucket(_index: int, tensors: Mapping[str, Any]) -> None:
            nonlocal broken
            if broken:
                return
            try:
                hook(target, tensors)
            except Exception as exc:  # noqa: BLE001 - staging is an optimisation: stage_weights copies what is missing
                broken = True
                log.warning("staging weight version %d bucket by bucket failed (%s); it is staged whole after the fetch", target, exc,
                            extra={"worker": self.worker_id})

        return await sub.fetch(target, on_bucket=on_bucket)

    def fetch_backoff_s(self, failures: int) -> float:
        return float(min(self.config.reconnect_backoff_s * 2 ** (failures - 1), self.config.reconnect_backoff_max_s))

    def grant_wait_s(self, ask: int) -> float:
        """How long ask `ask` (1-based) waits for its grant before asking again."""
        t = self.config.apply_grant_timeout_s
        return float(min(t * 2 ** (ask - 1), 4 * t))

    # ------------------------------------------------------------------ the one apply path

    async def apply(self, named_tensors: Mapping[str, Any], version: int, *, fetched: FetchedVersion | None = None,
                    under: _Version | None = None) -> bool:
        """Apply a whole version through the rolling-update flow; True when the engine serves it. `under`: the adapter
        version on under it, which the engine does not have on (`_fetch_adapter_on`), applied first in the same pause.

        Raises `WeightSyncError` when no grant came after ``weight_retries`` asks.
        """
        async with self._lock:
            if version <= self.version:
                return True
            await self.supervisor.ok.wait()
            applied = await self._apply(_Version(named_tensors, version, fetched, under), engine=None)
            if applied:
                return True
            if self.skipped >= version:
                return False  # refused and skipped (no restart under way)
            # the engine is being replaced and given the whole version; wait for it (or for the fallback)
            await self.supervisor.ok.wait()
            self._reapply_target = None  # a restart already under way when the apply failed did not see it
            return self.version >= version

    async def _apply(self, target: _Version, *, engine: Engine | None) -> bool:  # noqa: C901 - over 13 since the apply-slot and skip reports; to split into grant and run steps
        """stage -> grant -> pause/update/resume -> done, on the serving engine (engine None) or a fresh one.

        A fresh engine (a restart) takes no grant and sends no ApplyDone, and a failure
        raises `EngineError` for the supervisor to retry. On the serving engine a failure
        takes the engine out of service and returns False.
        """
        fresh = engine is not None
        version = target.version
        if not _intact(target):
            # its tensors view device buffers a newer version was written into since: never applied under this number
            why = f"version {version}'s buffers on the GPU hold a newer version by now"
            if fresh:
                raise WeightsRefusedError(why)
            raise WeightSyncError(why)
        if engine is None:
            engine = self.supervisor.engine
            assert engine is not None
        await self._stage(engine, target)
        if not fresh:
            if self._needs_grant(engine, target):
                await self._wait_grant(version)
            else:
                self.grants_skipped += 1
            await self.supervisor.ok.wait()  # a restart while waiting: apply to its engine
            engine = self.supervisor.engine
            assert engine is not None
        self.on_apply_started()
        t0 = time.monotonic()
        error: str | None = None
        refused = False
        try:
            await asyncio.wait_for(self._pause_update_resume(engine, target), self.config.apply_timeout_s)
        except WeightsRefusedError as exc:  # checked before anything was written: the engine serves its version intact
            error, refused = f"{type(exc).__name__}: {exc}", True
            try:
                if getattr(self, "_paused_for_apply", True):  # an adapter applied without a pause has nothing to resume
                    await engine.resume()
            except asyncio.CancelledError:
                raise
            except Exception as rexc:  # noqa: BLE001 - an engine that cannot resume is failed after all
                error, refused = f"{error}; then resume failed: {rexc}", False
        except TimeoutError:  # a wedged update (a hung device copy): the engine is restarted like any failed apply
            error = f"apply timed out after {self.config.apply_timeout_s:g}s"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure here means a restart
            error = f"{type(exc).__name__}: {exc}"
        duration_s = time.monotonic() - t0
        if not fresh:
            await self.link.send(ApplyDone(version=version, ok=error is None, duration_s=duration_s, error=_short(error)))
        if error is None:
            self._served_now(target)
            self.on_apply_finished(version)
            self.metrics.event("version_applied", {"worker_id": self.worker_id, "version": version, "duration_s": duration_s})
            log.info("applied weight version %d in %.3fs%s", version, duration_s, " (restarted engine)" if fresh else "",
                     extra={"worker": self.worker_id})
            return True
        self.on_apply_finished(None)
        self.metrics.event("apply_failed", {"worker_id": self.worker_id, "version": version, "error": error})
        if refused:
            # a version the engine refuses (a poison version): reported (ApplyDone above), skipped, never retried;
            # the engine keeps serving the last good version and no restart is needed
            await self._skip(version, error)
            if fresh:
                raise WeightsRefusedError(f"version {version} refused by the restarted engine: {error}")
            return False
        if fresh:
            raise EngineError(f"applying version {version} to the restarted engine failed: {error}")
        log.error("apply of version %d failed (%s); restarting the engine", version, error, extra={"worker": self.worker_id})
        self._reapply_target = target
        await self.supervisor.fail(f"apply failed: {error}")
        return False

    def _needs_grant(self, engine: Engine, target: _Version) -> bool:
        """An adapter version for an engine that serves it without a pause needs no apply slot when the broker
        says so (nothing pauses, so nothing to bound); every other version asks."""
        adapter = getattr(getattr(target.fetched, "manifest", None), "adapter", None)
        no_pause = adapter is not None and target.under is None and isinstance(engine, AdapterEngine) and getattr(engine, "adapters_without_pause", False)
        return not no_pause or self.adapters_need_grant()

    async def _pause_update_resume(self, engine: Engine, target: _Version) -> None:
        self._paused_for_apply = True  # until known otherwise: a refusal then resumes the engine, as it always has
        manifest = getattr(target.fetched, "manifest", None)
        adapter = getattr(manifest, "adapter", None)
        if adapter is not None and not isinstance(engine, AdapterEngine):
            raise WeightsRefusedError(f"version {target.version} is a LoRA adapter and the {engine.info().name} engine serves no adapters")
        if adapter is not None and target.under is None and getattr(engine, "adapters_without_pause", False):
            # the engine keeps several adapter versions loaded and each running sample names its own: nothing pauses
            self._paused_for_apply = False
            assert isinstance(engine, AdapterEngine)
            await engine.update_adapter(target.tensors, adapter, target.version)
            return
        under = target.under
        if under is not None and not isinstance(engine, AdapterEngine):
            self.adapter_on_fallbacks += 1
            raise WeightsRefusedError(f"version {target.version} runs on adapter version {under.version} (Manifest.adapter_on) and the "
                                      f"{engine.info().name} engine serves no adapters")
        await engine.pause(self._apply_mode(engine))
        if adapter is not None:
            assert isinstance(engine, AdapterEngine)
            if under is not None:  # its base first, inside the pause: no sample runs on the adapter over another base
                try:
                    await engine.update_weights(under.tensors, under.version)
                except WeightsRefusedError as exc:
                    self.base_on_fallbacks += 1
                    raise WeightsRefusedError(f"adapter version {target.version} applies over version {under.version} "
                                              f"(Manifest.base_on), which the engine refused: {exc}") from exc
                self.bases_joined += 1
                try:
                    await engine.update_adapter(target.tensors, adapter, target.version)
                except WeightsRefusedError as exc:
                    # the engine serves that base now, not the version this worker reports: replaced, as after a failed apply
                    raise EngineError(f"adapter version {target.version} refused after its base, version {under.version}, was "
                                      f"given to the engine ({exc}); the engine is restarted") from exc
            else:
                await engine.update_adapter(target.tensors, adapter, target.version)
        elif under is not None:  # first, inside the pause: no sample runs on that adapter over the old base
            assert isinstance(engine, AdapterEngine)
            try:
                await engine.update_adapter(under.tensors, _adapter_of(under), under.version)
            except WeightsRefusedError as exc:
                self.adapter_on_fallbacks += 1
                raise WeightsRefusedError(f"version {target.version} runs on adapter version {under.version} "
                                          f"(Manifest.adapter_on), which the engine refused: {exc}") from exc
            self.adapters_joined += 1
            try:
                await engine.update_weights(target.tensors, target.version)
            except WeightsRefusedError as exc:
                # the adapter is on in this engine now, over the base it served: not a state to serve on (its tokens
                # would carry the adapter's version), so the engine is replaced as after a failed apply
                raise EngineError(f"version {target.version} refused after adapter version {under.version} was given to the "
                                  f"engine with it ({exc}); the engine is restarted without it") from exc
        else:
            await engine.update_weights(target.tensors, target.version)
        await engine.resume()

    async def _reapply(self, engine: Engine) -> None:
        """The supervisor's hook: give a fresh engine the version to serve, through `_apply`."""
        target = self._reapply_target
        self._reapply_target = None  # tried once on a fresh engine; then the last good version
        if target is not None and not _intact(target):
            target = None  # its device buffers hold another version by now: never given to an engine
        if self._served is not None and not _intact(self._served):
            self._served_gone()
        if target is not None and target.version > self.version:
            try:
                await self._restore_adapter(engine, target)
                await self._apply(self._on_its_base(target), engine=engine)
                return
            except WeightsRefusedError:
                pass  # skipped; the fresh engine is intact: it gets the last good version below
            except EngineError as exc:
                await self._skip(target.version, f"it failed to apply on the serving engine and on a restarted one ({exc})")
                raise
        if self._served is not None:
            abandoned = self._served_abandoned
            await self._restore_adapter(engine, self._served)
            await self._apply(self._on_its_base(self._served), engine=engine)
            if abandoned:
                self._served_abandoned = True
                self.on_apply_finished(-1)

    def _served_gone(self) -> None:
        """The served version's tensors are device buffers written since by a newer version (the GPU holds one version,
        the next delta's base, rebuilt or staged in place): a fresh engine is not given them. It serves its checkpoint's
        weights, reported as version -1 (honest, never another version's bytes under this number), until the next
        version is applied."""
        served = self._served
        assert served is not None
        log.warning("the restarted engine does not get weight version %d again: its buffers on the GPU hold a newer version "
                    "by now (one version is kept there, the next delta's base); it serves its checkpoint's weights as version "
                    "-1 until the next version is applied", served.version, extra={"worker": self.worker_id})
        self.metrics.event("reapply_bytes_gone", {"worker_id": self.worker_id, "version": served.version})
        self._served, self._served_abandoned = None, False
        self.on_apply_finished(-1)

    def _on_its_base(self, target: _Version) -> _Version:
        """`target` as a fresh engine must be given it: an adapter version over the whole-model version the engine it
        replaces served under its adapters (held for this), not over the model the fresh engine loaded from disk."""
        if _adapter_of(target) is None or target.under is not None:
            return target
        served = self._served
        base = self._base_held if served is not None and _adapter_of(served) is not None else served
        return target if base is None else replace(target, under=base)

    async def _restore_adapter(self, engine: Engine, target: _Version) -> None:
        """Before a fresh engine gets whole-model version `target`: the adapter version that is on under it (the one
        served, when `target` is newer, else `_adapter_on`), as the engine being replaced had it."""
        if _adapter_of(target) is not None or target.under is not None or not isinstance(engine, AdapterEngine):
            return  # (an adapter version fetched with `target` is applied with it, by `_pause_update_resume`)
        under = self._served if self._served is not None and self._served is not target and _adapter_of(self._served) else self._adapter_on
        spec = _adapter_of(under) if under is not None else None
        if under is not None and spec is not None:
            await engine.update_adapter(under.tensors, spec, under.version)
            log.info("gave the restarted engine adapter version %d, on under version %d", under.version, target.version,
                     extra={"worker": self.worker_id})

    def _served_now(self, target: _Version) -> None:
        """`target` is served now (the caller tells the owner of the served version next, `on_apply_finished`)."""
        self._served_abandoned = False
        previous, self._served = self._served, target
        done_with = [previous]
        if _adapter_of(target) is not None:
            done_with.append(self._adapter_on)  # a newer adapter replaces the one that was on
            self._adapter_on = None
            if target.under is not None:  # the base fetched with it (a late joiner), or given again to a fresh engine
                if self._base_held is not target.under:
                    done_with.append(self._base_held)
                self._base_held, self._base_under = target.under, target.under.version
                self._served = replace(target, under=None)
            elif previous is not None and _adapter_of(previous) is None:
                # the whole-model version it applies over stays held: a restarted engine needs it under the adapter
                done_with.remove(previous)
                self._base_held, self._base_under = previous, previous.version
        elif target.under is not None:  # the adapter version fetched with it is on under it now (a late joiner)
            done_with += [self._adapter_on, self._base_held]
            self._adapter_on, self._base_held = target.under, None
        elif previous is not None and _adapter_of(previous) is not None:
            # a whole-model version over an adapter version: the engine keeps the adapter on, a fresh one needs it too
            done_with = [self._adapter_on, self._base_held]
            self._adapter_on, self._base_held = previous, None
        else:
            done_with.append(self._base_held)
            self._base_held = None
        for old in done_with:
            if (old is not None and old.fetched is not None and old.fetched is not target.fetched and old is not self._adapter_on
                    and old is not self._base_held and self.subscriber is not None):
                # the engine copied the version: its buffers take the next fetch (no fresh pages)
                self.subscriber.recycle(old.fetched)

    async def _stage(self, engine: Engine, target: _Version) -> None:
        details = getattr(target.fetched, "details", None)
        if isinstance(engine, FetchNotingEngine) and isinstance(details, Mapping):
            engine.note_fetch(target.version, details)
        if not isinstance(engine, StagingEngine) or getattr(getattr(target.fetched, "manifest", None), "adapter", None) is not None:
            return
        try:
            await engine.stage_weights(target.tensors, target.version)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - staging is an optimisation; the apply checks again and fails loudly
            log.warning("staging weight version %d failed (%s); it is copied during the pause instead", target.version, exc,
                        extra={"worker": self.worker_id})

    async def _wait_grant(self, version: int) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._grants[version] = fut
        try:
            for ask in range(1, self.config.weight_retries + 1):
                await self.link.send(ApplyRequest(version=version))
                try:
                    await asyncio.wait_for(asyncio.shield(fut), self.grant_wait_s(ask))
                    return
                except TimeoutError:
                    log.warning("no apply grant for version %d after ask %d of %d", version, ask, self.config.weight_retries,
                                extra={"worker": self.worker_id})
            raise WeightSyncError(f"no apply grant for version {version} after {self.config.weight_retries} asks")
        finally:
            self._grants.pop(version, None)
            fut.cancel()

    def _apply_mode(self, engine: Engine) -> str:
        modes = engine.info().apply_modes
        if self.config.apply_mode in modes:
            return self.config.apply_mode
        log.warning("engine does not support apply mode %s; using %s", self.config.apply_mode, modes[0], extra={"worker": self.worker_id})
        return modes[0]

    async def _skip(self, version: int, why: str) -> None:
        """Give `version` up for good, and tell the broker (a synchronous trainer waiting for it fails at once)."""
        self.skipped = max(self.skipped, version)
        log.error("weight version %d skipped: %s; keeping version %d and following the next one", version, why, self.version,
                  extra={"worker": self.worker_id})
        self.metrics.event("version_skipped", {"worker_id": self.worker_id, "version": version, "reason": why})
        await self.link.send(ApplyDone(version=version, ok=False, error=_short(why), skipped=True))

    def _make_subscriber(self) -> Subscriber:
        factory: SubscriberFactory | None = self._subscriber_factory
        if factory is None:
            from rollpool.weights import WeightSubscriber
            from rollpool.weights.memory import sweep_stale_segments

            sweep_stale_segments()  # segments of publishers gone from this host (judged by their owners' locks)
            factory = WeightSubscriber
        cfg = self.config
        engine = self.supervisor.engine
        device = str(engine.info().device or "") if engine is not None else ""
        on_cuda = device.startswith("cuda")
        # an engine that stages to CUDA bucket by bucket takes device tensors: on the shared-memory path each bucket is
        # copied from the publisher's segment straight to its device and verified there (weight_shm_to_device off: the
        # CPU copy, which stays the counted fallback either way)
        # (and with deltas on the GPU, `weight_delta_on_device`: the version is staged by the subscriber into buffers it
        # keeps on the engine's GPU after the apply, the next delta's base, rebuilt there in place)
        w = cfg.weights
        stages = on_cuda and isinstance(engine, BucketStagingEngine) and (w.weight_shm_to_device or (w.weight_delta and w.weight_delta_on_device))
        return factory(self.sockets, worker_id=self.worker_id, fetch_timeout_s=cfg.fetch_timeout_s, window_chunks=cfg.window_chunks,
                       max_refetch=cfg.max_refetch, pin_memory=on_cuda, stage_device=device if stages else None, weights=cfg.weights)

    def close(self) -> None:
        if self.subscriber is not None:
            try:
                self.subscriber.close()
            except Exception:  # closing anyway
                log.warning("weight subscriber close raised", exc_info=True)


_MAX_ERROR_CHARS = 2000


def _short(error: str | None) -> str | None:
    """An error text for `ApplyDone`: an exception's text can be long, and the message must stay small."""
    if error is None or len(error) <= _MAX_ERROR_CHARS:
        return error
    return error[: _MAX_ERROR_CHARS - 15] + " ... (truncated)"
