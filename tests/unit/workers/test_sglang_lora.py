"""The sglang engine's LoRA adapter versions on a CPU, against the engine's real child with the sim backend.

The one fake is at the process edge: `SimLora` in the child (server.py), which serves adapters by name as SGLang
0.5.14 does (load from a PEFT directory, unload, a ``/generate`` naming an adapter never loaded refused) and counts
the tokens it served per adapter name, so the tests can hold the engine's per-token versions against what was run.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
from collections.abc import AsyncIterator, Iterable
from typing import Any

import pytest

pytest.importorskip("aiohttp")
torch = pytest.importorskip("torch")

from rollpool.protocol.errors import WeightsRefusedError  # noqa: E402
from rollpool.protocol.fingerprint import model_fingerprint  # noqa: E402
from rollpool.protocol.messages import AdapterSpec, SamplingParams  # noqa: E402
from rollpool.weights.adapters import adapter_spec  # noqa: E402
from rollpool.workers.engines.sglang.engine import SGLangEngine  # noqa: E402
from rollpool.workers.engines.sglang.wire import read_safetensors_index  # noqa: E402

from .conftest import SIM_SERVER_ARGS  # noqa: E402

pytestmark = pytest.mark.timeout(90)


def _adapter(model_dir: pathlib.Path, *, rank: int = 4, targets: Iterable[str] = ("q_proj", "v_proj"), fingerprint: str | None = None,
             in_features: int | None = None) -> tuple[dict[str, Any], AdapterSpec]:
    targets = tuple(targets)
    named: dict[str, Any] = {}
    for name, (_dtype, shape) in read_safetensors_index(model_dir).items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in targets:
            out_f, in_f = shape
            named[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, in_features or in_f) * 0.01
            named[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out_f, rank) * 0.01
    fp = model_fingerprint(model_dir) if fingerprint is None else fingerprint
    return named, adapter_spec(rank, 2 * rank, targets, base_fingerprint=fp, base_model=str(model_dir))


async def _start(model_dir: pathlib.Path, tmp_path: pathlib.Path, **options: Any) -> SGLangEngine:
    engine = SGLangEngine(model=str(model_dir), capacity=8, device="cpu", backend="sim", log_dir=str(tmp_path / "logs"),
                          lora_dir=str(tmp_path / "lora"), start_timeout_s=60,
                          server_args=json.dumps({**SIM_SERVER_ARGS, "decode_s_per_token": 0.004}), **options)
    await engine.start()
    return engine


@pytest.fixture
async def lora_engine(tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> AsyncIterator[SGLangEngine]:
    engine = await _start(tiny_model_dir, tmp_path, lora=True, lora_resident=1, max_lora_rank=8,
                          lora_target_modules="q_proj,k_proj,v_proj,o_proj")
    yield engine
    await engine.stop()


async def _served(engine: SGLangEngine) -> dict[str, Any]:
    info: dict[str, Any] = await engine._post("/model_info", method="GET")
    return info


async def test_adapter_versions_load_without_a_restart_and_every_token_carries_its_version(
        lora_engine: SGLangEngine, tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    pid = lora_engine._proc.pid if lora_engine._proc else None
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    base = await lora_engine.generate([1, 2, 3], 2, sp, "base")
    assert all(s.token_versions == [0] * 6 for s in base.samples)
    named, spec = _adapter(tiny_model_dir)
    await lora_engine.update_adapter(named, spec, 1)
    out = await lora_engine.generate([1, 2, 3], 2, sp, "on-v1")
    assert all(s.token_versions == [1] * 6 for s in out.samples)
    served = await _served(lora_engine)
    (name,) = served["lora_loaded"]
    assert name.endswith("-v1") and served["lora_tokens"] == {"": 12, name: 12}  # the tokens tagged 1 ran on adapter v1
    assert (lora_engine._proc.pid if lora_engine._proc else None) == pid  # no restart
    assert lora_engine.info().extra["adapter_versions"] == [1] and lora_engine.info().weight_version == 1
    assert list((tmp_path / "lora").iterdir()) == []  # the PEFT directory is gone once SGLang has loaded it


async def test_a_running_sample_finishes_on_its_adapter_version_and_old_versions_unload_once_free(
        lora_engine: SGLangEngine, tiny_model_dir: pathlib.Path) -> None:
    await lora_engine.update_adapter(*_adapter(tiny_model_dir), 1)
    long = asyncio.create_task(lora_engine.generate([1, 2, 3], 1, SamplingParams(max_new_tokens=150, ignore_eos=True), "long"))
    await asyncio.sleep(0.1)
    await lora_engine.update_adapter(*_adapter(tiny_model_dir), 2)  # no pause: the long sample runs on
    assert not long.done()
    assert lora_engine.adapter_versions() == [1, 2]  # lora_resident 1, but v1 is still named by the long sample
    short = await lora_engine.generate([4, 5], 1, SamplingParams(max_new_tokens=5, ignore_eos=True), "short")
    assert short.samples[0].token_versions == [2] * 5
    done = await asyncio.wait_for(long, 30)
    assert done.samples[0].token_versions == [1] * 150
    await lora_engine.update_adapter(*_adapter(tiny_model_dir), 3)
    served = await _served(lora_engine)
    assert lora_engine.adapter_versions() == [3] and [n.rsplit("-", 1)[1] for n in served["lora_loaded"]] == ["v3"]
    by_version = {int(n.rsplit("-v", 1)[1]): k for n, k in served["lora_tokens"].items() if n}
    assert by_version == {1: 150, 2: 5}


async def test_bad_adapters_are_refused_naming_why_and_nothing_reaches_sglang(lora_engine: SGLangEngine, tiny_model_dir: pathlib.Path) -> None:
    cases = [
        (_adapter(tiny_model_dir, rank=16), "max_lora_rank 8"),
        (_adapter(tiny_model_dir, targets=("gate_proj",)), "not among this engine's lora_target_modules"),
        (_adapter(tiny_model_dir, fingerprint="0" * 16), "fingerprint"),
        (_adapter(tiny_model_dir, in_features=7), "do not fit it"),
    ]
    for (named, spec), why in cases:
        with pytest.raises(WeightsRefusedError, match=why):
            await lora_engine.update_adapter(named, spec, 5)
    assert (await _served(lora_engine))["lora_loads"] == 0 and lora_engine.adapter_versions() == []
    await lora_engine.update_adapter(*_adapter(tiny_model_dir), 5)
    with pytest.raises(WeightsRefusedError, match="not newer"):
        await lora_engine.update_adapter(*_adapter(tiny_model_dir), 5)
    out = await lora_engine.generate([1, 2], 1, SamplingParams(max_new_tokens=3, ignore_eos=True), "after")  # serves on
    assert out.samples[0].token_versions == [5, 5, 5]


async def test_an_engine_without_lora_refuses_an_adapter_version_by_name(tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    engine = await _start(tiny_model_dir, tmp_path)
    try:
        with pytest.raises(WeightsRefusedError, match="lora=true"):
            await engine.update_adapter(*_adapter(tiny_model_dir), 1)
        # the child's fake refuses an adapter request as SGLang does without enable_lora
        with pytest.raises(Exception, match="not enabled"):
            await engine._post("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}, "lora_path": "x"})
    finally:
        await engine.stop()


def _base_version(model_dir: pathlib.Path) -> dict[str, Any]:
    """A whole-model version: one norm weight changed (what it holds does not matter to the sim)."""
    params = read_safetensors_index(model_dir)
    name = next(n for n, (_d, shape) in params.items() if len(shape) == 1)
    return {name: torch.ones(params[name][1])}


def _tokens_by_adapter(served: dict[str, Any]) -> dict[int | None, int]:
    """The child's count of tokens served per adapter version (None: the base alone)."""
    return {(int(n.rsplit("-v", 1)[1]) if n else None): k for n, k in served["lora_tokens"].items()}


