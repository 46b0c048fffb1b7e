"""Adapter versions' names and checks (`rollpool.weights.adapters`) and the spec on the wire (`Manifest.adapter`)."""

from __future__ import annotations

import msgpack
import pytest

torch = pytest.importorskip("torch")

from rollpool.protocol import LORA_MINOR, PROTOCOL_MINOR, decode, encode  # noqa: E402
from rollpool.protocol.errors import WeightsRefusedError  # noqa: E402
from rollpool.protocol.messages import Manifest  # noqa: E402
from rollpool.weights.adapters import adapter_spec, lora_pairs  # noqa: E402

SPEC = adapter_spec(4, 8, ["q_proj", "v_proj"], base_fingerprint="0123456789abcdef", base_model="tiny")


def _peft(prefix: str = "base_model.model.", name: str = "") -> dict[str, torch.Tensor]:
    mid = f".{name}" if name else ""
    out = {}
    for m in ("q_proj", "v_proj"):
        out[f"{prefix}model.layers.0.self_attn.{m}.lora_A{mid}.weight"] = torch.zeros(4, 32)
        out[f"{prefix}model.layers.0.self_attn.{m}.lora_B{mid}.weight"] = torch.zeros(16, 4)
    return out


@pytest.mark.parametrize("prefix,name", [("base_model.model.", ""), ("base_model.model.", "default"), ("", "")])
def test_peft_names_as_they_come(prefix: str, name: str) -> None:
    """get_peft_model_state_dict's names, a PeftModel's state_dict() names (adapter name inside), and bare module paths."""
    pairs = lora_pairs(_peft(prefix, name), SPEC)
    assert sorted(pairs) == ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]
    a, b = pairs["model.layers.0.self_attn.q_proj"]
    assert tuple(a.shape) == (4, 32) and tuple(b.shape) == (16, 4)


def test_refusals_name_what_and_why() -> None:
    named = _peft()
    with pytest.raises(WeightsRefusedError, match="not a LoRA matrix.*get_peft_model_state_dict"):
        lora_pairs({**named, "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight": torch.zeros(16, 32)}, SPEC)
    with pytest.raises(WeightsRefusedError, match="has no lora_B"):
        lora_pairs({k: v for k, v in named.items() if "q_proj.lora_B" not in k}, SPEC)
    with pytest.raises(WeightsRefusedError, match="rank A 4 / B 4, the spec says rank 8"):
        lora_pairs(named, adapter_spec(8, 8, ["q_proj", "v_proj"]))
    with pytest.raises(WeightsRefusedError, match="not among the spec's target modules"):
        lora_pairs(named, adapter_spec(4, 8, ["q_proj"]))
    with pytest.raises(ValueError, match="rank must be >= 1"):
        adapter_spec(0, 8, ["q_proj"])
    with pytest.raises(ValueError, match="at least one target module"):
        adapter_spec(4, 8, [])


def test_the_spec_travels_in_the_manifest() -> None:
    m = Manifest(request_id="m", version=3, adapter=SPEC)
    frames = encode(m)
    header = msgpack.unpackb(bytes(frames[0]), raw=False)
    assert header[1] == PROTOCOL_MINOR >= LORA_MINOR
    assert header[3]["adapter"]["rank"] == 4 and header[3]["adapter"]["base_fingerprint"] == "0123456789abcdef"
    assert decode(frames) == m
    assert decode(encode(Manifest(request_id="m", version=3))).adapter is None


def test_a_manifest_of_the_minor_before_reads_as_whole_model_weights() -> None:
    fields = {"request_id": "m", "version": 3, "buckets": [{"index": 0, "dtype": "float32", "nbytes": 32, "checksum": "crc32:00000000"}]}
    old = decode([msgpack.packb([1, LORA_MINOR - 1, "manifest", fields], use_bin_type=True)])
    assert old.adapter is None and old.version == 3
