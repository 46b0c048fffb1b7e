"""The sim engine scales on timers; the registry finds engines by name; the config validates."""

from __future__ import annotations

import asyncio

import pytest

from rollpool.protocol.errors import ConfigError, EngineError
from rollpool.protocol.messages import FinishReason, SamplingParams
from rollpool.workers.config import WorkerConfig, parse_engine_options
from rollpool.workers.engines.registry import engine_names, get_engine, register_engine
from rollpool.workers.engines.sim import SimEngine


async def test_hundreds_of_sim_engines_share_one_loop_without_threads() -> None:
    import threading

    before = threading.active_count()
    engines = [SimEngine(decode_s_per_token=0.0005, length="lognormal", length_median=20, seed=i) for i in range(300)]
    for e in engines:
        await e.start()
    sp = SamplingParams(max_new_tokens=64)
    outs = await asyncio.gather(*(e.generate([1, 2, 3], 4, sp, f"r{i}") for i, e in enumerate(engines)))
    assert threading.active_count() == before
    lengths = [len(s.output_ids) for o in outs for s in o.samples]
    assert all(1 <= n <= 64 for n in lengths) and len(set(lengths)) > 10  # a spread, with a capped tail
    assert any(s.finish_reason == FinishReason.LENGTH for o in outs for s in o.samples)
    stopped = [s for o in outs for s in o.samples if s.finish_reason == FinishReason.STOP]
    assert stopped and all(s.output_ids[-1] == 2 for s in stopped)  # eos included


async def test_a_sim_with_special_ids_samples_turns_as_a_chat_model_does() -> None:
    """No special token inside a sample, and a stopped sample ends with the request's end-of-turn (4 here), not the
    end-of-sequence (2); without special ids the sim keeps its draws (specials inside, the first stop id at the end)."""
    specials = (0, 1, 2, 3, 4, 5, 6)
    sp = SamplingParams(max_new_tokens=64, stop_token_ids=(2, 4))

    async def samples(**opts: object) -> list[list[int]]:
        e = SimEngine(decode_s_per_token=0.0001, vocab=40, length="uniform", length_median=24, **opts)  # type: ignore[arg-type]
        await e.start()
        outs = await asyncio.gather(*(e.generate([7, 8, 9], 4, sp, f"r{i}") for i in range(8)))
        return [s.output_ids for o in outs for s in o.samples if s.finish_reason == FinishReason.STOP]

    chat, plain = await samples(special_ids=specials), await samples()
    assert chat and all(ids[-1] == 4 and not set(ids[:-1]) & set(specials) for ids in chat)
    assert plain and all(ids[-1] == 2 for ids in plain) and any(set(ids[:-1]) & {0, 1, 3, 5, 6} for ids in plain)
    with pytest.raises(ConfigError, match="special_ids"):
        SimEngine(vocab=40, special_ids=(40,))


def test_the_sim_childs_chat_sampling_reads_the_models_special_tokens(tiny_model_dir: object) -> None:
    from rollpool.workers.engines.sglang.server import _sim_special_ids
    from rollpool.workers.engines.tiny_model import SPECIAL_TOKENS

    assert _sim_special_ids(str(tiny_model_dir), 320) == tuple(range(len(SPECIAL_TOKENS)))
    assert _sim_special_ids(str(tiny_model_dir), 3) == (0, 1, 2)


async def test_sim_zero_byte_versions_and_crash() -> None:
    e = SimEngine(decode_s_per_token=0.001, length="fixed", length_median=3)
    await e.start()
    await e.pause("interrupt")
    await e.update_weights({}, 5)
    await e.resume()
    out = await e.generate(None, 1, SamplingParams(max_new_tokens=8), "t", text="hello")
    assert out.samples[0].token_versions == [5, 5, 5] and out.simulated
    e.inject_crash()
    with pytest.raises(EngineError):
        await e.generate([1], 1, SamplingParams(), "dead")


def test_registry_resolves_builtins_lazily_and_accepts_new_engines() -> None:
    assert {"sim", "hf", "sglang"} <= set(engine_names())
    assert get_engine("sim") is get_engine("sim")
    with pytest.raises(KeyError, match="unknown engine"):
        get_engine("nope")
    register_engine("mine", lambda **kw: SimEngine(**kw))
    assert isinstance(get_engine("mine")(capacity=2), SimEngine)


def test_config_validates_and_parses_engine_options() -> None:
    cfg = WorkerConfig(engine="sim", engine_options="decode_s_per_token=0.01,length=fixed,length_median=5", capacity=8)
    assert cfg.worker_id and cfg.engine_kwargs() == {"decode_s_per_token": 0.01, "length": "fixed", "length_median": 5, "capacity": 8}
    assert parse_engine_options("a=true, b=x") == {"a": True, "b": "x"}
    with pytest.raises(ConfigError, match="apply_mode"):
        WorkerConfig(apply_mode="sometimes")
    with pytest.raises(ConfigError, match="reward"):
        WorkerConfig(reward="no_colon")
    with pytest.raises(ConfigError, match="count"):
        WorkerConfig(engine="hf", count=2)


def test_engine_options_keep_a_json_value_with_commas_whole() -> None:
    """``server_args`` is a JSON object: one of several keys must reach the engine whole, not cut at its commas."""
    text = 'port=31000,server_args={"chat_sampling": true, "length": "fixed", "stop": [1, 2], "s": "a,}b"},capacity=4'
    cfg = WorkerConfig(engine="sglang", model="/m", engine_options=text)
    assert cfg.engine_kwargs()["server_args"] == '{"chat_sampling": true, "length": "fixed", "stop": [1, 2], "s": "a,}b"}'
    assert cfg.engine_kwargs()["port"] == 31000
    assert parse_engine_options('a=1,b={"x": 1, "y": [2, 3]},c=x') == {"a": 1, "b": '{"x": 1, "y": [2, 3]}', "c": "x"}
    with pytest.raises(ConfigError, match="is not key=value"):
        WorkerConfig(engine="sim", engine_options="length=fixed,oops")


def test_settings_checked_once_are_checked_again_when_they_could_have_changed() -> None:
    """`validate_sampling` remembers the settings objects it found valid (an episode sends one object every turn): the
    same object passes again, a bad one is refused every time, and one whose list field changed after its check (a
    list given where a tuple belongs) is checked again, not passed as remembered."""
    from rollpool.protocol.errors import RequestRefusedError
    from rollpool.protocol.messages import SamplingParams
    from rollpool.workers.engines.base import validate_sampling

    ok = SamplingParams(max_new_tokens=8, stop_token_ids=(3,))
    for _ in range(2):
        validate_sampling(ok, 1)
    with pytest.raises(RequestRefusedError, match="seed"):
        validate_sampling(SamplingParams(seed=2**63 - 1), 2)  # the same settings are valid for n=1, not for a group of 2
    bad = SamplingParams(top_p=0.0)
    for _ in range(2):
        with pytest.raises(RequestRefusedError, match="top_p"):
            validate_sampling(bad, 1)
    ids = [3]
    loose = SamplingParams(stop_token_ids=ids)  # type: ignore[arg-type]
    validate_sampling(loose, 1)
    ids.append(-1)
    with pytest.raises(RequestRefusedError, match="stop_token_ids"):
        validate_sampling(loose, 1)
    seeded = SamplingParams(seed=2**63 - 1)
    validate_sampling(seeded, 1)
    with pytest.raises(RequestRefusedError, match="seed"):
        validate_sampling(seeded, 2)  # remembered for n=1 only
