"""The weights configs: `WeightPathConfig` (how weight bytes travel, shared by the publisher, the subscriber,
the relay and their CLIs) and `RelayConfig` (the relay's flags, ``rollpool relay``).

- ``path``: ``auto`` (shared memory when publisher and subscriber share a host
  and /dev/shm, else the network path; every fallback is logged and counted),
  ``network`` (ZeroMQ chunks only), ``shm`` (shared memory or a clear error),
  ``cuda_ipc`` (the trainer's GPU tensors copied device-to-device by an engine on
  the same GPU; shared memory, then the network, as counted fallbacks). On
  ``auto`` the same-GPU path is taken when the publisher offers it: it does once a
  subscriber on its host said it sees the GPU (docs/weights.md).
- ``streams``: DEALER sockets a subscriber spreads its chunk window over
  (several TCP connections, each on its own ZeroMQ I/O thread where the
  context has them).
- ``pinned_budget_bytes``: the most page-locked host memory one side
  allocates for buckets (None: no bound; beyond it buffers are pageable).

Environment: ``ROLLPOOL_WEIGHT_PATH``, ``ROLLPOOL_WEIGHT_STREAMS``,
``ROLLPOOL_PINNED_BUDGET_BYTES``; flags ``--weight-path``, ``--weight-streams``,
``--pinned-budget-bytes`` (the relay's and the worker's CLIs; the worker's and
the trainer client's configs carry the same three fields, checked by
`check_path_fields`). The worker also reserves its page-locked buffers at engine
start (``--weight-reserve-versions``, the engine's own parameter bytes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from rollpool.protocol.errors import ConfigError

__all__ = ["WEIGHT_PATHS", "WeightPathConfig", "check_path_fields", "RelayConfig", "default_pub_endpoint", "default_streams", "default_copy_threads"]

WEIGHT_PATHS = ("auto", "network", "shm", "cuda_ipc")


def default_streams() -> int:
    """Streams a subscriber opens by default: one per two cores, 1 to 4 (a 2-core box keeps one)."""
    return max(1, min(4, (os.cpu_count() or 1) // 2))


def weight_streams(streams: int | None = None) -> int:
    """The sockets a subscriber spreads its fetches over: `streams`, else ``ROLLPOOL_WEIGHT_STREAMS``, else
    `default_streams` (0 or None: automatic); in [1, 16]. A process that fetches over them gives its ZeroMQ context as
    many I/O threads (a context's default is one I/O thread for all of its sockets)."""
    if not streams:
        text = os.environ.get("ROLLPOOL_WEIGHT_STREAMS", "").strip()
        if not text:
            return default_streams()
        try:
            streams = int(text)
        except ValueError:
            raise ValueError(f"ROLLPOOL_WEIGHT_STREAMS must be an integer, got {text!r}") from None
    if not 1 <= streams <= 16:
        raise ValueError(f"streams must be in [1, 16], got {streams}")
    return streams


def default_copy_threads() -> int:
    """Threads that copy or checksum buckets: up to 8, leaving a core to the event loop where there are few."""
    n = os.cpu_count() or 1
    return max(1, min(8, n - 1 if n > 2 else n))


def check_path_fields(owner: str, weight_path: str, weight_streams: int, pinned_budget_bytes: int | None) -> None:
    """The checks of the three weight-path fields, for every config that carries them (`owner` names it in errors)."""
    if weight_path not in WEIGHT_PATHS:
        raise ConfigError(f"{owner}.weight_path must be one of {', '.join(WEIGHT_PATHS)}, got {weight_path!r}")
    if not 0 <= weight_streams <= 16:
        raise ConfigError(f"{owner}.weight_streams must be in [0, 16] (0: automatic), got {weight_streams}")
    if pinned_budget_bytes is not None and pinned_budget_bytes < 0:
        raise ConfigError(f"{owner}.pinned_budget_bytes must be >= 0 or None, got {pinned_budget_bytes}")


@dataclass(frozen=True)
class WeightPathConfig:
    weight_path: str = field(default="auto", metadata={"help": "how weight bytes travel: auto, network, shm or cuda_ipc"})
    weight_streams: int = field(default=0, metadata={"help": "sockets a subscriber spreads chunk requests over, 1..16 (0: automatic, one per two cores up to 4)"})
    pinned_budget_bytes: int | None = field(default=None, metadata={"help": "most page-locked bucket memory per side (None: no bound)"})
    weight_bulk: bool = field(default=True, metadata={"help": "the network path's bulk lane (plain TCP beside the ROUTER; off under CURVE anyway)"})

    def __post_init__(self) -> None:
        check_path_fields(type(self).__name__, self.weight_path, self.weight_streams, self.pinned_budget_bytes)

    @property
    def streams(self) -> int:
        """`weight_streams`, else ``ROLLPOOL_WEIGHT_STREAMS``, else the default (`weight_streams()`, as the worker's)."""
        return weight_streams(self.weight_streams)

    def subscriber_kwargs(self) -> dict[str, object]:
        """Keyword arguments for `WeightSubscriber` (what the relay passes on to its upstream subscriber)."""
        return {"path": self.weight_path, "streams": self.streams, "pinned_budget_bytes": self.pinned_budget_bytes}

    def publisher_kwargs(self) -> dict[str, object]:
        """Keyword arguments for `WeightPublisher`."""
        return {"path": self.weight_path, "pinned_budget_bytes": self.pinned_budget_bytes}


def default_pub_endpoint(router_endpoint: str) -> str:
    """The PUB endpoint beside a ROUTER endpoint: the next tcp port, or ``<path>.pub`` for ipc."""
    if router_endpoint.startswith("ipc://"):
        return router_endpoint + ".pub"
    if router_endpoint.startswith("tcp://"):
        host, _, port = router_endpoint[len("tcp://") :].rpartition(":")
        if port == "*":
            return router_endpoint
        if port.isdigit():
            return f"tcp://{host}:{int(port) + 1}"
    raise ConfigError(f"cannot derive a PUB endpoint from {router_endpoint!r}; give --bind-pub")


@dataclass(frozen=True)
class RelayConfig(WeightPathConfig):
    """The relay's flags; `weight_path` and `weight_streams` apply to its upstream fetch (--weight-path, --weight-streams)."""

    upstream: str = field(default="", metadata={"help": "the upstream publisher's (or relay's) ROUTER endpoint"})
    upstream_pub: str | None = field(default=None, metadata={"help": "the upstream PUB endpoint (announcements)"})
    bind: str = field(default="tcp://127.0.0.1:6100", metadata={"help": "the ROUTER endpoint local workers fetch from"})
    bind_pub: str | None = field(default=None, metadata={"help": "the PUB endpoint to announce on (default: beside --bind)"})
    keep_versions: int = field(default=2, metadata={"help": "versions kept and served"})
    window_chunks: int = field(default=16, metadata={"help": "chunk requests outstanding upstream"})
    fetch_timeout_s: float = field(default=30.0, metadata={"help": "longest wait for any upstream reply"})
    max_refetch: int = field(default=3, metadata={"help": "re-asks of a silent upstream / refetches of a bad bucket"})
    poll_interval_s: float = field(default=5.0, metadata={"help": "how often to ask upstream for its latest version"})
    pool: str = field(default="default", metadata={"help": "pool name (monitoring keys)"})
    curve_dir: str | None = field(default=None, metadata={"help": "CURVE key directory from `rollpool keys gen` (None: plaintext)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.upstream:
            raise ConfigError("RelayConfig.upstream is required (--upstream ENDPOINT)")
        if self.keep_versions < 1:
            raise ConfigError(f"RelayConfig.keep_versions must be >= 1, got {self.keep_versions}")
        if not 1 <= self.window_chunks <= 1024:
            raise ConfigError(f"RelayConfig.window_chunks must be in [1, 1024], got {self.window_chunks}")
        if self.fetch_timeout_s <= 0 or self.poll_interval_s <= 0:
            raise ConfigError("RelayConfig.fetch_timeout_s and poll_interval_s must be > 0")
        if self.max_refetch < 0:
            raise ConfigError(f"RelayConfig.max_refetch must be >= 0, got {self.max_refetch}")
