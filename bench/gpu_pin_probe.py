"""GPU probe for the weight paths at real model sizes: does page-locking host memory in a thread stall an asyncio
loop, and how fast is each way?

    python3 bench/gpu_pin_probe.py GIB KIND CUDA_ON_LOOP     # KIND: torch_pinned | register; CUDA_ON_LOOP: 0 | 1

One process per probe (torch's pinned-host cache would reuse the first block otherwise). A thread allocates GIB GiB:
`torch_pinned` is `torch.empty(pin_memory=True)` (one cudaHostAlloc, what `BufferPool` does for pinned host buffers);
`register` is a pageable `torch.empty`, touched with `fill_(0)`, then one `cudaHostRegister` of the whole buffer (what
the shared-memory segments get). Meanwhile the loop sleeps 10 ms per tick, touching CUDA on each tick when
CUDA_ON_LOOP is 1; printed: the allocation's seconds and the loop's longest gap. Needs an NVIDIA GPU.
"""
from __future__ import annotations

import asyncio
import json
import sys
import threading
import time

import torch


def main() -> None:
    nbytes = int(float(sys.argv[1]) * (1 << 30))
    kind, cuda_on_loop = sys.argv[2], sys.argv[3] == "1"
    out: dict[str, object] = {"gib": float(sys.argv[1]), "kind": kind, "cuda_on_loop": cuda_on_loop}
    torch.zeros(1, device="cuda")  # the context first, outside the timing
    bufs: list[torch.Tensor] = []

    def alloc() -> None:
        t = time.perf_counter()
        if kind == "torch_pinned":
            bufs.append(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
        else:
            b = torch.empty(nbytes, dtype=torch.uint8)
            b.fill_(0)
            rc = torch.cuda.cudart().cudaHostRegister(b.data_ptr(), nbytes, 0)  # type: ignore[no-untyped-call]
            out["register_rc"] = int(getattr(rc, "value", rc))
            bufs.append(b)
        out["alloc_s"] = round(time.perf_counter() - t, 3)

    async def probe() -> None:
        th = threading.Thread(target=alloc)
        th.start()
        gaps: list[float] = []
        last = time.perf_counter()
        while th.is_alive():
            await asyncio.sleep(0.01)
            if cuda_on_loop:
                torch.cuda.current_stream().query()
                torch.empty(16, device="cuda")
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        th.join()
        out["max_loop_gap_s"] = round(max(gaps), 3)
        out["pinned"] = bool(bufs and bufs[0].is_pinned())

    asyncio.run(probe())
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
