"""rollpool.workers.heap: a worker or agent process freezes its start-up heap and collects its young objects less often."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rollpool.workers.heap import GC_THRESHOLDS

ROOT = Path(__file__).resolve().parents[3]


def test_the_start_up_heap_leaves_the_collector_and_collections_come_rarer() -> None:
    code = ("import gc, json; from rollpool.workers.worker import freeze_start_up_heap; before = gc.get_threshold(); "
            "n = freeze_start_up_heap(); print(json.dumps([before, gc.get_threshold(), n, gc.get_freeze_count()]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60, check=True)
    before, after, returned, frozen = json.loads(out.stdout)
    assert tuple(before) == (700, 10, 10) and tuple(after) == GC_THRESHOLDS == (10_000, 20, 20)
    assert returned == frozen > 10_000  # the worker's modules, frozen
