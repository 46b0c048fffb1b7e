"""The delta encoding (`rollpool.weights.delta`): what is rebuilt is bit-identical, and a payload that cannot be right is refused."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from rollpool.protocol.messages import BucketInfo, TensorInfo  # noqa: E402
from rollpool.weights.delta import (  # noqa: E402
    GAPS,
    SPARSE,
    UNCHANGED,
    WHOLE,
    DeltaError,
    compute_delta,
    decode_bucket,
    encode_bucket,
)


def _bf16(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(torch.bfloat16)


def _step(w: torch.Tensor, frac: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = w.clone()
    idx = torch.randperm(w.numel(), generator=g)[: int(w.numel() * frac)]
    out[idx] = (out[idx].float() * 1.5 + 0.25).to(out.dtype)
    return out


@pytest.mark.parametrize(("frac", "want"), [(0.0, UNCHANGED), (0.01, GAPS), (1.0, WHOLE)])
def test_a_bucket_rebuilt_from_its_encoding_is_the_new_bucket_bit_for_bit(frac: float, want: str) -> None:
    base = _bf16(4096, 0)
    new = _step(base, frac, 1)
    enc, payload, changed = encode_bucket(new.view(torch.uint8), base.view(torch.uint8), 2)
    assert enc == want
    assert changed == int((new.view(torch.int16) != base.view(torch.int16)).sum())
    if enc == GAPS:
        assert payload is not None and payload.numel() == changed * 4  # a 2-byte gap + a bf16 value per changed element
    out = torch.empty(new.numel() * 2, dtype=torch.uint8)
    decode_bucket(enc, payload, base.view(torch.uint8), out, 2)
    assert torch.equal(out, new.view(torch.uint8))


@pytest.mark.parametrize(("gap", "want"), [(40_000, GAPS), (70_000, SPARSE)])
def test_gaps_past_two_bytes_take_int32_indices(gap: int, want: str) -> None:
    base = _bf16(gap + 10, 0)
    new = base.clone()
    for i in (3, 3 + gap):  # one gap of `gap` elements (past int16's range, then past 2 bytes)
        new[i] = new[i] + 1
    enc, payload, changed = encode_bucket(new.view(torch.uint8), base.view(torch.uint8), 2)
    assert (enc, changed) == (want, 2)
    out = torch.empty_like(base.view(torch.uint8))
    decode_bucket(enc, payload, base.view(torch.uint8), out, 2)
    assert torch.equal(out, new.view(torch.uint8))


def test_a_payload_that_cannot_be_right_is_refused() -> None:
    base = _bf16(64, 0).view(torch.uint8)
    out = torch.empty_like(base)
    bad_index = torch.empty(6, dtype=torch.uint8)
    bad_index[:4].view(torch.int32)[0] = 64  # one past the last element
    with pytest.raises(DeltaError, match="outside"):
        decode_bucket(SPARSE, bad_index, base, out, 2)
    with pytest.raises(DeltaError, match="pairs"):
        decode_bucket(SPARSE, torch.empty(7, dtype=torch.uint8), base, out, 2)
    with pytest.raises(DeltaError, match="whole bucket"):
        decode_bucket(WHOLE, torch.empty(3, dtype=torch.uint8), base, out, 2)
    with pytest.raises(DeltaError, match="unknown"):
        decode_bucket("xor", torch.empty(3, dtype=torch.uint8), base, out, 2)


def test_no_delta_when_the_layouts_differ_or_it_passes_the_threshold() -> None:
    base = _bf16(4096, 0)
    info = BucketInfo(index=0, dtype="bfloat16", nbytes=8192, checksum="", tensors=(TensorInfo("w", "bfloat16", (4096,), 0, 8192),))
    small = _step(base, 0.01, 1)
    ds = compute_delta([small.view(torch.uint8)], [base.view(torch.uint8)], [info], [info], base_version=3)
    assert ds is not None and ds.base == 3 and ds.encodings == [GAPS] and 0.005 < ds.changed_fraction < 0.015
    moved = _step(base, 0.3, 1)  # 30% changed: 60% of the bytes as pairs, over the default 0.5
    assert compute_delta([moved.view(torch.uint8)], [base.view(torch.uint8)], [info], [info], base_version=3) is None
    other = BucketInfo(index=0, dtype="float16", nbytes=8192, checksum="", tensors=info.tensors)
    assert compute_delta([small.view(torch.uint8)], [base.view(torch.uint8)], [info], [other], base_version=3) is None


def test_the_delta_knobs_are_read_from_the_environment_and_checked() -> None:
    from rollpool.protocol.errors import ConfigError
    from rollpool.weights.config import WeightPathConfig

    cfg = WeightPathConfig.from_env({"ROLLPOOL_WEIGHT_DELTA": "0", "ROLLPOOL_WEIGHT_DELTA_MAX_FRACTION": "0.25"})
    assert (cfg.weight_delta, cfg.weight_delta_max_fraction) == (False, 0.25)
    with pytest.raises(ConfigError, match="weight_delta_max_fraction"):
        WeightPathConfig(weight_delta_max_fraction=1.5)
    threads = WeightPathConfig.from_env({"ROLLPOOL_WEIGHT_DELTA_THREADS": "12", "ROLLPOOL_WEIGHT_COPY_THREADS": "3"})
    assert (threads.delta_threads, threads.copy_threads) == (12, 3)
    assert WeightPathConfig(weight_copy_threads=3).delta_threads == 3  # 0: the copy threads
    with pytest.raises(ConfigError, match="weight_delta_threads"):
        WeightPathConfig(weight_delta_threads=65)


def _reference(new: torch.Tensor, base: torch.Tensor) -> tuple[str, bytes]:
    """The documented wire form of a bf16 bucket's delta, computed the plain way (one pass over the whole bucket)."""
    import numpy as np

    a, b = new.view(torch.int16).numpy(), base.view(torch.int16).numpy()
    idx = np.flatnonzero(a != b)
    gaps = np.diff(idx, prepend=-1)
    if int(gaps.max()) <= 0xFFFF:
        return GAPS, (gaps - 1).astype("<u2").tobytes() + a[idx].tobytes()
    return SPARSE, idx.astype("<i4").tobytes() + a[idx].tobytes()


