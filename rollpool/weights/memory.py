"""Host memory for weight buckets: reusable buffers, page-locked within a budget, and shared-memory segments.

Guarantees
    - `BufferPool` hands out 1-D uint8 CPU tensors by exact size and takes them
      back; `reserve` allocates (and touches, so no page fault is left for the
      first version) a whole layout's buffers ahead of time. Page-locked
      buffers are made only while CUDA is available and the pool's
      `pinned_budget_bytes` allows; beyond it buffers are pageable (counted).
    - Shared-memory buffers (`ShmBuffer`) are POSIX segments in ``/dev/shm``
      named ``rollpool-<pool>-<publisher id>-<owner>-<n>``, created ``O_EXCL``
      with mode 0600 (only the same user maps them), their blocks reserved with
      ``posix_fallocate`` (a full ``/dev/shm`` fails at allocation with ENOSPC,
      never later with SIGBUS), unlinked on `close`, at exit, by a reaper child
      when the owner dies in any way (SIGKILL included: the child sees its pipe
      close), and by `sweep_stale_segments` for owners that are gone.
    - Ownership is judged by a lock, not a pid: ``<owner>`` is a random id made
      once per process (``o`` + 16 hex digits, made again in a forked child),
      and the process holds an exclusive `flock` on ``/dev/shm/rollpool.owner.<owner>``
      while it lives. The kernel drops the lock with the process however it
      ends, and a lock on one tmpfs file is seen from every PID namespace that
      shares the mount, so a trainer restarted in a new container (PID 1 again,
      its reaper gone with the old namespace) still finds its predecessor's
      segments stale. A sweep unlinks a segment whose owner's lock can be taken
      (or whose lock file is gone), then the lock file. Segments of older builds
      (a pid where the owner id is) are judged by that pid, as before.
    - Each segment starts with a 4 KiB header: magic, the version whose bytes
      it holds (-1 while being written) and a write generation. A reader takes
      the generation before and after copying: a change means the publisher
      reused the buffer under it (a torn read), caught before the checksum.

Nothing here talks to a socket.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import re
import secrets
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch

from rollpool.weights.gpu import DeviceSlabs, arena_offsets

__all__ = [
    "SHM_DIR",
    "SHM_HEADER_BYTES",
    "BufferPool",
    "ShmBuffer",
    "ShmReader",
    "ShmUnavailableError",
    "empty_pinned_cache",
    "VersionBuffers",
    "host_key",
    "shm_free_bytes",
    "sweep_stale_segments",
    "segment_prefix",
    "segment_owner",
    "wait_released",
]

log = logging.getLogger(__name__)
_sub_log = logging.getLogger("rollpool.weights.subscriber")
"""`VersionBuffers` logs as the subscriber it serves."""

SHM_DIR = "/dev/shm"
SHM_HEADER_BYTES = 4096
"""The header page before a segment's bucket bytes (keeps the bytes page-aligned)."""
_MAGIC = b"RPWSHM01"
_HEADER = struct.Struct("<8sqq")  # magic, version, generation
_NAME_OK = re.compile(r"[^A-Za-z0-9_.]")
_SHM_HEADROOM_BYTES = 64 * 1024 * 1024
"""Left free in /dev/shm beyond what a reservation needs (other users of the host)."""


class ShmUnavailableError(OSError):
    """A shared-memory segment cannot be made or mapped here (no room, no /dev/shm, another user's)."""


def host_key() -> str:
    """This host's identity for the same-host paths: boot id and the /dev/shm mount seen from here.

    Two processes with the same key see the same /dev/shm (same machine, same
    boot, same tmpfs, so also containers that share one); the subscriber still
    proves it by mapping the segment and checking its header.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = os.uname().nodename
    try:
        st = os.stat(SHM_DIR)
        shm = f"{st.st_dev:x}.{st.st_ino:x}"
    except OSError:
        shm = "none"
    return f"{boot}/{shm}"


def shm_free_bytes() -> int:
    """Bytes free in /dev/shm (0 where there is none)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return int(st.f_bavail) * int(st.f_frsize)


def segment_prefix(pool: str, publisher_id: str) -> str:
    return f"rollpool-{_NAME_OK.sub('_', pool)}-{_NAME_OK.sub('_', publisher_id)}-"


