"""Run the blocks of README.md and docs/*.md marked ``run``, ``slow`` or ``serve`` (tests/doc_blocks.py).

Python and shell blocks run as a reader would run them, in a child process; one that names the pool
(`POOL_NAMES`) gets a fresh local pool (`rollpool launch local`, sim workers) in their place; Python blocks get the names of
prelude.py first. ``serve`` blocks start each line's service with its flags as written (endpoints through
``ROLLPOOL_*`` environment variables, so the line stays verbatim), check that the pool answers, then stop
it with SIGINT and expect exit 0. ``slow`` blocks (and ``serve: slow``) are marked ``slow`` (CI's one pytest run
runs them with the rest), with the tiny model made by ``rollpool make-tiny-model``.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.doc_blocks import REPO, Block, doc_files, read_blocks

HERE = pathlib.Path(__file__).resolve().parent
SIM = "length_median=12,decode_s_per_token=0.0005,capacity=128"
POOL_NAMES = ("tcp://broker:5556", "tcp://broker:5555")
"""What a block writes for the pool's client and worker endpoints; the harness puts the test pool's in their place."""


def _blocks(*kinds: str) -> list[Block]:
    return [b for p in doc_files() for b in read_blocks(p) if b.is_code and b.kind in kinds]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(**extra: str) -> dict[str, str]:
    bindir = os.path.dirname(sys.executable)  # the `rollpool` console script of this environment
    return {**os.environ, "PATH": f"{bindir}:{os.environ.get('PATH', '')}", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), **extra}


def _wait_for_workers(client_endpoint: str, workers: int, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Until the broker at ``client_endpoint`` counts ``workers`` alive (its port first, then its status)."""
    from rollpool.trainer_client import SyncTrainerClient, TrainerClientConfig

    deadline = time.monotonic() + timeout_s
    host, port = client_endpoint.removeprefix("tcp://").rsplit(":", 1)
    while True:  # the broker's port accepts: a client's requests now reach it
        assert proc.poll() is None, f"the pool exited with {proc.returncode}"
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, f"the broker did not listen on {client_endpoint} within {timeout_s} s"
            time.sleep(0.2)
    client = SyncTrainerClient(config=TrainerClientConfig(broker=client_endpoint, request_timeout_s=2.0))
    try:
        while client.status()["counters"].get("workers_alive", 0) < workers:
            assert proc.poll() is None, f"the pool exited with {proc.returncode}"
            assert time.monotonic() < deadline, f"{workers} workers did not come up within {timeout_s} s"
            time.sleep(0.3)
    finally:
        client.close()


def _stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def _log_tail(log_dir: pathlib.Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(log_dir.glob("*.log")))


