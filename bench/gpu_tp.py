"""A worker whose sglang engine spans ``--tp-size`` x ``--dp-size`` GPUs: pool vs direct tokens/s, publish -> applied.

One device call (``--out $OUT``); every stage rewrites the partial JSON before the next starts:

1. build the model (random Llama, ~0.85 B parameters, bf16; bench/gpu_sglang.py's);
2. what one more rank costs the worker, on this GPU: pickling the payload once per rank (1, 2, 4, 8 ranks of the
   same CUDA tensors) and the model's host-to-device copy (the per-rank path makes one per rank's GPU);
3. a broker, one worker (``rollpool worker --engine sglang --tp-size N --dp-size M``: its engine launches one
   SGLang child per replica, ranks from ``base_gpu_id`` on the worker's GPUs) and a trainer client;
   pool vs direct output tokens/s: the same prompts straight to the worker's SGLang children (spread over the
   replicas as the engine does), alternating pairs, medians;
4. weight versions published while a long batch generates: every version must be applied on every rank (the
   worker's ``sglang apply`` line counts ``ranks`` = tp_size x dp_size, one payload each), every trajectory's
   token versions are checked, and publish -> applied is split into fetch, stage, pause, update, verify.

Writes ``$OUT/<card>-tp<N>[-dp<M>].json`` (``h200-tp1.json`` on one H200, as in bench/results) with ``pool_vs_direct`` (the goal at
tp_size 1: >= 0.97), ``publish_to_applied_s`` and its split (compare with bench/results/h200-sglang.json's).

On the device::

    bash .sgkit/install.sh .sgkit /tmp/site >$OUT/install.log 2>&1 || exit 1
    PYTHONPATH=/tmp/site:. python3 bench/gpu_tp.py --tp-size 1 --out $OUT

Anywhere (no GPU, no SGLang): ``python bench/gpu_tp.py --tp-size 2 --print-plan`` prints the processes it would run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import random
import re
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULT: dict[str, Any] = {"bench": "gpu_tp", "machine": "", "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "stages": {}}
OUT = Path(".")
RESULT_PATH = Path("gpu-tp.json")


def note(msg: str) -> None:
    print(f"[gpu_tp {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def save() -> None:
    RESULT_PATH.write_text(json.dumps(RESULT, indent=1, default=str))


def _sibling(name: str) -> ModuleType:
    """bench/gpu_sglang.py (model build, kit environment, process helpers), loaded by path."""
    spec = importlib.util.spec_from_file_location(f"rollpool_bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def card_name(device_name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``h100``; anything else: its first word-number token, or ``gpu``."""
    m = re.search(r"\b([A-Za-z]\d{2,4})\b", device_name)
    return m.group(1).lower() if m else "gpu"


def result_name(card: str, tp_size: int, dp_size: int) -> str:
    return f"{card}-tp{tp_size}" + (f"-dp{dp_size}" if dp_size > 1 else "") + ".json"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp-size", type=int, default=1, help="tensor-parallel GPUs of the engine's replica")
    ap.add_argument("--dp-size", type=int, default=1, help="data-parallel replicas of the engine")
    ap.add_argument("--per-rank-weights", action=argparse.BooleanOptionalAction, default=True,
                    help="copy each version onto every rank's GPU before the pause (else one copy on rank 0's GPU)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--work", default="/tmp/gpu_tp")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--out-tokens", type=int, default=512, help="output tokens per prompt in the throughput pairs")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--versions", type=int, default=4, help="weight versions published during the long batch (second half from CUDA tensors)")
    ap.add_argument("--long-tokens", type=int, default=1800)
    ap.add_argument("--capacity", type=int, default=256, help="the engine's capacity (all replicas together)")
    ap.add_argument("--mem-fraction-static", type=float, default=0.6)
    ap.add_argument("--result-name", default="", help="default: <card>-tp<N>[-dp<M>].json")
    ap.add_argument("--print-plan", action="store_true", help="print the processes it would start and exit (no GPU needed)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run every stage but the per-rank costs on a CPU: a tiny model, the engine's child serving the sim "
                         "backend (pretending the ranks); numbers simulated, for checking the script only")
    args = ap.parse_args(argv)
    if args.tp_size < 1 or args.dp_size < 1:
        ap.error("--tp-size and --dp-size must be >= 1")
    if args.capacity < args.dp_size:
        ap.error("--capacity must be >= --dp-size")
    return args


