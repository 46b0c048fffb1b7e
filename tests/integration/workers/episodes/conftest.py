"""Fixtures for the episode endpoint tests: the tiny model's tokenizer (its real chat template)."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from tests.unit.workers.conftest import tiny_model_dir, tiny_vlm_dir

__all__ = ["tiny_model_dir", "tiny_tokenizer", "tiny_vlm_dir"]


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: pathlib.Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
