"""The hf engine's output tokens/s against two transformers peers on CPU.

Workload (fixed and seeded, the same for every system): a tiny random Llama
(`build_tiny_model` defaults: vocab 384, hidden 64, 2 layers, 4 heads, 2 KV
heads), prompts of 16..64 random token ids, output lengths lognormal (median
64, sigma 0.8, capped at 512) realised through ``max_new_tokens`` with EOS
ignored, so every system generates exactly the same tokens' worth of work.
Sampling is plain temperature 1.0 (no top-k / top-p) everywhere.

Requests arrive continuously in one fixed order at concurrency C = 1, 8, 32:
a concurrency-C run keeps C requests in flight, submitting the next request in
arrival order as soon as one finishes (closed loop). Systems, side by side in
the same process on the same model weights, prompts and arrival order:

* ``rollpool``: `HFEngine` (``get_engine("hf")``, capacity 32, one thread),
  one request per ``generate(..., n=1)`` call from C asyncio workers;
* ``static``: ``model.generate`` on batches of C requests in arrival order
  (left-padded prompts, ``max_new_tokens`` = the batch's longest request);
  only each request's own requested tokens are counted;
* ``hf_cb``: transformers' continuous batching
  (``model.init_continuous_batching()`` -> ``ContinuousBatchingManager``,
  ``add_request(max_new_tokens=...)`` / ``get_result``), closed loop like
  rollpool's. Left out (and the reason recorded) if it fails on this machine.

Tokens/s = requested output tokens / wall time from the first submission to
the last completion. Each (system, C) cell is the median of ``--reps``
interleaved repetitions (systems rotate order every repetition). Engines /
managers are started once and warmed up before timing.

    PYTHONPATH=. python bench/engine.py [--quick] [--reps 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

import numpy as np
import torch

CONCURRENCIES = (1, 8, 32)
MEDIAN_LEN, SIGMA, CAP = 64, 0.8, 512
GOAL_RATIO, GOAL_VS_STATIC_32 = 1.0, 1.5


def make_workload(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    lens = np.minimum(CAP, np.maximum(1, np.round(rng.lognormal(math.log(MEDIAN_LEN), SIGMA, size=n)))).astype(int)
    plens = rng.integers(16, 65, size=n)
    return [(rng.integers(8, vocab, size=int(p)).tolist(), int(ln)) for p, ln in zip(plens, lens, strict=True)]


# -- systems


class Rollpool:
    name = "rollpool"

    def __init__(self, path: str, loop: asyncio.AbstractEventLoop) -> None:
        from rollpool.workers.engines.registry import get_engine

        self.loop = loop
        self.engine = get_engine("hf")(model=path, capacity=32, num_threads=1)
        loop.run_until_complete(self.engine.start())
        self.counter = 0

    def run(self, work: list[tuple[list[int], int]], c: int) -> int:
        return self.loop.run_until_complete(self._run(work, c))

    async def _run(self, work: list[tuple[list[int], int]], c: int) -> int:
        from rollpool.protocol import SamplingParams

        it = iter(list(enumerate(work)))
        got = 0

        async def worker() -> None:
            nonlocal got
            for i, (prompt, n_new) in it:
                self.counter += 1
                sp = SamplingParams(max_new_tokens=n_new, temperature=1.0, ignore_eos=True, seed=i)
                out = await self.engine.generate(prompt, 1, sp, f"b{self.counter}")
                got += min(n_new, len(out.samples[0].output_ids))

        await asyncio.gather(*(worker() for _ in range(c)))
        return got

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.stop())


class Static:
    name = "static"

    def __init__(self, path: str) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
        self.pad = 0
        self.gc = GenerationConfig(
            do_sample=True, temperature=1.0, top_k=None, top_p=None, eos_token_id=None, pad_token_id=self.pad
        )

    def run(self, work: list[tuple[list[int], int]], c: int) -> int:
        got = 0
        for start in range(0, len(work), c):
            batch = work[start : start + c]
            width = max(len(p) for p, _ in batch)
            ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for r, (p, _) in enumerate(batch):
                ids[r, width - len(p) :] = torch.tensor(p)
                mask[r, width - len(p) :] = 1
            n_max = max(n for _, n in batch)
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids, attention_mask=mask, generation_config=self.gc, max_new_tokens=n_max, min_new_tokens=n_max
                )
            made = out.shape[1] - width
            got += sum(min(n, made) for _, n in batch)  # only the requested tokens count
        return got

    def close(self) -> None:
        pass


class HFContinuous:
    name = "hf_cb"

    def __init__(self, path: str) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
        gc = GenerationConfig(do_sample=True, temperature=1.0, top_k=None, top_p=None, eos_token_id=-1, pad_token_id=0, max_new_tokens=CAP)
        self.manager = model.init_continuous_batching(generation_config=gc)
        self.manager.start()
        self.counter = 0

    def run(self, work: list[tuple[list[int], int]], c: int) -> int:
        m = self.manager
        pending = list(enumerate(work))[::-1]
        want: dict[str, int] = {}
        got = 0

        def submit() -> None:
            _, (prompt, n_new) = pending.pop()
            self.counter += 1
            rid = f"b{self.counter}"
            want[rid] = n_new
            m.add_request(prompt, request_id=rid, max_new_tokens=n_new, eos_token_id=-1)

        for _ in range(min(c, len(pending))):
            submit()
        while want:
            res = m.get_result(timeout=60)
            if res is None:
                err = m.background_thread_status.fatal_error if hasattr(m, "background_thread_status") else None
                raise RuntimeError(f"continuous batching produced nothing for 60 s (fatal error: {err!r})")
            if not res.is_finished() or res.request_id not in want:
                continue
            got += min(want.pop(res.request_id), len(res.generated_tokens))
            if pending:
                submit()
        return got

    def close(self) -> None:
        try:
            self.manager.stop(block=True, timeout=10)
        except Exception:  # noqa: BLE001
            pass


# -- driver


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer requests per run (finishes in a few minutes)")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions per cell (median reported)")
    ap.add_argument("--requests", type=int, default=0, help="requests per run (default: max(8, 2C) quick, max(16, 4C) full)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import transformers

    from rollpool.workers.engines.tiny_model import build_tiny_model

    tmp = tempfile.mkdtemp(prefix="rollpool-enginebench-")
    path = str(build_tiny_model(os.path.join(tmp, "tiny"), seed=0))
    vocab = 384

    def n_requests(c: int) -> int:
        if args.requests:
            return args.requests
        return max(8, 2 * c) if args.quick else max(16, 4 * c)

    workloads = {c: make_workload(n_requests(c), args.seed + c, vocab) for c in CONCURRENCIES}
    warm = make_workload(8, 999, vocab)
    warm = [(p, min(n, 16)) for p, n in warm]

    loop = asyncio.new_event_loop()
    systems: list[Any] = []
    notes: dict[str, str] = {}
    systems.append(Rollpool(path, loop))
    systems.append(Static(path))
    cb_api = f"transformers {transformers.__version__}: model.init_continuous_batching() -> ContinuousBatchingManager (add_request / get_result)"
    try:
        cb = HFContinuous(path)
        cb.run(warm, 4)
        systems.append(cb)
        bp = getattr(cb.manager, "batch_processor", None)
        cache = getattr(bp, "cache", None)
        notes["hf_cb"] = f"ok (default ContinuousBatchingConfig; KV cache num_blocks={getattr(cache, 'num_blocks', '?')})"
    except Exception as exc:  # noqa: BLE001
        notes["hf_cb"] = f"left out: {type(exc).__name__}: {exc}"
        traceback.print_exc()
    for s in systems[:2]:
        s.run(warm, 4)

    samples: dict[str, dict[int, list[float]]] = {s.name: {c: [] for c in CONCURRENCIES} for s in systems}
    t_all = time.perf_counter()
    for rep in range(args.reps):
        for c in CONCURRENCIES:
            order = systems[rep % len(systems) :] + systems[: rep % len(systems)]
            for s in order:
                t0 = time.perf_counter()
                try:
                    got = s.run(workloads[c], c)
                except Exception as exc:
                    if s.name != "hf_cb":
                        raise
                    notes["hf_cb"] = f"left out: failed at C={c}: {type(exc).__name__}: {exc}"
                    traceback.print_exc()
                    systems.remove(s)
                    samples.pop(s.name, None)
                    continue
                dt = time.perf_counter() - t0
                want = sum(n for _, n in workloads[c])
                assert got == want, f"{s.name} C={c}: {got} tokens, wanted {want}"
                samples[s.name][c].append(got / dt)
                print(f"rep {rep} C={c:>2} {s.name:<8} {got:>6} tok {dt:7.2f} s {got / dt:9.1f} tok/s", flush=True)
    wall = time.perf_counter() - t_all
    for s in systems:
        s.close()
    loop.close()

    names = [s.name for s in systems]
    tps = {str(c): {n: round(statistics.median(samples[n][c]), 1) for n in names} for c in CONCURRENCIES}
    ratios = {k: round(v["rollpool"] / max(x for n, x in v.items() if n != "rollpool"), 3) for k, v in tps.items()}
    vs_static_32 = round(tps["32"]["rollpool"] / tps["32"]["static"], 3)
    met = {
        "ratios_ge_1": all(r >= GOAL_RATIO for r in ratios.values()),
        "vs_static_32_ge_1_5": vs_static_32 >= GOAL_VS_STATIC_32,
    }

    print()
    print(f"output tokens/s, median of {args.reps} interleaved runs (CPU, 1 thread, tiny Llama)")
    hdr = f"{'C':>3} {'requests':>8} {'tokens':>7} " + " ".join(f"{n:>10}" for n in names) + f" {'ratio':>7}"
    print(hdr)
    for c in CONCURRENCIES:
        k = str(c)
        print(
            f"{c:>3} {len(workloads[c]):>8} {sum(n for _, n in workloads[c]):>7} "
            + " ".join(f"{tps[k][n]:>10.1f}" for n in names)
            + f" {ratios[k]:>7.3f}"
        )
    print(f"ratio = rollpool / best peer; vs_static_32 = {vs_static_32:.3f}")
    print(f"goals: ratios >= 1.0 at every C: {'met' if met['ratios_ge_1'] else 'NOT met'}; "
          f"vs_static_32 >= 1.5: {'met' if met['vs_static_32_ge_1_5'] else 'NOT met'}")
    print(f"hf_cb: {notes['hf_cb']} ({cb_api})")

    if args.json:
        result = {
            "benchmark": "bench/engine.py",
            "issue": 4,
            "mode": "quick" if args.quick else "full",
            "tokens_per_s": tps,
            "ratios": ratios,
            "vs_static_32": vs_static_32,
            "goals": {"ratios_min": GOAL_RATIO, "vs_static_32_min": GOAL_VS_STATIC_32, "met": met},
            "samples_tokens_per_s": {n: {str(c): [round(x, 1) for x in v] for c, v in d.items()} for n, d in samples.items()},
            "peers": {
                "static": "model.generate on batches of C requests in arrival order, left-padded, max_new_tokens = batch max; only requested tokens counted",
                "hf_cb": cb_api,
            },
            "peer_status": notes,
            "workload": {
                "model": "build_tiny_model defaults (llama, vocab 384, hidden 64, 2 layers, 4 heads, 2 kv heads), float32",
                "prompt_tokens": "uniform 16..64",
                "output_tokens": f"lognormal median {MEDIAN_LEN}, sigma {SIGMA}, cap {CAP}, via max_new_tokens with EOS ignored",
                "sampling": "temperature 1.0, no top-k/top-p",
                "requests": {str(c): len(workloads[c]) for c in CONCURRENCIES},
                "tokens": {str(c): sum(n for _, n in workloads[c]) for c in CONCURRENCIES},
                "arrival": "closed loop, C in flight, fixed seeded order",
                "reps": args.reps,
                "seed": args.seed,
            },
            "env": {
                "python": sys.version.split()[0],
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "platform": platform.platform(),
                "cpu_count": os.cpu_count(),
                "torch_threads": 1,
            },
            "timed_wall_s": round(wall, 1),
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
