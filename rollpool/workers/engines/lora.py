"""LoRA adapter versions served by a torch model: several versions resident, chosen per batch row.

`LoraBank` holds adapter versions (``{module path: (A, B, alpha / rank)}``, engine-owned copies) and, through a
forward hook on each targeted ``nn.Linear`` (the model's module tree and parameter names stay as they are), adds
``(x A^T B^T) * alpha / rank`` to the layer's output for each batch row under the adapter version that row runs
on (`select` before each forward; rows of one version are computed together). A row on no adapter (None) gets
the base model alone.

Contracts:

- `add` checks the whole version before keeping any of it (`WeightsRefusedError` naming the module and why: a
  module the model does not have or that is not a Linear layer, shapes that do not fit it, a rank above
  `max_rank`); a refused version changes nothing.
- Eviction (`evict`): the oldest versions beyond `resident` go, except those still named by a sequence (the
  caller passes them): a sequence finishes on the adapter version it began with. Resident memory is at most
  ``(resident + versions pinned) * bytes_per_version`` where ``bytes_per_version`` is
  ``sum(rank * (in + out)) * element size`` over the targeted modules (`version_bytes`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from rollpool.protocol.errors import WeightsRefusedError
from rollpool.protocol.messages import AdapterSpec
from rollpool.weights.adapters import lora_pairs

__all__ = ["LoraBank"]

_Weights = dict[str, tuple[torch.Tensor, torch.Tensor, float]]

_SPAN_COPY = True
"""Copy a fetched bucket's matrices as one span (`_copied`); False copies them one by one (bench/lora.py's
``--compare`` runs both)."""


class LoraBank:
    """Resident adapter versions of one model and the per-row choice of the next forward (module docstring)."""

    def __init__(self, model: torch.nn.Module, *, resident: int = 4, max_rank: int = 64) -> None:
        self.model = model
        self.resident = max(1, resident)
        self.max_rank = max_rank
        self.versions: dict[int, _Weights] = {}
        self.specs: dict[int, AdapterSpec] = {}
        self._modules = dict(model.named_modules())
        self._hooked: set[str] = set()
        self._groups: list[tuple[int, torch.Tensor | None]] = []
        """(version, rows of the batch or None for all rows) of the next forward."""

    @property
    def latest(self) -> int | None:
        return max(self.versions) if self.versions else None

    def version_bytes(self, version: int) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b, _ in self.versions[version].values())

    def add(self, version: int, named: Mapping[str, Any], spec: AdapterSpec, *, dtype: torch.dtype, device: Any) -> None:
        """Keep adapter `version` (copies of its matrices in `dtype` on `device`); checked whole first."""
        if spec.rank > self.max_rank:
            raise WeightsRefusedError(f"adapter version {version}: rank {spec.rank} is above this engine's max_lora_rank {self.max_rank}")
        pairs = lora_pairs(named, spec)
        plan: list[tuple[str, Any, Any]] = []
        for path, (a, b) in pairs.items():
            module = self._modules.get(path)
            if module is None:
                raise WeightsRefusedError(f"adapter version {version}: the base model has no module {path!r}")
            if not isinstance(module, torch.nn.Linear):
                raise WeightsRefusedError(
                    f"adapter version {version}: module {path!r} ({type(module).__name__}) is not a Linear layer this engine can adapt")
            if tuple(a.shape) != (spec.rank, module.in_features) or tuple(b.shape) != (module.out_features, spec.rank):
                raise WeightsRefusedError(
                    f"adapter version {version}: {path!r} is Linear({module.in_features} -> {module.out_features}); "
                    f"A {tuple(a.shape)} / B {tuple(b.shape)} do not fit it at rank {spec.rank}")
            plan.append((path, a, b))
        scale = float(spec.alpha) / float(spec.rank)
        copies = _copied([t for _, a, b in plan for t in (a, b)], dtype=dtype, device=device)
        weights: _Weights = {path: (copies[2 * i], copies[2 * i + 1], scale) for i, (path, _a, _b) in enumerate(plan)}
        for path in weights:
            if path not in self._hooked:
                self._modules[path].register_forward_hook(self._hook(path))
                self._hooked.add(path)
        self.versions[version] = weights
        self.specs[version] = spec

    def evict(self, pinned: Iterable[int | None]) -> list[int]:
        """Drop the oldest versions beyond `resident`, never one in `pinned`; returns those dropped."""
        keep = {v for v in pinned if v is not None}
        dropped: list[int] = []
        for v in sorted(self.versions)[: -self.resident]:
            if v not in keep:
                del self.versions[v]
                del self.specs[v]
                dropped.append(v)
        return dropped

    def retain(self, keep: set[int]) -> None:
        """Drop every version not in `keep` (the caller knows no sequence names them)."""
        for v in [v for v in self.versions if v not in keep]:
            del self.versions[v]
            del self.specs[v]
        self._groups = []

    def select(self, rows: list[int | None]) -> None:
        """The adapter version of each batch row of the next forward (None: the base alone)."""
        present = {v for v in rows if v is not None}
        missing = present - set(self.versions)
        if missing:  # eviction never drops a pinned version: reaching here is a bookkeeping bug, not bad input
            raise RuntimeError(f"adapter versions {sorted(missing)} are not resident")
        if len(present) == 1 and None not in rows:
            self._groups = [(present.pop(), None)]
            return
        groups: list[tuple[int, torch.Tensor | None]] = []
        for v in sorted(present):
            idx = torch.tensor([i for i, r in enumerate(rows) if r == v], dtype=torch.long)
            groups.append((v, idx))
        self._groups = groups

    def _hook(self, path: str) -> Any:
        def hook(_module: torch.nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
            if not self._groups:
                return output
            x = inputs[0]
            for version, idx in self._groups:
                w = self.versions[version].get(path)
                if w is None:
                    continue
                a, b, scale = w
                if idx is None:
                    output = output + (x @ a.T) @ b.T * scale
                else:
                    idx = idx.to(x.device)
                    output = output.index_add(0, idx, (x.index_select(0, idx) @ a.T) @ b.T * scale)
            return output

        return hook


def _copied(tensors: list[Any], *, dtype: torch.dtype, device: Any, span: bool | None = None) -> list[torch.Tensor]:
    """Engine-owned copies of `tensors` in `dtype` on `device` (the channel's buffers are recycled for the next fetch).

    Tensors that are contiguous views of one buffer (a fetched bucket) in one dtype, bound for another device, are
    copied as that buffer's span, once, and handed out as views of the copy: one transfer instead of one per matrix
    (hundreds, each a synchronous host-to-device copy). Anything else is copied tensor by tensor (on the CPU one
    fresh 84 MB block page-faults on every version, where per-matrix blocks reuse the evicted version's memory).
    `span` forces the choice (None: the span when the device type differs)."""
    ts = [t if isinstance(t, torch.Tensor) else torch.as_tensor(t) for t in tensors]
    spans: dict[int, list[int]] = {}
    for i, t in enumerate(ts):
        spans.setdefault(t.untyped_storage().data_ptr(), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(ts)
    for members in spans.values():
        group = [ts[i] for i in members]
        first = group[0]
        esize = first.element_size()
        lo = min(t.storage_offset() for t in group) * esize
        hi = max((t.storage_offset() + t.numel()) * esize for t in group)
        nbytes = sum(t.numel() * esize for t in group)
        crossing = torch.device(device).type != first.device.type if span is None else span
        one_span = (_SPAN_COPY and crossing and len(group) > 1 and all(t.dtype == first.dtype and t.is_contiguous() for t in group) and hi - lo <= 2 * nbytes)
        if not one_span:
            for i in members:
                out[i] = ts[i].detach().to(device=device, dtype=dtype, copy=True)
            continue
        raw = torch.empty(0, dtype=torch.uint8, device=first.device)
        raw.set_(first.untyped_storage(), lo, (hi - lo,), (1,))
        moved = raw.to(device=device, copy=True)
        for i in members:
            t = ts[i]
            at = t.storage_offset() * esize - lo
            view = moved[at : at + t.numel() * esize].view(t.dtype).view(t.shape)
            out[i] = view if t.dtype == dtype else view.to(dtype)
    return [t for t in out if t is not None]
