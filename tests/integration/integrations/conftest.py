"""Fixtures of the integration adapters' tests: the real-process pool of the trainer-client tests."""

from __future__ import annotations

from tests.integration.trainer_client.conftest import pool_factory  # noqa: F401  (re-exported fixture)
