"""The Grafana dashboard queries only metrics the exporter actually renders."""

from __future__ import annotations

import json
import math
import pathlib
import re

from rollpool.monitor.prometheus import BROKER_COUNTERS, BROKER_GAUGES, render_prometheus
from rollpool.monitor.reader import HistogramState, PoolState
from tests.unit.monitor.promtext import parse_prometheus

DASHBOARD = pathlib.Path(__file__).resolve().parents[3] / "ops" / "grafana" / "rollpool.json"


def test_every_dashboard_query_names_an_exported_metric() -> None:
    broker = {"epoch": "e", "age_s": 0.1, **{f: 1 for f in BROKER_GAUGES}, **{f: 1 for f in BROKER_COUNTERS}}
    worker = {"host": "h", "engine": "sim", "model": "m", "state": "idle", "weight_version": 1, "inflight": 1,
              "credits": 1, "tokens_total": 1, "tokens_per_s": 1.0, "age_s": 0.1}
    state = PoolState(pool="p", time=0.0, broker=broker, workers={"w": worker}, entities={}, events=[],
                      histograms={"staleness": HistogramState(buckets=[(0, 1), (math.inf, 0)], count=1, sum=0.0)})
    exported = {name for fam in parse_prometheus(render_prometheus(state)).values() for name, _, _ in fam["samples"]}
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in doc["templating"]["list"] if "definition" in v]
    used = {m for e in exprs for m in re.findall(r"\brollpool_[a-z_]+", e)}
    assert used and used <= exported, sorted(used - exported)
    assert len({p["id"] for p in doc["panels"]}) == len(doc["panels"])
