"""The codec: round trips, golden wire bytes, strict and bounded decoding."""

from __future__ import annotations

import json
import pathlib
import pickle
import random
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollpool import protocol as p
from rollpool.protocol import Limits, ProtocolError, decode, encode, message_types

from .samples import header_bins, inline_samples, samples
from .strategies import any_message, record_strategy

GOLDEN = pathlib.Path(__file__).parents[2] / "fixtures" / "golden_wire.json"


def _roundtrip(msg: Any) -> Any:
    return decode([bytes(memoryview(f)) for f in encode(msg)])


@pytest.mark.parametrize("type_name", sorted(message_types()))
def test_every_message_type_round_trips(type_name: str) -> None:
    cls = message_types()[type_name]

    @settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow], deadline=None)
    @given(record_strategy(cls))
    def check(msg: Any) -> None:
        out = _roundtrip(msg)
        assert type(out) is cls
        assert out == msg

    check()


def test_every_message_type_is_covered_by_the_strategies() -> None:
    # A new message type gets a round-trip test automatically; this pins that the registry is not empty.
    assert {"hello", "task", "result", "submit", "batch", "manifest", "chunk", "error"} <= set(message_types())


def test_golden_fixtures_pin_the_wire_format() -> None:
    golden = json.loads(GOLDEN.read_text())
    current = samples()
    inline = inline_samples()
    assert set(golden) == set(current) | set(inline)
    for name, msg in current.items():
        frames = [bytes.fromhex(h) for h in golden[name]]
        assert [bytes(memoryview(f)) for f in encode(msg)] == frames, f"wire format of {name} changed"
        assert decode(frames) == msg
    for name, msg in inline.items():  # minor 12: small arrays inline in the header
        frames = [bytes.fromhex(h) for h in golden[name]]
        assert [bytes(memoryview(f)) for f in encode(msg, p.Inline())] == frames, f"wire format of {name} changed"
        assert decode(frames) == msg
    assert [len(golden[n]) for n in ("result@inline", "submit@inline", "chunk@inline", "task_batch@inline")] == [1, 1, 1, 2]


def test_arrays_travel_as_raw_frames_and_decode_as_views() -> None:
    msg = samples()["result"]
    frames = encode(msg)
    header = msgpack.unpackb(frames[0])
    assert header[:3] == [p.PROTOCOL_MAJOR, p.PROTOCOL_MINOR, "result"]
    out = decode([bytes(memoryview(f)) for f in frames])  # as received from a socket
    t = out.trajectories[0]
    assert t.output_ids.dtype == np.int32 and t.output_logprobs.dtype == np.float32
    assert t.loss_mask.dtype == np.uint8
    assert not t.output_ids.flags.writeable  # a zero-copy view of the received frame
    assert t.trajectory_id == "p1:1"


def test_shared_prompt_array_travels_once() -> None:
    ids = np.arange(100, dtype=np.int32)
    trajs = tuple(
        p.Trajectory(prompt_id="g", sample_index=i, input_ids=ids, output_ids=ids[:3], output_logprobs=np.zeros(3, np.float32),
                     token_versions=np.zeros(3, np.int32), loss_mask=np.ones(3, np.uint8), finish_reason="stop")
        for i in range(8)
    )
    frames = encode(p.Result(task_id="t", prompt_id="g", trajectories=trajs))
    # 1 header + 1 shared input_ids + 8 x 4 per-sample arrays (output_ids slices are distinct objects)
    assert len(frames) == 1 + 1 + 8 * 4
    assert decode(frames) == p.Result(task_id="t", prompt_id="g", trajectories=trajs)


# --------------------------------------------------------------------------- minor 12: arrays inline in the header


@pytest.mark.parametrize("type_name", sorted(message_types()))
def test_every_message_type_round_trips_inline(type_name: str) -> None:
    cls = message_types()[type_name]

    @settings(max_examples=25, suppress_health_check=[HealthCheck.too_slow], deadline=None)
    @given(record_strategy(cls), st.sampled_from([0, 1, 16, 64, 1 << 14]))
    def check(msg: Any, max_bytes: int) -> None:
        frames = [bytes(memoryview(f)) for f in encode(msg, p.Inline(max_bytes=max_bytes))]
        out = decode(frames)
        assert type(out) is cls
        assert out == msg

    check()


