"""A few lines of C built once per machine with the system's compiler and loaded with ctypes (which releases the
interpreter lock around each foreign call): the compiled CPU mix64 (`rollpool.weights.mix64_native`) and the bulk
lane's send loop (`rollpool.weights.paths.lane_native`).

A library is built into the user's cache (``$ROLLPOOL_CACHE_DIR``, else ``$XDG_CACHE_HOME`` or ``~/.cache``, then
``rollpool/``; a temporary folder where none is writable), named by its source's and the compiler's hash and written
under a temporary name then renamed, so processes building at once each get a whole library; a folder or a library
another user may write is never loaded from. The compiler is ``$CC``, else ``cc``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["address", "build", "cache_dirs"]


def build(name: str, source: str) -> Path:
    """The shared library of `source` (C), built now unless the cache holds it; raises where it cannot be built."""
    cc = os.environ.get("CC") or "cc"
    exe = shutil.which(cc)
    if exe is None:
        raise FileNotFoundError(f"no C compiler ({cc!r}) on PATH")
    flags = ["-O3", "-shared", "-fPIC"]
    key = hashlib.sha256("\0".join([source, exe, *flags, os.uname().machine]).encode()).hexdigest()[:16]
    for folder in cache_dirs():
        target = folder / f"{name}-{key}.so"
        try:
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            if not _ours(folder):
                continue  # a folder another user made or may write (a shared /tmp): never load a library from it
            if target.exists():
                if _ours(target):
                    return target
                continue
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                src = Path(tmp) / f"{name}.c"
                src.write_text(source)
                out = Path(tmp) / f"{name}.so"
                done = subprocess.run([exe, *flags, "-o", str(out), str(src)], capture_output=True, text=True, timeout=120)
                if done.returncode != 0:
                    raise RuntimeError(f"{cc} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
                os.replace(out, target)  # whole or absent, for every process building at once
            return target
        except OSError:
            continue  # a cache folder we may not write: the next one
    raise PermissionError(f"no writable folder to build {name} in")


def address(buf: Any) -> int:
    """The address of the first byte of `buf` (a numpy array, or a writable object with the buffer protocol)."""
    iface = getattr(buf, "__array_interface__", None)
    if iface is not None:
        return int(iface["data"][0])
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _ours(path: Path) -> bool:
    """Whether `path` belongs to this user and no one else may write it."""
    st = path.stat()
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def cache_dirs() -> list[Path]:
    """Where libraries are built, in the order tried."""
    given = os.environ.get("ROLLPOOL_CACHE_DIR")
    if given:
        return [Path(given)]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [Path(base) / "rollpool", Path(tempfile.gettempdir()) / f"rollpool-{os.getuid()}"]
