"""Adapter versions across a pool: publish to applied on every worker, with and without the apply slot, side by side.

A real broker (a child process, rolling activation, ``--max-applying`` slots, default 1), ``--workers`` hf workers (tiny
random-init model, `build_tiny_model`) and a `TrainerClient` here that publishes LoRA adapter versions (rank
``--rank`` on every attention and MLP projection, PEFT names). Rounds alternate the two arms on the same workers:

* ``slot`` (before protocol 1.21): each worker asks for an apply slot (ApplyRequest -> ApplyGrant) before it applies an
  adapter version, so with ``max_applying=1`` the workers apply one after another;
* ``no_slot`` (1.21, `Feature.ADAPTER_NO_GRANT` in the broker's Welcome): the hf engine serves adapter versions without
  a pause, so each worker applies as soon as it fetched, and reports it (ApplyDone).

The ``slot`` arm is this build's worker told to ask anyway (`WeightSync.adapters_need_grant`), which is what a worker
did before. Per version: from the publish call until the last worker serves it (`publish_to_all_applied_s`, read off
the workers in this process every 2 ms) and until the first does. Medians per arm after ``--warmup`` rounds, and the
ratio. ``--load`` keeps each worker generating (one sample of 64 tokens in flight per worker) while versions land.

    python bench/lora_pool.py [--workers 4] [--versions 6] [--warmup 1] [--rank 8] [--hidden 64] [--layers 2]
                              [--max-applying 1] [--load] [--json PATH]

On the shared 2-core box the broker, the workers and the client share two cores: the times are of that box; the
side-by-side ratio is the claim.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--versions", type=int, default=6, help="versions per arm (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=1, help="versions per arm not counted")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=64, help="the tiny model's hidden size (MLP 4x)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--max-applying", type=int, default=1)
    ap.add_argument("--load", action="store_true", help="keep one 64-token sample per worker in flight")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def _adapter(model_dir: Path, rank: int, seed: int) -> tuple[dict[str, Any], Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from rollpool.protocol.fingerprint import model_fingerprint
    from rollpool.weights.adapters import adapter_spec

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    named: dict[str, Any] = {}
    for path, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and path.rsplit(".", 1)[-1] in TARGETS:
            named[f"base_model.model.{path}.lora_A.weight"] = torch.randn(rank, mod.in_features, generator=g) * 0.1
            named[f"base_model.model.{path}.lora_B.weight"] = torch.randn(mod.out_features, rank, generator=g) * 0.1
    return named, adapter_spec(rank, 2 * rank, TARGETS, base_fingerprint=model_fingerprint(model_dir), base_model="tiny")


def _spawn_broker(bw: str, bc: str, max_applying: int, log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "rollpool.cli", "--log-level", "WARNING", "broker", "--worker-endpoint", bw, "--client-endpoint", bc,
             "--activation", "rolling", "--max-applying", str(max_applying), "--heartbeat-interval-s", "0.2"],
            stdout=out, stderr=subprocess.STDOUT)


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import zmq.asyncio

    from rollpool.protocol import Prompt, SamplingParams
    from rollpool.protocol.sockets import SocketFactory
    from rollpool.trainer_client.client import TrainerClient, TrainerClientConfig
    from rollpool.workers.config import WorkerConfig
    from rollpool.workers.engines.hf import HFEngine
    from rollpool.workers.engines.tiny_model import build_tiny_model
    from rollpool.workers.worker import Worker

    model_dir = tmp / "tiny"
    build_tiny_model(model_dir, hidden=args.hidden, layers=args.layers, intermediate=4 * args.hidden)
    bw, bc = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}"
    broker = _spawn_broker(bw, bc, args.max_applying, tmp / "broker.log")
    ctx = zmq.asyncio.Context()
    sockets = SocketFactory(ctx)
    workers = [Worker(WorkerConfig(broker=bw, worker_id=f"lp{i}", engine="hf", model=str(model_dir), heartbeat_interval_s=0.2,
                                   apply_mode="interrupt"),
                      sockets, engine_factory=lambda: HFEngine(model=str(model_dir), capacity=4, num_threads=1))
               for i in range(args.workers)]
    need_grant = [w.weights.adapters_need_grant for w in workers]
    runs = [asyncio.create_task(w.run()) for w in workers]
    client = TrainerClient(config=TrainerClientConfig(broker=bc, client_id="lora-pool", pull_wait_s=0.2))
    rows: dict[str, list[dict[str, float]]] = {"slot": [], "no_slot": []}
    loader: asyncio.Task[None] | None = None
    loaded = [0]
    adapter_bytes = 0
    try:
        await client.connect()
        for _ in range(600):
            st = await client.status()
            if st["counters"].get("workers_alive", 0) >= args.workers:
                break
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError(f"only {st['counters'].get('workers_alive')} of {args.workers} workers joined")
        if args.load:
            async def load() -> None:
                n = 0
                while True:
                    prompts = [Prompt(prompt_id=f"l{n + i}", input_ids=[3, 4, 5, i % 50], group_size=1,
                                      sampling=SamplingParams(max_new_tokens=64, ignore_eos=True)) for i in range(args.workers)]
                    n += args.workers
                    await client.submit(prompts)
                    for _ in prompts:
                        try:
                            await client.get_batch(1, timeout=30)
                        except TimeoutError:
                            break
                        loaded[0] += 1
            loader = asyncio.create_task(load())
        version = 0
        for i in range(args.warmup + args.versions):
            for arm in ("slot", "no_slot") if i % 2 == 0 else ("no_slot", "slot"):
                for w, own in zip(workers, need_grant, strict=True):
                    w.weights.adapters_need_grant = (lambda: True) if arm == "slot" else own
                version += 1
                named, spec = _adapter(model_dir, args.rank, version)
                adapter_bytes = sum(int(t.numel()) * t.element_size() for t in named.values())
                asks_before = sum(w.weights.grants_skipped for w in workers)
                t0 = time.monotonic()
                await client.publish_weights(named, version, adapter=spec)
                first = None
                while True:
                    at = [w.session.version for w in workers]
                    if first is None and max(at) >= version:
                        first = time.monotonic() - t0
                    if min(at) >= version:
                        break
                    if time.monotonic() - t0 > 60:
                        raise RuntimeError(f"version {version} not applied on every worker after 60 s: {at}")
                    await asyncio.sleep(0.002)
                last = time.monotonic() - t0
                skipped = sum(w.weights.grants_skipped for w in workers) - asks_before
                if i >= args.warmup:
                    rows[arm].append({"version": version, "publish_to_first_applied_s": round(first or last, 4),
                                      "publish_to_all_applied_s": round(last, 4), "slots_skipped": skipped})
        for _ in range(100):  # the last ApplyDone and this status request travel on two sockets: wait for it
            counters = (await client.status())["counters"]
            if counters.get("versions_converged", 0) >= version:
                break
            await asyncio.sleep(0.05)
        if loader is not None and loader.done():
            loader.result()  # the load died: say why instead of reporting an unloaded run as loaded
    finally:
        if loader is not None:
            loader.cancel()
        await client.close()
        for w in workers:
            w.stop()
        await asyncio.gather(*runs, return_exceptions=True)
        broker.terminate()
        broker.wait(10)
        ctx.destroy(linger=0)

    def med(arm: str, key: str) -> float:
        return round(statistics.median(r[key] for r in rows[arm]), 4)

    out: dict[str, Any] = {
        "bench": "lora_pool", "workers": args.workers, "max_applying": args.max_applying, "rank": args.rank,
        "hidden": args.hidden, "layers": args.layers, "adapter_bytes": adapter_bytes,
        "load": args.load, "versions_per_arm": args.versions, "warmup": args.warmup,
        "obtained": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "slot": {"publish_to_all_applied_s": med("slot", "publish_to_all_applied_s"),
                 "publish_to_first_applied_s": med("slot", "publish_to_first_applied_s"), "rows": rows["slot"]},
        "no_slot": {"publish_to_all_applied_s": med("no_slot", "publish_to_all_applied_s"),
                    "publish_to_first_applied_s": med("no_slot", "publish_to_first_applied_s"), "rows": rows["no_slot"]},
        "broker_versions_converged": counters.get("versions_converged"),
        "load_groups_done": loaded[0],
    }
    out["all_applied_ratio_no_slot_over_slot"] = round(out["no_slot"]["publish_to_all_applied_s"] / out["slot"]["publish_to_all_applied_s"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    with tempfile.TemporaryDirectory() as d:
        out = asyncio.run(run(args, Path(d)))
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