def test_small_arrays_travel_inline_and_decode_as_read_only_views_of_the_header() -> None:
    msg = samples()["result"]
    frames = encode(msg, p.Inline())
    assert len(frames) == 1  # every array of the trajectory in the header: no frame at all
    header = msgpack.unpackb(frames[0])
    assert header[:3] == [p.PROTOCOL_MAJOR, p.PROTOCOL_MINOR, "result"] and p.PROTOCOL_MINOR >= p.INLINE_MINOR
    raw = header[3]["trajectories"][0]
    assert raw["output_ids"] == np.array([7, 8, 2], "<i4").tobytes() and raw["loss_mask"] == b"\x01\x01\x01"
    t = decode(frames).trajectories[0]
    assert t.output_ids.dtype == np.int32 and t.output_logprobs.dtype == np.float32 and t.loss_mask.dtype == np.uint8
    assert t.output_logprobs.tolist() == [-0.5, -1.25, -0.125]
    assert not t.output_ids.flags.writeable and not t.loss_mask.flags.writeable
    assert type(t.output_ids.base) is bytes  # a view of the header's bin, not a copy
    assert encode(msg) == encode(msg, None)  # no policy: the minor-11 form, frames only
    chunk = decode(encode(samples()["chunk"], p.Inline()))
    assert type(chunk.data) is memoryview and bytes(chunk.data) == b"\x00\x01\x02\x03" and chunk.data.readonly


def test_an_array_referenced_twice_travels_once_in_a_frame_and_one_referenced_once_inline() -> None:
    shared = np.arange(6, dtype=np.int32)
    trajs = tuple(
        p.Trajectory(prompt_id="g", sample_index=i, input_ids=shared, output_ids=np.full(2, i, np.int32),
                     output_logprobs=np.zeros(2, np.float32), token_versions=np.zeros(2, np.int32),
                     loss_mask=np.ones(2, np.uint8), finish_reason="stop")
        for i in range(4)
    )
    frames = encode(p.Result(task_id="t", prompt_id="g", trajectories=trajs), p.Inline())
    assert len(frames) == 2 and bytes(memoryview(frames[1])) == shared.tobytes()  # the prompt, once
    fields = msgpack.unpackb(frames[0])[3]
    assert [t["input_ids"] for t in fields["trajectories"]] == [1, 1, 1, 1]  # the first reference too
    assert header_bins(fields) == 4 * 4  # each trajectory's own arrays inline
    out = decode([bytes(memoryview(f)) for f in frames])
    assert out.trajectories[0].input_ids is out.trajectories[3].input_ids  # shared on decode, as before
    # a blob referenced twice: the same
    tasks = p.TaskBatch(tasks=tuple(p.Task(task_id=f"t{i}", prompt=p.Prompt(prompt_id="q", input_ids=shared)) for i in range(3)))
    assert len(encode(tasks, p.Inline())) == 2


def test_arrays_over_the_threshold_or_past_the_budget_travel_in_frames() -> None:
    big, small = np.zeros(64, np.int32), np.zeros(4, np.int32)  # 256 and 16 bytes
    prompts = (p.Prompt(prompt_id="a", input_ids=big), p.Prompt(prompt_id="b", input_ids=small))
    frames = encode(p.Submit(request_id="r", prompts=prompts), p.Inline(max_bytes=255))
    assert len(frames) == 2 and bytes(memoryview(frames[1])) == big.tobytes()
    assert len(encode(p.Submit(request_id="r", prompts=prompts), p.Inline(max_bytes=256))) == 1
    many = tuple(p.Prompt(prompt_id=str(i), input_ids=np.full(4, i, np.int32)) for i in range(10))
    frames = encode(p.Submit(request_id="r", prompts=many), p.Inline(max_bytes=16, budget_bytes=48))
    assert len(frames) == 1 + 7  # three inline (48 bytes), the rest in frames
    assert decode([bytes(memoryview(f)) for f in frames]) == p.Submit(request_id="r", prompts=many)
    assert len(encode(p.Submit(request_id="r", prompts=many), p.Inline(max_bytes=0))) == 11


