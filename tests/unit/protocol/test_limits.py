"""Limits are checked before allocation: a small header cannot expand into a large decode.

The memory figures are traced by `tracemalloc` (every Python object msgpack
builds goes through the traced allocator); they are bounds on what a decode
may allocate, not timings.
"""

from __future__ import annotations

import tracemalloc

import msgpack
import numpy as np
import pytest

from rollpool.protocol import Credit, Error, Limits, ProtocolError, Result, decode, encode, peek_type

MiB = 1024 * 1024


def _bomb(nbytes: int = 4 * MiB - 64) -> bytes:
    """A valid `credit` whose unknown field holds ~4 million empty maps (1 byte each on the wire)."""
    inner = [{}] * 65_536  # max_array_len per list, so lists of lists
    lists = nbytes // (65_536 + 3)
    header = msgpack.packb([1, 0, "credit", {"credits": 1, "zz_unknown": [inner] * lists}], use_bin_type=True)
    assert len(header) <= 4 * MiB
    return header


def _peak_decode(frames: list[bytes], limits: Limits | None = None) -> tuple[int, BaseException | None]:
    tracemalloc.start()
    try:
        try:
            decode(frames, limits) if limits is not None else decode(frames)
            exc = None
        except ProtocolError as e:
            exc = e
        return tracemalloc.get_traced_memory()[1], exc
    finally:
        tracemalloc.stop()


def test_a_4_mib_header_of_empty_maps_is_refused_without_expanding() -> None:
    """Break 2: today this decodes (the unknown field is ignored) after building ~4 M dicts (~290 MiB)."""
    header = _bomb()
    peak, exc = _peak_decode([header])
    assert isinstance(exc, ProtocolError), "the bomb decoded: its unknown field was unpacked and accepted"
    assert exc.code == "oversize" and exc.limit == "max_header_objects"
    assert peak < 80 * MiB, f"decode allocated {peak / MiB:.0f} MiB for a {len(header) / MiB:.1f} MiB header"


def test_the_budget_is_per_limits_and_tighter_limits_allocate_less() -> None:
    tight = Limits(max_header_objects=65_536)
    peak, exc = _peak_decode([_bomb()], tight)
    assert isinstance(exc, ProtocolError) and exc.limit == "max_header_objects"
    assert peak < 16 * MiB


def test_unknown_fields_are_bounded() -> None:
    fields = {"credits": 1} | {f"new_{i}": i for i in range(17)}
    frames = [msgpack.packb([1, 0, "credit", fields], use_bin_type=True)]
    with pytest.raises(ProtocolError) as info:
        decode(frames)
    assert info.value.limit == "max_unknown_fields" and "17 unknown fields" in str(info.value)
    # up to the bound they are ignored (a newer minor's optional fields)
    fields = {"credits": 1} | {f"new_{i}": i for i in range(16)}
    assert decode([msgpack.packb([1, 0, "credit", fields], use_bin_type=True)]) == Credit(credits=1)


def test_a_legitimate_large_result_fits_the_default_budget() -> None:
    from rollpool.protocol import Trajectory

    trajs = tuple(
        Trajectory(prompt_id="p", sample_index=i, input_ids=np.arange(64, dtype=np.int32),
                   output_ids=np.arange(256, dtype=np.int32), output_logprobs=np.zeros(256, np.float32),
                   token_versions=np.zeros(256, np.int32), loss_mask=np.ones(256, np.uint8), finish_reason="stop",
                   worker_id="w", queued_at=1.0, started_at=2.0, finished_at=3.0,
                   metadata={"answer": "x" * 100, "tags": list(range(50))})
        for i in range(1024)
    )
    msg = Result(task_id="t", prompt_id="p", trajectories=trajs)
    assert decode([bytes(memoryview(f)) for f in encode(msg)]) == msg


def test_accept_refuses_other_types_before_their_fields() -> None:
    frames = [bytes(memoryview(f)) for f in encode(Credit(credits=1))]
    with pytest.raises(ProtocolError) as info:
        decode(frames, accept=frozenset({"pull"}))
    assert info.value.code == "unexpected_type"
    assert decode(frames, accept=frozenset({"credit"})) == Credit(credits=1)


def test_peek_type_does_not_expand_the_header() -> None:
    tracemalloc.start()
    try:
        assert peek_type([_bomb()]) == "credit"
        assert tracemalloc.get_traced_memory()[1] < 16 * MiB
    finally:
        tracemalloc.stop()


def test_senders_refuse_what_the_peer_would_cut_and_name_the_limit() -> None:
    from rollpool.protocol.codec import check_size
    from rollpool.protocol.errors import MessageTooLargeError

    frames = encode(Error(code="x", message="y"))
    check_size(frames, 1024, "error")
    big = [b"h", np.zeros(2 * MiB, np.uint8)]
    with pytest.raises(MessageTooLargeError) as info:
        check_size(big, MiB, "submit")
    assert info.value.limit == "max_msg_bytes" and "max_msg_bytes of 1048576 bytes" in str(info.value)