async def test_a_whole_model_version_keeps_the_current_adapter_on_top_of_the_new_base(
        lora_engine: SGLangEngine, tiny_model_dir: pathlib.Path) -> None:
    """Adapter version 1, then whole-model version 2 while a sample runs on the adapter (interrupt mode): the sample
    and every later one run on the new base with adapter 1 still on, and their tokens carry 2 (the policy of version 2
    is base 2 + adapter 1). The child models what SGLang 0.5.14 does to loaded adapters on a base update: nothing.
    ``update_weights_from_tensor`` only runs ``model.load_weights`` on the named base parameters (sglang-kit API-NOTES
    section 3.2); with ``enable_lora`` each wrapped layer shares its base layer's ``weight`` (the kit's
    ``sglang/srt/lora/layers.py``, ``BaseLayerWithLoRA``), so the load writes the base in place and the LoRA manager's
    adapters, and its GPU pool, are left as they were: `SimLora` keeps them loaded and servable (the GPU check of the same
    sequence is tests/gpu/test_sglang_lora_gpu.py). Before the fix the engine unloaded adapter 1 itself and ran every
    later token on the base alone: what a prompt naming the adapter got after a base version."""
    await lora_engine.update_adapter(*_adapter(tiny_model_dir), 1)
    # 300 tokens at 4 ms: 1.2 s to run, so the interrupt 0.3 s in finds some made and most to come (with 120 tokens
    # and 0.1 s, a loaded CI box once interrupted it before its first token: cut 0)
    long = asyncio.create_task(lora_engine.generate([1, 2, 3], 1, SamplingParams(max_new_tokens=300, ignore_eos=True), "long"))
    await asyncio.sleep(0.3)
    await lora_engine.pause("interrupt")
    await lora_engine.update_weights(_base_version(tiny_model_dir), 2)
    await lora_engine.resume()
    after = await lora_engine.generate([1, 2], 2, SamplingParams(max_new_tokens=5, ignore_eos=True), "after")
    assert all(s.token_versions == [2] * 5 for s in after.samples)
    versions = (await asyncio.wait_for(long, 30)).samples[0].token_versions
    cut = versions.index(2)  # interrupted: tokens before the base version carry 1, after it 2, nothing else
    assert 0 < cut and versions == [1] * cut + [2] * (300 - cut)
    # every token, before and after the base version, ran on adapter 1: none on the base alone
    assert _tokens_by_adapter(await _served(lora_engine)) == {1: 310}
    assert lora_engine.stats["resubmits"] == 1 and lora_engine.adapter_versions() == [1] and lora_engine.version == 2


