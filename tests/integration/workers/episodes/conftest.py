"""Fixtures for the episode tests: the tiny model's tokenizer (its real chat template), and the reliability suite's pool
(a real broker over ZeroMQ that the tests start workers against)."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from tests.integration.reliability.conftest import pool
from tests.unit.workers.conftest import tiny_model_dir, tiny_vlm_dir

__all__ = ["pool", "tiny_model_dir", "tiny_tokenizer", "tiny_vlm_dir"]


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: pathlib.Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
