"""Weight tensors for SGLang: the copy to the device and the payload of ``/update_weights_from_tensor``.

torch is imported inside the functions, so the engine module loads without it.

- `serialize_ranks` copies the tensors to the devices (one flat buffer per
  dtype per device, one synchronise each) and pickles them once per
  tensor-parallel rank: SGLang's ``serialized_named_tensors`` holds one
  payload per rank and rank r reads entry r (``tp_worker.py``). With
  ``per_rank`` each rank's payload names a copy on that rank's own GPU (the
  copies are made before the pause, so the update only maps local memory);
  without, every payload names one copy on rank 0's GPU, and each other rank
  copies it across GPUs inside the update. `serialize_update` is the
  one-rank case. On CUDA the pickle carries CUDA
  IPC handles (what SGLang's ``MultiprocessingSerializer`` sends: SGLang maps
  the memory, no copy through the host; same host only); the returned tensors
  must stay alive until SGLang has answered. On CPU, where no real SGLang can
  serve, the tensors travel by value (``torch.save``, prefixed ``TORCHSAVE``)
  to the child's `sim` backend, which reads them with `load_cpu_payload`
  (``weights_only``: nothing but tensors is unpickled).
- `leading` is what ``get_weights_by_name(truncate_size=1)`` answers, for the
  check that an update landed.
"""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["CPU_PAYLOAD_MAGIC", "cuda_available", "cuda_device_count", "init_cuda", "leading", "load_cpu_payload", "nbytes",
           "on_device", "serialize_ranks", "serialize_update", "values_tensor", "BucketStager", "RankPayloads"]

CPU_PAYLOAD_MAGIC = b"TORCHSAVE"


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def cuda_device_count() -> int:
    """GPUs this process sees (0 without torch or CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def init_cuda(device: str) -> None:
    import torch

    torch.zeros(1, device=device)
    torch.cuda.synchronize(device)


def nbytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size()) if hasattr(t, "element_size") else 0


def leading(t: Any) -> list[float]:
    """The first row of a 2-D tensor, the first element of a 1-D one (as floats)."""
    head = t[0:1] if t.dim() == 1 else t[0]
    return [float(x) for x in head.float().cpu().tolist()]


def values_tensor(values: list[Any]) -> Any:
    """A 1-D float32 CPU tensor from the floats ``get_weights_by_name`` answers: those are a parameter's own values
    widened to float32, so loading it back (SGLang's loaders cast into the parameter's dtype) changes nothing."""
    import torch

    return torch.tensor(values, dtype=torch.float32)


def on_device(named: Mapping[str, Any], device: str) -> bool:
    """Every tensor is a CUDA tensor on `device` (``cuda`` alone: on the current device)."""
    import torch

    if not device.startswith("cuda") or not named:
        return False
    want = torch.device(device)
    index = want.index if want.index is not None else torch.cuda.current_device()
    return all(isinstance(t, torch.Tensor) and t.is_cuda and t.device.index == index for t in named.values())


_STREAMS: dict[str, Any] = {}


def _side_stream(device: str) -> Any:
    """One staging stream per device for the process: the caching allocator keeps freed blocks per stream, so a
    fresh stream per version would keep every version's staging memory cached (torch recycles 32 streams)."""
    import torch

    key = str(torch.device(device))
    s = _STREAMS.get(key)
    if s is None:
        s = _STREAMS[key] = torch.cuda.Stream(device=torch.device(device))  # type: ignore[no-untyped-call]
    return s


class BucketStager:
    """A version's buckets copied to the device as each one verifies (the fetch's ``on_bucket``), so the copy of bucket
    i overlaps the fetch of bucket i + 1; `serialize_update(..., staged=)` copies only what is still missing.

    Only page-locked sources and tensors on another GPU are queued (a copy from pageable memory would hold the event
    loop); tensors already on the device (the same-GPU path) are taken as they are. The copies run on a side stream
    of the device, synchronised once by `serialize_ranks`. A tensor-parallel engine keeps one stager per rank GPU."""

    def __init__(self, version: int, device: str) -> None:

        self.version = version
        self.device = device
        self.stream: Any = _side_stream(device) if device.startswith("cuda") else None
        self.placed: dict[str, Any] = {}
        self.started_at = time.time()

    def add(self, named: Mapping[str, Any]) -> int:
        """Queue the copies of one verified bucket; returns how many were queued or taken."""
        import torch

        if self.stream is None:
            return 0
        n = 0
        with torch.cuda.stream(self.stream):
            for name, value in named.items():
                if not isinstance(value, torch.Tensor):
                    continue
                if on_device({name: value}, self.device):
                    self.placed[name] = value
                elif (value.device.type == "cpu" and value.is_pinned()) or value.is_cuda:
                    dst = torch.empty(value.shape, dtype=value.dtype, device=self.device)
                    dst.copy_(value, non_blocking=True)
                    self.placed[name] = dst
                else:
                    continue
                n += 1
        return n


