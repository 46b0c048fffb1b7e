"""LoRA adapter versions end to end on CPU: published with their spec, fetched direct and through a relay (real
ZeroMQ), served by the hf engine (a real tiny Llama) exactly as the merged model computes, several versions resident,
and bad adapters refused with the engine serving on."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from rollpool.protocol.errors import WeightsRefusedError  # noqa: E402
from rollpool.protocol.fingerprint import model_fingerprint  # noqa: E402
from rollpool.protocol.messages import AdapterSpec, SamplingParams  # noqa: E402
from rollpool.weights.adapters import adapter_spec  # noqa: E402
from rollpool.workers.engines.hf import HFEngine  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from rollpool.workers.engines.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", vocab=320, hidden=32, layers=2, heads=4, kv_heads=2)


def _adapter(model_dir: pathlib.Path, seed: int, rank: int = 4) -> tuple[dict[str, torch.Tensor], AdapterSpec]:
    """PEFT-named matrices (as get_peft_model_state_dict gives them) for every projection, random and non-zero."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    named: dict[str, torch.Tensor] = {}
    for path, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and path.rsplit(".", 1)[-1] in TARGETS:
            named[f"base_model.model.{path}.lora_A.weight"] = torch.randn(rank, mod.in_features, generator=g) * 0.3
            named[f"base_model.model.{path}.lora_B.weight"] = torch.randn(mod.out_features, rank, generator=g) * 0.3
    return named, adapter_spec(rank, 2 * rank, TARGETS, base_fingerprint=model_fingerprint(model_dir), base_model="tiny")


