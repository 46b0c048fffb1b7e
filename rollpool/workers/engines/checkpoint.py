"""Reading an HF checkpoint directory into named CPU tensors (``update_weights_from_disk``).

Reads every ``*.safetensors`` file of the directory (the format HF
``save_pretrained`` writes by default), or ``pytorch_model*.bin`` with
``torch.load(weights_only=True)`` (no arbitrary objects are unpickled).
"""

from __future__ import annotations

import pathlib
from typing import Any

from rollpool.protocol.errors import WeightSyncError

__all__ = ["load_checkpoint_tensors"]


def load_checkpoint_tensors(path: str) -> dict[str, Any]:
    root = pathlib.Path(path)
    if not root.is_dir():
        raise WeightSyncError(f"checkpoint directory {path!r} does not exist")
    tensors: dict[str, Any] = {}
    shards = sorted(root.glob("*.safetensors"))
    if shards:
        from safetensors.torch import load_file

        for shard in shards:
            tensors.update(load_file(str(shard), device="cpu"))
        return tensors
    bins = sorted(root.glob("pytorch_model*.bin"))
    if bins:
        import torch

        for b in bins:
            tensors.update(torch.load(str(b), map_location="cpu", weights_only=True))
        return tensors
    raise WeightSyncError(f"no *.safetensors or pytorch_model*.bin files in {path!r}")
