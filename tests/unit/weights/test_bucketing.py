"""Bucketing: every dtype round-trips bit-exactly; one dtype per bucket; oversize alone; views, not copies."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from rollpool.protocol.messages import BucketInfo, TensorInfo  # noqa: E402
from rollpool.weights.bucketing import (  # noqa: E402
    BucketPlanner,
    Checksummer,
    check_bucket_info,
    checksum,
    checksum_supported,
    dtype_name,
    pack_tensors,
    unpack_bucket,
    unpack_buckets,
    verify_checksum,
)


def _every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(5, 7, generator=g)
    out = {
        "bf16": base.to(torch.bfloat16),
        "fp16": base.to(torch.float16),
        "fp32": base,
        "fp64": base.to(torch.float64),
        "int8": (base * 50).to(torch.int8),
        "uint8": (base.abs() * 50).to(torch.uint8),
        "int16": (base * 1000).to(torch.int16),
        "int32": (base * 1e6).to(torch.int32),
        "int64": (base * 1e12).to(torch.int64),
        "bool": base > 0,
        "nan_bf16": torch.tensor([float("nan"), float("inf"), -0.0], dtype=torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "noncontig": torch.randn(6, 4, generator=g).t(),
        "strided": torch.randn(10, generator=g)[::3],
    }
    for name in ("float8_e4m3fn", "float8_e5m2"):
        dt = getattr(torch, name, None)
        if dt is not None:
            out[name] = base.to(dt)
    return out


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.mark.parametrize("bucket_bytes", [1, 64, 1 << 20])
def test_every_dtype_round_trips_bit_exactly(bucket_bytes: int) -> None:
    src = _every_dtype()
    buckets = pack_tensors(src, bucket_bytes=bucket_bytes)
    out = unpack_buckets((b.info, b.data) for b in buckets)
    assert list(out) == list(src) or set(out) == set(src)
    for name, t in src.items():
        got = out[name]
        assert got.dtype == t.dtype and tuple(got.shape) == tuple(t.shape), name
        assert _bits(got) == _bits(t), name


def test_one_dtype_per_bucket_and_order_kept_within_a_dtype() -> None:
    src = {}
    for i in range(6):
        src[f"layer{i}.w"] = torch.ones(64, dtype=torch.bfloat16) * i  # 128 bytes
        src[f"layer{i}.norm"] = torch.ones(8, dtype=torch.float32) * i  # 32 bytes
    buckets = pack_tensors(src, bucket_bytes=256)
    for b in buckets:
        assert {t.dtype for t in b.info.tensors} == {b.info.dtype}
        assert b.info.nbytes <= 256
        offsets = [t.offset for t in b.info.tensors]
        assert offsets == sorted(offsets)
    # interleaved dtypes do not fragment: two bf16 tensors per 256-byte bucket, all 6 norms in one
    assert sorted(b.info.dtype for b in buckets) == ["bfloat16"] * 3 + ["float32"]
    names = [t.name for b in buckets if b.info.dtype == "bfloat16" for t in b.info.tensors]
    assert names == [f"layer{i}.w" for i in range(6)]


def test_oversize_tensor_lies_alone_in_its_own_bucket() -> None:
    src = {"a": torch.ones(4), "big": torch.ones(1000), "b": torch.ones(4)}
    buckets = pack_tensors(src, bucket_bytes=64)
    big = [b for b in buckets if any(t.name == "big" for t in b.info.tensors)]
    assert len(big) == 1 and len(big[0].info.tensors) == 1 and big[0].info.nbytes == 4000
    out = unpack_buckets((b.info, b.data) for b in buckets)
    assert torch.equal(out["big"], src["big"])


def test_unpacked_tensors_are_views_of_the_buffer() -> None:
    buckets = pack_tensors({"x": torch.randn(16, 16), "y": torch.randn(3)}, bucket_bytes=1 << 20)
    (b,) = buckets
    out = unpack_bucket(b.info, b.data)
    base = b.data.data_ptr()
    for t in out.values():
        assert base <= t.data_ptr() < base + b.info.nbytes
    b.data[0] ^= 0xFF  # writing the buffer shows through the view
    assert out["x"].reshape(-1).view(torch.uint8)[0] == b.data[0]


def test_snapshot_is_independent_of_the_source() -> None:
    src = {"w": torch.zeros(8)}
    buckets = pack_tensors(src)
    src["w"].add_(1)
    assert torch.equal(unpack_buckets((b.info, b.data) for b in buckets)["w"], torch.zeros(8))


def test_modules_and_iterators_are_accepted() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    out = unpack_buckets((b.info, b.data) for b in pack_tensors(module))
    assert set(out) == set(module.state_dict())
    gen = ((f"t{i}", torch.full((2,), float(i))) for i in range(3))
    out = unpack_buckets((b.info, b.data) for b in pack_tensors(gen))
    assert torch.equal(out["t2"], torch.full((2,), 2.0))
    with pytest.raises(TypeError):
        pack_tensors([("ok", torch.ones(1)), ("bad", [1, 2])])
    with pytest.raises(ValueError, match="twice"):
        pack_tensors([("a", torch.ones(1)), ("a", torch.ones(1))])


def test_checksum_detects_a_flipped_byte() -> None:
    (b,) = pack_tensors({"w": torch.randn(1000)})
    assert verify_checksum(b.info.checksum, b.data.numpy())
    b.data[123] ^= 0x01
    assert not verify_checksum(b.info.checksum, b.data.numpy())
    assert b.info.checksum.startswith("xxh3_64:") and len(b.info.checksum) == len("xxh3_64:") + 16
    assert not verify_checksum("sha999:00", b"")  # an unknown algorithm never passes
    assert checksum(b"", "crc32") == "crc32:00000000"
    assert checksum(b"", "xxh3_64") == "xxh3_64:2d06800538d394c2"  # XXH3_64bits of nothing, seed 0


@pytest.mark.parametrize("algorithm", ["xxh3_64", "crc32"])
def test_both_checksum_algorithms_verify_and_catch_a_flipped_byte(algorithm: str) -> None:
    """crc32 manifests (older publishers, or no xxhash) verify as well as the xxh3_64 default."""
    (b,) = pack_tensors({"w": torch.randn(300_000)}, checksum_algorithm=algorithm)
    assert b.info.checksum.startswith(algorithm + ":")
    data = b.data.numpy()
    assert verify_checksum(b.info.checksum, data)
    running = Checksummer.for_digest(b.info.checksum)
    for off in range(0, len(data), 65536):  # fed in chunks, as a subscriber does
        running.update(data[off : off + 65536])
    assert verify_checksum(b.info.checksum, running=running)
    other = "crc32" if algorithm == "xxh3_64" else "xxh3_64"
    assert not verify_checksum(b.info.checksum, running=Checksummer(other))  # a running sum of the wrong algorithm never passes
    data[len(data) // 3] ^= 0x01
    assert not verify_checksum(b.info.checksum, data)


def test_without_xxhash_the_default_falls_back_to_crc32(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollpool.weights import bucketing, manifest

    monkeypatch.setattr(manifest, "xxhash_module", lambda: None)  # the one place the module is looked up
    assert bucketing.default_checksum_algorithm() == "crc32"
    (b,) = pack_tensors({"w": torch.randn(10)})
    assert b.info.checksum.startswith("crc32:") and verify_checksum(b.info.checksum, b.data.numpy())
    assert not checksum_supported("xxh3_64")
    assert not verify_checksum(checksum(b"x", "crc32").replace("crc32", "xxh3_64"), b"x")  # cannot verify: fails, never passes
    with pytest.raises(ValueError, match="xxhash"):
        Checksummer("xxh3_64")


def test_manifests_that_do_not_fit_their_buffer_are_refused() -> None:
    def bucket(offset: int, shape: tuple[int, ...], nbytes: int, size: int = 16) -> BucketInfo:
        t = TensorInfo(name="t", dtype="float32", shape=shape, offset=offset, nbytes=nbytes)
        return BucketInfo(index=0, dtype="float32", nbytes=size, checksum="crc32:0", tensors=(t,))

    check_bucket_info(bucket(0, (4,), 16))
    for bad in (bucket(4, (4,), 16), bucket(0, (5,), 16), bucket(2, (1,), 4), bucket(0, (-1,), 16)):
        with pytest.raises(ValueError):
            check_bucket_info(bad)
    with pytest.raises(ValueError):
        unpack_bucket(bucket(0, (4,), 16), torch.empty(8, dtype=torch.uint8))
    with pytest.raises(ValueError):
        dtype_name(torch.quint8)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.sampled_from(["bfloat16", "float32", "int8"]), st.integers(0, 300)), min_size=1, max_size=30),
    bucket_bytes=st.integers(1, 512),
)
def test_planner_respects_the_bucket_size_unless_a_tensor_is_alone(sizes: list[tuple[str, int]], bucket_bytes: int) -> None:
    planner = BucketPlanner(bucket_bytes)
    for i, (dtype, n) in enumerate(sizes):
        planner.place(f"t{i}", dtype, (n,), n * {"bfloat16": 2, "float32": 4, "int8": 1}[dtype])
    placed = [t.name for b in planner.buckets for t in b.tensors]
    assert sorted(placed) == sorted(f"t{i}" for i in range(len(sizes)))
    for b in planner.buckets:
        assert {t.dtype for t in b.tensors} == {b.dtype}
        nonempty = [t for t in b.tensors if t.nbytes]
        assert b.nbytes <= bucket_bytes or len(nonempty) == 1
        end = 0
        for t in b.tensors:
            assert t.offset == end
            end += t.nbytes
        assert end == b.nbytes
