"""The sglang engine on one H200: contract tests, golden answers, versions, pool vs direct, publish-to-applied.

One entry point for one device call (``--out $OUT``); every stage writes the
partial JSON (``h200-sglang.json``) before the next starts:

1. build the models (random Llama, ~0.85 B parameters, bf16; and a small one for the tests);
2. ``pytest tests/gpu`` (the engine contract on SGLang + golden ``/generate`` answers into $OUT/golden);
3. broker + one worker whose ``sglang`` engine starts SGLang as its child + a trainer client:
   pool vs direct output tokens/s (the same prompts straight to the same SGLang server,
   median of alternating pairs), then three weight versions published while generating,
   every trajectory's token versions checked, and publish -> applied with its split.

Run on the device: ``bash .sgkit/install.sh .sgkit /tmp/site && PYTHONPATH=/tmp/site:. python3 bench/gpu_sglang.py --out $OUT``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULT: dict[str, Any] = {"machine": "", "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "stages": {}}
OUT = Path(".")


def note(msg: str) -> None:
    print(f"[gpu_sglang {time.strftime('%H:%M:%S')}] {msg}", flush=True)


RESULT_NAME = "h200-sglang.json"


def save() -> None:
    (OUT / RESULT_NAME).write_text(json.dumps(RESULT, indent=1, default=str))


def setup_env() -> None:
    sys.path.insert(0, str(ROOT / ".sgkit"))
    import smoke  # the kit's environment recipe: CUDA_HOME, JIT caches, multicast off

    smoke.setup_env()


def build_models(work: Path) -> tuple[Path, Path, int]:
    import torch
    from safetensors.torch import load_file, save_file

    from rollpool.workers.engines.tiny_model import build_tiny_model

    small = build_tiny_model(work / "small", vocab=1024, hidden=256, layers=2, heads=4, kv_heads=2)
    big = work / "big"
    if not (big / "rollpool_bf16").exists():
        build_tiny_model(big, vocab=32000, hidden=2048, layers=16, heads=32, kv_heads=8)
        sd = load_file(str(big / "model.safetensors"))
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}, str(big / "model.safetensors"), metadata={"format": "pt"})
        cfg = json.loads((big / "config.json").read_text())
        cfg["torch_dtype"] = "bfloat16"
        cfg["dtype"] = "bfloat16"
        (big / "config.json").write_text(json.dumps(cfg, indent=1))
        (big / "rollpool_bf16").write_text("1")
    sd = load_file(str(big / "model.safetensors"))
    return small, big, sum(v.numel() * v.element_size() for v in sd.values())


async def run_contract(small: Path) -> dict[str, Any]:
    """The gpu test module's tests, run directly (the H200 has pytest but not pytest-asyncio)."""
    import inspect
    import traceback

    from rollpool.workers.engines.sglang.engine import SGLangEngine
    from tests.gpu import test_sglang_gpu as T

    os.environ["ROLLPOOL_SGLANG_GOLDEN_DIR"] = str(OUT / "golden")
    server = SGLangEngine(model=str(small), capacity=64, mem_fraction_static=0.15, cuda_graph_max_bs=16, log_dir=str(OUT))
    t0 = time.time()
    await server.start()  # the engine-owned child process path
    url = f"http://127.0.0.1:{server.port}"
    results: dict[str, str] = {"server_start_s": f"{time.time() - t0:.1f}"}
    tests = [(n, f) for n, f in vars(T).items() if n.startswith("test_") and inspect.iscoroutinefunction(f)]
    try:
        for name, fn in tests:
            params = list(inspect.signature(fn).parameters)
            variants = [{"mode": m} for m in ("interrupt", "in_place", "drain")] if "mode" in params else [{}]
            for extra in variants:
                label = name + (f"[{extra['mode']}]" if extra else "")
                case = await T.make_case(url, str(small), server.token) if "case" in params else None
                try:
                    kw: dict[str, Any] = dict(extra)
                    if case is not None:
                        kw["case"] = case
                    if "sglang_server" in params:
                        kw["sglang_server"] = (url, str(small), server.token)
                    await asyncio.wait_for(fn(**kw), 120)
                    results[label] = "passed"
                except BaseException as exc:  # pytest.skip raises a BaseException
                    if isinstance(exc, (KeyboardInterrupt, SystemExit, asyncio.CancelledError)):
                        raise
                    if type(exc).__name__ == "Skipped":
                        results[label] = f"skipped: {exc}"
                    else:
                        results[label] = f"FAILED: {type(exc).__name__}: {exc}"[:600]
                        (OUT / "contract_failures.log").open("a").write(f"== {label}\n{traceback.format_exc()}\n")
                finally:
                    if case is not None:
                        await case.engine.stop()
                note(f"{label}: {results[label][:200]}")
                RESULT["stages"]["contract"] = results
                save()
    finally:
        await server.stop()
    return results


