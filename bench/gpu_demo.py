"""Real training on one GPU: `rollpool demo` async (eta 1, 2, 4) against sync, one JSON per run.

One device call (``bash .sgkit/install.sh .sgkit /tmp/site`` first, as for bench/gpu_sglang.py)::

    PYTHONPATH=/tmp/site:$PWD TVM_FFI_CACHE_DIR=/tmp/tvm-ffi-cache python3 bench/gpu_demo.py \\
        --runs sync,async1,async2,async4 --seeds 0,1 --deadline-s 540 --out $OUT

(seed 1's runs only as far as the deadline allows: they start only with ``--min-run-s`` left) writes, as it
goes, ``<card>-demo-<mode>-s<seed>.json`` per run (card from ``torch.cuda.get_device_name``:
h100, h200) and ``<card>-demo-pairs.json`` (each async run against the sync run of its seed:
``async_over_sync``), re-written after every run, plus ``gpu-demo.log`` and each run's own folder
(its demo report, the broker's log).

What one run is: ``python -m rollpool demo --task max --device cuda --lengths longtail`` (a child process
of this bench, killed with its process group when it overruns ``--per-run-timeout-s`` or the deadline):
the trainer (the demo's GRPO, float32 master weights, bfloat16 autocast, micro-batches) on the GPU,
its broker, and one ``--engine sglang`` worker on the same GPU (``mem_fraction_static`` 0.3 of the card:
weights, KV cache; the trainer takes what is left; capacity 512 sequences, twice a step's samples).
The model: ``--model-shape w34m``, a random-init Llama of hidden 1024 and 2 layers (34 M parameters), lr 2e-5.
The task: the largest of four digits, answered by the first output token (reward 1 or 0 on the worker); the long tail: each prompt's output length is drawn
lognormal (median 32 tokens, sigma 1, capped at 512, EOS ignored), so a few groups run 10-15x longer than
the median one, and the trainer runs the whole output through its forward and backward passes (it trains
the answer token: ``--loss-tokens answer``; the tail stands in for a reasoning trace the reward does not
read). Each run trains from the same fresh initialisation (per seed) until the trainer's expected
held-out reward reaches ``--stop-at-reward`` (or ``--max-train-s``) and reports the time at which it
crossed ``--reward-threshold``.

The SGLang engine start (30-80 s) is paid once: one worker is started here and kept across runs (each run
starts its own broker on the same endpoint; the worker reconnects). That is sound because every run
begins by rebasing the pool to a version above any the worker has served (``--first-version``) and
publishing its fresh initial weights as that version, whole (every parameter; weight deltas are off),
and the demo sends no prompt, held-out ones included, before the worker serves it
(``wait_for_version``); SGLang flushes its cache on every update. ``--no-keep-worker`` starts a worker
per run instead (through the demo itself).

CPU smoke (the hf engine and the tiny model, two short runs, about a minute here)::

    python bench/gpu_demo.py --smoke --out /tmp/gd

Keys of a run's JSON (besides the demo's summary under ``demo``): device, card, mode, max_staleness, seed,
reward_first / reward_final (held-out reward through the pool before and after training), lost,
duplicated, wall_s (the training loop), run_wall_s (the whole child), time_to_threshold_s,
steps_to_threshold, tokens_per_s, samples_per_s, trainer_idle_share, staleness_seen (histogram),
max_staleness_seen, train_s_mean, publish_s_mean and what bench/calibrate_sim.py reads: per_step
(wait, train, publish seconds) and group_timings ([step, longest output tokens, seconds, samples] per
trained group).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

MODES = {"sync": 0, "async1": 1, "async2": 2, "async4": 4, "async8": 8}
"""Run names and their staleness bound (sync: eta 0, the demo's --sync)."""

POOL = "gpu-demo"
"""One pool name for every run (the kept worker is refused by a broker of another pool)."""
_CHILDREN: list[subprocess.Popen[bytes]] = []
_LOG: Path | None = None


def note(msg: str) -> None:
    line = f"[gpu_demo {time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    if _LOG is not None:
        with _LOG.open("a") as fh:
            fh.write(line + "\n")


def card_name(device_name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``h100``; no GPU -> ``cpu``."""
    if not device_name:
        return "cpu"
    m = re.search(r"\b([A-Za-z]\d{2,4})\b", device_name)
    return m.group(1).lower() if m else "gpu"


def result_name(card: str, mode: str, seed: int) -> str:
    return f"{card}-demo-{mode}-s{seed}.json"


def parse_runs(text: str) -> list[str]:
    runs = [r.strip() for r in text.split(",") if r.strip()]
    bad = [r for r in runs if r not in MODES]
    if bad or not runs:
        raise ValueError(f"--runs: unknown {bad or text!r}; choose from {', '.join(MODES)}")
    return runs


def run_order(runs: Sequence[str], seeds: Sequence[int]) -> list[tuple[str, int]]:
    """Seed by seed, the runs in the order given (a cut-short call still has whole pairs of its first seed)."""
    return [(mode, seed) for seed in seeds for mode in runs]


def next_first_version(first_version: int, steps_planned: int) -> int:
    """The next run's first version: above any version this run can have published (first + steps), so the kept
    worker, whatever it holds, applies the next run's initial weights as a newer version."""
    return first_version + steps_planned + 1


def run_record(summary: dict[str, Any], *, card: str, mode: str, seed: int, command: list[str], run_wall_s: float,
               engine_start_s: float | None) -> dict[str, Any]:
    """One run's JSON from the demo's summary (the keys the issue names first, the whole summary under ``demo``)."""
    lag = summary.get("lag_histogram", {})
    return {
        "device": summary.get("device"), "card": card, "engine": summary.get("engine"), "mode": mode,
        "max_staleness": summary.get("max_staleness"), "seed": seed,
        "reward_first": summary.get("heldout_reward_first"), "reward_final": summary.get("heldout_reward_final"),
        "train_reward_first": summary.get("reward_first"), "train_reward_final": summary.get("reward_final"),
        "heldout_expected_final": summary.get("heldout_expected_final"),
        "lost": summary.get("lost"), "duplicated": summary.get("duplicated"),
        "wall_s": summary.get("train_wall_s"), "run_wall_s": round(run_wall_s, 2),
        "reward_threshold": summary.get("reward_threshold"),
        "time_to_threshold_s": summary.get("time_to_threshold_s"), "steps_to_threshold": summary.get("steps_to_threshold"),
        "steps": summary.get("steps"), "stop_reason": summary.get("stop_reason"),
        "samples_per_step": summary.get("samples_per_step"),
        "tokens_per_s": summary.get("tokens_per_s"), "samples_per_s": summary.get("samples_per_s"),
        "trainer_idle_share": summary.get("trainer_idle_share"),
        "staleness_seen": lag, "max_staleness_seen": max((int(k) for k in lag), default=0),
        "groups_dropped_stale": summary.get("groups_over_eta"),
        "train_s_mean": summary.get("train_s_mean"), "publish_s_mean": summary.get("publish_s_mean"),
        "model_parameters": summary.get("model_parameters"),
        "first_version": summary.get("first_version"), "oldest_token_version": summary.get("oldest_token_version"),
        "engine_start_s": engine_start_s,
        "per_step": summary.get("per_step"), "group_timings": summary.get("group_timings"),
        "how": " ".join(command),
        "demo": {k: v for k, v in summary.items() if k not in ("per_step", "group_timings")},
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def pair_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each async run against the sync run of its seed, and per mode the mean and spread over seeds.

    ``async_over_sync`` is the wall-time ratio to the held-out threshold (async time / sync time: below 1, async
    got there sooner); ``async_over_sync_samples_per_s`` the throughput ratio (trained samples per second of the
    training loop, async / sync: what the simulator predicts)."""
    sync = {r["seed"]: r for r in records if r["mode"] == "sync"}
    pairs: list[dict[str, Any]] = []
    for r in records:
        s = sync.get(r["seed"])
        if r["mode"] == "sync" or s is None:
            continue
        pairs.append({"mode": r["mode"], "seed": r["seed"],
                      "async_over_sync": _ratio(r.get("time_to_threshold_s"), s.get("time_to_threshold_s")),
                      "async_over_sync_samples_per_s": _ratio(r.get("samples_per_s"), s.get("samples_per_s")),
                      "async_over_sync_tokens_per_s": _ratio(r.get("tokens_per_s"), s.get("tokens_per_s"))})
    by_mode: dict[str, dict[str, Any]] = {}
    for mode in sorted({p["mode"] for p in pairs}, key=lambda m: MODES[m]):
        out: dict[str, Any] = {}
        for key in ("async_over_sync", "async_over_sync_samples_per_s"):
            xs = [p[key] for p in pairs if p["mode"] == mode and p[key] is not None]
            out[key] = {"mean": round(sum(xs) / len(xs), 4), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None
        by_mode[mode] = out
    return {"pairs": pairs, "by_mode": by_mode,
            "how": "async_over_sync = async time_to_threshold_s / sync time_to_threshold_s of the same seed (below 1: async "
                   "reached the held-out threshold sooner); async_over_sync_samples_per_s = trained samples per second of the "
                   "training loop, async / sync"}


def gpu_name() -> str:
    """The first GPU's name, asked of nvidia-smi (or torch in a child): this process makes no CUDA context of its own,
    which would hold GPU memory for the whole call."""
    for cmd in (["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                [sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"]):
        with contextlib.suppress(Exception):
            name = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
            if name:
                return name.splitlines()[0]
    return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill(proc: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """SIGTERM to the child's process group, then SIGKILL after `grace_s`: nothing of it is left running."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def _spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    fh = log.open("ab")
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=fh, stderr=subprocess.STDOUT,
                            start_new_session=True)
    _CHILDREN.append(proc)
    return proc


def start_watchdog(deadline_s: float, on_fire: Any) -> None:
    """At the deadline: write what there is, kill every child's process group, exit 3 (before the call's limit)."""

    def fire() -> None:
        time.sleep(deadline_s)
        note(f"deadline {deadline_s:.0f} s reached (--deadline-s): stopping")
        with contextlib.suppress(Exception):
            on_fire()
        for proc in _CHILDREN:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        os._exit(3)

    threading.Thread(target=fire, daemon=True, name="watchdog").start()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="sync,async1,async2,async4", help=f"comma-separated, from {', '.join(MODES)}")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (model initialisation, prompts, sampling)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--work", default="/tmp/gpu_demo")
    ap.add_argument("--deadline-s", type=float, default=540.0, help="the whole call; runs that cannot start are skipped")
    ap.add_argument("--per-run-timeout-s", type=float, default=200.0, help="a run takes about 120 s on an H100 (sync, the engine kept): its start, 85 s of training at most, the held-out evaluations")
    ap.add_argument("--min-run-s", type=float, default=100.0, help="do not start a run with less time than this left")
    ap.add_argument("--engine", choices=("sglang", "hf"), default="sglang")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--model-shape", default="w34m", help="w34m (hidden 1024, 2 layers, 34 M parameters: learns on CPU at its "
                                                          "rate) or s113m (768 x 12, 113 M: settled on one answer on CPU)")
    ap.add_argument("--mem-fraction", type=float, default=0.3, help="the sglang worker's mem_fraction_static")
    ap.add_argument("--capacity", type=int, default=512,
                    help="the worker's engine capacity (sequences at once): twice a step's 256 samples, so async can run "
                         "ahead within its bound while sync fills half")
    ap.add_argument("--keep-worker", action=argparse.BooleanOptionalAction, default=True,
                    help="one worker for every run (the engine starts once); --no-keep-worker: the demo starts one per run")
    ap.add_argument("--steps", type=int, default=300, help="most steps per run (runs end at --stop-at-reward first)")
    ap.add_argument("--prompts-per-step", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=None, help="default: the demo's for the shape (2e-5 for w34m)")
    ap.add_argument("--entropy-coef", type=float, default=0.0)
    ap.add_argument("--lr-warmup-steps", type=int, default=0)
    ap.add_argument("--tail-median-tokens", type=int, default=32)
    ap.add_argument("--tail-sigma", type=float, default=1.0)
    ap.add_argument("--tail-max-tokens", type=int, default=512)
    ap.add_argument("--loss-tokens", choices=("all", "answer"), default="answer")
    ap.add_argument("--micro-batch-tokens", type=int, default=32768)
    ap.add_argument("--reward-threshold", type=float, default=0.8)
    ap.add_argument("--stop-at-reward", type=float, default=0.82,
                    help="end a run once the expected held-out reward reaches this (on CPU the 256-wide model levelled off near 0.85)")
    ap.add_argument("--max-train-s", type=float, default=85.0,
                    help="end a run after this much training (four runs and an engine start fit a 540 s deadline)")
    ap.add_argument("--eval-prompts", type=int, default=200)
    ap.add_argument("--smoke", action="store_true", help="CPU: hf engine, tiny model, sync and async2 for 3 steps each")
    args = ap.parse_args(argv)
    if args.smoke:
        args.engine, args.device, args.model_shape = "hf", "cpu", "tiny"
        args.runs, args.steps, args.prompts_per_step, args.eval_prompts = "sync,async2", 3, 8, 16
        args.tail_median_tokens, args.tail_max_tokens, args.micro_batch_tokens = 4, 32, 512
        args.stop_at_reward, args.max_train_s, args.per_run_timeout_s, args.min_run_s = None, None, 150.0, 10.0
        args.lr_warmup_steps = 0
    args.run_list = parse_runs(args.runs)
    args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    return args


def demo_command(args: argparse.Namespace, mode: str, seed: int, model: Path, run_dir: Path, endpoint: str,
                 first_version: int) -> list[str]:
    eta = MODES[mode]
    cmd = [sys.executable, "-m", "rollpool", "demo", "--task", "max", "--device", args.device, "--engine", args.engine,
           "--model", str(model), "--lengths", "longtail", "--tail-median-tokens", str(args.tail_median_tokens),
           "--tail-sigma", str(args.tail_sigma), "--tail-max-tokens", str(args.tail_max_tokens),
           "--loss-tokens", args.loss_tokens, "--micro-batch-tokens", str(args.micro_batch_tokens),
           "--steps", str(args.steps), "--prompts-per-step", str(args.prompts_per_step), "--group-size", str(args.group_size),
           *(["--lr", str(args.lr)] if args.lr is not None else []), "--model-shape", args.model_shape,
           "--lr-warmup-steps", str(args.lr_warmup_steps), "--entropy-coef", str(args.entropy_coef), "--seed", str(seed),
           "--reward-threshold", str(args.reward_threshold), "--eval-prompts", str(args.eval_prompts),
           "--out", str(run_dir), "--worker-endpoint", endpoint, "--pool", POOL]
    cmd += ["--sync"] if eta == 0 else ["--max-staleness", str(eta)]
    if args.stop_at_reward is not None:
        cmd += ["--stop-at-reward", str(args.stop_at_reward)]
    if args.max_train_s is not None:
        cmd += ["--max-train-s", str(args.max_train_s)]
    if args.keep_worker:
        cmd += ["--workers", "0", "--external-workers", "1", "--first-version", str(first_version)]
    else:
        cmd += ["--workers", "1", "--engine-options", engine_options(args, run_dir)]
    return cmd


def engine_options(args: argparse.Namespace, log_dir: Path) -> str:
    if args.engine == "sglang":
        return (f"mem_fraction_static={args.mem_fraction},capacity={args.capacity},"
                f"context_length={args.tail_max_tokens + 16},log_dir={log_dir}")
    return f"capacity={args.capacity}"


def worker_command(args: argparse.Namespace, model: Path, endpoint: str, log_dir: Path) -> list[str]:
    return [sys.executable, "-m", "rollpool.workers", "--broker", endpoint, "--engine", args.engine, "--model", str(model),
            "--worker-id", "gd-w0", "--reward", "rollpool.demo.task:reward", "--heartbeat-interval-s", "0.5",
            "--apply-mode", "interrupt", "--engine-options", f"seed=0,{engine_options(args, log_dir)}", "--log-level", "INFO",
            # between runs the broker is gone for the seconds the next trainer takes to start: hello again soon
            "--reconnect-backoff-s", "0.5", "--reconnect-backoff-max-s", "2", "--pool", POOL]


def run_one(cmd: list[str], log: Path, timeout_s: float, prefix: str,
            watch: subprocess.Popen[bytes] | None = None) -> tuple[int, float]:
    """The demo child, its lines echoed with `prefix`; killed with its process group past `timeout_s`, or as soon
    as `watch` (the kept worker) exits."""
    t0 = time.monotonic()
    with log.open("ab") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        _CHILDREN.append(proc)
        done = threading.Event()

        def guard() -> None:
            while not done.wait(1.0):
                why = (f"over its {timeout_s:.0f} s" if time.monotonic() - t0 > timeout_s
                       else f"the worker exited ({watch.returncode})" if watch is not None and watch.poll() is not None else "")
                if why:
                    note(f"{prefix}: {why}: killed")
                    _kill(proc, 5.0)
                    return

        timer = threading.Thread(target=guard, daemon=True, name="run-guard")
        timer.start()
        try:
            assert proc.stdout is not None
            for raw in proc.stdout:
                fh.write(raw)
                line = raw.decode(errors="replace").rstrip()
                if line.startswith(("step", "held-out", "rollpool demo", "  ")):
                    print(f"  [{prefix}] {line}", flush=True)
            proc.wait()
        finally:
            done.set()
            _kill(proc, 5.0)
            _CHILDREN.remove(proc)
    return int(proc.returncode if proc.returncode is not None else -1), time.monotonic() - t0


def main(argv: Sequence[str] | None = None) -> int:
    global _LOG
    args = parse_args(argv)
    t_start = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _LOG = out / "gpu-demo.log"
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    device_name = gpu_name() if args.device == "cuda" else ""
    if args.device == "cuda" and not device_name:
        note("no CUDA device: use --smoke (CPU) or --device cpu")
        return 2
    card = card_name(device_name)
    if args.engine == "sglang":
        sys.path.insert(0, str(ROOT))
        from bench import gpu_weights as gw

        gw.setup_env()  # the kit's environment (CUDA_HOME, JIT caches, multicast off), inherited by every child
    from rollpool.demo.runner import MODEL_SHAPES
    from rollpool.demo.task import build_demo_model

    records: list[dict[str, Any]] = []
    state: dict[str, Any] = {"card": card, "machine": device_name or "cpu", "args": {k: v for k, v in vars(args).items()},
                             "runs_done": [], "runs_skipped": [], "started_at": time.strftime("%Y-%m-%dT%H:%M:%S")}

    def write_pairs() -> None:
        (out / f"{card}-demo-pairs.json").write_text(json.dumps({**state, **pair_summary(records)}, indent=1, default=str) + "\n")

    start_watchdog(args.deadline_s, write_pairs)
    models: dict[int, Path] = {}
    for seed in args.seed_list:
        t = time.monotonic()
        models[seed] = build_demo_model(work / f"model-{args.model_shape}-s{seed}", seed=seed, **MODEL_SHAPES[args.model_shape])
        note(f"model {args.model_shape} seed {seed} built in {time.monotonic() - t:.1f} s: {models[seed]}")
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    worker = None
    worker_spawned = time.monotonic()
    if args.keep_worker:
        # the worker's own initial weights are seed 0's; every run publishes its own initialisation before any prompt
        worker = _spawn(worker_command(args, models[args.seed_list[0]], endpoint, out), out / "worker.log",
                        env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
        note(f"worker started (pid {worker.pid}, {args.engine}), dialing {endpoint}")
    first_version = 1
    engine_start_s: float | None = None
    rc = 0
    try:
        for mode, seed in run_order(args.run_list, args.seed_list):
            name = f"{mode}-s{seed}"
            left = args.deadline_s - (time.monotonic() - t_start) - 10
            if left < args.min_run_s:
                note(f"{name}: skipped, {left:.0f} s left before the deadline")
                state["runs_skipped"].append(name)
                continue
            if worker is not None and worker.poll() is not None:
                note(f"the worker exited ({worker.returncode}); see worker.log: no more runs")
                state["worker_exit"] = worker.returncode
                rc = 1
                break
            run_dir = out / name
            run_dir.mkdir(parents=True, exist_ok=True)
            cmd = demo_command(args, mode, seed, models[seed], run_dir, endpoint, first_version)
            timeout_s = min(args.per_run_timeout_s + (300 if engine_start_s is None and worker is not None else 0), left)
            note(f"{name}: starting (first version {first_version}, timeout {timeout_s:.0f} s)")
            code, wall = run_one(cmd, run_dir / "demo.log", timeout_s, name, worker)
            run_first, first_version = first_version, next_first_version(first_version, args.steps)
            report = run_dir / "demo-report.json"
            if code != 0 or not report.exists():
                note(f"{name}: failed (exit {code}) after {wall:.0f} s; see {run_dir / 'demo.log'}")
                state["runs_done"].append({"run": name, "exit": code, "wall_s": round(wall, 1)})
                rc = 1
                write_pairs()
                continue
            summary = json.loads(report.read_text())["summary"]
            if engine_start_s is None and worker is not None:
                engine_start_s = round(time.monotonic() - worker_spawned - wall + float(summary.get("workers_ready_s", 0.0)), 1)
            rec = run_record(summary, card=card, mode=mode, seed=seed, command=cmd, run_wall_s=wall,
                             engine_start_s=engine_start_s)
            rec["worker_kept_across_runs"] = bool(args.keep_worker)
            # the reset's proof: no token of this run came from weights older than its own first version
            rec["reset_sound"] = rec["oldest_token_version"] is not None and rec["oldest_token_version"] >= run_first
            rec["capacity"] = args.capacity
            rec["group_size"] = args.group_size
            records.append(rec)
            sync = next((r for r in records if r["mode"] == "sync" and r["seed"] == seed), None)
            if sync is not None and mode != "sync":
                rec["async_over_sync"] = _ratio(rec["time_to_threshold_s"], sync["time_to_threshold_s"])
                rec["async_over_sync_samples_per_s"] = _ratio(rec["samples_per_s"], sync["samples_per_s"])
            (out / result_name(card, mode, seed)).write_text(json.dumps(rec, indent=1, default=str) + "\n")
            state["runs_done"].append({"run": name, "exit": code, "wall_s": round(wall, 1)})
            write_pairs()
            note(f"{name}: held-out {rec['reward_first']:.3f} -> {rec['reward_final']:.3f}, time to {args.reward_threshold} "
                 f"{rec['time_to_threshold_s']}, {rec['steps']} steps in {rec['wall_s']:.1f} s, samples/s {rec['samples_per_s']:.1f}, "
                 f"idle {rec['trainer_idle_share']:.0%}, lost {rec['lost']} duplicated {rec['duplicated']}, "
                 f"staleness {rec['staleness_seen']}, oldest token version {rec['oldest_token_version']} (first {run_first})" + (f", async_over_sync {rec.get('async_over_sync')}" if "async_over_sync" in rec else ""))
    finally:
        if worker is not None:
            _kill(worker)
            note(f"worker stopped (exit {worker.returncode})")
        state["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        state["wall_s"] = round(time.monotonic() - t_start, 1)
        state["engine_start_s"] = engine_start_s
        write_pairs()
    note(f"done in {time.monotonic() - t_start:.0f} s: {len(records)} runs, pairs in {out / f'{card}-demo-pairs.json'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
