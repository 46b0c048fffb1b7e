"""LoRA adapter versions on the weight channel: names, layout and checks, one definition for both ends.

An adapter version is an ordinary version of the channel (the same buckets, checksums, paths, relays and
verify-then-apply) whose manifest carries an `AdapterSpec` (`Manifest.adapter`, protocol minor `LORA_MINOR`).
Its tensors are the adapter's matrices only, named and laid out as PEFT gives them
(``get_peft_model_state_dict(model)`` or the ``lora_A`` / ``lora_B`` entries of a ``PeftModel``'s ``state_dict()``):

- ``<prefix><module path>.lora_A[.<adapter name>].weight``: A, shape (rank, in_features)
- ``<prefix><module path>.lora_B[.<adapter name>].weight``: B, shape (out_features, rank)

where ``<prefix>`` is PEFT's ``base_model.model.`` (dropped when present) and ``<module path>`` names a Linear layer
of the base model by its transformers name (``model.layers.0.self_attn.q_proj``). The update is
``y = base(x) + (x A^T B^T) * alpha / rank``.

`lora_pairs` turns such a dict into ``{module path: (A, B)}`` and refuses, naming what and why, anything else: a
tensor that is not an adapter matrix (the base weights of a whole ``state_dict()``), a module with only one of its
two matrices, a rank other than the spec's, a module whose last name is not among the spec's target modules.
Pure: torch only for shapes, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollpool.protocol.errors import WeightsRefusedError
from rollpool.protocol.messages import AdapterSpec

__all__ = ["AdapterSpec", "PEFT_PREFIX", "adapter_spec", "lora_pairs", "read_peft_adapter"]

PEFT_PREFIX = "base_model.model."


def adapter_spec(rank: int, alpha: float, target_modules: Any, *, base_fingerprint: str = "", base_model: str = "",
                 name: str = "") -> AdapterSpec:
    """An `AdapterSpec`, checked (rank >= 1, alpha > 0, at least one target module).

    `target_modules` as PEFT's ``LoraConfig.target_modules`` (a list or set of names; a PEFT config's own value).
    `name`: the policy this adapter serves (prompts name it: `Prompt.policy`); keep it across the versions of one adapter.
    """
    if isinstance(target_modules, str):
        target_modules = [target_modules]
    targets = tuple(sorted(str(t) for t in (target_modules or ())))
    if int(rank) < 1:
        raise ValueError(f"adapter rank must be >= 1, got {rank}")
    if not float(alpha) > 0:
        raise ValueError(f"adapter alpha must be > 0, got {alpha}")
    if not targets:
        raise ValueError("an adapter needs at least one target module (PEFT's target_modules)")
    return AdapterSpec(rank=int(rank), alpha=float(alpha), target_modules=targets, base_fingerprint=base_fingerprint,
                       base_model=base_model, name=str(name))


def _split(name: str) -> tuple[str, str] | None:
    """(module path, "A" | "B") of an adapter matrix's name, or None for any other tensor."""
    parts = name.removeprefix(PEFT_PREFIX).split(".")
    for i, part in enumerate(parts):
        if part in ("lora_A", "lora_B") and i > 0:
            rest = parts[i + 1 :]
            # ``lora_A.weight`` (get_peft_model_state_dict) or ``lora_A.<adapter name>.weight`` (PeftModel.state_dict)
            if rest in (["weight"],) or (len(rest) == 2 and rest[1] == "weight"):
                return ".".join(parts[:i]), part[-1]
            return None
    return None


def lora_pairs(named: Mapping[str, Any], spec: AdapterSpec) -> dict[str, tuple[Any, Any]]:
    """``{module path: (A, B)}`` of an adapter version's tensors, checked against `spec` (see the module docstring).

    Raises `WeightsRefusedError` naming the tensor or module and why.
    """
    if spec.rank < 1:
        raise WeightsRefusedError(f"adapter rank must be >= 1, got {spec.rank}")
    found: dict[str, dict[str, Any]] = {}
    for name, tensor in named.items():
        where = _split(name)
        if where is None:
            raise WeightsRefusedError(
                f"adapter version: {name!r} is not a LoRA matrix (lora_A / lora_B); publish the adapter's tensors only "
                "(peft's get_peft_model_state_dict(model)), not the base model's")
        module, which = where
        if module in found and which in found[module]:
            raise WeightsRefusedError(f"adapter version: two lora_{which} matrices for module {module!r} (several adapters in one version)")
        found.setdefault(module, {})[which] = tensor
    if not found:
        raise WeightsRefusedError("adapter version has no LoRA matrices")
    targets = set(spec.target_modules)
    pairs: dict[str, tuple[Any, Any]] = {}
    for module, mats in sorted(found.items()):
        if "A" not in mats or "B" not in mats:
            missing = "lora_A" if "A" not in mats else "lora_B"
            raise WeightsRefusedError(f"adapter version: module {module!r} has no {missing} matrix")
        a, b = mats["A"], mats["B"]
        if len(a.shape) != 2 or len(b.shape) != 2:
            raise WeightsRefusedError(f"adapter version: {module!r} matrices must be 2-D, got A {tuple(a.shape)}, B {tuple(b.shape)}")
        if a.shape[0] != spec.rank or b.shape[1] != spec.rank:
            raise WeightsRefusedError(
                f"adapter version: {module!r} has rank A {a.shape[0]} / B {b.shape[1]}, the spec says rank {spec.rank}")
        if targets and module.rsplit(".", 1)[-1] not in targets:
            raise WeightsRefusedError(
                f"adapter version: module {module!r} is not among the spec's target modules {sorted(targets)}")
        pairs[module] = (a, b)
    return pairs


def read_peft_adapter(path: str, *, base_fingerprint: str = "") -> tuple[dict[str, Any], AdapterSpec]:
    """A PEFT adapter directory as `save_pretrained` writes it (``adapter_config.json`` and
    ``adapter_model.safetensors``): its matrices (PEFT's names) and its spec. `ValueError` naming what is missing."""
    import json
    import pathlib

    root = pathlib.Path(path)
    config_file, weights_file = root / "adapter_config.json", root / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise ValueError(f"{path!r} is not a PEFT adapter directory (adapter_config.json and adapter_model.safetensors needed)")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path!r}: peft_type {config.get('peft_type')!r}, only LORA adapters are served")
    from safetensors.torch import load_file

    tensors = dict(load_file(str(weights_file)))
    base = str(config.get("base_model_name_or_path") or "")
    if not base_fingerprint and base and pathlib.Path(base).is_dir():  # a local base: its fingerprint, as workers compute theirs
        from rollpool.protocol.fingerprint import model_fingerprint

        base_fingerprint = model_fingerprint(base)
    spec = adapter_spec(int(config["r"]), float(config.get("lora_alpha", config["r"])), config.get("target_modules") or (),
                        base_fingerprint=base_fingerprint, base_model=str(config.get("base_model_name_or_path") or ""))
    lora_pairs(tensors, spec)
    return tensors, spec
