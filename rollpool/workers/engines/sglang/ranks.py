"""The GPUs of one `sglang` engine: which GPU each tensor-parallel rank of each data-parallel replica runs on. Pure.

A worker owns the GPUs of its engine: the ones it sees (``CUDA_VISIBLE_DEVICES``,
which ``rollpool launch``, Ray, Slurm and Kubernetes set from
``--gpus-per-worker``), or every GPU of the host when nothing narrows them. An
engine of ``tp_size`` x ``dp_size`` needs that many; fewer is a `ConfigError`
naming both numbers and where the visible ones came from, raised before any
child starts. Replica ``d`` runs its ``tp_size`` ranks on the worker's GPUs
``d * tp_size .. (d + 1) * tp_size - 1`` (SGLang's ``base_gpu_id``): the child
keeps the worker's ``CUDA_VISIBLE_DEVICES``, so a GPU has one index in the
worker and in SGLang, and the CUDA IPC handles the worker pickles (which name a
device by index) open on the same GPU in SGLang's schedulers.

Nothing here imports torch: the engine counts the GPUs when no environment
variable names them. More GPUs than needed is not an error (the rest stay idle).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rollpool.protocol.errors import ConfigError

__all__ = ["GpuPlan", "plan_gpus", "visible_from_env"]


def visible_from_env(environ: Mapping[str, str]) -> tuple[str, ...] | None:
    """The GPUs ``CUDA_VISIBLE_DEVICES`` names (ids or UUIDs, in order), or None when it is unset.

    An empty value (or ``-1``, which CUDA reads the same way) names no GPU."""
    raw = environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    out: list[str] = []
    for part in (p.strip() for p in raw.split(",")):
        if not part or part.startswith("-"):
            break  # CUDA stops at the first invalid entry
        out.append(part)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class GpuPlan:
    """Where each rank runs, in the worker's CUDA numbering (``cuda:<index>``)."""

    tp_size: int
    dp_size: int
    visible: tuple[str, ...]
    """The worker's GPUs as the environment names them (``("0", "1")``), or ``("cuda:0", ...)`` when counted."""
    first: int = 0
    """The worker's GPU of rank 0 of replica 0 (an engine ``device="cuda:K"`` starts at K)."""

    def base_gpu_id(self, replica: int) -> int:
        """SGLang's ``base_gpu_id`` of replica `replica`: its rank r runs on ``cuda:<base + r>``."""
        return self.first + replica * self.tp_size

    def devices(self, replica: int = 0) -> tuple[str, ...]:
        """``cuda:<i>`` of each rank of `replica`, rank order."""
        base = self.base_gpu_id(replica)
        return tuple(f"cuda:{base + r}" for r in range(self.tp_size))

    @property
    def gpus_needed(self) -> int:
        return self.tp_size * self.dp_size


def plan_gpus(tp_size: int, dp_size: int, visible: tuple[str, ...], *, where: str, first: int = 0) -> GpuPlan:
    """The plan, or a `ConfigError` when the worker has fewer GPUs than ``tp_size * dp_size`` (from GPU `first` on).

    `where` says where `visible` came from, for the message (``CUDA_VISIBLE_DEVICES=0``, ``torch.cuda.device_count()``)."""
    if tp_size < 1 or dp_size < 1:
        raise ConfigError(f"SGLangOptions.tp_size and dp_size must be >= 1, got {tp_size} and {dp_size}")
    need = tp_size * dp_size
    if len(visible) - first < need:
        start = f" from cuda:{first} (SGLangOptions.device) on" if first else ""
        raise ConfigError(
            f"the sglang engine needs tp_size x dp_size = {tp_size} x {dp_size} = {need} GPUs{start}; this worker has "
            f"{len(visible)} ({where}). Give the worker more GPUs (rollpool launch --gpus-per-worker {need}, "
            f"Slurm --gpus-per-task={need}, k8s nvidia.com/gpu: {need}) or lower --tp-size/--dp-size")
    return GpuPlan(tp_size, dp_size, tuple(visible), first)
