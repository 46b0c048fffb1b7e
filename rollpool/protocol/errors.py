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
    "WeightsRefusedError",
    "WeightSyncError",
    "BrokerUnavailableError",
    "RejectedError",
    "MessageTooLargeError",
]


class RollpoolError(Exception):
    """Base of every error rollpool raises deliberately."""


class ConfigError(RollpoolError, ValueError):
    """A configuration value is out of range; the message names the field."""


class ProtocolError(RollpoolError):
    """A frame list could not be decoded, or a peer broke the protocol.

    `code` is a short machine-readable reason (``truncated``, ``oversize``,
    ``unknown_type``, ``version``, ``missing_field``, ``type``, ``frames``,
    ``malformed``, ``encode``, ``unexpected_type``); the message is for humans. `limit`
    names the bound that refused the input (a `Limits` field, ``max_msg_bytes``,
    ``pending_pulls_per_peer``, ...) when a limit did.
    """

    def __init__(self, code: str, message: str, *, limit: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.limit = limit


class EngineError(RollpoolError):
    """An inference engine failed (start, generate, apply, ...)."""


class WeightsRefusedError(EngineError):
    """An engine refused a weight version after checking it, before writing anything (an unknown parameter
    name, a shape that does not match): it still serves its previous version, intact. The worker reports the
    version failed and skips it; no restart (a poison version costs nothing but itself)."""


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


class MessageTooLargeError(ProtocolError):
    """The sender refused to send a message larger than the peer said it accepts.

    libzmq drops a message over the receiver's MAXMSGSIZE together with the
    connection and tells nobody why, so the sender checks first, against the
    limit the peer announced in its hello (or the default it has always used).
    """

    def __init__(self, what: str, nbytes: int, limit_bytes: int, limit: str = "max_msg_bytes") -> None:
        super().__init__(
            "oversize",
            f"{what} of {nbytes} bytes is over the peer's {limit} of {limit_bytes} bytes (split it, or raise {limit} on both sides)",
            limit=limit,
        )
        self.nbytes = nbytes
        self.limit_bytes = limit_bytes