def test_inline_for_settles_on_the_peers_minor_and_header_limit() -> None:
    assert p.inline_for(0) is None and p.inline_for(p.INLINE_MINOR - 1) is None  # minor 11 or a peer that did not say
    pol = p.inline_for(p.INLINE_MINOR)
    assert pol is not None and pol.max_bytes == p.DEFAULT_INLINE_MAX_BYTES and pol.budget_bytes <= p.DEFAULT_LIMITS.max_header_bytes // 8
    assert p.inline_for(p.INLINE_MINOR, 64 * 1024) == p.Inline(p.DEFAULT_INLINE_MAX_BYTES, 8 * 1024)
    assert p.inline_for(p.INLINE_MINOR, 0, inline_max_bytes=0) is None
    assert p.settle_minor(0) == 0 and p.settle_minor(11) == 11 and p.settle_minor(p.PROTOCOL_MINOR + 5) == p.PROTOCOL_MINOR


def test_an_array_anywhere_else_is_still_refused_with_a_policy() -> None:
    bad = p.Prompt(prompt_id="a", input_ids=np.zeros(2, np.int32), metadata={"x": np.zeros(2, np.int32)})
    for policy in (None, p.Inline()):
        with pytest.raises(ProtocolError) as err:
            encode(p.Submit(request_id="r", prompts=(bad,)), policy)
        assert err.value.code == "encode"


def _inline_header(type_name: str, fields: Any) -> bytes:
    return msgpack.packb([1, p.PROTOCOL_MINOR, type_name, fields], use_bin_type=True)


def test_malformed_inline_arrays_raise_protocol_error() -> None:
    good = {"request_id": "r", "prompts": [{"prompt_id": "a", "input_ids": b"\x01\x00\x00\x00"}]}
    assert decode([_inline_header("submit", good)]).prompts[0].input_ids.tolist() == [1]
    cases: list[tuple[Any, Limits | None, str]] = [
        ({"request_id": "r", "prompts": [{"prompt_id": "a", "input_ids": b"\x01\x00\x00"}]}, None, "frames"),  # 3 bytes of int32
        ({"request_id": "r", "prompts": [{"prompt_id": "a", "input_ids": "text"}]}, None, "type"),  # a str is not a bin
        ({"request_id": "r", "prompts": [{"prompt_id": "a", "input_ids": b"\x00" * 64}]}, Limits(max_frame_bytes=32), "oversize"),
        ({"request_id": "r", "prompts": [{"prompt_id": "a", "input_ids": b"\x00" * 64}]}, Limits(max_bin_len=32), "oversize"),
        ({"request_id": "r", "prompts": [{"prompt_id": "a", "input_ids": b"\x00" * 4096}]}, Limits(max_header_bytes=1024), "oversize"),
    ]
    for fields, limits, code in cases:
        with pytest.raises(ProtocolError) as err:
            decode([_inline_header("submit", fields)], limits or p.DEFAULT_LIMITS)
        assert err.value.code == code, (fields, err.value)
    traj = {"prompt_id": "g", "sample_index": 0, "input_ids": b"", "output_ids": b"", "token_versions": b"", "loss_mask": b"",
            "finish_reason": "stop"}
    ok = decode([_inline_header("result", {"task_id": "t", "prompt_id": "g", "trajectories": [traj | {"output_logprobs": b""}]})])
    assert ok.trajectories[0].output_logprobs.size == 0  # empty arrays inline are fine
    with pytest.raises(ProtocolError) as err:  # 6 bytes are not float32s
        decode([_inline_header("result", {"task_id": "t", "prompt_id": "g", "trajectories": [traj | {"output_logprobs": b"\x00" * 6}]})])
    assert err.value.code == "frames"
    with pytest.raises(ProtocolError) as err:  # an inline array and a frame nothing refers to
        decode([_inline_header("submit", good), b"\x00" * 4])
    assert err.value.code == "frames"