def _merged(model_dir: pathlib.Path, named: dict[str, torch.Tensor] | None, spec: AdapterSpec | None,
            base: dict[str, torch.Tensor] | None = None) -> Any:
    """The reference: the base (with the whole-model tensors `base` loaded over it) with W + (alpha / r) B A merged in
    (what PEFT's merge_and_unload computes); `named` None: the base alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    mods = dict(model.named_modules())
    with torch.no_grad():
        model.load_state_dict(base or {}, strict=False)
        if named is None or spec is None:
            return model
        for name, a in named.items():
            if ".lora_A." in name:
                path = name.removeprefix("base_model.model.").split(".lora_A.")[0]
                b = named[name.replace(".lora_A.", ".lora_B.")]
                mods[path].weight += (b @ a) * (spec.alpha / spec.rank)
    return model


def _teacher_forced(model: Any, prompt: list[int], output: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[len(prompt) - 1 + i, tok]) for i, tok in enumerate(output)]


@pytest.fixture
async def engine(model_dir: pathlib.Path) -> AsyncIterator[HFEngine]:
    e = HFEngine(model=str(model_dir), capacity=8, num_threads=1, lora_resident=2, max_lora_rank=8)
    await e.start()
    yield e
    await e.stop()


GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT = [3, 40, 41, 42, 43, 44]


async def test_an_adapter_version_travels_direct_and_through_a_relay_and_serves_exactly(
        model_dir: pathlib.Path, engine: HFEngine, make_publisher: Any, make_subscriber: Any, make_relay: Any) -> None:
    named, spec = _adapter(model_dir, seed=1)
    pub = await make_publisher(keep_versions=2)
    manifest = await pub.publish(named, 1, adapter=spec, wait_ready=True)
    assert manifest.adapter == spec
    relay = await make_relay(upstream_router=pub.router_endpoint, upstream_pub=pub.pub_endpoint)
    direct = make_subscriber(pub.router_endpoint, pub.pub_endpoint)
    relayed = make_subscriber(relay.router_endpoint, relay.pub_endpoint)
    for sub in (direct, relayed):
        wv = await sub.fetch(1)
        assert wv.manifest.adapter == spec  # verified bytes and the spec, end to end
        assert all(torch.equal(wv.tensors[k], v) for k, v in named.items())
    base_out = (await engine.generate(PROMPT, 1, GREEDY, "base")).samples[0]
    await engine.update_adapter(wv.tensors, wv.manifest.adapter, 1)
    relayed.recycle(wv)  # the engine keeps its own copy: the buffers may be reused at once
    out = (await engine.generate(PROMPT, 1, GREEDY, "lora")).samples[0]
    assert out.token_versions == [1] * 12
    ref = _teacher_forced(_merged(model_dir, named, spec), PROMPT, out.output_ids)
    assert max(abs(a - b) for a, b in zip(ref, out.logprobs, strict=True)) < TOL
    assert out.logprobs != base_out.logprobs or out.output_ids != base_out.output_ids  # the adapter changed the model


async def test_in_flight_sequences_finish_on_their_adapter_version(model_dir: pathlib.Path, engine: HFEngine) -> None:
    (n1, s1), (n2, s2), (n3, s3) = (_adapter(model_dir, seed=i) for i in (1, 2, 3))
    await engine.update_adapter(n1, s1, 1)
    long = SamplingParams(max_new_tokens=120, temperature=0.0, ignore_eos=True)
    first = asyncio.create_task(engine.generate(PROMPT, 1, long, "old"))
    while engine.stats["decode_steps"] < 2:  # noqa: ASYNC110 - a counter of the engine's thread
        await asyncio.sleep(0.005)
    await engine.update_adapter(n2, s2, 2)
    prefills = engine.stats["prefill_tokens"]
    second = asyncio.create_task(engine.generate(PROMPT, 1, long, "new"))
    # "new" takes its adapter version at its first prefill: version 3 must come after that (on a loaded box the
    # first one alone can run 8 decode steps before "new" is admitted)
    while engine.stats["prefill_tokens"] == prefills or engine.stats["decode_steps"] < 8:  # noqa: ASYNC110 - counters of the engine's thread
        await asyncio.sleep(0.005)
    await engine.update_adapter(n3, s3, 3)  # resident 2: version 1 stays while "old" still runs on it
    assert 1 in engine.adapter_versions()
    a, b = (await first).samples[0], (await second).samples[0]
    assert a.token_versions == [1] * 120 and b.token_versions == [2] * 120  # one batch, two adapters, per row
    assert max(abs(x - y) for x, y in zip(_teacher_forced(_merged(model_dir, n1, s1), PROMPT, a.output_ids), a.logprobs, strict=True)) < TOL
    assert max(abs(x - y) for x, y in zip(_teacher_forced(_merged(model_dir, n2, s2), PROMPT, b.output_ids), b.logprobs, strict=True)) < TOL
    await engine.update_adapter(*_adapter(model_dir, seed=4), 4)
    assert engine.adapter_versions() == [3, 4]  # nothing pins 1 or 2 now: evicted down to lora_resident


def _base_version(model_dir: pathlib.Path, seed: int) -> dict[str, torch.Tensor]:
    """A whole-model version: two projections an adapter also targets, changed."""
    from safetensors.torch import load_file

    weights = load_file(str(model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    names = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight")
    return {n: weights[n].float() + torch.randn(weights[n].shape, generator=g) * 0.3 for n in names}


def _gap(model: Any, out: Any, positions: range | None = None) -> float:
    ref = _teacher_forced(model, PROMPT, out.output_ids)
    at = positions or range(len(ref))
    return max(abs(ref[i] - out.logprobs[i]) for i in at)


async def test_a_whole_model_version_keeps_the_current_adapter_on_top_of_the_new_base(model_dir: pathlib.Path, engine: HFEngine) -> None:
    """The sequence of the sglang engine's test (tests/unit/workers/test_sglang_lora.py): adapter 1, then whole-model
    version 2 while a sequence runs on the adapter (interrupt mode). The sequence and every later one run on the new
    base with adapter 1 still on (the merged model of base 2 and adapter 1 computes their logprobs), and their tokens
    carry 2: the policy of version 2 is base 2 plus adapter 1. Before the fix the engine dropped the adapter and later
    tokens ran on the base alone."""
    named, spec = _adapter(model_dir, seed=1)
    await engine.update_adapter(named, spec, 1)
    long = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
    running = asyncio.create_task(engine.generate(PROMPT, 1, long, "long"))
    while engine.stats["decode_steps"] < 3:  # noqa: ASYNC110 - a counter of the engine's thread
        await asyncio.sleep(0.005)
    base2 = _base_version(model_dir, seed=7)
    await engine.pause("interrupt")
    await engine.update_weights(base2, 2)
    await engine.resume()
    after = (await engine.generate(PROMPT, 1, GREEDY, "after")).samples[0]
    assert after.token_versions == [2] * 12
    on_new_base = _merged(model_dir, named, spec, base=base2)
    assert _gap(on_new_base, after) < TOL  # the adapter is on, on the new base
    assert _gap(_merged(model_dir, None, None, base=base2), after) > 100 * TOL  # (not the new base alone)
    seq = (await running).samples[0]
    cut = seq.token_versions.index(2)
    assert 0 < cut and seq.token_versions == [1] * cut + [2] * (60 - cut)
    assert _gap(_merged(model_dir, named, spec), seq, range(cut)) < TOL  # base 1 + adapter 1 before the update
    assert _gap(on_new_base, seq, range(cut, 60)) < TOL  # re-prefilled under base 2 + adapter 1 after it
    assert engine.adapter_versions() == [1] and engine.version == 2


async def test_bad_adapters_are_refused_naming_why_and_the_engine_serves_on(model_dir: pathlib.Path, engine: HFEngine) -> None:
    named, spec = _adapter(model_dir, seed=1)
    await engine.update_adapter(named, spec, 1)
    other = AdapterSpec(rank=spec.rank, alpha=spec.alpha, target_modules=spec.target_modules, base_fingerprint="ffffffffffffffff",
                        base_model="other-8b")
    fp = model_fingerprint(model_dir)
    with pytest.raises(WeightsRefusedError, match=f"other-8b \\(fingerprint ffffffffffffffff\\).*fingerprint {fp}"):
        await engine.update_adapter(named, other, 2)
    big, big_spec = _adapter(model_dir, seed=1, rank=16)
    with pytest.raises(WeightsRefusedError, match="rank 16 is above this engine's max_lora_rank 8"):
        await engine.update_adapter(big, big_spec, 2)
    emb = {"base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(4, 320),
           "base_model.model.model.embed_tokens.lora_B.weight": torch.zeros(32, 4)}
    with pytest.raises(WeightsRefusedError, match=r"'model.embed_tokens' \(Embedding\) is not a Linear layer"):
        await engine.update_adapter(emb, adapter_spec(4, 8, ["embed_tokens"]), 2)
    wrong = {k: (v[:, :16] if ".lora_A." in k else v) for k, v in named.items()}
    with pytest.raises(WeightsRefusedError, match=r"is Linear\(\d+ -> \d+\); A \(4, 16\) .* do not fit it at rank 4"):
        await engine.update_adapter(wrong, spec, 2)
    assert engine.adapter_versions() == [1] and engine.version == 1  # nothing of a refused version was kept
    out = (await engine.generate(PROMPT, 1, GREEDY, "after")).samples[0]
    assert out.token_versions == [1] * 12


def test_the_bank_keeps_its_own_copy_of_a_fetched_bucket_in_its_dtype() -> None:
    """Matrices that are views of one fetched bucket are copied (to a GPU: once, as the bucket's span, handed out as
    views of that copy): equal to what came, in the engine's dtype, untouched when the channel reuses the bucket."""
    from rollpool.workers.engines.lora import LoraBank, _copied

    model = torch.nn.Sequential()
    model.add_module("q_proj", torch.nn.Linear(24, 16, bias=False))
    model.add_module("v_proj", torch.nn.Linear(24, 8, bias=False))
    spec = adapter_spec(4, 8, ("q_proj", "v_proj"))
    shapes = {"q_proj.lora_A.weight": (4, 24), "q_proj.lora_B.weight": (16, 4), "v_proj.lora_A.weight": (4, 24),
              "v_proj.lora_B.weight": (8, 4)}
    bucket = torch.zeros(sum(r * c for r, c in shapes.values()) * 2, dtype=torch.uint8)
    named, at = {}, 0
    for name, (r, c) in shapes.items():
        named[name] = bucket[at : at + r * c * 2].view(torch.bfloat16).view(r, c)
        named[name].copy_(torch.randn(r, c))
        at += r * c * 2
    want = {k: t.clone() for k, t in named.items()}
    for dtype in (torch.bfloat16, torch.float32):
        bank = LoraBank(model)
        bank.add(1, named, spec, dtype=dtype, device="cpu")
        bucket.zero_()  # the channel recycles the bucket for the next fetch
        a, b, scale = bank.versions[1]["q_proj"]
        assert a.dtype == b.dtype == dtype and scale == 2.0
        assert torch.equal(a, want["q_proj.lora_A.weight"].to(dtype)) and torch.equal(b, want["q_proj.lora_B.weight"].to(dtype))
        a, b, _ = bank.versions[1]["v_proj"]
        assert torch.equal(a, want["v_proj.lora_A.weight"].to(dtype)) and torch.equal(b, want["v_proj.lora_B.weight"].to(dtype))
        for k, t in want.items():
            named[k].copy_(t)
        # the span copy itself (a GPU's path), forced on the CPU: views of one copy, not of the bucket
        got = _copied(list(named.values()), dtype=dtype, device="cpu", span=True)
        storages = {t.untyped_storage().data_ptr() for t in got}
        assert bucket.data_ptr() not in storages and (len(storages) == 1 or dtype != torch.bfloat16)  # (converted: its own)
        bucket.zero_()
        assert all(torch.equal(g, w.to(dtype)) for g, w in zip(got, want.values(), strict=True))
        for k, t in want.items():
            named[k].copy_(t)


