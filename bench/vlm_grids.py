"""What the sglang engine spends per image on the worker's side to report a prompt's expanded ids: the model's image
processor run whole (a second decode, resize, normalise, patches made and dropped: the engine before) against the grid
from the image's size (`VisionSpec.grids_of`: the header read, transformers' ``smart_resize``). CPU only, this box.

    python bench/vlm_grids.py --json bench/results/cpu-vlm-grids.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the bench package beside rollpool
    sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=256, help="distinct random-noise PNGs (gpu_vlm.py's workload: 256)")
    ap.add_argument("--image-px", type=int, default=224)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args()
    from bench.gpu_vlm import noise_pngs
    from rollpool.workers.engines.tiny_model import build_tiny_model
    from rollpool.workers.engines.vision import load_vision_spec

    model = build_tiny_model(pathlib.Path(tempfile.mkdtemp()) / "vlm", arch="qwen2", vocab=320, hidden=32, layers=2, heads=4,
                             kv_heads=2, vlm=True)
    spec = load_vision_spec(model)
    assert spec is not None
    images = noise_pngs(args.images, args.image_px)

    def per_image(fn: Any) -> float:
        runs = []
        for _ in range(args.reps):
            t = time.perf_counter()
            for im in images:
                fn([im])
            runs.append(time.perf_counter() - t)
        return statistics.median(runs) / len(images)

    # interleaved, the processor first
    full = per_image(lambda x: spec.grids(x))
    size = per_image(spec.grids_of)
    same = all(spec.grids_of([im]) == spec.grids([im])[1] for im in images[:16])
    out = {"processor": type(spec.processor).__name__, "images": args.images, "image_px": args.image_px, "reps": args.reps,
           "full_processor_ms_per_image": round(full * 1e3, 4), "size_only_ms_per_image": round(size * 1e3, 4),
           "size_over_full": round(size / full, 4), "same_grids_first_16": same,
           "saved_s_per_256_images": round((full - size) * 256, 3),
           "how": "CPU, the shared 2-core development VM, `python bench/vlm_grids.py --json ...`; the GPU effect on "
                  "bench/gpu_vlm.py's pool_vs_direct is not measured"}
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
