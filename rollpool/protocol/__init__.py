"""rollpool.protocol: messages, codec, limits, staleness arithmetic and the seams.

Pure: imports the standard library, msgpack and numpy, nothing else of ours
and no zmq, redis or torch at import time. Every other subpackage talks in
these types.
"""

from __future__ import annotations

from rollpool.protocol.codec import (
    ADAPTER_GRANT_MINOR,
    ADAPTER_ON_MINOR,
    BASE_ON_MINOR,
    CONTRACT_MINOR,
    DEFAULT_INLINE_MAX_BYTES,
    DELTA_MINOR,
    DELTA_PATHS_MINOR,
    EARLY_BYTES_MINOR,
    EARLY_DELTA_MINOR,
    EPOCH_MINOR,
    IMAGES_MINOR,
    INLINE_MINOR,
    LORA_MINOR,
    PARKED_MINOR,
    POLICY_MINOR,
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    REPLAY_MINOR,
    RESULT_MIX64_MINOR,
    RING_MINOR,
    SUPPORTED_MAJORS,
    TURN_BATCH_MINOR,
    Inline,
    carry_entry,
    decode,
    encode,
    inline_for,
    message_types,
    peek_type,
    records_equal,
)
from rollpool.protocol.errors import (
    BrokerUnavailableError,
    ConfigError,
    EngineError,
    ProtocolError,
    RejectedError,
    RollpoolError,
    WeightsRefusedError,
    WeightSyncError,
)
from rollpool.protocol.limits import DEFAULT_LIMITS, Limits
from rollpool.protocol.messages import *  # noqa: F403
from rollpool.protocol.messages import __all__ as _messages_all
from rollpool.protocol.metrics import MemoryMetricsSink, MetricsSink, NullMetricsSink
from rollpool.protocol.sockets import SecurityConfig, SocketFactory, SocketOptions
from rollpool.protocol.staleness import (
    StalenessController,
    admission_capacity,
    can_admit,
    sampled_versions,
    trajectory_staleness,
)

__all__ = [
    "PROTOCOL_MAJOR",
    "PROTOCOL_MINOR",
    "LORA_MINOR",
    "SUPPORTED_MAJORS",
    "encode",
    "decode",
    "Inline",
    "inline_for",
    "carry_entry",
    "IMAGES_MINOR",
    "REPLAY_MINOR",
    "ADAPTER_GRANT_MINOR",
    "RING_MINOR",
    "ADAPTER_ON_MINOR",
    "BASE_ON_MINOR",
    "POLICY_MINOR",
    "DELTA_PATHS_MINOR",
    "RESULT_MIX64_MINOR",
    "EARLY_BYTES_MINOR",
    "EARLY_DELTA_MINOR",
    "TURN_BATCH_MINOR",
    "INLINE_MINOR",
    "CONTRACT_MINOR",
    "DELTA_MINOR",
    "PARKED_MINOR",
    "EPOCH_MINOR",
    "DEFAULT_INLINE_MAX_BYTES",
    "peek_type",
    "message_types",
    "records_equal",
    "RollpoolError",
    "ConfigError",
    "ProtocolError",
    "EngineError",
    "WeightsRefusedError",
    "WeightSyncError",
    "BrokerUnavailableError",
    "RejectedError",
    "Limits",
    "DEFAULT_LIMITS",
    "MetricsSink",
    "NullMetricsSink",
    "MemoryMetricsSink",
    "SocketFactory",
    "SocketOptions",
    "SecurityConfig",
    "StalenessController",
    "admission_capacity",
    "can_admit",
    "sampled_versions",
    "trajectory_staleness",
    *_messages_all,
]


def negotiate_version(peer_min: int, peer_max: int) -> int | None:
    """The highest protocol major both sides speak, or None."""
    common = [m for m in SUPPORTED_MAJORS if peer_min <= m <= peer_max]
    return max(common) if common else None


def settle_minor(peer_minor: int) -> int:
    """The minor both sides speak: the lower of this build's and the one the peer's hello or welcome said (0: it
    did not say, i.e. minor 11 or older). There is one major; a second one would settle its minors the same way."""
    return min(PROTOCOL_MINOR, peer_minor) if peer_minor > 0 else 0


__all__ += ["negotiate_version", "settle_minor"]
