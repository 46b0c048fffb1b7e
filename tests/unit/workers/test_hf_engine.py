"""The hf engine reports what the model computes: logprobs, stops, versions, incremental decoding."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from rollpool.protocol.errors import WeightsRefusedError  # noqa: E402
from rollpool.protocol.messages import FinishReason, SamplingParams  # noqa: E402
from rollpool.workers.engines.hf import HFEngine  # noqa: E402

TOL = 1e-4


@pytest.fixture
async def engine(tiny_model_dir: pathlib.Path) -> AsyncIterator[HFEngine]:
    e = HFEngine(model=str(tiny_model_dir), capacity=16, num_threads=1)
    await e.start()
    yield e
    await e.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_dir: pathlib.Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def teacher_forced(model: Any, prompt: list[int], output: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) of each output token from one plain forward pass over prompt + output."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    t = 1.0 if temperature < 1e-5 else temperature
    logp = torch.log_softmax(logits / t, dim=-1)
    return [float(logp[len(prompt) - 1 + i, tok]) for i, tok in enumerate(output)]


async def test_logprobs_match_a_teacher_forced_forward_pass(engine: HFEngine, reference: Any) -> None:
    prompts = [[3, 40, 41, 42, 43, 44, 45, 46, 47], [7, 8], [100, 101, 102, 103]]
    params = [
        SamplingParams(max_new_tokens=24, temperature=0.7, top_k=20, top_p=0.9, seed=1, ignore_eos=True),
        SamplingParams(max_new_tokens=30, temperature=1.3, min_p=0.05, seed=2, ignore_eos=True),
        SamplingParams(max_new_tokens=16, temperature=0.0),
    ]
    outs = await asyncio.gather(*(engine.generate(p, 2, sp, f"r{i}") for i, (p, sp) in enumerate(zip(prompts, params, strict=True))))
    for prompt, sp, out in zip(prompts, params, outs, strict=True):
        for s in out.samples:
            ref = teacher_forced(reference, prompt, s.output_ids, sp.temperature)
            assert max(abs(a - b) for a, b in zip(ref, s.logprobs, strict=True)) < TOL


async def test_decoding_is_incremental(engine: HFEngine) -> None:
    prompt = list(range(10, 27))
    engine.forward_log.clear()
    out = await engine.generate(prompt, 1, SamplingParams(max_new_tokens=12, ignore_eos=True, seed=0), "inc")
    assert len(out.samples[0].output_ids) == 12
    log = list(engine.forward_log)
    assert log[0] == ("prefill", 1, len(prompt))  # the prompt is computed once
    assert log[1:] == [("decode", 1, 1)] * 11  # then one new token per step, never the prefix again


async def test_group_shares_one_prefill_and_decodes_one_token_per_sequence(engine: HFEngine) -> None:
    engine.forward_log.clear()
    await engine.generate([5, 6, 7, 8], 4, SamplingParams(max_new_tokens=6, ignore_eos=True, seed=0), "grp")
    log = list(engine.forward_log)
    assert log[0] == ("prefill", 1, 4)
    assert log[1:] == [("decode", 4, 1)] * 5


async def test_stop_token_is_included_and_stops(engine: HFEngine) -> None:
    greedy = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    base = (await engine.generate([9, 10, 11], 1, greedy, "base")).samples[0].output_ids
    stop_tok = base[4]
    first = base.index(stop_tok)
    sp = SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=(stop_tok,))
    s = (await engine.generate([9, 10, 11], 1, sp, "stop")).samples[0]
    assert s.finish_reason == FinishReason.STOP and s.matched_stop == stop_tok
    assert s.output_ids == base[: first + 1]


async def test_stop_string_ends_the_sample_and_is_trimmed_from_text(engine: HFEngine) -> None:
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    base = (await engine.generate([12, 13, 14], 1, greedy, "base")).samples[0]
    tok = engine.tokenizer
    tail = tok.decode(base.output_ids[8:10], skip_special_tokens=True)
    stop = tail.strip()[:2] or tail[:1]
    assert stop
    sp = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,))
    s = (await engine.generate([12, 13, 14], 1, sp, "stopstr")).samples[0]
    assert s.finish_reason == FinishReason.STOP and s.matched_stop == stop
    assert s.output_ids == base.output_ids[: len(s.output_ids)] and len(s.output_ids) <= 10
    assert stop in tok.decode(s.output_ids, skip_special_tokens=True)
    assert s.output_text is not None and stop not in s.output_text


async def test_text_prompt_through_the_chat_template(engine: HFEngine) -> None:
    out = await engine.generate(None, 1, SamplingParams(max_new_tokens=3), "chat", text="the quick fox", apply_chat_template=True)
    tok = engine.tokenizer
    rendered = tok.apply_chat_template([{"role": "user", "content": "the quick fox"}], tokenize=False, add_generation_prompt=True)
    assert out.input_ids == tok(rendered, add_special_tokens=False)["input_ids"]
    assert isinstance(out.samples[0].output_text, str)


async def test_interrupt_update_has_an_exact_version_boundary(engine: HFEngine, reference: Any) -> None:
    prompt = [20, 21, 22, 23]
    sp = SamplingParams(max_new_tokens=80, temperature=0.8, ignore_eos=True, seed=9)
    task = asyncio.create_task(engine.generate(prompt, 1, sp, "x"))
    while engine.stats["decode_steps"] < 5:  # noqa: ASYNC110 - a counter of the compute thread
        await asyncio.sleep(0.001)
    await engine.pause("interrupt")
    g = torch.Generator().manual_seed(3)
    new = {k: v + torch.randn(v.shape, generator=g) * 0.3 for k, v in reference.state_dict().items()}
    await engine.update_weights(new, 1)
    await engine.resume()
    s = (await asyncio.wait_for(task, 30)).samples[0]
    k = s.token_versions.index(1)
    assert 0 < k < len(s.output_ids) and s.token_versions == [0] * k + [1] * (len(s.output_ids) - k)
    old_ref = teacher_forced(reference, prompt, s.output_ids[:k], sp.temperature)
    assert max(abs(a - b) for a, b in zip(old_ref, s.logprobs[:k], strict=True)) < TOL
    from transformers import AutoModelForCausalLM

    new_model = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=torch.float32).eval()
    new_model.load_state_dict(new)
    new_ref = teacher_forced(new_model, prompt, s.output_ids, sp.temperature)[k:]
    assert max(abs(a - b) for a, b in zip(new_ref, s.logprobs[k:], strict=True)) < TOL


async def test_update_by_name_changes_the_weights(engine: HFEngine) -> None:
    name = "model.layers.0.mlp.down_proj.weight"
    target = engine._model.state_dict()[name]
    await engine.update_weights({name: torch.full(target.shape, 0.25)}, 4)
    assert bool((engine._model.state_dict()[name] == 0.25).all())
    assert engine.info().weight_version == 4


async def test_an_unknown_parameter_is_refused_before_anything_is_written_and_the_engine_goes_on(engine: HFEngine) -> None:
    before = engine.info().weight_version
    with pytest.raises(WeightsRefusedError, match="unknown parameter"):
        await engine.update_weights({"no.such.weight": torch.zeros(2)}, 1)
    # the old version, intact: no restart needed (a version that cannot be applied is skipped, the last good one kept)
    assert engine.info().weight_version == before
    out = await engine.generate([1, 2, 3], 1, SamplingParams(max_new_tokens=2), "after")
    assert out.samples and all(int(v) == before for s in out.samples for v in s.token_versions)


async def test_weight_bytes_is_what_a_trainer_publishing_the_same_model_sends(engine: HFEngine, reference: Any) -> None:
    from rollpool.weights.publisher import layout_of

    # the worker reserves this many bytes per version at engine start: a version of the same model must fit
    assert engine.weight_bytes() == sum(n for *_, n in layout_of(reference))


async def test_a_request_failing_inside_the_compute_thread_fails_alone(engine: HFEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's own split of whose failure it is, for a request that reaches the thread unchecked (the request
    checks skipped): its sampling failing on finite logits refuses that request; the running ones decode on."""
    import math

    from rollpool.protocol.errors import RequestRefusedError
    from rollpool.workers.engines import hf

    monkeypatch.setattr(hf, "check_request", lambda *a, **k: None)
    running = asyncio.create_task(engine.generate([3, 4, 5], 2, SamplingParams(max_new_tokens=60, ignore_eos=True, seed=1), "ok"))
    while engine.stats["decode_steps"] < 3:  # noqa: ASYNC110 - a counter of another thread
        await asyncio.sleep(0.001)
    with pytest.raises(RequestRefusedError, match="sampling failed"):
        await engine.generate([3, 4, 5], 2, SamplingParams(max_new_tokens=60, temperature=math.nan), "nan")
    with pytest.raises(RequestRefusedError, match="seed"):
        await engine.generate([3, 4, 5], 1, SamplingParams(max_new_tokens=5, seed=2**64), "seed")
    out = await asyncio.wait_for(running, 30)
    assert [len(s.output_ids) for s in out.samples] == [60, 60]


async def test_non_finite_logits_are_the_engine_failing(engine: HFEngine) -> None:
    """NaN logits come from the model, not the request: the engine fails (and the worker restarts it)."""
    from rollpool.protocol.errors import EngineError, RequestRefusedError

    name, param = next((k, v) for k, v in engine._model.state_dict().items() if k.endswith("norm.weight"))
    await engine.update_weights({name: torch.full_like(param, float("nan"))}, 1)
    with pytest.raises(EngineError) as info:
        await engine.generate([3, 4, 5], 1, SamplingParams(max_new_tokens=5, temperature=1.0), "broken")
    assert "non-finite" in str(info.value) and not isinstance(info.value, RequestRefusedError)
