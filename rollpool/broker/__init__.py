"""rollpool.broker: the ZeroMQ broker (imports only `rollpool.protocol`)."""

from __future__ import annotations