@pytest.mark.parametrize("far", [False, True])
def test_a_bucket_encoded_in_pieces_is_the_documented_form_and_rebuilds_with_its_checksum_in_one_pass(
        monkeypatch: pytest.MonkeyPatch, far: bool) -> None:
    """Pieces of 32 elements: changes on both sides of piece boundaries, a gap across several pieces (past 2 bytes when
    `far`); the payload is byte for byte the plain encoding (what an older peer decodes), from one thread or three, and
    the rebuild's running checksum is the checksum of the bytes it left in `out`."""
    import rollpool.weights.delta as delta
    from rollpool.weights.bucketing import Checksummer, checksum

    monkeypatch.setattr(delta, "PIECE_BYTES", 64)
    n = 70_100 if far else 1000
    base = _bf16(n, 0)
    new = base.clone()
    at = [0, 31, 32, 33, 63, 64, 65, 200, n - 33, n - 32, n - 1] + ([100, 100 + 66_000] if far else [])
    for i in at:
        new[i] = new[i] + 1
    want_enc, want = _reference(new, base)
    enc, payload, changed = encode_bucket(new.view(torch.uint8), base.view(torch.uint8), 2)
    assert (enc, changed) == (want_enc, len(set(at)))
    assert payload is not None and payload.numpy().tobytes() == want
    info = BucketInfo(index=0, dtype="bfloat16", nbytes=2 * n, checksum="", tensors=(TensorInfo("w", "bfloat16", (n,), 0, 2 * n),))
    ds = compute_delta([new.view(torch.uint8)], [base.view(torch.uint8)], [info], [info], base_version=1, threads=3)
    assert ds is not None and ds.encodings == [want_enc] and ds.payloads[0] is not None
    assert ds.payloads[0].numpy().tobytes() == want and set(ds.timings) == {"compare_s", "encode_s"}
    out = torch.zeros(2 * n, dtype=torch.uint8)
    summer = Checksummer()
    delta.rebuild_bucket(enc, payload, base.view(torch.uint8), out, 2, summer)
    assert torch.equal(out, new.view(torch.uint8))
    assert summer.hexdigest() == checksum(new.view(torch.uint8).numpy().data)