def plan(args: argparse.Namespace, model: Path, wep: str, cep: str, sg_port: int) -> dict[str, list[str]]:
    """The broker's and the worker's command lines (``python -m ...``)."""
    opts = (f"port={sg_port},capacity={args.capacity},mem_fraction_static={args.mem_fraction_static},log_dir={OUT},"
            f"context_length=2048,per_rank_weights={str(args.per_rank_weights).lower()}")
    if args.cpu_smoke:
        opts += ",backend=sim,device=cpu"
    broker = ["rollpool.broker", "--worker-endpoint", wep, "--client-endpoint", cep, "--batch-size", "256",
              "--max-staleness", "1000", "--max-applying", "1", "--task-timeout-s", "3600", "--log-level", "WARNING"]
    worker = ["rollpool.workers", "--broker", wep, "--engine", "sglang", "--model", str(model), "--worker-id", "tp0",
              "--engine-options", opts, "--tp-size", str(args.tp_size), "--dp-size", str(args.dp_size),
              "--apply-mode", "interrupt", "--window-chunks", "16", "--log-level", "INFO"]
    return {"broker": broker, "worker": worker}


def rank_payload_stage(big: Path, ranks: Sequence[int]) -> dict[str, Any]:
    """What one more TP rank costs the worker, measured on this one GPU: the payload pickled once per rank (CUDA IPC
    handles of the same tensors, as the shared path sends them), and the copy of the model from page-locked host
    memory to the GPU (what the per-rank path does once per rank's GPU, each over its own link)."""
    import torch
    from safetensors.torch import load_file

    from rollpool.workers.engines.sglang.tensors import serialize_ranks

    host = {k: t.pin_memory() for k, t in load_file(str(big / "model.safetensors")).items()}
    out: dict[str, Any] = {"tensors": len(host), "model_bytes": sum(t.numel() * t.element_size() for t in host.values())}
    on_gpu = serialize_ranks(host, [["cuda:0"]]).first()  # also the host-to-device copy, timed below
    h2d = []
    for _ in range(3):
        torch.cuda.synchronize()
        h2d.append(serialize_ranks(host, [["cuda:0"]]).h2d_s)
    out["h2d_s_per_rank_copy"] = round(statistics.median(h2d), 4)
    rows = []
    for n in ranks:
        runs = [serialize_ranks(dict(on_gpu), [["cuda:0"] * n], per_rank=False) for _ in range(3)]
        pickle_s = statistics.median(r.pickle_s for r in runs)
        rows.append({"ranks": n, "pickle_s": round(pickle_s, 5), "pickle_s_per_rank": round(pickle_s / n, 5),
                     "payload_bytes_per_rank": len(runs[0].payloads[0][0])})
    out["pickling"] = rows
    del runs, on_gpu, host
    torch.cuda.ipc_collect()  # the handles pickled here were never opened by anyone
    torch.cuda.empty_cache()  # the worker's SGLang sizes its memory from what is free when it starts
    return out


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def pool_stage(sg: ModuleType, big: Path, model_bytes: int, args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import load_file

    from rollpool.protocol.messages import SamplingParams
    from rollpool.trainer_client.client import TrainerClient, TrainerClientConfig
    from rollpool.workers.engines.sglang.http import HttpClient
    from rollpool.workers.engines.sglang.wire import generate_body, parse_generate_response, sample_rid

    wep, cep = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}"
    sg_port = 30000 + os.getpid() % 1000 * 4  # replica d serves on sg_port + d (the engine's port option)
    cmds = plan(args, big, wep, cep, sg_port)
    broker = sg._spawn(cmds["broker"], OUT / "broker.log")
    worker_log = OUT / "worker.log"
    worker = sg._spawn(cmds["worker"], worker_log)
    wdir = Path(args.work) / "ipc"
    wdir.mkdir(parents=True, exist_ok=True)
    cfg = TrainerClientConfig(broker=cep, pull_wait_s=0.5, request_timeout_s=60.0, keep_versions=2,
                              weight_router_endpoint=f"ipc://{wdir}/router", weight_pub_endpoint=f"ipc://{wdir}/pub")
    client = TrainerClient(config=cfg)
    stage: dict[str, Any] = {"commands": cmds}
    RESULT["stages"]["pool"] = stage
    https: list[Any] = []
    try:
        await client.connect()
        await client.publish_weights({}, 0)
        t0 = time.time()
        while True:
            st = await client.status()
            if st["counters"].get("workers_alive", 0) >= 1:
                break
            if worker.poll() is not None:
                raise RuntimeError(f"worker exited {worker.returncode}: {worker_log.read_text(errors='replace')[-3000:]}")
            if time.time() - t0 > 600:
                raise RuntimeError("the sglang worker never joined")
            await asyncio.sleep(0.2)
        stage["worker_join_s"] = round(time.time() - t0, 1)
        note(f"worker joined after {stage['worker_join_s']} s")
        await asyncio.sleep(2.0)
        save()

        rng = random.Random(0)
        prompts = [[rng.randrange(10, 31000) for _ in range(128)] for _ in range(args.prompts)]
        sampling = {"max_new_tokens": args.out_tokens, "temperature": 1.0, "ignore_eos": True}
        token = (OUT / f"sglang-{sg_port}.token").read_text()  # one per launch, written 0600 beside the first child's log
        https = [HttpClient("127.0.0.1", sg_port + d, token=token) for d in range(args.dp_size)]
        sp = SamplingParams(max_new_tokens=args.out_tokens, temperature=1.0, ignore_eos=True)
        counter = iter(range(10**9))

        async def direct() -> float:
            t = time.perf_counter()
            outs = await asyncio.gather(*(https[i % len(https)].request(
                "POST", "/generate", generate_body(p, sp, rid=sample_rid("directxx", next(counter), 0, 0), index=0))
                for i, p in enumerate(prompts)))
            dt = time.perf_counter() - t
            return sum(len(parse_generate_response(o).output_ids) for o in outs) / dt

        async def pool() -> float:
            t = time.perf_counter()
            res = await client.submit([{"input_ids": p} for p in prompts], group_size=1, sampling=sampling)
            if res.rejected:
                raise RuntimeError(f"rejected: {list(res.rejected.values())[:3]}")
            batch = await client.get_batch(len(prompts), max_staleness=1000, timeout=600)
            dt = time.perf_counter() - t
            return sum(len(tr.output_ids) for tr in batch.trajectories) / dt

        await direct()  # warm-up
        await pool()
        d_runs: list[float] = []
        p_runs: list[float] = []
        for i in range(args.pairs):
            d_runs.append(await direct())
            p_runs.append(await pool())
            note(f"pair {i}: direct {d_runs[-1]:.0f} tok/s, pool {p_runs[-1]:.0f} tok/s")
            stage.update(direct_runs=d_runs, pool_runs=p_runs)
            save()
        RESULT["direct_tokens_per_s"] = round(statistics.median(d_runs), 1)
        RESULT["pool_tokens_per_s"] = round(statistics.median(p_runs), 1)
        RESULT["pool_vs_direct"] = round(statistics.median(p_runs) / statistics.median(d_runs), 4)
        RESULT["pool_vs_direct_pairwise_median"] = round(statistics.median(p / d for p, d in zip(p_runs, d_runs, strict=True)), 4)
        RESULT["throughput_workload"] = {"prompts": len(prompts), "prompt_tokens": 128, "output_tokens": args.out_tokens,
                                         "ignore_eos": True, "temperature": 1.0, "pairs": args.pairs}
        save()

        sd = load_file(str(big / "model.safetensors"))
        long_prompts = prompts * 4  # enough work to span every update
        await client.submit([{"input_ids": p} for p in long_prompts], group_size=1,
                            sampling={"max_new_tokens": args.long_tokens, "temperature": 1.0, "ignore_eos": True})
        await asyncio.sleep(1.0)
        pubs: list[dict[str, Any]] = []
        versions = list(range(1, args.versions + 1))
        ranks_ok = True
        for v in versions:
            on = "cuda" if v > len(versions) // 2 and torch.cuda.is_available() else "cpu"
            if on == "cuda" and sd["lm_head.weight"].device.type != "cuda":
                sd = {k: t.to("cuda") for k, t in sd.items()}
                torch.cuda.synchronize()
            with torch.no_grad():
                sd["lm_head.weight"].mul_(1.0 + 0.01 * v)  # a real change each time
            t_pub = time.time()
            await client.publish_weights(sd, v)
            t_ret = time.time()
            for _ in range(1200):
                lines = sg._apply_lines(worker_log)
                if v in lines:
                    break
                if worker.poll() is not None:
                    raise RuntimeError(f"worker exited {worker.returncode}: {worker_log.read_text(errors='replace')[-3000:]}")
                await asyncio.sleep(0.05)
            else:
                raise RuntimeError(f"version {v} never applied")
            a = lines[v]
            ranks = int(a.get("ranks", 1))
            ranks_ok = ranks_ok and ranks == args.tp_size * args.dp_size
            pause_at = a["update_started_at"] - a["pause_s"]
            rec: dict[str, Any] = {"version": v, "trainer_tensors_on": on, "ranks": ranks,
                                   "publish_to_applied_s": round(a["applied_at"] - t_pub, 4), "publish_call_s": round(t_ret - t_pub, 4)}
            if a.get("staged"):
                rec.update(fetch_s=round(a["stage_started_at"] - t_ret, 4), stage_h2d_s=round(a["stage_h2d_s"], 4),
                           stage_s=round(a["stage_s"], 4), grant_wait_s=round(pause_at - a["stage_started_at"] - a["stage_s"], 4))
            else:
                rec.update(fetch_s=round(pause_at - t_ret, 4))
            rec.update({k: round(a[k], 4) for k in ("pause_s", "h2d_s", "serialize_s", "sglang_update_s", "verify_s", "resume_s")})
            rec["gb_per_s"] = round(model_bytes / rec["publish_to_applied_s"] / 1e9, 3)
            pubs.append(rec)
            note(f"version {v}: {rec}")
            stage["publishes"] = pubs
            save()
            await asyncio.sleep(0.5)
        batch = await client.get_batch(len(long_prompts), max_staleness=1000, timeout=600)
        bad, seen = 0, set()
        for tr in batch.trajectories:
            tv = [int(x) for x in tr.token_versions]
            seen |= set(tv)
            bad += int(len(tv) != len(tr.output_ids) or tv != sorted(tv) or not set(tv) <= {0, *versions})
        stage["versions"] = {"trajectories": len(batch.trajectories), "bad": bad, "versions_seen": sorted(seen)}
        RESULT["versions_ok"] = bad == 0 and len(batch.trajectories) == len(long_prompts) and versions[-1] in seen
        RESULT["every_rank_applied_every_version"] = ranks_ok
        steady = [p for p in pubs if p["version"] > 1] or pubs
        keys = [k for k in steady[0] if isinstance(steady[0][k], (int, float)) and k not in ("version", "ranks")]
        RESULT["publish_to_applied_s"] = round(statistics.median(p["publish_to_applied_s"] for p in steady), 4)
        RESULT["publish_to_applied_split"] = {k: round(statistics.median(p[k] for p in steady if k in p), 4) for k in keys}
        for on in ("cpu", "cuda"):
            group = [p for p in steady if p["trainer_tensors_on"] == on]
            if group:
                RESULT[f"publish_to_applied_{on}_s"] = round(statistics.median(p["publish_to_applied_s"] for p in group), 4)
        save()
    finally:
        for h in https:
            with contextlib.suppress(Exception):
                await h.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), 10)
        sg._stop(worker)
        sg._stop(broker)


