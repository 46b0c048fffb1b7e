"""rollpool.trainer_client: the trainer's client library (imports `protocol` and `weights`)."""

from __future__ import annotations
