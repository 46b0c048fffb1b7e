"""The publisher's device diff on one GPU: the Triton kernels (`rollpool.weights.diff_kernel`) against the torch ops they
replace and against the card's limit, byte for byte and in seconds, side by side in one run.

An 8B-shaped model (the layer shapes of ``bench/gpu_weights.py --run 8b``, bf16, 14.5 GB; ``--layers`` fewer) on the
GPU, in the publisher's bucket layout (``--bucket-mib``, 512 as the publisher's default), and two `DeviceBase`s holding
the same previous version: every version, after `sparse_step` (``--fraction`` of the elements changed, 2.15% as AdamW at
lr 1e-6 measured), each base diffs the same tensors, one with the kernels, one with them switched off, in alternating
order. Per path, medians over versions 3..N of:

- ``diff_s``: `DeviceBase.diff`'s wall time (the trainer's wait for a device delta: it returns once its stream is done);
- ``compare_s`` / ``encode_s``: its buckets' timings summed (the bench's ``delta_compare_s`` / ``delta_encode_s``);
- ``limit_s``: one read of the new version's and the base's bytes (``torch.sum`` of their int64 words): what any
  compare must at least read;

``all_equal``: every bucket's encoding, count and payload bytes (on the host) are the same from both paths, and both
bases equal the model after each version. ``kernels_ran``: the kernels compared every bucket of the kernel row (a run
where they were switched off reports no figure for them). ``kernels_vs_torch`` = torch diff_s / kernel diff_s.

Run on the device inside ``bench/gpu_batch.sh``: ``python3 bench/gpu_diff_kernel.py --out $STEP``. ``--smoke`` runs a
tiny model on the CPU with the kernels in Triton's interpreter (set ``TRITON_INTERPRET=1``): the code path only, no
figure (the tests run it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE_8B = {"vocab": 32000, "hidden": 4096, "layers": 32, "intermediate": 14336, "heads": 32, "kv_heads": 8}


def model(shape: dict[str, int], layers: int, device: Any) -> dict[str, Any]:
    """A state dict of `layers` decoder layers of `shape` (bf16, random), as a trainer's parameters."""
    import torch

    h, inter, kv = shape["hidden"], shape["intermediate"], shape["hidden"] // shape["heads"] * shape["kv_heads"]
    g = torch.Generator(device=device).manual_seed(0)

    def t(*dims: int) -> Any:
        return (torch.randn(*dims, generator=g, device=device) * 0.02).to(torch.bfloat16)

    sd = {"embed.weight": t(shape["vocab"], h)}
    for i in range(layers):
        p = f"layers.{i}."
        sd.update({p + "q.weight": t(h, h), p + "k.weight": t(kv, h), p + "v.weight": t(kv, h), p + "o.weight": t(h, h),
                   p + "gate.weight": t(inter, h), p + "up.weight": t(inter, h), p + "down.weight": t(h, inter),
                   p + "norm1.weight": t(h), p + "norm2.weight": t(h)})
    sd.update({"norm.weight": t(h), "lm_head.weight": t(shape["vocab"], h)})
    return sd


def differing(views: list[tuple[str, Any]], items: list[tuple[str, Any]]) -> dict[str, int]:
    """The tensors of `views` whose bytes are not those of `items`' (same order), each with how many bytes differ."""
    import torch

    from rollpool.weights.bucketing import flat_bytes

    return {name: int((flat_bytes(view) != flat_bytes(t)).sum())
            for (name, view), (_m, t) in zip(views, items, strict=True) if not torch.equal(flat_bytes(view), flat_bytes(t))}


