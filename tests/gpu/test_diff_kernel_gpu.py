"""The device diff's kernels on a real GPU (marked gpu; skipped without one): on after their self-check there, their
positions and base are the torch ops' (`reference_changed`) for every word type and for pieces at unaligned offsets,
and a `DeviceBase` on CUDA compares through them (`compared_by`), making the host path's delta bytes."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no GPU", allow_module_level=True)

from rollpool.weights import diff_kernel  # noqa: E402
from rollpool.weights.delta import compute_delta  # noqa: E402
from rollpool.weights.delta_device import compared_by  # noqa: E402

from ..unit.weights.test_delta_device import _base_holding_v1, _host, _model, _plan  # noqa: E402


def test_the_kernels_are_on_and_find_the_references_positions() -> None:
    dev = torch.device("cuda:0")
    assert diff_kernel.usable(dev), diff_kernel._off
    g = torch.Generator().manual_seed(3)
    per = diff_kernel.BLOCK * diff_kernel.ITERS
    for dtype in (torch.int16, torch.int32, torch.int64, torch.uint8):
        whole_base = torch.randint(0, 100, (5 * per + 301,), dtype=dtype, generator=g)
        whole_src = whole_base.clone()
        whole_src[torch.rand(whole_src.shape, generator=g) < 0.02] += 1
        cuts = [(3, 2 * per + 5), (2 * per + 5, 5 * per + 301)]  # a piece starting at an odd word: an unaligned pointer
        mine = [(whole_src[a:b].to(dev), whole_base[a:b].to(dev)) for a, b in cuts]
        theirs = [(whole_src[a:b].clone(), whole_base[a:b].clone()) for a, b in cuts]
        starts, k = diff_kernel.count_changed(mine)
        got = torch.empty(k, dtype=torch.int32, device=dev)
        diff_kernel.gather_changed(mine, [a for a, _b in cuts], starts, got)
        want = diff_kernel.reference_changed(theirs, [a for a, _b in cuts])
        assert torch.equal(got.cpu(), want), dtype
        assert all(torch.equal(b.cpu(), s) for (_s, b), (s, _b) in zip(mine, theirs, strict=True)), dtype
    assert diff_kernel.enabled()


def test_a_cuda_device_base_compares_through_the_kernels_and_makes_the_host_paths_bytes() -> None:
    base, items2, places, infos, host2 = _base_holding_v1("cuda")
    host1 = _host(_plan(_model("cuda"), 8192)[0], places, infos)
    made = [d.wait() for d in base.diff(2, infos, places, items2, host2) or []]
    assert compared_by(torch.device("cuda:0")) == "kernels", diff_kernel._off
    want = compute_delta(host2, host1, infos, infos, base_version=1, max_fraction=1.0)
    assert want is not None and [d.encodings[0] for d in made] == want.encodings
    for d, p in zip(made, want.payloads, strict=True):
        if d.encodings[0] not in ("unchanged", "whole"):
            assert bytes(d.payloads[0].numpy()) == bytes(p.numpy())
    assert all(torch.equal(v, t) for (_n, v), (_m, t) in zip(base.views(places), items2, strict=True))
