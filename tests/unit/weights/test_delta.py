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
