"""rollpool.workers.engines: the Engine protocol and its implementations (sim, hf, sglang)."""

from __future__ import annotations
