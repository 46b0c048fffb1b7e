"""Multi-turn episodes on SGLang: how much of each turn's prompt the prefix cache serves (issue 22).

One device call (H200, kit installed as for bench/gpu_sglang.py):

    PYTHONPATH=/tmp/site:. python3 bench/gpu_episodes.py --out $OUT        -> h200-episodes.json

On CPU, the same run against the sglang engine's child serving the sim engine, whose prefix cache is
simulated (a list of recent sequences; labelled ``simulated``)::

    python bench/gpu_episodes.py --backend sim --out /tmp/ep

Broker, one worker (``--engine sglang``, SGLang as the engine's child) and this process as the trainer,
separate processes. The worker runs `agent` below for every sample: an unmodified agent on the `openai`
SDK through the episode endpoint, ``--turns`` chat turns of ``--tokens-per-turn`` sampled tokens, each
followed by a user message of about ``--tool-tokens`` tokens (an environment's observation), the history
sent back unchanged. Per turn after the first, the agent reads SGLang's ``cached_tokens`` (the endpoint's
``usage.prompt_tokens_details.cached_tokens``) and counts the cacheable tokens: the previous turn's
prompt and output, less the one last sampled token (it has no KV yet). Phase ``no_update``: no weight
update in the window. Phase ``one_update``: the same workload with one version published while it runs
(SGLang flushes its cache on an update, so the turns right after it are recomputed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import gpu_weights as gw  # noqa: E402 - the model builder, process helpers and kit setup

WORDS = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "lambda", "zeta")


# --------------------------------------------------------------------------- the agent (runs in the worker)


async def agent(ctx: Any, prompt: Any) -> float:
    """An unmodified `openai` SDK agent: fixed turns, observations between them, history sent back unchanged."""
    import openai

    md = prompt.metadata
    turns, tokens, tool_words = int(md["turns"]), int(md["tokens_per_turn"]), int(md["tool_words"])
    rng = random.Random(f"{prompt.prompt_id}:{ctx.sample_index}")
    client = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key, max_retries=0, timeout=600)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful agent."},
                                      {"role": "user", "content": str(md["task"])}]
    per_turn: list[dict[str, Any]] = []
    prev: tuple[int, int] | None = None
    try:
        for t in range(turns):
            t0 = time.time()
            r = await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=tokens, temperature=1.0)
            msg = r.choices[0].message
            usage = r.usage
            cached = int(usage.prompt_tokens_details.cached_tokens or 0) if usage and usage.prompt_tokens_details else 0
            rec = {"turn": t, "prompt_tokens": usage.prompt_tokens if usage else 0,
                   "completion_tokens": usage.completion_tokens if usage else 0, "cached": cached,
                   "cacheable": (prev[0] + prev[1] - 1) if prev else 0, "s": round(time.time() - t0, 4)}
            per_turn.append(rec)
            prev = (rec["prompt_tokens"], rec["completion_tokens"])
            messages.append(msg.model_dump(exclude_none=True))  # sent back unchanged
            obs = " ".join(rng.choice(WORDS) for _ in range(tool_words))
            messages.append({"role": "user", "content": f"observation {t}: {obs}"})
    finally:
        await client.close()
    ctx.metadata["cache_turns"] = per_turn
    return 0.0


# --------------------------------------------------------------------------- the trainer side


def cache_share(groups: list[Any]) -> dict[str, Any]:
    cached = cacheable = turns = 0
    full = 0
    for g in groups:
        for tr in g.trajectories:
            for rec in tr.metadata.get("cache_turns", []):
                if rec["turn"] == 0:
                    continue
                turns += 1
                cached += min(rec["cached"], rec["cacheable"])
                cacheable += rec["cacheable"]
                full += rec["cached"] >= rec["cacheable"]
    return {"cached_tokens": cached, "cacheable_tokens": cacheable, "share": round(cached / cacheable, 4) if cacheable else None,
            "turns_counted": turns, "turns_fully_cached": full}


async def run_phase(client: Any, name: str, args: argparse.Namespace, publish_at: float | None, sd: dict[str, Any] | None,
                    version: int) -> dict[str, Any]:
    from rollpool.protocol import Prompt, SamplingParams

    def task(i: int) -> str:
        rng = random.Random(i)
        return f"Task {i}: " + " ".join(rng.choice(WORDS) for _ in range(40))

    prompts = [Prompt(prompt_id=f"{name}-{i}", text=task(i), group_size=args.n,
                      sampling=SamplingParams(max_new_tokens=args.tokens_per_turn, temperature=1.0),
                      metadata={"turns": args.turns, "tokens_per_turn": args.tokens_per_turn, "tool_words": args.tool_words,
                                "task": task(i)})
               for i in range(args.groups)]
    t0 = time.time()
    res = await client.submit(prompts)
    if res.rejected:
        raise RuntimeError(f"rejected: {res.rejected}")
    groups: list[Any] = []
    published_at = None
    while len(groups) < args.groups:
        if publish_at is not None and published_at is None and time.time() - t0 >= publish_at:
            if sd is not None:
                gw.optimizer_step(sd, version)
            await client.publish_weights(sd if sd is not None else {}, version)
            published_at = round(time.time() - t0, 3)
            gw.note(f"{name}: published version {version} at {published_at} s")
        try:
            batch = await client.get_batch(1, timeout=1.0)
        except TimeoutError:
            if time.time() - t0 > args.phase_timeout_s:
                raise RuntimeError(f"{name}: {len(groups)} of {args.groups} groups after {args.phase_timeout_s} s") from None
            continue
        groups += batch.groups
        for other in batch.other:
            raise RuntimeError(f"{name}: group {other.prompt_id} ended {other.state}: {other.reason}")
    wall = time.time() - t0
    out = {"wall_s": round(wall, 2), "episodes": sum(len(g.trajectories) for g in groups), "published_at_s": published_at,
           **cache_share(groups)}
    versions = sorted({int(v) for g in groups for tr in g.trajectories for v in tr.token_versions})
    out["token_versions_seen"] = versions
    out["sampled_tokens"] = sum(int((tr.loss_mask == 1).sum()) for g in groups for tr in g.trajectories)
    out["output_tokens_per_s"] = round(out["sampled_tokens"] / wall, 1)
    return out


async def main_async(args: argparse.Namespace, result: dict[str, Any], save: Any) -> None:
    import zmq.asyncio

    from rollpool.protocol.sockets import SocketFactory
    from rollpool.trainer_client.client import TrainerClient, TrainerClientConfig
    from rollpool.weights.publisher import WeightPublisher

    work = Path(args.work)
    if args.backend == "sglang":
        model, model_bytes = gw.build_model(work, args.shape)
        sd = gw.load_on(model, "cuda")
    else:
        from rollpool.workers.engines.tiny_model import build_tiny_model

        model = work / "tiny"
        if not (model / "config.json").exists():
            build_tiny_model(model)
        model_bytes, sd = 0, None
    result["model"] = {"path_kind": args.shape if args.backend == "sglang" else "tiny", "bytes": model_bytes}
    wep, cep, sg_port = f"tcp://127.0.0.1:{gw._port()}", f"tcp://127.0.0.1:{gw._port()}", gw._port()
    out = Path(args.out)
    broker = gw._spawn(["rollpool.broker", "--worker-endpoint", wep, "--client-endpoint", cep, "--max-staleness", "1000",
                        "--task-timeout-s", "3600", "--log-level", "WARNING"], out / "broker.log")
    opts = f"port={sg_port},capacity={args.concurrency},backend={args.backend},context_length={args.context},log_dir={out}"
    if args.backend == "sglang":
        opts += f",mem_fraction_static={args.mem_fraction}"
    wlog = out / "worker.log"
    worker = gw._spawn(["rollpool.workers", "--broker", wep, "--engine", "sglang", "--model", str(model), "--worker-id", "ep0",
                        "--engine-options", opts, "--episode", "bench.gpu_episodes:agent", "--max-episodes", str(args.concurrency),
                        "--max-context-tokens", str(args.context), "--apply-mode", "interrupt", "--log-level", "INFO"], wlog)
    zctx = zmq.asyncio.Context()
    pub = WeightPublisher(SocketFactory(zctx), router_endpoint=f"tcp://127.0.0.1:{gw._port()}",
                          pub_endpoint=f"tcp://127.0.0.1:{gw._port()}", keep_versions=2, pool="bench-episodes")
    await pub.start()
    client = TrainerClient(config=TrainerClientConfig(broker=cep, pull_wait_s=0.5, request_timeout_s=60.0, keep_versions=2))
    client._publisher = pub  # bench: the client publishes through this publisher
    try:
        await client.connect()
        await client.publish_weights({}, 0)
        t0 = time.time()
        while (await client.status())["counters"].get("workers_alive", 0) < 1:
            if worker.poll() is not None:
                raise RuntimeError(f"worker exited {worker.returncode}: {wlog.read_text(errors='replace')[-3000:]}")
            if time.time() - t0 > args.join_timeout_s:
                raise RuntimeError("the worker never joined")
            await asyncio.sleep(0.2)
        result["worker_join_s"] = round(time.time() - t0, 1)
        gw.note(f"worker joined after {result['worker_join_s']} s")
        save()
        result["warmup"] = await run_phase(client, "warmup", argparse.Namespace(**{**vars(args), "groups": 2, "turns": 2}), None, None, 0)
        result["no_update"] = await run_phase(client, "no-update", args, None, None, 0)
        gw.note(f"no_update: {json.dumps(result['no_update'])}")
        save()
        at = result["no_update"]["wall_s"] / 2
        result["one_update"] = await run_phase(client, "one-update", args, at, sd, 1)
        gw.note(f"one_update: {json.dumps(result['one_update'])}")
        save()
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), 10)
        gw._stop(worker)
        gw._stop(broker)
        with contextlib.suppress(Exception):
            await pub.close()
        zctx.destroy(linger=0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("sglang", "sim"), default="sglang")
    ap.add_argument("--shape", choices=tuple(gw.SHAPES), default="1p4")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--work", default="/tmp/gpu_episodes")
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--n", type=int, default=4, help="episodes per group")
    ap.add_argument("--concurrency", type=int, default=128, help="the engine's capacity and the worker's max_episodes")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--tokens-per-turn", type=int, default=128)
    ap.add_argument("--tool-words", type=int, default=24)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--mem-fraction", type=float, default=0.6)
    ap.add_argument("--join-timeout-s", type=float, default=300)
    ap.add_argument("--phase-timeout-s", type=float, default=240)
    ap.add_argument("--deadline-s", type=float, default=560)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gw.OUT = out
    gw.RESULT_NAME = "h200-episodes.json" if args.backend == "sglang" else "cpu-episodes-simulated.json"
    result = gw.RESULT
    result.pop("rows", None)
    result["what"] = "bench/gpu_episodes.py: multi-turn openai-SDK agents through the episode endpoint on one sglang worker"
    result["simulated"] = args.backend == "sim"
    result["workload"] = {k: getattr(args, k) for k in ("groups", "n", "concurrency", "turns", "tokens_per_turn", "tool_words", "context")}
    result["how"] = {"share": "sum over turns 2..T of min(SGLang cached_tokens, cacheable) / sum of cacheable, where cacheable is "
                              "the previous turn's prompt_tokens + completion_tokens - 1 (the last sampled token has no KV)",
                     "one_update": "the same workload; one version published (every tensor +-0.01, from CUDA tensors) at half "
                                   "the no_update phase's wall time"}
    gw.start_watchdog(args.deadline_s)
    if args.backend == "sglang":
        gw.setup_env()
        import torch

        result["machine"] = torch.cuda.get_device_name(0)
    try:
        asyncio.run(main_async(args, result, gw.save))
    except Exception as exc:  # noqa: BLE001 - recorded; the partial JSON stands
        result["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        gw.note(f"failed: {exc!r}")
    result["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    gw.save()
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
