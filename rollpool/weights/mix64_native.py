"""mix64 of host bytes in one compiled pass, without the GIL: a few lines of C built with the system's compiler.

A trainer publishing from CPU tensors over the staged shared-memory path has each host bucket's mix64 summed on the
CPU (`rollpool.weights.gpu._mix64_cpu`; the worker checks its GPU copy against it), and a worker rebuilding a delta on
the host checks the result the same way. In numpy that is six passes over every 1 MiB slice, and numpy's operations
take the GIL on the way in and out: on the H100 host the publisher's eight checksum threads summed about 1.2 GB/s
each, and at 8B the sums, not the copies, set when a version was applied (2.67 s of publish to applied). One pass
in C reads each word once and runs in the caller's thread with the GIL released (ctypes releases it around a
foreign call), so the checksum threads run side by side.

The source is built once per machine into the user's cache (`rollpool.weights.native`). The same function as
`mix64_reference` (its specification): compared with numpy on random bytes before first use
(`_self_check`), and switched off for the process, logged once, where it differs, no compiler is found
(``$CC``, else ``cc``), the build fails, or ``ROLLPOOL_MIX64_NATIVE=0``; numpy sums then.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path
from typing import Any

from rollpool.weights import native

__all__ = ["enabled", "library_path", "mix_words", "switch_off"]

_log = logging.getLogger("rollpool.weights.mix64_native")

_C1 = 0x9E3779B97F4A7C15
_SHIFT = 29
_SOURCE = f"""
#include <stdint.h>
#include <string.h>
/* The sum modulo 2^64 of v = (w_i + base + i) * C1; v ^= v >> {_SHIFT}, over n little-endian words at p (any
   alignment); the caller multiplies the sum by C2 (distributive modulo 2^64). Four sums in flight. */
uint64_t rollpool_mix64_words(const unsigned char *p, uint64_t n, uint64_t base) {{
    const uint64_t c1 = 0x{_C1:016X}ULL;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0, i = 0;
    for (; i + 4 <= n; i += 4) {{
        uint64_t w[4];
        memcpy(w, p + 8 * i, 32);
        uint64_t v0 = (w[0] + base + i) * c1, v1 = (w[1] + base + i + 1) * c1;
        uint64_t v2 = (w[2] + base + i + 2) * c1, v3 = (w[3] + base + i + 3) * c1;
        s0 += v0 ^ (v0 >> {_SHIFT}); s1 += v1 ^ (v1 >> {_SHIFT});
        s2 += v2 ^ (v2 >> {_SHIFT}); s3 += v3 ^ (v3 >> {_SHIFT});
    }}
    for (; i < n; i++) {{
        uint64_t w;
        memcpy(&w, p + 8 * i, 8);
        uint64_t v = (w + base + i) * c1;
        s0 += v ^ (v >> {_SHIFT});
    }}
    return s0 + s1 + s2 + s3;
}}
"""

_lock = threading.Lock()
_fn: Any = None
_path: Path | None = None
_off: str | None = None if os.environ.get("ROLLPOOL_MIX64_NATIVE", "1") != "0" else "ROLLPOOL_MIX64_NATIVE=0"


def enabled() -> bool:
    """Whether the compiled sum runs here (built, loaded and checked on first call; False for good after a failure)."""
    return _off is None and _load() is not None


def switch_off(reason: str) -> None:
    """numpy sums from now on in this process."""
    global _off
    if _off is None:
        _off = reason
        _log.warning("the compiled CPU mix64 is off, numpy sums host bytes from now on: %s", reason)


def library_path() -> Path | None:
    """The shared library in use (None where it is off or not yet built)."""
    return _path if _off is None else None


def mix_words(buf: Any, nwords: int, base_word: int) -> int:
    """The sum (modulo 2^64, before the multiply by C2) of the first `nwords` words of `buf` (an object with the
    buffer protocol, e.g. a numpy array: its first byte is word `base_word` of a bucket). Raises where not `enabled`."""
    fn = _load()
    if fn is None:
        raise RuntimeError(f"the compiled CPU mix64 is off: {_off}")
    return int(fn(native.address(buf), nwords, base_word & ((1 << 64) - 1)))


def _load() -> Any:
    global _fn, _path
    if _fn is not None or _off is not None:
        return _fn
    with _lock:
        if _fn is not None or _off is not None:
            return _fn
        try:
            path = _build()
            lib = ctypes.CDLL(str(path))  # CDLL, not PyDLL: the GIL is released around each call
            fn = lib.rollpool_mix64_words
            fn.restype = ctypes.c_uint64
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64]
        except Exception as e:  # noqa: BLE001 - no compiler, a failed build, a library that does not load
            switch_off(f"{type(e).__name__}: {e}")
            return None
        why = _self_check(fn)
        if why:
            switch_off(why)
            return None
        _fn, _path = fn, path
        _log.debug("the compiled CPU mix64 is on: %s", path)
        return _fn


def _build() -> Path:
    return native.build("mix64", _SOURCE)


def _self_check(fn: Any) -> str | None:
    """Why the built function is not mix64 (compared with numpy on random bytes at an odd word offset and an odd
    length, as a bucket's middle and tail), or None when it is."""
    import numpy as np

    words = np.random.default_rng(5).integers(0, 1 << 63, size=4099, dtype=np.uint64) * np.uint64(3)
    base = 123_457
    with np.errstate(over="ignore"):
        v = np.multiply(words + np.arange(base, base + words.size, dtype=np.uint64), np.uint64(_C1), dtype=np.uint64)
        v ^= np.right_shift(v, np.uint64(_SHIFT))
        want = int(v.sum(dtype=np.uint64))
    got = int(fn(words.ctypes.data, words.size, base))
    return None if got == want else f"its sum differs from numpy's ({got} != {want})"
