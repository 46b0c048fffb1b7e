"""GPU probe for the shm path staged to the GPU: one GPU's host link, each way alone and both ways at once.

    python3 bench/gpu_duplex_probe.py [GIB] > duplex.json

The shm row of bench/gpu_weights.py runs the trainer's device-to-host snapshot and the worker's host-to-device staging
on the same GPU, so both directions share one link. This measures that link: GIB GiB page-locked host <-> device, on
side streams, device-to-host alone, host-to-device alone, and both at once (two streams), median of 3 each, in GB/s
(10^9 bytes). Needs an NVIDIA GPU.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch


def main() -> None:
    nbytes = int(float(sys.argv[1] if len(sys.argv) > 1 else 4) * (1 << 30))
    dev = torch.device("cuda", 0)
    host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_in = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    dev_src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    dev_dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    d2h, h2d = torch.cuda.Stream(device=dev), torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]

    def run(ways: str) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        if "d" in ways:
            with torch.cuda.stream(d2h):
                host_out.copy_(dev_src, non_blocking=True)
        if "h" in ways:
            with torch.cuda.stream(h2d):
                dev_dst.copy_(host_in, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    out: dict[str, object] = {"gib": nbytes / (1 << 30), "device": torch.cuda.get_device_name(dev)}
    for name, ways, moved in (("d2h_gbps", "d", nbytes), ("h2d_gbps", "h", nbytes), ("both_gbps_total", "dh", 2 * nbytes)):
        run(ways)  # warm
        secs = statistics.median(run(ways) for _ in range(3))
        out[name] = round(moved / secs / 1e9, 2)
    out["both_over_one_way"] = round(float(out["both_gbps_total"]) / max(float(out["d2h_gbps"]), float(out["h2d_gbps"])), 3)  # type: ignore[arg-type]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
