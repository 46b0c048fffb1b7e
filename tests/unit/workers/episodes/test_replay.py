"""The replay of a re-run episode: the turns an earlier attempt recorded are served back where the requests match.

The engine is `ScriptedEngine`, a FAKE at the process edge: every call it gets is in `engine.prompts`, so a turn
served from the record is one the engine never saw.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from rollpool.protocol.messages import Prompt, RecordedTurn, SamplingParams
from rollpool.workers import EpisodeContext
from rollpool.workers.episodes import EpisodeConfig, EpisodeRunner
from tests.unit.workers.episodes.scripted_engine import ScriptedEngine

EOS = 99
SCRIPT = [[10, 11, EOS], [12, 13, EOS], [14, EOS], [15, EOS]]


def _prompt(n: int = 1) -> Prompt:
    return Prompt(prompt_id="p", input_ids=np.array([1, 2, 3], dtype=np.int32), group_size=n, sampling=SamplingParams(max_new_tokens=8))


def _agent(tool_output: list[list[int]]) -> Any:
    """Four turns with a tool result between them; `tool_output[k]` is what the tool gives after turn k."""

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> float:
        for k in range(4):
            await ctx.generate()
            if k < 3:
                ctx.append(tool_output[k])
        return 1.0

    return agent


async def _run(engine: ScriptedEngine, agent: Any, *, n: int = 1, **replay: Any) -> tuple[list[Any], list[RecordedTurn], EpisodeRunner]:
    recorded: list[RecordedTurn] = []
    async with EpisodeRunner(engine, agent, EpisodeConfig(serve_openai=False), worker_id="w") as runner:
        out = await runner.run_group(_prompt(n), attempt=1, on_turn=recorded.append, **replay)
    return out, recorded, runner


def _same(a: Any, b: Any) -> None:
    for name in ("input_ids", "output_ids", "output_logprobs", "token_versions", "loss_mask"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
    assert a.finish_reason == b.finish_reason and a.reward == b.reward


async def test_a_rerun_is_served_the_recorded_turns_and_samples_only_the_unfinished_one() -> None:
    tools = [[50], [51, 52], [53]]
    first = ScriptedEngine(list(SCRIPT), eos_id=EOS, version=2)
    (whole,), recorded, _ = await _run(first, _agent(tools))
    assert [r.turn for r in recorded] == [0, 1, 2, 3] and len(first.prompts) == 4
    # the first attempt's worker died during turn 2: turns 0 and 1 had been recorded
    again = ScriptedEngine([SCRIPT[2], SCRIPT[3]], eos_id=EOS, version=3)
    (t,), streamed, runner = await _run(again, _agent(tools), replay=recorded[:2])
    assert again.prompts == first.prompts[2:]  # only the unfinished turn and the one after it reached the engine
    assert [r.turn for r in streamed] == [2, 3]  # the replayed turns are not streamed again
    assert t.token_versions.tolist() == [2] * 9 + [3] * 5  # served turns keep the versions that sampled them
    for name in ("input_ids", "output_ids", "output_logprobs", "loss_mask"):
        assert getattr(t, name).tolist() == getattr(whole, name).tolist(), name
    st = runner.stats
    assert (st.turns_replayed, st.tokens_replayed, st.tokens_regenerated, st.replays_diverged) == (2, 6, 0, 0)


async def test_every_recorded_turn_served_leaves_the_engine_unused() -> None:
    first = ScriptedEngine(list(SCRIPT), eos_id=EOS)
    (whole,), recorded, _ = await _run(first, _agent([[50], [51], [52]]))
    again = ScriptedEngine([], eos_id=EOS, version=7)
    (t,), _, _ = await _run(again, _agent([[50], [51], [52]]), replay=recorded)
    assert again.prompts == []
    _same(t, whole)


async def test_a_non_deterministic_tool_ends_the_replay_at_the_turn_its_output_changed() -> None:
    first = ScriptedEngine(list(SCRIPT), eos_id=EOS)
    _, recorded, _ = await _run(first, _agent([[50], [51], [52]]))
    # the tool's answer after turn 0 differs on the re-run (a clock, a random pick, a live service)
    again = ScriptedEngine([[20, EOS], [21, EOS], [22, EOS]], eos_id=EOS)
    (t,), streamed, runner = await _run(again, _agent([[77], [51], [52]]), replay=recorded)
    assert len(again.prompts) == 3  # turn 0 from the record; turns 1..3 sampled, the old turns 2 and 3 not served
    assert t.output_ids.tolist() == [10, 11, EOS, 77, 20, EOS, 51, 21, EOS, 52, 22, EOS]
    assert [r.turn for r in streamed] == [1, 2, 3]
    st = runner.stats
    assert (st.turns_replayed, st.replays_diverged, st.tokens_regenerated) == (1, 1, 6)


async def test_with_replay_off_every_turn_is_sampled_again_and_counted_as_regenerated() -> None:
    first = ScriptedEngine(list(SCRIPT), eos_id=EOS)
    _, recorded, _ = await _run(first, _agent([[50], [51], [52]]))
    again = ScriptedEngine(list(SCRIPT), eos_id=EOS)
    _, _, runner = await _run(again, _agent([[50], [51], [52]]), replay=recorded[:3], serve_replay=False)
    assert len(again.prompts) == 4
    assert (runner.stats.turns_replayed, runner.stats.tokens_regenerated) == (0, 3 + 3 + 2)


async def test_a_record_older_than_the_oldest_version_the_broker_accepts_is_sampled_again() -> None:
    first = ScriptedEngine(list(SCRIPT), eos_id=EOS, version=1)
    _, recorded, _ = await _run(first, _agent([[50], [51], [52]]))
    again = ScriptedEngine(list(SCRIPT), eos_id=EOS, version=5)
    (t,), _, _ = await _run(again, _agent([[50], [51], [52]]), replay=recorded, min_version=3)
    assert len(again.prompts) == 4 and set(t.token_versions.tolist()) == {5}


async def test_each_episode_of_a_group_is_served_its_own_turns() -> None:
    counter = iter(range(100))

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> float:
        await ctx.generate()
        ctx.append([60 + ctx.sample_index])
        await ctx.generate()
        return 0.0

    first = ScriptedEngine([[next(counter), EOS] for _ in range(4)], eos_id=EOS)
    out, recorded, _ = await _run(first, agent, n=2)
    again = ScriptedEngine([], eos_id=EOS)
    out2, _, _ = await _run(again, agent, n=2, replay=recorded)
    assert again.prompts == []
    for a, b in zip(out, out2, strict=True):
        _same(a, b)


def test_a_turns_digest_is_the_same_from_its_ids_as_a_list_or_as_their_array() -> None:
    """The episode digests a turn from the `TokenIds` array it hands the engine: a record written by a worker that
    digested the list must still match (and the array holds the same ids as the list)."""
    from rollpool.workers.engines.base import TokenIds
    from rollpool.workers.episodes.episode import request_digest

    sp = SamplingParams(max_new_tokens=8, stop_token_ids=(2, 4))
    ids = [0, 1, 383, 70_000, 2**31 - 1, *range(5, 600)]
    held = TokenIds(ids)
    assert held == ids and held.array.dtype == np.int64 and held.array.tolist() == ids
    assert request_digest(held, sp) == request_digest(held.array, sp) == request_digest(ids, sp) != request_digest(ids[:-1], sp)
    assert held.int32() is held.int32() and held.int32().dtype == np.dtype("<i4") and held.int32().tolist() == ids
    # what every worker has digested: the ids as little-endian int32, then the sampling's and the constraint's repr
    import hashlib

    h = hashlib.blake2b(np.asarray(ids, dtype="<i4").tobytes() + repr(sp).encode() + repr(None).encode(), digest_size=8)
    assert request_digest(held.array, sp) == int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


async def test_a_turns_settings_are_the_last_turns_object_only_for_the_same_body_fields_of_the_same_types() -> None:
    """The endpoint reuses the last turn's sampling settings (and so its digest's text) for a body whose fields are the
    same values of the same types; a value equal but of another type, or a float zero (-0.0 equals 0.0), is read anew."""
    import asyncio

    from rollpool.workers.episodes.episode import Episode, EpisodeStats, request_digest
    from rollpool.workers.episodes.toolcalls import get_tool_call_parser

    episode = Episode(engine=ScriptedEngine(), prompt=_prompt(), sample_index=0, start_version=0, tokenizer=None,
                      parser=get_tool_call_parser("hermes"), model_name="m", max_context_tokens=0, request_prefix="r",
                      stats=EpisodeStats(), loop=asyncio.get_running_loop())
    ids = [1, 2, 3]

    def sampling(body: dict[str, Any]) -> SamplingParams:
        return episode._body_sampling(body, chat_request=True)

    base = {"model": "m", "messages": [{"role": "user", "content": "a"}], "max_tokens": 5, "temperature": 1.0}
    first = sampling(base)
    assert sampling({**base, "messages": [{"role": "user", "content": "b"}]}) is first  # the messages are not read
    assert sampling({**base, "temperature": 0.5}) is not first
    for zero in (0.0, -0.0):
        a, b = sampling({**base, "temperature": zero}), sampling({**base, "temperature": zero})
        assert a is not b and repr(a) == repr(b)
    assert repr(sampling({**base, "temperature": -0.0})) != repr(sampling({**base, "temperature": 0.0}))
    plus, minus = sampling({**base, "temperature": 0.0}), sampling({**base, "temperature": -0.0})
    assert request_digest(ids, plus) != request_digest(ids, minus)  # as every worker digested them: by their text
    again = sampling(base)
    assert again is not first and repr(again) == repr(first)  # read anew after other settings, the same text
    from rollpool.workers.episodes.chat import EndpointError

    with pytest.raises(EndpointError, match="max_tokens must be an integer"):  # equal to 5, but read anew: refused
        sampling({**base, "max_tokens": 5.0})
