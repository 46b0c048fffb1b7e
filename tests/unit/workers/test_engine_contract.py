"""The Engine contract, run on every engine (parametrised by name, gated by declared apply modes).

``sglang`` here is the real `SGLangEngine` (HTTP client, interrupt-and-resubmit, per-attempt
versions, weight payloads and their verification) against its real child process, whose front
serves the sim engine with SGLang-shaped answers on a CPU (conftest: `sglang_sim_child`). The same
tests run on real SGLang on the H200 (tests/gpu/test_sglang_gpu.py).
"""

from __future__ import annotations

import asyncio
import math
import pathlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from rollpool.protocol.errors import RequestRefusedError
from rollpool.protocol.messages import FinishReason, SamplingParams
from rollpool.workers.engines.base import Engine, GenerateOutput
from rollpool.workers.engines.registry import get_engine


@dataclass
class EngineCase:
    name: str
    engine: Engine
    new_weights: Callable[[], dict[str, Any]]
    """A full set of different weights (empty for a zero-byte engine)."""
    progressed: Callable[[], Awaitable[None]]
    """Returns once a running request has produced a few tokens."""
    prompt: list[int]
    simulated: bool = False


async def _sim_case() -> EngineCase:
    engine = get_engine("sim")(decode_s_per_token=0.002, length="fixed", length_median=40, vocab=300, capacity=16)

    async def progressed() -> None:
        await asyncio.sleep(0.02)

    return EngineCase("sim", engine, dict, progressed, [5, 6, 7, 8], simulated=True)


async def _hf_case(model_dir: pathlib.Path) -> EngineCase:
    engine = get_engine("hf")(model=str(model_dir), capacity=16, num_threads=1)
    await engine.start()

    def new_weights() -> dict[str, Any]:
        import torch

        g = torch.Generator().manual_seed(7)
        return {k: torch.randn(v.shape, generator=g) * 0.2 for k, v in engine._model.state_dict().items()}  # type: ignore[attr-defined]

    async def progressed() -> None:
        start = engine.stats["decode_steps"]  # type: ignore[attr-defined]
        while engine.stats["decode_steps"] < start + 3:  # type: ignore[attr-defined]  # noqa: ASYNC110 - a counter of another thread
            await asyncio.sleep(0.001)

    return EngineCase("hf", engine, new_weights, progressed, [10, 20, 30, 40, 50])


async def _sglang_sim_case(child: Any) -> EngineCase:
    # over the hop, as a launched child is spoken to (the HTTP path of /generate: test_sglang_engine.py)
    engine = get_engine("sglang")(model=child.model, url=child.url, api_key=child.token, capacity=16, device="cpu", backend="sim",
                                  hop=child.hop)

    def new_weights() -> dict[str, Any]:
        import torch

        g = torch.Generator().manual_seed(7)
        return {k: torch.randn(shape, generator=g) * 0.2 for k, (_dt, shape) in engine._params.items()}  # type: ignore[attr-defined]

    async def progressed() -> None:
        await asyncio.sleep(0.05)  # answers are not streamed: ~25 decode steps of the child's sim engine

    return EngineCase("sglang", engine, new_weights, progressed, [10, 20, 30, 40, 50], simulated=True)


# the id is not "sglang": that keyword is the marker that skips a test where sglang is not installed
@pytest.fixture(params=["sim", "hf", pytest.param("sglang", id="sglang-cpu-child")])
async def case(request: pytest.FixtureRequest) -> AsyncIterator[EngineCase]:
    if request.param == "sim":
        c = await _sim_case()
    elif request.param == "sglang":
        c = await _sglang_sim_case(request.getfixturevalue("sglang_sim_child"))
    else:
        c = await _hf_case(request.getfixturevalue("tiny_model_dir"))
    await c.engine.start()
    yield c
    await c.engine.stop()


