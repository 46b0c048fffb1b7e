"""The sglang engine's LoRA adapter versions on real SGLang (marked gpu + sglang, skipped elsewhere).

Each test starts its own engine (the worker's path: the engine launches SGLang as its child, with ``lora=true``)
on a tiny random Llama. What runs on a CPU against the sim child (tests/unit/workers/test_sglang_lora.py) is not
repeated; here: SGLang loads what the engine writes and serves it (the adapter changes the output, and its
logprobs are those of the merged model), two adapter versions serve side by side without a pause, and a whole-model
version leaves the adapter on, on top of the new base (SGLang keeps loaded adapters across ``update_weights_from_tensor``;
the CPU tests model it so). bench/gpu_lora.py runs these functions directly (the device may lack pytest-asyncio: the
last test is a plain function around ``asyncio.run``).
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import tempfile
from typing import Any

import pytest

from rollpool.protocol.fingerprint import model_fingerprint
from rollpool.protocol.messages import SamplingParams
from rollpool.weights.adapters import adapter_spec
from rollpool.workers.engines.sglang.engine import SGLangEngine
from rollpool.workers.engines.sglang.wire import read_safetensors_index

pytestmark = [pytest.mark.gpu, pytest.mark.sglang, pytest.mark.timeout(600)]

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_model(where: pathlib.Path) -> pathlib.Path:
    from rollpool.workers.engines.tiny_model import build_tiny_model

    model = os.environ.get("ROLLPOOL_SGLANG_TEST_MODEL")
    return pathlib.Path(model) if model else build_tiny_model(where / "model", vocab=1024, hidden=256, layers=2, heads=4, kv_heads=2)


def base_version(model_dir: pathlib.Path, seed: int) -> dict[str, Any]:
    """A whole-model version: two projections an adapter also targets, changed (in bfloat16, the engine's dtype, so the
    reference computes with exactly the weights SGLang holds)."""
    import torch
    from safetensors import safe_open

    names = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight")
    g = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in set(names) & set(f.keys()):
                w = f.get_tensor(name).float()
                out[name] = (w + torch.randn(w.shape, generator=g) * float(w.std())).to(torch.bfloat16)
    assert set(out) == set(names), f"{model_dir} has no {sorted(set(names) - set(out))}"
    return out


def make_adapter(model_dir: pathlib.Path, seed: int, rank: int = 8) -> tuple[dict[str, Any], Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    named: dict[str, Any] = {}
    for name, (_dtype, shape) in sorted(read_safetensors_index(model_dir).items()):
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in TARGETS:
            out_f, in_f = shape
            named[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * 0.05
            named[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.05
    return named, adapter_spec(rank, 2 * rank, TARGETS, base_fingerprint=model_fingerprint(model_dir))


async def start_engine(model_dir: pathlib.Path, log_dir: pathlib.Path) -> SGLangEngine:
    engine = SGLangEngine(model=str(model_dir), capacity=32, mem_fraction_static=0.15, cuda_graph_max_bs=16, log_dir=str(log_dir),
                          lora=True, max_lora_rank=16, lora_resident=2)
    await engine.start()
    return engine


def merged_logprobs(model_dir: pathlib.Path, named: dict[str, Any] | None, spec: Any, prompt: list[int], output: list[int],
                    base: dict[str, Any] | None = None) -> list[float]:
    """Teacher-forced logprobs of `output` under the base (with the whole-model tensors `base` loaded over it) with the
    adapter merged in (float32, CPU); `named` None: the base alone."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = dict(model.named_parameters())
    scale = spec.alpha / spec.rank
    with torch.no_grad():
        for name, w in (base or {}).items():
            params[name].copy_(w)
        for name, a in (named or {}).items():
            if ".lora_A." in name:
                module = name.removeprefix("base_model.model.").split(".lora_A.")[0]
                b = named[name.replace(".lora_A.", ".lora_B.")]
                params[f"{module}.weight"].add_(b.float() @ a.float() * scale)
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


async def check_adapter_is_served_as_the_merged_model(work: pathlib.Path) -> None:
    model_dir = tiny_model(work)
    engine = await start_engine(model_dir, work)
    try:
        prompt = list(range(10, 42))
        sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
        base = (await engine.generate(prompt, 1, sp, "base")).samples[0]
        named, spec = make_adapter(model_dir, seed=1)
        await engine.update_adapter(named, spec, 1)
        on = (await engine.generate(prompt, 1, sp, "adapter")).samples[0]
        assert on.token_versions == [1] * 16
        assert on.logprobs != base.logprobs  # the adapter is on
        want = merged_logprobs(model_dir, named, spec, prompt, on.output_ids)
        worst = max(abs(a - b) for a, b in zip(on.logprobs, want, strict=True))
        assert worst < 0.1, f"SGLang's logprobs under the adapter differ from the merged model's by up to {worst:.3f}"
    finally:
        await engine.stop()


