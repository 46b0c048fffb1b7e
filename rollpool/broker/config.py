"""`BrokerConfig`: every setting of the broker process, frozen and validated.

Loaded with ``rollpool.protocol.config.load_config(BrokerConfig, args, section="broker")``
from defaults < TOML ``[broker]`` < ``ROLLPOOL_*`` environment < flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollpool.protocol.codec import DEFAULT_INLINE_MAX_BYTES
from rollpool.protocol.config import help_ as _h
from rollpool.protocol.errors import ConfigError

__all__ = ["ACTIVATION_MODES", "BrokerConfig"]

ACTIVATION_MODES = ("rolling", "fleet")


def _non_negative_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"BrokerConfig.{name} must be an int >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    worker_endpoint: str = field(default="tcp://127.0.0.1:5555", metadata=_h("ROUTER endpoint workers dial"))
    client_endpoint: str = field(default="tcp://127.0.0.1:5556", metadata=_h("ROUTER endpoint trainer clients dial"))
    pool: str = field(default="default", metadata=_h("pool name (monitoring keys rollpool:{pool}:...)"))
    heartbeat_interval_s: float = field(default=1.0, metadata=_h("heartbeat period, both ways"))
    missed_heartbeats: int = field(default=3, metadata=_h("a worker silent this many heartbeats is declared dead"))
    task_timeout_s: float = field(default=600.0, metadata=_h("most seconds one task (a whole group) may take"))
    max_attempts: int = field(default=3, metadata=_h("dispatches of one group before it is FAILED"))
    max_handbacks: int = field(default=20, metadata=_h("hand-backs (nack, goodbye) of one group before it is FAILED"))
    max_queued: int = field(default=100_000, metadata=_h("most groups waiting for a worker (submit beyond: queue_full)"))
    max_held: int = field(default=100_000, metadata=_h("most groups leased or held for the trainer at once"))
    max_group_size: int = field(default=1024, metadata=_h("largest accepted group (samples per prompt)"))
    batch_size: int = field(default=256, metadata=_h("B: samples per optimizer step (staleness admission)"))
    max_staleness: int | None = field(default=None, metadata=_h("eta: staleness bound in versions (None: off)"))
    cancel_stale_inflight: bool = field(
        default=False,
        metadata=_h("cancel and requeue, at the version bump that dooms it, every in-flight group whose start version is more than "
                    "the trainer's bound behind (eta, or the trainer's stated SetVersion.stale_bound); drop staler output on arrival"),
    )
    fresh_dispatch_hold_s: float = field(
        default=0.0,
        metadata=_h("version-aware dispatch: the admission capacity a version bump opens goes only to workers on that version "
                    "for at most this long (then to any worker within eta); 0: off"),
    )
    max_applying: int = field(default=1, metadata=_h("workers allowed to pause for a weight update at once (rolling activation)"))
    activation: str = field(default="rolling", metadata=_h(
        "how workers switch to a new weight version: rolling (apply slots, at most max_applying at once) or fleet (every "
        "worker fetches and stages it while serving; all are told to switch together once every live worker has staged "
        "it, or at fleet_stage_deadline_s; no task is dispatched on the old version after that)"))
    fleet_stage_deadline_s: float = field(default=10.0, metadata=_h(
        "fleet activation: after the first worker staged a version, how long the others have to stage it before the "
        "staged ones switch without them; a worker that had not is held out of dispatch until it serves the version"))
    result_resend_s: float = field(
        default=10.0,
        metadata=_h("a group sent to a client and not acknowledged this long is sent again with its next pull (a lost Batch)"),
    )
    apply_slot_deadline_s: float = field(
        default=120.0,
        metadata=_h("longest a worker may hold an apply slot: past it the slot is freed for the next worker (a hung apply)"),
    )
    orphan_ttl_s: float = field(
        default=600.0,
        metadata=_h("how long a task adopted after a broker restart waits for its prompt to be resubmitted before it is forgotten"),
    )
    dedup_window: int = field(default=1_000_000, metadata=_h("forgotten prompt ids remembered to refuse duplicates"))
    max_worker_credits: int = field(default=65_536, metadata=_h("cap on one worker's outstanding credit (sequences)"))
    max_pull_groups: int = field(default=4096, metadata=_h("most groups in one Batch"))
    max_pull_wait_s: float = field(default=60.0, metadata=_h("longest long-poll a Pull may ask for"))
    control_timeout_s: float = field(default=30.0, metadata=_h("longest wait for workers' control replies"))
    drain_timeout_s: float = field(default=5.0, metadata=_h("on stop: how long results may still be handed over"))
    burst_messages: int = field(default=256, metadata=_h("messages read per socket wake-up before yielding the loop"))
    coalesce_s: float = field(default=0.001, metadata=_h(
        "a socket read again within this long of its last read waits for the rest of it, so messages arriving "
        "faster are read (and answered) together: fewer wake-ups per message; 0: off"))
    inline_max_bytes: int = field(default=DEFAULT_INLINE_MAX_BYTES, metadata=_h(
        "to a peer of protocol minor 12 or later, arrays of at most this many bytes travel inline in the message header "
        "instead of in their own frame (fewer socket operations per message); 0: every array in a frame"))
    latency_samples: int = field(default=65_536, metadata=_h("delivered groups whose broker-side timestamps are kept (a ring)"))
    replay_max_group_bytes: int = field(default=8 << 20, metadata=_h(
        "episodes: most bytes of finished turns kept per running group, to serve back to the next attempt if its worker "
        "dies (turns past it are not kept and are sampled again); 0: keep none"))
    replay_max_bytes: int = field(default=512 << 20, metadata=_h("episodes: most bytes of finished turns kept for all groups together"))
    curve_dir: str | None = field(default=None, metadata=_h("CURVE key directory from `rollpool keys gen` (None: plaintext)"))

    def __post_init__(self) -> None:
        def positive(name: str, minimum: float = 1) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
                raise ConfigError(f"BrokerConfig.{name} must be >= {minimum}, got {value!r}")

        for name in (
            "missed_heartbeats",
            "max_attempts",
            "max_handbacks",
            "max_queued",
            "max_held",
            "max_group_size",
            "batch_size",
            "max_applying",
            "dedup_window",
            "max_worker_credits",
            "max_pull_groups",
            "burst_messages",
            "latency_samples",
        ):
            positive(name)
            if not isinstance(getattr(self, name), int):
                raise ConfigError(f"BrokerConfig.{name} must be an int, got {getattr(self, name)!r}")
        for name in ("heartbeat_interval_s", "task_timeout_s", "control_timeout_s", "orphan_ttl_s", "apply_slot_deadline_s", "result_resend_s",
                     "fleet_stage_deadline_s"):
            positive(name, 0.001)
        for name in ("max_pull_wait_s", "drain_timeout_s", "fresh_dispatch_hold_s", "coalesce_s"):
            positive(name, 0)
        for name in ("inline_max_bytes", "replay_max_group_bytes", "replay_max_bytes"):
            _non_negative_int(name, getattr(self, name))
        if self.activation not in ACTIVATION_MODES:
            raise ConfigError(f"BrokerConfig.activation must be one of {ACTIVATION_MODES}, got {self.activation!r}")
        if self.max_staleness is not None and (isinstance(self.max_staleness, bool) or self.max_staleness < 0):
            raise ConfigError(f"BrokerConfig.max_staleness must be >= 0 or None, got {self.max_staleness!r}")
        for name in ("worker_endpoint", "client_endpoint"):
            value = getattr(self, name)
            if not isinstance(value, str) or "://" not in value:
                raise ConfigError(f"BrokerConfig.{name} must be a ZeroMQ endpoint like tcp://127.0.0.1:5555, got {value!r}")
        if not self.pool:
            raise ConfigError("BrokerConfig.pool must not be empty")

    @property
    def dead_after_s(self) -> float:
        """Silence after which a worker is declared dead."""
        return self.heartbeat_interval_s * self.missed_heartbeats
