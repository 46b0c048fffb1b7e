"""Fixtures for the worker and engine tests: a tiny local model, the sglang engine's child on CPU."""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

SIM_SERVER_ARGS = {"decode_s_per_token": 0.002, "length": "fixed", "length_median": 40, "vocab": 320}
"""What the sglang engine's CPU child serves: the sim engine with the tiny model's vocabulary."""


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A random-weight Llama with a byte-level BPE tokenizer, built once per session."""
    pytest.importorskip("transformers")
    from rollpool.workers.engines.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", vocab=320, hidden=32, layers=2, heads=4, kv_heads=2)


@dataclass(frozen=True)
class SimChild:
    url: str
    token: str
    model: str
    log: pathlib.Path
    hop: str
    """The child's per-sample socket (``--hop``): an engine attached with ``hop=`` sends /generate and /abort_request there."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def sglang_sim_child(tiny_model_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimChild]:
    """The sglang engine's child process, serving the sim engine with SGLang-shaped answers (one per module).

    Started with the command line `SGLangEngine.command` builds and a per-launch token in its
    environment, as the engine does; each test attaches its own engine with ``url=`` and the token.
    """
    pytest.importorskip("aiohttp")
    from rollpool.workers.engines.sglang.engine import SGLangEngine
    from rollpool.workers.engines.sglang.http import TOKEN_ENV

    port = _free_port()
    eng = SGLangEngine(model=str(tiny_model_dir), port=port, capacity=16, backend="sim", server_args=json.dumps(SIM_SERVER_ARGS))
    token = secrets.token_urlsafe(16)
    log = tmp_path_factory.mktemp("sglang-sim") / "child.log"
    hop = f"ipc://{log.parent}/hop"
    with log.open("ab") as fh:
        proc = subprocess.Popen(eng.command(hop=hop), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, TOKEN_ENV: token})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the sim child exited {proc.returncode}: {log.read_text()[-3000:]}")
            try:
                req = urllib.request.Request(url + "/health_generate", headers={"Authorization": f"Bearer {token}"})
                with urllib.request.urlopen(req, timeout=5) as r:
                    if r.status == 200:
                        break
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the sim child did not start")
            time.sleep(0.05)
        yield SimChild(url, token, str(tiny_model_dir), log, hop)
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A random-weight Qwen2-VL (one-block vision tower) with its tokenizer and image processor, built once per session."""
    pytest.importorskip("transformers")
    pytest.importorskip("PIL")
    from rollpool.workers.engines.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-vlm") / "model", arch="qwen2", vocab=320, hidden=32, layers=2, heads=4,
                            kv_heads=2, vlm=True)
