"""One chat turn's round trip through the pool, stage by stage (SIMULATED: the sim engine, near-zero generation time).

An unmodified `openai` SDK agent sends chat turns, one at a time (no queueing: each figure is latency, not
throughput), to a real `EpisodeRunner`'s endpoint (aiohttp), whose episode renders, tokenizes and records the turn
and calls the real sglang engine, which sends it over its hop (ZeroMQ) to its launched child serving the sim engine
(``decode_s_per_token`` 1e-6: generation itself takes about nothing). Everything runs as the worker runs it, except
that the agent shares the runner's process and event loop (one call at a time, so it waits for nothing of the
pool's but its own turn).

The stages come from timestamps taken by wrappers this bench puts around the pool's own methods (the code under
test is not changed): the agent's SDK call, the endpoint's handler (`EpisodeServer._chat`), the episode's calls to
its tokenizer thread (`Episode._off_loop`, and the work inside the thread), the engine's ``generate`` and its hop
round trip (`SGLangEngine._post` of ``/generate``), and the child's own time for the request (SGLang's
``meta_info.e2e_latency``). Per stage: the median over the turns, in microseconds.

    python bench/turn_latency.py --trees before=/tmp/before,after=. --json bench/results/cpu-turn-latency-simulated.json

``--trees`` runs each tree in a process of its own (that tree first on ``PYTHONPATH``), interleaved rep by rep.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "lambda", "zeta")
SPANS = ("turn_round_trip", "sdk_builds_request", "http_round_trip", "endpoint_handler", "engine_generate", "hop_call",
         "child_generate", "tokenizer_thread_work", "tokenizer_thread_wait")  # tokenizer_thread_*: per call of the episode's tokenizer work (its thread, or inline)
STAGES = (*SPANS, "endpoint_and_episode", "engine_less_hop", "hop_less_child", "sdk_and_http_less_endpoint", "pool_less_child")


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    import contextvars

    import httpx2 as httpx  # what the openai SDK sends with
    import openai

    from rollpool.protocol import Prompt, SamplingParams
    from rollpool.workers.engines.sglang import engine as sglang_engine_mod
    from rollpool.workers.engines.sglang.engine import SGLangEngine
    from rollpool.workers.engines.tokenizer import load_tokenizer
    from rollpool.workers.episodes import EpisodeConfig, EpisodeRunner
    from rollpool.workers.episodes import episode as episode_mod
    from rollpool.workers.episodes import server as server_mod

    spans: dict[str, list[float]] = {k: [] for k in SPANS}
    call_start: contextvars.ContextVar[float] = contextvars.ContextVar("call_start", default=0.0)
    measuring = [False]

    def add(key: str, value: float) -> None:
        if measuring[0]:
            spans[key].append(value)

    def timed_async(cls: Any, name: str, key: str, only: str | None = None) -> None:
        orig = getattr(cls, name)

        async def wrapper(self: Any, *a: Any, **kw: Any) -> Any:
            if only is not None and (not a or a[0] != only):
                return await orig(self, *a, **kw)
            t = time.perf_counter()
            try:
                return await orig(self, *a, **kw)
            finally:
                add(key, time.perf_counter() - t)

        setattr(cls, name, wrapper)

    timed_async(server_mod.EpisodeServer, "_chat", "endpoint_handler")
    timed_async(SGLangEngine, "generate", "engine_generate")
    timed_async(SGLangEngine, "_post", "hop_call", only="/generate")

    orig_parse = sglang_engine_mod.parse_generate_response

    def parse(resp: Any) -> Any:
        meta = resp.get("meta_info", {}) if isinstance(resp, dict) else {}
        add("child_generate", float(meta.get("e2e_latency") or 0.0))
        return orig_parse(resp)

    sglang_engine_mod.parse_generate_response = parse

    orig_off = episode_mod.Episode._off_loop

    async def off_loop(self: Any, fn: Any, *a: Any, **kw: Any) -> Any:
        box: dict[str, float] = {}

        def timed(*xs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*xs)
            finally:
                box["work"] = time.perf_counter() - t

        t0 = time.perf_counter()
        try:
            return await orig_off(self, timed, *a, **kw)
        finally:
            add("tokenizer_thread_work", box.get("work", 0.0))
            add("tokenizer_thread_wait", time.perf_counter() - t0 - box.get("work", 0.0))

    episode_mod.Episode._off_loop = off_loop  # type: ignore[method-assign]

    orig_send = httpx.AsyncClient.send

    async def send(self: Any, request: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        add("sdk_builds_request", t - call_start.get())
        try:
            return await orig_send(self, request, **kw)
        finally:
            add("http_round_trip", time.perf_counter() - t)

    httpx.AsyncClient.send = send  # type: ignore[method-assign]

    async def agent(ctx: Any, prompt: Any) -> float:
        rng = random.Random(prompt.prompt_id)
        client = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key, max_retries=0, timeout=60)
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful agent."},
                                          {"role": "user", "content": prompt.text}]
        try:
            for t in range(args.turns):
                t0 = time.perf_counter()
                call_start.set(t0)
                r = await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=args.tokens_per_turn,
                                                         temperature=1.0)
                add("turn_round_trip", time.perf_counter() - t0)
                messages.append(r.choices[0].message.model_dump(exclude_none=True))
                messages.append({"role": "user", "content": f"observation {t}: " + " ".join(rng.choice(WORDS) for _ in range(24))})
        finally:
            await client.close()
        return 0.0

    work = Path(tempfile.mkdtemp(prefix="rp-turn-latency-"))
    engine = SGLangEngine(model=args.model_dir, capacity=args.concurrency, device="cpu", backend="sim", log_dir=str(work), start_timeout_s=120,
                          server_args=json.dumps({"decode_s_per_token": 1e-6, "length": "fixed", "length_median": args.tokens_per_turn,
                                                  "vocab": args.vocab}))
    await engine.start()
    runner = EpisodeRunner(engine, agent, EpisodeConfig(max_episodes=args.concurrency), tokenizer=load_tokenizer(args.model_dir), worker_id="lat")
    await runner.start()
    try:
        for i in range(args.warmup + args.episodes):
            if i == args.warmup:
                t_measured = time.perf_counter()
            measuring[0] = i >= args.warmup
            text = f"Task {i}: " + " ".join(random.Random(i).choice(WORDS) for _ in range(40))
            p = Prompt(prompt_id=f"lat-{i}", text=text, group_size=args.concurrency,
                       sampling=SamplingParams(max_new_tokens=args.tokens_per_turn))
            await runner.run_group(p, args.concurrency)  # the group's episodes at once (1: one turn at a time)
    finally:
        await runner.close()
        await engine.stop()
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in spans.items() if v}
    derived = {  # the stages between the spans above, from their medians
        "endpoint_and_episode": med["endpoint_handler"] - med["engine_generate"],
        "engine_less_hop": med["engine_generate"] - med["hop_call"],
        "hop_less_child": med["hop_call"] - med["child_generate"],
        "sdk_and_http_less_endpoint": med["turn_round_trip"] - med["endpoint_handler"],
        "pool_less_child": med["endpoint_handler"] - med["child_generate"]}
    wall = time.perf_counter() - t_measured
    return {"turns": len(spans["turn_round_trip"]), "concurrency": args.concurrency,
            "turns_per_s": round(len(spans["turn_round_trip"]) / wall, 1),
            "median_us": {k: round(1e6 * v, 1) for k, v in {**med, **derived}.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", default=f"this={ROOT}", help="label=path,... source trees (each run in a process of its own)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--episodes", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=1, help="episodes at once (1: one turn at a time, latency alone)")
    ap.add_argument("--tokens-per-turn", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=320, help="the tiny model's vocabulary")
    ap.add_argument("--model-dir", default="/tmp/rp-turn-latency-tiny")
    ap.add_argument("--json", default="")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one measured run, its JSON on stdout
    args = ap.parse_args()
    if args.one:
        print(json.dumps(asyncio.run(measure(args))))
        return 0
    if not (Path(args.model_dir) / "config.json").exists():
        sys.path.insert(0, str(ROOT))
        from rollpool.workers.engines.tiny_model import build_tiny_model

        build_tiny_model(Path(args.model_dir), vocab=args.vocab, hidden=32, layers=2, heads=4, kv_heads=2)
    trees = [(label, Path(path).resolve()) for label, _, path in (t.partition("=") for t in args.trees.split(","))]
    result: dict[str, Any] = {"what": "bench/turn_latency.py: one SDK chat turn through the pool, stage by stage, one turn at a time",
                              "simulated": True, "params": {k: v for k, v in vars(args).items() if k != "one"},
                              "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start", "rows": []}
    for rep in range(args.reps):
        for label, tree in trees if rep % 2 == 0 else list(reversed(trees)):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--one", *sys.argv[1:]]
            env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
            out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
            if out.returncode != 0:
                raise SystemExit(f"{label}: {out.stderr[-3000:]}")
            row = {"tree": label, "rep": rep, **json.loads(out.stdout.strip().splitlines()[-1])}
            result["rows"].append(row)
            print(f"  {label}: {json.dumps(row)}", flush=True)
    summary: dict[str, Any] = {}
    for label, _ in trees:
        mine = [r["median_us"] for r in result["rows"] if r["tree"] == label and r["median_us"]]
        summary[label] = {k: statistics.median(m[k] for m in mine) for k in STAGES} if mine else {}
    if len(trees) == 2 and all(summary.values()):
        (a, _), (b, _) = trees
        summary[f"{b}_vs_{a}"] = {k: round(summary[b][k] / summary[a][k], 3) if summary[a][k] else None for k in STAGES}
        tps = {label: statistics.median(r["turns_per_s"] for r in result["rows"] if r["tree"] == label) for label, _ in trees}
        summary["turns_per_s"] = {**tps, f"{b}_vs_{a}": round(tps[b] / tps[a], 3)}
    result["summary_median_us"] = summary
    result["load_average_at_end"] = round(os.getloadavg()[0], 1)
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
