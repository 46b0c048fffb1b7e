"""LoRA adapter versions for SGLang: the checks before anything is sent, and the PEFT directory SGLang loads.

SGLang 0.5.14 (``enable_lora``) keeps adapters by name beside the base model: ``/load_lora_adapter`` (a PEFT
directory: ``adapter_config.json`` + ``adapter_model.safetensors``) and ``/unload_lora_adapter`` change the set
without a restart, and each ``/generate`` names the adapter it runs on (``lora_path``: the adapter's name). Its
``load_lora_adapter_from_tensors`` exists too, but its tensors are copied to the scheduler's CPU memory either
way (``LoRAAdapter._process_weight`` calls ``.cpu()``), so a file on a tmpfs costs the same and keeps the child's
HTTP body small.

- `check_adapter` refuses, naming what and why (`WeightsRefusedError`, nothing sent): a rank above the engine's
  ``max_lora_rank``, a target module outside its ``lora_target_modules``, a module the checkpoint does not have, or
  matrices that do not fit that module's weight. SGLang itself would only find the last two while copying into its
  GPU pool, inside the scheduler, where a failure kills the server (API notes fact 6).
- `write_adapter` writes one version as a PEFT directory (canonical PEFT names, ``base_model.model.<module>
  .lora_{A,B}.weight``), named after the version so no two versions share a directory.

torch and safetensors are imported inside the functions.
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from rollpool.protocol.errors import WeightsRefusedError
from rollpool.protocol.messages import AdapterSpec
from rollpool.weights.adapters import PEFT_PREFIX, lora_pairs

__all__ = ["adapter_root", "check_adapter", "peft_config", "write_adapter"]


def adapter_root(configured: str = "") -> pathlib.Path:
    """Where adapter directories go: `configured`, else /dev/shm (a tmpfs: no disk write) when present, else the
    system's temporary directory."""
    if configured:
        return pathlib.Path(configured)
    shm = pathlib.Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else pathlib.Path(tempfile.gettempdir())


def check_adapter(named: Mapping[str, Any], spec: AdapterSpec, version: int, *, params: Mapping[str, tuple[str, Sequence[int]]],
                  targets: Sequence[str], max_rank: int) -> dict[str, tuple[Any, Any]]:
    """``{module path: (A, B)}`` of adapter `version`, every check of the module docstring passed."""
    if spec.rank > max_rank:
        raise WeightsRefusedError(f"adapter version {version}: rank {spec.rank} is above this engine's max_lora_rank {max_rank} "
                                  "(SGLang sizes its adapter memory pool for it at start)")
    served = set(targets)
    if "all" not in served:
        outside = sorted(set(spec.target_modules) - served)
        if outside:
            raise WeightsRefusedError(f"adapter version {version}: target modules {outside} are not among this engine's "
                                      f"lora_target_modules {sorted(served)}")
    pairs = lora_pairs(named, spec)
    for path, (a, b) in pairs.items():
        known = params.get(f"{path}.weight")
        if known is None:
            raise WeightsRefusedError(f"adapter version {version}: the base model has no module {path!r} (no {path}.weight)")
        shape = tuple(int(x) for x in known[1])
        if len(shape) != 2:
            raise WeightsRefusedError(f"adapter version {version}: {path}.weight has shape {shape}, not a linear layer's")
        out_f, in_f = shape
        if tuple(a.shape) != (spec.rank, in_f) or tuple(b.shape) != (out_f, spec.rank):
            raise WeightsRefusedError(
                f"adapter version {version}: {path!r} is Linear({in_f} -> {out_f}); A {tuple(a.shape)} / B {tuple(b.shape)} "
                f"do not fit it at rank {spec.rank}")
    return pairs


def peft_config(spec: AdapterSpec) -> dict[str, Any]:
    """The ``adapter_config.json`` of `spec`, as PEFT writes it (the keys SGLang reads: r, lora_alpha, target_modules)."""
    return {"peft_type": "LORA", "r": spec.rank, "lora_alpha": spec.alpha, "target_modules": list(spec.target_modules),
            "bias": "none", "lora_dropout": 0.0, "base_model_name_or_path": spec.base_model, "task_type": "CAUSAL_LM"}


def write_adapter(root: pathlib.Path, name: str, pairs: Mapping[str, tuple[Any, Any]], spec: AdapterSpec,
                  dtype: str | None = None) -> pathlib.Path:
    """Write `pairs` as PEFT directory ``root/name`` (contiguous CPU tensors in `dtype`, or as they are); returns it."""
    import torch
    from safetensors.torch import save_file

    target = getattr(torch, dtype) if dtype else None
    tensors: dict[str, Any] = {}
    for path, (a, b) in pairs.items():
        for which, t in (("A", a), ("B", b)):
            tt = t if isinstance(t, torch.Tensor) else torch.as_tensor(t)
            tensors[f"{PEFT_PREFIX}{path}.lora_{which}.weight"] = tt.detach().to("cpu", dtype=target or tt.dtype).contiguous()
    out = root / name
    out.mkdir(parents=True, exist_ok=False)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(peft_config(spec)))
    return out
