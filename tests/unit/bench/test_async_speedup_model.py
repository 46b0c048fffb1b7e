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
    model = bench.analytic(W, gpus, [eta], warmup_s=600.0, rule_models=False)
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
    b = bench.analytic(W, 64, [8], warmup_s=600.0, rule_models=False)["async_bound"][8]
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


# ---------------------------------------------------------------------- the staleness rule sets (MODEL)

TODAY = {"start_behind_at_bump": True}
NEW = {"start_behind_at_bump": True, "fresh_dispatch_hold_s": 5.0, "apply_s": 1.0, "cancel_doomed": True}


def test_version_aware_dispatch_recovers_the_start_behind_loss_when_the_hold_covers_the_apply() -> None:
    gen, train = bench.split(W, 64)
    ideal = bench.ideal_pool(W, gen, train, 1, steps=300, warmup_s=600.0)
    today = bench.ideal_pool(W, gen, train, 1, steps=300, warmup_s=600.0, **TODAY)
    held = bench.ideal_pool(W, gen, train, 1, steps=300, warmup_s=600.0, start_behind_at_bump=True,
                            fresh_dispatch_hold_s=5.0, apply_s=1.0)
    short = bench.ideal_pool(W, gen, train, 1, steps=300, warmup_s=600.0, start_behind_at_bump=True,
                             fresh_dispatch_hold_s=0.5, apply_s=1.0)  # the hold ends first: dispatched behind anyway
    assert held["samples_per_s"] == pytest.approx(ideal["samples_per_s"], rel=0.03)  # 1 s of idle capacity per step
    assert held["dropped_share"] == pytest.approx(ideal["dropped_share"], abs=0.02)
    assert held["dropped_share"] < today["dropped_share"] - 0.1
    assert short["samples_per_s"] < 0.9 * held["samples_per_s"]
    with pytest.raises(ValueError, match="fresh_dispatch_hold_s"):
        bench.ideal_pool(W, gen, train, 1, steps=10, fresh_dispatch_hold_s=-1.0)


def test_early_cancellation_turns_stale_drops_into_cheaper_cancels_and_the_shares_add_up() -> None:
    gen, train = bench.split(W, 64)
    today = bench.ideal_pool(W, gen, train, 1, steps=300, warmup_s=600.0, **TODAY)
    new = bench.ideal_pool(W, gen, train, 1, steps=300, warmup_s=600.0, **NEW)
    assert today["cancelled_share"] == 0 and today["wasted_share_by_reason"]["cancel"] == 0
    assert new["cancelled_share"] > 0.1 and new["dropped_share"] < 0.05
    for r in (today, new):
        assert sum(r["wasted_share_by_reason"].values()) == pytest.approx(r["wasted_share"])
        assert r["max_staleness_seen"] <= 1 and r["older_than_eta_share"] == 0  # drop never trains above eta
    # the issue's figure: at eta 1 the new drop rules waste about half of what today's do, and train more
    assert 0.4 < new["wasted_share"] / today["wasted_share"] < 0.7
    assert new["samples_per_s"] > 1.15 * today["samples_per_s"]


@pytest.mark.parametrize("gpus", [64, 256])
def test_keep_with_twice_eta_reaches_the_bound_with_little_waste_and_states_its_staleness(gpus: int) -> None:
    gen, train = bench.split(W, gpus)
    b = bench.analytic(W, gpus, [], warmup_s=600.0)  # the bound's inputs only
    bound = min(bench.fluid_window_bound(W, 4, b["mean_group_s"], b["async_train_s"]), gen * W.capacity / b["mean_group_s"])
    keep = bench.ideal_pool(W, gen, train, 4, steps=300, warmup_s=600.0, stale_policy="keep", **NEW)
    drop = bench.ideal_pool(W, gen, train, 4, steps=300, warmup_s=600.0, **NEW)
    assert keep["samples_per_s"] >= 0.95 * bound > drop["samples_per_s"]
    assert keep["wasted_share"] <= 0.04 < drop["wasted_share"]
    assert 0 < keep["older_than_eta_share"] < 0.5 and 4 < keep["max_staleness_seen"] <= 8
    tight = bench.ideal_pool(W, gen, train, 4, steps=300, warmup_s=600.0, stale_policy="keep", max_staleness_keep=5, **NEW)
    assert tight["max_staleness_seen"] <= 5 and tight["wasted_share"] > keep["wasted_share"]
    with pytest.raises(ValueError, match="stale_policy"):
        bench.ideal_pool(W, gen, train, 4, steps=10, stale_policy="regenerate")