_OWNER_LOCK = "rollpool.owner."
_OWNER_RE = re.compile(r"o[0-9a-f]{16}")


class _Owner:
    """This process's owner id and the lock it holds while it lives (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._id = ""
        self._fd = -1

    def id(self) -> str:
        with self._lock:
            if not self._id:
                owner = f"o{secrets.token_hex(8)}"
                # locked under another name, then renamed: a sweep never sees the lock file unlocked
                staging = os.path.join(SHM_DIR, f"rollpool.owning.{owner}")
                try:
                    fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                except OSError as exc:
                    raise ShmUnavailableError(exc.errno, f"cannot create the owner lock {staging}: {exc.strerror}") from exc
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    os.rename(staging, os.path.join(SHM_DIR, _OWNER_LOCK + owner))
                except BaseException:
                    os.close(fd)
                    with contextlib.suppress(OSError):
                        os.unlink(staging)
                    raise
                self._id, self._fd = owner, fd
                _reaper.track(_OWNER_LOCK + owner, True)
            return self._id

    def after_fork(self) -> None:
        """In a forked child: the parent's id and lock are the parent's (the inherited fd is closed, not unlocked)."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._lock = threading.Lock()
        self._id, self._fd = "", -1

    def release(self) -> None:
        if self._id:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM_DIR, _OWNER_LOCK + self._id))
            _reaper.track(_OWNER_LOCK + self._id, False)


_owner = _Owner()
os.register_at_fork(after_in_child=_owner.after_fork)


def segment_owner() -> str:
    """This process's owner id, as it appears in the names of the segments it makes (its lock taken on first use)."""
    return _owner.id()


