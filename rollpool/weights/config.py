"""`WeightPathConfig`: how weight bytes travel, shared by the publisher, the subscriber, the relay and their CLIs.

- ``path``: ``auto`` (shared memory when publisher and subscriber share a host
  and /dev/shm, else the network path; every fallback is logged and counted),
  ``network`` (ZeroMQ chunks only), ``shm`` (shared memory or a clear error),
  ``cuda_ipc`` (the trainer's GPU tensors handed to the engine's process; not
  built yet: served as ``auto``, see docs/weights.md).
- ``streams``: DEALER sockets a subscriber spreads its chunk window over
  (several TCP connections, each on its own ZeroMQ I/O thread where the
  context has them).
- ``pinned_budget_bytes``: the most page-locked host memory one side
  allocates for buckets (None: no bound; beyond it buffers are pageable).

Environment: ``ROLLPOOL_WEIGHT_PATH``, ``ROLLPOOL_WEIGHT_STREAMS``,
``ROLLPOOL_PINNED_BUDGET_BYTES``; flags ``--weight-path``, ``--weight-streams``,
``--pinned-budget-bytes`` (the relay's CLI; the worker's and the trainer
client's configs carry the same three fields).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from rollpool.protocol.errors import ConfigError

__all__ = ["WEIGHT_PATHS", "WeightPathConfig", "default_streams", "default_copy_threads"]

WEIGHT_PATHS = ("auto", "network", "shm", "cuda_ipc")


def default_streams() -> int:
    """Streams a subscriber opens by default: one per two cores, 1 to 4 (a 2-core box keeps one)."""
    return max(1, min(4, (os.cpu_count() or 1) // 2))


def default_copy_threads() -> int:
    """Threads that copy or checksum buckets: up to 8, leaving a core to the event loop where there are few."""
    n = os.cpu_count() or 1
    return max(1, min(8, n - 1 if n > 2 else n))


@dataclass(frozen=True)
class WeightPathConfig:
    weight_path: str = field(default="auto", metadata={"help": "how weight bytes travel: auto, network, shm or cuda_ipc"})
    weight_streams: int = field(default=0, metadata={"help": "sockets a subscriber spreads chunk requests over (0: one per two cores, 1..4)"})
    pinned_budget_bytes: int | None = field(default=None, metadata={"help": "most page-locked bucket memory per side (None: no bound)"})

    def __post_init__(self) -> None:
        if self.weight_path not in WEIGHT_PATHS:
            raise ConfigError(f"weight_path must be one of {', '.join(WEIGHT_PATHS)}, got {self.weight_path!r}")
        if not 0 <= self.weight_streams <= 16:
            raise ConfigError(f"weight_streams must be in [0, 16] (0: automatic), got {self.weight_streams}")
        if self.pinned_budget_bytes is not None and self.pinned_budget_bytes < 0:
            raise ConfigError(f"pinned_budget_bytes must be >= 0 or None, got {self.pinned_budget_bytes}")

    @property
    def streams(self) -> int:
        return self.weight_streams or default_streams()

    def subscriber_kwargs(self) -> dict[str, object]:
        """Keyword arguments for `WeightSubscriber` (what a worker's weight sync passes on)."""
        return {"path": self.weight_path, "streams": self.streams, "pinned_budget_bytes": self.pinned_budget_bytes}

    def publisher_kwargs(self) -> dict[str, object]:
        """Keyword arguments for `WeightPublisher`."""
        return {"path": self.weight_path, "pinned_budget_bytes": self.pinned_budget_bytes}
