"""Launchers place workers by GPUs per worker: local (CUDA_VISIBLE_DEVICES per worker), Ray (num_gpus), Slurm
(--gpus-per-task) and Kubernetes (nvidia.com/gpu); a host or cluster with too few GPUs is a clear error."""

from __future__ import annotations

import pytest

from rollpool.cli import main
from rollpool.launch.config import LaunchWorker, host_gpus
from rollpool.launch.local import LocalLaunchConfig, local_process_specs
from rollpool.launch.ray_launch import RayLaunchConfig, worker_command
from rollpool.protocol.errors import ConfigError

TP2 = LaunchWorker(engine="sglang", model="/m", tp_size=2)


def test_local_gives_each_worker_its_own_consecutive_gpus() -> None:
    specs = local_process_specs(LocalLaunchConfig(workers=2, worker=TP2), python="py",
                                gpus=(("4", "5", "6", "7", "8"), "CUDA_VISIBLE_DEVICES='4,5,6,7,8'"))
    workers = [s for s in specs if s.name.startswith("worker")]
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in workers] == ["4,5", "6,7"]
    assert all(w.argv[w.argv.index("--tp-size") + 1] == "2" for w in workers)
    # explicit GPUs per worker beyond the engine's (the rest stay idle); none assigned for a one-GPU default
    wide = local_process_specs(LocalLaunchConfig(workers=1, gpus_per_worker=3, worker=TP2), python="py", gpus=(("0", "1", "2"), "t"))
    assert wide[-1].env["CUDA_VISIBLE_DEVICES"] == "0,1,2"
    assert all(not s.env for s in local_process_specs(LocalLaunchConfig(workers=2), python="py", gpus=((), "t")))
    # one-GPU sglang workers each get their own GPU (they used to share GPU 0), none on a host without GPUs
    one = LaunchWorker(engine="sglang", model="/m")
    specs = local_process_specs(LocalLaunchConfig(workers=2, worker=one), python="py", gpus=(("0", "1"), "t"))
    assert [s.env.get("CUDA_VISIBLE_DEVICES") for s in specs if s.name.startswith("worker")] == ["0", "1"]
    assert all(not s.env for s in local_process_specs(LocalLaunchConfig(workers=2, worker=one), python="py", gpus=((), "t")))
    with pytest.raises(ConfigError, match="this host has 1"):
        local_process_specs(LocalLaunchConfig(workers=2, worker=one), python="py", gpus=(("0",), "t"))


def test_local_refuses_a_host_with_fewer_gpus_than_asked() -> None:
    with pytest.raises(ConfigError, match=r"2 workers x 2 GPUs per worker \(--gpus-per-worker\) = 4 GPUs; this host has 3 \(CUDA_VISIBLE_DEVICES='0,1,2'\)"):
        local_process_specs(LocalLaunchConfig(workers=2, worker=TP2), python="py", gpus=(("0", "1", "2"), "CUDA_VISIBLE_DEVICES='0,1,2'"))
    with pytest.raises(ConfigError, match="gpus_per_worker is 1, but each worker's engine spans tp_size x dp_size = 4 GPUs"):
        LocalLaunchConfig(gpus_per_worker=1, worker=LaunchWorker(engine="sglang", tp_size=2, dp_size=2))
    with pytest.raises(ConfigError, match="need engine sglang, got 'hf'"):
        LaunchWorker(engine="hf", tp_size=2)


def test_launch_local_exits_2_before_starting_anything(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                                       tmp_path: object) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    rc = main(["launch", "local", "--workers", "1", "--engine", "sglang", "--model", str(tmp_path), "--tp-size", "2",
               "--log-dir", str(tmp_path)])
    assert rc == 2
    assert "1 workers x 2 GPUs per worker (--gpus-per-worker) = 2 GPUs; this host has 1 (CUDA_VISIBLE_DEVICES='0')" in capsys.readouterr().err


def test_host_gpus_come_from_the_environment_first() -> None:
    assert host_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}) == (("2", "3"), "CUDA_VISIBLE_DEVICES='2, 3'")
    assert host_gpus({"CUDA_VISIBLE_DEVICES": ""})[0] == ()


def test_ray_bundles_ask_for_the_engines_gpus() -> None:
    cfg = RayLaunchConfig(broker="tcp://h:5555", worker=TP2)
    assert cfg.gpus == 2.0  # -1 (the default): tp_size x dp_size
    assert "--tp-size" in worker_command(cfg, 0)
    assert RayLaunchConfig(broker="tcp://h:5555").gpus == 1.0  # a one-GPU engine, as before
    assert RayLaunchConfig(broker="tcp://h:5555", gpus_per_worker=0, worker=LaunchWorker(engine="sim")).gpus == 0.0
    with pytest.raises(ConfigError, match="gpus_per_worker is 1, but each worker's engine spans tp_size x dp_size = 2 GPUs"):
        RayLaunchConfig(broker="tcp://h:5555", gpus_per_worker=1, worker=TP2)
    with pytest.raises(ConfigError, match="above 1 must be a whole number"):
        RayLaunchConfig(broker="tcp://h:5555", gpus_per_worker=1.5)


def test_ray_bundles_ask_for_a_cpu_per_agent_process_beside_the_workers() -> None:
    agents = LaunchWorker(engine="sglang", model="/m", agent_processes=8, args="--episode my_agents:solve")
    cfg = RayLaunchConfig(broker="tcp://h:5555", worker=agents)
    assert cfg.bundle() == {"CPU": 9.0, "GPU": 1.0}  # -1 (the default): the worker and its 8 agent processes
    assert "--agent-processes" in worker_command(cfg, 0)
    assert RayLaunchConfig(broker="tcp://h:5555").bundle() == {"CPU": 1.0, "GPU": 1.0}  # no agent processes: as before
    assert RayLaunchConfig(broker="tcp://h:5555", cpus_per_worker=4, worker=agents).bundle() == {"CPU": 4.0, "GPU": 1.0}
    sim = LaunchWorker(engine="sim")
    assert RayLaunchConfig(broker="tcp://h:5555", gpus_per_worker=0, cpus_per_worker=0.5, worker=sim).bundle() == {"CPU": 0.5}
    with pytest.raises(ConfigError, match="not both 0"):
        RayLaunchConfig(broker="tcp://h:5555", gpus_per_worker=0, cpus_per_worker=0, worker=sim)
    with pytest.raises(ConfigError, match=r"must be >= 0 \(or -1\)"):
        RayLaunchConfig(broker="tcp://h:5555", cpus_per_worker=-2)
