"""bench/lora.py's checksum and receive-buffer arms run on a CPU (the demo's shape, real sockets): each arm says what it
ran, and the module's switches are as they were afterwards (the GPU run the coordinator makes is this one at 8B)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("torch")
pytest.importorskip("zmq")

ROOT = Path(__file__).resolve().parents[3]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lora_bench", ROOT / "bench" / "lora.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_checksums_and_pinned_arms_say_what_they_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollpool.weights import snapshot

    monkeypatch.setattr(snapshot, "_FOLD_CHECKSUMS", None)  # restored after the test, whatever --fold set
    bench = _bench()
    a = bench.parse(["--demo-shape", "--device", "cpu", "--versions", "1", "--warmup", "0", "--compare", "2",
                     "--compare-what", "checksums+pinned", "--fold", "always"])
    out = asyncio.run(bench.run(a))
    assert (out["before"]["checksums_folded"], out["after"]["checksums_folded"]) == ("never", "always")
    assert out["before"]["receive_pinned"] is False  # and the after arm's only where CUDA is (not here)
    assert set(out["after"]["profile_s"]) == {"snapshot_copy_trainer_blocked", "checksums_after_return",
                                              "manifest_chunks_and_verify", "bank_copy"}
    assert out["compare_what"] == "checksums+pinned" and out["lora_publish_to_applied_s_after_vs_before"] > 0
    assert snapshot._FOLD_CHECKSUMS is True and a.pin == "auto"  # --fold always stays; the arms' switches restored
