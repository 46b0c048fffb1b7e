"""TRL's AsyncGRPOTrainer trained through a rollpool pool: the demo's task on two CPU hf workers.

    pip install 'rollpool[hf,trl]'
    python examples/trl_async_grpo.py --steps 60 --json trl-report.json

What runs: a broker and two ``hf`` workers (processes, on the demo's tiny Llama built on the
spot, scoring with the demo's reward through ``--reward rollpool.demo.task:reward``), and in this
process ``AsyncGRPOTrainer(...).train()`` with ``rollout_worker`` and ``weight_transfer`` from
`rollpool.integrations.trl.rollpool_backend`. TRL is unmodified except two named, test-harness-only
shims from ``examples/trl_cpu_shims.py`` (the MFU probe guard and a pure-PyTorch
``flash_attn_varlen_func`` for ``tree_fa3``), needed on a CPU build of torch and a machine that
cannot reach a model hub. ``--reward-on trainer`` scores with a TRL reward function instead.

The report (``--json``): reward_first / reward_final (TRL's logged ``reward`` at the first step and
the mean over the last five), steps, lost (accepted prompt groups with no terminal state after the
adapter cancelled what was in flight at stop), duplicated (trajectories put into TRL's buffer twice), wall_s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import trl_cpu_shims  # noqa: E402  (the example's own shims, next to it)


def largest_digit_reward(completion_ids: list[list[int]], answer_id: list[int], **_: Any) -> list[float]:
    """TRL-style reward function: 1.0 when the first completion token is the answer."""
    return [1.0 if ids and int(ids[0]) == int(a) else 0.0 for ids, a in zip(completion_ids, answer_id, strict=True)]


def _start(name: str, args: list[str], log_dir: pathlib.Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    from rollpool.launch.supervisor import set_parent_death_signal

    logf = open(log_dir / f"{name}.log", "ab")
    return subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            preexec_fn=set_parent_death_signal)


def _stop_all(procs: list[subprocess.Popen[bytes]], timeout_s: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=5)


def run(opts: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    trl_cpu_shims.install_all()
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from rollpool.demo import task
    from rollpool.integrations.trl import TRLRolloutConfig, rollpool_backend
    from rollpool.trainer_client import SyncTrainerClient, TrainerClientConfig

    torch.set_num_threads(1)
    work = pathlib.Path(tempfile.mkdtemp(prefix="rollpool-trl-"))
    log_dir = pathlib.Path(opts.log_dir) if opts.log_dir else work
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    client: SyncTrainerClient | None = None
    samples_per_step = opts.groups_per_step * opts.group_size
    try:
        model_dir = task.build_demo_model(work / "model", seed=opts.seed)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        worker_ep, client_ep = f"ipc://{work}/workers", f"ipc://{work}/clients"
        level = os.environ.get("ROLLPOOL_LOG_LEVEL", "INFO")
        procs.append(_start("broker", [sys.executable, "-m", "rollpool.broker", "--log-level", level,
                                       "--worker-endpoint", worker_ep, "--client-endpoint", client_ep,
                                       "--batch-size", str(samples_per_step), "--max-staleness", str(opts.max_staleness),
                                       "--heartbeat-interval-s", "0.5", "--task-timeout-s", "60", "--pool", "trl"], log_dir, env))
        reward_flag = ["--reward", "rollpool.demo.task:reward"] if opts.reward_on == "workers" else []
        for i in range(opts.workers):
            procs.append(_start(f"worker-{i}", [sys.executable, "-m", "rollpool.workers", "--log-level", level,
                                                "--broker", worker_ep, "--engine", "hf", "--model", str(model_dir),
                                                "--worker-id", f"trl-w{i}", *reward_flag, "--heartbeat-interval-s", "0.5",
                                                "--apply-mode", "interrupt", "--engine-options", f"seed={opts.seed + i}",
                                                "--pool", "trl"], log_dir, env))

        rng = random.Random(opts.seed)
        rows = [task.training_example(rng) for _ in range(opts.dataset_size)]
        dataset = Dataset.from_dict({
            "prompt": [" ".join(task.VOCAB[i] for i in ids) for ids, _ in rows],
            "answer_id": [ans for _, ans in rows],
        })
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        args = AsyncGRPOConfig(
            output_dir=str(work / "out"), max_steps=opts.steps, learning_rate=opts.lr, lr_scheduler_type="constant",
            per_device_train_batch_size=samples_per_step, gradient_accumulation_steps=1,
            num_generations=opts.group_size, max_completion_length=1, temperature=1.0,
            max_staleness=opts.max_staleness, weight_sync_steps=1, token_budget=0,
            logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, dtype="float32",
            seed=opts.seed, heartbeat_stale_after_s=120.0, disable_tqdm=True,
        )
        client = SyncTrainerClient(client_ep, config=TrainerClientConfig(broker=client_ep, request_timeout_s=30.0))
        worker, transfer = rollpool_backend(
            client, train_dataset=dataset, args=args, processing_class=tokenizer,
            reward_funcs=[largest_digit_reward] if opts.reward_on == "trainer" else None,
            config=TRLRolloutConfig(no_workers_timeout_s=60.0),
        )
        logged: list[dict[str, float]] = []

        class Record(TrainerCallback):  # type: ignore[misc]
            def on_log(self, _args: Any, state: Any, _control: Any, logs: dict[str, float] | None = None, **_kw: Any) -> None:
                if logs and "reward" in logs and logs["reward"] is not None:
                    logged.append({"step": float(state.global_step), "reward": float(logs["reward"]),
                                   "staleness_max": float(logs.get("sample/staleness_max") or 0.0)})
                    if not opts.quiet:
                        print(f"step {state.global_step:3d}  reward {logs['reward']:.3f}  "
                              f"staleness max {logs.get('sample/staleness_max') or 0:.0f}  "
                              f"{time.monotonic() - t0:6.1f} s", flush=True)

        trainer = AsyncGRPOTrainer(model=str(model_dir), reward_funcs=None, args=args, train_dataset=dataset,
                                   processing_class=tokenizer, callbacks=[Record()],
                                   rollout_worker=worker, weight_transfer=transfer)
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)  # the Record lines above are the progress output
        t_train = time.monotonic()
        trainer.train()
        train_wall = time.monotonic() - t_train
        # TRL's train() ended with worker.stop(): it cancelled the groups still in flight and waited until
        # each was reported, so what is pending now is lost (an accepted group with no terminal state)
        counters = client.status()["counters"]
        rewards = [r["reward"] for r in logged]
        tail = rewards[-min(5, len(rewards)):] or [float("nan")]
        report = {
            "reward_first": rewards[0] if rewards else float("nan"),
            "reward_final": float(sum(tail) / len(tail)),
            "steps": int(trainer.state.global_step),
            "lost": int(client.pending()),
            # trajectories the trainer side got twice (the adapter checks every trajectory id it puts in the buffer)
            "duplicated": int(worker.counters["duplicated"]),
            # results the broker dropped because their group had already ended (e.g. a cancelled task finishing): not deliveries
            "broker_dropped_duplicate_results": int(counters.get("duplicates", 0)),
            "wall_s": round(time.monotonic() - t0, 1),
            "train_wall_s": round(train_wall, 1),
            "samples_per_step": samples_per_step,
            "workers": opts.workers,
            "reward_on": opts.reward_on,
            "weight_versions_published": len(transfer.published),
            "max_staleness": opts.max_staleness,
            "adapter": dict(worker.counters),
            "left_in_rollout_buffer": worker.rollout_buffer.qsize(),
            "reward_per_step": rewards,
            "note": "real hf engine on CPU; TRL 1.16 AsyncGRPOTrainer with two test-harness shims (examples/trl_cpu_shims.py)",
        }
        if opts.json:
            pathlib.Path(opts.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nTRL AsyncGRPO through rollpool: reward {report['reward_first']:.3f} -> {report['reward_final']:.3f} "
              f"in {report['steps']} steps x {samples_per_step} samples, lost {report['lost']}, "
              f"duplicated {report['duplicated']}, {report['wall_s']:.1f} s", flush=True)
        return report
    finally:
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
        _stop_all(procs)
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60, help="optimizer steps (TRL max_steps)")
    p.add_argument("--workers", type=int, default=2, help="hf worker processes")
    p.add_argument("--groups-per-step", type=int, default=16, help="prompt groups per optimizer step")
    p.add_argument("--group-size", type=int, default=8, help="TRL num_generations")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate")
    p.add_argument("--max-staleness", type=int, default=2, help="TRL max_staleness (and the broker's eta)")
    p.add_argument("--dataset-size", type=int, default=2000, help="training prompts (cycled)")
    p.add_argument("--reward-on", choices=("workers", "trainer"), default="workers",
                   help="score on the workers (--reward) or with a TRL reward function in the trainer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--log-dir", default=None, help="keep the broker and worker logs here")
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    opts = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if opts.steps < 1 or opts.workers < 1 or opts.group_size < 2 or opts.groups_per_step < 1:
        p.error("steps, workers and groups-per-step must be >= 1 and group-size >= 2")
    run(opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
