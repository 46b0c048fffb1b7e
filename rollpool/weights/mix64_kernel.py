"""mix64 in one pass over the bytes: a Triton kernel for CUDA buffers.

`rollpool.weights.gpu.mix64_partial` on a CUDA buffer runs the mix as about ten torch operations per 64 MiB slice,
each reading and writing the slice again: 215 GB/s on an idle H200, ~85 GB/s on an H100 beside SGLang, a tenth to a
twentieth of what the card's memory gives. Two such passes over a 14.5 GB model (the publisher's sums of an early
delta, the worker's check of the version it rebuilt) were most of a delta version's time to applied. This kernel reads
each word once: every program mixes `ITERS` blocks of `BLOCK` words in registers and writes one partial sum; torch adds
the partials (modulo 2^64, as int64 arithmetic wraps). The digest is the same function (`mix64_reference` is the
specification): the tests run the kernel in Triton's interpreter on the CPU against it, and `bench/gpu_mix64.py`
compares it with the torch path on the GPU, bit for bit, with its speed.

Used only on CUDA, only where Triton imports, and not with ``ROLLPOOL_MIX64_TRITON=0``; a kernel whose sum differs
from the torch ops' on a device (`rollpool.weights.gpu.self_check`, before its first sum there) or that fails to build
or launch is switched off for the process (logged once) and the torch path takes over.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch

__all__ = ["BLOCK", "ITERS", "enabled", "mix64_words", "switch_off"]

_log = logging.getLogger("rollpool.weights.mix64_kernel")

BLOCK = 1024
"""Words a program mixes at once (8 KiB)."""
ITERS = 8
"""Blocks per program: one partial sum per 64 KiB."""
_C1 = 0x9E3779B97F4A7C15
_C2 = 0xBF58476D1CE4E5B9
_SHIFT = 29

_lock = threading.Lock()
_kernel: Any = None
_off: str | None = None if os.environ.get("ROLLPOOL_MIX64_TRITON", "1") != "0" else "ROLLPOOL_MIX64_TRITON=0"


def enabled() -> bool:
    """Whether the kernel may be tried (Triton importable, not switched off)."""
    return _off is None and _build() is not None


def switch_off(reason: str) -> None:
    """Use the torch path from now on in this process (a failed launch, a wrong answer in a self-check)."""
    global _off
    if _off is None:
        _off = reason
        _log.warning("mix64 kernel switched off, the torch path sums from now on: %s", reason)


def _build() -> Any:
    global _kernel
    if _kernel is not None or _off is not None:
        return _kernel
    with _lock:
        if _kernel is not None or _off is not None:
            return _kernel
        try:
            import triton
            import triton.language as tl
        except Exception as e:  # noqa: BLE001 - no Triton, or one that does not import here
            switch_off(f"triton does not import ({type(e).__name__}: {e})")
            return None

        @triton.jit  # type: ignore[untyped-decorator]
        def _mix64_blocks(words, partials, n_words, base, c1, c2, BLOCK: tl.constexpr, ITERS: tl.constexpr,  # type: ignore[no-untyped-def]
                          SHIFT: tl.constexpr):
            pid = tl.program_id(0).to(tl.int64)
            lane = tl.arange(0, BLOCK).to(tl.int64)
            acc = tl.zeros([BLOCK], dtype=tl.uint64)
            first = pid * (BLOCK * ITERS)
            for k in tl.static_range(ITERS):
                i = first + k * BLOCK + lane
                inside = i < n_words
                w = tl.load(words + i, mask=inside, other=0).to(tl.uint64, bitcast=True)
                v = (w + (i + base).to(tl.uint64, bitcast=True)) * c1
                v = v ^ (v >> SHIFT)
                v = v * c2
                acc += tl.where(inside, v, tl.zeros([BLOCK], dtype=tl.uint64))
            tl.store(partials + pid, tl.sum(acc, axis=0).to(tl.int64, bitcast=True))

        _kernel = _mix64_blocks
        return _kernel


def mix64_words(words: torch.Tensor, base_word: int) -> torch.Tensor:
    """The mix64 sum (an int64 scalar on `words`' device, not synchronised) of a 1-D int64 tensor whose first word is
    word `base_word` of a bucket, on the current stream. Raises where the kernel cannot run (the caller falls back)."""
    kernel = _build()
    if kernel is None:
        raise RuntimeError(f"the mix64 kernel is off: {_off}")
    if not 0 <= base_word < (1 << 62):
        raise ValueError(f"base_word {base_word} out of range")
    n = int(words.numel())
    if n == 0:
        return torch.zeros((), dtype=torch.int64, device=words.device)
    per_program = BLOCK * ITERS
    programs = (n + per_program - 1) // per_program
    partials = torch.empty(programs, dtype=torch.int64, device=words.device)
    kernel[(programs,)](words, partials, n, base_word, _C1, _C2, BLOCK=BLOCK, ITERS=ITERS, SHIFT=_SHIFT)
    return partials.sum()
