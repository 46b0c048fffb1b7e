"""The weights configs: `WeightPathConfig` (every knob of how weight bytes travel, one dataclass nested in the worker's
and the trainer client's configs and taken by the publisher, the subscriber and the relay) and `RelayConfig` (the
relay's flags, ``rollpool relay``).

Every field is read once, when the config is loaded (`rollpool.protocol.config.load_config`: defaults < TOML <
``ROLLPOOL_<FIELD>`` < flags; nested, its flags and variables keep their flat names, e.g. ``--weight-path``,
``ROLLPOOL_WEIGHT_PATH``). A publisher or subscriber made without one loads it from the environment once, at its
making (`WeightPathConfig.from_env`); library code reads no variable after that.

- ``weight_path``: ``auto`` (the fastest path the hello and manifest allow; every fallback is logged and counted),
  ``network`` (the bulk lane or ZeroMQ chunks only), ``shm`` (shared memory or a clear error), ``cuda_ipc`` (the
  trainer's GPU tensors copied device-to-device by an engine on the same GPU; shared memory, then the network, as
  counted fallbacks). On ``auto`` the same-GPU path is taken when the publisher offers it: it does once a subscriber
  on its host said it sees the GPU (docs/weights.md). The order is `rollpool.weights.manifest.plan`'s.
- ``weight_streams``: DEALER sockets (and bulk-lane connections) a subscriber spreads its fetch over; 0: one per two
  cores, 1 to 4. A process that fetches over them gives its ZeroMQ context as many I/O threads.
- ``pinned_budget_bytes``: the most page-locked host memory one side allocates for buckets (None: no bound; beyond
  it buffers are pageable).
- ``weight_bulk``: the network path's bulk lane (plain TCP beside the ROUTER, off under CURVE anyway); off on either
  side, that side neither offers nor takes it.
- ``weight_early_bytes``: a subscriber takes a bucket's bytes over the bulk lane before the publisher has its checksum,
  from a server that offers it (minor 30: where the checksums wait for a version's copies, a trainer's CPU tensors,
  every chunk but the bucket's last once the copies landed; the bucket is verified as before, once its last chunk
  brought the checksum). A relay asks too, and forwards such bytes to its subscribers that ask (the rest get a
  bucket's chunks once its checksum is known).
- ``weight_reserve_bytes``: a subscriber reserves its host (and staging device) buffers for two versions of this
  size at its making (None: at engine start by the engine's own size, `WorkerConfig.weight_reserve_versions`, else
  at the first fetch).
- ``weight_shm_to_device``: a worker whose engine stages to CUDA copies shared-memory buckets straight to its GPU and
  verifies them there (off: the CPU copy and checksum).
- ``weight_copy_threads``: threads that copy and checksum buckets on either side (0: up to 8, a core left to the
  event loop where there are few; a publisher's copies of CPU tensors, which the trainer waits for, up to 16).
- ``weight_delta_threads``: threads that make a delta version (a server: compare and pack, the publisher's beside its
  snapshot's copy threads) and rebuild one (a subscriber); 0: ``weight_copy_threads``. The delta reads two versions'
  bytes and the rebuild writes one, so where cores are idle more threads shorten both (docs/weights.md).
- ``weight_delta_on_device``: with ``weight_delta``, a worker whose engine stages to CUDA keeps the version it applied on
  its GPU in bucket layout (the staging copy, 1 x the model's bytes outside SGLang's static fraction, kept between
  versions instead of dropped after each apply: the same peak) and rebuilds a delta against it there, in place,
  verified there against the mix64 of the resulting bytes (`rollpool.weights.delta_gpu`); off: deltas are rebuilt on
  the host and the engine stages each version itself.
- ``publisher_gpu_budget_bytes``: the most GPU memory a publisher allocates on the trainer's GPU (the same-GPU path's
  arenas and ring, the device delta base, drawn from one `rollpool.weights.manifest.GpuBudget`);
  None: two of its buckets and what the ring needs to checksum two slots of one (`manifest.ring_scratch_bytes`). A whole-version arena that would pass it is not made: the version streams through the
  same-GPU ring when two slots of its largest bucket fit, else over the host paths, and the publisher says why (log,
  `WeightPublisher.path_note`). Delta versions are made on the trainer's GPU only when it holds the device base (1 x
  the model's bytes plus 5 buckets of scratch; `rollpool.weights.delta_device`), else on the host.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from rollpool.protocol.errors import ConfigError

__all__ = ["WEIGHT_PATHS", "WeightPathConfig", "RelayConfig", "default_pub_endpoint", "default_streams", "default_copy_threads", "default_host_copy_threads", "with_overrides"]

WEIGHT_PATHS = ("auto", "network", "shm", "cuda_ipc")


def default_streams() -> int:
    """Streams a subscriber opens by default: one per two cores, 1 to 4 (a 2-core box keeps one)."""
    return max(1, min(4, (os.cpu_count() or 1) // 2))


def default_copy_threads() -> int:
    """Threads that copy or checksum buckets: up to 8, leaving a core to the event loop where there are few."""
    n = os.cpu_count() or 1
    return max(1, min(8, n - 1 if n > 2 else n))


def default_host_copy_threads() -> int:
    """Threads that copy a trainer's CPU tensors into a snapshot: up to 16, a core left to the event loop where there are
    more than two. The trainer waits for these copies (its checksums follow them), and on a 16-core GPU host 15 threads
    copied 8B's 14.5 GB in 0.33 s against 0.42 s with 8 (bench/results/h200-host-copy-probe-s22.json)."""
    n = os.cpu_count() or 1
    return max(1, min(16, n - 1 if n > 2 else n))


