"""Several SGLang workers, rolling weight updates, a killed worker on several GPUs (gpu, skipped in CI).

One device call: a broker (``--max-applying 1``), N SGLang workers (worker i on GPU ``i % gpus``,
``CUDA_VISIBLE_DEVICES``), and a trainer client that keeps the pool busy with prompts while it
publishes ``--versions`` new weight versions of the 0.85 B random Llama of bench/gpu_sglang.py.

Measured and written to ``$OUT/<name>.json`` (``--name``, default ``h200x2-sglang``) as it goes:

* ``throughput_during_updates_share``: output tokens/s completed while an update is rolling through
  the pool (from publish until every live worker reports the version) over tokens/s in a steady
  window before the first update (goal: >= 0.5 with ``max_applying = 1``);
* ``versions_ok``: every trajectory's token versions are non-decreasing and within the published
  range, and tokens of several versions were seen;
* ``lost`` / ``duplicated``: accepted prompts with no terminal state / trajectory ids delivered twice;
* the killed worker (``--kill-at-version``, SIGKILL of the worker and its SGLang child) is replaced
  under the same id, catches up to the newest version before taking work (the broker's
  ``--max-staleness 1`` dispatches nothing to a worker more than one version behind, while the one
  still at the previous version keeps generating during a rolling update), and its prompts complete elsewhere.

``--gpus 1 --workers 2 --mem-fraction 0.3`` runs two workers sharing one GPU (what a one-GPU lease allows).
Run on the device: ``bash .sgkit/install.sh .sgkit /tmp/site && PYTHONPATH=/tmp/site:. python3 bench/gpu_multi.py --out $OUT``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_sglang as G  # the shared helpers: env, models, process spawning

RESULT: dict[str, Any] = {"started_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
OUT = Path(".")
NAME = "h200x2-sglang"


def save() -> None:
    (OUT / f"{NAME}.json").write_text(json.dumps(RESULT, indent=1, default=str))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill_tree(pid: int) -> None:
    """SIGKILL a worker and every descendant (its SGLang child runs in its own session)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    for p in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


