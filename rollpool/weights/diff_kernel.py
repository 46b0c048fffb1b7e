"""The device diff's compare, count and gather in two passes: Triton kernels for CUDA buckets.

`rollpool.weights.delta_device` finds a bucket's changed elements with torch operations: `ne` into a bucket-sized
mask, a `copy_` of the whole bucket into the base, the mask summed, then `nonzero` over it one 32 Mi-element piece at
a time, each piece a host sync. On an H100 at 8B that was 0.074 s of compare and 0.042 s of encode per version
(`delta_compare_s`, `delta_encode_s` summed over 33 buckets, bench/results/h100-weights-8b-delta-s23.json): the
trainer's wait for a delta version, and most of the time before its early delta is served. The bytes read and written
are about 5.5 times a bucket's, and the syncs leave the GPU idle between pieces.

These kernels read the caller's words and the base's twice and write only what changed:

- `count_changed`: every program compares `BLOCK * ITERS` words and writes how many differ (no writes to the base).
- `gather_changed`: with each program's first slot (the exclusive prefix sum of those counts, taken by torch), every
  program compares its words again, writes the positions of those that differ in order (a prefix sum within each
  block) and writes them, and only them, into the base.

So a bucket costs one host sync (its count, which decides the encoding) instead of one per piece. The positions are
the torch path's, bit for bit (`reference_changed` is the specification: the tests run the kernels in Triton's
interpreter on the CPU against it, and `self_check` compares them on a device before their first use there).

Built and checked on a device when a `DeviceBase` is first allocated there, in a thread of its own (Triton compiles a
kernel on its first launch, ~a second: not in the trainer's wait for the first delta). Used only on CUDA, only where
Triton imports, and not with ``ROLLPOOL_DIFF_TRITON=0``; a kernel that fails to build or
launch, or that disagrees with the torch path in `self_check`, is switched off for the process (logged once) and the
torch path takes over.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["BLOCK", "ITERS", "compared_by", "count_changed", "enabled", "gather_changed", "reference_changed", "self_check",
           "switch_off", "usable"]

_log = logging.getLogger("rollpool.weights.diff_kernel")

BLOCK = 1024
"""Words a program compares at once."""
ITERS = 8
"""Blocks per program: one count per 8 Ki words."""

_lock = threading.Lock()
_check_lock = threading.Lock()
_kernels: tuple[Any, Any] | None = None
_off: str | None = None if os.environ.get("ROLLPOOL_DIFF_TRITON", "1") != "0" else "ROLLPOOL_DIFF_TRITON=0"
_checked: set[str] = set()


def enabled() -> bool:
    """Whether the kernels may be tried (Triton importable, not switched off)."""
    return _off is None and _build() is not None


def switch_off(reason: str) -> None:
    """Use the torch path from now on in this process (a failed launch, a wrong answer in `self_check`)."""
    global _off
    if _off is None:
        _off = reason
        _log.warning("diff kernels switched off, the torch path compares from now on: %s", reason)


def usable(device: torch.device) -> bool:
    """Whether a bucket on `device` is compared by the kernels: on CUDA, enabled, and `self_check` passed there."""
    if device.type != "cuda" or not enabled():
        return False
    key = str(device)
    if key not in _checked:
        with _check_lock:
            if key not in _checked:
                # (on `device`: Triton launches on the thread's current device, 0 in a fresh thread)
                with torch.cuda.device(device) if device.type == "cuda" and torch.cuda.is_available() else contextlib.nullcontext():
                    self_check(device)
                _checked.add(key)
    return enabled()


def compared_by(device: torch.device | None) -> str:
    """What compares a bucket on `device`, as far as known without running anything: ``kernels`` (checked there and
    on), ``torch ops (why)``, or "" (no bucket compared there yet)."""
    if device is None:
        return ""
    if device.type != "cuda":
        return "torch ops (not a CUDA device)"
    if _off is not None:
        return f"torch ops ({_off})"
    return "kernels" if str(device) in _checked else ""


def _build() -> tuple[Any, Any] | None:
    global _kernels
    if _kernels is not None or _off is not None:
        return _kernels
    with _lock:
        if _kernels is not None or _off is not None:
            return _kernels
        try:
            import triton
            import triton.language as tl
        except Exception as e:  # noqa: BLE001 - no Triton, or one that does not import here
            switch_off(f"triton does not import ({type(e).__name__}: {e})")
            return None

        # (`n` and `lo` not specialised on: one build per word type, not one per divisibility of a piece's length)
        @triton.jit(do_not_specialize=["n"])  # type: ignore[untyped-decorator]
        def _count(src, base, counts, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):  # type: ignore[no-untyped-def]
            pid = tl.program_id(0).to(tl.int64)
            lane = tl.arange(0, BLOCK).to(tl.int64)
            first = pid * (BLOCK * ITERS)
            acc = tl.zeros([BLOCK], dtype=tl.int32)
            for k in tl.static_range(ITERS):
                i = first + k * BLOCK + lane
                inside = i < n
                a = tl.load(src + i, mask=inside, other=0)
                b = tl.load(base + i, mask=inside, other=0)
                acc += (a != b).to(tl.int32)
            tl.store(counts + pid, tl.sum(acc, axis=0))

        @triton.jit(do_not_specialize=["n", "lo"])  # type: ignore[untyped-decorator]
        def _gather(src, base, starts, positions, n, lo, BLOCK: tl.constexpr, ITERS: tl.constexpr):  # type: ignore[no-untyped-def]
            pid = tl.program_id(0).to(tl.int64)
            lane = tl.arange(0, BLOCK).to(tl.int64)
            first = pid * (BLOCK * ITERS)
            at = tl.load(starts + pid).to(tl.int64)
            for k in tl.static_range(ITERS):
                i = first + k * BLOCK + lane
                inside = i < n
                a = tl.load(src + i, mask=inside, other=0)
                b = tl.load(base + i, mask=inside, other=0)
                changed = (a != b) & inside
                c = changed.to(tl.int32)
                rank = tl.cumsum(c, axis=0).to(tl.int64)  # 1 for the block's first changed word
                tl.store(positions + at + rank - 1, (i + lo).to(tl.int32), mask=changed)
                tl.store(base + i, a, mask=changed)
                at += tl.sum(c, axis=0).to(tl.int64)

        _kernels = (_count, _gather)
        return _kernels


def _programs(n: int) -> int:
    per = BLOCK * ITERS
    return (n + per - 1) // per


def count_changed(pieces: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, int]:
    """For `pieces` = [(the caller's words, the base's words at the same place)], in ascending order of place, each
    pair 1-D of one integer dtype: (every program's first slot in the positions, an int64 tensor on their device, and
    how many words differ in all). One host sync. Nothing is written to the base. Raises where a kernel cannot run."""
    kernels = _build()
    if kernels is None:
        raise RuntimeError(f"the diff kernels are off: {_off}")
    count, _gather = kernels
    device = pieces[0][0].device if pieces else torch.device("cpu")
    counts = torch.zeros(sum(_programs(int(s.numel())) for s, _b in pieces) + 1, dtype=torch.int32, device=device)
    at = 0
    for src, base in pieces:
        n = _check_pair(src, base)
        p = _programs(n)
        if p:
            count[(p,)](src, base, counts[at : at + p], n, BLOCK=BLOCK, ITERS=ITERS)
        at += p
    starts = torch.cumsum(counts, 0, dtype=torch.int64)  # (shifted: the extra zero slot at the end is the total)
    starts = torch.cat([starts.new_zeros(1), starts[:-1]])
    return starts, int(starts[-1].item())


def gather_changed(pieces: Sequence[tuple[torch.Tensor, torch.Tensor]], offsets: Sequence[int], starts: torch.Tensor,
                   positions: torch.Tensor) -> None:
    """`count_changed`'s `pieces` again, with each piece's first word's position in the bucket (`offsets`) and that
    call's `starts`: writes the position of every word that differs into `positions` (int32, as long as the count),
    ascending, and those words into the base (the base then equals the caller's words). Not synchronised. Raises where a
    kernel cannot run (the base may then be written in part)."""
    kernels = _build()
    if kernels is None:
        raise RuntimeError(f"the diff kernels are off: {_off}")
    _count, gather = kernels
    at = 0
    for (src, base), lo in zip(pieces, offsets, strict=True):
        n = _check_pair(src, base)
        p = _programs(n)
        if p:
            gather[(p,)](src, base, starts[at : at + p], positions, n, lo, BLOCK=BLOCK, ITERS=ITERS)
        at += p


def _check_pair(src: torch.Tensor, base: torch.Tensor) -> int:
    if src.dim() != 1 or base.shape != src.shape or base.dtype != src.dtype or src.device != base.device:
        raise ValueError(f"pieces must be two 1-D tensors alike, got {tuple(src.shape)} {src.dtype} {src.device} and "
                         f"{tuple(base.shape)} {base.dtype} {base.device}")
    if not (src.is_contiguous() and base.is_contiguous()):
        raise ValueError("pieces must be contiguous")
    return int(src.numel())


def reference_changed(pieces: Sequence[tuple[torch.Tensor, torch.Tensor]], offsets: Sequence[int]) -> torch.Tensor:
    """The specification, by torch operations: the positions (int32, ascending) of the words that differ, each base
    piece then written with the caller's words (as the torch path of `rollpool.weights.delta_device` does)."""
    found: list[torch.Tensor] = []
    for (src, base), lo in zip(pieces, offsets, strict=True):
        found.append((torch.nonzero(torch.ne(src, base)).squeeze(1) + lo).to(torch.int32))
        base.copy_(src)
    return torch.cat(found) if found else torch.empty(0, dtype=torch.int32)


def self_check(device: torch.device) -> bool:
    """Compare the kernels with `reference_changed` on random words of `device` (two pieces at an offset, with runs
    of changes across block and program boundaries) and switch them off if they differ. True when they are on after."""
    if not enabled():
        return False
    g = torch.Generator(device="cpu").manual_seed(11)
    sizes, offsets = (3 * BLOCK * ITERS + 517, 2 * BLOCK + 3), (64, 3 * BLOCK * ITERS + 1000)
    mine: list[tuple[torch.Tensor, torch.Tensor]] = []
    theirs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for n in sizes:
        base = torch.randint(-(1 << 15), 1 << 15, (n,), dtype=torch.int16, generator=g)
        src = base.clone()
        hit = torch.rand(n, generator=g) < 0.03
        hit[BLOCK - 3 : BLOCK + 3] = True  # a run across a block's end
        src[hit] ^= 1
        mine.append((src.to(device), base.to(device)))
        theirs.append((src.clone(), base.clone()))
    want = reference_changed(theirs, offsets)
    try:
        starts, k = count_changed(mine)
        got = torch.empty(k, dtype=torch.int32, device=device)
        gather_changed(mine, offsets, starts, got)
        same = k == int(want.numel()) and torch.equal(got.cpu(), want) and all(
            torch.equal(b.cpu(), s) for (_s, b), (s, _b) in zip(mine, theirs, strict=True))
    except Exception as e:  # noqa: BLE001 - kernels that do not build or launch on this device
        switch_off(f"{type(e).__name__}: {e}")
        return False
    if not same:
        switch_off(f"their positions or base differ from the torch path's on {device}")
        return False
    return True
