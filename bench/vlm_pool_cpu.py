"""The pool's own CPU per image prompt on the sglang engine's path, against direct calls to the same child (SIMULATED).

`bench/gpu_vlm.py`'s throughput stage on a CPU: one image per prompt (`bench.gpu_vlm.noise_pngs`, distinct 224 px
noise PNGs), ``--prompt-tokens`` text tokens, ``--out-tokens`` output tokens, ``--prompts`` prompts per batch; a broker,
one worker (``--engine sglang``, its child the ``sim`` backend: SGLang's routes, no model, SIMULATED) and this
process as the trainer. Each rep runs, on the same child:

- ``direct``: every prompt as its own HTTP ``POST /generate`` with ``image_data`` (a base64 data URI, built before the
  clock starts, as gpu_vlm.py does) and one image token in the ids, all at once (``asyncio.gather``);
- ``pool``: `TrainerClient.submit` of the same prompts with `Prompt.images` (raw bytes) and `get_batch` of all.

The sim child decodes in ``--decode-s-per-token`` per step (small, so the pool's own costs show; the GPU's step is
about 6 ms for this batch). Per run: wall time, output tokens/s, and CPU (psutil user+system) of this process (the
trainer client; the direct run's HTTP client), the broker, the worker and the engine's child, per prompt; the ratio
pool/direct of tokens/s. SGLang's own work on an image (its processor, the vision tower) is not here: the sim runs
no model, so on a GPU both runs pay it alike.

``--trees base=/tmp/vlm-base,now=.`` runs the broker and the worker from each source tree (a ``git archive`` of
main beside this checkout), interleaved rep by rep; this process's code (the trainer client) is this checkout's
for both. ``--profile PY_SPY`` adds, after the measured reps, one pool run per tree under py-spy on the worker
(``--gil``: the thread holding the GIL), summarised by category and leaf frame.

    python bench/vlm_pool_cpu.py --trees base=/tmp/vlm-base,now=. --profile /tmp/pyspy/bin/py-spy \\
        --json bench/results/cpu-vlm-pool-simulated.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the bench package beside rollpool
    sys.path.insert(0, str(ROOT))

from bench.episodes import (  # noqa: E402
    Pool,
    Profiler,
    _children,
    _client,
    _cpu,
    _main_thread_cpu,
    _port,
    _wait_workers,
    profile_summary,
)
from bench.gpu_vlm import noise_pngs  # noqa: E402

# where a worker sample's CPU went: the leaf-most frame one of these matches (a file fragment or a function name)
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("image decode and checks (Pillow, workers/images.py)", ("/PIL/", "workers/images.py")),
    ("image grids and ids (engines/vision.py, transformers)", ("engines/vision.py", "/transformers/")),
    ("base64", ("/base64.py",)),
    ("JSON", ("/json/", "orjson")),
    ("logging", ("/logging/",)),
    ("ZeroMQ and the broker link", ("/zmq/", "workers/link.py", "protocol/codec.py", "protocol/messages.py", "/msgpack/")),
    ("hop to the child (sglang engine, wire, hop)", ("engines/sglang/",)),
    ("trajectories", ("workers/trajectories.py",)),
    ("worker and session", ("workers/worker.py", "workers/session.py", "rollpool/")),
    ("threads (to_thread hand-off)", ("/concurrent/futures/", "/threading.py", "/queue.py")),
)
FALLBACK = ("asyncio scheduling and sockets", ("/asyncio/", "/selectors.py", "/socket.py"))


def summarise(raw: str, top: int = 20) -> dict[str, Any]:
    """py-spy's raw stacks -> the share of samples per category (this bench's) and the top leaf frames."""
    return profile_summary(raw, top, CATEGORIES, FALLBACK)


class _Profiled(Profiler):
    def stop(self) -> dict[str, Any]:
        super().stop()
        try:
            return summarise(self.out.read_text())
        except OSError as exc:
            return {"error": f"py-spy wrote nothing: {exc}"}


async def tree_rows(label: str, tree: Path, args: argparse.Namespace, work: Path, model: Path, images: list[bytes],
                    reps: list[int], profile: str = "") -> list[dict[str, Any]]:
    """One pool of `tree`: warm-up, then `reps` pairs (direct, pool; the order alternating); with `profile`, one
    profiled pool run instead (a row with the profile)."""
    import numpy as np

    from rollpool.protocol.messages import Prompt, PromptImage, SamplingParams
    from rollpool.trainer_client.client import new_prompt_id
    from rollpool.workers.engines.sglang.http import HttpClient
    from rollpool.workers.engines.sglang.wire import generate_body, parse_generate_response, sample_rid
    from rollpool.workers.engines.vision import load_vision_spec

    spec = load_vision_spec(model)
    assert spec is not None
    pool = Pool(tree, work, label)
    wep, cep, sg_port = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}", _port()
    client = http = None
    rows: list[dict[str, Any]] = []
    try:
        broker = pool.spawn(["-m", "rollpool.broker", "--worker-endpoint", wep, "--client-endpoint", cep, "--batch-size",
                             str(len(images)), "--max-staleness", "1000", "--task-timeout-s", "3600", "--log-level", "WARNING"],
                            f"broker-{label}.log")
        server_args = json.dumps({"decode_s_per_token": args.decode_s_per_token}, separators=(",", ":"))
        opts = f"port={sg_port},capacity={len(images)},backend=sim,log_dir={work},server_args={server_args}"
        worker = pool.spawn(["-m", "rollpool.workers", "--broker", wep, "--engine", "sglang", "--model", str(model),
                             "--worker-id", f"vl-{label}", "--engine-options", opts, "--log-level", "WARNING"], f"worker-{label}.log")
        client = await _client(cep)
        join_s = await _wait_workers(client, 1, pool.procs, 180)
        http = HttpClient("127.0.0.1", sg_port, token=(work / f"sglang-{sg_port}.token").read_text())
        child = _children(worker.pid)
        pids = {"broker": [broker.pid], "worker": [worker.pid], "engine_child": child}

        rng = random.Random(1)
        texts = [[rng.randrange(10, 250) for _ in range(args.prompt_tokens)] for _ in images]
        sent = [spec.placeholders(t, 1) for t in texts]
        uris = ["data:image/png;base64," + base64.b64encode(b).decode() for b in images]
        sp = SamplingParams(max_new_tokens=args.out_tokens, temperature=1.0, ignore_eos=True)
        counter = iter(range(10**9))

        async def direct() -> int:
            outs = await asyncio.gather(*(http.request("POST", "/generate", generate_body(
                ids, sp, rid=sample_rid("directvl", next(counter), 0, 0), index=0, image_data=[uri]), timeout_s=600)
                for ids, uri in zip(sent, uris, strict=True)))
            return sum(len(parse_generate_response(o).output_ids) for o in outs)

        timeline: dict[str, float] = {}

        async def pooled(with_images: bool = True) -> int:
            t0 = time.time()
            if with_images:
                prompts = [Prompt(prompt_id=new_prompt_id(), input_ids=np.asarray(t, dtype=np.int32), sampling=sp,
                                  images=(PromptImage(data=b),)) for t, b in zip(texts, images, strict=True)]
            else:  # the ids the direct run sends (one image token each), no image: what the images cost the pool
                prompts = [Prompt(prompt_id=new_prompt_id(), input_ids=np.asarray(ids, dtype=np.int32), sampling=sp) for ids in sent]
            res = await client.submit(prompts)
            submitted = time.time()
            if res.rejected:
                raise RuntimeError(f"rejected: {list(res.rejected.values())[:3]}")
            batch = await client.get_batch(len(images), max_staleness=1000, timeout=600)
            bad = [t for t in batch.trajectories
                   if with_images and (len(t.image_sha256) != 1 or t.input_ids.tolist().count(spec.image_id) != expect)]
            if bad or len(batch.trajectories) != len(images):
                raise RuntimeError(f"{len(batch.trajectories)} trajectories, {len(bad)} without the image's hash or expanded ids")
            done = time.time()
            # where the wall time went (one host, one clock): submit -> the engine took the first and the last prompt;
            # the last sample done -> the batch in the trainer's hands
            timeline.update(submit_returned_s=submitted - t0, last_queued_s=max(t.queued_at for t in batch.trajectories) - t0,
                            first_started_s=min(t.started_at for t in batch.trajectories) - t0,
                            last_started_s=max(t.started_at for t in batch.trajectories) - t0,
                            last_finished_s=max(t.finished_at for t in batch.trajectories) - t0,
                            batch_in_hand_s=done - t0)
            return sum(len(t.output_ids) for t in batch.trajectories)

        expect = spec.expand([7], [spec.grids_of(images[:1])[0]]).count(spec.image_id)

        async def measured(run: str, rep: int, profiler: Any = None) -> dict[str, Any]:
            before = {k: sum(_cpu(p) for p in v) for k, v in pids.items()}
            loop0, mine0, t0 = _main_thread_cpu(worker.pid), time.process_time(), time.perf_counter()
            tokens = await (direct() if run == "direct" else pooled(run == "pool"))
            wall = time.perf_counter() - t0
            mine = time.process_time() - mine0
            cpu = {k: sum(_cpu(p) for p in v) - before[k] for k, v in pids.items()}
            loop = _main_thread_cpu(worker.pid) - loop0
            n = len(images)
            row = {"tree": label, "run": run, "rep": rep, "simulated": True, "wall_s": round(wall, 3),
                   "output_tokens_per_s": round(tokens / wall, 1), "output_tokens": tokens,
                   "client_cpu_ms_per_prompt": round(1e3 * mine / n, 3),
                   **{f"{k}_cpu_ms_per_prompt": round(1e3 * v / n, 3) for k, v in cpu.items()},
                   "worker_loop_thread_cpu_ms_per_prompt": round(1e3 * loop / n, 3)}
            if run != "direct":
                row["timeline"] = {k: round(v, 3) for k, v in timeline.items()}
            if profiler is not None:
                row["profile"] = profiler.stop()
            print(f"  {json.dumps({k: v for k, v in row.items() if k != 'profile'})}", flush=True)
            return row

        for _ in range(args.warmup):
            await direct()
            await pooled()
        if profile:
            prof = _Profiled(profile, worker.pid, work / f"profile-{label}-worker.txt")
            await asyncio.sleep(1.0)  # py-spy attached
            row = await measured("pool", -1, prof)
            row["join_s"] = round(join_s, 1)
            rows.append(row)
        for rep in reps:
            runs = ("direct", "pool", *(("pool_text",) if args.text_pool else ()))
            for run in (runs if rep % 2 == 0 else runs[::-1]):
                row = await measured(run, rep)
                row["join_s"] = round(join_s, 1)
                rows.append(row)
    finally:
        if http is not None:
            with contextlib.suppress(Exception):
                await http.close()
        if client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), 10)
        pool.stop()
    return rows


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


KEYS = ("output_tokens_per_s", "wall_s", "client_cpu_ms_per_prompt", "broker_cpu_ms_per_prompt", "worker_cpu_ms_per_prompt",
        "worker_loop_thread_cpu_ms_per_prompt", "engine_child_cpu_ms_per_prompt")


def summarise_rows(rows: list[dict[str, Any]], trees: list[tuple[str, Path]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, _ in trees:
        for run in ("direct", "pool", "pool_text"):
            mine = [r for r in rows if r["tree"] == label and r["run"] == run and r["rep"] >= 0]
            if not mine:
                continue
            out[f"{label}/{run}"] = {k: _median([r[k] for r in mine]) for k in KEYS}
        pairs: dict[tuple[str, int], dict[str, float]] = {}
        for r in rows:
            if r["tree"] == label and r["rep"] >= 0:
                pairs.setdefault((r["tree"], r["rep"]), {})[r["run"]] = r["output_tokens_per_s"]
        ratios = [p["pool"] / p["direct"] for p in pairs.values() if "pool" in p and "direct" in p]
        d, p = out[f"{label}/direct"]["output_tokens_per_s"], out[f"{label}/pool"]["output_tokens_per_s"]
        out[f"{label}/pool_vs_direct"] = round(p / d, 4) if d and p else None
        out[f"{label}/pool_vs_direct_pairwise_median"] = _median(ratios)
        pool, direct = out[f"{label}/pool"], out[f"{label}/direct"]
        out[f"{label}/pool_extra_cpu_ms_per_prompt"] = {
            k.removesuffix("_cpu_ms_per_prompt"): round((pool[k] or 0) - (direct[k] or 0), 3) for k in KEYS if k.endswith("_cpu_ms_per_prompt")}
        text = out.get(f"{label}/pool_text")
        if text:
            out[f"{label}/pool_text_vs_direct"] = round(text["output_tokens_per_s"] / d, 4) if d else None
            out[f"{label}/pool_vs_pool_text"] = round(p / text["output_tokens_per_s"], 4) if p else None
            out[f"{label}/image_extra_cpu_ms_per_prompt"] = {
                k.removesuffix("_cpu_ms_per_prompt"): round((pool[k] or 0) - (text[k] or 0), 3) for k in KEYS if k.endswith("_cpu_ms_per_prompt")}
    if len(trees) == 2:
        (a, _), (b, _) = trees
        out[f"{b}_vs_{a}"] = {
            "pool_tokens_per_s_ratio": round(out[f"{b}/pool"]["output_tokens_per_s"] / out[f"{a}/pool"]["output_tokens_per_s"], 3),
            "pool_worker_cpu_ratio": round(out[f"{b}/pool"]["worker_cpu_ms_per_prompt"] / out[f"{a}/pool"]["worker_cpu_ms_per_prompt"], 3),
            "pool_vs_direct": [out[f"{a}/pool_vs_direct"], out[f"{b}/pool_vs_direct"]]}
    return out


async def run(args: argparse.Namespace, result: dict[str, Any], save: Any) -> None:
    work = Path(tempfile.mkdtemp(prefix="rp-vlm-pool-"))
    model = Path(args.model_dir)
    if not (model / "config.json").exists():
        from rollpool.workers.engines.tiny_model import build_tiny_model

        build_tiny_model(model, arch="qwen2", vocab=2048, hidden=64, layers=2, heads=4, kv_heads=2, vlm=True)
    images = noise_pngs(args.prompts, args.image_px)
    result["image_bytes_mean"] = round(statistics.mean(len(b) for b in images))
    rows: list[dict[str, Any]] = result.setdefault("rows", [])
    trees = args.tree_paths
    try:
        for rep in range(args.reps):  # one pool per tree and rep, the trees' order alternating
            for label, tree in (trees if rep % 2 == 0 else list(reversed(trees))):
                rows.extend(await tree_rows(label, tree, args, work, model, images, [rep]))
                save()
        result["summary"] = summarise_rows(rows, trees)
        save()
        if args.profile:
            profiles = result.setdefault("profile", {})
            for label, tree in trees:
                row = (await tree_rows(label, tree, args, work, model, images, [], profile=args.profile))[0]
                profiles[label] = {"what": "py-spy record --gil --threads --nonblocking at 1000 Hz on the worker over one pool "
                                           "batch (samples of the thread holding the GIL); share by the leaf-most frame a "
                                           "category of bench/vlm_pool_cpu.py CATEGORIES matches; simulated",
                                   "worker_cpu_ms_per_prompt_while_profiled": row["worker_cpu_ms_per_prompt"], **row["profile"]}
                save()
    finally:
        if args.keep_work:
            print(f"work directory kept: {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result.get("summary", {}), indent=1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="")
    ap.add_argument("--trees", default=f"this={ROOT}", help="label=path,... source trees of the broker and worker (interleaved)")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--image-px", type=int, default=224)
    ap.add_argument("--out-tokens", type=int, default=512)
    ap.add_argument("--decode-s-per-token", type=float, default=0.0002, help="the sim child's decode step (simulated)")
    ap.add_argument("--reps", type=int, default=3, help="pools per tree; each runs one direct and one pool batch")
    ap.add_argument("--warmup", type=int, default=1, help="direct + pool batches before the measured ones, per pool")
    ap.add_argument("--text-pool", action="store_true",
                    help="each rep also runs the same prompts through the pool without their images (pool_text: the ids the "
                         "direct run sends): what the images cost the pool beyond a text prompt")
    ap.add_argument("--profile", default="", metavar="PY_SPY", help="then one profiled pool batch per tree (py-spy binary)")
    ap.add_argument("--model-dir", default="/tmp/rp-vlm-pool-tiny")
    ap.add_argument("--keep-work", action="store_true")
    args = ap.parse_args()
    args.tree_paths = [(label, Path(path).resolve()) for label, _, path in (t.partition("=") for t in args.trees.split(","))]
    result: dict[str, Any] = {"what": "bench/vlm_pool_cpu.py: pool vs direct with one image per prompt, the sglang engine over "
                                      "its sim child (SIMULATED: no model; SGLang's image work is not in either run)",
                              "simulated": True, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                              "params": {k: v for k, v in vars(args).items() if k != "tree_paths"},
                              "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start"}

    def save() -> None:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=1, default=str))

    try:
        asyncio.run(run(args, result, save))
    except Exception as exc:  # noqa: BLE001 - recorded; the partial JSON stands
        result["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        print(f"failed: {exc!r}", flush=True)
    result["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    result["load_average_at_end"] = round(os.getloadavg()[0], 1)
    save()
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