def test_sparse_positions_out_of_order_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bucket is rebuilt piece by piece, each piece checksummed once written: a position that belongs to a piece
    already checksummed would leave bytes that differ from those checked, so positions must ascend."""
    import rollpool.weights.delta as delta

    monkeypatch.setattr(delta, "PIECE_BYTES", 64)
    base = _bf16(100, 0).view(torch.uint8)
    payload = torch.empty(12, dtype=torch.uint8)
    payload[:8].view(torch.int32).copy_(torch.tensor([80, 5], dtype=torch.int32))
    with pytest.raises(DeltaError, match="ascending"):
        decode_bucket(SPARSE, payload, base, torch.empty_like(base), 2)


def test_an_unchanged_bucket_rebuilt_over_its_base_is_checksummed_without_a_copy() -> None:
    from rollpool.weights.bucketing import Checksummer, checksum
    from rollpool.weights.delta import rebuild_bucket

    base = _bf16(4096, 0).view(torch.uint8)
    summer = Checksummer()
    rebuild_bucket(UNCHANGED, None, base, base, 2, summer)
    assert summer.hexdigest() == checksum(base.numpy().data)


@pytest.mark.parametrize("piece_bytes", [4 << 20, 4096])
def test_two_deltas_applied_in_place_to_the_version_before_the_base_give_the_new_version_and_its_checksum(
        monkeypatch: pytest.MonkeyPatch, piece_bytes: int) -> None:
    """The in-place rebuild: a buffer holding v-2, patched with the delta v-2 -> v-1 and then v-1 -> v (gaps, sparse or
    unchanged, positions spanning pieces), is v bit for bit, and its checksum is fed in the same pass."""
    from rollpool.weights import delta as delta_mod
    from rollpool.weights.bucketing import Checksummer, checksum
    from rollpool.weights.delta import patch_bucket

    monkeypatch.setattr(delta_mod, "REBUILD_PIECE_BYTES", piece_bytes)  # small pieces: positions spread over many
    v0 = _bf16(1 << 16, 0)
    v1 = _step(v0, 0.01, 1)
    v2 = v1.clone()
    v2[[5, 70_000 // 2, 65_000]] = (v2[[5, 70_000 // 2, 65_000]].float() + 1.0).to(v2.dtype)  # a few, far apart
    e1, p1, _ = encode_bucket(v1.view(torch.uint8), v0.view(torch.uint8), 2)
    e2, p2, _ = encode_bucket(v2.view(torch.uint8), v1.view(torch.uint8), 2)
    assert e1 == GAPS and e2 in (GAPS, SPARSE)
    out = v0.clone().view(torch.uint8)
    summer = Checksummer("crc32")
    patch_bucket([(e1, p1), (e2, p2)], out, 2, summer)
    assert torch.equal(out, v2.view(torch.uint8))
    assert summer.hexdigest() == checksum(v2.view(torch.uint8).numpy().data, "crc32")
    again = v2.clone().view(torch.uint8)
    patch_bucket([(UNCHANGED, None), (UNCHANGED, None)], again, 2)  # neither delta touched it: not written
    assert torch.equal(again, v2.view(torch.uint8))


def test_a_whole_bucket_cannot_be_applied_in_place_and_a_bad_payload_is_refused() -> None:
    from rollpool.weights.delta import patch_bucket

    base = _bf16(4096, 0).view(torch.uint8)
    with pytest.raises(DeltaError, match="in place"):
        patch_bucket([(WHOLE, base.clone())], base.clone(), 2)
    with pytest.raises(DeltaError):
        patch_bucket([(GAPS, torch.tensor([0xFF, 0xFF, 0, 0], dtype=torch.uint8))], base.clone(), 2)  # a gap past the bucket


def test_a_bucket_is_rebuilt_in_place_only_when_the_delta_before_changed_few_of_its_elements() -> None:
    from rollpool.weights.delta import IN_PLACE_MAX_FRACTION, in_place_pays

    n = 1 << 20  # bytes: 2**19 bf16 elements
    few = int(IN_PLACE_MAX_FRACTION * (n // 2))

    def before(encoding: str, changed: int) -> BucketInfo:
        per = {GAPS: 4, SPARSE: 6}.get(encoding, 0)
        return BucketInfo(index=0, dtype="bfloat16", nbytes=n, checksum="", encoding=encoding, delta_nbytes=changed * per)

    assert in_place_pays(before(UNCHANGED, 0))  # nothing to apply again: only this delta's scatter, no copy
    assert in_place_pays(before(GAPS, few)) and in_place_pays(before(SPARSE, few))
    assert not in_place_pays(before(GAPS, few + 1)) and not in_place_pays(before(SPARSE, 4 * few))
    assert not in_place_pays(BucketInfo(index=0, dtype="bfloat16", nbytes=n, checksum="", encoding=WHOLE, delta_nbytes=n))
