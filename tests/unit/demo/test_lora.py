"""The demo trainer's LoRA adapter computes what the workers' `LoraBank` serves, and publishes PEFT-named matrices only."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rollpool.demo.lora import DEMO_TARGETS, TrainableLora  # noqa: E402
from rollpool.weights.adapters import lora_pairs  # noqa: E402
from rollpool.workers.engines.lora import LoraBank  # noqa: E402


def _model() -> object:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=15, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(config)


def test_the_trainers_adapter_and_the_workers_bank_give_the_same_logits() -> None:
    base = _model()
    served = copy.deepcopy(base)
    adapter = TrainableLora(base, rank=4, alpha=8.0)
    ids = torch.tensor([[1, 5, 7, 9, 3]])
    before = base(input_ids=ids).logits  # type: ignore[operator]
    assert torch.allclose(before, served(input_ids=ids).logits)  # type: ignore[operator]  # B = 0: the base
    with torch.no_grad():
        for _a, b in adapter.pairs.values():
            b.normal_(0.0, 0.1)  # as if trained
    trained = base(input_ids=ids).logits  # type: ignore[operator]
    assert not torch.allclose(trained, before, atol=1e-3)
    spec = adapter.spec()
    named = adapter.named_tensors()
    assert set(lora_pairs(named, spec)) == set(adapter.pairs)  # PEFT names, the workers' check passes
    bank = LoraBank(served, resident=2)  # type: ignore[arg-type]
    bank.add(1, named, spec, dtype=torch.float32, device="cpu")
    bank.select([1])
    assert torch.allclose(served(input_ids=ids).logits, trained, atol=1e-5)  # type: ignore[operator]


def test_only_the_adapter_trains() -> None:
    model = _model()
    adapter = TrainableLora(model, rank=2, alpha=4.0)
    assert not any(p.requires_grad for p in model.parameters())  # type: ignore[attr-defined]
    assert len(adapter.pairs) == 2 * len(DEMO_TARGETS) and all(p.requires_grad for p in adapter.parameters())
    assert adapter.nbytes() == sum(p.numel() * 4 for p in adapter.parameters())
    with pytest.raises(ValueError, match="no Linear layer"):
        TrainableLora(_model(), rank=2, alpha=4.0, targets=("nothing",))


def test_demo_lora_flags_are_checked_by_name() -> None:
    from rollpool.demo.runner import DemoConfig, report_stem
    from rollpool.protocol import ConfigError

    with pytest.raises(ConfigError, match="task max only"):
        DemoConfig(task="tool", lora=True)
    with pytest.raises(ConfigError, match="lora_rank"):
        DemoConfig(lora=True, lora_rank=0)
    with pytest.raises(ConfigError, match="lora_alpha"):
        DemoConfig(lora=True, lora_alpha=0.0)
    assert report_stem(DemoConfig(lora=True)) == "demo-report-lora"  # beside the full-weights demo's report
