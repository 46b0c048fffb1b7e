"""The rollpool exception hierarchy (defined in `rollpool.protocol.errors`)."""

from __future__ import annotations

from rollpool.protocol.errors import (
    BrokerUnavailableError,
    ConfigError,
    EngineError,
    ProtocolError,
    RejectedError,
    RequestRefusedError,
    RollpoolError,
    WeightsRefusedError,
    WeightSyncError,
)

__all__ = [
    "RollpoolError",
    "ConfigError",
    "ProtocolError",
    "EngineError",
    "RequestRefusedError",
    "WeightSyncError",
    "WeightsRefusedError",
    "BrokerUnavailableError",
    "RejectedError",
]
