"""Codec benchmark: a 4,096-token trajectory through rollpool's codec vs msgpack of Python lists.

Both sides encode and decode one `Trajectory` (prompt 512 ids, 4,096 output
ids, logprobs, token versions, loss mask). The reference is what a naive
protocol does: msgpack of a dict whose arrays are Python lists. Repetitions are
interleaved (A, B, A, B, ...) and the median of each side is reported, with the
ratio msgpack_lists / rollpool.

    python bench/codec.py [--reps 200] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import msgpack
import numpy as np

from rollpool import protocol as p


def make_trajectory(n_out: int = 4096, n_in: int = 512) -> p.Trajectory:
    rng = np.random.default_rng(0)
    return p.Trajectory(
        prompt_id="bench-0",
        sample_index=0,
        input_ids=rng.integers(0, 150_000, n_in, dtype=np.int32),
        output_ids=rng.integers(0, 150_000, n_out, dtype=np.int32),
        output_logprobs=-rng.random(n_out, dtype=np.float32),
        token_versions=np.full(n_out, 7, dtype=np.int32),
        loss_mask=np.ones(n_out, dtype=np.uint8),
        finish_reason="length",
        worker_id="w0",
        metadata={"answer": "42"},
    )


def rollpool_roundtrip(msg: p.Result, copy_frames: bool = False) -> float:
    """Encode, then decode the frames (as a zero-copy socket would hand them over, or copied to bytes)."""
    t0 = time.perf_counter()
    frames = p.encode(msg)
    if copy_frames:
        frames = [bytes(memoryview(f)) for f in frames]
    out = p.decode(frames)
    assert out.trajectories[0].output_ids.shape[0] == msg.trajectories[0].output_ids.shape[0]
    return time.perf_counter() - t0


def lists_roundtrip(d: dict[str, object]) -> float:
    t0 = time.perf_counter()
    wire = msgpack.packb(d, use_bin_type=True)
    out = msgpack.unpackb(wire, raw=False)
    assert len(out["output_ids"]) == len(d["output_ids"])  # type: ignore[arg-type]
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    traj = make_trajectory(args.tokens)
    msg = p.Result(task_id="t", prompt_id=traj.prompt_id, trajectories=(traj,))
    as_lists = {
        "prompt_id": traj.prompt_id,
        "sample_index": 0,
        "input_ids": traj.input_ids.tolist(),
        "output_ids": traj.output_ids.tolist(),
        "output_logprobs": traj.output_logprobs.tolist(),
        "token_versions": traj.token_versions.tolist(),
        "loss_mask": traj.loss_mask.tolist(),
        "finish_reason": traj.finish_reason,
    }
    for _ in range(20):  # warm-up
        rollpool_roundtrip(msg)
        lists_roundtrip(as_lists)
    a: list[float] = []
    b: list[float] = []
    c: list[float] = []
    for _ in range(args.reps):
        a.append(rollpool_roundtrip(msg))
        b.append(lists_roundtrip(as_lists))
        c.append(rollpool_roundtrip(msg, copy_frames=True))
    rp_us = statistics.median(a) * 1e6
    ml_us = statistics.median(b) * 1e6
    rc_us = statistics.median(c) * 1e6
    result = {
        "bench": "codec",
        "tokens": args.tokens,
        "reps": args.reps,
        "rollpool_us": round(rp_us, 2),
        "msgpack_lists_us": round(ml_us, 2),
        "ratio": round(ml_us / rp_us, 2),
        "rollpool_copied_frames_us": round(rc_us, 2),
        "ratio_copied_frames": round(ml_us / rc_us, 2),
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "numpy": np.__version__,
        "msgpack": ".".join(map(str, msgpack.version)),
    }
    print(f"encode+decode of one trajectory, {args.tokens} output tokens (median of {args.reps} interleaved reps)")
    print(f"{'codec':<28}{'us per round trip':>20}")
    print(f"{'rollpool (raw frames)':<28}{rp_us:>20.1f}")
    print(f"{'rollpool, frames copied':<28}{rc_us:>20.1f}")
    print(f"{'msgpack of Python lists':<28}{ml_us:>20.1f}")
    print(f"ratio (msgpack lists / rollpool): {result['ratio']}x  (goal >= 20x); "
          f"with every frame copied to bytes as a copying recv would: {result['ratio_copied_frames']}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
            fh.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
