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

__all__ = ["CPU_PAYLOAD_MAGIC", "cuda_available", "init_cuda", "leading", "load_cpu_payload", "nbytes", "serialize_update"]

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


def serialize_update(named: Mapping[str, Any], device: str) -> tuple[str, dict[str, Any], float]:
    """``(base64 payload, the tensors as placed on device, host-to-device seconds)``; see the module docstring."""
    import torch
    import torch.multiprocessing  # registers the CUDA tensor reductions on ForkingPickler

    t0 = time.time()
    by_dtype: dict[Any, list[tuple[str, Any]]] = {}
    for name, value in named.items():
        t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        by_dtype.setdefault(t.dtype, []).append((name, t))
    placed: dict[str, Any] = {}
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
