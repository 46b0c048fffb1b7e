"""The mix64 checksum on one GPU: the fused kernel (`rollpool.weights.mix64_kernel`) against the torch path it replaces
and against the card's limit, bit for bit and in GB/s, side by side in one run.

For bucket-sized buffers of random bytes (64 MiB to 2 GiB, and a whole 8B model's 14.5 GB as eight 1.8 GB buckets):
- ``torch``: the torch ops in 64 MiB slices (``ROLLPOOL_MIX64_TRITON=0``'s path);
- ``fused``: the Triton kernel, one read of every word;
- ``limit``: ``torch.sum`` of the same int64 words, one read and nothing mixed (what a single pass can reach);
each the median of ``--repeats`` runs timed with CUDA events on one stream; ``all_equal``: every fused digest is the
torch path's, with a word offset (``base_word``) and without. ``fused_vs_torch`` = torch time / fused time.

Run on the device inside ``bench/gpu_batch.sh``: ``python3 bench/gpu_mix64.py --out $STEP``.
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--result-name", default="")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--sizes-mib", default="64,256,1024,2048")
    args = ap.parse_args()

    import torch

    from rollpool.weights import gpu, mix64_kernel

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    card = "h200" if "H200" in name else "h100" if "H100" in name else "gpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result_path = out / (args.result_name or f"{card}-mix64.json")
    result: dict[str, Any] = {"bench": "gpu_mix64", "device": name, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                              "torch": torch.__version__, "rows": [], "all_equal": None}
    try:
        import triton
        result["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        result["triton"] = f"not importable: {e}"

    def save() -> None:
        result_path.write_text(json.dumps(result, indent=1))

    t0 = time.perf_counter()
    gpu.warm_up(dev)
    result["warm_up_s"] = round(time.perf_counter() - t0, 3)
    result["kernel_on_after_self_check"] = mix64_kernel.enabled()
    result["kernel_off_reason"] = mix64_kernel._off
    save()
    if not mix64_kernel.enabled():
        result["reading"] = "the fused kernel did not run here: nothing measured of it (see kernel_off_reason)"
        save()
        return 1

    def timed(fn: Any, reps: int) -> tuple[float, Any]:
        times, value = [], None
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            value = fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        return statistics.median(times), value

    def torch_path(buf: torch.Tensor, base: int) -> torch.Tensor:
        words = buf.numel() // 8
        w = buf[: words * 8].view(torch.int64)
        acc = torch.zeros((), dtype=torch.int64, device=buf.device)
        for s in range(0, words, gpu.MIX64_SLICE_WORDS):
            x = w[s : s + gpu.MIX64_SLICE_WORDS]
            acc += gpu._mix_sum(x, gpu._indices(buf.device, x.numel()), base + s)
        return acc

    all_equal = True
    for mib in [int(x) for x in args.sizes_mib.split(",")]:
        n = mib << 20
        buf = torch.randint(-128, 127, (n // 8,), dtype=torch.int64, device=dev).view(torch.uint8)
        row: dict[str, Any] = {"mib": mib}
        for base in (0, 12_345_679):
            ft, fv = timed(lambda b=buf, o=base: mix64_kernel.mix64_words(b.view(torch.int64), o), args.repeats)
            tt, tv = timed(lambda b=buf, o=base: torch_path(b, o), max(3, args.repeats // 2))
            equal = int(fv.item()) == int(tv.item())
            all_equal &= equal
            row[f"equal_base_{base}"] = equal
            if base == 0:
                lt, _ = timed(lambda b=buf: b.view(torch.int64).sum(), args.repeats)
                row.update(fused_s=round(ft, 5), torch_s=round(tt, 5), limit_s=round(lt, 5),
                           fused_gbps=round(n / ft / 1e9, 1), torch_gbps=round(n / tt / 1e9, 1),
                           limit_gbps=round(n / lt / 1e9, 1), fused_vs_torch=round(tt / ft, 2),
                           fused_vs_limit=round(lt / ft, 3))
        result["rows"].append(row)
        result["all_equal"] = all_equal
        save()
        del buf
        torch.cuda.empty_cache()
    # a whole 8B model's bytes as the checksum sees them: eight 1.8 GB buckets, summed one after another
    buckets = [torch.randint(-128, 127, (1_812_000_000 // 8,), dtype=torch.int64, device=dev).view(torch.uint8)
               for _ in range(8)]
    ft, _ = timed(lambda: [gpu.mix64_partial(b, 0) for b in buckets], 3)
    mix64_kernel.switch_off("the bench's torch row")
    tt, _ = timed(lambda: [gpu.mix64_partial(b, 0) for b in buckets], 3)
    total = sum(b.numel() for b in buckets)
    result["model_8b"] = {"bytes": total, "fused_s": round(ft, 4), "torch_s": round(tt, 4),
                          "fused_gbps": round(total / ft / 1e9, 1), "torch_gbps": round(total / tt / 1e9, 1),
                          "via": "gpu.mix64_partial per bucket (the publisher's and the worker's call)"}
    result["reading"] = (f"fused {result['model_8b']['fused_s']} s vs torch {result['model_8b']['torch_s']} s for "
                         f"14.5 GB; digests equal: {all_equal}")
    save()
    print(json.dumps(result, indent=1))
    return 0 if all_equal else 2


if __name__ == "__main__":
    raise SystemExit(main())
