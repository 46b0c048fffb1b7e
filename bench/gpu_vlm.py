"""Pool vs direct SGLang with one image per prompt, on a small random Qwen2-VL (one GPU).

One entry point for one device call (``--out $OUT``); the partial JSON (``--result-name``, default
``h100-vlm.json``) is written after every stage:

1. build the model (``build_tiny_model(vlm=True)``: a Qwen2-VL, random weights, bf16) and one distinct
   random-noise PNG per prompt (distinct, so SGLang's multimodal cache serves none of them twice);
2. broker + one worker whose ``sglang`` engine starts SGLang as its child + a trainer client;
   pool vs direct output tokens/s: the same prompts, each with its image, straight to the same SGLang
   child (``/generate`` with ``image_data``) and through the pool (`Prompt.images`), alternating pairs,
   medians; ``pool_vs_direct`` = median pool / median direct; ``images_reached_sglang``: SGLang's
   ``prompt_tokens`` of every direct prompt is the expanded length (the image seen; one image token means
   SGLang ran without it); ``stages.pool.pool_timelines``: per pool run, seconds after submit until the engine
   took the first and the last prompt, the last sample was done, the batch was in hand;
3. versions with images: a long batch while version 1 is published; every trajectory's token versions
   must be non-decreasing and within {0, 1}, every trajectory must carry its image's sha256 and the
   expanded image tokens its grid says (``versions_exact``).

On a machine without a GPU or SGLang, ``--dry-run`` parses the arguments, builds the model and the
images, runs the worker's side of an image prompt (the model's image processor: grids and the expanded
ids the pool reports) and writes the JSON with ``"dry_run": true`` (a check of the script before a device call).

What the GPU run needs beyond the checkout: SGLang's kit (``.sgkit``, carried) and torchvision, which
``import sglang`` and SGLang's Qwen2-VL processor import (``sglang/srt/utils/common.py``,
``multimodal/processors/qwen_vl.py``): the kit does not carry it, the device image has it (torchvision 0.26.0
beside torch 2.11.0). The vision tower's attention runs on triton (the engine's child sets
``mm_attention_backend``; its Hopper default, fa3, is not in the kit).

Run on the device: ``bash .sgkit/install.sh .sgkit /tmp/site && PYTHONPATH=/tmp/site:. python3 bench/gpu_vlm.py --out $OUT``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import io
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
RESULT_NAME = "h100-vlm.json"


def note(msg: str) -> None:
    print(f"[gpu_vlm {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def save() -> None:
    (OUT / RESULT_NAME).write_text(json.dumps(RESULT, indent=1, default=str))


def build(work: Path, args: argparse.Namespace) -> tuple[Path, list[bytes]]:
    from rollpool.workers.engines.tiny_model import build_tiny_model

    model = work / "vlm"
    if not (model / "config.json").exists():
        build_tiny_model(model, arch="qwen2", vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                         kv_heads=args.kv_heads, vlm=True)
        if not args.dry_run:
            import torch
            from safetensors.torch import load_file, save_file

            sd = load_file(str(model / "model.safetensors"))
            save_file({k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}, str(model / "model.safetensors"), metadata={"format": "pt"})
            cfg = json.loads((model / "config.json").read_text())
            cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
            (model / "config.json").write_text(json.dumps(cfg, indent=1))
    return model, noise_pngs(args.prompts, args.image_px)


def noise_pngs(count: int, px: int, seed: int = 0) -> list[bytes]:
    """`count` distinct random-noise PNGs of `px` x `px` (distinct, so SGLang's multimodal cache serves none twice)."""
    from PIL import Image

    rng = random.Random(seed)
    images = []
    for _ in range(count):
        buf = io.BytesIO()
        Image.frombytes("RGB", (px, px), rng.randbytes(px * px * 3)).save(buf, "PNG")
        images.append(buf.getvalue())
    return images


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


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def pool_stage(model: Path, images: list[bytes], args: argparse.Namespace) -> None:
    import base64

    import numpy as np
    from safetensors.torch import load_file

    from rollpool.protocol.messages import Prompt, PromptImage, SamplingParams
    from rollpool.trainer_client.client import TrainerClient, TrainerClientConfig, UnfillableBatchError, new_prompt_id
    from rollpool.workers.engines.sglang.http import HttpClient
    from rollpool.workers.engines.sglang.wire import generate_body, parse_generate_response, sample_rid
    from rollpool.workers.engines.vision import load_vision_spec

    spec = load_vision_spec(model)
    assert spec is not None
    wep, cep, sg_port = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}", _port()
    broker = _spawn(["rollpool.broker", "--worker-endpoint", wep, "--client-endpoint", cep, "--batch-size", "256",
                     "--max-staleness", "1000", "--max-applying", "1", "--task-timeout-s", "3600", "--log-level", "WARNING"],
                    OUT / "broker.log")
    opts = f"port={sg_port},capacity={args.capacity},mem_fraction_static=0.6,log_dir={OUT},context_length=2048"
    worker_log = OUT / "worker.log"
    worker = _spawn(["rollpool.workers", "--broker", wep, "--engine", "sglang", "--model", str(model), "--worker-id", "sg0",
                     "--engine-options", opts, "--apply-mode", "interrupt", "--log-level", "INFO"], worker_log)
    client = TrainerClient(config=TrainerClientConfig(broker=cep, pull_wait_s=0.5, request_timeout_s=60.0, keep_versions=2))
    stage: dict[str, Any] = {}
    RESULT["stages"]["pool"] = stage
    try:
        await client.connect()
        await client.publish_weights({}, 0)
        t0 = time.time()
        while (await client.status())["counters"].get("workers_alive", 0) < 1:
            if worker.poll() is not None:
                raise RuntimeError(f"worker exited {worker.returncode}: {worker_log.read_text()[-3000:]}")
            if time.time() - t0 > 600:
                raise RuntimeError("the sglang worker never joined")
            await asyncio.sleep(0.2)
        stage["worker_join_s"] = round(time.time() - t0, 1)
        note(f"worker joined after {stage['worker_join_s']} s")
        save()

        rng = random.Random(1)
        texts = [[rng.randrange(10, 250) for _ in range(args.prompt_tokens)] for _ in images]
        sent = [spec.placeholders(t, 1) for t in texts]  # one image token per image, in front: SGLang expands it
        uris = ["data:image/png;base64," + base64.b64encode(b).decode() for b in images]
        sp = SamplingParams(max_new_tokens=args.out_tokens, temperature=1.0, ignore_eos=True)
        http = HttpClient("127.0.0.1", sg_port, token=(OUT / f"sglang-{sg_port}.token").read_text())
        counter = iter(range(10**9))

        expanded = [len(spec.expand(t, spec.grids_of([b]))) for t, b in zip(texts, images, strict=True)]
        seen_prompt_tokens: list[int] = []

        async def direct() -> float:
            t = time.perf_counter()
            outs = await asyncio.gather(*(http.request("POST", "/generate", generate_body(
                ids, sp, rid=sample_rid("directvl", next(counter), 0, 0), index=0, image_data=[uri])) for ids, uri in zip(sent, uris, strict=True)))
            dt = time.perf_counter() - t
            seen_prompt_tokens[:] = [int((o.get("meta_info") or {}).get("prompt_tokens") or 0) for o in outs]
            return sum(len(parse_generate_response(o).output_ids) for o in outs) / dt

        def prompts(sampling: SamplingParams) -> list[Prompt]:
            return [Prompt(prompt_id=new_prompt_id(), input_ids=np.asarray(t, dtype=np.int32), sampling=sampling,
                           images=(PromptImage(data=b),)) for t, b in zip(texts, images, strict=True)]

        timelines: list[dict[str, float]] = []

        async def pool() -> tuple[float, list[Any]]:
            t, t0 = time.perf_counter(), time.time()
            res = await client.submit(prompts(sp))
            if res.rejected:
                raise RuntimeError(f"rejected: {list(res.rejected.values())[:3]}")
            # no timeout: a prompt the worker fails (an image SGLang expands otherwise) raises UnfillableBatchError at
            # once, with the reasons, instead of the call waiting out a timeout while the device call runs out
            try:
                batch = await client.get_batch(len(images), max_staleness=1000)
            except UnfillableBatchError as exc:
                ended = [f"{g.state}: {g.reason}" for g in await client.take_ended()]
                raise RuntimeError(f"{len(ended)} prompts ended otherwise ({ended[:2]}): {exc}") from exc
            dt = time.perf_counter() - t
            tr = batch.trajectories
            # where the wall time went (one host, one clock): submit -> the engine took the first and the last prompt
            # (its image checks done), the last sample done, the batch in hand
            timelines.append({"first_started_s": round(min(x.started_at for x in tr) - t0, 3),
                              "last_started_s": round(max(x.started_at for x in tr) - t0, 3),
                              "last_finished_s": round(max(x.finished_at for x in tr) - t0, 3), "batch_in_hand_s": round(dt, 3)})
            return sum(len(x.output_ids) for x in tr) / dt, list(tr)

        await direct()  # warm-up
        # SGLang's prompt_tokens is the prompt as its model ran it: with the image seen, the expanded length the pool
        # reports; a prompt run without its image has one image token (SGLang never got image_data)
        RESULT["images_reached_sglang"] = seen_prompt_tokens == expanded
        RESULT["direct_prompt_tokens_seen"] = sorted(set(seen_prompt_tokens))[:5]
        RESULT["expanded_prompt_tokens"] = sorted(set(expanded))[:5]
        note(f"SGLang ran prompts of {RESULT['direct_prompt_tokens_seen']} tokens; the expanded ids have {RESULT['expanded_prompt_tokens']}")
        save()
        d_runs, p_runs = [], []
        trajs: list[Any] = []
        for i in range(args.pairs):
            d_runs.append(await direct())
            rate, trajs = await pool()
            p_runs.append(rate)
            note(f"pair {i}: direct {d_runs[-1]:.0f} tok/s, pool {p_runs[-1]:.0f} tok/s")
            stage.update(direct_runs=d_runs, pool_runs=p_runs, pool_timelines=timelines)
            save()
        RESULT["direct_tokens_per_s"] = round(statistics.median(d_runs), 1)
        RESULT["pool_tokens_per_s"] = round(statistics.median(p_runs), 1)
        RESULT["pool_vs_direct"] = round(statistics.median(p_runs) / statistics.median(d_runs), 4)
        RESULT["pool_vs_direct_pairwise_median"] = round(statistics.median(p / d for p, d in zip(p_runs, d_runs, strict=True)), 4)
        RESULT["throughput_workload"] = {"prompts": len(images), "prompt_text_tokens": args.prompt_tokens, "images_per_prompt": 1,
                                         "image_px": args.image_px, "output_tokens": args.out_tokens, "pairs": args.pairs}
        hashes = {hashlib.sha256(b).hexdigest() for b in images}
        stage["trajectories_with_image_hash"] = sum(1 for t in trajs if len(t.image_sha256) == 1 and t.image_sha256[0] in hashes)
        save()

        # versions with images: publish version 1 (the same tensors) while a long batch generates
        sd = load_file(str(model / "model.safetensors"))
        long_sp = SamplingParams(max_new_tokens=args.long_tokens, temperature=1.0, ignore_eos=True)
        await client.submit(prompts(long_sp))
        await asyncio.sleep(1.0)
        await client.publish_weights(sd, 1)
        batch = await client.get_batch(len(images), max_staleness=1000)
        bad, spanning = 0, 0
        for t in batch.trajectories:
            v = t.token_versions.tolist()
            grid = t.image_grid_thw.tolist() if t.image_grid_thw is not None else []
            expect = grid[0] * grid[1] * grid[2] // (spec.merge * spec.merge) if len(grid) == 3 else -1
            ok = (v == sorted(v) and set(v) <= {0, 1} and len(t.image_sha256) == 1 and t.image_sha256[0] in hashes
                  and t.input_ids.tolist().count(spec.image_id) == expect)
            bad += not ok
            spanning += len(set(v)) == 2
        RESULT["versions_exact"] = bad == 0
        stage.update(version_trajectories=len(batch.trajectories), version_bad=bad, version_spanning=spanning)
        note(f"versions: {len(batch.trajectories)} trajectories, {spanning} span the update, {bad} bad")
        save()
    finally:
        with contextlib.suppress(Exception):
            await client.close()
        _stop(worker)
        _stop(broker)


