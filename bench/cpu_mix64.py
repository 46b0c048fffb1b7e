"""The mix64 checksum on the CPU (`rollpool.weights.gpu._mix64_cpu`, what a publisher sums each host bucket with when
the trainer's tensors are on the CPU and a worker stages the shared-memory bucket to its GPU) against its previous form
and against one read of the same bytes, in GB/s, side by side in one run.

- ``before``: the previous form, numpy on 1 MiB slices (`gpu._mix64_numpy`, still the fallback where no compiler is);
- ``now``: `_mix64_cpu`: one compiled pass with the GIL released (`rollpool.weights.mix64_native`) where it builds;
- ``limit``: numpy's sum of the same uint64 words (one pass, nothing mixed);
each the median of ``--repeats`` rounds (the three interleaved in each round), on one thread and on ``--threads``
threads at once (each its own buffer, as the publisher's checksum threads each take a bucket). ``all_equal``: every
digest of ``now`` is ``before``'s. ``now_vs_before`` = before's time / now's; ``now_path`` says which path ``now`` took.

    python bench/cpu_mix64.py --json bench/results/cpu-mix64.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="bytes per buffer (a bucket's default size)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    import numpy as np
    import torch

    from rollpool.weights import gpu, mix64_native

    n = args.mib << 20
    rng = np.random.default_rng(0)
    bufs = [torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8)) for _ in range(max(1, args.threads))]
    forms = {
        "before": lambda b: gpu._mix64_numpy(b.numpy(), 0),
        "now": lambda b: gpu._mix64_cpu(b, 0),
        "limit": lambda b: int(b.numpy().view("<u8").sum(dtype=np.uint64)),
    }
    digests: dict[str, set[int]] = {"before": set(), "now": set()}
    times: dict[str, dict[str, list[float]]] = {"1": {k: [] for k in forms}, str(args.threads): {k: [] for k in forms}}
    with ThreadPoolExecutor(args.threads) as pool:
        for _ in range(args.repeats):
            for name, fn in forms.items():
                t0 = time.perf_counter()
                got = fn(bufs[0])
                times["1"][name].append(time.perf_counter() - t0)
                if name in digests:
                    digests[name].add(got)
                t0 = time.perf_counter()
                list(pool.map(fn, bufs[: args.threads]))
                times[str(args.threads)][name].append(time.perf_counter() - t0)
    rows: dict[str, Any] = {}
    for threads, by in times.items():
        k = int(threads)
        med = {name: statistics.median(ts) for name, ts in by.items()}
        rows[f"threads_{threads}"] = {
            **{f"{name}_gb_per_s": round(k * n / s / 1e9, 3) for name, s in med.items()},
            "now_vs_before": round(med["before"] / med["now"], 3),
            "now_vs_limit": round(med["limit"] / med["now"], 3),
        }
    result = {
        "what": "bench/cpu_mix64.py: the CPU mix64 of a bucket against its previous form (numpy) and one read of the bytes",
        "now_path": f"compiled ({mix64_native.library_path()})" if mix64_native.enabled() else "numpy (no compiled sum here)",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "simulated": False,
        "mib_per_buffer": args.mib,
        "repeats": args.repeats,
        "all_equal": len(digests["now"]) == 1 and digests["now"] == digests["before"],
        **rows,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if result["all_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
