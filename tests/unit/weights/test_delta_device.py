"""Deltas made on the tensors' device (`rollpool.weights.delta_device`): the same bytes as the host's encoding of the
same two versions, bucket by bucket, on CPU tensors here and on a GPU where there is one."""

from __future__ import annotations

import weakref
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from rollpool.protocol.messages import BucketInfo  # noqa: E402
from rollpool.weights import delta_device  # noqa: E402
from rollpool.weights.bucketing import flat_bytes  # noqa: E402
from rollpool.weights.delta import (  # noqa: E402
    ENCODED_FRACTION_GUESS,
    GAPS,
    SPARSE,
    UNCHANGED,
    WHOLE,
    compute_delta,
    encode_bucket,
    itemsize_of,
)
from rollpool.weights.delta_device import DeviceBase  # noqa: E402
from rollpool.weights.manifest import GpuBudget  # noqa: E402
from rollpool.weights.snapshot import plan_version  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")])]


def _model(device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {
        "a": torch.randn(3000, generator=g).to(torch.bfloat16),          # changes scattered: gaps
        "b": torch.randn(40, 50, generator=g).to(torch.bfloat16),        # unchanged (shares a bucket with "a")
        "far": torch.randn(80_000, generator=g).to(torch.bfloat16),      # two changes 70 000 apart: sparse
        "norm": torch.randn(700, generator=g),                           # fp32, every element changes: whole
        "ids": torch.randint(0, 255, (999,), generator=g, dtype=torch.uint8),
        "step": torch.tensor(7, dtype=torch.int64),                      # 0-d
        "empty": torch.empty(0, dtype=torch.bfloat16),
        "t": torch.randn(64, 32, generator=g).to(torch.bfloat16).t(),   # not contiguous
    }
    return {k: v.to(device) for k, v in sd.items()}


def _next(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {k: v.clone() for k, v in sd.items()}
    a = out["a"]
    idx = torch.randperm(a.numel(), generator=g)[:60].to(a.device)
    a[idx] = (a[idx].float() * 1.5 + 0.25).to(a.dtype)
    a[0] += 1  # the first element (a gap from position -1)
    a[-1] += 1
    out["far"][5] += 1
    out["far"][5 + 70_000] += 1
    out["norm"] += 1.0
    out["ids"][::7] += 1
    out["step"] += 1
    out["t"][3, 5] += 1  # one element of the transposed view
    return out


def _plan(sd: dict[str, torch.Tensor], bucket_bytes: int) -> tuple[list[tuple[str, torch.Tensor]], list[Any], tuple[BucketInfo, ...]]:
    items, places, planner = plan_version(sd, bucket_bytes, None)
    assert places is not None
    infos = tuple(BucketInfo(index=b.index, dtype=b.dtype, nbytes=b.nbytes, checksum="", tensors=tuple(b.tensors)) for b in planner.buckets)
    return items, places, infos


def _host(items: list[tuple[str, torch.Tensor]], places: list[Any], infos: tuple[BucketInfo, ...]) -> list[torch.Tensor]:
    """The version's host buckets, as the publisher's snapshot packs them."""
    out = [torch.zeros(b.nbytes, dtype=torch.uint8) for b in infos]
    for (idx, offset, _n, _s, _d, nbytes), (_name, t) in zip(places, items, strict=True):
        if nbytes:
            out[idx][offset : offset + nbytes] = flat_bytes(t).cpu()
    return out


def _base_holding_v1(device: str) -> tuple[DeviceBase, list[tuple[str, torch.Tensor]], list[Any], tuple[BucketInfo, ...], list[torch.Tensor]]:
    """A `DeviceBase` that diffed `_model` as version 1, and version 2 to diff next: (base, v2's items, the places,
    the buckets, v2's host buckets)."""
    v1 = _model(device)
    items1, places, infos = _plan(v1, 8192)
    items2, _p, _i = _plan(_next(v1, 1), 8192)
    base = DeviceBase(GpuBudget(1 << 30))
    assert base.diff(1, infos, places, items1, _host(items1, places, infos)) is None
    return base, items2, places, infos, _host(items2, places, infos)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("piece", [None, 100])
def test_a_device_made_delta_is_byte_identical_to_the_host_made_one(device: str, piece: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every bucket's encoding, changed count and payload bytes are the host path's (`compute_delta` over the two
    versions' host buckets); a `whole` bucket's payload is the new host bucket, as there; the base holds v2 after."""
    if piece is not None:  # positions found in pieces of 100 elements: changes on both sides of many piece boundaries
        monkeypatch.setattr(delta_device, "PIECE_ELEMENTS", piece)
    v1, bucket_bytes = _model(device), 8192
    v2 = _next(v1, 1)
    items1, places, infos = _plan(v1, bucket_bytes)
    items2, places2, infos2 = _plan(v2, bucket_bytes)
    assert places2 == places and infos2 == infos
    base = DeviceBase(GpuBudget(1 << 30))
    host1, host2 = _host(items1, places, infos), _host(items2, places, infos)
    assert base.diff(1, infos, places, items1, host1) is None  # nothing held before: the base is written, no delta
    made = base.diff(2, infos, places, items2, host2)
    assert made is not None and len(made) == len(infos)
    want = compute_delta(host2, host1, infos, infos, base_version=1, max_fraction=1.0)  # the host path's threads
    assert want is not None
    assert {GAPS, SPARSE, UNCHANGED, WHOLE} <= set(want.encodings)  # the model exercises every encoding
    for i, d in enumerate(made):
        ds = d.wait()
        enc, exp, changed = encode_bucket(host2[i], host1[i], itemsize_of(infos[i].dtype))
        assert (ds.encodings[0], ds.changed_elements, ds.base) == (enc, changed, 1) and enc == want.encodings[i], infos[i]
        got = ds.payloads[0]
        if exp is None:
            assert got is None
        elif enc == WHOLE:
            assert got is host2[i]
        else:
            assert got is not None and got.device.type == "cpu" and want.payloads[i] is not None
            assert got.numpy().tobytes() == exp.numpy().tobytes() == want.payloads[i].numpy().tobytes(), infos[i]
    assert sum(d.delta.changed_elements for d in made) == want.changed_elements
    assert sum(d.delta.total_elements for d in made) == want.total_elements
    assert set(made[0].delta.timings) == {"compare_s", "encode_s", "pin_s"}
    for (name, view), (_n, t) in zip(base.views(places), items2, strict=True):
        assert torch.equal(view, t), name


@pytest.mark.parametrize("device", DEVICES)
def test_a_bucket_s_changed_elements_are_counted_in_pieces(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch sums a bool tensor by casting it whole to int64 first (8 bytes an element: 2 GiB for a 512 MiB bf16
    bucket, which ran an H100 trainer out of memory at 8B): the comparison mask is summed a piece at a time. (The torch
    ops' path: on a GPU the diff kernels count without a mask, so they are switched off here.)"""
    from torch.overrides import TorchFunctionMode

    from rollpool.weights import diff_kernel

    monkeypatch.setattr(diff_kernel, "_off", "this test: the torch ops' pieces")

    sums: list[int] = []

    class Sums(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func in (torch.sum, torch.Tensor.sum, torch.count_nonzero, torch.Tensor.count_nonzero) and args[0].dtype == torch.bool:
                sums.append(int(args[0].numel()))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(delta_device, "PIECE_ELEMENTS", 100)
    v1 = _model(device)
    v2 = _next(v1, 1)
    items1, places, infos = _plan(v1, 8192)
    items2, _p, _i = _plan(v2, 8192)
    base = DeviceBase(GpuBudget(1 << 30))
    base.diff(1, infos, places, items1, _host(items1, places, infos))
    with Sums():
        made = base.diff(2, infos, places, items2, _host(items2, places, infos))
    assert made is not None and sum(d.wait().changed_elements for d in made) > 0
    assert sums and max(sums) <= 100, max(sums)


@pytest.mark.parametrize("device", DEVICES)
def test_no_delta_against_a_skipped_version_or_a_changed_layout_and_the_base_follows(device: str) -> None:
    v1 = _model(device)
    items, places, infos = _plan(v1, 8192)
    host = _host(items, places, infos)
    base = DeviceBase(GpuBudget(1 << 30))
    assert base.diff(1, infos, places, items, host) is None
    assert base.diff(3, infos, places, items, host) is None  # holds 1, not 2
    assert base.version == 3
    assert base.diff(4, infos, places, items, host) is not None
    bigger = {**v1, "extra": torch.ones(10, device=device)}
    items2, places2, infos2 = _plan(bigger, 8192)
    assert base.diff(5, infos2, places2, items2, _host(items2, places2, infos2)) is None  # a new layout: a new base
    assert base.version == 5 and base.buckets == infos2


def test_the_base_and_its_scratch_are_counted_against_the_gpu_budget() -> None:
    items, places, infos = _plan(_model("cpu"), 8192)
    need = DeviceBase.need_bytes(infos)
    assert need >= sum(b.nbytes for b in infos) + delta_device.SCRATCH_BUCKETS * max(b.nbytes for b in infos)
    budget = GpuBudget(need - 1)
    base = DeviceBase(budget)
    assert "publisher_gpu_budget_bytes" in base.why_not(infos, torch.device("cpu"))
    budget.budget = need
    assert base.why_not(infos, torch.device("cpu")) == ""
    base.diff(1, infos, places, items, _host(items, places, infos))
    assert budget.used == need and base.why_not(infos, torch.device("cpu")) == ""  # held: no more needed
    base.release()
    assert budget.used == 0 and base.version == -1


@pytest.mark.parametrize("device", DEVICES)
def test_the_base_s_mix64_of_every_bucket_is_the_reference_of_its_bytes(device: str) -> None:
    """`DeviceBase.mix64s` (an early delta's `host_mix64`): each bucket's digest is `mix64_reference` of the version's
    host bucket (the planner lays a bucket's tensors end to end: summed over the bucket at once); a bucket with a gap
    or a tensor ending inside a word is not taken for one (summed tensor by tensor, as before)."""
    from rollpool.weights.delta_device import _tiles
    from rollpool.weights.gpu import mix64_reference

    v1 = _model(device)
    items, places, infos = _plan(v1, 8192)
    host = _host(items, places, infos)
    base = DeviceBase(GpuBudget(1 << 30))
    base.diff(1, infos, places, items, host)
    ranges: list[list[tuple[int, int]]] = [[] for _ in infos]
    for idx, offset, _n, _s, _d, nbytes in places:
        if nbytes:
            ranges[idx].append((offset, nbytes))
    tiled = [_tiles(r, b.nbytes) for r, b in zip(ranges, infos, strict=True)]
    assert all(tiled), tiled
    assert not _tiles([(0, 8), (16, 8)], 24) and not _tiles([(0, 6), (6, 8)], 14) and not _tiles([(0, 8)], 16)
    assert _tiles([(8, 5), (0, 8)], 13) and _tiles([], 0)
    assert base.mix64s(places) == [mix64_reference(bytes(h.numpy())) for h in host]


@pytest.mark.parametrize("device", DEVICES)
def test_the_sums_queued_by_the_diff_are_the_new_versions_and_taken_once(device: str) -> None:
    """`diff(mix=True)` queues the base's sums behind the diff (the early delta's `host_mix64`, launched while the
    trainer waits anyway): `mix64s` returns the sums of the version the diff wrote, not of the one before, and a
    later call sums again (the queued sums are taken once); a diff without a delta queues none."""
    from rollpool.weights.gpu import mix64_reference

    v1 = _model(device)
    items1, places, infos = _plan(v1, 8192)
    base = DeviceBase(GpuBudget(1 << 30))
    base.diff(1, infos, places, items1, _host(items1, places, infos), mix=True)
    assert base._mixed is None  # the first version: no delta made, nothing queued
    v2 = _next(v1, 1)
    items2, _places, _infos = _plan(v2, 8192)
    host2 = _host(items2, places, infos)
    assert base.diff(2, infos, places, items2, host2, mix=True) is not None
    assert base._mixed is not None
    want = [mix64_reference(bytes(h.numpy())) for h in host2]
    assert want != [mix64_reference(bytes(h.numpy())) for h in _host(items1, places, infos)]
    assert base.mix64s(places) == want
    assert base._mixed is None and base.mix64s(places) == want  # summed again from the base


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_the_early_sums_run_on_the_devices_highest_priority_stream() -> None:
    """The sums the diff queues run on a stream of the device's highest priority: the trainer's next step, on its own
    stream once the diff returns, does not take the GPU ahead of them."""
    v1 = _model("cuda")
    items1, places, infos = _plan(v1, 8192)
    base = DeviceBase(GpuBudget(1 << 30))
    base.diff(1, infos, places, items1, _host(items1, places, infos), mix=True)
    v2 = _next(v1, 1)
    items2, _places, _infos = _plan(v2, 8192)
    assert base.diff(2, infos, places, items2, _host(items2, places, infos), mix=True) is not None
    assert base._mix_stream is not None
    _least, greatest = torch.cuda.Stream.priority_range()
    assert base._mix_stream.priority == greatest < 0


class _FakePageLocked:
    """A fake of torch's page-locked allocation (the process edge: no GPU here): plain tensors, every size asked for
    and the most held at once recorded."""

    def __init__(self, fail: bool = False) -> None:
        self.asked: list[int] = []
        self.live = self.most_live = 0
        self.fail = fail

    def __call__(self, nbytes: int) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("CUDA error: out of memory (fake)")
        self.asked.append(nbytes)
        self.live += 1
        self.most_live = max(self.most_live, self.live)
        t = torch.empty(nbytes, dtype=torch.uint8)
        weakref.finalize(t, self._freed)
        return t

    def _freed(self) -> None:
        self.live -= 1


def test_page_locked_payload_blocks_are_made_ahead_all_held_at_once_then_freed() -> None:
    """A device delta's payload blocks are made in a thread of their own before the diff needs them: every size asked
    for, all held at once (so torch's cache gets blocks beside those the served versions hold), then freed into it."""
    fake = _FakePageLocked()
    host = delta_device.PayloadHost(fake)
    host.warm_for([100, 300, 200])
    host.join(5)
    assert host.warmed == 1 and sorted(fake.asked) == [100, 200, 300] and fake.most_live == 3 and fake.live == 0
    assert host.take(300).numel() == 300 and fake.asked[-1] == 300


def test_a_failed_warm_up_is_logged_and_leaves_the_diff_to_allocate(caplog: pytest.LogCaptureFixture) -> None:
    host = delta_device.PayloadHost(_FakePageLocked(fail=True))
    host.warm_for([100])
    host.join(5)
    assert host.warmed == 0 and "could not be made ahead" in caplog.text


@pytest.mark.parametrize("device", DEVICES)
def test_the_payload_sizes_to_make_ahead_follow_the_last_diff(device: str) -> None:
    """Before any delta (a CUDA base just written): `delta.ENCODED_FRACTION_GUESS` of each bucket; after a diff: that diff's
    device payloads (on the CPU none are copied from a device, so none)."""
    v1, bucket_bytes = _model(device), 8192
    items, places, infos = _plan(v1, bucket_bytes)
    base = DeviceBase(GpuBudget(1 << 30))
    assert base.diff(1, infos, places, items, _host(items, places, infos)) is None
    guess = [max(1, int(b.nbytes * ENCODED_FRACTION_GUESS)) for b in infos]
    assert base.payload_sizes == (guess if device == "cuda" else [])
    items2, _p, _i = _plan(_next(v1, 1), bucket_bytes)
    made = base.diff(2, infos, places, items2, _host(items2, places, infos))
    assert made is not None
    want = [int(d.delta.payloads[0].numel()) for d in made if d.delta.payloads[0] is not None and d.delta.encodings[0] in (GAPS, SPARSE)]
    assert base.payload_sizes == (want if device == "cuda" else []) and (device == "cpu" or want)


def test_the_workers_delta_buffer_is_made_ahead_once_a_version_is_held_on_its_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The page-locked buffer a delta's encoded bytes land in (the worker's first delta fetch made it: ~0.6 s at 8B)
    is made in a thread once the first whole version is held on the engine's GPU, `delta.ENCODED_FRACTION_GUESS` of the model;
    the first delta's fetch takes it; a delta larger than it grows it then. The page-locked allocation is faked (no GPU
    here: the process edge), the device a CUDA one by name only."""
    from types import SimpleNamespace

    from rollpool.weights.paths import delta as delta_path

    made: list[tuple[int, bool]] = []
    real_empty = torch.empty

    def fake_empty(n: int, *, dtype: torch.dtype, pin_memory: bool = False) -> torch.Tensor:
        made.append((n, pin_memory))
        return real_empty(n, dtype=dtype)

    monkeypatch.setattr(delta_path.torch, "empty", fake_empty)
    path = delta_path.DeltaPath(None, None, enabled=True, threads=1)  # type: ignore[arg-type]
    path.device = SimpleNamespace(device=torch.device("cuda", 0))  # type: ignore[assignment]
    model = 1000 << 20
    path._make_scratch_ahead(model)
    path._make_scratch_ahead(model)  # once
    want = delta_path._scratch_bytes(int(model * ENCODED_FRACTION_GUESS))
    got = path._scratch_of(30 << 20)
    assert made == [(want, True)] and got.numel() == 30 << 20 and path._scratch is not None and path._scratch.numel() == want
    path._scratch_of(want + 1)  # a larger delta: grown when it comes
    assert made[-1] == (delta_path._scratch_bytes(want + 1), True)
