"""Readers against a real Redis: `rollpool status --json`, `rollpool top` (plain and under a pty), the exporter."""

from __future__ import annotations

import json
import os
import pathlib
import pty
import re
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

import pytest

from rollpool.cli import build_parser
from rollpool.monitor.exporter import ExporterServer
from rollpool.monitor.sink import RedisMetricsSink
from tests.integration.monitor.conftest import populate
from tests.unit.monitor.promtext import parse_prometheus, sample_value

pytestmark = pytest.mark.redis

ROOT = pathlib.Path(__file__).resolve().parents[3]
Make = Callable[..., RedisMetricsSink]


def _run(argv: list[str]) -> int:
    """Run a subcommand as the console script does, minus the global logging setup."""
    args = build_parser().parse_args(argv)
    return int(args._run(args))


@pytest.fixture
def populated(make_sink: Make) -> RedisMetricsSink:
    sink = make_sink(series_interval_s=0.0)
    populate(sink)
    assert sink.flush()
    return sink


def test_status_json_reports_the_whole_pool(populated: RedisMetricsSink, redis_server: str, pool: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["status", "--json", "--redis-url", redis_server, "--pool", pool, "--series"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pool"] == pool and out["workers_alive"] == 2
    assert out["broker"]["queued"] == 17 and out["broker"]["epoch"] == "a1b2"
    assert out["workers"]["w2"]["tokens_per_s"] == 500.0 and 0 < out["workers"]["w2"]["ttl_s"] <= 30
    assert out["version_lag"] == {"w1": 0, "w2": 1}
    assert [e["kind"] for e in out["events"]] == ["worker_joined", "task_requeued"]
    assert out["histograms"]["staleness"]["count"] == 5
    assert ["+Inf", 0] in out["histograms"]["staleness"]["buckets"]
    assert out["series"]["broker:queued"][-1][1] == 17


def test_status_without_a_url_or_a_server_fails_cleanly(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("ROLLPOOL_REDIS_URL", raising=False)
    assert _run(["status", "--json"]) == 2
    assert "--redis-url" in capsys.readouterr().err
    monkeypatch.setenv("ROLLPOOL_REDIS_URL", "redis://127.0.0.1:1/0")
    assert _run(["status", "--json"]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_top_once_prints_one_frame(populated: RedisMetricsSink, redis_server: str, pool: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["top", "--once", "--redis-url", redis_server, "--pool", pool]) == 0
    frame = capsys.readouterr().out
    for text in (f"pool {pool}", "queued 17", "WORKERS (2 alive)", "w1", "w2", "STALENESS AT CONSUMPTION (n=5", "task_requeued"):
        assert text in frame, text
    assert "\x1b[" not in frame  # not a terminal: no escape codes


def _read_pty(fd: int, until: Callable[[bytes], bool], timeout_s: float) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not until(out):
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
    return out


@pytest.fixture
def top_process(redis_server: str, pool: str) -> Iterator[Callable[..., tuple[subprocess.Popen[bytes], int]]]:
    procs: list[tuple[subprocess.Popen[bytes], int]] = []

    def start(*extra: str) -> tuple[subprocess.Popen[bytes], int]:
        master, slave = pty.openpty()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120", "LINES": "40"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollpool", "top", "--redis-url", redis_server, "--pool", pool, *extra],
            stdin=slave, stdout=slave, stderr=slave, env=env, cwd=ROOT,
        )
        os.close(slave)
        procs.append((proc, master))
        return proc, master

    yield start
    for proc, master in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        os.close(master)


def test_top_redraws_live_under_a_pseudo_terminal(populated: RedisMetricsSink,
                                                  top_process: Callable[..., tuple[subprocess.Popen[bytes], int]]) -> None:
    proc, master = top_process("--interval-s", "0.2")
    out = _read_pty(master, lambda b: b.count(b"\x1b[H\x1b[2J") >= 2, timeout_s=20)
    assert out.count(b"\x1b[H\x1b[2J") >= 2, out[-2000:]
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=10) == 0
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", out.decode("utf-8", "replace"))
    assert "WORKERS (2 alive)" in text and "w2" in text and "queued 17" in text
    assert "\x1b[1m" in out.decode()  # a terminal gets bold headers


def _get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Content-Type", ""), err.read().decode()


@pytest.fixture
def exporter(redis_server: str, pool: str) -> Iterator[ExporterServer]:
    server = ExporterServer(redis_server, pool, port=0, cache_s=0.0).start()
    yield server
    server.close()


def test_exporter_metrics_parse_and_carry_broker_and_worker_figures(populated: RedisMetricsSink,
                                                                    exporter: ExporterServer, pool: str) -> None:
    status, ctype, body = _get(exporter.url + "/metrics")
    assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
    fams = parse_prometheus(body)
    assert sample_value(fams, "rollpool_up", pool=pool) == 1
    assert sample_value(fams, "rollpool_queue_depth", pool=pool) == 17
    assert sample_value(fams, "rollpool_requeued_total") == 3
    assert sample_value(fams, "rollpool_dropped_stale_total") == 2
    assert sample_value(fams, "rollpool_workers_alive") == 2
    assert sample_value(fams, "rollpool_worker_tokens_per_second", worker="w1") == 250.0
    assert sample_value(fams, "rollpool_worker_version_lag", worker="w2") == 1
    assert sample_value(fams, "rollpool_version_lag") == 1
    assert sample_value(fams, "rollpool_staleness_bucket", le="1") == 3
    assert sample_value(fams, "rollpool_staleness_count") == 5


def test_exporter_metrics_parse_with_prometheus_client(populated: RedisMetricsSink, exporter: ExporterServer,
                                                      pool: str) -> None:
    """The reference parser (prometheus_client's) reads the whole exposition and finds the same figures."""
    parser = pytest.importorskip("prometheus_client.parser")
    _, _, body = _get(exporter.url + "/metrics")
    families = list(parser.text_string_to_metric_families(body))
    types = {f.name: f.type for f in families}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}

    def value(name: str, **labels: str) -> float:
        hits = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)]
        assert len(hits) == 1, (name, labels, hits)
        return hits[0]

    assert types["rollpool_up"] == "gauge" and types["rollpool_staleness"] == "histogram"
    assert types["rollpool_requeued"] == "counter"  # the parser strips _total from a counter's family name
    assert value("rollpool_up", pool=pool) == 1
    assert value("rollpool_queue_depth", pool=pool) == 17
    assert value("rollpool_requeued_total") == 3
    assert value("rollpool_workers_alive") == 2
    assert value("rollpool_worker_tokens_per_second", worker="w1") == 250.0
    assert value("rollpool_worker_tokens_per_second", worker="w2") == 500.0
    assert value("rollpool_worker_version_lag", worker="w2") == 1
    assert value("rollpool_staleness_bucket", le="1") == 3
    assert value("rollpool_staleness_count") == 5


