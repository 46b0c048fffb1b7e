"""The dashboard's scripts, run under Node against a real /api/state reply: every chart draws its series.

A stand-in for a headless browser (none on the CI image): the page's own chart.js
and dashboard.js run unchanged with a recording canvas and a minimal DOM.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable

import pytest

import rollpool.monitor
from rollpool.monitor.exporter import ExporterServer
from rollpool.monitor.reader import PoolState
from rollpool.monitor.sink import RedisMetricsSink
from tests.integration.monitor.conftest import populate

pytestmark = [pytest.mark.redis, pytest.mark.skipif(shutil.which("node") is None, reason="needs node")]

HERE = pathlib.Path(__file__).resolve().parent
STATIC = pathlib.Path(rollpool.monitor.__file__).resolve().parent / "static"


def test_the_dashboard_charts_draw_the_pool_series(make_sink: Callable[..., RedisMetricsSink], redis_server: str,
                                                   pool: str, tmp_path: pathlib.Path) -> None:
    sink = make_sink(series_interval_s=0.0)
    populate(sink)
    for step in range(1, 6):
        time.sleep(0.01)  # distinct sample times
        sink.publish_state("broker", "broker", {"version": 4 + step, "queued": 17 - step, "leased": 6, "held": 2,
                                                "requeued": 3 + step, "failed": 1, "dropped_stale": 2,
                                                "generated_tokens": 1000, "wasted_share": 0.3, "wasted_share_cancel": 0.25,
                                                "wasted_share_stale_drop": 0.05})
        for w in ("w1", "w2"):
            sink.publish_state("worker", w, {"weight_version": 3 + step, "tokens_per_s": 100.0 * step}, ttl_s=30)
        sink.observe("staleness", step % 3)
    assert sink.flush()
    time.sleep(1.1)  # one observation window, so the staleness series has a sample
    sink.observe("staleness", 1)
    assert sink.flush()

    server = ExporterServer(redis_server, pool, port=0, cache_s=0.0).start()
    try:
        with urllib.request.urlopen(server.url + "/api/state", timeout=10) as resp:
            (tmp_path / "state.json").write_bytes(resp.read())
    finally:
        server.close()
    out = subprocess.run(["node", str(HERE / "dashboard_harness.js"), str(STATIC), str(tmp_path / "state.json")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["loaded"] == "1", result["status"]
    for chart, drawn in result["charts"].items():
        assert drawn["points"] >= 2 and drawn["lineTo"] >= 1, (chart, drawn)
    assert {"w1", "w2"} <= set(result["charts"]["chart-tokens"]["text"])  # one legend entry per worker
    assert result["workerRows"] == 2 and result["eventRows"] == 2
    # the wasted shares by reason (cancelled, dropped as stale)
    cards = {label: value for value, label in result["brokerCards"]}
    assert cards["wasted"] == "30.0%" and cards["wasted: cancel"] == "25.0%" and cards["wasted: stale drop"] == "5.0%"


def test_before_the_first_publish_the_dashboard_shows_version_none_and_draws_no_lag(tmp_path: pathlib.Path) -> None:
    """The lag chart dipped to -2 and the cards read -1 while nothing was published (broker and workers at -1)."""
    t0 = 1_700_000_000.0
    state = PoolState(pool="p", time=t0 + 5, broker={"epoch": "e", "version": -1, "queued": 3, "age_s": 0.1},
                      workers={"w1": {"state": "ready", "weight_version": -1}}, entities={}, events=[], histograms={},
                      series={"broker:version": [(t0 + i, -1.0) for i in range(5)],
                              "worker:w1:weight_version": [(t0 + i + 0.5, -1.0) for i in range(5)]})
    (tmp_path / "state.json").write_text(json.dumps(state.to_dict()))
    out = subprocess.run(["node", str(HERE / "dashboard_harness.js"), str(STATIC), str(tmp_path / "state.json")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    cards = {label: value for value, label in result["brokerCards"]}
    assert cards["version"] == "none"
    assert result["charts"]["chart-lag"]["points"] == 0  # no lag before there are versions