def test_records_received_with_every_array_inline_are_sent_on_as_their_maps() -> None:
    sample = samples()["result"]
    fields: list[Any] = []
    frames = [bytes(memoryview(f)) for f in encode(sample, p.Inline())]
    result = decode(frames, fields_out=fields)
    raws = fields[0]["trajectories"]
    entry = p.carry_entry(result.trajectories, raws)
    assert entry is not None and entry[0] is result.trajectories and entry[1] is raws
    assert entry[2] == sum(len(v) for v in raws[0].values() if type(v) is bytes) and entry[3] == 16  # the prompt: 4 int32
    batch = p.Batch(request_id="r", epoch="e", groups=(p.GroupResult(prompt_id="p1", state="done", trajectories=result.trajectories),))
    carried = encode(batch, p.Inline(), {id(result.trajectories): entry})
    assert len(carried) == 1 and msgpack.unpackb(carried[0])[3]["groups"][0]["trajectories"] == raws
    assert decode(carried) == batch == decode(encode(batch, p.Inline()))
    # an unknown field of a newer sender goes on with the map (bounded when it was decoded)
    newer = [dict(raws[0], from_the_future=1)]
    out = encode(batch, p.Inline(), {id(result.trajectories): p.carry_entry(result.trajectories, newer)})
    assert msgpack.unpackb(out[0])[3]["groups"][0]["trajectories"][0]["from_the_future"] == 1
    # encoded again instead: no policy (a minor-11 peer), a policy its arrays exceed, another tuple, frames in the map
    plain = encode(batch, p.Inline())
    assert encode(batch, None, {id(result.trajectories): entry}) == encode(batch)
    assert encode(batch, p.Inline(max_bytes=8), {id(result.trajectories): entry}) == encode(batch, p.Inline(max_bytes=8))
    assert encode(batch, p.Inline(), {id(result.trajectories): (tuple(result.trajectories), *entry[1:])}) == plain
    framed: list[Any] = []
    res2 = decode([bytes(memoryview(f)) for f in encode(sample)], fields_out=framed)
    assert p.carry_entry(res2.trajectories, framed[0]["trajectories"]) is None  # frame indices name this message's frames
    assert p.carry_entry((), []) is None and p.carry_entry(result.trajectories, raws * 2) is None


def test_numpy_scalars_and_lists_are_accepted_on_encode() -> None:
    msg = p.Task(task_id="t", prompt=p.Prompt(prompt_id="x", input_ids=[1, 2, 3], group_size=np.int64(4)))  # type: ignore[arg-type]
    out = _roundtrip(msg)
    assert out.prompt.group_size == 4 and out.prompt.input_ids.tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    "bad",
    [
        p.Credit(credits="3"),  # type: ignore[arg-type]
        p.Credit(credits=True),  # bools are not ints
        p.Nack(task_ids=("a", 1)),  # type: ignore[arg-type]
        p.Task(task_id="t", prompt=p.Prompt(prompt_id="x", input_ids=[2**40])),  # type: ignore[arg-type]
        p.Submit(request_id="r", prompts=(object(),)),  # type: ignore[arg-type]
        p.Reply(request_id="r", data={"x": object()}),
    ],
)
def test_encode_refuses_wrong_types_with_protocol_error(bad: Any) -> None:
    with pytest.raises(ProtocolError):
        encode(bad)


def test_encode_refuses_unregistered_types() -> None:
    with pytest.raises(ProtocolError):
        encode(p.SamplingParams())


# --------------------------------------------------------------------------- malformed input


def _header(type_name: str, fields: Any, major: int = 1, minor: int = 0) -> bytes:
    return msgpack.packb([major, minor, type_name, fields], use_bin_type=True)


def _code(frames: list[bytes], limits: Limits = p.DEFAULT_LIMITS) -> str:
    with pytest.raises(ProtocolError) as info:
        decode(frames, limits)
    return info.value.code


