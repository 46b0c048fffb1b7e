"""Restart backoff and queue-depth autoscaling: pure decisions, an injected clock, no sleeping."""

from __future__ import annotations

import argparse
import logging
import pathlib

import pytest

from rollpool.launch.config import LaunchWorker
from rollpool.launch.local import LocalLaunchConfig, local_process_specs
from rollpool.launch.policy import Autoscaler, RestartPolicy, RestartTracker, desired_replicas
from rollpool.launch.ray_launch import RayLaunchConfig, worker_command
from rollpool.protocol.config import add_config_arguments, load_config
from rollpool.protocol.errors import ConfigError


def test_backoff_doubles_caps_and_gives_up_after_max_quick_failures() -> None:
    tracker = RestartTracker(RestartPolicy(backoff_s=1, backoff_max_s=5, max_restarts=4, stable_after_s=60))
    assert [tracker.on_exit(0.5) for _ in range(4)] == [1, 2, 4, 5]
    assert tracker.on_exit(0.5) is None  # the 5th quick failure in a row: given up


def test_a_stable_run_resets_the_backoff() -> None:
    tracker = RestartTracker(RestartPolicy(backoff_s=1, backoff_max_s=30, max_restarts=3, stable_after_s=10))
    assert [tracker.on_exit(1), tracker.on_exit(1), tracker.on_exit(100), tracker.on_exit(1)] == [1, 2, 1, 2]
    assert tracker.restarts == 4


@pytest.mark.parametrize(("queued", "inflight", "want"), [(0, 0, 1), (64, 0, 1), (65, 0, 2), (200, 56, 4), (10_000, 0, 8)])
def test_desired_replicas_follows_queue_depth_within_bounds(queued: int, inflight: int, want: int) -> None:
    assert desired_replicas(queued, inflight, capacity_per_worker=64, min_replicas=1, max_replicas=8) == want


def test_desired_replicas_rejects_nonsense() -> None:
    with pytest.raises(ConfigError, match="capacity_per_worker"):
        desired_replicas(1, 0, 0, 1, 2)
    with pytest.raises(ConfigError, match="min_replicas"):
        desired_replicas(1, 0, 8, 3, 2)


def test_autoscaler_scales_up_at_once_and_down_only_after_a_quiet_window() -> None:
    a = Autoscaler(capacity_per_worker=10, min_replicas=1, max_replicas=10, scale_down_cooldown_s=60, max_scale_down_step=2)
    assert a.decide(now=0, current=1, queued_samples=55, inflight_samples=0) == 6  # backlog: up at once
    assert a.decide(now=10, current=6, queued_samples=0, inflight_samples=0) == 6  # quiet for 0 s: hold
    assert a.decide(now=50, current=6, queued_samples=0, inflight_samples=0) == 6  # 40 s: still hold
    assert a.decide(now=71, current=6, queued_samples=0, inflight_samples=0) == 4  # a whole quiet window: down, 2 at most
    assert a.decide(now=80, current=4, queued_samples=0, inflight_samples=0) == 4  # next step down waits a window
    assert a.decide(now=132, current=4, queued_samples=0, inflight_samples=0) == 2
    assert a.decide(now=133, current=2, queued_samples=95, inflight_samples=0) == 10  # a burst: up at once, capped


def test_autoscaler_does_not_drop_below_a_recent_peak() -> None:
    a = Autoscaler(capacity_per_worker=10, min_replicas=1, max_replicas=10, scale_down_cooldown_s=60, max_scale_down_step=5)
    a.decide(now=0, current=5, queued_samples=50, inflight_samples=0)
    a.decide(now=30, current=5, queued_samples=30, inflight_samples=0)  # recommends 3
    # at 61 the 50-sample peak (t=0) has left the window, the 30-sample one (t=30) has not: down to 3, not 1
    assert a.decide(now=61, current=5, queued_samples=0, inflight_samples=0) == 3


def test_local_specs_are_the_plain_service_clis_with_stable_worker_ids() -> None:
    cfg = LocalLaunchConfig(workers=2, relay=True, weights_upstream="tcp://trainer:6000", pool="p",
                            worker=LaunchWorker(args="--capacity 8"))
    specs = local_process_specs(cfg, python="py", redis_url="redis://r:6379/0")
    assert [s.name for s in specs] == ["broker", "relay", "worker-0", "worker-1"]
    assert specs[0].argv[:4] == ("py", "-m", "rollpool", "broker") and specs[0].critical
    assert specs[2].argv[:4] == ("py", "-m", "rollpool", "worker")
    assert "p-w1" in specs[3].argv and specs[3].argv[-2:] == ("--capacity", "8")
    assert all("redis://r:6379/0" in s.argv for s in specs)
    assert [s.stop_stage for s in specs] == [2, 1, 0, 0]  # workers drain first, the broker goes last


