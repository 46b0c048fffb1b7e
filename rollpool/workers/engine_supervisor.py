"""`EngineSupervisor`: starts the worker's engine and restarts it when it fails.

- `fail(reason)`: the first report of a failure takes the engine out of service (`ok`
  is cleared) and runs the ``on_down`` hook. The worker's hook hands the engine's
  tasks back through the session's effects. Later reports of the same failure return
  False, so one failure means one restart.
- `run()`: the supervision loop. It waits for a failure, stops the old engine, and
  starts a new one. Through the ``reapply`` hook (set by `WeightSync`) it gives the
  new engine the version the worker serves; that is the one apply path, so an engine
  never takes work half-updated. Then it sets `ok` and runs ``on_up``.
- Bounded, with a backoff (STYLE 9): the first attempt of a row runs at once, each
  next one waits ``restart_backoff_s`` doubling to ``restart_backoff_max_s``. After
  ``max_restarts`` attempts in a row, `run` raises `EngineError` and the worker gives
  up. Successful restarts count toward the row too; an engine that stays up for
  ``restart_backoff_max_s`` ends the row.

Imports `engines` (the Engine seam) and `config`; never the session (hooks carry what it must know).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from rollpool.protocol.errors import EngineError
from rollpool.protocol.metrics import MetricsSink
from rollpool.workers.config import WorkerConfig
from rollpool.workers.engines.base import Engine, EngineInfo

__all__ = ["EngineFactory", "EngineSupervisor"]

log = logging.getLogger(__name__)

EngineFactory = Callable[[], Engine]


async def _nothing(_: object) -> None:
    return None


class EngineSupervisor:
    """Owns the engine: start, fail, restart with a bounded backoff (see the module docstring)."""

    def __init__(
        self,
        config: WorkerConfig,
        factory: EngineFactory,
        metrics: MetricsSink,
        *,
        engine: Engine | None = None,
        on_down: Callable[[str], Awaitable[None]] = _nothing,
        on_up: Callable[[EngineInfo], Awaitable[None]] = _nothing,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.worker_id = config.worker_id
        self.metrics = metrics
        self.on_down = on_down
        self.on_up = on_up
        self.reapply: Callable[[Engine], Awaitable[None]] | None = None
        """Gives a fresh engine the version the worker serves (set by `WeightSync`); raises on failure."""
        self.ok = asyncio.Event()
        """Set while the engine serves."""
        self.restarts = 0
        self._factory = factory
        self._engine = engine
        self._clock = clock
        self._failed = asyncio.Event()
        self._reason = ""
        self._streak = 0
        self._up_since = 0.0

    @property
    def engine(self) -> Engine | None:
        """The engine (None while it is being replaced)."""
        return self._engine

    async def start(self) -> EngineInfo:
        """Start the first engine (a failure here is the caller's: the worker does not start)."""
        if self._engine is None:
            self._engine = self._factory()
        await self._engine.start()
        self._up_since = self._clock()
        self.ok.set()
        return self._engine.info()

    async def fail(self, reason: str) -> bool:
        """Report an engine failure; True for the report that takes the engine out of service."""
        if not self.ok.is_set():
            return False
        self.ok.clear()
        self._reason = reason
        self.restarts += 1
        self.metrics.event("engine_restart", {"worker_id": self.worker_id, "reason": reason})
        log.error("engine failed (%s); handing back its tasks and restarting it", reason, extra={"worker": self.worker_id})
        await self.on_down(reason)
        self._failed.set()
        return True

    async def run(self) -> None:
        """The supervision loop; raises `EngineError` when `max_restarts` attempts in a row failed."""
        while True:
            await self._failed.wait()
            self._failed.clear()
            info = await self._restart(self._reason)
            await self.on_up(info)

    async def stop(self) -> None:
        engine, self._engine = self._engine, None
        self.ok.clear()
        if engine is not None:
            await self._stop_quietly(engine, "engine stop raised")

    def backoff_s(self, attempt: int) -> float:
        """The wait before attempt `attempt` (1-based) of a row: none for the first."""
        if attempt <= 1:
            return 0.0
        return float(min(self.config.restart_backoff_s * 2 ** (attempt - 2), self.config.restart_backoff_max_s))

    async def _restart(self, reason: str) -> EngineInfo:
        if self._clock() - self._up_since >= self.config.restart_backoff_max_s:
            self._streak = 0  # the engine had stayed up: a new row begins
        old, self._engine = self._engine, None
        if old is not None:
            await self._stop_quietly(old, "stopping the failed engine raised")
        last = reason
        while True:
            self._streak += 1
            if self._streak > self.config.max_restarts:
                raise EngineError(
                    f"engine failed {self.config.max_restarts} times in a row (WorkerConfig.max_restarts); giving up. Last failure: {last}"
                )
            delay = self.backoff_s(self._streak)
            if delay:
                await asyncio.sleep(delay)
            engine: Engine | None = None
            try:
                engine = self._factory()
                await engine.start()
                if self.reapply is not None:
                    await self.reapply(engine)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - retried with backoff, bounded by max_restarts
                last = f"{type(exc).__name__}: {exc}"
                log.error("engine restart %d failed (%s); next attempt in %.1fs", self._streak, last, self.backoff_s(self._streak + 1),
                          extra={"worker": self.worker_id})
                if engine is not None:
                    await self._stop_quietly(engine, "stopping the engine that failed to start raised")
                continue
            self._engine = engine
            self._up_since = self._clock()
            self.ok.set()
            info = engine.info()
            log.warning("engine restarted (%s) at version %d", reason, info.weight_version, extra={"worker": self.worker_id})
            return info

    async def _stop_quietly(self, engine: Engine, what: str) -> None:
        try:
            await engine.stop()
        except asyncio.CancelledError:
            raise
        except Exception:  # it is being replaced anyway
            log.debug(what, exc_info=True)