def run_pytest(small: Path, timeout_s: int) -> dict[str, Any]:
    env = {**os.environ, "ROLLPOOL_SGLANG_TEST_MODEL": str(small), "ROLLPOOL_SGLANG_GOLDEN_DIR": str(OUT / "golden"),
           "ROLLPOOL_SGLANG_LOG_DIR": str(OUT)}
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "timeout=180", "tests/gpu/test_sglang_gpu.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    (OUT / "pytest.log").write_text(proc.stdout + proc.stderr)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    return {"rc": proc.returncode, "summary": tail[0], "seconds": round(time.time() - t0, 1)}


def _spawn(args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    fh = log_path.open("ab")
    return subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=os.environ.copy(), stdout=fh, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, 9)


def _apply_lines(log_path: Path) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for line in log_path.read_text(errors="replace").splitlines():
        if "sglang apply {" in line:
            d = json.loads(line[line.index("sglang apply ") + len("sglang apply "):])
            out[int(d["version"])] = d
    return out


async def pool_stage(big: Path, model_bytes: int, args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import load_file

    from rollpool.protocol.messages import SamplingParams
    from rollpool.trainer_client.client import TrainerClient, TrainerClientConfig
    from rollpool.workers.engines.sglang.http import HttpClient
    from rollpool.workers.engines.sglang.wire import generate_body, parse_generate_response, sample_rid

    def port() -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    wep, cep, sg_port = f"tcp://127.0.0.1:{port()}", f"tcp://127.0.0.1:{port()}", port()
    broker = _spawn(["rollpool.broker", "--worker-endpoint", wep, "--client-endpoint", cep, "--batch-size", "256",
                     "--max-staleness", "1000", "--max-applying", "1", "--task-timeout-s", "3600", "--log-level", "WARNING"],
                    OUT / "broker.log")
    opts = f"port={sg_port},capacity={args.capacity},mem_fraction_static=0.6,log_dir={OUT},context_length=2048"
    worker_log = OUT / "worker.log"
    worker = _spawn(["rollpool.workers", "--broker", wep, "--engine", "sglang", "--model", str(big), "--worker-id", "sg0",
                     "--engine-options", opts, "--apply-mode", "interrupt", "--window-chunks", "16", "--log-level", "INFO"], worker_log)
    if args.weights_transport == "ipc":
        wdir = Path(args.work) / "ipc"
        wdir.mkdir(parents=True, exist_ok=True)
        weights_ep = {"weight_router_endpoint": f"ipc://{wdir}/router", "weight_pub_endpoint": f"ipc://{wdir}/pub"}
    else:
        weights_ep = {}
    # launch_server derives more ports from this one (its gRPC port is 10,000 above): keep it low
    hs_port, hs = 31000 + os.getpid() % 2000, None
    if args.compare_http_server:
        # SGLang's own HTTP server on the same model, same backends, for the child-vs-server measurement
        hs = _spawn(["sglang.launch_server", "--model-path", str(big), "--host", "127.0.0.1", "--port", str(hs_port),
                     "--dtype", "bfloat16", "--mem-fraction-static", "0.25", "--max-running-requests", str(args.capacity),
                     "--random-seed", "0", "--context-length", "2048", "--attention-backend", "triton",
                     "--sampling-backend", "pytorch", "--grammar-backend", "none", "--cuda-graph-backend-prefill", "disabled",
                     "--log-level", "warning"], OUT / "http_server.log")
    cfg = TrainerClientConfig(broker=cep, pull_wait_s=0.5, request_timeout_s=60.0, keep_versions=2, **weights_ep)
    client = TrainerClient(config=cfg)
    stage: dict[str, Any] = {}
    RESULT["stages"]["pool"] = stage
    try:
        await client.connect()
        await client.publish_weights({}, 0)
        t0 = time.time()
        for _ in range(3000):
            st = await client.status()
            if st["counters"].get("workers_alive", 0) >= 1:
                break
            if worker.poll() is not None:
                raise RuntimeError(f"worker exited {worker.returncode}: {worker_log.read_text()[-3000:]}")
            await asyncio.sleep(0.2)
        else:
            raise RuntimeError("the sglang worker never joined")
        stage["worker_join_s"] = round(time.time() - t0, 1)
        note(f"worker joined after {stage['worker_join_s']} s")
        await asyncio.sleep(2.0)
        save()

        rng = random.Random(0)
        prompts = [[rng.randrange(10, 31000) for _ in range(128)] for _ in range(args.prompts)]
        sampling = {"max_new_tokens": args.out_tokens, "temperature": 1.0, "ignore_eos": True}
        # the worker's SGLang child takes requests with its per-launch token only (the engine writes it, 0600, beside its log)
        http = HttpClient("127.0.0.1", sg_port, token=(OUT / f"sglang-{sg_port}.token").read_text())
        sp = SamplingParams(max_new_tokens=args.out_tokens, temperature=1.0, ignore_eos=True)
        counter = iter(range(10**9))

        async def direct(target: HttpClient | None = None) -> float:
            t = time.perf_counter()
            outs = await asyncio.gather(*((target or http).request("POST", "/generate", generate_body(p, sp, rid=sample_rid("directxx", next(counter), 0, 0), index=0))
                                          for p in prompts))
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

        hs_http = None
        if hs is not None:
            hs_http = HttpClient("127.0.0.1", hs_port)
            for _ in range(1200):
                if hs.poll() is not None:
                    stage["http_server_error"] = f"exited {hs.returncode}: " + (OUT / "http_server.log").read_text(errors="replace")[-1500:]
                    hs_http = None
                    break
                try:
                    await hs_http.request("GET", "/health_generate", timeout_s=30)
                    break
                except Exception:  # noqa: BLE001 - not up yet
                    await asyncio.sleep(0.5)
            note(f"SGLang HTTP server: {'up' if hs_http else stage.get('http_server_error', 'not up')[:300]}")
            save()
        await direct()  # warm-up (CUDA graphs, radix cache of nothing: prompts differ per run anyway)
        if hs_http is not None:
            await direct(hs_http)
        d_runs, p_runs, h_runs = [], [], []
        for i in range(args.pairs):
            d_runs.append(await direct())
            p_runs.append(await pool())
            if hs_http is not None:
                h_runs.append(await direct(hs_http))
            note(f"pair {i}: direct {d_runs[-1]:.0f} tok/s, pool {p_runs[-1]:.0f} tok/s, http server {h_runs[-1] if h_runs else 0:.0f} tok/s")
            stage.update(direct_runs=d_runs, pool_runs=p_runs, http_server_runs=h_runs)
            save()
        if h_runs:
            RESULT["http_server_tokens_per_s"] = round(statistics.median(h_runs), 1)
            RESULT["child_engine_vs_http_server"] = round(statistics.median(d / h for d, h in zip(d_runs, h_runs, strict=True)), 4)
        if hs is not None:
            _stop(hs)
        RESULT["direct_tokens_per_s"] = round(statistics.median(d_runs), 1)
        RESULT["pool_tokens_per_s"] = round(statistics.median(p_runs), 1)
        RESULT["pool_vs_direct"] = round(statistics.median(p_runs) / statistics.median(d_runs), 4)
        RESULT["pool_vs_direct_pairwise_median"] = round(statistics.median(p / d for p, d in zip(p_runs, d_runs, strict=True)), 4)
        RESULT["throughput_workload"] = {"prompts": len(prompts), "prompt_tokens": 128, "output_tokens": args.out_tokens,
                                         "ignore_eos": True, "temperature": 1.0, "pairs": args.pairs}
        save()

        # versions: publish new versions while a long batch generates; the first half from the trainer's CPU
        # tensors, the second half from CUDA tensors (a trainer that keeps its weights on the GPU)
        sd = load_file(str(big / "model.safetensors"))
        long_sampling = {"max_new_tokens": args.long_tokens, "temperature": 1.0, "ignore_eos": True}
        long_prompts = prompts * 4  # enough work to span every update
        await client.submit([{"input_ids": p} for p in long_prompts], group_size=1, sampling=long_sampling)
        await asyncio.sleep(1.0)
        pubs = []
        versions = list(range(1, args.versions + 1))
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
            for _ in range(600):
                lines = _apply_lines(worker_log)
                if v in lines:
                    break
                await asyncio.sleep(0.05)
            else:
                raise RuntimeError(f"version {v} never applied")
            a = lines[v]
            pause_at = a["update_started_at"] - a["pause_s"]
            rec: dict[str, Any] = {"version": v, "trainer_tensors_on": on, "publish_to_applied_s": round(a["applied_at"] - t_pub, 4),
                                   "publish_call_s": round(t_ret - t_pub, 4)}
            if a.get("staged"):
                fetched_at = a["stage_started_at"]
                rec.update(fetch_s=round(fetched_at - t_ret, 4), stage_h2d_s=round(a["stage_h2d_s"], 4), stage_s=round(a["stage_s"], 4),
                           grant_wait_s=round(pause_at - fetched_at - a["stage_s"], 4))
            else:
                rec.update(fetch_s=round(pause_at - t_ret, 4))
            rec.update({"pause_s": round(a["pause_s"], 4), "h2d_s": round(a["h2d_s"], 4), "serialize_s": round(a["serialize_s"], 4),
                        "sglang_update_s": round(a["sglang_update_s"], 4), "verify_s": round(a["verify_s"], 4),
                        "resume_s": round(a["resume_s"], 4)})
            rec["gb_per_s"] = round(model_bytes / rec["publish_to_applied_s"] / 1e9, 3)
            pubs.append(rec)
            note(f"version {v}: {pubs[-1]}")
            stage["publishes"] = pubs
            save()
            await asyncio.sleep(0.5)
        batch = await client.get_batch(len(long_prompts), max_staleness=1000, timeout=600)
        bad, mixed, seen = [], 0, set()
        for tr in batch.trajectories:
            tv = [int(x) for x in tr.token_versions]
            seen |= set(tv)
            if len(tv) != len(tr.output_ids) or tv != sorted(tv) or not set(tv) <= {0, *versions}:
                bad.append(tr.prompt_id if hasattr(tr, "prompt_id") else "?")
            if len(set(tv)) > 1:
                mixed += 1
        stage["versions"] = {"trajectories": len(batch.trajectories), "bad": len(bad), "mixed_version_trajectories": mixed,
                             "versions_seen": sorted(seen)}
        RESULT["versions_ok"] = not bad and len(batch.trajectories) == len(long_prompts) and versions[-1] in seen and mixed > 0
        RESULT["model_bytes"] = model_bytes
        RESULT["weights_transport"] = args.weights_transport

        def summary(group: list[dict[str, Any]]) -> dict[str, Any]:
            keys = [k for k in group[0] if isinstance(group[0][k], (int, float)) and k != "version"]
            return {k: round(statistics.median(p[k] for p in group if k in p), 4) for k in keys}

        # version 1 pays for fresh (pinned) host buffers in the worker; later ones reuse them
        steady = [p for p in pubs if p["version"] > 1] or pubs
        for on in ("cpu", "cuda"):
            group = [p for p in steady if p["trainer_tensors_on"] == on]
            if group:
                RESULT[f"publish_to_applied_{on}"] = summary(group)
        best = min(steady, key=lambda p: p["publish_to_applied_s"])
        RESULT["publish_to_applied_s"] = round(statistics.median(p["publish_to_applied_s"] for p in steady), 4)
        RESULT["publish_to_applied_split"] = summary(steady)
        RESULT["publish_to_applied_best"] = best
        RESULT["applied_gb_per_s"] = round(model_bytes / RESULT["publish_to_applied_s"] / 1e9, 3)
        save()
        await http.close()
        if hs_http is not None:
            await hs_http.close()
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), 10)
        _stop(worker)
        _stop(broker)
        if hs is not None:
            _stop(hs)


