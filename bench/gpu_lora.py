"""LoRA adapter versions on one GPU through the sglang engine: the gpu tests, pool vs direct, publish to applied.

One entry point for one device call (``--out $OUT``); every stage writes the partial JSON (``gpu-lora-sglang.json``)
before the next starts:

1. the models of bench/gpu_sglang.py (a small Llama for the tests; a ~0.85 B-parameter bf16 Llama for the figures);
2. tests/gpu/test_sglang_lora_gpu.py, run directly (SGLang serves the adapter as the merged model; two adapter
   versions side by side without a pause; a whole-model version leaves the adapter on, on top of the new base);
3. broker + one worker (``sglang`` engine, ``lora=true``) + a trainer client. The trainer publishes adapter
   version 1 (rank ``--rank`` on every attention and MLP projection); the same adapter is loaded into the same
   SGLang server under another name for the direct run. ``pool_vs_direct``: output tokens/s through the pool
   (adapter version 1) over the same prompts sent straight to SGLang with ``lora_path`` = that adapter, median of
   alternating pairs. Then adapter versions 2..N published while a long batch generates: publish to applied
   (the worker's ``sglang adapter apply`` log line) and the publish call (trainer blocked); every trajectory must
   carry one adapter version on all its tokens (a sample runs on one version to its end).

Run on the device:
``bash .sgkit/install.sh .sgkit /tmp/site && PYTHONPATH=/tmp/site:. python3 bench/gpu_lora.py --out $OUT``.
``--sim`` is a dry run of stage 3 on a CPU: the same script over the sglang engine's sim child (`SimLora`, no SGLang,
a tiny model, small sizes); its figures mean nothing, it checks the script.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_sglang as G

RESULT: dict[str, Any] = {"started_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "stages": {}}
OUT = Path(".")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save() -> None:
    (OUT / "gpu-lora-sglang.json").write_text(json.dumps(RESULT, indent=1, default=str))


def _applied(log_path: Path) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for line in log_path.read_text(errors="replace").splitlines():
        if "sglang adapter apply {" in line:
            d = json.loads(line[line.index("sglang adapter apply ") + len("sglang adapter apply "):])
            out[int(d["version"])] = d
    return out


async def run_tests(small: Path) -> dict[str, str]:
    import traceback

    from tests.gpu import test_sglang_lora_gpu as T

    os.environ["ROLLPOOL_SGLANG_TEST_MODEL"] = str(small)
    results: dict[str, str] = {}
    for name in ("check_adapter_is_served_as_the_merged_model", "check_two_adapter_versions_serve_side_by_side_without_a_pause",
                 "check_a_base_version_keeps_the_adapter_on"):
        work = OUT / name
        work.mkdir(exist_ok=True)
        try:
            await asyncio.wait_for(getattr(T, name)(work), 600)
            results[name] = "passed"
        except Exception as exc:  # noqa: BLE001 - recorded, the next stage runs
            results[name] = f"FAILED: {type(exc).__name__}: {exc}"[:600]
            (OUT / "test_failures.log").open("a").write(f"== {name}\n{traceback.format_exc()}\n")
        G.note(f"{name}: {results[name][:200]}")
        RESULT["stages"]["tests"] = results
        save()
    return results


async def pool_stage(big: Path, a: argparse.Namespace) -> None:
    import torch

    from rollpool.protocol.fingerprint import model_fingerprint
    from rollpool.protocol.messages import SamplingParams
    from rollpool.trainer_client.client import TrainerClient, TrainerClientConfig
    from rollpool.weights.adapters import adapter_spec, lora_pairs
    from rollpool.workers.engines.sglang.http import HttpClient
    from rollpool.workers.engines.sglang.lora import write_adapter
    from rollpool.workers.engines.sglang.wire import (
        generate_body,
        parse_generate_response,
        read_safetensors_index,
        sample_rid,
    )

    def port() -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    spec = adapter_spec(a.rank, 2 * a.rank, TARGETS, base_fingerprint=model_fingerprint(big), base_model=str(big))
    shapes = {n.removesuffix(".weight"): shape for n, (_d, shape) in read_safetensors_index(big).items()
              if n.endswith(".weight") and n.removesuffix(".weight").rsplit(".", 1)[-1] in TARGETS}
    g = torch.Generator().manual_seed(0)
    named = {}
    for module, (out_f, in_f) in sorted(shapes.items()):
        named[f"base_model.model.{module}.lora_A.weight"] = (torch.randn(a.rank, in_f, generator=g) * 0.01).to(torch.bfloat16)
        named[f"base_model.model.{module}.lora_B.weight"] = (torch.randn(out_f, a.rank, generator=g) * 0.01).to(torch.bfloat16)
    adapter_bytes = sum(t.numel() * t.element_size() for t in named.values())
    RESULT.update(adapter_bytes=adapter_bytes, rank=a.rank, targets=list(TARGETS))
    wep, cep, sg_port = f"tcp://127.0.0.1:{port()}", f"tcp://127.0.0.1:{port()}", port()
    broker = G._spawn(["rollpool.broker", "--worker-endpoint", wep, "--client-endpoint", cep, "--batch-size", "256",
                       "--max-staleness", "1000", "--max-applying", "1", "--task-timeout-s", "3600", "--log-level", "WARNING"],
                      OUT / "broker.log")
    opts = (f"port={sg_port},capacity={a.capacity},mem_fraction_static=0.6,log_dir={OUT},context_length=2048,"
            f"lora=true,max_lora_rank={a.rank},lora_resident=4" + (",backend=sim,device=cpu" if a.sim else ""))
    worker_log = OUT / "worker.log"
    worker = G._spawn(["rollpool.workers", "--broker", wep, "--engine", "sglang", "--model", str(big), "--worker-id", "sg0",
                       "--engine-options", opts, "--apply-mode", "interrupt", "--log-level", "INFO"], worker_log)
    client = TrainerClient(config=TrainerClientConfig(broker=cep, pull_wait_s=0.5, request_timeout_s=60.0, keep_versions=2))
    stage: dict[str, Any] = {}
    RESULT["stages"]["pool"] = stage
    http = None
    try:
        await client.connect()
        t0 = time.time()
        while (await client.status())["counters"].get("workers_alive", 0) < 1:
            if worker.poll() is not None:
                raise RuntimeError(f"worker exited {worker.returncode}: {worker_log.read_text()[-3000:]}")
            if time.time() - t0 > 900:
                raise RuntimeError("the sglang worker never joined")
            await asyncio.sleep(0.2)
        stage["worker_join_s"] = round(time.time() - t0, 1)
        await client.publish_weights(named, 1, adapter=spec)
        for _ in range(1200):
            if 1 in _applied(worker_log):
                break
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError("adapter version 1 never applied: " + worker_log.read_text(errors="replace")[-3000:])
        G.note(f"worker joined after {stage['worker_join_s']} s; adapter v1 applied")
        http = HttpClient("127.0.0.1", sg_port, token=(OUT / f"sglang-{sg_port}.token").read_text())
        # the direct run's adapter: the same tensors under another name in the same server
        direct_dir = write_adapter(OUT / "direct-adapter", "direct", lora_pairs(named, spec), spec, "bfloat16")
        res = await http.request("POST", "/load_lora_adapter", {"lora_name": "direct", "lora_path": str(direct_dir)}, timeout_s=600)
        stage["direct_adapter_load"] = res
        save()

        rng = random.Random(0)
        prompts = [[rng.randrange(10, 1000 if a.sim else 31000) for _ in range(128)] for _ in range(a.prompts)]
        sampling = {"max_new_tokens": a.out_tokens, "temperature": 1.0, "ignore_eos": True}
        sp = SamplingParams(max_new_tokens=a.out_tokens, temperature=1.0, ignore_eos=True)
        counter = iter(range(10**9))

        async def direct() -> float:
            assert http is not None
            t = time.perf_counter()
            bodies = [{**generate_body(p, sp, rid=sample_rid("directlr", next(counter), 0, 0), index=0), "lora_path": "direct"}
                      for p in prompts]
            outs = await asyncio.gather(*(http.request("POST", "/generate", b, timeout_s=1200) for b in bodies))
            return sum(len(parse_generate_response(o).output_ids) for o in outs) / (time.perf_counter() - t)

        async def pool() -> tuple[float, set[int]]:
            t = time.perf_counter()
            await client.submit([{"input_ids": p} for p in prompts], group_size=1, sampling=sampling)
            batch = await client.get_batch(len(prompts), max_staleness=1000, timeout=1200)
            dt = time.perf_counter() - t
            return sum(len(tr.output_ids) for tr in batch.trajectories) / dt, {int(v) for tr in batch.trajectories for v in tr.token_versions}

        await direct()  # warm-up
        d_runs, p_runs, seen = [], [], set()
        for i in range(a.pairs):
            if i % 2:  # pool first on odd pairs: neither side always runs second (a warm cache, a clock ramp)
                p, vs = await pool()
                d_runs.append(await direct())
            else:
                d_runs.append(await direct())
                p, vs = await pool()
            p_runs.append(p)
            seen |= vs
            G.note(f"pair {i}: direct {d_runs[-1]:.0f} tok/s, pool {p_runs[-1]:.0f} tok/s (versions {sorted(vs)})")
            stage.update(direct_runs=d_runs, pool_runs=p_runs)
            save()
        RESULT["direct_tokens_per_s"] = round(statistics.median(d_runs), 1)
        RESULT["pool_tokens_per_s"] = round(statistics.median(p_runs), 1)
        RESULT["pool_vs_direct"] = round(statistics.median(p_runs) / statistics.median(d_runs), 4)
        RESULT["pool_vs_direct_pairwise_median"] = round(statistics.median(p / d for p, d in zip(p_runs, d_runs, strict=True)), 4)
        RESULT["pool_vs_direct_pairwise_range"] = [round(min(p / d for p, d in zip(p_runs, d_runs, strict=True)), 4),
                                                   round(max(p / d for p, d in zip(p_runs, d_runs, strict=True)), 4)]
        RESULT["direct_runs_spread"] = round(max(d_runs) / min(d_runs), 4)  # the direct run against itself: the noise floor
        RESULT["pool_ran_on_adapter_version_1"] = seen == {1}
        RESULT["throughput_workload"] = {"prompts": len(prompts), "prompt_tokens": 128, "output_tokens": a.out_tokens, "pairs": a.pairs}
        save()

        long_prompts = prompts * 2
        await client.submit([{"input_ids": p} for p in long_prompts], group_size=1,
                            sampling={"max_new_tokens": a.long_tokens, "temperature": 1.0, "ignore_eos": True})
        await asyncio.sleep(1.0)
        pubs = []
        versions = list(range(2, a.versions + 2))
        for v in versions:
            with torch.no_grad():
                for t in named.values():
                    t.add_(1e-3)  # a training step changed the adapter
            t_pub = time.time()
            await client.publish_weights(named, v, adapter=spec)
            t_ret = time.time()
            for _ in range(1200):
                got = _applied(worker_log).get(v)
                if got is not None:
                    break
                await asyncio.sleep(0.01)
            else:
                raise RuntimeError(f"adapter version {v} never applied")
            pubs.append({"version": v, "lora_publish_to_applied_s": round(got["applied_at"] - t_pub, 4),
                         "lora_trainer_blocked_s": round(t_ret - t_pub, 4), "write_s": round(got["write_s"], 4),
                         "sglang_load_s": round(got["sglang_load_s"], 4)})
            G.note(f"adapter version {v}: {pubs[-1]}")
            stage["publishes"] = pubs
            save()
            await asyncio.sleep(0.5)
        batch = await client.get_batch(len(long_prompts), max_staleness=1000, timeout=1200)
        one_version = sum(1 for tr in batch.trajectories if len({int(x) for x in tr.token_versions}) == 1)
        stage["long_batch"] = {"trajectories": len(batch.trajectories), "one_adapter_version_each": one_version,
                               "versions_seen": sorted({int(x) for tr in batch.trajectories for x in tr.token_versions})}
        RESULT["versions_ok"] = one_version == len(batch.trajectories) == len(long_prompts)
        steady = pubs[1:] or pubs
        RESULT["lora_publish_to_applied_s"] = round(statistics.median(p["lora_publish_to_applied_s"] for p in steady), 4)
        RESULT["lora_trainer_blocked_s"] = round(statistics.median(p["lora_trainer_blocked_s"] for p in steady), 4)
        save()
    finally:
        if http is not None:
            await http.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), 10)
        G._stop(worker)
        G._stop(broker)


def main() -> int:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--work", default="/tmp/rollpool-gpu-lora")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--capacity", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--out-tokens", type=int, default=256)
    ap.add_argument("--long-tokens", type=int, default=1024)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--base", choices=("1p4", "8b"), default="1p4",
                    help="the base of stage 3: the 1.4 GB model, or bench/gpu_weights.py's 8B-shaped Llama (the issue's goal shape)")
    ap.add_argument("--skip-tests", action="store_true", help="stage 3 only (the figures)")
    ap.add_argument("--tests-only", action="store_true", help="stages 1-2 only (the gpu tests), for a short device call")
    ap.add_argument("--sim", action="store_true", help="a CPU dry run of stage 3 on the sim child (checks the script only)")
    a = ap.parse_args()
    OUT = G.OUT = Path(a.out)
    OUT.mkdir(parents=True, exist_ok=True)
    if a.sim:
        from rollpool.workers.engines.tiny_model import build_tiny_model

        RESULT["simulated"] = True
        tiny = Path(a.work) / "tiny"
        if not (tiny / "config.json").exists():
            build_tiny_model(tiny, vocab=1024, hidden=64, layers=2, heads=4, kv_heads=2)
        asyncio.run(pool_stage(tiny, a))
        G.note(json.dumps({k: v for k, v in RESULT.items() if k != "stages"}))
        return 0
    G.setup_env()
    import torch

    RESULT["machine"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    if a.tests_only:  # the small model only (the big one takes a minute to build)
        from rollpool.workers.engines.tiny_model import build_tiny_model

        small = build_tiny_model(work / "small", vocab=1024, hidden=256, layers=2, heads=4, kv_heads=2)
        big = small
    else:
        small, big, model_bytes = G.build_models(work)
        if a.base == "8b":
            import gpu_weights

            big, model_bytes = gpu_weights.build_model(work, "8b")
        RESULT["model_bytes"], RESULT["base"] = model_bytes, a.base
    save()
    if not a.skip_tests:
        asyncio.run(run_tests(small))
    if not a.tests_only:
        asyncio.run(pool_stage(big, a))
    G.note(json.dumps({k: v for k, v in RESULT.items() if k != "stages"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
