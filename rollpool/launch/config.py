"""`LaunchWorker`: what every worker a launcher starts runs, one nested config of both launchers; `host_gpus`.

``LocalLaunchConfig.worker`` and ``RayLaunchConfig.worker`` are a `LaunchWorker`;
their ``restart`` is a `RestartPolicy` (rollpool.launch.policy). The flags stay
flat (``--engine``, ``--model``, ``--engine-options``, ``--agent-processes``, ``--worker-args``;
``--restart-backoff-s`` ...), the TOML file nests them (``[launch.worker]``,
``[launch.restart]``; see rollpool.protocol.config).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field

from rollpool.protocol.config import help_
from rollpool.protocol.errors import ConfigError

__all__ = ["LaunchWorker", "assign_gpus", "host_gpus"]


@dataclass(frozen=True, slots=True)
class LaunchWorker:
    """The worker fields a launcher sets for every worker it starts (ids, endpoints and pool are the launcher's)."""

    engine: str = field(default="sim", metadata=help_("engine of every worker: sim, hf, sglang"))
    model: str | None = field(default=None, metadata=help_("model directory (hf, sglang); with ray, visible on every node"))
    engine_options: str = field(default="", metadata=help_("engine keyword options for every worker: key=value,..."))
    tp_size: int = field(default=1, metadata=help_("sglang: tensor-parallel GPUs of each worker's engine replica"))
    dp_size: int = field(default=1, metadata=help_("sglang: data-parallel replicas of each worker's engine"))
    agent_processes: int = field(default=0, metadata=help_(
        "run each worker's --episode functions (given in --worker-args) in this many child processes of it; 0: in the worker"))
    args: str = field(default="", metadata={**help_("extra flags for every worker, one shell-quoted string"),
                                            "flag": "worker_args"})

    def __post_init__(self) -> None:
        if not self.engine:
            raise ConfigError("LaunchWorker.engine must name an engine (sim, hf, sglang)")
        if self.tp_size < 1 or self.dp_size < 1:
            raise ConfigError(f"LaunchWorker.tp_size and dp_size must be >= 1, got {self.tp_size} and {self.dp_size}")
        if self.gpus_needed > 1 and self.engine != "sglang":
            raise ConfigError(f"LaunchWorker.tp_size and dp_size above 1 need engine sglang, got {self.engine!r}")
        if self.agent_processes:
            # imported only then: it imports the episode machinery
            from rollpool.workers.episodes.runner import MAX_AGENT_PROCESSES

            if not 0 < self.agent_processes <= MAX_AGENT_PROCESSES:
                raise ConfigError(f"LaunchWorker.agent_processes must be in [0, {MAX_AGENT_PROCESSES}], got {self.agent_processes}")
        try:
            shlex.split(self.args)
        except ValueError as exc:
            raise ConfigError(f"LaunchWorker.args (--worker-args): {exc}") from exc

    def argv(self) -> list[str]:
        """``--engine``, ``--model``, ``--engine-options`` ... as worker flags (``args`` go last: `extra_argv`)."""
        out = ["--engine", self.engine]
        if self.model:
            out += ["--model", self.model]
        if self.engine_options:
            out += ["--engine-options", self.engine_options]
        if self.tp_size != 1:
            out += ["--tp-size", str(self.tp_size)]
        if self.dp_size != 1:
            out += ["--dp-size", str(self.dp_size)]
        if self.agent_processes:
            out += ["--agent-processes", str(self.agent_processes)]
        return out

    @property
    def gpus_needed(self) -> int:
        """GPUs one worker's engine spans (``tp_size * dp_size``)."""
        return self.tp_size * self.dp_size

    def extra_argv(self) -> list[str]:
        return shlex.split(self.args)


def host_gpus(environ: Mapping[str, str] | None = None) -> tuple[tuple[str, ...], str]:
    """The GPUs this host gives its workers, and where that came from: ``CUDA_VISIBLE_DEVICES`` when set, else every
    GPU ``nvidia-smi -L`` lists (none when it is absent: a CPU host)."""
    env = os.environ if environ is None else environ
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is not None:
        ids: list[str] = []
        for part in (p.strip() for p in raw.split(",")):
            if not part or part.startswith("-"):
                break  # CUDA stops at the first invalid entry
            ids.append(part)
        return tuple(ids), f"CUDA_VISIBLE_DEVICES={raw!r}"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return (), "no CUDA_VISIBLE_DEVICES and no nvidia-smi"
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return (), f"nvidia-smi -L failed: {exc}"
    return tuple(str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")), "nvidia-smi -L"


def assign_gpus(workers: int, per_worker: int, gpus: tuple[str, ...], where: str) -> list[tuple[str, ...]]:
    """Worker i's GPUs: ``gpus[i * per_worker : (i + 1) * per_worker]``; a `ConfigError` when the host has too few."""
    need = workers * per_worker
    if need > len(gpus):
        raise ConfigError(f"{workers} workers x {per_worker} GPUs per worker (--gpus-per-worker) = {need} GPUs; this host "
                          f"has {len(gpus)} ({where}). Run fewer workers, or fewer GPUs per worker (--tp-size x --dp-size)")
    return [tuple(gpus[i * per_worker : (i + 1) * per_worker]) for i in range(workers)]
