"""rollpool.workers: the rollout worker and its engines (imports `protocol` and `weights`)."""

from __future__ import annotations