def main() -> int:
    global OUT, RESULT_NAME
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--work", default="/tmp/gpu_sglang")
    ap.add_argument("--skip-pytest", action="store_true")
    ap.add_argument("--skip-pool", action="store_true")
    ap.add_argument("--pytest-timeout-s", type=int, default=300)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--out-tokens", type=int, default=1024, help="per prompt in the throughput pairs (~4 s of generation per run)")
    ap.add_argument("--versions", type=int, default=6, help="weight versions published during the long batch (second half from CUDA tensors)")
    ap.add_argument("--weights-transport", choices=("ipc", "tcp"), default="ipc")
    ap.add_argument("--compare-http-server", action=argparse.BooleanOptionalAction, default=False,
                    help="also time SGLang's own HTTP server (python -m sglang.launch_server; not startable from the kit, see docs/sglang.md)")
    ap.add_argument("--long-tokens", type=int, default=1800)
    ap.add_argument("--capacity", type=int, default=256)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--result-name", default="h200-sglang.json")
    args = ap.parse_args()
    OUT = Path(args.out)
    RESULT_NAME = args.result_name
    OUT.mkdir(parents=True, exist_ok=True)
    setup_env()
    import torch

    RESULT["machine"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    RESULT["torch"] = torch.__version__
    with contextlib.suppress(Exception):
        import sglang

        RESULT["sglang"] = sglang.__version__
    with contextlib.suppress(Exception):
        import aiohttp

        RESULT["http"] = f"aiohttp {aiohttp.__version__} (client in the worker, server in the child)"
    with contextlib.suppress(Exception):
        RESULT["commit"] = (ROOT / ".commit").read_text().strip()
    save()
    t = time.time()
    small, big, model_bytes = build_models(Path(args.work))
    RESULT["model"] = {"params_bytes": model_bytes, "arch": "llama", "hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8,
                       "vocab": 32000, "dtype": "bfloat16", "build_s": round(time.time() - t, 1)}
    RESULT["model_bytes"] = model_bytes
    save()
    note(f"models built: {model_bytes / 1e9:.2f} GB")
    if not args.skip_pytest:
        try:
            r = asyncio.run(run_contract(small))
            RESULT["contract_passed"] = all(v == "passed" or v.startswith("skipped") for k, v in r.items() if k.startswith("test_"))
            RESULT["contract_counts"] = {"passed": sum(v == "passed" for v in r.values()),
                                         "failed": sum(v.startswith("FAILED") for v in r.values()),
                                         "skipped": sum(v.startswith("skipped") for v in r.values())}
        except Exception as exc:  # noqa: BLE001
            RESULT["contract_passed"] = False
            RESULT["stages"]["contract_error"] = f"{type(exc).__name__}: {exc}"[:3000]
            note(f"contract stage failed: {exc!r}")
        save()
    if not args.skip_pool:
        try:
            asyncio.run(pool_stage(big, model_bytes, args))
        except Exception as exc:  # noqa: BLE001 - recorded, then the partial JSON stands
            RESULT["stages"].setdefault("pool", {})["error"] = f"{type(exc).__name__}: {exc}"[:3000]
            note(f"pool stage failed: {exc!r}")
    RESULT["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
