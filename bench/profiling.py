"""Sampling profiles of a bench's running processes with py-spy: raw stacks, a text summary, the top functions.

`Sampler(out, duration_s).start({"worker": pid, ...})` runs, per role, one ``py-spy dump`` (the stacks at that
moment) and then ``py-spy record --format raw --nolineno`` for ``duration_s`` seconds (idle threads left out, py-spy's
default), and reads each process's CPU time from /proc at the start and the end of the window. `finish()` waits for
the recorders and writes ``profile-<role>.raw`` (py-spy's collapsed stacks), ``profile-<role>-dump.txt`` and
``profile-<role>.txt`` (the top 25 functions by own samples and by cumulative samples) into `out`, and returns, per
role, a dict for the result JSON: ``samples``, ``top_self`` and ``top_cum`` ([function, share of the role's samples]),
``cpu_s`` and ``cpu_share`` (CPU seconds over the window, all threads, over the window's wall time), or ``error``
(why sampling failed: no py-spy, no ptrace rights, the process gone) -- a failed profile never fails the bench.

Idle: py-spy leaves out threads it sees waiting, but counts some waits as running (a thread blocked in C under a
Python frame, one waiting for the GIL or for a core on a loaded host): the summary drops the known waiting leaves
(bench/episodes.py's ``IDLE_LEAVES`` and those below). With ``native`` (py-spy ``--native``) the leaf is the C call
itself, so waits are told apart better: blocking system calls and lock waits are dropped, and a condition wait under
any other frame is counted as a wait for the GIL (``gil_wait_share``, ``top_gil_wait``: the frames that waited) and
left out of the shares.

py-spy: the ``py-spy`` on PATH, else the manylinux wheel in ``<repo>/.gpuextra/`` (a GPU machine has no network:
that folder travels with the checkout), unpacked once into a temporary folder; the binary is the wheel's
``*.data/scripts/py-spy``.

ptrace: py-spy attaches with ptrace. Where Yama's ``ptrace_scope`` is 1, only an ancestor may attach, and py-spy
(a child of the bench) is no ancestor of the pool's processes: `ptrace_hook_env` gives the environment for the
processes to be profiled (a ``sitecustomize`` that calls ``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)`` in every
Python process started with it, then runs any other ``sitecustomize`` on the path), and `allow_ptrace_self` does the
same for the calling process. Where the scope is 0 or Yama is absent, neither changes anything.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import stat
import subprocess
import tempfile
import time
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TOP = 25
PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = -1  # (unsigned long)-1 in the kernel
# threads blocked in C that py-spy reports as running (beside bench/episodes.py's IDLE_LEAVES): a leaf frame that is
# the child watcher's waitpid or a lane thread's queue get
MORE_IDLE_LEAVES = ("_do_waitpid (asyncio/unix_events.py", "TokenizerLane._run (")
# with --native the leaf is the C call a thread waits in: the blocking system calls, and any wait under a Python lock
# (a thread pool's idle workers, a queue's get)
NATIVE_IDLE_LEAVES = ("wait4 (", "epoll_wait (", "poll (libc", "select (libc", "accept (libc", "accept4 (libc",
                      "nanosleep (libc", "clock_nanosleep (libc", "sigtimedwait (", "pause (libc")
LOCK_WAIT = ("PyThread_acquire_lock_timed (", "_queue_SimpleQueue_get_impl (")
# with --native, a condition wait right under any other frame is (on CPython 3.11-3.12) a thread taking the GIL back
GIL_WAIT_LEAVES = ("pthread_cond_wait (", "pthread_cond_timedwait (")

_HOOK = '''"""Written by bench/profiling.py: lets py-spy attach to this process where Yama's ptrace_scope is 1."""
import ctypes, importlib.machinery, importlib.util, os, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(0x59616D61, ctypes.c_ulong(-1 & 0xFFFFFFFFFFFFFFFF), 0, 0, 0)
except Exception:
    pass
_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:  # the sitecustomize this one hides
    _mod = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