def test_malformed_input_of_every_kind_raises_protocol_error() -> None:
    good = [bytes(memoryview(f)) for f in encode(samples()["result"])]
    assert _code([]) == "truncated"
    assert _code([good[0][:-5]] + good[1:]) == "malformed"  # truncated header
    assert _code(good[:-1]) == "frames"  # a referenced frame is missing
    assert _code(good + [b"extra"]) == "frames"  # a frame nobody refers to
    assert _code([b"\xc1"]) == "malformed"  # never-used msgpack byte
    assert _code([msgpack.packb({"t": "x"})]) == "malformed"  # not the header shape
    assert _code([_header("no_such_type", {})]) == "unknown_type"
    assert _code([_header("credit", {"credits": 1}, major=2)]) == "version"
    assert _code([_header("credit", {})]) == "missing_field"
    assert _code([_header("credit", {"credits": "1"})]) == "type"
    assert _code([_header("credit", {"credits": 1.5})]) == "type"
    assert _code([_header("nack", {"task_ids": "abc"})]) == "type"
    assert _code([_header("reply", {"request_id": "r", "data": {"x": msgpack.ExtType(1, b"x")}})]) == "malformed"
    assert _code([_header("chunk", {"request_id": "c", "version": 1, "bucket": 0, "offset": 0, "data": 5})]) == "frames"
    bad_len = [_header("result", {"task_id": "t", "prompt_id": "p", "trajectories": [
        {"prompt_id": "p", "sample_index": 0, "input_ids": 1, "output_ids": 1, "output_logprobs": 1,
         "token_versions": 1, "loss_mask": 1, "finish_reason": "stop"}]}), b"abc"]
    assert _code(bad_len) == "frames"  # 3 bytes is not a whole int32
    assert _code([b"not bytes" * 0, object()]) in ("malformed", "truncated")  # type: ignore[list-item]


def test_unknown_fields_are_ignored_for_additive_evolution() -> None:
    out = decode([_header("credit", {"credits": 2, "from_the_future": [1, 2]}, minor=7)])
    assert out == p.Credit(credits=2)


def test_compiled_decoders_fill_defaults_fresh_and_bound_unknown_fields_among_few_known() -> None:
    """Each record's decoder is generated code (one block per field); it must keep the loop's rules."""
    hello = {"worker_id": "w", "protocol_min": 1, "protocol_max": 1, "engine": "e", "capacity": 2, "credits": 2}
    a = decode([_header("hello", hello)])
    assert a == p.Hello(worker_id="w", protocol_min=1, protocol_max=1, engine="e", capacity=2, credits=2)  # absent: defaults
    assert a.pool == "default" and a.weight_version == -1 and a.features == ()
    b = decode([_header("hello", hello)])
    assert a.engine_info == {} and a.engine_info is not b.engine_info  # a default factory is called per object
    # unknown fields are bounded even when the message is short because known fields are absent
    limits = Limits(max_unknown_fields=2)
    assert decode([_header("credit", {"credits": 1, "x1": 0, "x2": 0})], limits) == p.Credit(credits=1)
    assert _code([_header("credit", {"credits": 1, "x1": 0, "x2": 0, "x3": 0})], limits) == "oversize"
    assert _code([_header("hello", {**hello, "x1": 0, "x2": 0, "x3": 0})], limits) == "oversize"
    with pytest.raises(AttributeError):
        a.worker_id = "x"  # type: ignore[misc]  # still a frozen record


def test_an_all_defaults_record_is_one_shared_instance_and_encodes_as_before() -> None:
    """`Prompt.sampling` absent or `{}` decodes to one shared, frozen `SamplingParams()` (built once, not per prompt);
    any other value is decoded as before, and every prompt encodes to the same bytes either way."""
    ids = np.arange(3, dtype=np.int32)
    shared = decode(encode(p.Submit(request_id="r", prompts=(p.Prompt(prompt_id="a", input_ids=ids),)))).prompts[0].sampling
    assert shared == p.SamplingParams()
    absent = decode([_header("submit", {"request_id": "r", "prompts": [{"prompt_id": "b", "text": "x"}]})]).prompts[0]
    assert absent.sampling is shared and absent.metadata == {}
    other = decode(encode(p.Submit(request_id="r", prompts=(p.Prompt(prompt_id="c", text="x", sampling=p.SamplingParams(top_k=5)),))))
    assert other.prompts[0].sampling == p.SamplingParams(top_k=5) and other.prompts[0].sampling is not shared
    with pytest.raises(AttributeError):
        shared.top_k = 3  # type: ignore[misc]  # frozen: sharing it cannot leak a change
    fresh = p.Task(task_id="t", prompt=p.Prompt(prompt_id="a", input_ids=ids))
    reused = p.Task(task_id="t", prompt=p.Prompt(prompt_id="a", input_ids=ids, sampling=shared))
    assert [bytes(memoryview(f)) for f in encode(fresh)] == [bytes(memoryview(f)) for f in encode(reused)]
    assert b"sampling" in encode(reused)[0]  # still written (as an empty map), as every earlier build wrote it