def _check_output(out: GenerateOutput, n: int, max_new: int) -> None:
    assert len(out.samples) == n
    assert sorted(s.index for s in out.samples) == list(range(n))
    for s in out.samples:
        assert len(s.output_ids) == len(s.logprobs) == len(s.token_versions) >= 1
        assert len(s.output_ids) <= max_new
        assert s.finish_reason in FinishReason.ALL
        assert all(lp <= 1e-6 for lp in s.logprobs)
        if s.finish_reason == FinishReason.LENGTH:
            assert len(s.output_ids) == max_new
        if s.finish_reason == FinishReason.STOP and isinstance(s.matched_stop, int):
            assert s.output_ids[-1] == s.matched_stop  # the stop token is included
        assert s.first_token_at <= s.finished_at


async def test_generate_returns_n_complete_samples(case: EngineCase) -> None:
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=1)
    out = await case.engine.generate(case.prompt, 3, sp, "r1")
    _check_output(out, 3, 12)
    assert out.input_ids == case.prompt
    v = case.engine.info().weight_version
    assert all(t == v for s in out.samples for t in s.token_versions)
    assert out.simulated == case.engine.info().simulated


async def test_info_declares_capacity_modes_and_fingerprint(case: EngineCase) -> None:
    info = case.engine.info()
    assert info.capacity >= 1 and info.fingerprint
    assert set(info.apply_modes) <= {"interrupt", "in_place", "drain"} and info.apply_modes
    assert info.as_dict()["simulated"] is case.simulated


async def test_same_seed_same_output(case: EngineCase) -> None:
    sp = SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.95, seed=123)
    a = await case.engine.generate(case.prompt, 2, sp, "a")
    b = await case.engine.generate(case.prompt, 2, sp, "b")
    assert [s.output_ids for s in a.samples] == [s.output_ids for s in b.samples]
    assert a.samples[0].output_ids != a.samples[1].output_ids or len(a.samples[0].output_ids) < 3


async def test_refuses_bad_requests_with_request_refused_error(case: EngineCase) -> None:
    with pytest.raises(RequestRefusedError, match="top_p"):
        await case.engine.generate(case.prompt, 1, SamplingParams(top_p=0.0), "bad")
    with pytest.raises(RequestRefusedError, match="n must be"):
        await case.engine.generate(case.prompt, 0, SamplingParams(), "bad2")
    with pytest.raises(RequestRefusedError, match="capacity"):
        await case.engine.generate(case.prompt, case.engine.info().capacity + 1, SamplingParams(), "bad3")
    with pytest.raises(RequestRefusedError, match="empty prompt"):
        await case.engine.generate([], 1, SamplingParams(), "bad4")
    with pytest.raises(RequestRefusedError, match="token ids"):
        await case.engine.generate([10**6], 1, SamplingParams(), "bad5")
    # still serving after the refusals
    out = await case.engine.generate(case.prompt, 1, SamplingParams(max_new_tokens=3, ignore_eos=True), "good")
    assert len(out.samples[0].output_ids) == 3


# sampling values that pass a naive range check (NaN compares False to every bound) or that overflow what the
# engine hands to torch / SGLang: each must fail its own request only
_POISONED = [
    SamplingParams(max_new_tokens=5, temperature=math.nan),
    SamplingParams(max_new_tokens=5, temperature=math.inf),
    SamplingParams(max_new_tokens=5, seed=2**64),
    SamplingParams(max_new_tokens=5, seed=2**63 - 1),  # seed + 1 for the group's second sample overflows int64
    SamplingParams(max_new_tokens=5, min_p=math.nan),
    SamplingParams(max_new_tokens=5, top_k=2**40),
    SamplingParams(max_new_tokens=2**40),
]


async def test_poisoned_requests_leave_the_other_requests_untouched(case: EngineCase) -> None:
    sp = SamplingParams(max_new_tokens=80, ignore_eos=True, seed=3)
    others = [asyncio.create_task(case.engine.generate(case.prompt, 2, sp, f"other{i}")) for i in range(2)]
    await case.progressed()
    for i, bad in enumerate(_POISONED):
        with pytest.raises(RequestRefusedError):
            await asyncio.wait_for(case.engine.generate(case.prompt, 2, bad, f"poison{i}"), 30)
    for task in others:
        out = await asyncio.wait_for(task, 30)
        assert [len(s.output_ids) for s in out.samples] == [80, 80]
        assert all(s.finish_reason == FinishReason.LENGTH for s in out.samples)
    # the engine still serves, with the same ids it used for the refused ones
    after = await case.engine.generate(case.prompt, 1, SamplingParams(max_new_tokens=3, ignore_eos=True), "poison0")
    assert len(after.samples[0].output_ids) == 3


