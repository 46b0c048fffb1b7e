"""`SyncTrainerClient`: the trainer client for plain (non-async) training loops.

It runs a `TrainerClient` on its own event loop in a background thread; each
method submits a coroutine there and waits for its result, so the calling
thread can be a normal PyTorch training loop. `close()` (or the context
manager) stops the loop thread and closes the sockets.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from rollpool.protocol import GroupResult, MetricsSink, Prompt, SamplingParams
from rollpool.trainer_client.client import RolloutBatch, SubmitResult, TrainerClient, TrainerClientConfig

__all__ = ["SyncTrainerClient"]

T = TypeVar("T")


class SyncTrainerClient:
    def __init__(self, broker: str | None = None, *, config: TrainerClientConfig | None = None,
                 metrics: MetricsSink | None = None, fingerprint: str = "", connect_timeout_s: float = 60.0) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="rollpool-trainer-client", daemon=True)
        self._thread.start()
        self._closed = False

        async def make() -> TrainerClient:
            client = TrainerClient(broker, config=config, metrics=metrics, fingerprint=fingerprint)
            await client.connect()
            return client

        try:
            self.client: TrainerClient = self._call(make, timeout=connect_timeout_s)
        except BaseException:
            self._stop_loop()
            raise

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _call(self, make: Callable[[], Awaitable[T]], timeout: float | None = None) -> T:
        async def run() -> T:
            return await make()

        fut = asyncio.run_coroutine_threadsafe(run(), self._loop)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()
            raise

    # the same API as TrainerClient, blocking

    @property
    def version(self) -> int:
        return self.client.version

    @property
    def counters(self) -> dict[str, int]:
        return dict(self.client.counters)

    def submit(self, prompts: Iterable[Prompt | Mapping[str, Any] | str | Sequence[int]], *, group_size: int = 1,
               sampling: SamplingParams | Mapping[str, Any] | None = None, exact_weight_version: int | None = None,
               policy: str | None = None) -> SubmitResult:
        items = list(prompts)
        return self._call(lambda: self.client.submit(items, group_size=group_size, sampling=sampling,
                                                     exact_weight_version=exact_weight_version, policy=policy))

    def take_ended(self, timeout: float = 0.0) -> list[GroupResult]:
        """See `TrainerClient.take_ended`."""
        return self._call(lambda: self.client.take_ended(timeout))

    def wait_for_version(self, version: int, fraction: float = 1.0, timeout: float | None = None,
                         poll_s: float = 0.1) -> dict[str, Any]:
        """See `TrainerClient.wait_for_version`."""
        return self._call(lambda: self.client.wait_for_version(version, fraction, timeout, poll_s))

    def get_batch(self, n: int, max_staleness: int | None = None, timeout: float | None = None,
                  stale_policy: str | None = None, max_staleness_keep: int | None = None) -> RolloutBatch:
        return self._call(lambda: self.client.get_batch(n, max_staleness=max_staleness, timeout=timeout,
                                                        stale_policy=stale_policy, max_staleness_keep=max_staleness_keep))

    def publish_weights(self, model_or_named_tensors: Any, version: int, *, adapter: Any = None) -> Any:
        return self._call(lambda: self.client.publish_weights(model_or_named_tensors, version, adapter=adapter))

    def set_version(self, version: int, *, adapter: Any = None) -> None:
        self._call(lambda: self.client.set_version(version, adapter=adapter))

    def rebase_version(self, version: int) -> None:
        """See `TrainerClient.rebase_version` (a trainer resumed from a checkpoint at `version`)."""
        self._call(lambda: self.client.rebase_version(version))

    def status(self) -> dict[str, Any]:
        return self._call(self.client.status)

    def control(self, op: str, tags: Sequence[str] = (), timeout_s: float = 60.0, **args: Any) -> dict[str, Any]:
        return self._call(lambda: self.client.control(op, tags, timeout_s, **args))

    def sleep(self, tags: Sequence[str] = ()) -> dict[str, Any]:
        return self._call(lambda: self.client.sleep(tags))

    def wake(self, tags: Sequence[str] = ()) -> dict[str, Any]:
        return self._call(lambda: self.client.wake(tags))

    def flush_cache(self) -> dict[str, Any]:
        return self._call(self.client.flush_cache)

    def cancel(self, prompt_ids: Sequence[str]) -> dict[str, list[str]]:
        ids = list(prompt_ids)
        return self._call(lambda: self.client.cancel(ids))

    def pending(self) -> int:
        return self.client.pending()

    def pending_ids(self) -> list[str]:
        return self.client.pending_ids()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self.client.close, timeout=30)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> SyncTrainerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
