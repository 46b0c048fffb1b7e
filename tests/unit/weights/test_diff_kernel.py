"""The device diff's kernels (`rollpool.weights.diff_kernel`), run by Triton's interpreter on the CPU (a child process
with ``TRITON_INTERPRET=1``, which Triton reads when a kernel is made): their positions and base are
`reference_changed`'s for every word width, length, offset and boundary; a `DeviceBase` diff that goes through them
makes the torch path's bytes; `self_check` switches off kernels that compute another function; kernels that cannot
launch (no GPU here) hand the bucket to the torch path, which still makes the same delta."""

from __future__ import annotations

import importlib
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from rollpool.weights import delta_device, diff_kernel  # noqa: E402

from .test_delta_device import _base_holding_v1  # noqa: E402
from .triton_interpreted import interpreted  # noqa: E402


def _interpreted(code: str) -> str:
    return interpreted(code, ROLLPOOL_DIFF_TRITON="1")


def test_the_kernels_find_the_references_positions_and_write_the_same_base() -> None:
    out = _interpreted("""
        import torch
        from rollpool.weights import diff_kernel as dk
        per = dk.BLOCK * dk.ITERS
        g = torch.Generator().manual_seed(5)
        cases = [(torch.int16, [1], 0.5), (torch.int16, [per - 1, per + 1], 0.02), (torch.int16, [3 * per + 17, 5], 0.0),
                 (torch.int16, [2 * per], 1.0), (torch.int32, [dk.BLOCK + 7, 9], 0.1), (torch.int64, [per + 3], 0.01),
                 (torch.uint8, [2 * dk.BLOCK - 1, per], 0.3)]
        for dtype, sizes, fraction in cases:
            mine, theirs, offsets, at = [], [], [], 11
            for n in sizes:
                info = torch.iinfo(dtype)
                base = torch.randint(max(info.min, -1000), min(info.max, 1000), (n,), dtype=dtype, generator=g)
                src = base.clone()
                hit = torch.rand(n, generator=g) < fraction
                hit[: min(n, 2)] = fraction > 0  # the first words: a change at a piece's start
                src[hit] += 1
                mine.append((src, base.clone()))
                theirs.append((src.clone(), base.clone()))
                offsets.append(at)
                at += n + 5
            starts, k = dk.count_changed(mine)
            got = torch.full((k,), -1, dtype=torch.int32)
            dk.gather_changed(mine, offsets, starts, got)
            want = dk.reference_changed(theirs, offsets)
            print(dtype, sizes, k == want.numel() and torch.equal(got, want)
                  and all(torch.equal(b, s) for (_s, b), (s, _b) in zip(mine, theirs)), k)
        print("off", dk._off)
    """)
    lines = [line for line in out.split("\n") if line]
    assert "off None" in lines, out
    results = [line for line in lines if not line.startswith("off")]
    assert len(results) == 7 and all(" True " in line for line in results), out
    assert any(line.endswith(" 0") for line in results) and not all(line.endswith(" 0") for line in results), out


def test_a_device_base_diff_through_the_kernels_makes_the_torch_paths_bytes() -> None:
    """The same two versions diffed by `DeviceBase` with the kernels (their `usable` opened to the CPU, interpreted) and
    without: every bucket's encoding, count and payload bytes are equal and the base holds v2 after, with the kernels
    called for every bucket that was compared (fewer host syncs is their point; not measurable here)."""
    out = _interpreted("""
        import torch
        from rollpool.weights import diff_kernel as dk
        from tests.unit.weights.test_delta_device import _base_holding_v1

        def made(kernels):
            calls = []
            dk.usable = (lambda device: True) if kernels else (lambda device: False)
            count = dk.count_changed
            dk.count_changed = lambda pieces: calls.append(len(pieces)) or count(pieces)
            try:
                base, items2, places, infos, host2 = _base_holding_v1("cpu")
                out = [d.wait() for d in base.diff(2, infos, places, items2, host2)]
                same = all(torch.equal(v, t) for (_n, v), (_m, t) in zip(base.views(places), items2))
                return [(d.encodings[0], d.changed_elements, None if d.payloads[0] is None else bytes(d.payloads[0].numpy()))
                        for d in out], same, calls, len(infos)
            finally:
                dk.count_changed = count

        with_k, same_k, calls, buckets = made(True)
        without, same_t, none, _b = made(False)
        print("equal", with_k == without, same_k, same_t)
        print("calls", len(calls) == buckets, none == [], dk._off)
        print("encodings", sorted({e for e, _c, _p in with_k}))
    """)
    assert "equal True True True" in out, out
    assert "calls True True None" in out, out
    assert "encodings ['gaps', 'sparse', 'unchanged', 'whole']" in out, out