async def check_two_adapter_versions_serve_side_by_side_without_a_pause(work: pathlib.Path) -> None:
    model_dir = tiny_model(work)
    engine = await start_engine(model_dir, work)
    try:
        await engine.update_adapter(*make_adapter(model_dir, seed=1), 1)
        long = asyncio.create_task(engine.generate(list(range(5, 20)), 4, SamplingParams(max_new_tokens=1500, ignore_eos=True), "long"))
        await asyncio.sleep(0.5)
        await engine.update_adapter(*make_adapter(model_dir, seed=2), 2)
        assert not long.done()
        short = await engine.generate(list(range(7, 30)), 2, SamplingParams(max_new_tokens=8, ignore_eos=True), "short")
        assert all(s.token_versions == [2] * 8 for s in short.samples)
        done = await asyncio.wait_for(long, 300)
        assert all(s.token_versions == [1] * 1500 for s in done.samples)
        assert engine.stats["resubmits"] == 0  # nothing was aborted for the adapter version
        await engine.update_adapter(*make_adapter(model_dir, seed=3), 3)
        assert engine.adapter_versions() == [2, 3]  # lora_resident 2: v1 unloaded once no sample named it
    finally:
        await engine.stop()


async def check_a_base_version_keeps_the_adapter_on(work: pathlib.Path) -> None:
    """Adapter version 1, then whole-model version 2 (interrupt mode) while a sample runs on the adapter: later samples
    are served as the merged model of base 2 and adapter 1, not base 2 alone, and carry version 2; the running sample's
    tokens carry 1 up to the update and 2 after it."""
    model_dir = tiny_model(work)
    engine = await start_engine(model_dir, work)
    try:
        named, spec = make_adapter(model_dir, seed=1)
        await engine.update_adapter(named, spec, 1)
        running = asyncio.create_task(engine.generate(list(range(5, 20)), 1, SamplingParams(max_new_tokens=1500, ignore_eos=True), "long"))
        await asyncio.sleep(0.3)
        assert not running.done()
        base2 = base_version(model_dir, seed=7)
        await engine.pause("interrupt")
        await engine.update_weights(base2, 2)
        await engine.resume()
        prompt = list(range(10, 42))
        after = (await engine.generate(prompt, 1, SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True), "after")).samples[0]
        assert after.token_versions == [2] * 16
        want = merged_logprobs(model_dir, named, spec, prompt, after.output_ids, base=base2)
        alone = merged_logprobs(model_dir, None, spec, prompt, after.output_ids, base=base2)
        apart = max(abs(a - b) for a, b in zip(want, alone, strict=True))
        assert apart > 0.5, f"the adapter moves the new base's logprobs by only {apart:.3f}: this check cannot tell them apart"
        worst = max(abs(a - b) for a, b in zip(after.logprobs, want, strict=True))
        assert worst < 0.1, (f"after the whole-model version SGLang's logprobs differ from base 2 + adapter 1 merged by up to "
                             f"{worst:.3f} (from base 2 alone by {max(abs(a - b) for a, b in zip(after.logprobs, alone, strict=True)):.3f})")
        versions = (await asyncio.wait_for(running, 300)).samples[0].token_versions
        cut = versions.index(2) if 2 in versions else -1
        assert 0 < cut and versions == [1] * cut + [2] * (1500 - cut), f"token versions {sorted(set(versions))}, cut at {cut}"
        assert engine.adapter_versions() == [1] and engine.version == 2
    finally:
        await engine.stop()


async def test_an_adapter_is_served_as_the_merged_model() -> None:
    with tempfile.TemporaryDirectory() as d:
        await check_adapter_is_served_as_the_merged_model(pathlib.Path(d))


async def test_two_adapter_versions_serve_side_by_side_without_a_pause() -> None:
    with tempfile.TemporaryDirectory() as d:
        await check_two_adapter_versions_serve_side_by_side_without_a_pause(pathlib.Path(d))


def test_a_base_version_keeps_the_adapter_on() -> None:
    with tempfile.TemporaryDirectory() as d:
        asyncio.run(check_a_base_version_keeps_the_adapter_on(pathlib.Path(d)))
