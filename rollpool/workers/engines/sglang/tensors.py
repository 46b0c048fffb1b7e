"""Weight tensors for SGLang: the copy to the device and the payload of ``/update_weights_from_tensor``.

torch is imported inside the functions, so the engine module loads without it.

- `serialize_update` copies the tensors to the device (one flat buffer per
  dtype, one synchronise) and pickles them. On CUDA the pickle carries CUDA
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
from collections.abc import Mapping
from typing import Any

__all__ = ["CPU_PAYLOAD_MAGIC", "cuda_available", "init_cuda", "leading", "load_cpu_payload", "nbytes", "on_device", "serialize_update",
           "values_tensor", "BucketStager"]

CPU_PAYLOAD_MAGIC = b"TORCHSAVE"


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


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

    Only page-locked sources are queued (a copy from pageable memory would hold the event loop); tensors already
    on the device (the same-GPU path) are taken as they are. The copies run on a side stream, synchronised once
    by `serialize_update`."""

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
                elif value.device.type == "cpu" and value.is_pinned():
                    dst = torch.empty(value.shape, dtype=value.dtype, device=self.device)
                    dst.copy_(value, non_blocking=True)
                    self.placed[name] = dst
                else:
                    continue
                n += 1
        return n


def serialize_update(named: Mapping[str, Any], device: str, staged: BucketStager | None = None) -> tuple[str, dict[str, Any], float]:
    """``(base64 payload, the tensors as placed on device, host-to-device seconds)``; see the module docstring.

    `staged`: copies queued as the buckets verified (`BucketStager`); what it holds is used as it is."""
    import torch
    import torch.multiprocessing  # registers the CUDA tensor reductions on ForkingPickler

    t0 = time.time()
    by_dtype: dict[Any, list[tuple[str, Any]]] = {}
    pre: dict[str, Any] = {}
    if staged is not None and staged.device == device:
        if staged.stream is not None:
            staged.stream.synchronize()
        pre = {name: staged.placed[name] for name in named if name in staged.placed
               and tuple(staged.placed[name].shape) == tuple(named[name].shape) and staged.placed[name].dtype == named[name].dtype}
    for name, value in named.items():
        if name in pre:
            continue
        t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        by_dtype.setdefault(t.dtype, []).append((name, t))
    placed: dict[str, Any] = dict(pre)
    if not pre and on_device(named, device):
        # already on the engine's GPU (the same-GPU weight path: the subscriber's verified device buffers, kept until
        # the next version is served): SGLang maps these very tensors, no copy
        placed = dict(named)
        by_dtype = {}
    for dtype, items in by_dtype.items():
        total = sum(t.numel() for _, t in items)
        flat = torch.empty(total, dtype=dtype, device=device)
        off = 0
        for name, t in items:
            n = t.numel()
            view = flat[off : off + n]
            view.copy_(t.reshape(-1), non_blocking=True)  # pinned sources copy asynchronously; one sync below
            placed[name] = view.view(t.shape)
            off += n
    on_cuda = device.startswith("cuda")
    if on_cuda:
        torch.cuda.synchronize(device)
    h2d_s = time.time() - t0
    items_out = [(name, placed[name]) for name in named]
    buf = io.BytesIO()
    if on_cuda:
        from multiprocessing.reduction import ForkingPickler

        ForkingPickler(buf).dump(items_out)
        data = buf.getvalue()
    else:
        torch.save(items_out, buf)
        data = CPU_PAYLOAD_MAGIC + buf.getvalue()
    return base64.b64encode(data).decode(), placed, h2d_s


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
