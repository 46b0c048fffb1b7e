"""RolloutPool's reading of SGLang's generate arguments: honoured, mapped or refused by name (pure, no sockets)."""

from __future__ import annotations

import json
import pathlib
import struct

import numpy as np
import pytest

from rollpool.protocol import SamplingParams
from rollpool.trainer_client.compat._model import model_fingerprint, read_param_shapes
from rollpool.trainer_client.pool import (
    UnsupportedParameterError,
    _check_unsupported,
    _normalise_inputs,
    sampling_from_sglang,
)


def test_sglang_sampling_keys_map_to_the_pools_and_max_tokens_is_max_new_tokens() -> None:
    sp, n = sampling_from_sglang({"temperature": 0.7, "max_tokens": 50})
    assert sp == SamplingParams(temperature=0.7, max_new_tokens=50) and n == 1
    sp, n = sampling_from_sglang({"max_new_tokens": 8, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "stop": "\n", "stop_token_ids": 7,
                                  "ignore_eos": True, "sampling_seed": 3, "n": 4, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                                  "skip_special_tokens": True, "json_schema": None, "regex": None})
    assert sp == SamplingParams(max_new_tokens=8, top_p=0.9, top_k=5, min_p=0.1, stop=("\n",), stop_token_ids=(7,), ignore_eos=True, seed=3)
    assert n == 4
    assert sampling_from_sglang(None) == (SamplingParams(), 1)
    assert sampling_from_sglang({"temperature": None})[0] == SamplingParams()  # None means the default, as in SGLang


@pytest.mark.parametrize("params,name", [
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"min_new_tokens": 4}, "min_new_tokens"),
    ({"json_schema": "{}"}, "json_schema"),
    ({"regex": "a+"}, "regex"),
    ({"logit_bias": {"1": 2.0}}, "logit_bias"),
    ({"no_such_knob": 1}, "no_such_knob"),
])
def test_a_sampling_key_the_pool_cannot_honour_is_refused_by_name(params: dict[str, object], name: str) -> None:
    with pytest.raises(UnsupportedParameterError, match=name) as info:
        sampling_from_sglang(params)
    assert name in info.value.parameter


def test_conflicting_or_malformed_sampling_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="max_new_tokens=8 and max_tokens=9"):
        sampling_from_sglang({"max_new_tokens": 8, "max_tokens": 9})
    with pytest.raises(ValueError, match="n'\\] must be >= 1"):
        sampling_from_sglang({"n": 0})
    with pytest.raises(TypeError, match="sampling_params must be a dict"):
        sampling_from_sglang([{"temperature": 1.0}])  # type: ignore[arg-type]


def test_inputs_single_batch_tokens_and_the_nemo_dict_refused() -> None:
    assert _normalise_inputs("hi", None) == (["hi"], True)
    assert _normalise_inputs(["a", "b"], None) == (["a", "b"], False)
    assert _normalise_inputs(None, [1, 2, 3]) == ([[1, 2, 3]], True)
    assert _normalise_inputs(None, np.array([[1, 2], [3, 4]])) == ([[1, 2], [3, 4]], False)
    with pytest.raises(TypeError, match="NeMo-RL's batched data"):
        _normalise_inputs({"input_ids": [[1]], "input_lengths": [1]}, None)
    with pytest.raises(TypeError, match="NeMo-RL's batched data"):
        _normalise_inputs(None, {"input_ids": [[1]]})
    with pytest.raises(TypeError, match="token ids go in input_ids"):
        _normalise_inputs([1, 2], None)
    with pytest.raises(ValueError, match="not both"):
        _normalise_inputs("x", [1])
    with pytest.raises(ValueError, match="needs prompt or input_ids"):
        _normalise_inputs(None, None)
    with pytest.raises(TypeError, match="non-empty"):
        _normalise_inputs(None, [[1], []])


@pytest.mark.parametrize("kwargs,name", [
    ({"custom_logit_processor": "x"}, "custom_logit_processor"),
    ({"logprob_start_len": -2}, "logprob_start_len"),  # a position >= 0 is honoured (by engines that can), -1 means none
    ({"top_logprobs_num": 65}, "top_logprobs_num"),  # above MAX_TOP_LOGPROBS (0..64 are honoured by engines that can)
    ({"top_logprobs_num": [3, -1]}, "top_logprobs_num"),
    ({"stream": True}, "stream"),
])
def test_generate_arguments_the_pool_lacks_are_refused_by_name(kwargs: dict[str, object], name: str) -> None:
    args: dict[str, object] = {"image_data": None, "lora_path": None, "custom_logit_processor": None, "logprob_start_len": None,
                               "top_logprobs_num": None, "stream": False, **kwargs}
    if isinstance(args["top_logprobs_num"], list):
        args["count"] = len(args["top_logprobs_num"])  # type: ignore[arg-type]
        with pytest.raises(UnsupportedParameterError, match=name):
            _check_unsupported(**args)  # type: ignore[arg-type]
        return
    with pytest.raises(UnsupportedParameterError, match=name):
        _check_unsupported(count=1, **args)  # type: ignore[arg-type]


