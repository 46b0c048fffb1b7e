"""Probe: how fast can a trainer's CPU tensors (8B-shaped, bf16) be copied into one shared-memory buffer, and by which
way? A trainer publishing CPU tensors waits for mostly this copy.

    python3 bench/host_copy_probe.py --gib 13.5 --out DIR

The source is the 8B layout's tensors (an embedding, 32 layers of q/k/v/o and gate/up/down, norms, a head), each its
own CPU tensor with its pages touched; the destination one buffer mapped from a file in /dev/shm (as the publisher's
segments are), touched once before timing. Ways, each over every tensor in the layout's order, median of --reps:
    torch_Nt_intraK   N threads, each `dst.copy_(src)` (what the snapshot does), torch's intra-op threads set to K
    numpy_Nt          N threads, each `np.copyto` of the tensors' numpy views (releases the GIL)
    split_Nt          N threads over equal byte ranges of the whole version (large tensors split across threads)
Prints and writes host_copy_probe.json: GB/s and seconds per way, with the host's core count. No GPU needed.
"""

from __future__ import annotations

import argparse
import functools
import json
import mmap
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch


def layout(scale: float) -> list[tuple[str, tuple[int, ...]]]:
    h, inter, vocab, layers, kv = 4096, 14336, 32000, 32, 1024
    out: list[tuple[str, tuple[int, ...]]] = [("embed", (vocab, h))]
    for i in range(max(1, round(layers * scale))):
        out += [(f"l{i}.q", (h, h)), (f"l{i}.k", (kv, h)), (f"l{i}.v", (kv, h)), (f"l{i}.o", (h, h)),
                (f"l{i}.gate", (inter, h)), (f"l{i}.up", (inter, h)), (f"l{i}.down", (h, inter)),
                (f"l{i}.n1", (h,)), (f"l{i}.n2", (h,))]
    return out + [("norm", (h,)), ("head", (vocab, h))]


def ways(mm: mmap.mmap, total: int, src: list[torch.Tensor], sizes: list[int], offsets: list[int],
         args: argparse.Namespace) -> tuple[dict[str, dict[str, float]], int]:
    dst_np = np.frombuffer(mm, dtype=np.uint8)
    dst_np[:] = 0  # pages touched once, as a reused segment's are
    dst = torch.from_numpy(dst_np)
    flat = [t.view(-1).view(torch.uint8) for t in src]
    flat_np = [f.numpy() for f in flat]
    cores = os.cpu_count() or 1
    results: dict[str, dict[str, float]] = {}

    def timed(name: str, fn) -> None:  # type: ignore[no-untyped-def]
        runs = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t0)
        s = statistics.median(runs)
        results[name] = {"s": round(s, 4), "gbps": round(total / s / 1e9, 2), "runs": [round(r, 4) for r in runs]}
        print(name, results[name], flush=True)

    def per_tensor(pool: ThreadPoolExecutor, copy) -> None:  # type: ignore[no-untyped-def]
        list(pool.map(copy, range(len(flat))))

    def torch_copy(i: int) -> None:
        dst[offsets[i] : offsets[i] + sizes[i]].copy_(flat[i])

    def numpy_copy(i: int) -> None:
        np.copyto(dst_np[offsets[i] : offsets[i] + sizes[i]], flat_np[i])

    def ranged(cuts: list[int], k: int) -> None:
        lo, hi = cuts[k], cuts[k + 1]
        for i, (off, sz) in enumerate(zip(offsets, sizes, strict=True)):
            a, b = max(lo, off), min(hi, off + sz)
            if a < b:
                np.copyto(dst_np[a:b], flat_np[i][a - off : b - off])

    for n in [int(x) for x in args.threads.split(",")]:
        with ThreadPoolExecutor(n) as pool:
            for intra in (1, cores):
                torch.set_num_threads(intra)
                timed(f"torch_{n}t_intra{intra}", functools.partial(per_tensor, pool, torch_copy))
            torch.set_num_threads(cores)
            timed(f"numpy_{n}t", functools.partial(per_tensor, pool, numpy_copy))
            cuts = [total * k // n for k in range(n + 1)]  # equal byte ranges: large tensors split across threads
            timed(f"split_{n}t", functools.partial(lambda p, c, m: list(p.map(functools.partial(ranged, c), range(m))), pool, cuts, n))
    return results, cores


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=13.5, help="about this many GiB of bf16 (13.5: the 8B layout, 32 layers; scaled by layers)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", default="4,8,12,16")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    shapes = layout(args.gib / 13.5)
    src = []
    for _name, shape in shapes:
        t = torch.empty(shape, dtype=torch.bfloat16)
        t.view(torch.int16).fill_(1)
        src.append(t)
    sizes = [t.numel() * 2 for t in src]
    total = sum(sizes)
    offsets = np.cumsum([0] + sizes[:-1]).tolist()
    path = f"/dev/shm/rollpool-copy-probe-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, total)
        mm = mmap.mmap(fd, total)
        results, cores = ways(mm, total, src, sizes, offsets, args)
        out = {"cores": cores, "bytes": total, "tensors": len(src), "torch": torch.__version__, "ways": results}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "host_copy_probe.json").write_text(json.dumps(out, indent=1))
        mm.close()
    finally:
        os.close(fd)
        os.unlink(path)


if __name__ == "__main__":
    main()