def test_relay_needs_an_upstream() -> None:
    with pytest.raises(ConfigError, match="weights-upstream"):
        LocalLaunchConfig(relay=True)


# nested launch configs (a shared group of fields is one dataclass, not copies): flags and environment stay flat, the
# TOML file nests, old flat TOML keys still read


def _cli_config(cls: type, argv: list[str], toml: str | None = None, tmp_path: pathlib.Path | None = None,
                environ: dict[str, str] | None = None) -> object:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, cls)
    path = None
    if toml is not None:
        assert tmp_path is not None
        path = tmp_path / "c.toml"
        path.write_text(toml)
    section = "launch" if cls is LocalLaunchConfig else "launch_ray"
    return load_config(cls, parser.parse_args(argv), toml_path=str(path) if path else None, section=section,
                       environ=environ or {})


def test_the_old_flags_fill_the_nested_worker_and_restart_policy() -> None:
    cfg = _cli_config(LocalLaunchConfig, ["--engine", "hf", "--model", "/m", "--engine-options", "seed=1",
                                          "--worker-args", "--capacity 8", "--restart-backoff-s", "0.2",
                                          "--restart-backoff-max-s", "4", "--max-restarts", "3", "--stable-after-s", "9"])
    assert isinstance(cfg, LocalLaunchConfig)
    assert cfg.worker == LaunchWorker(engine="hf", model="/m", engine_options="seed=1", args="--capacity 8")
    assert cfg.restart == RestartPolicy(backoff_s=0.2, backoff_max_s=4.0, max_restarts=3, stable_after_s=9.0)
    worker = local_process_specs(cfg, python="py")[1].argv
    assert worker[worker.index("--engine") + 1] == "hf" and worker[-2:] == ("--capacity", "8")


def test_a_nested_default_is_the_launcher_s_own() -> None:
    """ray's workers default to sglang, local's to sim; a flag changes only its own field."""
    cfg = _cli_config(RayLaunchConfig, ["--broker", "tcp://h:5555", "--model", "/m"])
    assert isinstance(cfg, RayLaunchConfig)
    assert cfg.worker == LaunchWorker(engine="sglang", model="/m")
    assert worker_command(cfg, 0)[:8] == ["python", "-m", "rollpool", "worker", "--broker", "tcp://h:5555", "--engine", "sglang"]
    local = _cli_config(LocalLaunchConfig, [], environ={"ROLLPOOL_ENGINE": "hf", "ROLLPOOL_MAX_RESTARTS": "2"})
    assert isinstance(local, LocalLaunchConfig)
    assert local.worker.engine == "hf" and local.restart.max_restarts == 2 and local.restart.backoff_s == 1.0


def test_toml_nests_the_worker_and_restart_tables(tmp_path: pathlib.Path) -> None:
    toml = "[launch]\nworkers = 3\n[launch.worker]\nengine = \"hf\"\nargs = \"--capacity 4\"\n[launch.restart]\nbackoff_s = 0.5\nmax_restarts = 4\n"
    cfg = _cli_config(LocalLaunchConfig, ["--model", "/m"], toml, tmp_path)
    assert isinstance(cfg, LocalLaunchConfig)
    assert cfg.workers == 3
    assert cfg.worker == LaunchWorker(engine="hf", model="/m", args="--capacity 4")  # the flag adds to the table
    assert cfg.restart == RestartPolicy(backoff_s=0.5, max_restarts=4)