def test_self_check_passes_the_kernels_and_switches_off_ones_that_compute_another_function() -> None:
    out = _interpreted("""
        import torch
        from rollpool.weights import diff_kernel as dk
        print("right", dk.self_check(torch.device("cpu")), dk._off is None)
        gather = dk.gather_changed
        def off_by_one(pieces, offsets, starts, positions):
            gather(pieces, offsets, starts, positions)
            positions[-1:] += 1  # another function: the last position one word on
        dk.gather_changed = off_by_one
        print("wrong", dk.self_check(torch.device("cpu")), dk._off is None, dk.enabled())
    """)
    assert "right True True" in out, out
    assert "wrong False False False" in out, out


def test_kernels_that_cannot_launch_are_switched_off_and_the_torch_path_diffs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # Triton reads it as a kernel is made
    monkeypatch.setattr(diff_kernel, "_off", None)
    monkeypatch.setattr(diff_kernel, "_kernels", None)
    monkeypatch.setattr(diff_kernel, "usable", lambda device: diff_kernel.enabled())  # (CPU tensors: the launch fails)
    base, items2, places, infos, host2 = _base_holding_v1("cpu")
    made = base.diff(2, infos, places, items2, host2)
    assert made is not None and diff_kernel._off is not None and not diff_kernel.enabled()
    assert sum(d.wait().changed_elements for d in made) > 0
    assert all(torch.equal(v, t) for (_n, v), (_m, t) in zip(base.views(places), items2, strict=True))


def test_a_gather_that_fails_part_way_fails_the_diff_and_the_base_holds_no_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """The count ran, the gather did not finish (the base may be written in part): the diff raises, the kernels are off
    and the base claims no version, so the next diff makes no delta from it (the publisher falls back as for any
    failed device diff)."""
    base, items2, places, infos, host2 = _base_holding_v1("cpu")

    def broken(*_a: object) -> None:
        raise RuntimeError("launch failed")

    monkeypatch.setattr(diff_kernel, "_off", None)
    monkeypatch.setattr(diff_kernel, "usable", lambda device: True)
    monkeypatch.setattr(diff_kernel, "count_changed", lambda pieces: (torch.zeros(2, dtype=torch.int64), 5))
    monkeypatch.setattr(diff_kernel, "gather_changed", broken)
    with pytest.raises(RuntimeError, match="launch failed"):
        base.diff(2, infos, places, items2, host2)
    assert base.version == -1 and diff_kernel._off is not None
    assert delta_device.DeviceBase.fits(base, infos, torch.device("cpu"))  # (the buffers stay; only the version is gone)


def test_a_device_is_checked_once_before_its_first_bucket_and_a_failed_check_keeps_the_torch_ops(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(diff_kernel, "_off", None)
    monkeypatch.setattr(diff_kernel, "_checked", set())
    checks: list[str] = []

    def check(device: torch.device) -> bool:
        checks.append(str(device))
        time.sleep(0.05)  # (the other threads arrive meanwhile)
        return True

    monkeypatch.setattr(diff_kernel, "self_check", check)
    cuda = torch.device("cuda", 0)
    threads = [threading.Thread(target=diff_kernel.usable, args=(cuda,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert checks == ["cuda:0"] and diff_kernel.usable(cuda) and not diff_kernel.usable(torch.device("cpu"))
    assert diff_kernel.compared_by(cuda) == "kernels" and diff_kernel.compared_by(torch.device("cuda", 1)) == ""
    diff_kernel._checked.clear()
    monkeypatch.setattr(diff_kernel, "self_check", lambda device: diff_kernel.switch_off("disagrees") or False)
    assert not diff_kernel.usable(cuda) and diff_kernel.compared_by(cuda) == "torch ops (disagrees)"
    assert diff_kernel.compared_by(None) == ""


def test_the_switch_turns_the_kernels_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLPOOL_DIFF_TRITON", "0")
    try:
        importlib.reload(diff_kernel)  # (read as the module loads)
        assert not diff_kernel.enabled() and not diff_kernel.usable(torch.device("cuda"))
        assert diff_kernel._off == "ROLLPOOL_DIFF_TRITON=0"
    finally:
        monkeypatch.delenv("ROLLPOOL_DIFF_TRITON")
        importlib.reload(diff_kernel)
    assert diff_kernel._off is None
