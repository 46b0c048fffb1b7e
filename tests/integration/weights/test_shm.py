"""The same-host shared-memory path (CPU): chosen from the manifest, no bucket byte on a ZeroMQ socket,
the checksum over the subscriber's own copy, the network path as the counted fallback, and segments
that never outlive their publisher.
"""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from rollpool.protocol.errors import WeightSyncError  # noqa: E402
from rollpool.weights import memory  # noqa: E402
from rollpool.weights.memory import SHM_DIR, sweep_stale_segments  # noqa: E402

from .counters import settled  # noqa: E402
from .segments import RestoreOnRefetch, flip_byte, segment_exists  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")

_MiB = 1024 * 1024
ROOT = Path(__file__).resolve().parents[3]


def model(seed: int, n: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"layers.{i}.w": torch.randn(256, 1024, generator=g).to(torch.bfloat16) for i in range(n)}
    out["norm"] = torch.randn(1024, generator=g)
    return out


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(want) and all(torch.equal(got[k], t) for k, t in want.items())


async def test_same_host_versions_travel_through_shared_memory(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher(pool="tpool", publisher_id="pubshm1")
    w = model(1)
    manifest = await pub.publish(w, 1, wait_ready=True)
    sub = make_subscriber(pub.router_endpoint, path="auto")
    got = await sub.fetch(1)
    assert same(got.tensors, w)
    assert sub.last_path == "shm" and sub.fallbacks == {}
    total = sum(b.nbytes for b in manifest.buckets)
    assert sub.shm_bytes == total and sub.bytes_received == 0 and pub.bytes_served == 0  # no bucket byte on a socket
    for b in manifest.buckets:
        assert b.shm_segment.startswith("rollpool-tpool-pubshm1-")
        st = os.stat(os.path.join(SHM_DIR, b.shm_segment))
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    # the next versions reuse the same segments
    for v in (2, 3):
        w = model(v)
        await pub.publish(w, v, wait_ready=True)
        got = await sub.fetch(v)
        assert same(got.tensors, w) and sub.last_path == "shm"
    segments = {b.shm_segment for b in manifest.buckets}
    await pub.close()
    assert not any(segment_exists(s) for s in segments)  # unlinked on close


async def test_a_corrupt_segment_is_refetched_and_then_verified(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher()
    w = model(2)
    manifest = await pub.publish(w, 1, wait_ready=True)
    flip_byte(manifest.buckets[0].shm_segment, 100)
    restore = RestoreOnRefetch(manifest.buckets[0].shm_segment, 100, path="shm")
    sub = make_subscriber(pub.router_endpoint, path="auto", metrics=restore)
    got = await sub.fetch(1)
    assert sub.buckets_refetched == 1 and sub.last_path == "shm"
    assert same(got.tensors, w)  # the bytes handed to the engine are the good ones


async def test_a_segment_that_stays_corrupt_is_never_returned(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher()
    manifest = await pub.publish(model(3), 1, wait_ready=True)
    flip_byte(manifest.buckets[-1].shm_segment, 8)
    sub = make_subscriber(pub.router_endpoint, path="auto", max_refetch=2)
    with pytest.raises(WeightSyncError, match="checksum"):
        await sub.fetch(1)
    assert sub.buckets_refetched == 3  # first try + 2 refetches, then the version is refused whole


async def test_another_host_takes_the_network_path_logged_and_counted(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher()
    w = model(4)
    await pub.publish(w, 1, wait_ready=True)
    sub = make_subscriber(pub.router_endpoint, path="auto")
    sub.host_key = "another-boot/another-shm"
    got = await sub.fetch(1)
    assert same(got.tensors, w) and sub.last_path == "network"
    assert sub.fallbacks == {"the publisher is on another host (or another /dev/shm)": 1}
    assert sub.bytes_received == await settled(lambda: pub.bytes_served, sub.bytes_received) > 0 and sub.shm_bytes == 0
    strict = make_subscriber(pub.router_endpoint, path="shm")
    strict.host_key = "another-boot/another-shm"
    with pytest.raises(WeightSyncError, match="path 'shm'"):
        await strict.fetch(1)


async def test_a_full_dev_shm_falls_back_to_ordinary_memory(make_publisher: Any, make_subscriber: Any, monkeypatch: Any) -> None:
    import rollpool.weights.snapshot as snapshot

    monkeypatch.setattr(snapshot, "shm_free_bytes", lambda: 1 * _MiB)  # a /dev/shm too small for a version (where the snapshot's buffers ask)
    pub = await make_publisher()
    w = model(5)
    manifest = await pub.publish(w, 1, wait_ready=True)
    assert pub.shm_fallbacks == 1 and not any(b.shm_segment for b in manifest.buckets)
    sub = make_subscriber(pub.router_endpoint, path="auto")
    got = await sub.fetch(1)
    assert same(got.tensors, w) and sub.last_path == "network"
    assert sub.fallbacks == {"the publisher offers no shared memory for this version": 1}
    strict = await make_publisher(path="shm")
    with pytest.raises(WeightSyncError, match="/dev/shm"):
        await strict.publish(w, 1)


def test_segments_of_a_killed_publisher_are_unlinked(tmp_path: Path) -> None:
    """SIGKILL leaves no atexit handler to run: the reaper child sees its pipe close and unlinks."""
    script = textwrap.dedent(
        """
        import asyncio, sys, torch, zmq.asyncio
        from rollpool.protocol.sockets import SocketFactory
        from rollpool.weights.publisher import WeightPublisher

        async def main():
            pub = WeightPublisher(SocketFactory(zmq.asyncio.Context()), pool="killed", bucket_bytes=1 << 20)
            await pub.start()
            m = await pub.publish({"w": torch.ones(1 << 19, dtype=torch.bfloat16)}, 1, wait_ready=True)
            print(" ".join(b.shm_segment for b in m.buckets), flush=True)
            await asyncio.sleep(60)

        asyncio.run(main())
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        names = proc.stdout.readline().split()
        assert names and all(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while any(os.path.exists(os.path.join(SHM_DIR, n)) for n in names) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_a_sweep_unlinks_segments_whose_owner_is_gone() -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    name = f"rollpool-sweeptest-p0-{int(dead.stdout)}-1"
    live = f"rollpool-sweeptest-p0-{os.getpid()}-1"
    for n in (name, live):
        Path(SHM_DIR, n).write_bytes(b"x")
    try:
        assert sweep_stale_segments("sweeptest") == [name]
        assert not Path(SHM_DIR, name).exists() and Path(SHM_DIR, live).exists()
    finally:
        for n in (name, live):
            Path(SHM_DIR, n).unlink(missing_ok=True)


async def test_a_reused_segment_under_a_reader_is_a_torn_read(make_publisher: Any, make_subscriber: Any) -> None:
    """The publisher rewrites a buffer only after evicting its version; a reader that raced it sees the generation change."""
    pub = await make_publisher(keep_versions=1)
    await pub.publish(model(6), 1, wait_ready=True)
    sub = make_subscriber(pub.router_endpoint, path="auto")
    m1 = await sub.fetch_manifest(1)
    reader = memory.ShmReader(m1.buckets[0].shm_segment, m1.buckets[0].nbytes)
    before = reader.state()
    assert before[0] == 1
    await pub.publish(model(7), 2, wait_ready=True)
    await pub.publish(model(8), 3, wait_ready=True)  # version 1's spare buffers are reused by now
    after = reader.state()
    reader.close()
    assert after != before
    with pytest.raises(WeightSyncError):
        await sub.fetch(1)  # gone: never a mix of two versions
    got = await sub.fetch(None)
    assert got.version == 3 and same(got.tensors, model(8))
    await asyncio.sleep(0)


async def test_set_path_network_offers_no_segments(make_publisher: Any, make_subscriber: Any) -> None:
    pub = await make_publisher()
    pub.set_path("network")
    m = await pub.publish(model(9), 1, wait_ready=True)
    assert not any(b.shm_segment for b in m.buckets) and pub.shm_fallbacks == 0
    pub.set_path("auto")
    m = await pub.publish(model(10), 2, wait_ready=True)
    assert all(b.shm_segment for b in m.buckets)
    sub = make_subscriber(pub.router_endpoint, path="auto")
    assert same((await sub.fetch(2)).tensors, model(10)) and sub.last_path == "shm"


async def test_after_shm_versions_set_path_network_reuses_no_segment(make_publisher: Any, make_subscriber: Any) -> None:
    # seen on the H200 bench: versions published after set_path("network") still went out through shared
    # memory, because an evicted shm version's buffers were taken as spares for the network path
    pub = await make_publisher(keep_versions=1)
    for v in (1, 2, 3):
        m = await pub.publish(model(v), v, wait_ready=True)
        assert all(b.shm_segment for b in m.buckets)
    pub.set_path("network")
    for v in (4, 5):
        m = await pub.publish(model(v), v, wait_ready=True)
        assert not any(b.shm_segment for b in m.buckets), f"version {v} offered a segment on the network path"
    sub = make_subscriber(pub.router_endpoint, path="auto")
    assert same((await sub.fetch(5)).tensors, model(5)) and sub.last_path == "network"


async def test_segments_freed_by_a_publish_are_released_off_the_callers_thread(make_publisher: Any, make_subscriber: Any,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """After a switch to the network path the spare segments are freed by the next publishes: unregistering and
    unmapping a 14 GB version took 0.41 s of a trainer's `publish` on the H200 (the tcp row's second version). The
    release runs in a releasing thread, and nothing is leaked."""
    closed_on: list[str] = []
    real_close = memory.ShmBuffer.close

    def close(self: Any) -> None:
        closed_on.append(threading.current_thread().name)
        real_close(self)

    monkeypatch.setattr(memory.ShmBuffer, "close", close)
    pub = await make_publisher(pool="trel", publisher_id="pubrel", keep_versions=1)
    names: set[str] = set()
    for v in (1, 2, 3):
        m = await pub.publish(model(v), v, wait_ready=True)
        names |= {b.shm_segment for b in m.buckets}
    pub.set_path("network")
    for v in (4, 5, 6):
        await pub.publish(model(v), v, wait_ready=True)
    memory.wait_released()
    assert closed_on, "no segment was freed"
    assert all(name.startswith("rollpool-weight-release") for name in closed_on), closed_on
    assert not [n for n in names if segment_exists(n)], sorted(names)
    sub = make_subscriber(pub.router_endpoint, path="auto")
    assert same((await sub.fetch(6)).tensors, model(6)) and sub.last_path == "network"


async def test_the_cpu_shm_path_keeps_both_version_sets_mapped(make_publisher: Any, make_subscriber: Any) -> None:
    """The publisher reuses K = 2 sets of segments in turn; the subscriber keeps every live one mapped (it used to
    unmap the other set at each fetch and map it again the next version: page-table faults every version)."""
    pub = await make_publisher(pool="tmaps", publisher_id="pubmaps", keep_versions=2)
    sub = make_subscriber(pub.router_endpoint, path="auto")
    buckets = 0
    for v in (1, 2, 3, 4, 5):
        w = model(v)
        manifest = await pub.publish(w, v, wait_ready=True)
        buckets = len(manifest.buckets)
        got = await sub.fetch(v)
        assert same(got.tensors, w) and sub.last_path == "shm"
        sub.recycle(got)
    assert sub.segment_maps == 2 * buckets  # each set mapped once


_UNSHARE = (["unshare", "--pid", "--fork", "--kill-child"],
            ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child"])


def _pid_namespace() -> list[str]:
    """The command prefix that runs a process as PID 1 of a new PID namespace (as a container does); skip where none works."""
    for prefix in _UNSHARE:
        try:
            done = subprocess.run([*prefix, "sh", "-c", "echo $$"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0 and done.stdout.strip() == "1":
            return prefix
    pytest.skip("cannot make a PID namespace here (unshare unavailable or not permitted)")


_MAKE_SEGMENTS = """
import os, sys
from rollpool.weights import memory
pool = memory.BufferPool(kind="shm", pool=sys.argv[1], owner_id="p0")
bufs = pool.reserve([4096, 4096])
print(os.getpid(), *sorted(s.name for s in pool.segments()), flush=True)
if sys.argv[2] == "die":
    memory._reaper._proc.kill()  # the container goes whole: its reaper child with it
    memory._reaper._proc.wait()
    os._exit(0)  # no atexit: as a SIGKILLed container's PID 1
sys.stdin.read()
"""


def test_segments_of_a_trainer_that_died_in_its_pid_namespace_are_swept_by_the_next_one_there(tmp_path: Path) -> None:
    """A trainer in a container is PID 1 and its reaper dies with it; the restarted one is PID 1 again. Judged by pid,
    the dead one's segments looked alive for good (a leak of K model versions per restart); judged by the owner's lock
    they are swept, while the segments of an owner alive in another namespace stay."""
    ns = _pid_namespace()
    pool = f"nstest{os.getpid()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    alive = subprocess.Popen([*ns, sys.executable, "-c", _MAKE_SEGMENTS, pool, "live"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=env)  # beside the one that dies (each takes seconds to import torch)
    try:
        dead = subprocess.run([*ns, sys.executable, "-c", _MAKE_SEGMENTS, pool, "die"], capture_output=True, text=True, timeout=60, env=env)
        pid, *dead_names = dead.stdout.split()
        assert pid == "1" and len(dead_names) == 2, dead.stderr
        assert alive.stdout is not None and alive.stdin is not None
        pid, *live_names = alive.stdout.readline().split()
        assert pid == "1" and len(live_names) == 2
        assert all(Path(SHM_DIR, n).exists() for n in dead_names + live_names)
        # swept from here (judged by pid, "1" is always alive here too, as it is to the restarted trainer in its namespace)
        assert sorted(sweep_stale_segments(pool)) == sorted(dead_names)
        assert not any(Path(SHM_DIR, n).exists() for n in dead_names) and all(Path(SHM_DIR, n).exists() for n in live_names)
        alive.stdin.close()
        assert alive.wait(30) == 0
        assert not any(Path(SHM_DIR, n).exists() for n in live_names)  # its own exit unlinked them
    finally:
        if alive.poll() is None:
            alive.kill()
            alive.wait()
        for stream in (alive.stdin, alive.stdout):
            if stream is not None:
                stream.close()
        for n in os.listdir(SHM_DIR):
            if pool in n:
                Path(SHM_DIR, n).unlink(missing_ok=True)
