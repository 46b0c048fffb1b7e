"""The worker integration tests share the unit tests' tiny model fixture."""

from __future__ import annotations

from tests.unit.workers.conftest import tiny_model_dir

__all__ = ["tiny_model_dir"]
