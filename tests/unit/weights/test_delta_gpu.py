"""A delta rebuilt on the engine's device (`rollpool.weights.delta_gpu`), run here on CPU tensors standing in for the GPU:
the bucket patched in place is the host rebuild's (`rollpool.weights.delta.rebuild_bucket`) bit for bit for every
encoding, verified against the mix64 of the resulting bytes, and a payload that cannot be right is refused."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from rollpool.protocol.messages import BucketInfo, TensorInfo  # noqa: E402
from rollpool.weights.delta import GAPS, SPARSE, UNCHANGED, WHOLE, DeltaError, encode_bucket, rebuild_bucket  # noqa: E402
from rollpool.weights.delta_gpu import DeviceHeld, apply_delta, decode_positions, result_checks  # noqa: E402
from rollpool.weights.delta_gpu import rebuild_bucket as rebuild_on_device  # noqa: E402
from rollpool.weights.gpu import mix64_checksum, mix64_reference  # noqa: E402


def _words(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype)


def _changed(w: torch.Tensor, positions: list[int]) -> torch.Tensor:
    out = w.clone()
    bits = out.view(torch.uint8).view(-1, out.element_size())
    for i in positions:
        bits[i, 0] ^= 1  # the lowest bit of element i flips: a changed value, bit for bit
    return out


def _cases() -> list[tuple[str, torch.dtype, list[int] | str]]:
    return [
        (UNCHANGED, torch.bfloat16, []),
        (GAPS, torch.bfloat16, [0, 5, 6, 700, 4095]),
        (GAPS, torch.float32, [1, 2, 3, 1000, 4095]),  # 4-byte words: the values start at 2k bytes, not 4-aligned for odd k
        (SPARSE, torch.bfloat16, [3, 3 + 70_000]),  # a gap past 2 bytes: int32 indices
        (WHOLE, torch.bfloat16, "all"),
    ]


@pytest.mark.parametrize(("want", "dtype", "positions"), _cases())
def test_a_bucket_patched_on_the_device_is_the_host_rebuild_bit_for_bit(want: str, dtype: torch.dtype, positions: list[int] | str) -> None:
    n = 4096 if want != SPARSE else 70_010
    base = _words(n, dtype, 0)
    new = _words(n, dtype, 1) if positions == "all" else _changed(base, list(positions))
    width = base.element_size()
    enc, payload, _k = encode_bucket(new.view(torch.uint8), base.view(torch.uint8), width)
    assert enc == want
    host = torch.empty(n * width, dtype=torch.uint8)
    rebuild_bucket(enc, payload, base.view(torch.uint8), host, width)
    on_device = base.view(torch.uint8).clone()  # the "device" base, patched in place
    apply_delta(enc, payload, on_device, width)
    assert torch.equal(on_device, host)
    assert torch.equal(on_device, new.view(torch.uint8))


def test_gap_positions_are_the_prefix_sum_of_gap_plus_one() -> None:
    gaps = torch.tensor([4, 0, 65535, 2], dtype=torch.int32).to(torch.int16)  # 65535 wraps to -1 as int16: read unsigned
    values = torch.arange(4, dtype=torch.int16)
    payload = torch.cat([gaps.view(torch.uint8), values.view(torch.uint8)])
    idx, vals = decode_positions(GAPS, payload, 200_000, 2)
    assert idx.tolist() == [4, 5, 5 + 65536, 5 + 65536 + 3]
    assert vals.tolist() == [0, 1, 2, 3]


def test_a_payload_that_cannot_be_right_is_refused_on_the_device() -> None:
    bucket = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(DeltaError, match="not whole"):
        apply_delta(GAPS, torch.zeros(5, dtype=torch.uint8), bucket, 2)
    outside = torch.cat([torch.tensor([40], dtype=torch.int32).view(torch.uint8), torch.zeros(2, dtype=torch.uint8)])
    with pytest.raises(DeltaError, match="outside"):
        apply_delta(SPARSE, outside, bucket, 2)  # element 40 of a 32-element bucket
    backwards = torch.cat([torch.tensor([5, 2], dtype=torch.int32).view(torch.uint8), torch.zeros(4, dtype=torch.uint8)])
    with pytest.raises(DeltaError, match="ascending"):
        apply_delta(SPARSE, backwards, bucket, 2)
    with pytest.raises(DeltaError, match="whole bucket"):
        apply_delta(WHOLE, torch.zeros(3, dtype=torch.uint8), bucket, 2)
    with pytest.raises(DeltaError, match="unknown"):
        apply_delta("runs", torch.zeros(4, dtype=torch.uint8), bucket, 2)
    assert bucket.eq(0).all()  # nothing written by a refused payload


def _info(new: torch.Tensor, enc: str, payload: torch.Tensor | None, *, mix: str | None = None) -> BucketInfo:
    data = new.view(torch.uint8)
    return BucketInfo(index=0, dtype="bfloat16", nbytes=int(data.numel()), checksum="", encoding=enc,
                      tensors=(TensorInfo(name="w", dtype="bfloat16", shape=(int(new.numel()),), offset=0, nbytes=int(data.numel())),),
                      delta_nbytes=0 if payload is None else int(payload.numel()),
                      host_mix64=mix64_reference(bytes(data.numpy())) if mix is None else mix)


def test_a_rebuilt_bucket_passes_only_against_the_mix64_of_the_resulting_bytes() -> None:
    base = _words(4096, torch.bfloat16, 0)
    new = _changed(base, [7, 8, 9, 3000])
    enc, payload, _k = encode_bucket(new.view(torch.uint8), base.view(torch.uint8), 2)
    bucket = base.view(torch.uint8).clone()
    ok, _patch_s, _sum_s = rebuild_on_device(_info(new, enc, payload), payload, bucket)
    assert ok and mix64_checksum(bucket) == mix64_reference(bytes(new.view(torch.uint8).numpy()))
    # the base was not what the holder thought (one byte off): the same delta gives bytes the manifest's mix64 refuses
    wrong = base.view(torch.uint8).clone()
    wrong[100] ^= 0x40
    ok, _patch_s, _sum_s = rebuild_on_device(_info(new, enc, payload), payload, wrong)
    assert not ok
    # no mix64 on the manifest: never a pass
    ok, _patch_s, _sum_s = rebuild_on_device(_info(new, enc, payload, mix=""), payload, base.view(torch.uint8).clone())
    assert not ok
    assert "1 of 1 buckets" in result_checks([_info(new, enc, payload, mix="")])
    assert result_checks([_info(new, enc, payload)]) == ""


def test_the_held_version_is_forgotten_while_it_is_written_and_named_once_verified() -> None:
    infos = [BucketInfo(index=i, dtype="bfloat16", nbytes=n, checksum="") for i, n in enumerate((10, 4096, 6))]
    held = DeviceHeld("cpu")
    views = held.begin(infos)
    assert [int(v.numel()) for v in views] == [10, 4096, 6]
    assert held.slab is not None and all((v.data_ptr() - held.slab.data_ptr()) % 256 == 0 for v in views)  # word views, mix64
    assert not held.holds("p", 3)
    held.done("p", 3, infos)
    assert held.holds("p", 3) and not held.holds("q", 3) and not held.holds("p", 4)
    slab = held.slab
    again = held.begin(infos)  # the same layout: written in place, its version forgotten meanwhile
    assert held.slab is slab and [v.data_ptr() for v in again] == [v.data_ptr() for v in views]
    assert not held.holds("p", 3)
    assert held.drop() is slab and held.slab is None
