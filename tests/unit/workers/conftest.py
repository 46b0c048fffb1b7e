"""Fixtures for the worker and engine tests: a tiny local model, engines by name."""

from __future__ import annotations

import pathlib

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A random-weight Llama with a byte-level BPE tokenizer, built once per session."""
    pytest.importorskip("transformers")
    from rollpool.workers.engines.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", vocab=320, hidden=32, layers=2, heads=4, kv_heads=2)