@dataclass(frozen=True, eq=False)
class RankPayloads:
    """One version as SGLang's tensor-parallel update takes it (`serialize_ranks`)."""

    payloads: tuple[tuple[str, ...], ...]
    """Per data-parallel replica, one base64 payload per TP rank (``serialized_named_tensors``), each pickled on its own."""
    placed: Mapping[str, Mapping[str, Any]]
    """Per device, the tensors the payloads refer to: kept alive until SGLang has answered."""
    h2d_s: float
    """Seconds of the copies to the devices (and the synchronise)."""
    pickle_s: float
    """Seconds of pickling every payload (CUDA IPC handles on CUDA; the values on CPU)."""

    @property
    def ranks(self) -> int:
        return sum(len(p) for p in self.payloads)

    def first(self) -> Mapping[str, Any]:
        """The tensors of rank 0 of replica 0 (what the update check compares SGLang's answer with)."""
        return next(iter(self.placed.values()))


def _place(named: Mapping[str, Any], device: str, staged: BucketStager | None) -> dict[str, Any]:
    """`named` on `device`: what `staged` holds already, the tensors already there as they are, the rest copied in one
    flat buffer per dtype (from pinned host memory or another GPU, asynchronously; the caller synchronises)."""
    import torch

    pre: dict[str, Any] = {}
    if staged is not None and staged.device == device:
        if staged.stream is not None:
            staged.stream.synchronize()
        pre = {name: staged.placed[name] for name in named if name in staged.placed
               and tuple(staged.placed[name].shape) == tuple(named[name].shape) and staged.placed[name].dtype == named[name].dtype}
    if not pre and on_device(named, device):
        # already on this GPU (the same-GPU weight path: the subscriber's verified device buffers, kept until the next
        # version is served): SGLang maps these very tensors, no copy
        return dict(named)
    by_dtype: dict[Any, list[tuple[str, Any]]] = {}
    for name, value in named.items():
        if name in pre:
            continue
        t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        by_dtype.setdefault(t.dtype, []).append((name, t))
    placed: dict[str, Any] = dict(pre)
    for dtype, items in by_dtype.items():
        total = sum(t.numel() for _, t in items)
        flat = torch.empty(total, dtype=dtype, device=device)
        off = 0
        for name, t in items:
            n = t.numel()
            view = flat[off : off + n]
            view.copy_(t.reshape(-1), non_blocking=True)  # pinned sources copy asynchronously; one sync per device
            placed[name] = view.view(t.shape)
            off += n
    return placed


def _pickle(items: list[tuple[str, Any]], on_cuda: bool) -> str:
    import torch
    import torch.multiprocessing  # registers the CUDA tensor reductions on ForkingPickler

    buf = io.BytesIO()
    if on_cuda:
        from multiprocessing.reduction import ForkingPickler

        ForkingPickler(buf).dump(items)
        data = buf.getvalue()
    else:
        torch.save(items, buf)
        data = CPU_PAYLOAD_MAGIC + buf.getvalue()
    return base64.b64encode(data).decode()


def serialize_ranks(named: Mapping[str, Any], rank_devices: Sequence[Sequence[str]], *, per_rank: bool = True,
                    staged: Mapping[str, BucketStager] | None = None) -> RankPayloads:
    """`named` as one payload per TP rank of every replica; `rank_devices[d][r]` is the device of rank r of replica d.

    ``per_rank``: every rank's payload refers to a copy on its own device (each device gets one copy, shared by
    nothing else). Otherwise every payload refers to one copy on ``rank_devices[0][0]``, which the other ranks map
    and copy to their own GPU inside SGLang's update. Either way each payload is pickled on its own: one pickle
    read by several ranks leaks CUDA IPC memory (SGLang PR #4446, API notes 3.2). `staged`: per device, the copies
    queued while the version was fetched (`BucketStager`)."""
    import torch

    if not rank_devices or not all(rank_devices):
        raise ValueError("serialize_ranks needs at least one replica of at least one rank")
    t0 = time.time()
    targets = list(dict.fromkeys(d for replica in rank_devices for d in replica)) if per_rank else [rank_devices[0][0]]
    placed = {dev: _place(named, dev, (staged or {}).get(dev)) for dev in targets}
    for dev in targets:
        if dev.startswith("cuda"):
            torch.cuda.synchronize(dev)
    t1 = time.time()
    payloads = tuple(
        tuple(_pickle([(name, placed[dev if per_rank else targets[0]][name]) for name in named], dev.startswith("cuda"))
              for dev in replica)
        for replica in rank_devices)
    return RankPayloads(payloads, placed, t1 - t0, time.time() - t1)


def serialize_update(named: Mapping[str, Any], device: str, staged: BucketStager | None = None) -> tuple[str, dict[str, Any], float]:
    """One rank on one device: ``(base64 payload, the tensors as placed on device, host-to-device seconds)``."""
    out = serialize_ranks(named, [[device]], staged={device: staged} if staged is not None else None)
    return out.payloads[0][0], dict(out.first()), out.h2d_s


def load_cpu_payload(payload: str) -> list[tuple[str, Any]]:
    """The named tensors of a CPU payload (`ValueError` for anything else, CUDA IPC pickles included)."""
    import torch

    data = base64.b64decode(payload)
    if not data.startswith(CPU_PAYLOAD_MAGIC):
        raise ValueError("not a CPU weight payload (CUDA IPC payloads are for a real SGLang on the same GPU host)")
    items = torch.load(io.BytesIO(data[len(CPU_PAYLOAD_MAGIC) :]), weights_only=True)
    if not isinstance(items, list) or not all(isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], str) for i in items):
        raise ValueError("a CPU weight payload must be a list of (name, tensor)")
    return items