def test_compiled_inits_take_what_dataclasses_inits_take() -> None:
    """Every record's `__init__` is generated (slot setters): same parameters, in order, same defaults, a fresh
    object from each default factory, still frozen."""
    import dataclasses
    import inspect

    for cls in p.codec._SPECS:
        params = list(inspect.signature(cls).parameters.values())
        fields = dataclasses.fields(cls)
        assert [x.name for x in params] == [f.name for f in fields], cls
        for x, f in zip(params, fields, strict=True):
            if f.default is not dataclasses.MISSING:
                assert x.default is f.default, (cls, f.name)
            elif f.default_factory is not dataclasses.MISSING:
                assert repr(x.default) == "<factory>", (cls, f.name)
            else:
                assert x.default is inspect.Parameter.empty, (cls, f.name)
    a, b = p.Prompt(prompt_id="a"), p.Prompt("b", None, "t")
    assert a.metadata == {} and a.metadata is not b.metadata and b.text == "t" and a.sampling == p.SamplingParams()
    with pytest.raises(TypeError):
        p.Task(task_id="t")  # type: ignore[call-arg]
    with pytest.raises(AttributeError):
        a.prompt_id = "c"  # type: ignore[misc]


def test_zmq_frames_decode_as_bytes_do() -> None:
    """A zmq.Frame is sized by len() and read as it is (no memoryview): same message, same limits."""
    zmq = pytest.importorskip("zmq")
    msg = p.Submit(request_id="r", prompts=(p.Prompt(prompt_id="a", input_ids=np.arange(5, dtype=np.int32), metadata={"t": 1.5}),))
    raw = [bytes(memoryview(f)) for f in encode(msg)]
    for _ in range(2):  # the first sighting of the type, then the remembered one
        assert decode([zmq.Frame(x) for x in raw]) == msg == decode(raw)
    with pytest.raises(ProtocolError) as exc:
        decode([zmq.Frame(x) for x in raw], Limits(max_frame_bytes=19))
    assert exc.value.code == "oversize" and "frame 1 of 20 bytes" in str(exc.value)
    with pytest.raises(ProtocolError) as exc:
        decode([zmq.Frame(raw[0][:-3]), zmq.Frame(raw[1])])
    assert exc.value.code == "malformed"


def test_decoded_arrays_are_read_only_whatever_the_frames_are() -> None:
    """The module's promise: arrays decode as read-only zero-copy views (a zmq.Frame's buffer is writable: writing into
    a decoded prompt would write into the received frame, which other decoded fields may share)."""
    zmq = pytest.importorskip("zmq")
    msg = p.Submit(request_id="r", prompts=(p.Prompt(prompt_id="a", input_ids=np.arange(5, dtype=np.int32)),))
    raw = [bytes(memoryview(f)) for f in encode(msg)]
    for frames in (raw, [zmq.Frame(x) for x in raw], [bytearray(x) for x in raw]):
        ids = decode(frames).prompts[0].input_ids
        assert not ids.flags.writeable
        with pytest.raises(ValueError):
            ids[0] = 7


def test_message_bytes_is_the_largest_part_whatever_its_type() -> None:
    frames = [b"12345", np.zeros(3, np.float32), memoryview(b"1234567"), bytearray(2), np.zeros((2, 2), np.int32)[:, 0]]
    assert p.codec.message_bytes(frames) == 12
    assert p.codec.message_bytes([]) == 0


def test_a_minor6_apply_done_has_no_skipped_field_and_reads_as_not_skipped() -> None:
    # protocol 1.7 added ApplyDone.skipped; a 1.6 worker's failure report stays an ordinary (not final) failure
    old = decode([_header("apply_done", {"version": 3, "ok": False, "duration_s": 0.5, "error": "boom"}, minor=6)])
    assert old == p.ApplyDone(version=3, ok=False, duration_s=0.5, error="boom") and old.skipped is False
    # and a 1.6 peer reads a 1.7 report: the new field is one unknown field, ignored
    frames = encode(p.ApplyDone(version=3, ok=False, error="boom", skipped=True))
    assert msgpack.unpackb(frames[0])[3]["skipped"] is True


