"""bench/gpu_weights.py's goals on a CPU: a goal is reported only for the path its row meant; a row whose versions went
over another path says "not measured", with the paths taken and the fallbacks' reasons (the summary can never
report a figure of a path it did not take)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_weights_bench", ROOT / "bench" / "gpu_weights.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _version(v: int, path: str, *, reasons: list[str] | None = None, note: str = "", applied: float = 0.3) -> dict[str, Any]:
    return {"version": v, "trainer_blocked_s": 0.2, "publish_to_applied_s": applied, "pause_s": 0.001, "torn_snapshot": False,
            "fetched_path": path, "fallback_reasons": reasons or [], "publisher_path_note": note, "publisher_socket_bytes": 0,
            "extra_gpu_bytes_peak": 1 << 30, "fetched_after_publish_s": applied, "model_bytes": 14 << 30}


def _summarize(bench: ModuleType, rows: dict[str, Any]) -> dict[str, Any]:
    bench.RESULT.clear()
    bench.RESULT.update({"rows": rows, "how": {}, "model_bytes": 14 << 30})
    bench.summarize()
    return bench.RESULT  # type: ignore[no-any-return]


def test_the_same_gpu_goal_is_not_measured_when_shm_served_it() -> None:
    """The 8B failure: the arena was not made, every cuda_ipc row's version came over shared memory, and the summary
    said `same_gpu_ipc_s` met. Now: not measured, with the path taken and the publisher's reason."""
    bench = _bench()
    why = "a whole-version same-GPU arena of 13.49 GiB would pass the publisher's GPU budget"
    rows = {"cuda_ipc_cuda": {"versions": [_version(v, "shm_device", note=why) for v in range(1, 7)]}}
    res = _summarize(bench, rows)
    goal = res["goals"]["same_gpu_ipc_s"]
    assert goal["met"] is None and "not cuda_ipc" in goal["not_measured"]
    assert goal["paths_taken"] == ["shm_device"] and why in goal["fallback_reasons"]
    assert res["same_gpu_ipc_paths_taken"] == ["shm_device"]


def test_one_version_on_another_path_is_enough_to_not_measure() -> None:
    bench = _bench()
    vs = [_version(v, "cuda_ipc") for v in range(1, 7)]
    vs[3] = _version(4, "shm_device", reasons=["cannot open the publisher's GPU buffer"])
    goal = _summarize(bench, {"cuda_ipc_cuda": {"versions": vs}})["goals"]["same_gpu_ipc_s"]
    assert goal["met"] is None and goal["fallback_reasons"] == ["cannot open the publisher's GPU buffer"]
    assert "1 of 6" in goal["not_measured"]


def test_a_goal_is_met_or_missed_only_on_its_own_path() -> None:
    bench = _bench()
    rows = {"cuda_ipc_cuda": {"versions": [_version(v, "cuda_ipc") for v in range(1, 7)]},
            "shm_cpu": {"versions": [_version(v, "shm_device", applied=2.0) for v in range(7, 13)]},
            "tcp_cpu": {"versions": [_version(v, "shm", applied=1.0) for v in range(13, 19)]}}
    res = _summarize(bench, rows)
    goals = res["goals"]
    assert goals["same_gpu_ipc_s"]["met"] is True and goals["same_gpu_ipc_s"]["paths_taken"] == ["cuda_ipc"]
    assert goals["cpu_tensors_shm_path_s"]["met"] is False  # 2.0 s over shared memory: measured, and missed
    assert res["cpu_tensors_shm_path_s"] == 2.0 and res["ipc_extra_gpu_bytes"] == 1 << 30
    # the tcp_cpu row went over shared memory: no tcp figure is claimed (and there is no tcp_cuda row to compare with)
    assert "cpu_tensors_tcp_vs_cuda_tcp" not in goals or goals["cpu_tensors_tcp_vs_cuda_tcp"]["met"] is None


def test_path_goal_is_pure_and_never_reports_an_untaken_path() -> None:
    bench = _bench()
    for taken in ("cuda_ipc", "shm_device", "shm", "network", None):
        row = {"versions": [_version(1, str(taken)), _version(2, str(taken))]}
        for meant in ("cuda_ipc", ("shm", "shm_device"), "network"):
            goal = bench.path_goal(row, meant, 0.1, 0.5)
            wanted = (meant,) if isinstance(meant, str) else meant
            assert (goal["met"] is not None) == (str(taken) in wanted)
    assert bench.path_goal({"versions": []}, "cuda_ipc", None, 0.5)["met"] is None