async def run(args: argparse.Namespace) -> None:
    from safetensors.torch import load_file

    from rollpool.trainer_client.client import TrainerClient, TrainerClientConfig

    _, big, model_bytes = G.build_models(Path(args.work))
    RESULT.update(gpus=args.gpus, workers=args.workers, model_bytes=model_bytes, max_applying=1)
    wep, cep = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}"
    broker = G._spawn(["rollpool.broker", "--worker-endpoint", wep, "--client-endpoint", cep, "--batch-size", "100000",
                       "--max-staleness", "1", "--max-applying", "1", "--task-timeout-s", "3600", "--log-level", "WARNING"],
                      OUT / "broker.log")
    workers: dict[int, Any] = {}

    def start_worker(i: int) -> None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(i % args.gpus)
        opts = (f"port={_port()},capacity={args.capacity},mem_fraction_static={args.mem_fraction},"
                f"log_dir={OUT},context_length=2048")
        workers[i] = G._spawn(["rollpool.workers", "--broker", wep, "--engine", "sglang", "--model", str(big),
                               "--worker-id", f"sg{i}", "--engine-options", opts, "--apply-mode", "interrupt",
                               "--window-chunks", "16", "--log-level", "INFO"], OUT / f"worker{i}.log")

    for i in range(args.workers):
        start_worker(i)
    client = TrainerClient(config=TrainerClientConfig(broker=cep, pull_wait_s=0.5, request_timeout_s=60.0))
    delivered: dict[str, int] = {}
    completions: list[tuple[float, int]] = []  # (time a group came back, its output tokens)
    bad_versions, mixed, seen_versions = 0, 0, set()
    submitted = 0
    try:
        await client.connect()
        await client.publish_weights({}, 0)
        t0 = time.time()
        while (await client.status())["counters"].get("workers_alive", 0) < args.workers:
            if time.time() - t0 > 600:
                raise RuntimeError("workers did not join")
            await asyncio.sleep(0.5)
        RESULT["workers_join_s"] = round(time.time() - t0, 1)
        save()
        rng_prompts = [[1 + (i * 7 + j) % 31000 for j in range(128)] for i in range(64)]
        sampling = {"max_new_tokens": args.out_tokens, "temperature": 1.0, "ignore_eos": True}
        stop = asyncio.Event()

        async def feed() -> None:
            nonlocal submitted
            while not stop.is_set():
                if client.pending() < args.capacity * args.workers * 2:
                    res = await client.submit([{"input_ids": p} for p in rng_prompts], group_size=1, sampling=sampling)
                    submitted += len(res.accepted)
                await asyncio.sleep(0.2)

        async def consume() -> None:
            nonlocal bad_versions, mixed
            while not stop.is_set() or client.pending():
                try:
                    batch = await client.get_batch(8, max_staleness=None, timeout=5)
                except TimeoutError:
                    if stop.is_set():
                        return
                    continue
                now = time.time()
                for g in batch.groups:
                    delivered[g.prompt_id] = delivered.get(g.prompt_id, 0) + 1
                    for t in g.trajectories:
                        tv = [int(x) for x in t.token_versions]
                        seen_versions.update(tv)
                        bad_versions += tv != sorted(tv) or len(tv) != len(t.output_ids)
                        mixed += len(set(tv)) > 1
                        completions.append((now, len(t.output_ids)))
                for g in batch.other:
                    delivered[g.prompt_id] = delivered.get(g.prompt_id, 0) + 1

        feeder = asyncio.create_task(feed())
        consumer = asyncio.create_task(consume())
        await asyncio.sleep(args.warmup_s)
        steady_from = time.time()
        await asyncio.sleep(args.steady_s)
        steady = (steady_from, time.time())
        sd = load_file(str(big / "model.safetensors"))
        windows = []
        for v in range(1, args.versions + 1):
            sd["lm_head.weight"].mul_(1.0 + 0.001 * v)
            t_pub = time.time()
            await client.publish_weights(sd, v)
            if v == args.kill_at_version:
                _kill_tree(workers[0].pid)
                RESULT["killed_worker_at"] = time.time() - t0
                start_worker(0)
            while True:
                st = await client.status()
                live = {w: info for w, info in st["workers"].items()}
                if live and all(int(info.get("version", info.get("weight_version", -1))) >= v for info in live.values()) \
                        and len(live) >= args.workers:
                    break
                if time.time() - t_pub > 300:
                    raise RuntimeError(f"version {v} did not reach every worker: {live}")
                await asyncio.sleep(0.2)
            windows.append((t_pub, time.time()))
            RESULT.setdefault("update_windows_s", []).append(round(windows[-1][1] - windows[-1][0], 2))
            save()
            await asyncio.sleep(args.gap_s)
        stop.set()
        await feeder
        await asyncio.wait_for(consumer, 600)

        def rate(a: float, b: float) -> float:
            return sum(n for t, n in completions if a <= t < b) / max(1e-9, b - a)

        steady_rate = rate(*steady)
        upd_tokens = sum(sum(n for t, n in completions if a <= t < b) for a, b in windows)
        upd_time = sum(b - a for a, b in windows)
        RESULT.update(
            steady_tokens_per_s=round(steady_rate, 1),
            during_updates_tokens_per_s=round(upd_tokens / max(upd_time, 1e-9), 1),
            throughput_during_updates_share=round(upd_tokens / max(upd_time, 1e-9) / max(steady_rate, 1e-9), 3),
            versions_ok=bad_versions == 0 and len(seen_versions) > 1 and mixed > 0,
            versions_seen=sorted(seen_versions),
            mixed_version_trajectories=mixed,
            lost=submitted - len(delivered),
            duplicated=sum(c - 1 for c in delivered.values()),
            submitted=submitted,
        )
        save()
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), 10)
        for p in workers.values():
            G._stop(p)
        G._stop(broker)


def main() -> int:
    global OUT, NAME
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--name", default=NAME)
    ap.add_argument("--work", default="/tmp/gpu_multi")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--mem-fraction", type=float, default=0.6)
    ap.add_argument("--capacity", type=int, default=128)
    ap.add_argument("--out-tokens", type=int, default=256)
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--kill-at-version", type=int, default=3)
    ap.add_argument("--warmup-s", type=float, default=5.0)
    ap.add_argument("--steady-s", type=float, default=10.0)
    ap.add_argument("--gap-s", type=float, default=2.0)
    args = ap.parse_args()
    OUT, NAME = Path(args.out), args.name
    OUT.mkdir(parents=True, exist_ok=True)
    G.OUT = OUT
    G.setup_env()
    try:
        asyncio.run(run(args))
    except Exception as exc:  # recorded; the partial JSON stands
        RESULT["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        save()
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