def test_limits_refuse_oversize_before_allocating() -> None:
    small = Limits(max_header_bytes=64, max_frame_bytes=16, max_frames=3, max_str_len=8, max_array_len=4, max_map_len=32, max_depth=2)
    assert _code([b"\x00" * 65], small) == "oversize"
    assert _code([_header("chunk", {"request_id": "c", "version": 1, "bucket": 0, "offset": 0, "data": 1}), b"x" * 17], small) == "oversize"
    assert _code([b"a", b"b", b"c", b"d"], small) == "oversize"
    assert _code([_header("error", {"code": "x" * 9, "message": ""})], small) == "oversize"  # string too long (msgpack's own limit)
    assert _code([_header("nack", {"task_ids": ["a"] * 5})], small) == "oversize"  # list too long (msgpack's own limit)
    deep: Any = 1
    for _ in range(4):
        deep = {"k": deep}
    assert _code([_header("reply", {"request_id": "r", "data": deep})], Limits(max_depth=2)) == "oversize"
    assert _code([b"x" * 10, b"y" * 10], Limits(max_message_bytes=15)) in ("oversize",)


def test_decode_never_unpickles() -> None:
    payload = pickle.dumps({"x": 1})
    assert _code([payload]) in ("malformed",)


# --------------------------------------------------------------------------- fuzz


def _mutations(good: list[bytes], rng: random.Random) -> list[bytes]:
    frames = [bytearray(f) for f in good]
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        i = rng.randrange(len(frames))
        f = frames[i]
        if op == 0 and f:
            f[rng.randrange(len(f))] = rng.randrange(256)
        elif op == 1 and f:
            del f[rng.randrange(len(f)) :]
        elif op == 2:
            f[rng.randrange(len(f) + 1) : 0] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 3:
            frames.insert(i, bytearray(rng.randbytes(rng.randint(0, 16))))
        elif op == 4 and len(frames) > 1:
            del frames[i]
    return [bytes(f) for f in frames]


def test_fuzz_mutated_frames_raise_only_protocol_error() -> None:
    """10,000 mutated frame lists (seeded) through decode: ProtocolError or a valid message, nothing else."""
    rng = random.Random(1234)
    goods = [[bytes(memoryview(f)) for f in encode(m)] for m in samples().values()]
    goods += [[bytes(memoryview(f)) for f in encode(m, p.Inline())] for m in inline_samples().values()]  # minor 12
    counts = {"ok": 0, "protocol_error": 0}
    for n in range(10_000):
        frames = _mutations(goods[n % len(goods)], rng)
        try:
            decode(frames)
            counts["ok"] += 1
        except ProtocolError:
            counts["protocol_error"] += 1
    assert sum(counts.values()) == 10_000
    assert counts["protocol_error"] > 5_000  # the mutations really do break messages


@pytest.mark.slow  # 10,000 examples: ~25 s on a loaded 2-core box
@pytest.mark.timeout(120)
@settings(max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=6))
def test_fuzz_random_frame_lists_raise_only_protocol_error(frames: list[bytes]) -> None:
    try:
        decode(frames)
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_message(), st.data())
def test_fuzz_structured_headers_raise_only_protocol_error(msg: Any, data: st.DataObject) -> None:
    """Valid headers with one field replaced by a random msgpack value."""
    frames = [bytes(memoryview(f)) for f in encode(msg)]
    major, minor, t, fields = msgpack.unpackb(frames[0])
    if fields:
        key = data.draw(st.sampled_from(sorted(fields)))
        ints = st.integers(-(2**63), 2**63 - 1)
        fields[key] = data.draw(st.none() | ints | st.text(max_size=5) | st.lists(ints, max_size=3) | st.binary(max_size=4))
    frames[0] = msgpack.packb([major, minor, t, fields], use_bin_type=True)
    try:
        decode(frames)
    except ProtocolError:
        pass
