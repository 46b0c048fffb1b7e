"""rollpool.weights: bucketing, publisher, subscriber and relay (imports only `rollpool.protocol`)."""

from __future__ import annotations
