"""The analytic side of bench/async_speedup.py: the admission-window bound, the zero-latency
model of the pool's rules, and the steady-state rate. Pure arithmetic, no sockets, no clocks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("async_speedup_bench", ROOT / "bench" / "async_speedup.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


bench = _bench()
W = bench.Workload()


@pytest.mark.parametrize(("gpus", "eta"), [(64, 1), (64, 4), (256, 2), (256, 8)])
def test_window_bound_matches_the_zero_latency_model_without_drops(gpus: int, eta: int) -> None:
    model = bench.analytic(W, gpus, [eta], warmup_s=600.0)
    gen, train = bench.split(W, gpus)
    free = bench.ideal_pool(W, gen, train, eta, steps=300, hard_bound=False, warmup_s=600.0)["samples_per_s"]
    bound = model["async_bound"][eta]
    assert bound["samples_per_s"] == min(bound["window"], bound["slots"], bound["trainer"])
    assert free == pytest.approx(bound["samples_per_s"], rel=0.04)
    # the old (eta + 1) B / E[group time] overstates what the window allows
    assert (eta + 1) * W.batch_size / model["mean_group_s"] > 1.05 * bound["window"]


def test_hard_bound_drops_cost_a_share_at_every_eta() -> None:
    gen, train = bench.split(W, 64)
    for eta in (1, 4):
        ideal = bench.ideal_pool(W, gen, train, eta, steps=300, warmup_s=600.0)
        free = bench.ideal_pool(W, gen, train, eta, steps=300, hard_bound=False, warmup_s=600.0)
        assert 0.1 < ideal["dropped_share"] < 0.3
        assert free["dropped_share"] == 0
        assert ideal["samples_per_s"] < 0.9 * free["samples_per_s"]
        cancel = bench.ideal_pool(W, gen, train, eta, steps=300, warmup_s=600.0, cancel_doomed=True)
        assert ideal["samples_per_s"] < cancel["samples_per_s"] < free["samples_per_s"]


def test_slots_bind_at_64_gpus_eta_8() -> None:
    b = bench.analytic(W, 64, [8], warmup_s=600.0)["async_bound"][8]
    assert b["slots"] < b["window"]
    assert b["samples_per_s"] == b["slots"] == pytest.approx(56 * 64 / 202.8, rel=0.01)


def test_steady_rate_skips_the_warm_up() -> None:
    steps = [100.0, 300.0, 500.0, 700.0, 710.0, 720.0, 730.0, 740.0]
    rate, start, k = bench.steady_rate(steps, 512, warmup_s=600.0)
    assert (start, k) == (700.0, 4)  # from the first step at or after 600 s
    assert rate == pytest.approx(4 * 512 / 40.0)
    rate, start, k = bench.steady_rate([100.0, 700.0, 710.0], 512, warmup_s=600.0)  # too few after: second half
    assert (start, k) == (100.0, 2)


def test_starting_a_version_behind_at_each_bump_costs_most_at_small_eta() -> None:
    gen, train = bench.split(W, 64)
    loss = {}
    for eta in (1, 8):
        ideal = bench.ideal_pool(W, gen, train, eta, steps=300, warmup_s=600.0)
        behind = bench.ideal_pool(W, gen, train, eta, steps=300, warmup_s=600.0, start_behind_at_bump=True)
        assert behind["dropped_share"] >= ideal["dropped_share"]
        loss[eta] = 1 - behind["samples_per_s"] / ideal["samples_per_s"]
    assert loss[1] > 0.1 > loss[8]