def test_neutral_values_of_those_arguments_are_accepted() -> None:
    _check_unsupported(image_data=None, lora_path=[None, None], custom_logit_processor=None, logprob_start_len=[-1, -1],
                       top_logprobs_num=0, stream=False, count=2)
    _check_unsupported(None, None, None, None, [5, 64], False, 2)  # honoured (by engines that report them)
    with pytest.raises(ValueError, match="list of 3 for 2 prompts"):
        _check_unsupported(None, None, None, [-1, -1, -1], None, False, 2)


def _write_safetensors(path: pathlib.Path, tensors: dict[str, tuple[int, ...]]) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors.items():
        n = int(np.prod(shape)) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def test_param_shapes_come_from_safetensors_headers_and_the_fingerprint_from_the_config_files(tmp_path: pathlib.Path) -> None:
    _write_safetensors(tmp_path / "model-00001.safetensors", {"a.weight": (4, 8)})
    _write_safetensors(tmp_path / "model-00002.safetensors", {"b.weight": (3,)})
    assert read_param_shapes(tmp_path) == {"a.weight": (4, 8), "b.weight": (3,)}
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    fp = model_fingerprint(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": 16}')
    assert model_fingerprint(tmp_path) != fp and len(fp) == 16


def test_top_logprobs_are_shaped_as_sglang_reports_them_and_missing_ones_are_an_error() -> None:
    from rollpool.protocol import GroupResult, GroupState, Trajectory
    from rollpool.trainer_client.pool import RolloutPool

    def traj(**top: object) -> Trajectory:
        top.setdefault("input_ids", np.array([1], np.int32))
        return Trajectory(prompt_id="p", sample_index=0, output_ids=np.array([7, 2], np.int32),
                          output_logprobs=np.array([-0.5, -0.25], np.float32), token_versions=np.array([0, 0], np.int32),
                          loss_mask=np.ones(2, np.uint8), finish_reason="stop", worker_id="w", **top)  # type: ignore[arg-type]

    with_tops = traj(output_top_ids=np.array([7, 3, 2, 9], np.int32), output_top_logprobs=np.array([-0.5, -1.0, -0.25, -2.0], np.float32))
    [res] = RolloutPool._to_sglang(GroupResult(prompt_id="p", state=GroupState.DONE, trajectories=(with_tops,)), 1, True, top_k=2)
    assert res["meta_info"]["output_top_logprobs"] == [[(-0.5, 7, None), (-1.0, 3, None)], [(-0.25, 2, None), (-2.0, 9, None)]]
    # a worker of protocol 1.4 ignores top_logprobs_num: said, never a silent result without them
    with pytest.raises(UnsupportedParameterError, match="ignored the request"):
        RolloutPool._to_sglang(GroupResult(prompt_id="p", state=GroupState.DONE, trajectories=(traj(),)), 1, True, top_k=2)
    # prompt logprobs: SGLang's input_token_logprobs from the asked position, None where nothing precedes
    [res] = RolloutPool._to_sglang(GroupResult(prompt_id="p", state=GroupState.DONE, trajectories=(
        traj(input_ids=np.array([4, 5], np.int32), input_logprobs=np.array([np.nan, -3.0], np.float32)),)), 1, True, logprob_start=0)
    assert res["meta_info"]["input_token_logprobs"] == [(None, 4, None), (-3.0, 5, None)]
    with pytest.raises(UnsupportedParameterError, match="logprob_start_len"):
        RolloutPool._to_sglang(GroupResult(prompt_id="p", state=GroupState.DONE, trajectories=(traj(),)), 1, True, logprob_start=0)
    bad = traj(output_top_ids=np.array([7, 3, 2], np.int32), output_top_logprobs=np.array([-0.5, -1.0, -0.25], np.float32))
    with pytest.raises(ValueError, match="3 top ids and 3 top logprobs for 2 tokens x 2"):
        RolloutPool._to_sglang(GroupResult(prompt_id="p", state=GroupState.DONE, trajectories=(bad,)), 1, True, top_k=2)
