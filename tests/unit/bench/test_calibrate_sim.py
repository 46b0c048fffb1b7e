"""bench/calibrate_sim.py on synthetic measured runs: the simulated async/sync ratio against the measured one."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from bench import calibrate_sim as cs
from bench.gpu_demo import pair_summary

TAIL = {"tail_median_tokens": 32, "tail_sigma": 1.0, "tail_max_tokens": 512}


def _run(mode: str, eta: int, seed: int, decode_s: float, trainer_s_per_token: float, samples_per_s: float,
         steps: int = 20) -> dict[str, Any]:
    """A run JSON as bench/gpu_demo.py writes it, with group timings made from a known decode time per token."""
    rng = random.Random(seed * 100 + eta)
    groups, tokens = [], []
    for step in range(1, steps + 1):
        step_tokens = 0
        for _ in range(32):
            n_tokens = max(1, min(512, round(32 * 2.718 ** rng.gauss(0, 1))))
            groups.append([step, n_tokens, n_tokens * decode_s, 8])
            step_tokens += 8 * n_tokens
        tokens.append(float(step_tokens))
    return {"mode": mode, "max_staleness": eta, "seed": seed, "steps": steps, "samples_per_step": 256, "capacity": 256,
            "group_size": 8, "samples_per_s": samples_per_s, "group_timings": groups,
            "per_step": {"tokens": tokens, "train_s": [t * trainer_s_per_token for t in tokens], "publish_s": [0.0] * steps,
                         "eval_s": [0.0] * steps, "wait_s": [0.0] * steps},
            "demo": dict(TAIL)}


def _workload(decode_s: float, trainer_s: float) -> cs.Workload:
    return cs.Workload(length_median=32, length_sigma=1.0, length_cap=512, decode_s_per_step=decode_s, capacity=256,
                       group_size=8, batch_size=256, train_s_per_token_gpu=trainer_s, shared_group_length=True)


def test_measured_times_are_read_from_the_group_timings_and_the_trainer_steps() -> None:
    t = cs.measured_times(_run("sync", 0, 0, decode_s=0.004, trainer_s_per_token=2e-6, samples_per_s=100.0))
    assert t["decode_s_per_token"] == pytest.approx(0.004)
    assert t["trainer_s_per_token"] == pytest.approx(2e-6)


def test_a_measured_ratio_the_model_misses_by_more_than_15_percent_gets_a_correction_that_closes_it(tmp_path: Path) -> None:
    # the "GPU": sync decodes at 4 ms per token; async runs fuller beside the trainer, at 7 ms, and trains slower
    sync_rate = cs.simulated_rate(_workload(0.004, 2e-6), 0, 20)
    truth = cs.simulated_rate(_workload(0.007, 3e-6), 2, 20)  # what the measured async run did
    for rec in (_run("sync", 0, 0, 0.004, 2e-6, sync_rate), _run("async2", 2, 0, 0.007, 3e-6, truth)):
        (tmp_path / f"h100-demo-{rec['mode']}-s0.json").write_text(json.dumps(rec))
    out_path = tmp_path / "cal.json"
    assert cs.main(["--runs", str(tmp_path / "h100-demo-*-s*.json"), "--json", str(out_path)]) == 0
    out = json.loads(out_path.read_text())
    row = out["by_mode"]["async2"]
    assert row["measured"] == pytest.approx(truth / sync_rate, rel=1e-3)
    # as built: decode time fixed, no contention
    assert out["simulator_error_samples_per_s"] > cs.ERROR_LIMIT and not out["within_limit_samples_per_s"]
    # no time to the threshold in these runs: no wall-time ratio, no corrected model, and no error made up for them
    assert out["simulator_error"] is None and not out["within_limit"] and "skipped" in out["corrected"]
    assert out["simulator_error_shared_gpu"] < 0.02  # the measured contention times reproduce the measured ratio
    assert out["correction"]["decode_slowdown"] == pytest.approx(7 / 4, rel=1e-3)
    assert out["correction"]["trainer_slowdown"] == pytest.approx(1.5, rel=1e-3)
    # the sync run was as fast as the zero-latency model: no per-step latency to add, the third variant agrees
    assert row["sync_latency_s"] == pytest.approx(0.0, abs=1e-6)
    assert row["shared_gpu_latency"] == pytest.approx(row["shared_gpu"], rel=1e-3)


def test_a_sync_run_slower_than_the_model_shows_its_per_step_latency() -> None:
    sync_rate = cs.simulated_rate(_workload(0.004, 2e-6), 0, 20)
    slow_sync = 256 / (256 / sync_rate + 0.5)  # half a second per step the model does not have
    async_rate = cs.simulated_rate(_workload(0.004, 2e-6), 2, 20)
    out = cs.calibrate([_run("sync", 0, 0, 0.004, 2e-6, slow_sync), _run("async2", 2, 0, 0.004, 2e-6, async_rate)])
    row = out["by_mode"]["async2"]
    assert row["sync_latency_s"] == pytest.approx(0.5, rel=1e-3)
    assert row["error_shared_gpu_latency"] < 0.01 < row["error_as_built"]


def test_a_ratio_the_model_predicts_within_15_percent_needs_no_correction(tmp_path: Path) -> None:
    sync_rate = cs.simulated_rate(_workload(0.004, 2e-6), 0, 20)
    predicted = cs.simulated_rate(_workload(0.004, 2e-6), 4, 20)
    runs = [_run("sync", 0, s, 0.004, 2e-6, sync_rate) for s in (0, 1)]
    runs += [_run("async4", 4, 0, 0.004, 2e-6, predicted * 1.05), _run("async4", 4, 1, 0.004, 2e-6, predicted * 0.97)]
    out = cs.calibrate(runs)
    row = out["by_mode"]["async4"]
    assert row["seeds"] == [0, 1] and row["measured_min"] < row["measured_max"]  # the spread over seeds
    assert out["simulator_error_samples_per_s"] < cs.ERROR_LIMIT and out["within_limit_samples_per_s"]
    assert "correction" not in out


def test_async_runs_without_a_sync_run_of_their_seed_are_refused() -> None:
    with pytest.raises(ValueError, match="no async run"):
        cs.calibrate([_run("async2", 2, 3, 0.004, 2e-6, 10.0)])


def test_pairs_put_each_async_run_against_the_sync_run_of_its_seed() -> None:
    recs = [{"mode": "sync", "seed": 0, "time_to_threshold_s": 80.0, "samples_per_s": 100.0, "tokens_per_s": 1.0},
            {"mode": "sync", "seed": 1, "time_to_threshold_s": 100.0, "samples_per_s": 90.0, "tokens_per_s": 1.0},
            {"mode": "async2", "seed": 0, "time_to_threshold_s": 40.0, "samples_per_s": 200.0, "tokens_per_s": 2.0},
            {"mode": "async2", "seed": 1, "time_to_threshold_s": 60.0, "samples_per_s": 180.0, "tokens_per_s": 2.0},
            {"mode": "async4", "seed": 0, "time_to_threshold_s": None, "samples_per_s": 250.0, "tokens_per_s": 2.5}]
    out = pair_summary(recs)
    a2 = out["by_mode"]["async2"]["async_over_sync"]
    assert (a2["mean"], a2["min"], a2["max"], a2["n"]) == (0.55, 0.5, 0.6, 2)
    assert out["by_mode"]["async4"]["async_over_sync"] is None  # never reached the threshold: no ratio made up
    assert out["by_mode"]["async4"]["async_over_sync_samples_per_s"]["mean"] == 2.5


def test_fitted_times_separate_the_fixed_seconds_of_a_group_from_its_seconds_per_token() -> None:
    """Group timings of 0.15 s + 1.6 ms per token (the H100 sync runs' fit): the fit recovers both, where the median
    of seconds over tokens folds the fixed part in and comes out several times too slow per token."""
    rec = _run("sync", 0, 0, decode_s=0.0016, trainer_s_per_token=2e-6, samples_per_s=100.0)
    for g in rec["group_timings"]:
        g[2] += 0.15
    fitted = cs.fitted_times(rec)
    assert fitted["decode_s_per_token"] == pytest.approx(0.0016, rel=1e-6)
    assert fitted["group_latency_s"] == pytest.approx(0.15, rel=1e-6)
    assert cs.measured_times(rec)["decode_s_per_token"] > 3 * 0.0016
    w = cs.workload_of(rec, fitted)
    assert w.group_latency_s == pytest.approx(0.15)
    # the latency is on every group's clock: a step of the sync model takes longer with it than without it
    assert cs.simulated_rate(w, 0, 10) < cs.simulated_rate(cs.workload_of(rec, {**fitted, "group_latency_s": 0.0}), 0, 10)


TRUTH = {"decode_s_per_step": 1e-3, "group_latency_s": 0.1, "decode_s_per_seq": 5e-6, "update_s_per_seq": 2e-3,
         "decode_overlap": 0.5}
SMALL_GRID = {"decode_s_per_step": (1e-3, 2e-3), "group_latency_s": (0.1, 0.2), "decode_s_per_seq": (0.0, 5e-6),
              "update_s_per_seq": (0.0, 2e-3), "decode_overlap": (0.0, 0.5)}
SEEDS = (1, 2)


def _corrected_run(mode: str, eta: int, seed: int, params: dict[str, float], trainer_s: float, steps: int = 12) -> dict[str, Any]:
    """A run JSON whose measured figures are the corrected model's own (what a GPU obeying the model would give)."""
    rec = _run(mode, eta, seed, 0.002, trainer_s, 1.0, steps=steps)
    sim = cs.corrected_sim(rec, params, eta, trainer_s, steps, SEEDS)
    m = sim["mean_group_s"]
    k = steps - 2
    rec.update({"samples_per_s": sim["samples_per_s"], "trainer_idle_share": sim["trainer_idle_share"],
                "group_timings": [[1, 16, m - 0.05, 8], [1, 48, m + 0.05, 8]],
                "steps_to_threshold": k, "time_to_threshold_s": sim["step_at_s"][k - 1]})
    return rec


def test_the_corrected_model_fitted_on_sync_and_eta_1_recovers_its_parameters_and_predicts_eta_2() -> None:
    runs = [_corrected_run("sync", 0, 0, TRUTH, 2e-5), _corrected_run("async1", 1, 0, TRUTH, 3e-5),
            _corrected_run("async2", 2, 0, TRUTH, 3e-5)]
    out = cs.calibrate(runs, fit_etas=(1,), grid=SMALL_GRID, seeds=SEEDS)
    corr = out["corrected"]
    assert corr["params"] == TRUTH and corr["loss"] == pytest.approx(0.0, abs=1e-12)
    assert corr["trainer_s_per_token_async"] == pytest.approx(3e-5)  # the fitted bound's trainer, not the sync one's
    assert [r["role"] for r in corr["by_mode"].values()] == ["fitted", "predicted"]
    assert out["simulator_error_predicted"] < 1e-3 and out["within_limit"] and out["within_limit_predicted"]
    # the same runs against the simulator as built (fixed decode step, nothing shared): far off on the wall time
    assert out["simulator_error_as_built"] > cs.ERROR_LIMIT
    # the predicted bound is not fitted on: its runs can say anything, the parameters stay
    runs[2] = {**runs[2], "samples_per_s": 1.0, "trainer_idle_share": 0.99, "time_to_threshold_s": 1e3}
    again = cs.fit_corrected(runs, fit_etas=(1,), grid=SMALL_GRID, seeds=SEEDS, refine_rounds=0)
    assert again["params"] == TRUTH and not any("async2" in p for p in again["fitted_on"])
