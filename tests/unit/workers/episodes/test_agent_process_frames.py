"""The agent-process frames carry plain values only: a frame is never code (a pickle's payload is not run), the
prompt round-trips through the wire codec, and exceptions come back under their own names."""

from __future__ import annotations

import asyncio
import os
import pickle
import struct
from typing import Any

import numpy as np
import pytest

from rollpool.protocol.messages import Prompt, SamplingParams
from rollpool.workers.engines.base import SampleOutput
from rollpool.workers.episodes.episode import ContextLengthExceededError
from rollpool.workers.episodes.processes import (
    AgentProcessError,
    _exception_fields,
    _exception_from,
    _prompt_fields,
    _prompt_from,
    _read_frame,
    _sample_fields,
    _sample_from,
)


class _Payload:
    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, ("import os; os.environ['ROLLPOOL_PWNED'] = '1'",))


async def _read(body: bytes) -> Any:
    reader = asyncio.StreamReader()
    reader.feed_data(struct.pack("!I", len(body)) + body)
    reader.feed_eof()
    return await _read_frame(reader)


async def test_a_pickled_payload_is_not_run_and_closes_the_connection() -> None:
    os.environ.pop("ROLLPOOL_PWNED", None)
    assert await _read(pickle.dumps({"op": "done", "value": _Payload()})) is None
    assert "ROLLPOOL_PWNED" not in os.environ
    assert await _read(b"\xc1") is None  # not msgpack at all
    assert await _read(b"\x93\x01\x02\x03") is None  # msgpack, but not a map


def test_the_prompt_and_a_sample_round_trip_as_plain_values() -> None:
    prompt = Prompt(prompt_id="p1", input_ids=np.arange(5, dtype=np.int32), group_size=2,
                    sampling=SamplingParams(max_new_tokens=3, temperature=0.5), metadata={"answer": 4})
    back = _prompt_from(_prompt_fields(prompt))
    assert back.prompt_id == "p1" and back.input_ids.tolist() == [0, 1, 2, 3, 4] and back.metadata == {"answer": 4}
    assert back.sampling.temperature == 0.5
    out = SampleOutput(index=0, output_ids=[1, 2], logprobs=[-0.1, -0.2], token_versions=[3, 3], finish_reason="stop",
                       output_text="ab", matched_stop=2, top_ids=[[1], [2]], top_logprobs=[[-0.1], [-0.2]])
    assert _sample_from(_sample_fields(out)) == out


def test_exceptions_come_back_under_their_own_names() -> None:
    exc = _exception_from(_exception_fields(ValueError("the tool broke")))
    assert type(exc) is ValueError and str(exc) == "the tool broke"
    assert type(_exception_from(_exception_fields(ContextLengthExceededError("full")))) is ContextLengthExceededError

    class AgentsOwnError(Exception):
        pass

    mine = _exception_from(_exception_fields(AgentsOwnError("bad move")))
    assert isinstance(mine, AgentProcessError) and f"{type(mine).__name__}: {mine}" == "AgentsOwnError: bad move"
    odd = _exception_from({"exc_type": "no such name!", "text": "x"})
    assert type(odd) is AgentProcessError and str(odd) == "no such name!: x"
    with pytest.raises(AgentProcessError):
        raise _exception_from({})