def test_old_flat_toml_keys_are_read_with_a_deprecation_warning(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    toml = "[launch]\nengine = \"hf\"\nworker_args = \"--capacity 4\"\nrestart-backoff-s = 0.5\n"
    with caplog.at_level(logging.WARNING, logger="rollpool.protocol.config"):
        cfg = _cli_config(LocalLaunchConfig, [], toml, tmp_path)
    assert isinstance(cfg, LocalLaunchConfig)
    assert cfg.worker == LaunchWorker(engine="hf", args="--capacity 4") and cfg.restart.backoff_s == 0.5
    said = caplog.text
    assert "'engine' in [launch] is deprecated" in said and "engine = ... in [launch.worker]" in said
    assert "'restart-backoff-s' in [launch] is deprecated" in said and "backoff_s = ... in [launch.restart]" in said


def test_a_key_given_flat_and_nested_or_unknown_in_a_table_is_refused(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match="given twice"):
        _cli_config(LocalLaunchConfig, [], "[launch]\nengine = \"hf\"\n[launch.worker]\nengine = \"sim\"\n", tmp_path)
    with pytest.raises(ConfigError, match=r"unknown key 'engin' in \[launch.worker\]"):
        _cli_config(LocalLaunchConfig, [], "[launch.worker]\nengin = \"hf\"\n", tmp_path)
    with pytest.raises(ConfigError, match="RestartPolicy needs 0 < backoff_s"):
        _cli_config(LocalLaunchConfig, ["--restart-backoff-s", "0"])


def test_a_usage_error_is_given_up_at_once_whatever_the_policy() -> None:
    tracker = RestartTracker(RestartPolicy(max_restarts=10))
    assert tracker.on_exit(0.5, 2, ["rollpool worker: error: WorkerConfig.capacity must be >= 0"]) is None
    assert tracker.restarts == 0 and "usage error" in tracker.gave_up_because


def test_a_quick_failure_repeated_identically_is_given_up_and_a_different_one_is_retried() -> None:
    tracker = RestartTracker(RestartPolicy(backoff_s=1, backoff_max_s=30, max_restarts=10, stable_after_s=60))
    boom = ["12:00:01 INFO starting (pid 4242)", "FileNotFoundError: /models/policy"]
    assert tracker.on_exit(3.6, 1, boom) == 1
    # another failure (other last lines, or another status) resets nothing but is not identical: retried
    assert tracker.on_exit(3.1, 1, ["12:00:05 INFO starting (pid 4250)", "OSError: out of memory"]) == 2
    assert tracker.on_exit(3.3, 3, ["12:00:05 INFO starting (pid 4250)", "OSError: out of memory"]) == 4
    # the same failure again (only numbers differ: time, pid): given up
    assert tracker.on_exit(3.5, 3, ["12:00:09 INFO starting (pid 4301)", "OSError: out of memory"]) is None
    assert "same way" in tracker.gave_up_because and tracker.restarts == 3


def test_deaths_by_signal_and_failures_after_a_stable_run_are_never_identical() -> None:
    tracker = RestartTracker(RestartPolicy(backoff_s=1, backoff_max_s=30, max_restarts=10, stable_after_s=60))
    assert [tracker.on_exit(1, -9, []) for _ in range(3)] == [1, 2, 4]  # killed from outside (chaos, OOM killer)
    same = ["Traceback", "RuntimeError: engine died"]
    assert tracker.on_exit(600, 1, same) == 1  # after a stable run
    assert tracker.on_exit(600, 1, same) == 1  # again after a stable run: not a quick repeat


def test_the_default_log_folder_of_launch_local_is_ignored_by_git() -> None:
    import shutil
    import subprocess

    repo = pathlib.Path(__file__).resolve().parents[2]
    if shutil.which("git") is None or not (repo / ".git").exists():
        pytest.skip("needs a git checkout")
    log_dir = LocalLaunchConfig().log_dir
    out = subprocess.run(["git", "check-ignore", "-q", f"{log_dir}/launch.json"], cwd=repo, capture_output=True)
    assert out.returncode == 0, f"{log_dir}/ is not in .gitignore: a first `rollpool launch local` leaves it untracked"


def test_agent_processes_reach_every_worker_of_both_launchers(tmp_path: pathlib.Path) -> None:
    """``--agent-processes`` (flag, environment or ``[launch.worker]``) is on every worker's command line, before
    ``--worker-args``; 0 (the default) adds nothing."""
    episode = "--episode pkg.mod:fn"
    cfg = _cli_config(LocalLaunchConfig, ["--workers", "2", "--agent-processes", "3", "--worker-args", episode])
    assert isinstance(cfg, LocalLaunchConfig)
    workers = [s.argv for s in local_process_specs(cfg, python="py") if s.name.startswith("worker")]
    assert len(workers) == 2 and all(w[w.index("--agent-processes") + 1] == "3" and w[-2:] == ("--episode", "pkg.mod:fn")
                                     for w in workers)
    toml = _cli_config(LocalLaunchConfig, [], "[launch.worker]\nagent_processes = 2\n", tmp_path)
    assert isinstance(toml, LocalLaunchConfig) and toml.worker.agent_processes == 2
    ray = _cli_config(RayLaunchConfig, ["--broker", "tcp://h:5555"], environ={"ROLLPOOL_AGENT_PROCESSES": "4"})
    assert isinstance(ray, RayLaunchConfig)
    argv = worker_command(ray, 0)
    assert argv[argv.index("--agent-processes") + 1] == "4"
    assert "--agent-processes" not in local_process_specs(LocalLaunchConfig(), python="py")[-1].argv
    with pytest.raises(ConfigError, match=r"agent_processes must be in \[0, 256\], got -1"):
        _cli_config(LocalLaunchConfig, ["--agent-processes", "-1"])