def test_exporter_serves_the_dashboard_and_its_local_chart_code(populated: RedisMetricsSink,
                                                                exporter: ExporterServer) -> None:
    status, ctype, page = _get(exporter.url + "/")
    assert status == 200 and ctype.startswith("text/html")
    scripts = re.findall(r'<script src="([^"]+)"', page)
    assert scripts == ["static/chart.js", "static/dashboard.js"]
    for script in scripts:
        status, ctype, js = _get(f"{exporter.url}/{script}")
        assert status == 200 and "javascript" in ctype and len(js) > 500
        assert "http://" not in js and "https://" not in js  # no CDN, nothing fetched from elsewhere
    assert "class LineChart" in _get(exporter.url + "/static/chart.js")[2]
    assert "https://" not in page and "http://" not in page
    status, ctype, body = _get(exporter.url + "/api/state")
    state = json.loads(body)
    assert status == 200 and ctype == "application/json"
    assert state["broker"]["queued"] == 17 and set(state["workers"]) == {"w1", "w2"}
    assert "broker:queued" in state["series"] and "worker:w1:tokens_per_s" in state["series"]
    assert _get(exporter.url + "/static/../exporter.py")[0] == 404
    assert _get(exporter.url + "/nope")[0] == 404


def test_exporter_reports_down_when_redis_is_unreachable(pool: str) -> None:
    server = ExporterServer("redis://127.0.0.1:1/0", pool, port=0).start()
    try:
        status, _, body = _get(server.url + "/metrics")
        assert status == 200 and sample_value(parse_prometheus(body), "rollpool_up") == 0
        status, _, body = _get(server.url + "/api/state")
        assert status == 503 and "error" in json.loads(body)
    finally:
        server.close()
