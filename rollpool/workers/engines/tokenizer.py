"""The model directory's tokenizer, for an engine that keeps none in this process (sglang).

The episode endpoint renders chat messages and decodes turns in the worker; the `hf` engine
exposes its tokenizer, the sglang engine tokenizes in its child. `load_tokenizer` gives the
worker the same tokenizer from the model directory, or None (and a warning) when it cannot.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["load_tokenizer"]

log = logging.getLogger(__name__)


def load_tokenizer(model: str) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        log.warning("no tokenizer for %s: transformers is not installed (the chat endpoint refuses, token-level episodes run)", model)
        return None
    try:
        return AutoTokenizer.from_pretrained(model)
    except Exception as exc:  # noqa: BLE001 - the endpoint then refuses text requests and says so
        log.warning("no tokenizer from %s: %s", model, exc)
        return None
