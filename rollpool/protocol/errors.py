"""The exception hierarchy of rollpool.

Exceptions are for a process's own faults and for input it must refuse; a
per-sample outcome (stop, length, abort, error) is data on the trajectory, not
an exception. Every error rollpool raises on purpose derives from
`RollpoolError`, so callers can catch the family in one clause.
"""

from __future__ import annotations

__all__ = [
    "RollpoolError",
    "ConfigError",
    "ProtocolError",
    "EngineError",
    "RequestRefusedError",
    "WeightSyncError",
    "BrokerUnavailableError",
    "RejectedError",
]


class RollpoolError(Exception):
    """Base of every error rollpool raises deliberately."""


class ConfigError(RollpoolError, ValueError):
    """A configuration value is out of range; the message names the field."""


class ProtocolError(RollpoolError):
    """A frame list could not be decoded, or a peer broke the protocol.

    `code` is a short machine-readable reason (``truncated``, ``oversize``,
    ``unknown_type``, ``version``, ``missing_field``, ``type``, ``frames``,
    ``malformed``, ``encode``); the message is for humans.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class EngineError(RollpoolError):
    """An inference engine failed (start, generate, apply, ...)."""


class RequestRefusedError(EngineError):
    """An engine refused one request after an explicit check (bad sampling, prompt too long, ...).

    Only the request checks raise it; it fails that request alone (not retried), while any
    other exception out of an engine means the engine failed and is restarted.
    """


class WeightSyncError(RollpoolError):
    """A weight version could not be fetched, verified or applied."""


class BrokerUnavailableError(RollpoolError):
    """The broker did not answer within the timeout."""


class RejectedError(RollpoolError):
    """A peer refused a request and said why (`reason`)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