def main(argv: Sequence[str] | None = None) -> int:
    global OUT, RESULT_PATH
    args = parse_args(argv)
    OUT = Path(args.out)
    if args.print_plan:
        print(json.dumps(plan(args, Path(args.work) / "big", "tcp://127.0.0.1:WORKER", "tcp://127.0.0.1:CLIENT", 30000), indent=1))
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    sg = _sibling("gpu_sglang")
    if not args.cpu_smoke:
        sg.setup_env()
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    RESULT_PATH = OUT / (args.result_name or result_name(card_name(name), args.tp_size, args.dp_size))
    RESULT.update(machine=name, gpus_seen=torch.cuda.device_count() if torch.cuda.is_available() else 0, torch=torch.__version__,
                  tp_size=args.tp_size, dp_size=args.dp_size, per_rank_weights=args.per_rank_weights)
    with contextlib.suppress(Exception):
        import sglang

        RESULT["sglang"] = sglang.__version__
    with contextlib.suppress(Exception):
        RESULT["commit"] = (ROOT / ".commit").read_text().strip()
    save()
    t = time.time()
    if args.cpu_smoke:
        from rollpool.workers.engines.tiny_model import build_tiny_model

        RESULT["simulated"] = True
        big = build_tiny_model(Path(args.work) / "tiny", vocab=32000, hidden=32, layers=2, heads=4, kv_heads=2)
        model_bytes = (big / "model.safetensors").stat().st_size
    else:
        _small, big, model_bytes = sg.build_models(Path(args.work))
    RESULT["model"] = {"params_bytes": model_bytes, "arch": "llama", "hidden": 32 if args.cpu_smoke else 2048,
                       "layers": 2 if args.cpu_smoke else 16, "heads": 4 if args.cpu_smoke else 32,
                       "kv_heads": 2 if args.cpu_smoke else 8, "vocab": 32000,
                       "dtype": "float32" if args.cpu_smoke else "bfloat16", "build_s": round(time.time() - t, 1)}
    RESULT["model_bytes"] = model_bytes
    save()
    note(f"model built: {model_bytes / 1e9:.2f} GB; tp_size {args.tp_size} x dp_size {args.dp_size}; writing {RESULT_PATH}")
    try:
        if not args.cpu_smoke:
            RESULT["per_rank_costs"] = rank_payload_stage(big, (1, 2, 4, 8))
            note(f"per-rank costs: {RESULT['per_rank_costs']}")
    except Exception as exc:  # noqa: BLE001 - recorded; the pool stage still runs
        RESULT["stages"]["per_rank_costs_error"] = f"{type(exc).__name__}: {exc}"[:2000]
    save()
    try:
        asyncio.run(pool_stage(sg, big, model_bytes, args))
    except Exception as exc:  # noqa: BLE001 - recorded, then the partial JSON stands
        RESULT["stages"].setdefault("pool", {})["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        note(f"pool stage failed: {exc!r}")
    RESULT["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    save()
    return 0 if "error" not in RESULT["stages"].get("pool", {}) else 1


if __name__ == "__main__":
    sys.exit(main())