async def test_the_publisher_plans_and_checks_anew_when_names_or_shapes_change(model_dir: pathlib.Path, make_publisher: Any,
                                                                               make_subscriber: Any) -> None:
    """A trainer publishes the same matrices every version, so the publisher reuses the previous version's plan and
    adapter check while the names, shapes and dtypes stay the same; any change is planned and checked again."""
    pub = await make_publisher(keep_versions=2)
    sub = make_subscriber(pub.router_endpoint, pub.pub_endpoint)
    named, spec = _adapter(model_dir, seed=1)
    planned: Any = None
    for version in (1, 2):
        named = {k: v + 1 for k, v in named.items()}  # a training step: new values, the same tensors' layout
        await pub.publish(named, version, adapter=spec, wait_ready=True)
        got = await sub.fetch(version)
        assert all(torch.equal(got.tensors[k], v) for k, v in named.items())
        planned = planned or pub._plan.planner
        assert planned is not None and pub._plan.planner is planned  # version 2 reused version 1's plan
        sub.recycle(got)
    wrong = dict(named)
    first_a = next(k for k in named if ".lora_A." in k)
    wrong[first_a] = torch.zeros(8, named[first_a].shape[1])  # rank 8 against the spec's 4: checked again, refused
    with pytest.raises(WeightsRefusedError, match="the spec says rank 4"):
        await pub.publish(wrong, 3, adapter=spec)
    wider, wider_spec = _adapter(model_dir, seed=2, rank=8)
    await pub.publish(wider, 3, adapter=wider_spec, wait_ready=True)
    got = await sub.fetch(3)
    assert all(torch.equal(got.tensors[k], v) for k, v in wider.items()) and pub._plan.planner is not planned