@dataclass(frozen=True)
class WeightPathConfig:
    weight_path: str = field(default="auto", metadata={"help": "how weight bytes travel: auto, network, shm or cuda_ipc"})
    weight_streams: int = field(default=0, metadata={"help": "sockets a subscriber spreads its fetch over, 1..16 (0: automatic, one per two cores up to 4)"})
    pinned_budget_bytes: int | None = field(default=None, metadata={"help": "most page-locked bucket memory per side (None: no bound)"})
    weight_bulk: bool = field(default=True, metadata={"help": "the network path's bulk lane (plain TCP beside the ROUTER; off under CURVE anyway)"})
    weight_early_bytes: bool = field(default=True, metadata={"help": "a subscriber takes a bucket's bytes over the bulk lane before the publisher has its checksum (verified once its last chunk brings it)"})
    weight_reserve_bytes: int | None = field(default=None, metadata={"help": "a subscriber reserves buffers for two versions of this size when made (None: at engine start, else at the first fetch)"})
    weight_shm_to_device: bool = field(default=True, metadata={"help": "an engine that stages to CUDA gets shared-memory buckets copied straight to its GPU and verified there"})
    weight_copy_threads: int = field(default=0, metadata={"help": "threads that copy and checksum buckets, 0..64 (0: automatic, up to 8)"})
    publisher_gpu_budget_bytes: int | None = field(default=None, metadata={"help": "the most GPU memory a publisher allocates on the trainer's GPU for weight paths (None: two buckets and the ring's checksum scratch)"})
    weight_delta: bool = field(default=False, metadata={"help": "delta versions (off by default until measured at 8B on the GPU): a subscriber holding the previous version asks for the changed elements only; a server offers them"})
    weight_delta_max_fraction: float = field(default=0.5, metadata={"help": "a delta whose encoded bytes pass this fraction of the version's goes out as a full version, 0..1"})
    weight_delta_wait_s: float = field(default=1.0, metadata={"help": "a server answers a request parked for a version's delta with the full version once the version has been complete this long without its delta made, 0..600 (0: at once)"})
    weight_delta_threads: int = field(default=0, metadata={"help": "threads that make a delta version (a server) and rebuild one (a subscriber), 0..64 (0: weight_copy_threads)"})
    weight_delta_on_device: bool = field(default=True, metadata={"help": "with deltas on, a worker whose engine stages to CUDA keeps the version it applied on its GPU (the staging copy, 1 x the model's bytes, kept instead of dropped) and rebuilds delta versions there, verified there (off: on the host)"})

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if self.weight_path not in WEIGHT_PATHS:
            raise ConfigError(f"{owner}.weight_path must be one of {', '.join(WEIGHT_PATHS)}, got {self.weight_path!r}")
        if not 0 <= self.weight_streams <= 16:
            raise ConfigError(f"{owner}.weight_streams must be in [0, 16] (0: automatic), got {self.weight_streams}")
        if self.pinned_budget_bytes is not None and self.pinned_budget_bytes < 0:
            raise ConfigError(f"{owner}.pinned_budget_bytes must be >= 0 or None, got {self.pinned_budget_bytes}")
        if self.weight_reserve_bytes is not None and self.weight_reserve_bytes < 0:
            raise ConfigError(f"{owner}.weight_reserve_bytes must be >= 0 or None, got {self.weight_reserve_bytes}")
        if self.publisher_gpu_budget_bytes is not None and self.publisher_gpu_budget_bytes < 0:
            raise ConfigError(f"{owner}.publisher_gpu_budget_bytes must be >= 0 or None (two buckets), got {self.publisher_gpu_budget_bytes}")
        if not 0.0 <= self.weight_delta_max_fraction <= 1.0:
            raise ConfigError(f"{owner}.weight_delta_max_fraction must be in [0, 1], got {self.weight_delta_max_fraction}")
        if not 0.0 <= self.weight_delta_wait_s <= 600.0:
            raise ConfigError(f"{owner}.weight_delta_wait_s must be in [0, 600] seconds, got {self.weight_delta_wait_s}")
        if not 0 <= self.weight_copy_threads <= 64:
            raise ConfigError(f"{owner}.weight_copy_threads must be in [0, 64] (0: automatic), got {self.weight_copy_threads}")
        if not 0 <= self.weight_delta_threads <= 64:
            raise ConfigError(f"{owner}.weight_delta_threads must be in [0, 64] (0: weight_copy_threads), got {self.weight_delta_threads}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WeightPathConfig:
        """The defaults with ``ROLLPOOL_<FIELD>`` applied (what a facade made without a config takes, read once)."""
        from rollpool.protocol.config import load_config

        env = {k: v for k, v in (os.environ if environ is None else environ).items() if k != "ROLLPOOL_CONFIG"}  # (a TOML file is the process config's)
        return load_config(WeightPathConfig, environ=env)

    @property
    def streams(self) -> int:
        """`weight_streams`, or the default (one per two cores, 1 to 4) when it is 0."""
        return self.weight_streams or default_streams()

    @property
    def copy_threads(self) -> int:
        """`weight_copy_threads`, or the default (up to 8) when it is 0."""
        return self.weight_copy_threads or default_copy_threads()

    @property
    def delta_threads(self) -> int:
        """`weight_delta_threads`, or `copy_threads` when it is 0."""
        return self.weight_delta_threads or self.copy_threads


def with_overrides(weights: WeightPathConfig | None, **given: Any) -> WeightPathConfig:
    """`weights` (None: `WeightPathConfig.from_env`) with each field given not None replaced (the keywords of a
    facade's callers that predate `WeightPathConfig`)."""
    cfg = weights if weights is not None else WeightPathConfig.from_env()
    changes = {k: v for k, v in given.items() if v is not None}
    return replace(cfg, **changes) if changes else cfg


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

    def path_config(self) -> WeightPathConfig:
        """The weight-path fields alone (what the relay's upstream subscriber and its server take)."""
        return WeightPathConfig(**{f.name: getattr(self, f.name) for f in fields(WeightPathConfig)})
