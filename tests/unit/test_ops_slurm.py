"""ops/slurm/rollpool.sbatch: valid bash, and a dry run that prints the commands it would run."""

from __future__ import annotations

import os
import pathlib
import shlex
import shutil
import subprocess

import pytest

SBATCH = pathlib.Path(__file__).resolve().parents[2] / "ops" / "slurm" / "rollpool.sbatch"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def test_sbatch_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)


def _dry_run(**env: str) -> list[list[str]]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ROLLPOOL_"))}
    out = subprocess.run(["bash", str(SBATCH)], env={**base, "ROLLPOOL_DRY_RUN": "1", "PATH": "/usr/bin:/bin", **env},
                         check=True, capture_output=True, text=True, timeout=30).stdout
    return [shlex.split(line) for line in out.splitlines() if line and not line.startswith("#")]


def test_dry_run_places_broker_on_the_first_node_a_relay_per_node_and_a_worker_per_gpu() -> None:
    steps = _dry_run(SLURM_JOB_NODELIST="gpu-a,gpu-b,gpu-c", SLURM_JOB_ID="42", ROLLPOOL_GPUS_PER_NODE="8",
                     ROLLPOOL_WEIGHTS_UPSTREAM="tcp://trainer:6000", ROLLPOOL_MODEL="/models/q",
                     ROLLPOOL_REDIS_URL="redis://mon:6379/0")
    broker, relay, workers = steps
    assert broker[0] == "srun" and "--nodelist=gpu-a" in broker and "--nodes=1" in broker
    assert broker[broker.index("-m") + 1 : broker.index("-m") + 3] == ["rollpool", "broker"]
    assert "--nodes=3" in relay and "--ntasks-per-node=1" in relay and "tcp://trainer:6000" in relay
    assert "--nodes=3" in workers and "--ntasks-per-node=8" in workers and "--gpus-per-task=1" in workers
    assert workers[workers.index("--broker") + 1] == "tcp://gpu-a:5555"
    assert workers[workers.index("--model") + 1] == "/models/q"
    assert all("redis://mon:6379/0" in s and "slurm-42" in s for s in steps)
    assert "$SLURM_PROCID" in " ".join(workers)  # one worker id per task


def test_dry_run_without_upstream_runs_no_relay() -> None:
    steps = _dry_run(SLURM_JOB_NODELIST="n1", ROLLPOOL_GPUS_PER_NODE="2", ROLLPOOL_ENGINE="sim")
    assert len(steps) == 2
    assert not any("relay" in s for s in steps)


def test_dry_run_gives_each_kind_of_process_only_its_own_key_directory() -> None:
    steps = _dry_run(SLURM_JOB_NODELIST="gpu-a,gpu-b", ROLLPOOL_GPUS_PER_NODE="2", ROLLPOOL_CURVE_DIR="/secure/keys",
                     ROLLPOOL_WEIGHTS_UPSTREAM="tcp://trainer:6000")
    broker, relay, workers = steps
    assert broker[broker.index("--curve-dir") + 1] == "/secure/keys/broker"
    assert relay[relay.index("--curve-dir") + 1] == "/secure/keys/relay"
    assert workers[workers.index("--curve-dir") + 1] == "/secure/keys/worker"
    assert not any("--curve-dir" in s for s in _dry_run(SLURM_JOB_NODELIST="n1", ROLLPOOL_GPUS_PER_NODE="1"))


def test_dry_run_gives_a_tensor_parallel_worker_its_gpus_per_task() -> None:
    *_, workers = _dry_run(SLURM_JOB_NODELIST="gpu-a,gpu-b", ROLLPOOL_GPUS_PER_NODE="8", ROLLPOOL_TP_SIZE="2", ROLLPOOL_DP_SIZE="2")
    assert "--ntasks-per-node=2" in workers and "--gpus-per-task=4" in workers
    assert workers[workers.index("--tp-size") + 1] == "2" and workers[workers.index("--dp-size") + 1] == "2"
    *_, explicit = _dry_run(SLURM_JOB_NODELIST="n1", ROLLPOOL_GPUS_PER_NODE="8", ROLLPOOL_GPUS_PER_WORKER="4", ROLLPOOL_TP_SIZE="2")
    assert "--ntasks-per-node=2" in explicit and "--gpus-per-task=4" in explicit


def test_dry_run_gives_each_worker_a_cpu_per_agent_process_or_its_share_of_the_node() -> None:
    def cpus(**env: str) -> str:
        *_, workers = _dry_run(SLURM_JOB_NODELIST="n1", ROLLPOOL_GPUS_PER_NODE="8", **env)
        return next(a for a in workers if a.startswith("--cpus-per-task="))

    assert cpus() == "--cpus-per-task=1"  # no agent processes, node size unknown: the worker's own CPU
    assert cpus(ROLLPOOL_AGENT_PROCESSES="8") == "--cpus-per-task=9"  # as rollpool launch ray's default bundle
    assert cpus(ROLLPOOL_AGENT_PROCESSES="8", SLURM_CPUS_ON_NODE="128") == "--cpus-per-task=16"  # the node shared evenly
    assert cpus(ROLLPOOL_AGENT_PROCESSES="8", ROLLPOOL_CPUS_PER_WORKER="4") == "--cpus-per-task=4"


@pytest.mark.parametrize(("env", "message"), [
    ({"ROLLPOOL_GPUS_PER_NODE": "2", "ROLLPOOL_TP_SIZE": "4"}, "2 GPUs per node cannot hold workers of 4 GPUs each"),
    ({"ROLLPOOL_GPUS_PER_NODE": "8", "SLURM_CPUS_ON_NODE": "32", "ROLLPOOL_AGENT_PROCESSES": "4"},
     "32 CPUs per node give each of 8 workers 4, but a worker with ROLLPOOL_AGENT_PROCESSES=4 needs 5"),
    ({"ROLLPOOL_GPUS_PER_NODE": "8", "ROLLPOOL_GPUS_PER_WORKER": "1", "ROLLPOOL_TP_SIZE": "2"}, "engine spans tp_size x dp_size = 2 GPUs"),
])
def test_dry_run_refuses_workers_the_nodes_cannot_hold(env: dict[str, str], message: str) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ROLLPOOL_"))}
    out = subprocess.run(["bash", str(SBATCH)], env={**base, "ROLLPOOL_DRY_RUN": "1", "PATH": "/usr/bin:/bin",
                                                     "SLURM_JOB_NODELIST": "n1", **env}, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and message in out.stderr and not out.stdout.strip()
