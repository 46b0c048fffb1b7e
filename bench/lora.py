"""LoRA adapter versions on the weight channel: publish to applied, and how long the trainer is blocked.

One process: a `WeightPublisher` (the trainer side) and a `WeightSubscriber` (the worker side, network path
over tcp loopback unless ``--path``) with a `LoraBank` on a skeleton of the base model's Linear layers (built on
the ``meta`` device: no base weights are allocated, the bank checks names and shapes against it as the hf engine
does). Per version, timed: ``publish()`` returning (`lora_trainer_blocked_s`: the trainer may step then), and
publish start to the adapter resident in the bank on ``--device`` in ``--dtype`` (`lora_publish_to_applied_s`:
announce, fetch, verify, copy into the bank). Medians of ``--versions`` after ``--warmup``.

The 8B shape (default): 32 layers, hidden 4096, 8 KV heads of 128, MLP 14336; rank 16 on every attention and MLP
projection (q, k, v, o, gate, up, down): 42 M parameters, 84 MB in bf16 per version.

``--full``: the same run, side by side, with whole-model versions of the same shape (every targeted projection's
weight, in ``--dtype``, copied into the base's tensors on arrival): bytes per version and the same two times, and
the ratios. ``--demo-shape``: the shape of `rollpool demo --lora` (2 layers, hidden 64, MLP 256, rank 8).

`pool_vs_direct` (SGLang tokens/s with the adapter active, pool vs direct) is bench/gpu_lora.py's (a GPU and
SGLang); this JSON keeps it null, saying so.

    python bench/lora.py [--layers 32] [--hidden 4096] [--kv 1024] [--mlp 14336] [--rank 16] [--versions 10]
                         [--warmup 2] [--device cuda|cpu] [--dtype bfloat16] [--path network|auto|shm] [--json PATH]
                         [--pin auto|on|off] [--compare ROUNDS --compare-what copies|plan|checksums|pinned|checksums+pinned]

The subscriber's receive buffers are page-locked when the bank is on CUDA (``--pin auto``), as a worker's are (its
engine on a GPU); before 2026-12-06 this bench left them pageable, so its bank copy ran at pageable speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FOLD = {"auto": None, "always": True, "never": False}
COMPARE_WHAT = ("copies", "plan", "checksums", "pinned", "checksums+pinned")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--kv", type=int, default=1024, help="k/v projection width (KV heads x head dim)")
    ap.add_argument("--mlp", type=int, default=14336)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--versions", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default=None, help="the bank's device (default: cuda when available)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--path", default="network", choices=("network", "auto", "shm"))
    ap.add_argument("--full", action="store_true", help="also whole-model versions of the same shape, side by side")
    ap.add_argument("--demo-shape", action="store_true", help="rollpool demo --lora's model: 2 layers, hidden 64, MLP 256, rank 8")
    ap.add_argument("--bucket-mb", type=float, default=None, help="the publisher's bucket_bytes in MiB (default: its own)")
    ap.add_argument("--compare", type=int, default=0, metavar="ROUNDS",
                    help="ROUNDS alternating runs of the previous snapshot and bank copies (one job and one copy per matrix) "
                         "and the current ones (matrices batched into copy jobs of up to 4 MiB; one copy of each fetched "
                         "bucket into the bank), medians and ratios side by side")
    ap.add_argument("--compare-what", default="copies", choices=COMPARE_WHAT,
                    help="--compare's arms: copies (above); plan: every version planned and its adapter checked (before) "
                         "against the previous version's plan and check reused when the names and shapes are the same (after); "
                         "checksums: each bucket summed whole after its last copy lands (before) against folded as its copies "
                         "land (after); pinned: the subscriber's receive buffers pageable (before) against page-locked, as a "
                         "worker on a GPU has them (after; the same on a CPU: nothing is page-locked without CUDA); "
                         "checksums+pinned: both changes together")
    ap.add_argument("--fold", default="auto", choices=("auto", "always", "never"),
                    help="the publisher folds each bucket's checksum as its copies land: auto (where that overlaps the copies: "
                         "CUDA tensors, or a core to spare beyond the copy threads), always, never; with --compare-what "
                         "checksums it is the after arm's (the before arm never folds)")
    ap.add_argument("--pin", default="auto", choices=("auto", "on", "off"),
                    help="the subscriber's receive buffers page-locked (auto: when the bank is on CUDA, as a worker's are)")
    ap.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (1: a shared 2-core box's copies are "
                    "not slowed by threads spinning for cores they do not get)")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def shapes(a: argparse.Namespace) -> dict[str, tuple[int, int]]:
    """Module path -> (in, out) of every targeted projection of the shape."""
    io = {"q_proj": (a.hidden, a.hidden), "k_proj": (a.hidden, a.kv), "v_proj": (a.hidden, a.kv), "o_proj": (a.hidden, a.hidden),
          "gate_proj": (a.hidden, a.mlp), "up_proj": (a.hidden, a.mlp), "down_proj": (a.mlp, a.hidden)}
    out = {}
    for i in range(a.layers):
        for m, dims in io.items():
            out[f"model.layers.{i}.{'self_attn' if m in TARGETS[:4] else 'mlp'}.{m}"] = dims
    return out


async def run(a: argparse.Namespace) -> dict[str, Any]:
    if a.demo_shape:
        a.layers, a.hidden, a.kv, a.mlp, a.rank = 2, 64, 64, 256, 8
    from rollpool.weights import snapshot

    snapshot._FOLD_CHECKSUMS = _FOLD[a.fold]
    if a.compare:
        return await compare(a)
    lora = await run_one(a, full=False)
    if not a.full:
        return lora
    full = await run_one(a, full=True)
    return {**lora, "full": full, "full_vs_adapter_bytes": full["version_bytes"] / lora["version_bytes"],
            "full_vs_adapter_publish_to_applied": full["publish_to_applied_s"] / lora["lora_publish_to_applied_s"],
            "full_vs_adapter_trainer_blocked": full["trainer_blocked_s"] / lora["lora_trainer_blocked_s"]}


async def compare(a: argparse.Namespace) -> dict[str, Any]:
    """The previous copies against the current ones, alternating rounds in one process (module docstring)."""
    from rollpool.weights import snapshot
    from rollpool.workers.engines import lora

    batch_bytes, span, memo, fold, pin = snapshot._BATCH_BYTES, lora._SPAN_COPY, snapshot._MEMO_PLAN, snapshot._FOLD_CHECKSUMS, a.pin
    arms: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    try:
        for r in range(a.compare):
            for arm in (("before", "after") if r % 2 == 0 else ("after", "before")):  # neither arm always second
                after = arm == "after"
                if a.compare_what == "plan":  # before: every version planned and its adapter checked from scratch
                    snapshot._MEMO_PLAN = after
                elif a.compare_what in ("checksums", "pinned", "checksums+pinned"):
                    if "checksums" in a.compare_what:  # before: each bucket summed whole after its last copy
                        snapshot._FOLD_CHECKSUMS = _FOLD[a.fold] if after else False
                    if "pinned" in a.compare_what:  # before: pageable receive buffers (what this bench had before)
                        a.pin = "auto" if after else "off"
                else:  # before: every matrix its own copy job (a thread hop each) and its own copy into the bank
                    snapshot._BATCH_BYTES, lora._SPAN_COPY = (0, False) if arm == "before" else (batch_bytes, span)
                arms[arm].append(await run_one(a, full=False))
    finally:
        snapshot._BATCH_BYTES, lora._SPAN_COPY, snapshot._MEMO_PLAN, snapshot._FOLD_CHECKSUMS, a.pin = batch_bytes, span, memo, fold, pin
    out: dict[str, Any] = {k: v for k, v in arms["after"][0].items() if not k.startswith(("lora_", "phases"))}
    keys = ("lora_publish_to_applied_s", "lora_trainer_blocked_s")
    for arm, runs in arms.items():
        out[arm] = {k: statistics.median(x for r in runs for x in r["samples"][k]) for k in keys}
        out[arm]["receive_pinned"], out[arm]["checksums_folded"] = runs[0]["receive_pinned"], runs[0]["checksums_folded"]
        out[arm]["phases_median_s"] = {p: statistics.median(r["phases_median_s"][p] for r in runs)
                                       for p in runs[0]["phases_median_s"]}
        ph = out[arm]["phases_median_s"]
        # where publish to applied goes (medians of each phase's time from publish's call)
        out[arm]["profile_s"] = {"snapshot_copy_trainer_blocked": ph["returned"], "checksums_after_return": ph["checksummed"] - ph["returned"],
                                 "manifest_chunks_and_verify": ph["fetched"] - ph["checksummed"], "bank_copy": ph["applied"] - ph["fetched"]}
    for k in keys:
        out[k] = out["after"][k]
        out[f"{k}_after_vs_before"] = out["after"][k] / out["before"][k]
    out["rounds"] = a.compare
    out["compare_what"] = a.compare_what
    return out


async def run_one(a: argparse.Namespace, *, full: bool) -> dict[str, Any]:
    import torch
    import zmq.asyncio

    from rollpool.protocol.sockets import SocketFactory
    from rollpool.weights.adapters import adapter_spec
    from rollpool.weights.publisher import WeightPublisher
    from rollpool.weights.subscriber import WeightSubscriber
    from rollpool.workers.engines.lora import LoraBank

    torch.set_num_threads(a.threads)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, a.dtype)
    dims = shapes(a)
    with torch.device("meta"):
        skeleton = torch.nn.Module()
        for path, (i, o) in dims.items():
            parent = skeleton
            parts = path.split(".")
            for p in parts[:-1]:
                if not hasattr(parent, p):
                    parent.add_module(p, torch.nn.Module())
                parent = getattr(parent, p)
            parent.add_module(parts[-1], torch.nn.Linear(i, o, bias=False))
    bank = LoraBank(skeleton, resident=4, max_rank=max(64, a.rank))  # the hf engine's default lora_resident
    spec = adapter_spec(a.rank, 2 * a.rank, TARGETS, base_model=f"{a.layers}x{a.hidden}")
    src_device = device if device != "cpu" else "cpu"
    named = {}
    base: dict[str, Any] = {}
    for path, (i, o) in dims.items():
        if full:
            named[f"{path}.weight"] = torch.randn(o, i, dtype=dtype, device=src_device) * 0.01
            base[f"{path}.weight"] = torch.empty(o, i, dtype=dtype, device=device)
            continue
        named[f"base_model.model.{path}.lora_A.weight"] = torch.randn(a.rank, i, dtype=dtype, device=src_device) * 0.01
        named[f"base_model.model.{path}.lora_B.weight"] = torch.zeros(o, a.rank, dtype=dtype, device=src_device)
    nbytes = sum(t.numel() * t.element_size() for t in named.values())
    ctx = zmq.asyncio.Context()
    sockets = SocketFactory(ctx)
    extra = {} if a.bucket_mb is None else {"bucket_bytes": int(a.bucket_mb * 2**20)}
    pub = WeightPublisher(sockets, keep_versions=2, path=a.path, **extra)
    await pub.start()
    # a worker's subscriber has page-locked receive buffers when its engine is on CUDA (`WeightSync._make_subscriber`)
    pin = a.pin == "on" or (a.pin == "auto" and str(device).startswith("cuda"))
    sub = WeightSubscriber(sockets, worker_id="bench", path=a.path, pin_memory=pin)
    sub.connect(pub.router_endpoint, pub.pub_endpoint)
    blocked, applied = [], []
    phases: list[dict[str, float]] = []
    try:
        for v in range(1, a.versions + a.warmup + 1):
            for t in named.values():
                t.add_(1e-3)  # a training step changed the adapter
            if src_device != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            await pub.publish(named, v, adapter=None if full else spec)
            t1 = time.perf_counter()
            marks = {k: round(at, 4) for k, at in pub.last_phases.items()}
            fin = pub._finishing.get(v)
            if fin is not None:
                fin.add_done_callback(lambda _f, m=marks, t0=t0: m.__setitem__("checksummed", round(time.perf_counter() - t0, 4)))
            wv = await sub.fetch(v)
            marks["fetched"] = round(time.perf_counter() - t0, 4)
            if full:
                for name, t in wv.tensors.items():
                    base[name].copy_(t)  # the engine's copy into its weights
            else:
                assert wv.manifest.adapter == spec
                bank.add(v, wv.tensors, spec, dtype=dtype, device=device)
            if device != "cpu":
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            marks["applied"] = round(t2 - t0, 4)
            sub.recycle(wv)
            bank.evict(())
            if v > a.warmup:
                blocked.append(t1 - t0)
                applied.append(t2 - t0)
                phases.append(marks)
    finally:
        sub.close()
        await pub.close()
        ctx.term()
    if full:
        return {"version_bytes": nbytes, "publish_to_applied_s": statistics.median(applied),
                "trainer_blocked_s": statistics.median(blocked), "what": "every targeted projection's weight, whole"}
    return {
        "version_bytes": nbytes,
        "shape": {"layers": a.layers, "hidden": a.hidden, "kv": a.kv, "mlp": a.mlp, "rank": a.rank, "targets": list(TARGETS)},
        "adapter_bytes": nbytes, "device": device, "dtype": a.dtype, "path": a.path, "versions": a.versions,
        "receive_pinned": sub.pin_memory, "checksums_folded": _folded(),
        "lora_publish_to_applied_s": statistics.median(applied), "lora_publish_to_applied_s_range": [min(applied), max(applied)],
        "lora_trainer_blocked_s": statistics.median(blocked), "lora_trainer_blocked_s_range": [min(blocked), max(blocked)],
        "pool_vs_direct": None,
        "pool_vs_direct_note": "measured by bench/gpu_lora.py (SGLang on a GPU), not here",
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "bucket_bytes": pub.bucket_bytes,
        "samples": {"lora_publish_to_applied_s": applied, "lora_trainer_blocked_s": blocked},
        "phases_median_s": {k: statistics.median(p[k] for p in phases if k in p) for k in sorted({k for p in phases for k in p})},
    }


def _folded() -> str:
    from rollpool.weights import snapshot

    return {None: "auto", True: "always", False: "never"}[snapshot._FOLD_CHECKSUMS]


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    result = asyncio.run(run(a))
    text = json.dumps(result, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