async def test_after_a_base_version_new_adapter_versions_serve_and_a_pinned_sample_keeps_its_version(
        lora_engine: SGLangEngine, tiny_model_dir: pathlib.Path) -> None:
    """Adapter 1, base 2 (drain), a long sample begun then (adapter 1 on base 2: tokens carry 2), adapter 3 while it
    runs: the long sample finishes on adapter 1 carrying 2, a new one runs on adapter 3 carrying 3; a base version
    with no tensors re-tags as one with tensors does."""
    await lora_engine.update_adapter(*_adapter(tiny_model_dir), 1)
    await lora_engine.pause("drain")
    await lora_engine.update_weights(_base_version(tiny_model_dir), 2)
    await lora_engine.resume()
    long = asyncio.create_task(lora_engine.generate([1, 2, 3], 1, SamplingParams(max_new_tokens=150, ignore_eos=True), "long"))
    await asyncio.sleep(0.1)
    await lora_engine.update_adapter(*_adapter(tiny_model_dir), 3)  # no pause: the long sample runs on
    assert lora_engine.adapter_versions() == [1, 3]  # lora_resident 1, but adapter 1 is named by the long sample
    short = await lora_engine.generate([4, 5], 1, SamplingParams(max_new_tokens=5, ignore_eos=True), "short")
    assert short.samples[0].token_versions == [3] * 5
    assert (await asyncio.wait_for(long, 30)).samples[0].token_versions == [2] * 150
    assert _tokens_by_adapter(await _served(lora_engine)) == {1: 150, 3: 5}
    await lora_engine.pause("drain")
    await lora_engine.update_weights({}, 4)  # a whole-model version with no tensors: only SGLang's version label moves
    await lora_engine.resume()
    assert lora_engine.adapter_versions() == [3]
    last = await lora_engine.generate([6], 1, SamplingParams(max_new_tokens=3, ignore_eos=True), "last")
    assert last.samples[0].token_versions == [4] * 3 and _tokens_by_adapter(await _served(lora_engine)) == {1: 150, 3: 8}