async def test_an_engine_with_a_model_states_its_context_and_refuses_past_it(case: EngineCase) -> None:
    """The episode endpoint answers context_length_exceeded from this (``--max-context-tokens 0``: what the engine says)."""
    context = case.engine.info().extra.get("max_context_tokens", 0)
    if case.name == "sim":
        assert not context  # no model, no context
        return
    assert isinstance(context, int) and context > 0
    with pytest.raises(RequestRefusedError):
        await case.engine.generate([5] * context, 1, SamplingParams(max_new_tokens=1), "too-long")


async def test_abort_keeps_partial_output(case: EngineCase) -> None:
    sp = SamplingParams(max_new_tokens=400, ignore_eos=True, seed=2)
    task = asyncio.create_task(case.engine.generate(case.prompt, 2, sp, "long"))
    await case.progressed()
    await case.engine.abort("long")
    out = await asyncio.wait_for(task, 30)
    for s in out.samples:
        assert s.finish_reason == FinishReason.ABORT
        assert 0 < len(s.output_ids) < 400, (len(s.output_ids), s.finish_reason)
        assert len(s.output_ids) == len(s.logprobs) == len(s.token_versions)


async def test_request_joins_while_another_decodes(case: EngineCase) -> None:
    long_sp = SamplingParams(max_new_tokens=120, ignore_eos=True, seed=3)
    first = asyncio.create_task(case.engine.generate(case.prompt, 1, long_sp, "first"))
    await case.progressed()
    second = await asyncio.wait_for(case.engine.generate(case.prompt[:2], 2, SamplingParams(max_new_tokens=5, ignore_eos=True, seed=4), "second"), 30)
    assert not first.done() or case.name == "sim"
    _check_output(second, 2, 5)
    assert all(s.finish_reason == FinishReason.LENGTH for s in second.samples)
    out = await asyncio.wait_for(first, 30)
    _check_output(out, 1, 120)
    assert len(out.samples[0].output_ids) == 120


@pytest.mark.parametrize("mode", ["interrupt", "in_place", "drain"])
async def test_apply_mode_tags_later_tokens_with_the_new_version(case: EngineCase, mode: str) -> None:
    if mode not in case.engine.info().apply_modes:
        pytest.skip(f"{case.name} does not support {mode}")
    v0 = case.engine.info().weight_version
    sp = SamplingParams(max_new_tokens=60, ignore_eos=True, seed=5)
    task = asyncio.create_task(case.engine.generate(case.prompt, 1, sp, "running"))
    await case.progressed()
    await case.engine.pause(mode)
    await case.engine.update_weights(case.new_weights(), v0 + 1)
    await case.engine.resume()
    out = await asyncio.wait_for(task, 30)
    versions = out.samples[0].token_versions
    assert versions == sorted(versions) and set(versions) <= {v0, v0 + 1}
    if mode == "drain":
        assert set(versions) == {v0}  # pause(drain) returned only after the request finished
    else:
        assert versions[0] == v0 and versions[-1] == v0 + 1
        if case.name == "sglang":
            assert case.engine.stats["resubmits"] >= 1  # type: ignore[attr-defined]  # resubmitted as prompt + partial output
    assert case.engine.info().weight_version == v0 + 1
    after = await case.engine.generate(case.prompt, 1, SamplingParams(max_new_tokens=4, ignore_eos=True), "after")
    assert set(after.samples[0].token_versions) == {v0 + 1}


async def test_generate_waits_while_paused(case: EngineCase) -> None:
    await case.engine.pause("in_place" if "in_place" in case.engine.info().apply_modes else case.engine.info().apply_modes[0])
    task = asyncio.create_task(case.engine.generate(case.prompt, 1, SamplingParams(max_new_tokens=3, ignore_eos=True), "held"))
    await asyncio.sleep(0.05)
    assert not task.done()
    await case.engine.resume()
    out = await asyncio.wait_for(task, 30)
    assert len(out.samples[0].output_ids) == 3
