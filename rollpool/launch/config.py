"""`LaunchWorker`: what every worker a launcher starts runs, one nested config of both launchers.

``LocalLaunchConfig.worker`` and ``RayLaunchConfig.worker`` are a `LaunchWorker`;
their ``restart`` is a `RestartPolicy` (rollpool.launch.policy). The flags stay
flat (``--engine``, ``--model``, ``--engine-options``, ``--worker-args``;
``--restart-backoff-s`` ...), the TOML file nests them (``[launch.worker]``,
``[launch.restart]``; see rollpool.protocol.config).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from rollpool.protocol.config import help_
from rollpool.protocol.errors import ConfigError

__all__ = ["LaunchWorker"]


@dataclass(frozen=True, slots=True)
class LaunchWorker:
    """The worker fields a launcher sets for every worker it starts (ids, endpoints and pool are the launcher's)."""

    engine: str = field(default="sim", metadata=help_("engine of every worker: sim, hf, sglang"))
    model: str | None = field(default=None, metadata=help_("model directory (hf, sglang); with ray, visible on every node"))
    engine_options: str = field(default="", metadata=help_("engine keyword options for every worker: key=value,..."))
    args: str = field(default="", metadata={**help_("extra flags for every worker, one shell-quoted string"),
                                            "flag": "worker_args"})

    def __post_init__(self) -> None:
        if not self.engine:
            raise ConfigError("LaunchWorker.engine must name an engine (sim, hf, sglang)")
        try:
            shlex.split(self.args)
        except ValueError as exc:
            raise ConfigError(f"LaunchWorker.args (--worker-args): {exc}") from exc

    def argv(self) -> list[str]:
        """``--engine``, ``--model`` and ``--engine-options`` as worker flags (``args`` go last: `extra_argv`)."""
        out = ["--engine", self.engine]
        if self.model:
            out += ["--model", self.model]
        if self.engine_options:
            out += ["--engine-options", self.engine_options]
        return out

    def extra_argv(self) -> list[str]:
        return shlex.split(self.args)