def sparse_step(sd: dict[str, Any], v: int, fraction: float) -> None:
    """`fraction` of each bf16 tensor's elements move by one in their 16-bit pattern (`bench/gpu_weights.py`'s step)."""
    import torch

    with torch.no_grad():
        for t in sd.values():
            g = torch.Generator(device=t.device).manual_seed(v * 7919 + t.numel() % 7919)
            w = t.view(torch.int16).view(-1)
            mask = torch.rand(w.shape, generator=g, device=w.device) < fraction
            w.add_(mask.to(torch.int16), alpha=1 if v % 2 else -1)


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--result-name", default="")
    ap.add_argument("--versions", type=int, default=7)
    ap.add_argument("--layers", type=int, default=SHAPE_8B["layers"])
    ap.add_argument("--bucket-mib", type=int, default=512)
    ap.add_argument("--fraction", type=float, default=0.0215)
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, kernels interpreted: the code path only")
    args = ap.parse_args()

    import torch

    from rollpool.weights import diff_kernel
    from rollpool.weights.delta_device import DeviceBase
    from rollpool.weights.manifest import GpuBudget
    from rollpool.weights.snapshot import plan_version

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        dev = torch.device("cpu")
        shape = {"vocab": 512, "hidden": 64, "layers": 2, "intermediate": 128, "heads": 4, "kv_heads": 2}
        layers, bucket_bytes, name, card = 2, 64 << 10, "cpu (Triton interpreter)", "cpu"
        diff_kernel.usable = lambda device: diff_kernel.enabled()  # (the interpreter runs them on CPU tensors)
    else:
        dev = torch.device("cuda")
        shape, layers, bucket_bytes = SHAPE_8B, args.layers, args.bucket_mib << 20
        name = torch.cuda.get_device_name(dev)
        card = "h200" if "H200" in name else "h100" if "H100" in name else "gpu"
    result_path = out / (args.result_name or f"{card}-diff-kernel.json")
    result: dict[str, Any] = {"bench": "gpu_diff_kernel", "device": name, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                              "torch": torch.__version__, "simulated": False, "smoke": args.smoke,
                              "params": vars(args), "versions": []}
    try:
        import triton
        result["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        result["triton"] = f"not importable: {e}"

    def save() -> None:
        result_path.write_text(json.dumps(result, indent=1))

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    t0 = time.perf_counter()
    sd = model(shape, layers, dev)
    items, places, planner = plan_version(sd, bucket_bytes, None)
    assert places is not None
    from rollpool.protocol.messages import BucketInfo

    infos = tuple(BucketInfo(index=b.index, dtype=b.dtype, nbytes=b.nbytes, checksum="", tensors=tuple(b.tensors)) for b in planner.buckets)
    model_bytes = sum(b.nbytes for b in infos)
    wholes = [torch.empty(0, dtype=torch.uint8) for _ in infos]  # (a whole bucket's payload is the caller's host buffer: not read here)
    result.update(model_bytes=model_bytes, buckets=len(infos), build_s=round(time.perf_counter() - t0, 2))
    kernels_on = diff_kernel.usable(dev)
    result["kernels_on_after_self_check"] = kernels_on
    result["kernels_off_reason"] = diff_kernel._off
    save()
    if not kernels_on:
        result["reading"] = "the diff kernels did not run here: nothing measured of them (see kernels_off_reason)"
        save()
        return 1

    bases = {"kernels": DeviceBase(GpuBudget(1 << 40)), "torch": DeviceBase(GpuBudget(1 << 40))}
    calls = {"n": 0}
    count = diff_kernel.count_changed

    def counting(pieces: Any) -> Any:
        calls["n"] += 1
        return count(pieces)

    diff_kernel.count_changed = counting

    def run(path: str, v: int) -> tuple[float, list[Any]]:
        saved = diff_kernel._off
        diff_kernel._off = None if path == "kernels" else "the bench's torch row"
        try:
            sync()
            t = time.perf_counter()
            made = bases[path].diff(v, infos, places, items, wholes)
            wall = time.perf_counter() - t
            got = [d.wait() for d in made] if made is not None else []
            bases[path].payload_host.warm_for(bases[path].payload_sizes)  # as the publisher does once a version landed
            bases[path].payload_host.join()
            return wall, got
        finally:
            diff_kernel._off = saved

    all_equal = True
    for v in range(1, args.versions + 1):
        if v > 1:
            sparse_step(sd, v, args.fraction)
        sync()
        order = ["kernels", "torch"] if v % 2 else ["torch", "kernels"]
        before = calls["n"]
        rec: dict[str, Any] = {"version": v, "order": order}
        got: dict[str, list[Any]] = {}
        for path in order:
            wall, got[path] = run(path, v)
            rec[f"{path}_diff_s"] = round(wall, 4)
            rec[f"{path}_compare_s"] = round(sum(d.timings.get("compare_s", 0.0) for d in got[path]), 4)
            rec[f"{path}_encode_s"] = round(sum(d.timings.get("encode_s", 0.0) for d in got[path]), 4)
        rec["kernel_calls"] = calls["n"] - before
        if v > 1:
            same = len(got["kernels"]) == len(got["torch"]) == len(infos) and all(
                (a.encodings, a.changed_elements) == (b.encodings, b.changed_elements)
                and (a.payloads[0] is None) == (b.payloads[0] is None)
                and (a.payloads[0] is None or bytes(a.payloads[0].cpu().numpy()) == bytes(b.payloads[0].cpu().numpy()))
                for a, b in zip(got["kernels"], got["torch"], strict=False))
            rec["changed_fraction"] = round(sum(d.changed_elements for d in got["torch"]) / max(1, sum(d.total_elements for d in got["torch"])), 5)
            rec["equal"] = same
            all_equal &= same
        for path, base in bases.items():
            views = base.views(places)
            # compared byte for byte (`torch.equal` on bf16 values says a NaN differs from itself, and the step makes a
            # few), as soon as the diff returned and again once the device is idle: a tensor that differs only in the
            # first was read before the base's writes landed, one in both is a wrong base
            early = differing(views, items)
            sync()
            wrong = differing(views, items)
            ok = not wrong
            rec[f"{path}_base_is_the_model"] = ok
            if early or wrong:
                rec[f"{path}_base_differs"] = {"before_sync": len(early), "after_sync": len(wrong), "tensors": len(items),
                                               "first": dict(list((wrong or early).items())[:4])}
            all_equal &= ok
        result["versions"].append(rec)
        result["all_equal"] = all_equal
        save()
        print(json.dumps(rec), flush=True)

    # the limit: one read of the new version's bytes and one of a base's
    arena = bases["torch"].arena
    assert arena is not None

    def read_both() -> float:
        sync()
        t = time.perf_counter()
        acc = torch.zeros((), dtype=torch.int64, device=dev)
        for _n, x in items:
            acc += x.view(torch.int16).sum(dtype=torch.int64)
        acc += arena[: arena.numel() // 8 * 8].view(torch.int64).sum()
        int(acc.item())  # (one sync: the reads are done)
        return time.perf_counter() - t

    limit = statistics.median(read_both() for _ in range(3))
    steady = [r for r in result["versions"] if r["version"] >= 3]
    kernels_ran = all(r["kernel_calls"] == len(infos) for r in result["versions"] if r["version"] > 1) and diff_kernel._off is None

    def med(key: str) -> float | None:
        vals = [r[key] for r in steady if r.get(key) is not None]
        return round(statistics.median(vals), 4) if vals else None

    summary: dict[str, Any] = {"kernels_ran": kernels_ran, "limit_s": round(limit, 4), "all_equal": all_equal,
                               "changed_fraction": med("changed_fraction")}
    for path in ("kernels", "torch"):
        summary[path] = {k: med(f"{path}_{k}") for k in ("diff_s", "compare_s", "encode_s")}
    k_s, t_s = summary["kernels"]["diff_s"], summary["torch"]["diff_s"]
    if args.smoke:
        summary["kernels_vs_torch"] = None
        summary["why_not_measured"] = "smoke: a tiny model on the CPU with the kernels in Triton's interpreter (the code path only)"
    elif kernels_ran and k_s and t_s:
        summary["kernels_vs_torch"] = round(t_s / k_s, 2)
        summary["kernels_vs_limit"] = round(k_s / limit, 2) if limit else None
    else:
        summary["kernels_vs_torch"] = None
        summary["why_not_measured"] = "the kernels did not compare every bucket (switched off or not called)"
    result["summary"] = summary
    label = " (smoke: CPU, interpreted; not a figure)" if args.smoke else ""
    result["reading"] = (f"diff of {model_bytes / 1e9:.1f} GB in {len(infos)} buckets at {summary['changed_fraction']} changed: kernels "
                         f"{k_s} s, torch {t_s} s, limit {summary['limit_s']} s; equal: {all_equal}{label}")
    save()
    print(json.dumps(summary, indent=1))
    return 0 if all_equal and kernels_ran else 2


if __name__ == "__main__":
    raise SystemExit(main())
