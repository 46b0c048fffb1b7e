"""bench/gpu_tp.py imports and parses its arguments without a GPU or SGLang, and names its result by card and sizes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[3]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_tp_bench", ROOT / "bench" / "gpu_tp.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_args_plan_and_result_name_on_a_cpu() -> None:
    bench = _bench()
    args = bench.parse_args(["--tp-size", "2", "--dp-size", "2", "--no-per-rank-weights"])
    assert (args.tp_size, args.dp_size, args.per_rank_weights) == (2, 2, False)
    worker = bench.plan(args, Path("/m"), "tcp://w", "tcp://c", 31000)["worker"]
    assert worker[worker.index("--tp-size") + 1] == "2" and worker[worker.index("--dp-size") + 1] == "2"
    assert "per_rank_weights=false" in worker[worker.index("--engine-options") + 1]
    assert bench.result_name(bench.card_name("NVIDIA H100 80GB HBM3"), 1, 1) == "h100-tp1.json"
    assert bench.result_name(bench.card_name("NVIDIA H200"), 2, 2) == "h200-tp2-dp2.json"