def test_the_delta_rows_give_the_8b_delta_keys_from_the_versions_rebuilt_from_a_delta_only() -> None:
    bench = _bench()
    model = 14 << 30

    def delta_version(v: int, base: int, nbytes: int, applied: float) -> dict[str, Any]:
        return {**_version(v, "network", applied=applied), "delta_base": base, "worker_socket_bytes": nbytes,
                "changed_fraction": 0.0215 if base >= 0 else None}

    full_first = [delta_version(1, -1, model, 1.4)]  # the row's first version: no base held, the full version
    rows = {"tcp_cuda_delta": {"versions": full_first + [delta_version(v, v - 1, model // 23, 0.3) for v in range(2, 6)]},
            "shm_cuda_delta": {"versions": [delta_version(v, v - 1, model // 23, 0.2) for v in range(6, 11)]}}
    out = _summarize(bench, rows)
    assert out["changed_fraction"] == 0.0215 and out["delta_versions_rebuilt"] == 9
    assert abs(out["delta_bytes_fraction"] - 1 / 23) < 1e-3
    assert out["delta_host_path_s"] == 0.3 and out["delta_shm_path_s"] == round(0.2 - 0.001, 4)
    assert out["goals"]["delta_bytes_fraction"]["met"] is True and out["goals"]["delta_host_path_s"]["met"] is True


def test_the_ring_counts_for_the_same_gpu_goals_and_says_which_ran() -> None:
    """Past the budget the version streams through the ring: its row says cuda_ipc_ring, and the three same-GPU goals
    (publish to applied, trainer blocked, extra GPU bytes within two buckets) are measured on it; a row where the ring
    served some versions and shared memory others reports none of them."""
    bench = _bench()
    rows = {"cuda_ipc_cuda": {"versions": [_version(v, "cuda_ipc_ring") for v in range(1, 7)]}}
    bench.RESULT.clear()
    bench.RESULT.update({"rows": rows, "how": {}, "model_bytes": 14 << 30, "bucket_bytes": 512 << 20})
    bench.summarize()
    res, goals = bench.RESULT, bench.RESULT["goals"]
    assert res["same_gpu_ipc_paths_taken"] == ["cuda_ipc_ring"]
    assert goals["same_gpu_ipc_s"]["met"] is True and goals["same_gpu_trainer_blocked_s"]["met"] is True
    assert goals["ipc_extra_gpu_bytes"]["met"] is True and goals["ipc_extra_gpu_bytes"]["value"] == 1 << 30
    vs = [_version(v, "cuda_ipc_ring") for v in range(1, 7)]
    vs[2] = _version(3, "shm_device", reasons=["the publisher's same-GPU ring of version 3 ended after 4 of 27 buckets"])
    rows = {"cuda_ipc_cuda": {"versions": vs}}
    bench.RESULT.update({"rows": rows})
    bench.summarize()
    goals = bench.RESULT["goals"]
    for key in ("same_gpu_ipc_s", "same_gpu_trainer_blocked_s", "ipc_extra_gpu_bytes"):
        assert goals[key]["met"] is None and "1 of 6" in goals[key]["not_measured"], goals[key]
    assert bench.RESULT["same_gpu_ipc_paths_taken"] == ["cuda_ipc_ring", "shm_device"]


def test_the_ring_only_row_is_measured_on_the_ring_alone() -> None:
    """keep_versions=0 through the ring (row ring_only_cuda): its goals count only when the ring served every version."""
    bench = _bench()
    rows = {"ring_only_cuda": {"versions": [_version(v, "cuda_ipc_ring") for v in range(1, 7)]},
            "cuda_ipc_cuda": {"versions": [_version(v, "cuda_ipc_ring") for v in range(7, 13)]}}
    bench.RESULT.clear()
    bench.RESULT.update({"rows": rows, "how": {}, "model_bytes": 14 << 30, "bucket_bytes": 512 << 20})
    bench.summarize()
    goals = bench.RESULT["goals"]
    assert goals["ring_only_ipc_s"]["met"] is True and goals["ring_only_trainer_blocked_s"]["met"] is True
    assert bench.RESULT["ring_only_paths_taken"] == ["cuda_ipc_ring"]
    rows["ring_only_cuda"]["versions"][0] = _version(1, "network", reasons=["the publisher's same-GPU ring of version 1 ended"])
    bench.summarize()
    assert bench.RESULT["goals"]["ring_only_ipc_s"]["met"] is None
    assert bench.RESULT["goals"]["ring_only_extra_gpu_bytes"]["met"] is None


def test_the_device_delta_goals_are_measured_only_when_every_delta_was_made_on_the_device() -> None:
    bench = _bench()

    def row(made_on: str, why: str = "") -> dict[str, Any]:
        vs = []
        for v in range(1, 7):
            rec = {**_version(v, "network", applied=0.3), "delta_base": v - 1 if v > 1 else -1, "trainer_blocked_s": 0.05,
                   "delta_made_on": made_on, "why_not_delta_on_device": why, "delta_phases": {"delta_compare_s": 0.01},
                   "delta_rebuilt_on": "device" if v > 1 else None, "delta_device_rebuild_s": 0.03}
            vs.append(rec)
        return {"delta": True, "versions": vs}

    goals = _summarize(bench, {"tcp_cuda_delta_device": row("device")})["goals"]
    assert goals["delta_device_host_path_s"]["met"] is True and goals["delta_device_trainer_blocked_s"]["met"] is True
    why = "a device delta base of 16 GiB would pass the publisher's GPU budget"
    res = _summarize(bench, {"tcp_cuda_delta_device": row("host", why)})
    goal = res["goals"]["delta_device_trainer_blocked_s"]
    assert goal["met"] is None and goal["made_on"] == ["host"] and goal["why_not_device"] == [why]
    assert res["delta_device_phases"]["delta_compare_s"] == 0.01


def test_a_device_delta_row_counts_only_when_the_worker_rebuilt_every_steady_version_on_its_gpu() -> None:
    """The worker's side of the device rows: a version rebuilt on the host (an older publisher's delta without the
    mix64 of its resulting bytes) or one that came whole (a fallback) leaves the row's figure unmeasured, with where the
    versions were rebuilt and why not on the GPU."""
    bench = _bench()

    def row(rebuilt: list[str | None], why: str = "") -> dict[str, Any]:
        vs = [{**_version(v, "network", applied=0.3), "delta_base": v - 1, "trainer_blocked_s": 0.05, "delta_made_on": "device",
               "delta_rebuilt_on": where, "why_not_rebuilt_on_device": why if where != "device" else None,
               "delta_device_rebuild_s": 0.02 if where == "device" else None, "delta_phases": {}}
              for v, where in zip(range(1, 7), rebuilt, strict=True)]
        return {"delta": True, "versions": vs}

    res = _summarize(bench, {"tcp_cuda_delta_device": row([None, "device", "device", "device", "device", "device"])})
    assert res["goals"]["delta_device_host_path_s"]["met"] is True and res["goals"]["delta_device_host_path_s"]["rebuilt_on"] == ["device"]
    assert res["delta_device_rebuilt_on"]["tcp_cuda_delta_device"]["counts"] == {"device": 4}
    assert res["delta_device_rebuild_s"] == 0.02
    why = "the delta carries no mix64 of the resulting bytes for 27 of 27 buckets"
    res = _summarize(bench, {"tcp_cuda_delta_device": row([None, "device", "host", "device", None, "device"], why)})
    goal = res["goals"]["delta_device_host_path_s"]
    assert goal["met"] is None and goal["rebuilt_on"] == ["device", "host", "none"] and goal["why_not_rebuilt_on_device"] == [why]
    assert "not only its GPU" in goal["not_measured"]


def test_an_early_served_delta_versions_phases_are_recorded() -> None:
    """A device-made delta served early (minor 28) is applied before its complete delta exists: the version's phases
    are the early delta's (`ServedVersion.early`). The bench read only the complete one, so every steady version's
    server phases were None and a row's medians were its first delta version's (`early_mix_s` 0.147 s on an H100)."""
    from types import SimpleNamespace

    bench = _bench()
    early = SimpleNamespace(timings={"compare_s": 0.05, "encode_s": 0.03, "early_mix_s": 0.012, "early_at": 100.2},
                            changed_fraction=0.02, wire_bytes=1 << 20)
    served = SimpleNamespace(delta=None, early=early)
    phases = bench.delta_phases(bench.served_delta(served), {"manifest_at": 100.25, "manifest_s": 0.2}, 100.0)
    assert phases["early_mix_s"] == 0.012
    assert phases["early_delta_ready_after_publish_s"] == 0.2
    assert phases["delta_compare_s"] == 0.05
    complete = SimpleNamespace(timings={"early_mix_s": 0.012, "made_at": 101.0}, changed_fraction=0.02, wire_bytes=1 << 20)
    assert bench.served_delta(SimpleNamespace(delta=complete, early=None)) is complete  # the complete one, once made
    assert bench.served_delta(None) is None


def test_a_delta_rows_cold_start_is_its_first_delta_and_its_full_first_version_is_not_in_first_over_warm() -> None:
    """A delta row's first version is a full one (nothing to be a delta of): 1.4 s against steady 0.3 s deltas would
    read as a cold start of 4.7x; the row's cold start is its first delta (0.33 s: 1.1x), the full rows' goal stays."""
    bench = _bench()
    model = 14 << 30

    def delta_version(v: int, base: int, applied: float) -> dict[str, Any]:
        return {**_version(v, "network", applied=applied), "delta_base": base, "worker_socket_bytes": model // 23}

    rows = {"tcp_cuda": {"versions": [_version(v, "network", applied=1.3 if v == 1 else 1.2) for v in range(1, 6)]},
            "tcp_cuda_delta": {"delta": True, "versions": [delta_version(6, -1, 1.4), delta_version(7, 6, 0.33)]
                               + [delta_version(v, v - 1, 0.3) for v in range(8, 11)]}}
    goals = _summarize(bench, rows)["goals"]
    assert goals["first_over_warm"] == {"value": round(1.3 / 1.2, 3), "goal": "<= 1.2", "met": True}
    assert goals["first_delta_over_warm"] == {"value": 1.1, "goal": "<= 1.2", "met": True}


def test_the_delta_rows_step_moves_the_same_elements_as_a_masked_add_without_a_host_sync() -> None:
    """`sparse_step` (the delta rows' trainer step) moves `fraction` of each bf16 tensor's elements one bf16 step, the
    rest bit-identical: the same elements and values as the masked form it replaced (`w[mask] += 1`, which counted the
    mask on the host and so held the bench's loop), in both directions."""
    torch = pytest.importorskip("torch")
    sparse_step = _bench().sparse_step

    g = torch.Generator().manual_seed(3)
    sd = {"a": torch.randn(50_000, generator=g).to(torch.bfloat16), "b": torch.randn(300, 40, generator=g).to(torch.bfloat16),
          "f": torch.randn(100, generator=g)}
    for v in (4, 5):
        before = {k: t.clone() for k, t in sd.items()}
        sparse_step(sd, v, 0.02)
        masked = {k: t.clone() for k, t in before.items()}
        gen = torch.Generator().manual_seed(v)
        for k in ("a", "b"):  # the same generator, tensor by tensor, as sparse_step draws it
            w = masked[k].view(torch.int16).view(-1)
            w[torch.rand(w.shape, generator=gen) < 0.02] += 1 if v % 2 else -1
        for k in sd:
            assert torch.equal(sd[k].view(-1).view(torch.uint8), masked[k].view(-1).view(torch.uint8)), (v, k)
        changed = (sd["a"].view(torch.int16) != before["a"].view(torch.int16)).float().mean().item()
        assert 0.015 < changed < 0.025
        assert torch.equal(sd["f"], before["f"])  # fp32: not a bf16 tensor, untouched


def test_first_over_warm_leaves_out_a_shm_row_whose_segments_were_not_registered_ahead_and_says_so() -> None:
    """After a row switch the bench has evicted every version, so nothing announced the next shm row's segments: its
    first version measured that, not a cold start. Left out of the goal, named with the reason; a row registered
    ahead counts as before."""
    bench = _bench()
    first_slow = [_version(1, "shm", applied=1.9)] + [_version(v, "shm", applied=1.0) for v in range(2, 7)]
    rows = {"tcp_cuda": {"versions": [_version(v, "network", applied=1.0) for v in range(1, 7)]},
            "shm_cpu": {"versions": first_slow, "register_wait_s": 60.0}}
    goal = _summarize(bench, rows)["goals"]["first_over_warm"]
    assert goal["value"] == 1.0 and goal["met"] is True and list(goal["not_counted"]) == ["shm_cpu"]
    rows["shm_cpu"]["worker_registered_ahead"] = {"segments": 66, "registered": 66}
    goal = _summarize(bench, rows)["goals"]["first_over_warm"]
    assert goal["value"] == 1.9 and goal["met"] is False and "not_counted" not in goal


def test_a_cpu_row_run_without_the_trainers_step_reports_its_figure_but_no_goal() -> None:
    """`--cpu-step-threads 0` leaves out the CPU row's trainer step (a diagnostic of what that step costs the
    transfer): the figures stay, the CPU-tensor goals are "not measured"; with the step they count as before."""
    bench = _bench()
    rows = {"tcp_cuda": {"versions": [_version(v, "network", applied=1.0) for v in range(1, 7)]},
            "tcp_cpu": {"versions": [_version(v, "network", applied=1.1) for v in range(7, 13)]}}
    for threads, met in ((None, True), (8, True), (0, None)):
        bench.RESULT.clear()
        bench.RESULT.update({"rows": rows, "how": {}, "model_bytes": 14 << 30, "params": {"cpu_step_threads": threads}})
        bench.summarize()
        goal = bench.RESULT["goals"]["cpu_tensors_tcp_vs_cuda_tcp"]
        assert goal["value"] == 1.1 and goal["met"] is met, threads
        assert ("not_measured" in goal) is (met is None)


def test_a_cpu_row_run_again_with_its_step_on_n_threads_is_its_own_figure_not_the_goals() -> None:
    """``--rows tcp_cuda,tcp_cpu,tcp_cpu_step0`` runs the CPU row twice in one engine start, the second without the
    trainer's step: the goals read the row itself; the step row's median is reported beside, under its name."""
    bench = _bench()
    assert bench.select_rows("tcp_cuda,tcp_cpu,tcp_cpu_step0,shm_cpu_step8,tcp_cuda_step3,nope") == [
        ("tcp", "cuda", False), ("tcp", "cpu", False), ("tcp", "cpu@0", False), ("shm", "cpu@8", False)]
    assert bench.select_rows("", delta=True)[-1] == ("shm", "cuda", "device") and len(bench.select_rows("")) == 5
    rows = {"tcp_cuda": {"versions": [_version(v, "network", applied=1.0) for v in range(1, 7)]},
            "tcp_cpu": {"versions": [_version(v, "network", applied=1.5) for v in range(7, 13)]},
            "tcp_cpu_step0": {"cpu_step_threads": 0, "versions": [_version(v, "network", applied=1.1) for v in range(13, 19)]}}
    res = _summarize(bench, rows)
    goal = res["goals"]["cpu_tensors_tcp_vs_cuda_tcp"]
    assert goal["value"] == 1.5 and goal["met"] is False  # the row with the step, as always
    assert res["cpu_tensors_by_step_threads"]["tcp_cpu_step0"]["publish_to_applied_s"] == 1.1
    assert res["cpu_tensors_by_step_threads"]["tcp_cpu_step0"]["cpu_step_threads"] == 0


def test_a_device_delta_row_run_again_without_the_diff_kernels_is_its_own_figure_not_the_goals() -> None:
    """``--rows tcp_cuda_delta_device,tcp_cuda_delta_device_torchdiff`` runs the device delta row with the diff kernels
    and again with the torch ops in one engine start: the goals and first_delta_over_warm read the kernels' row only;
    both rows are reported side by side under delta_device_by_compare, with what compared each."""
    bench = _bench()
    assert bench.select_rows("tcp_cuda_delta_device,shm_cuda_delta_device_torchdiff,tcp_cuda_torchdiff") == [
        ("tcp", "cuda", "device"), ("shm", "cuda@torchdiff", "device")]

    def row(applied: float, blocked: float, by: str, first: float) -> dict[str, Any]:
        vs = [{**_version(v, "network", applied=first if v == 2 else applied), "delta_base": v - 1 if v > 1 else -1,
               "trainer_blocked_s": blocked, "delta_made_on": "device", "why_not_delta_on_device": "", "delta_compared_by": by,
               "delta_phases": {"delta_compare_s": blocked / 2}, "delta_rebuilt_on": "device" if v > 1 else None,
               "delta_device_rebuild_s": 0.03} for v in range(1, 7)]
        return {"delta": "device", "versions": vs}

    res = _summarize(bench, {"tcp_cuda_delta_device": row(0.25, 0.05, "kernels", 0.26),
                             "tcp_cuda_delta_device_torchdiff": row(0.33, 0.13, "torch ops (the bench's _torchdiff row)", 0.9)})
    assert res["goals"]["delta_device_host_path_s"]["value"] == 0.25 and res["goals"]["delta_device_trainer_blocked_s"]["value"] == 0.05
    assert res["goals"]["first_delta_over_warm"]["met"] is True  # the torch row's 0.9 s second version is not a cold start
    by = res["delta_device_by_compare"]
    assert by["tcp_cuda_delta_device"]["compared_by"] == ["kernels"] and by["tcp_cuda_delta_device"]["publish_to_applied_s"] == 0.25
    assert by["tcp_cuda_delta_device_torchdiff"]["trainer_blocked_s"] == 0.13
    assert by["tcp_cuda_delta_device_torchdiff"]["compared_by"] == ["torch ops (the bench's _torchdiff row)"]
    assert by["tcp_cuda_delta_device_torchdiff"]["delta_compare_s"] == 0.065
