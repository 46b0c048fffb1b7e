"""SGLang request building and response parsing, on CPU, against responses recorded from real SGLang.

tests/fixtures/sglang/golden.json was written by tests/gpu/test_sglang_gpu.py on an H200
(SGLang 0.5.14, bench/gpu_sglang.py, 2026-11-29): a length-limited sample, a sample
stopped by a stop token, and a sample aborted mid-decode.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from rollpool.protocol import FinishReason, SamplingParams
from rollpool.workers.engines.sglang.wire import (
    RID_WIDTH,
    generate_body,
    parse_generate_response,
    parse_weight_version,
    pick_verify_names,
    sample_rid,
)

GOLDEN: dict[str, Any] = json.loads((pathlib.Path(__file__).parents[2] / "fixtures" / "sglang" / "golden.json").read_text())


def test_length_finish_keeps_every_token_with_its_logprob() -> None:
    s = parse_generate_response(GOLDEN["length"])
    assert s.finish_reason == FinishReason.LENGTH
    assert len(s.output_ids) == len(s.logprobs) == GOLDEN["length"]["meta_info"]["completion_tokens"] == 8
    assert s.output_ids == GOLDEN["length"]["output_ids"]
    assert all(lp <= 0.0 for lp in s.logprobs)
    assert parse_weight_version(s.weight_version) == 0


def test_stop_token_is_included_and_reported_as_matched() -> None:
    s = parse_generate_response(GOLDEN["stop_token"])
    assert s.finish_reason == FinishReason.STOP
    assert s.matched_stop == s.output_ids[-1] == 79  # SGLang keeps the stop token in output_ids
    assert len(s.output_ids) == len(s.logprobs)
    # the same prompt and seed as the length case: the stop cut the same sequence short
    assert s.output_ids == GOLDEN["length"]["output_ids"][: len(s.output_ids)]


def test_abort_keeps_the_partial_output() -> None:
    s = parse_generate_response(GOLDEN["abort"])
    assert s.finish_reason == FinishReason.ABORT and s.aborted_by_request
    assert 0 < len(s.output_ids) == len(s.logprobs)


def test_malformed_responses_are_refused() -> None:
    with pytest.raises(ValueError, match="meta_info"):
        parse_generate_response({"text": "x"})
    error = parse_generate_response({"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "status_code": 400, "message": "bad"}}})
    assert error.finish_reason == FinishReason.ERROR


def test_rids_are_fixed_width_so_no_rid_is_a_prefix_of_another() -> None:
    a, b = sample_rid("abcd1234", 1, 0, 0), sample_rid("abcd1234", 12, 0, 0)
    assert len(a) == len(b) == RID_WIDTH and not b.startswith(a) and not a.startswith(b)
    with pytest.raises(ValueError):
        sample_rid("short", 1, 0, 0)


def test_generate_body_uses_sglang_names_and_one_request_per_sample() -> None:
    sp = SamplingParams(max_new_tokens=16, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, stop_token_ids=(2,),
                        stop=("\n",), ignore_eos=True, seed=10)
    body = generate_body([1, 2, 3], sp, rid=sample_rid("abcd1234", 3, 1, 0), index=1)
    assert body["input_ids"] == [1, 2, 3] and body["return_logprob"] is True and body["stream"] is False
    assert body["sampling_params"] == {"max_new_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
                                       "ignore_eos": True, "stop_token_ids": [2], "stop": ["\n"], "sampling_seed": 11}
    assert "n" not in body["sampling_params"]  # n > 1 would make SGLang replace our rids


def test_generate_body_ids_as_an_array_write_the_same_json_and_the_same_hop_frame() -> None:
    import numpy as np

    pytest.importorskip("aiohttp")  # the http module (its JSON helpers) needs the sglang extra's aiohttp
    from rollpool.workers.engines.sglang.hop import _pack_ids, _unpack_ids
    from rollpool.workers.engines.sglang.http import dumps, loads

    sp = SamplingParams(max_new_tokens=7, temperature=0.5)
    ids = [5, 0, 383, 2**31 - 1]
    as_list, as_array = (generate_body(x, sp, rid="r", index=0) for x in (ids, np.asarray(ids, dtype=np.int64)))
    assert loads(dumps(as_array)) == loads(dumps(as_list)) == {**as_list, "input_ids": ids}
    assert _unpack_ids(_pack_ids(as_array["input_ids"])) == _unpack_ids(_pack_ids(as_list["input_ids"])) == ids
    # the engine's int32 array (its ids checked against the vocabulary) travels as the same frame and the same JSON
    as_int32 = generate_body(np.asarray(ids, dtype=np.int32), sp, rid="r", index=0)
    assert _pack_ids(as_int32["input_ids"]) == _pack_ids(ids) and loads(dumps(as_int32)) == loads(dumps(as_list))
    for bad in ([2**31], [-(2**31) - 1], [1.5], [[1, 2]]):
        with pytest.raises(ValueError):
            _pack_ids(bad)


def test_verification_avoids_the_huge_embedding_tensors() -> None:
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight",
             "model.layers.1.self_attn.o_proj.weight", "lm_head.weight"]
    shapes = {n: (32000, 2048) if ("embed" in n or "lm_head" in n) else (2048, 2048) for n in names}
    picks = pick_verify_names(names, shapes)
    assert picks and not any("embed" in n or "lm_head" in n for n in picks)


def test_verification_prefers_one_cheap_norm_weight() -> None:
    names = [f"model.layers.{i}.{part}" for i in range(4) for part in ("input_layernorm.weight", "self_attn.o_proj.weight")]
    shapes = {n: (2048,) if "norm" in n else (2048, 2048) for n in names}
    assert pick_verify_names(names, shapes) == ["model.layers.2.input_layernorm.weight"]
    assert pick_verify_names([n for n in names if "norm" not in n], shapes) == [
        "model.layers.0.self_attn.o_proj.weight", "model.layers.2.self_attn.o_proj.weight"]


def test_shim_json_round_trips_a_recorded_response_with_or_without_orjson(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    pytest.importorskip("aiohttp")  # the shim lives in the http module, which needs the sglang extra's aiohttp

    from rollpool.workers.engines.sglang.http import dumps as _dumps
    from rollpool.workers.engines.sglang.http import loads as _loads

    golden = json.loads((pathlib.Path(__file__).parents[2] / "fixtures" / "sglang" / "golden.json").read_text())
    assert _loads(_dumps(golden["abort"])) == golden["abort"]
    assert _loads(b'{"lp": -Infinity}') == {"lp": float("-inf")}  # what the stdlib encoder writes for -inf
    real_import = builtins.__import__

    def no_orjson(name: str, *args: object, **kw: object) -> object:
        if name == "orjson":
            raise ImportError(name)
        return real_import(name, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", no_orjson)
    assert _loads(_dumps({"t": (1, 2), "x": None})) == {"t": [1, 2], "x": None}


def test_version_bytes_counts_floating_parameters_in_the_serving_dtype() -> None:
    from rollpool.workers.engines.sglang.wire import version_bytes

    params = {"w": ("float32", (4, 8)), "norm": ("bfloat16", (8,)), "pos": ("int64", (3,))}
    assert version_bytes(params) == 4 * 8 * 4 + 8 * 2 + 3 * 8  # as stored
    assert version_bytes(params, "bfloat16") == 4 * 8 * 2 + 8 * 2 + 3 * 8  # what a trainer publishing bf16 sends
    assert version_bytes(params, "auto") == version_bytes(params)
    assert version_bytes({"q": ("float4_packed", (2,))}) == 0  # a dtype it cannot size: unknown, not a guess


def test_logprobs_are_floats_with_a_missing_one_read_as_zero() -> None:
    meta = {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, 7, None], [None, 8, None], [-1, 9, None]]}
    s = parse_generate_response({"output_ids": [7, 8, 9], "meta_info": meta})
    assert s.logprobs == [-0.5, 0.0, -1.0] and all(type(x) is float for x in s.logprobs)
    s = parse_generate_response({"output_ids": [7, 9], "meta_info": {**meta, "output_token_logprobs": [[-0.5, 7, None], [-1, 9, None]]}})
    assert s.logprobs == [-0.5, -1.0] and all(type(x) is float for x in s.logprobs)


def _over_the_hop(answer: Any) -> Any:
    """`answer` as the hop's caller gets it: the child's frames after the status, read back as the client does."""
    from rollpool.workers.engines.sglang.hop import _answer_frames, _with_logprobs
    from rollpool.workers.engines.sglang.http import loads

    frames = _answer_frames(answer)
    if len(frames) == 3:
        return _with_logprobs(loads(frames[0]), frames[1], frames[2])
    return loads(frames[0]) if frames[0] else None


def test_the_hops_logprob_frames_give_what_the_json_gives_and_odd_entries_stay_json() -> None:
    pytest.importorskip("aiohttp")  # the http module (its JSON helpers) needs the sglang extra's aiohttp
    from rollpool.workers.engines.sglang.hop import _answer_frames
    from rollpool.workers.engines.sglang.http import dumps, loads
    from rollpool.workers.engines.sglang.wire import LogprobTriples

    for name in ("length", "stop_token", "abort"):
        answer = GOLDEN[name]
        by_json, by_hop = loads(dumps(answer)), _over_the_hop(answer)
        assert len(_answer_frames(answer)) == (3 if answer["meta_info"]["output_token_logprobs"] else 1)
        assert by_hop == by_json and list(by_hop["meta_info"]) == list(by_json["meta_info"])  # same keys, same order
        assert parse_generate_response(by_hop) == parse_generate_response(by_json)
    # exact floats (a logprob's every bit), -0.0, ids at the int32 bounds, tuples as lists
    entries = [(-0.1 + 1e-17 * i, t, None) for i, t in enumerate([0, 2**31 - 1, -(2**31), 5])] + [(-0.0, 9, None)]
    got = _over_the_hop({"output_ids": None, "meta_info": {"output_token_logprobs": entries, "finish_reason": None}})
    assert type(got["meta_info"]["output_token_logprobs"]) is LogprobTriples
    assert [[float(v).hex(), t, x] for v, t, x in got["meta_info"]["output_token_logprobs"]] == [
        [float(v).hex(), t, x] for v, t, x in entries]
    assert got["meta_info"]["output_token_logprobs"][1:3] == [list(e) for e in entries[1:3]]
    parsed = parse_generate_response(got)
    assert parsed.output_ids == [t for _, t, _ in entries] and [x.hex() for x in parsed.logprobs] == [v.hex() for v, _, _ in entries]
    # what the columns cannot hold exactly stays JSON, and reads as before (a non-finite logprob is JSON's null: 0.0)
    for odd in ([[float("nan"), 1, None]], [[float("-inf"), 1, None]], [[-1, 1, None]], [[None, 1, None]], [[-1.0, 2**31, None]],
                [[-1.0, True, None]], [[-1.0, 1]], [[-1.0, 1, None, 0]], [[-1.0, 1, 0]], ["abc"], [{"a": 1, "b": 2, "c": 3}]):
        answer = {"output_ids": [1], "meta_info": {"output_token_logprobs": odd, "finish_reason": {"type": "length"}}}
        assert len(_answer_frames(answer)) == 1, odd
        assert _over_the_hop(answer) == loads(dumps(answer))
    for plain in (None, [1, 2], {"text": "x"}, {"meta_info": {"output_token_logprobs": []}}, {"meta_info": "x"}):
        assert len(_answer_frames(plain)) == 1 and _over_the_hop(plain) == (None if plain is None else loads(dumps(plain)))
