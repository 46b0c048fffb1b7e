"""The compiled CPU mix64 (`rollpool.weights.mix64_native`): the digest of `mix64_reference` for every length, word
offset and byte alignment; built once into the cache folder; switched off for numpy (same digests) where there is no
compiler or the built function is another; and run with the GIL released, so the publisher's checksum threads sum side
by side."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from rollpool.weights import gpu, mix64_native  # noqa: E402

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here: the numpy path sums")


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The module as in a new process, its cache in a folder of the test's own."""
    monkeypatch.setenv("ROLLPOOL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(mix64_native, "_fn", None)
    monkeypatch.setattr(mix64_native, "_path", None)
    monkeypatch.setattr(mix64_native, "_off", None)
    return tmp_path / "cache"


def _reference(data: bytes, base_word: int) -> str:
    """The digest of `data` as words `base_word` onwards of a bucket: the bucket's reference less its leading zeros'."""
    whole = int(gpu.mix64_reference(bytes(8 * base_word) + data).split(":")[1], 16)
    lead = int(gpu.mix64_reference(bytes(8 * base_word)).split(":")[1], 16) if base_word else 0
    return gpu.mix64_format(whole - lead)


@needs_cc
def test_the_compiled_sum_is_the_reference_at_every_length_offset_and_alignment(fresh: Path) -> None:
    g = torch.Generator().manual_seed(11)
    backing = torch.randint(0, 256, (8 * 5000 + 16,), dtype=torch.uint8, generator=g)
    for start in (0, 1, 3, 8):  # the bytes need not be 8-byte aligned in memory
        for n in (0, 1, 7, 8, 9, 31, 32, 33, 8 * 4097 + 5):
            for base in (0, 3, 1001):
                data = backing[start : start + n]
                got = gpu.mix64_format(gpu._mix64_cpu(data, base))
                assert got == _reference(bytes(data.numpy()), base), (start, n, base)
    assert mix64_native.enabled() and mix64_native.library_path() is not None
    assert mix64_native.library_path().parent == fresh  # built in the cache folder named


@needs_cc
def test_a_second_process_loads_the_library_built_once(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert mix64_native.enabled()
    built = mix64_native.library_path()
    assert built is not None and built.exists()
    stamp = built.stat().st_mtime_ns
    monkeypatch.setattr(mix64_native, "_fn", None)  # as a new process would start
    monkeypatch.setattr(mix64_native, "_path", None)
    assert mix64_native.enabled() and mix64_native.library_path() == built and built.stat().st_mtime_ns == stamp
    assert [p.name for p in fresh.iterdir()] == [built.name]  # no build folders left behind


def test_without_a_compiler_numpy_sums_the_same_digest(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-rollpool")
    data = torch.randint(0, 256, (8 * 3000 + 3,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    got = gpu.mix64_format(gpu._mix64_cpu(data, 7))
    assert not mix64_native.enabled() and "no C compiler" in str(mix64_native._off)
    assert got == _reference(bytes(data.numpy()), 7)
    with pytest.raises(RuntimeError, match="off"):
        mix64_native.mix_words(data.numpy(), 8, 0)


@needs_cc
def test_a_built_function_that_is_not_mix64_is_switched_off(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mix64_native, "_SOURCE", mix64_native._SOURCE.replace(">> 29", ">> 30"))
    data = torch.randint(0, 256, (8 * 100,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    got = gpu.mix64_format(gpu._mix64_cpu(data, 0))
    assert not mix64_native.enabled() and "differs from numpy" in str(mix64_native._off)
    assert got == gpu.mix64_reference(bytes(data.numpy()))  # numpy summed it


def test_switched_off_by_the_environment(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    monkeypatch.setenv("ROLLPOOL_MIX64_NATIVE", "0")
    try:
        mod = importlib.reload(mix64_native)
        assert not mod.enabled() and mod._off == "ROLLPOOL_MIX64_NATIVE=0"
    finally:
        monkeypatch.delenv("ROLLPOOL_MIX64_NATIVE")
        importlib.reload(mix64_native)


@needs_cc
def test_the_compiled_sum_lets_other_threads_run(fresh: Path) -> None:
    """While one thread sums a buffer, another runs Python: the publisher's eight checksum threads need that to sum
    side by side. With a switch interval longer than the sum, a thread holding the GIL through the call would keep it
    until it ended (the loop below would then never run while the sum did)."""
    import sys

    assert mix64_native.enabled()
    buf = np.ones(64 << 20, dtype=np.uint8)
    started, done = threading.Event(), threading.Event()
    laps = 0

    def sum_it() -> None:
        started.set()
        mix64_native.mix_words(buf, buf.size // 8, 0)
        done.set()

    before = sys.getswitchinterval()
    sys.setswitchinterval(0.5)
    try:
        t = threading.Thread(target=sum_it)
        t.start()
        started.wait()
        while not done.is_set():
            laps += 1
        t.join()
    finally:
        sys.setswitchinterval(before)
    assert laps > 0


@needs_cc
def test_a_cache_folder_others_may_write_is_never_loaded_from(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A library is loaded only from a folder of this user's that no one else may write (a shared /tmp's folder could
    hold anybody's library under the name this source's hash gives)."""
    fresh.mkdir(parents=True)
    fresh.chmod(0o777)
    data = torch.randint(0, 256, (8 * 100 + 1,), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    got = gpu.mix64_format(gpu._mix64_cpu(data, 0))
    assert not mix64_native.enabled() and "no writable folder" in str(mix64_native._off)
    assert list(fresh.iterdir()) == [] and got == gpu.mix64_reference(bytes(data.numpy()))
