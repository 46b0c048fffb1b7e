"""`model_fingerprint`: what names a model directory (config and tokenizer files), not its weights."""

from __future__ import annotations

import pathlib

from rollpool.protocol.fingerprint import model_fingerprint


def test_the_config_and_tokenizer_decide_the_fingerprint_and_the_weights_do_not(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    (tmp_path / "tokenizer.json").write_text('{"model": {}}')
    first = model_fingerprint(tmp_path)
    assert len(first) == 16 and int(first, 16) >= 0
    assert model_fingerprint(str(tmp_path)) == first
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 64)  # a new weight version: same model
    assert model_fingerprint(tmp_path) == first
    (tmp_path / "tokenizer_config.json").write_text("{}")
    second = model_fingerprint(tmp_path)
    assert second != first
    (tmp_path / "config.json").write_text('{"hidden_size": 128}')
    assert model_fingerprint(tmp_path) not in (first, second)


def test_an_empty_directory_has_the_fingerprint_of_nothing(tmp_path: pathlib.Path) -> None:
    assert model_fingerprint(tmp_path) == "e3b0c44298fc1c14"  # sha256 of no bytes
