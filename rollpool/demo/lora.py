"""A trainable LoRA adapter on a frozen model, for `rollpool demo --lora` (the trainer's side; `peft` is not needed).

`TrainableLora(model, rank, alpha, targets)` freezes every parameter of `model` and puts a pair of trainable matrices
on each ``nn.Linear`` whose last name is in `targets`: A (rank x in), initialised as PEFT does (Kaiming-uniform with
a = sqrt(5)), and B (out x rank), zero, so the adapted model starts equal to the base. A forward hook adds
``(x A^T B^T) * alpha / rank`` to the layer's output: the same update the workers' `LoraBank` applies, so the
trainer's logprobs and the workers' agree up to float rounding.

`named_tensors()` gives the matrices under PEFT's names (``base_model.model.<module>.lora_A.weight``), the tensors a
version publishes; `spec()` the `AdapterSpec` that goes with them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rollpool.protocol.messages import AdapterSpec
from rollpool.weights.adapters import PEFT_PREFIX, adapter_spec

__all__ = ["DEMO_TARGETS", "TrainableLora"]

DEMO_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every attention and MLP projection of a Llama layer."""


class TrainableLora:
    """LoRA matrices on the targeted Linear layers of a frozen model (module docstring)."""

    def __init__(self, model: torch.nn.Module, *, rank: int, alpha: float, targets: tuple[str, ...] = DEMO_TARGETS) -> None:
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        self.rank, self.alpha, self.targets = rank, float(alpha), tuple(targets)
        self.scale = self.alpha / rank
        for p in model.parameters():
            p.requires_grad_(False)
        self.pairs: dict[str, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}
        for path, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and path.rsplit(".", 1)[-1] in self.targets:
                a = torch.nn.Parameter(torch.empty(rank, module.in_features, dtype=module.weight.dtype))
                torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5))
                b = torch.nn.Parameter(torch.zeros(module.out_features, rank, dtype=module.weight.dtype))
                self.pairs[path] = (a, b)
                module.register_forward_hook(self._hook(a, b))
        if not self.pairs:
            raise ValueError(f"the model has no Linear layer named any of {list(self.targets)}")

    def _hook(self, a: torch.nn.Parameter, b: torch.nn.Parameter) -> Any:
        def hook(_module: torch.nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
            adapted: torch.Tensor = output + (inputs[0] @ a.T) @ b.T * self.scale
            return adapted

        return hook

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for pair in self.pairs.values() for p in pair]

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The adapter's matrices under PEFT's names (detached views: the publisher copies them before it returns)."""
        out: dict[str, torch.Tensor] = {}
        for path, (a, b) in self.pairs.items():
            out[f"{PEFT_PREFIX}{path}.lora_A.weight"] = a.detach()
            out[f"{PEFT_PREFIX}{path}.lora_B.weight"] = b.detach()
        return out

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def spec(self, *, base_fingerprint: str = "", base_model: str = "") -> AdapterSpec:
        return adapter_spec(self.rank, self.alpha, self.targets, base_fingerprint=base_fingerprint, base_model=base_model)
