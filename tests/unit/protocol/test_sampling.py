"""The one definition of valid sampling settings (protocol.sampling), as the endpoint, the client and the engines use it."""

from __future__ import annotations

import math

import pytest

from rollpool.protocol.messages import SamplingParams
from rollpool.protocol.sampling import MAX_SEED, sampling_problem


@pytest.mark.parametrize(("changes", "n", "field"), [
    ({"temperature": math.nan}, 1, "temperature"),
    ({"temperature": math.inf}, 1, "temperature"),
    ({"temperature": -0.1}, 1, "temperature"),
    ({"top_p": math.nan}, 1, "top_p"),
    ({"top_p": 0.0}, 1, "top_p"),
    ({"min_p": math.nan}, 1, "min_p"),
    ({"top_k": 0}, 1, "top_k"),
    ({"top_k": 2**40}, 1, "top_k"),
    ({"max_new_tokens": 0}, 1, "max_new_tokens"),
    ({"max_new_tokens": 2**40}, 1, "max_new_tokens"),
    ({"seed": 2**64}, 1, "seed"),
    ({"seed": -(2**63) - 1}, 1, "seed"),
    ({"seed": MAX_SEED}, 2, "seed"),  # sample 1 would use seed + 1
    ({"stop_token_ids": (-1,)}, 1, "stop_token_ids"),
    ({"top_logprobs_num": -1}, 1, "top_logprobs_num"),
    ({}, 0, "n"),
])
def test_each_bad_value_is_named(changes: dict[str, object], n: int, field: str) -> None:
    problem = sampling_problem(SamplingParams(**changes), n)  # type: ignore[arg-type]
    assert problem is not None and problem.field == field and field in problem.message


@pytest.mark.parametrize("changes", [{}, {"temperature": 0.0}, {"temperature": 7.5}, {"seed": MAX_SEED}, {"seed": -5},
                                     {"top_k": 1}, {"top_p": 1.0}, {"min_p": 1.0}, {"stop_token_ids": (0, 2**31 - 1)}])
def test_servable_values_pass(changes: dict[str, object]) -> None:
    assert sampling_problem(SamplingParams(**changes)) is None  # type: ignore[arg-type]