def _owner_gone(owner: str) -> bool:
    """Whether the process that owns segments named with `owner` has ended (False when it cannot be told)."""
    if owner.isdigit():  # a segment of an older build: named by its owner's pid
        try:
            os.kill(int(owner), 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False
    if not _OWNER_RE.fullmatch(owner) or owner == _owner._id:
        return False
    try:
        fd = os.open(os.path.join(SHM_DIR, _OWNER_LOCK + owner), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True  # its owner unlinked it at exit, or a sweep did
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return False  # held: the owner lives (in this PID namespace or another one on this mount)
    finally:
        os.close(fd)
    return True


def sweep_stale_segments(pool: str | None = None) -> list[str]:
    """Unlink this user's rollpool segments (of `pool`, or all) whose owner has ended, and those owners' lock
    files; the segments' names."""
    removed: list[str] = []
    prefix = "rollpool-" if pool is None else f"rollpool-{_NAME_OK.sub('_', pool)}-"
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    uid = os.getuid()
    verdicts: dict[str, bool] = {}
    for name in names:
        parts = name.rsplit("-", 2)  # rollpool-<pool>-<publisher id>-<owner>-<n>
        if not name.startswith(prefix) or len(parts) != 3 or not parts[2].isdigit():
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if os.stat(path).st_uid != uid:
                continue
        except OSError:
            continue
        owner = parts[1]
        if owner not in verdicts:
            verdicts[owner] = _owner_gone(owner)
        if verdicts[owner]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(name)
    for name in names:  # the locks of owners that are gone (with no segment left, or every one just unlinked)
        owner = name[len(_OWNER_LOCK):] if name.startswith(_OWNER_LOCK) else ""
        if owner and verdicts.get(owner, True) and _owner_gone(owner):
            with contextlib.suppress(OSError):
                if os.stat(os.path.join(SHM_DIR, name)).st_uid == uid:
                    os.unlink(os.path.join(SHM_DIR, name))
    if removed:
        log.info("removed %d stale shared-memory weight segments of publishers that are gone", len(removed))
    return removed


# --------------------------------------------------------------------------- the reaper

_REAPER_CODE = r"""
import os, sys
SHM_DIR = sys.argv[1]
names = set()
for line in sys.stdin:
    op, _, name = line.strip().partition(" ")
    if op == "+":
        names.add(name)
    elif op == "-":
        names.discard(name)
for name in names:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except OSError:
        pass
"""


class _Reaper:
    """A child that unlinks the segments this process still holds once its pipe closes (this process died)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def _pipe(self) -> Any:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _REAPER_CODE, SHM_DIR], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, close_fds=True, start_new_session=True,
            )
        return self._proc.stdin

    def track(self, name: str, add: bool) -> None:
        with self._lock:
            try:
                pipe = self._pipe()
                pipe.write(f"{'+' if add else '-'} {name}\n".encode())
                pipe.flush()
            except OSError:
                log.warning("shared-memory reaper unavailable; %s is unlinked only by close() or the next sweep", name)

    def close(self, timeout_s: float = 2.0) -> None:
        """At a normal exit: close the pipe (the reaper unlinks what is left and exits) and reap it, so no child
        outlives its handle (Python warns of a subprocess "still running" when the handle is collected)."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


_reaper = _Reaper()
_live: dict[str, ShmBuffer] = {}


@atexit.register
def _unlink_all() -> None:
    for buf in list(_live.values()):
        buf.close()
    _owner.release()  # before the reaper closes: releasing tells the reaper, which would start a new one after
    _reaper.close()


# --------------------------------------------------------------------------- segments


class ShmBuffer:
    """One bucket buffer in a shared-memory segment owned by this process (see the module docstring)."""

    def __init__(self, name: str, nbytes: int, *, pin: bool = False) -> None:
        self.name = name
        self.nbytes = nbytes
        self.path = os.path.join(SHM_DIR, name)
        size = SHM_HEADER_BYTES + nbytes
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise ShmUnavailableError(exc.errno, f"cannot create {self.path}: {exc.strerror}") from exc
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise ShmUnavailableError(exc.errno or errno.ENOSPC, f"/dev/shm has no room for {size} bytes ({exc.strerror})") from exc
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise
        os.close(fd)
        _live[name] = self
        _reaper.track(name, True)
        self._header = memoryview(self._mmap)[:SHM_HEADER_BYTES]
        self._generation = 0
        self._write_header(-1)
        self.data = torch.frombuffer(self._mmap, dtype=torch.uint8, offset=SHM_HEADER_BYTES, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
        self.pinned = False
        if pin:
            self.pinned = _cuda_register(self.data)

    def _write_header(self, version: int) -> None:
        _HEADER.pack_into(self._header, 0, _MAGIC, version, self._generation)

    def begin_write(self) -> None:
        """The bytes are about to change: readers of the old version will see a new generation."""
        self._generation += 1
        self._write_header(-1)

    def end_write(self, version: int) -> None:
        self._write_header(version)

    def close(self) -> None:
        if _live.pop(self.name, None) is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        _reaper.track(self.name, False)
        if self.pinned:
            _cuda_unregister(self.data)
        # the mapping itself goes with the last tensor view of it (torch keeps the buffer alive)


class ShmReader:
    """A subscriber's read-only mapping of a publisher's segment.

    `register()` page-locks the mapped bucket bytes for this process's CUDA context (once, at map time: the publisher
    reuses its segments across versions, so later versions copy host-to-device at full speed); the mapping stays
    read-only where CUDA can register it so (``cudaHostRegisterReadOnly``), else it is mapped again read-write (this
    process never writes it) and registered plainly."""

    def __init__(self, name: str, nbytes: int, *, writable: bool = False) -> None:
        if "/" in name or not name.startswith("rollpool-"):
            raise ShmUnavailableError(errno.EINVAL, f"not a rollpool segment name: {name!r}")
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        except OSError as exc:
            raise ShmUnavailableError(exc.errno, f"cannot open {path}: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            size, inode = st.st_size, st.st_ino
            if size != SHM_HEADER_BYTES + nbytes:
                raise ShmUnavailableError(errno.EINVAL, f"{path} holds {size} bytes, the manifest says {SHM_HEADER_BYTES + nbytes}")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)
        self.writable = writable
        self.registered = False
        self._tensor: torch.Tensor | None = None
        self.name = name
        self.nbytes = nbytes
        self._inode = inode
        self.view = memoryview(self._mmap)
        magic, _v, _g = _HEADER.unpack_from(self.view, 0)
        if magic != _MAGIC:
            self.close()
            raise ShmUnavailableError(errno.EINVAL, f"{path} is not a rollpool weight segment")

    def alive(self) -> bool:
        """Whether the name still names this mapping's segment (not unlinked and made again)."""
        try:
            return os.stat(os.path.join(SHM_DIR, self.name)).st_ino == self._inode
        except OSError:
            return False

    def state(self) -> tuple[int, int]:
        """(the version it holds, -1 while written; its write generation)."""
        _m, version, generation = _HEADER.unpack_from(self.view, 0)
        return int(version), int(generation)

    def bytes(self, offset: int, nbytes: int) -> memoryview:
        start = SHM_HEADER_BYTES + offset
        return self.view[start : start + nbytes]

    def host_tensor(self) -> torch.Tensor:
        """The bucket bytes as a 1-D uint8 CPU tensor over the mapping (made once; never written here)."""
        if self._tensor is None:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a read-only mapping: torch warns that the buffer is not writable
                self._tensor = (torch.frombuffer(self._mmap, dtype=torch.uint8, offset=SHM_HEADER_BYTES, count=self.nbytes)
                                if self.nbytes else torch.empty(0, dtype=torch.uint8))
        return self._tensor

    def register(self) -> bool:
        """Page-lock the mapped bucket bytes for CUDA (read-only registration on a read-only mapping); False where it
        cannot (then copies run from pageable memory, slower)."""
        if self.registered:
            return True
        self.registered = _cuda_register(self.host_tensor(), 0 if self.writable else _CUDA_HOST_REGISTER_READ_ONLY)
        return self.registered

    def close(self) -> None:
        if self.registered and self._tensor is not None:
            _cuda_unregister(self._tensor)
            self.registered = False
        self._tensor = None
        with contextlib.suppress(BufferError, ValueError):
            self.view.release()
            self._mmap.close()


# --------------------------------------------------------------------------- CUDA registration (GPU only)


_CUDA_HOST_REGISTER_READ_ONLY = 0x08
"""``cudaHostRegisterReadOnly``: the device only reads the memory (needed to register a read-only mapping)."""


def _cuda_register(t: torch.Tensor, flags: int = 0) -> bool:
    """Page-lock existing host memory (a shared segment) for full-speed device copies; False where it cannot."""
    if not torch.cuda.is_available() or t.numel() == 0:
        return False
    try:
        rc = torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
            t.data_ptr(), t.numel(), flags)
    except Exception:  # noqa: BLE001 - an optimisation: pageable memory still works
        return False
    return int(rc) == 0 if not hasattr(rc, "value") else int(rc.value) == 0


_releaser_pool: Any = None
_releaser_lock = threading.Lock()


def _releaser() -> Any:
    """The one thread that releases dropped buffers (`BufferPool.drop(background=True)`), made on first use."""
    global _releaser_pool
    with _releaser_lock:
        if _releaser_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            _releaser_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollpool-weight-release")
        return _releaser_pool


def _release(segs: list[ShmBuffer], bufs: list[torch.Tensor], pinned_host: bool = False) -> None:
    """Unlink and unregister `segs`, then let the last references to `bufs` go (the unmapping happens here); with
    `pinned_host` (some of `bufs` page-locked by torch's host allocator) that allocator's cache is emptied after."""
    for seg in segs:
        try:
            seg.close()
        except Exception:  # a release that fails leaves the reaper and the sweep to unlink it
            log.warning("releasing weight segment %s failed", seg.name, exc_info=True)
    segs.clear()
    bufs.clear()
    if pinned_host:
        empty_pinned_cache()


def empty_pinned_cache() -> None:
    """Give the page-locked host memory torch's host allocator keeps for reuse back to the system. A freed pinned
    tensor stays allocated in that cache until this is called, so dropping a whole version of page-locked host buckets
    (`trim_spares` after a path switch, `close`) freed nothing: at 8B, 14.5 GB a version stayed resident beside the
    next path's segments. Only where CUDA is initialised (no pinned memory otherwise); the API differs by torch release."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):  # type: ignore[no-untyped-call]
        return
    accel = getattr(torch, "accelerator", None)
    for fn in (getattr(getattr(accel, "memory", None), "empty_host_cache", None), getattr(torch._C, "_host_emptyCache", None),
               getattr(torch._C, "_accelerator_emptyHostCache", None)):
        if fn is not None:
            try:
                fn()
            except Exception:  # the memory stays cached, as before
                log.debug("emptying torch's pinned host cache failed", exc_info=True)
                continue
            return


def wait_released() -> None:
    """Block until every buffer dropped in the background so far is released (tests, shutdown)."""
    with _releaser_lock:
        pool = _releaser_pool
    if pool is not None:
        pool.submit(lambda: None).result()


def _cuda_unregister(t: torch.Tensor) -> None:
    with contextlib.suppress(Exception):
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())  # type: ignore[no-untyped-call]


# --------------------------------------------------------------------------- the pool


class BufferPool:
    """Reusable bucket buffers: plain, page-locked (within a budget) or shared-memory segments.

    `kind` is ``"host"`` (ordinary memory) or ``"shm"`` (segments named with
    `pool` and `owner_id`). `pin` asks for page-locked memory while CUDA is
    available; `pinned_budget_bytes` bounds it (None: no bound). Its lists are
    kept under a lock, so threads may take, give and reserve at once; a buffer
    is made outside it (making a segment of a gigabyte takes tenths of a second).
    """

    def __init__(self, *, kind: str = "host", pin: bool = False, pinned_budget_bytes: int | None = None,
                 pool: str = "default", owner_id: str = "") -> None:
        if kind not in ("host", "shm"):
            raise ValueError(f"buffer kind must be 'host' or 'shm', got {kind!r}")
        if pinned_budget_bytes is not None and pinned_budget_bytes < 0:
            raise ValueError(f"pinned_budget_bytes must be >= 0, got {pinned_budget_bytes}")
        self.kind = kind
        self.pin = pin
        self.pinned_budget_bytes = pinned_budget_bytes
        self.prefix = segment_prefix(pool, owner_id)
        self._free: dict[int, list[torch.Tensor]] = {}
        self._segments: dict[int, ShmBuffer] = {}  # data_ptr -> segment
        self._counter = 0
        self._lock = threading.RLock()
        self.pinned_bytes = 0
        self.allocated_bytes = 0
        self.allocations = 0
        """Buffers made fresh (a warm pool makes none)."""
        self.unpinned_over_budget = 0

    def segment_of(self, buf: torch.Tensor) -> ShmBuffer | None:
        return self._segments.get(buf.data_ptr()) if buf.numel() else None

    def segments(self) -> list[ShmBuffer]:
        """Every segment this pool holds now (free or in use)."""
        with self._lock:
            return list(self._segments.values())

    def take(self, nbytes: int, *, ok: Any = None) -> torch.Tensor:
        """A buffer of exactly `nbytes`: a free one (for which `ok(buf)` holds), else a fresh one."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                for i in range(len(free) - 1, -1, -1):
                    if ok is None or ok(free[i]):
                        return free.pop(i)
        return self._new(nbytes)

    def take_at_least(self, nbytes: int) -> torch.Tensor:
        """The smallest free buffer of at least `nbytes` (a view of its first `nbytes`), else a fresh one of exactly `nbytes`."""
        buf = self.take_free(nbytes)
        return buf if buf is not None else self._new(nbytes)

    def take_free(self, nbytes: int) -> torch.Tensor | None:
        """The smallest free buffer of at least `nbytes`, or None when none is free (nothing is made)."""
        with self._lock:
            best = self._smallest_free(nbytes)
            if best is None:
                return None
            buf = self._free[best].pop()
            if not self._free[best]:
                del self._free[best]
            return buf

    def has_free(self, nbytes: int) -> bool:
        """Whether `take_at_least(nbytes)` would find a free buffer."""
        with self._lock:
            return self._smallest_free(nbytes) is not None

    def _smallest_free(self, nbytes: int) -> int | None:
        best: int | None = None
        for size, bufs in self._free.items():
            if size >= nbytes and bufs and (best is None or size < best):
                best = size
        return best

    def give(self, bufs: Iterable[torch.Tensor]) -> None:
        with self._lock:
            for b in bufs:
                self._free.setdefault(int(b.numel()), []).append(b)

    def free_sizes(self) -> list[int]:
        with self._lock:
            return [n for n, v in self._free.items() for _ in v]

    def free_bytes(self) -> int:
        with self._lock:
            return sum(n * len(v) for n, v in self._free.items())

    def trim(self, keep_bytes: int) -> None:
        """Drop free buffers (oldest first) until at most `keep_bytes` are held free."""
        victims: list[torch.Tensor] = []
        with self._lock:
            while self.free_bytes() > keep_bytes:
                size = max(self._free, key=lambda n: n * len(self._free[n]))
                victims.append(self._free[size].pop(0))
                if not self._free[size]:
                    del self._free[size]
        self.drop(victims, background=False)  # (released outside the lock: unmapping gigabytes takes tenths of a second)

    def reserve(self, sizes: Iterable[int]) -> list[torch.Tensor]:
        """Allocate (and touch) one buffer per size into the free list, ahead of the first version; the buffers made."""
        made = [self._new(n) for n in sizes]
        for b in made:
            if b.numel() and not b.is_pinned():
                b.zero_()  # fault the pages in now, not during the first version
        self.give(made)
        return made

    def close(self) -> None:
        with self._lock:
            for seg in list(self._segments.values()):
                seg.close()
            self._segments.clear()
            self._free.clear()

    def _new(self, nbytes: int) -> torch.Tensor:
        with self._lock:  # (the counts; the buffer is made outside the lock)
            self.allocations += 1
            self.allocated_bytes += nbytes
            want_pin = self.pin and torch.cuda.is_available() and nbytes > 0
            if want_pin and self.pinned_budget_bytes is not None and self.pinned_bytes + nbytes > self.pinned_budget_bytes:
                want_pin = False
                self.unpinned_over_budget += 1
            if want_pin:
                self.pinned_bytes += nbytes  # (given back below where the memory could not be page-locked)
            self._counter += 1
            name = f"{self.prefix}{segment_owner()}-{self._counter}"
        if self.kind == "shm":
            seg = ShmBuffer(name, nbytes, pin=want_pin)
            with self._lock:
                if want_pin and not seg.pinned:
                    self.pinned_bytes -= nbytes
                if nbytes:
                    self._segments[seg.data.data_ptr()] = seg
            return seg.data
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=want_pin)
        except BaseException:
            with self._lock:
                if want_pin:
                    self.pinned_bytes -= nbytes
            raise

    def drop(self, bufs: list[torch.Tensor], *, background: bool = True) -> None:
        """Forget these buffers of this pool (the list is emptied: the caller keeps no reference): each segment is
        unlinked and unregistered and the memory freed with its last view. With `background` that release runs in
        one releasing thread: unregistering gigabytes of page-locked memory and unmapping them takes a fraction of
        a second per 14 GB (0.41 s on the H200's host), which a trainer's `publish` need not wait for."""
        segs: list[ShmBuffer] = []
        pinned_host = False
        with self._lock:
            for buf in bufs:
                seg = self._segments.pop(buf.data_ptr(), None) if buf.numel() else None
                # asked before the close: a segment's bytes are no longer page-locked once it is unregistered
                pinned = seg.pinned if seg is not None else buf.is_pinned()
                if seg is not None:
                    segs.append(seg)
                if pinned:
                    self.pinned_bytes -= int(buf.numel())
                    pinned_host = pinned_host or seg is None
        held = list(bufs)
        bufs.clear()
        if background and (segs or held):
            _releaser().submit(_release, segs, held, pinned_host)
        else:
            _release(segs, held, pinned_host)


# --------------------------------------------------------------------------- a subscriber's versions


class VersionBuffers:
    """A subscriber's buffers, one per version: a host buffer of the version's total size, carved into its buckets'
    views (`take`), so neither the tensor order nor the publisher's bucket size has to match a reservation.

    - `reserve` allocates (and touches) them for a number of versions ahead of the first (page-locked when made with
      `pin`, within `pinned_budget_bytes`); free buffers that already fit a version count towards them, so a second
      call tops up. `reserve_in_background` does it in a thread; `reserved` waits for that thread (a fetch does,
      before it takes a buffer).
    - Buffers given back (`give`) take the next versions; beyond the reserve they are freed.
    - `slabs` are the device buffers of the device paths (the same GPU, shared memory staged to a GPU):
      `reserve_device` allocates them ahead, and a device slab given back is trimmed to the reserve too.
    """

    def __init__(self, *, pin: bool, pinned_budget_bytes: int | None, slabs: DeviceSlabs) -> None:
        self.pool = BufferPool(kind="host", pin=pin, pinned_budget_bytes=pinned_budget_bytes)
        self.slabs = slabs
        self.reserved_versions = 0
        self._reserving: threading.Thread | None = None
        self._warned = False

    @property
    def buffers_allocated(self) -> int:
        """Host buffers made fresh so far (reserved ones included; a warm subscriber makes none per version)."""
        return self.pool.allocations

    @property
    def pinned_bytes(self) -> int:
        return self.pool.pinned_bytes

    @property
    def pinned_budget_bytes(self) -> int | None:
        """The most page-locked bucket memory allocated (None: no bound)."""
        return self.pool.pinned_budget_bytes

    def reserve(self, total_bytes: int, versions: int, device: Any = None) -> int:
        """Host buffers for `versions` versions of `total_bytes` (and, with `device`, one version's device slab first:
        quick, and the device paths do not wait for the host buffers); returns the host bytes."""
        if versions < 1:
            raise ValueError(f"versions must be >= 1, got {versions}")
        t0 = time.perf_counter()
        if device is not None:
            # one version's device slab: a second is made on demand, only while two versions are on the device at
            # once (one waiting for its apply while the next is fetched); two reserved idle cost the worker's GPU a
            # whole model more (at 8B with an 8 GiB optimizer beside the trainer on one 80 GB card, an OOM)
            self.reserve_device(total_bytes, device, 1)
        have = sum(1 for n in self.pool.free_sizes() if n >= total_bytes)
        self.pool.reserve([total_bytes] * max(0, versions - have))
        self.reserved_versions = max(self.reserved_versions, versions)
        _sub_log.info("weights reserved %s", json.dumps({"bytes": total_bytes * versions, "pinned_bytes": self.pool.pinned_bytes,
                                                    "device": str(device), "seconds": round(time.perf_counter() - t0, 3),
                                                    "at": time.time()}))
        return total_bytes * versions

    def reserve_in_background(self, total_bytes: int, versions: int, device: Any = None) -> None:
        """`reserve` in a thread (page-locking 2 x 14.5 GB takes seconds; the event loop and its heartbeats go on)."""
        if self._reserving is not None:
            self._reserving.join()
        self._reserving = threading.Thread(target=self.reserve, args=(total_bytes, versions, device), name="weights-reserve", daemon=True)
        self._reserving.start()

    async def reserved(self) -> None:
        """Wait for a reserve running in the background."""
        if self._reserving is not None:
            await asyncio.to_thread(self._reserving.join)
            self._reserving = None

    def reserve_device(self, total_bytes: int, device: Any, versions: int = 2) -> int:
        """The device slabs for `versions` versions, allocated now (else the first such fetch does)."""
        # room for every bucket's alignment padding too (ARENA_ALIGN each; 1 MiB covers 4096 buckets)
        slabs = [self.slabs.take_at_least(arena_offsets([total_bytes])[1] + (1 << 20), device) for _ in range(versions)]
        for s in slabs:
            self.slabs.give(s)
        return sum(int(s.numel()) for s in slabs)

    def take(self, sizes: list[int], version: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(one buffer of the sizes' total, the views carved from it in order) for `version`'s buckets."""
        total = sum(sizes)
        free = self.pool.free_sizes()
        if self.reserved_versions and free and max(free) < total and not self._warned:
            self._warned = True
            _sub_log.warning("weight version %d takes %d bytes, more than the %d reserved per version: fresh buffers are "
                        "allocated (and the reserved ones dropped when unused)", version, total, max(free))
        slab = self.pool.take_at_least(total)
        views: list[torch.Tensor] = []
        pos = 0
        for n in sizes:
            views.append(slab[pos : pos + n])
            pos += n
        return slab, views

    def give(self, slab: torch.Tensor | None, buffers: Iterable[torch.Tensor] = ()) -> None:
        """A version's buffer back (a device slab to the slabs): the next fetch takes it; beyond the reserve, freed."""
        if slab is not None and slab.is_cuda:
            self.slabs.give(slab)
            self.slabs.trim(max(self.reserved_versions, 2))
            return
        bufs = [slab] if slab is not None else list(buffers)
        self.pool.give(bufs)
        self.pool.trim(max(self.reserved_versions, 1) * max((int(b.numel()) for b in bufs), default=0))

    def close(self) -> None:
        self.pool.close()
        self.slabs.trim(0)