'''


def ptrace_scope() -> int | None:
    """Yama's ptrace_scope (0 classic, 1 descendants only, 2 admin only, 3 none), None where Yama is absent."""
    try:
        return int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip())
    except (OSError, ValueError):
        return None


def ptrace_facts() -> dict[str, Any]:
    """What decides whether py-spy may attach: the Yama scope, the uid, CAP_SYS_PTRACE in the effective set."""
    cap = None
    with contextlib.suppress(OSError, ValueError, StopIteration):
        line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("CapEff:"))
        cap = bool(int(line.split()[1], 16) >> 19 & 1)  # CAP_SYS_PTRACE is bit 19
    return {"yama_ptrace_scope": ptrace_scope(), "uid": os.getuid(), "cap_sys_ptrace": cap}


def allow_ptrace_self() -> None:
    """Let any process of this user attach to this one (Yama scope 1); a no-op elsewhere."""
    if ptrace_scope() != 1:
        return
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, ctypes.c_ulong(PR_SET_PTRACER_ANY & 0xFFFFFFFFFFFFFFFF), 0, 0, 0)


def ptrace_hook_env(work: Path) -> dict[str, str]:
    """Environment additions that make every Python process started with them attachable (Yama scope 1 only)."""
    if ptrace_scope() != 1:
        return {}
    hook = work / "ptrace_hook"
    hook.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(_HOOK)
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": f"{hook}{os.pathsep}{path}" if path else str(hook)}


def find_pyspy() -> tuple[str | None, str]:
    """The py-spy binary and where it came from, or None and why not."""
    on_path = shutil.which("py-spy")
    if on_path:
        return on_path, "PATH"
    wheels = sorted(glob.glob(str(ROOT / ".gpuextra" / "py_spy-*manylinux*x86_64*.whl")))
    if not wheels:
        return None, f"no py-spy on PATH and no py_spy manylinux wheel in {ROOT / '.gpuextra'} (carry .gpuextra)"
    dest = Path(tempfile.gettempdir()) / f"rollpool-pyspy-{os.getuid()}" / Path(wheels[-1]).stem
    try:
        binary = next(iter(dest.glob("*.data/scripts/py-spy")), None)
        if binary is None:
            with zipfile.ZipFile(wheels[-1]) as zf:
                zf.extractall(dest)
            binary = next(iter(dest.glob("*.data/scripts/py-spy")), None)
        if binary is None:
            return None, f"{wheels[-1]} holds no *.data/scripts/py-spy"
        binary.chmod(binary.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    except (OSError, zipfile.BadZipFile) as exc:
        return None, f"unpacking {wheels[-1]}: {exc}"
    return str(binary), f"wheel {Path(wheels[-1]).name}"


def children(pid: int) -> list[tuple[int, list[str]]]:
    """All descendants of `pid` (breadth first) with their argv, read from /proc."""
    parent: dict[int, int] = {}
    argv: dict[int, list[str]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            st = (d / "stat").read_text()
            parent[int(d.name)] = int(st[st.rindex(")") + 2:].split()[1])
            argv[int(d.name)] = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
    out: list[tuple[int, list[str]]] = []
    todo = [pid]
    while todo:
        p = todo.pop(0)
        for c in sorted(k for k, v in parent.items() if v == p):
            out.append((c, argv.get(c, [])))
            todo.append(c)
    return out


def find_child(pid: int, *needles: str) -> int | None:
    """The first descendant of `pid` whose argv (joined by spaces) contains every needle."""
    for c, argv in children(pid):
        joined = " ".join(argv)
        if all(n in joined for n in needles):
            return c
    return None


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of the process (all its threads), in seconds."""
    try:
        st = Path(f"/proc/{pid}/stat").read_text()
        f = st[st.rindex(")") + 2:].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def summarize_raw(text: str, top: int = TOP) -> dict[str, Any]:
    """py-spy's raw (collapsed) stacks, root first, "a;b;c COUNT" a line: the top functions by own and cumulative samples."""
    from bench.episodes import IDLE_LEAVES, _category  # the episode bench's categories of where a turn's CPU goes

    own: Counter[str] = Counter()
    cum: Counter[str] = Counter()
    cats: Counter[str] = Counter()
    gil: Counter[str] = Counter()
    total = idle = 0
    for line in text.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        frames = stack.split(";")
        if any(m in frames[-1] for m in (*IDLE_LEAVES, *MORE_IDLE_LEAVES, *NATIVE_IDLE_LEAVES)) \
                or (frames[-1].endswith("(libc.so.6)") and any(f.startswith(LOCK_WAIT) for f in frames[-3:])):
            idle += count  # a wait py-spy took for running: not CPU
            continue
        cond = next((i for i in (len(frames) - 1, len(frames) - 2) if i > 0 and frames[i].startswith(GIL_WAIT_LEAVES)), None)
        if cond is not None:  # the libc frames under it are the futex call itself
            gil[frames[cond - 1]] += count
            continue
        total += count
        own[frames[-1]] += count
        cats[_category(stack)] += count
        for f in set(frames):
            cum[f] += count
    share = (lambda c: round(c / total, 4)) if total else (lambda c: 0.0)
    waits = sum(gil.values())
    out_gil = {"gil_wait_samples": waits, "gil_wait_share": round(waits / (total + waits), 4) if total + waits else 0.0,
               "top_gil_wait": [[f, round(c / waits, 4)] for f, c in gil.most_common(10)]} if waits else {}
    return {"samples": total, "idle_samples_left_out": idle, **out_gil, "share_by_category": {k: share(c) for k, c in cats.most_common()},
            "top_self": [[f, share(c)] for f, c in own.most_common(top)], "top_cum": [[f, share(c)] for f, c in cum.most_common(top)]}


def render(role: str, pid: int, info: dict[str, Any]) -> str:
    lines = [f"py-spy profile of {role} (pid {pid}): {info.get('samples', 0)} samples at {info.get('rate')} Hz over "
             f"{info.get('window_s')} s, idle threads left out; CPU {info.get('cpu_s')} s ({info.get('cpu_share')} of one core)"]
    if info.get("error"):
        lines.append(f"sampling failed: {info['error']}")
    if info.get("gil_wait_samples"):
        lines += ["", f"waiting for the GIL (--native): {info['gil_wait_samples']} samples, {info['gil_wait_share']:.1%} of the "
                      "non-idle ones, left out of the shares below; the frames that waited:"]
        lines += [f"  {s:6.1%} {f}" for f, s in info.get("top_gil_wait", [])]
    if info.get("share_by_category"):
        lines += ["", "by category (bench/episodes.py's PROFILE_CATEGORIES, the leaf-most frame that matches):"]
        lines += [f"  {s:6.1%} {c}" for c, s in info["share_by_category"].items()]
    for key, title in (("top_self", "own samples (the function itself was running)"),
                       ("top_cum", "cumulative samples (the function was on the stack)")):
        lines += ["", f"top {TOP} by {title}:", "  share  function"]
        lines += [f"  {s:6.1%} {f}" for f, s in info.get(key, [])]
    return "\n".join(lines) + "\n"


class Sampler:
    """py-spy on several processes at once for one window; see the module docstring."""

    def __init__(self, out: Path, duration_s: float, rate: int = 100, gil: bool = False, native: bool = False) -> None:
        self.out, self.duration_s, self.rate, self.gil, self.native = out, duration_s, rate, gil, native
        self.binary, self.source = find_pyspy()
        self._procs: dict[str, tuple[int, subprocess.Popen[bytes] | None, float | None]] = {}
        self.results: dict[str, dict[str, Any]] = {}
        self.t0 = 0.0

    def start(self, pids: dict[str, int | None]) -> None:
        self.t0 = time.time()
        for role, pid in pids.items():
            info: dict[str, Any] = {"pid": pid, "rate": self.rate, "gil_only": self.gil, "native": self.native, "pyspy": self.source}
            self.results[role] = info
            if pid is None:
                info["error"] = "process not found"
                continue
            cpu0 = cpu_seconds(pid)
            proc = None
            if self.binary is None:
                info["error"] = self.source
            else:
                try:
                    dump = subprocess.run([self.binary, "dump", "--pid", str(pid)], capture_output=True, timeout=30)
                    (self.out / f"profile-{role}-dump.txt").write_bytes(dump.stdout + dump.stderr)
                    if dump.returncode:
                        info["dump_error"] = (dump.stderr or dump.stdout).decode(errors="replace").strip()[-500:]
                    proc = subprocess.Popen([self.binary, "record", "--pid", str(pid), "--duration", str(max(1, round(self.duration_s))),
                                             "--rate", str(self.rate), "--format", "raw", "--nolineno",
                                             "-o", str(self.out / f"profile-{role}.raw"), *(["--gil"] if self.gil else []),
                                             *(["--native"] if self.native else [])],
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                except (OSError, subprocess.SubprocessError) as exc:
                    info["error"] = f"py-spy: {type(exc).__name__}: {exc}"
            self._procs[role] = (pid, proc, cpu0)

    def running(self) -> bool:
        return any(p is not None and p.poll() is None for _, p, _ in self._procs.values())

    def finish(self, timeout_s: float = 60) -> dict[str, dict[str, Any]]:
        """Wait for the recorders (stopping any past `timeout_s` beyond the window), summarize, write the files."""
        deadline = self.t0 + self.duration_s + timeout_s
        for role, (pid, proc, cpu0) in self._procs.items():
            info = self.results[role]
            said = b""
            if proc is not None:
                try:
                    said, _ = proc.communicate(timeout=max(1.0, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    said, _ = proc.communicate()
                    info["error"] = "py-spy did not finish in time"
            window = time.time() - self.t0
            cpu1 = cpu_seconds(pid)
            info["window_s"] = round(window, 2)
            if cpu0 is not None and cpu1 is not None:
                info["cpu_s"] = round(cpu1 - cpu0, 2)
                info["cpu_share"] = round((cpu1 - cpu0) / window, 3) if window > 0 else None
            raw = self.out / f"profile-{role}.raw"
            if proc is not None:
                tail = said.decode(errors="replace").strip()
                info["pyspy_said"] = tail[-500:]
                if raw.exists():
                    info.update(summarize_raw(raw.read_text(errors="replace")))
                if not info.get("samples") and "error" not in info:
                    info["error"] = (f"py-spy exited {proc.returncode} with no samples: {tail[-500:]}; ptrace: {ptrace_facts()}"
                                     if proc.returncode else f"no samples (the process idle throughout?): {tail[-300:]}")
            (self.out / f"profile-{role}.txt").write_text(render(role, pid, info))
        return self.results