def test_summarise_writes_the_issue_24_maps_from_the_model_and_the_runs() -> None:
    model = bench.analytic(W, 64, [4], warmup_s=600.0)
    model["async_bound"] = {str(k): v for k, v in model["async_bound"].items()}
    bound = model["async_bound"]["4"]["samples_per_s"]
    run = {"eta": 4, "steady_samples_per_s": 0.5 * bound, "samples_per_s": 0.5 * bound, "max_staleness_seen": 4,
           "wasted_share": 0.3, "older_than_eta_share": 0.0, "rules": "new"}
    keep = {**run, "steady_samples_per_s": 0.9 * bound, "max_staleness_seen": 7, "wasted_share": 0.01, "older_than_eta_share": 0.2}
    # stored before the broker's staleness rules
    today = {k: v for k, v in run.items() if k not in ("wasted_share", "rules")}
    out: dict = {"runs": {"64": {"analytic": model, "async_eta4": run, "keep_eta4": keep, "today_eta4": {**today, "rules": "today"}}}}
    bench.summarise(out)
    assert out["keep_fraction_of_bound"] == {"64": {"4": pytest.approx(0.9)}}
    assert out["keep_wasted_share"]["64"]["4"] == 0.01 and out["keep_older_than_eta_share"]["64"]["4"] == 0.2
    assert out["keep_max_staleness_seen"]["64"]["4"] == 7 and out["max_staleness_seen"]["64"]["4"] == 4
    assert out["drop_wasted_share"]["64"]["4"] == 0.3
    new_drop = model["async_bound"]["4"]["model_new_drop"]
    assert out["drop_model_wasted_share"]["64"]["4"] == new_drop["wasted_share"]
    assert out["drop_fraction_of_model"]["64"]["4"] == pytest.approx(0.5 * bound / new_drop["samples_per_s"])
    assert out["today_fraction_of_bound"]["64"]["4"] == pytest.approx(0.5) and out["today_wasted_share"] == {}


# ---------------------------------------------------------------------- the corrected model (one shared GPU, MODEL)

DEMO = bench.Workload(length_median=32, length_sigma=1.0, length_cap=512, decode_s_per_step=0.0016, capacity=512,
                      group_size=8, batch_size=256, train_s_per_token_gpu=25e-6, shared_group_length=True,
                      group_latency_s=0.15)


@pytest.mark.parametrize("eta", [0, 1, 4])
def test_the_shared_gpu_model_without_costs_is_the_zero_latency_model(eta: int) -> None:
    plain = bench.ideal_pool(DEMO, 1, 1, eta, steps=20, seed=3, return_steps=True)
    shared = bench.shared_gpu_pool(DEMO, bench.SharedGpuCost(), 1, 1, eta, steps=20, seed=3, return_steps=True)
    assert shared["step_at_s"] == pytest.approx(plain["step_at_s"], rel=1e-9)
    assert shared["paused_share"] == 0


def test_a_fuller_engine_slows_every_sequence_and_weight_updates_pause_the_groups_in_flight() -> None:
    free = bench.shared_gpu_pool(DEMO, bench.SharedGpuCost(), 1, 1, 4, steps=30, seed=3)
    per_seq = bench.shared_gpu_pool(DEMO, bench.SharedGpuCost(decode_s_per_seq=20e-6), 1, 1, 4, steps=30, seed=3)
    paused = bench.shared_gpu_pool(DEMO, bench.SharedGpuCost(update_s_per_seq=5e-4), 1, 1, 4, steps=30, seed=3)
    overlap = bench.shared_gpu_pool(DEMO, bench.SharedGpuCost(decode_overlap=1.0), 1, 1, 4, steps=30, seed=3)

    def mean_s(r: dict) -> float:
        return sum(g[1] for g in r["group_timings"]) / len(r["group_timings"])

    for slow in (per_seq, paused, overlap):
        assert mean_s(slow) > mean_s(free)
    # (a decode slowed only while the trainer trains can raise the rate: the short groups it lets finish first make
    # cheaper batches; so no rate claim for it)
    assert per_seq["samples_per_s"] < free["samples_per_s"] and paused["samples_per_s"] < free["samples_per_s"]
    assert per_seq["mean_in_flight"] > 2 * free["mean_in_flight"]  # slower sequences: more of them in flight
    assert paused["paused_share"] > 0.02 and per_seq["paused_share"] == 0
    # sync has nothing in flight at a version: the update pause costs it nothing
    sync = bench.ideal_pool(DEMO, 1, 1, 0, steps=10, seed=3, return_steps=True)
    sync_paused = bench.shared_gpu_pool(DEMO, bench.SharedGpuCost(update_s_per_seq=5e-4), 1, 1, 0, steps=10, seed=3,
                                        return_steps=True)
    assert sync_paused["step_at_s"] == pytest.approx(sync["step_at_s"], rel=1e-9)