@pytest.fixture
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A fresh local pool of 2 sim workers, with the admission rule the documented loops assume (eta 2).

    One per block, so no block depends on what another left (versions published, groups held): a block that
    publishes version 1 after one that published 3 would be refused."""
    d = tmp_path_factory.mktemp("doc-pool")
    worker_ep, client_ep = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    argv = [sys.executable, "-m", "rollpool", "--log-level", "WARNING", "launch", "local", "--workers", "2",
            "--engine", "sim", "--engine-options", SIM, "--worker-endpoint", worker_ep, "--client-endpoint", client_ep,
            "--log-dir", str(d / "logs"), "--broker-args", "--max-staleness 2 --batch-size 256"]
    with open(d / "launch.log", "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
    try:
        _wait_for_workers(client_ep, 2, proc, 60)
        yield dict(zip(POOL_NAMES, (client_ep, worker_ep), strict=True))
    finally:
        _stop(proc)


def _substituted(block: Block, subs: dict[str, str]) -> str:
    text = block.text
    for old, new in subs.items():
        text = text.replace(old, new)
    return text


def _run_block(block: Block, subs: dict[str, str], cwd: pathlib.Path, timeout_s: float = 120) -> None:
    text = _substituted(block, subs)
    if block.language in ("python", "py"):
        script = cwd / "block.py"
        prelude = (HERE / "prelude.py").read_text()
        if re.search(r"\bmodel\b", text):
            prelude += (HERE / "prelude_torch.py").read_text()
        script.write_text(prelude + f"\n# --- {block.id}\n" + text + "\n")
        argv = [sys.executable, str(script)]
        run_cwd = cwd
    else:
        argv = ["bash", "-euo", "pipefail", "-c", text]
        run_cwd = REPO  # shell blocks name repository paths (ops/, examples/)
    out = subprocess.run(argv, cwd=run_cwd, env=_env(), capture_output=True, text=True, timeout=timeout_s)
    assert out.returncode == 0, f"{block.id} exited {out.returncode}\n--- block\n{text}\n--- output\n{out.stdout[-3000:]}{out.stderr[-3000:]}"


def _pool_for(block: Block, request: pytest.FixtureRequest) -> dict[str, str]:
    """A pool for a block that names one (`POOL_NAMES`); none is started for the others."""
    return request.getfixturevalue("pool") if any(name in block.text for name in POOL_NAMES) else {}


@pytest.mark.parametrize("block", _blocks("run"), ids=lambda b: b.id)
def test_documented_block_runs(block: Block, request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> None:
    _run_block(block, _pool_for(block, request), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("block", _blocks("slow"), ids=lambda b: b.id)
def test_documented_long_block_runs(block: Block, request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> None:
    _run_block(block, _pool_for(block, request), tmp_path, timeout_s=600)


def _serve_blocks(slow: bool) -> list[Any]:
    out = []
    for b in _blocks("serve"):
        if (b.reason == "slow") == slow:
            out.extend(pytest.param(b, line, id=f"{b.id}+{i}") for i, line in enumerate(b.text.splitlines()) if line.strip())
    return out


def _serve(line: str, tmp_path: pathlib.Path, subs: dict[str, str], workers: int) -> None:
    worker_ep, client_ep = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    for old, new in subs.items():
        line = line.replace(old, new)
    env = _env(ROLLPOOL_WORKER_ENDPOINT=worker_ep, ROLLPOOL_CLIENT_ENDPOINT=client_ep)
    with open(tmp_path / "serve.log", "wb") as out:
        proc = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=tmp_path, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for_workers(client_ep, workers, proc, 120)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{(tmp_path / 'serve.log').read_text()[-3000:]}\n{_log_tail(tmp_path / 'logs')}") from None
    finally:
        rc = _stop(proc)
    assert rc == 0, (tmp_path / "serve.log").read_text()[-3000:]
    state = json.loads(next(tmp_path.rglob("launch.json")).read_text())
    assert all(p["pid"] is None and not p["given_up"] for p in state["processes"].values())


def _workers_in(line: str) -> int:
    words = line.split()
    return int(words[words.index("--workers") + 1]) if "--workers" in words else 2


@pytest.mark.parametrize(("block", "line"), _serve_blocks(slow=False))
def test_documented_service_comes_up_and_stops_clean(block: Block, line: str, tmp_path: pathlib.Path) -> None:
    _serve(line, tmp_path, {}, _workers_in(line))


@pytest.mark.slow
@pytest.mark.parametrize(("block", "line"), _serve_blocks(slow=True))
def test_documented_long_service_comes_up_and_stops_clean(block: Block, line: str, tmp_path: pathlib.Path,
                                                           redis_server: str) -> None:
    model = tmp_path / "tiny-model"
    subprocess.run([sys.executable, "-m", "rollpool", "make-tiny-model", str(model)], env=_env(), check=True,
                   capture_output=True, timeout=300)
    subs = {"/models/tiny": str(model), "redis://127.0.0.1:6379/0": redis_server}
    _serve(line, tmp_path, subs, _workers_in(line))