def main() -> int:
    global OUT, RESULT_NAME
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--work", default="/tmp/gpu_vlm")
    ap.add_argument("--result-name", default="h100-vlm.json")
    ap.add_argument("--dry-run", action="store_true", help="parse, build the model and images, write the JSON; no GPU, no SGLang")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=64, help="text tokens per prompt (beside the image's)")
    ap.add_argument("--image-px", type=int, default=224, help="side of each square image (the tiny model's processor resizes "
                                                                "to at most 112x112: 16 image tokens)")
    ap.add_argument("--out-tokens", type=int, default=512)
    ap.add_argument("--long-tokens", type=int, default=1200)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--capacity", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    args = ap.parse_args()
    OUT = Path(args.out)
    RESULT_NAME = args.result_name
    OUT.mkdir(parents=True, exist_ok=True)
    RESULT["dry_run"] = args.dry_run
    if not args.dry_run:
        sys.path.insert(0, str(ROOT / ".sgkit"))
        import smoke  # the kit's environment recipe: CUDA_HOME, JIT caches, multicast off

        smoke.setup_env()
    import torch

    RESULT["machine"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    with contextlib.suppress(Exception):
        import sglang

        RESULT["sglang"] = sglang.__version__
    with contextlib.suppress(Exception):
        RESULT["commit"] = (ROOT / ".commit").read_text().strip()
    t = time.time()
    model, images = build(Path(args.work), args)
    RESULT["model"] = {"arch": "qwen2_vl", "hidden": args.hidden, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
                       "vocab": args.vocab, "vision": "1 block, embed 32", "build_s": round(time.time() - t, 1)}
    save()
    note(f"model and {len(images)} images built")
    from rollpool.workers.engines.vision import load_vision_spec

    spec = load_vision_spec(model)  # what the worker does with each image prompt: grids, then the ids it reports
    assert spec is not None
    _pixels, grids = spec.grids(images[:2])
    RESULT["image_tokens_per_image"] = spec.expand([7], grids[:1]).count(spec.image_id)
    RESULT["image_processor"] = type(spec.processor).__name__
    save()
    if not args.dry_run:
        try:
            asyncio.run(pool_stage(model, images, args))
        except Exception as exc:  # noqa: BLE001 - recorded, then the partial JSON stands
            RESULT["stages"].setdefault("pool", {})["error"] = f"{type(exc).__name__}: {exc}"[:3000]
            note(f"pool stage failed: {exc!r}")
    RESULT["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
