"""`model_fingerprint`: the digest that names a model directory across processes.

A worker reports it for the model it loaded (`Hello.fingerprint`); the broker may
require one (`set_required_fingerprint`), and a trainer-side adapter computes it
for its own copy of the directory to check that both sides mean the same model.
It covers what decides tokenization and shapes (``config.json``, ``tokenizer.json``,
``tokenizer_config.json``, the ones present), not the weights: a new weight version
of the same model keeps its fingerprint. One definition, so every side agrees.
"""

from __future__ import annotations

import hashlib
import pathlib

__all__ = ["FINGERPRINT_FILES", "model_fingerprint"]

FINGERPRINT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


def model_fingerprint(model_dir: str | pathlib.Path) -> str:
    """16 hex digits of sha256 over the fingerprint files present in `model_dir` (name, NUL, bytes, in order)."""
    path = pathlib.Path(model_dir)
    digest = hashlib.sha256()
    for name in FINGERPRINT_FILES:
        f = path / name
        if f.exists():
            digest.update(name.encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:16]
