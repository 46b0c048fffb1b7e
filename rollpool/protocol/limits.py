"""Decoding limits: the most a peer may make us read or allocate.

Every bound is configurable; the defaults fit the largest legitimate messages
(a pulled batch of 64 groups of 64 samples, a 4 MiB weight chunk) with room to
spare and refuse anything far beyond them before it is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollpool.protocol.errors import ConfigError

__all__ = ["Limits", "DEFAULT_LIMITS", "DEFAULT_PEER_MAX_MSG_BYTES"]

_MiB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Limits:
    max_header_bytes: int = 4 * _MiB
    """Largest msgpack header (frame 0)."""
    max_frame_bytes: int = 64 * _MiB
    """Largest binary frame (token ids, logprobs, a weight chunk)."""
    max_message_bytes: int = 512 * _MiB
    """Largest sum of all frames of one message."""
    max_frames: int = 65_536
    """Most frames in one message, header included."""
    max_str_len: int = 1 * _MiB
    """Longest string anywhere in a header."""
    max_bin_len: int = 1 * _MiB
    """Longest inline bytes value in a header."""
    max_array_len: int = 65_536
    """Longest list in a header."""
    max_map_len: int = 4_096
    """Most keys in one map of a header."""
    max_depth: int = 16
    """Deepest nesting of free-form maps (metadata)."""
    max_header_objects: int = 1 << 20
    """Most values in one header, counted as msgpack builds it (every element of every list, every key
    and value of every map): the decoder stops when the count is passed, so a small header cannot
    expand into many small objects (4 MiB of empty maps is 4 million dicts, about 290 MiB)."""
    max_unknown_fields: int = 16
    """Most fields one record map may carry beyond the ones this build knows (newer optional fields)."""

    def __post_init__(self) -> None:
        for name in (
            "max_header_bytes",
            "max_frame_bytes",
            "max_message_bytes",
            "max_frames",
            "max_str_len",
            "max_bin_len",
            "max_array_len",
            "max_map_len",
            "max_depth",
            "max_header_objects",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"Limits.{name} must be a positive int, got {value!r}")
        if self.max_frames < 1:
            raise ConfigError("Limits.max_frames must be >= 1")
        if not isinstance(self.max_unknown_fields, int) or self.max_unknown_fields < 0:
            raise ConfigError(f"Limits.max_unknown_fields must be an int >= 0, got {self.max_unknown_fields!r}")


DEFAULT_LIMITS = Limits()

DEFAULT_PEER_MAX_MSG_BYTES = 64 * _MiB
"""The MAXMSGSIZE a peer that announced none is assumed to have (`SocketOptions.max_msg_bytes`'s default)."""
