"""`WorkerConfig`: the frozen configuration of one rollout worker process.

Loaded with ``load_config(WorkerConfig, args, section="worker")`` (flags,
``ROLLPOOL_*`` environment, ``[worker]`` TOML table). `__post_init__` checks
every range and names the field. ``engine_options`` (``key=value,key=value``)
is parsed by the chosen engine's options dataclass (`SimOptions`, `HFOptions`,
`SGLangOptions` in engines/options.py: typed by field, validated, errors name
the field) here, before any engine loads; `engine_kwargs()` gives the typed
values plus ``model``/``capacity`` as keyword arguments for the engine factory.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

from rollpool.protocol.config import help_ as _h
from rollpool.protocol.errors import ConfigError
from rollpool.protocol.messages import ApplyMode
from rollpool.weights.config import WeightPathConfig
from rollpool.workers.engines.options import OPTIONS_BY_ENGINE, parse_options, split_options
from rollpool.workers.images import ImagePolicy

__all__ = ["WorkerConfig", "parse_engine_options"]



@dataclass(frozen=True, slots=True)
class WorkerConfig:
    broker: str = field(default="tcp://127.0.0.1:5555", metadata=_h("the broker's worker endpoint"))
    engine: str = field(default="sim", metadata=_h("engine name: sim, hf, sglang"))
    model: str | None = field(default=None, metadata=_h("model directory (hf, sglang)"))
    worker_id: str = field(default="", metadata=_h("unique id; default host-pid"))
    capacity: int = field(default=0, metadata=_h("most sequences at once; 0 = the engine's capacity"))
    apply_mode: str = field(default="interrupt", metadata=_h("weight apply mode: interrupt, in_place, drain"))
    reward: str | None = field(default=None, metadata=_h("reward function as module:function"))
    reward_timeout_s: float = field(default=30.0, metadata=_h("most seconds one reward call may take"))
    episode: tuple[str, ...] = field(default=(), metadata=_h("episode function as package.module:function or name=package.module:function; a prompt picks by metadata['episode'], else the first"))
    max_episodes: int = field(default=64, metadata=_h("most episodes running at once on this worker (beside the engine's capacity)"))
    agent_processes: int = field(default=0, metadata=_h("run the --episode functions in this many child processes, each with its own event loop "
                                                         "(restarted if they die); 0 = in the worker's process"))
    episode_timeout_s: float = field(default=600.0, metadata=_h("most seconds one episode may run; then it ends with finish_reason abort"))
    tool_call_parser: str = field(default="hermes", metadata=_h("the episode endpoint's tool-call parser, by name"))
    max_context_tokens: int = field(default=0, metadata=_h("episodes: the context in tokens; 0 = what the engine states"))
    episode_replay: bool = field(default=True, metadata=_h("episodes: a group run again after its worker died is served the turns "
                                                          "the earlier attempt recorded where its requests match (off: every turn sampled again)"))
    image_fetch: bool = field(default=False, metadata=_h("fetch prompt images given as http(s) URLs (off: such a prompt fails, naming why)"))
    image_fetch_timeout_s: float = field(default=10.0, metadata=_h("most seconds one image fetch may take"))
    max_images_per_prompt: int = field(default=8, metadata=_h("most images in one prompt"))
    max_image_bytes: int = field(default=8 * 1024 * 1024, metadata=_h("largest encoded image (bytes, data, file or fetched)"))
    max_image_pixels: int = field(default=4096 * 4096, metadata=_h("most pixels (width x height) of one image"))
    heartbeat_interval_s: float = field(default=1.0, metadata=_h("seconds between heartbeats"))
    missed_heartbeats: int = field(default=3, metadata=_h("broker silent this many intervals -> reconnect"))
    drain_timeout_s: float = field(default=30.0, metadata=_h("on SIGTERM, finish in-flight work for this long"))
    reconnect_backoff_s: float = field(default=1.0, metadata=_h("first wait before re-sending hello"))
    reconnect_backoff_max_s: float = field(default=30.0, metadata=_h("longest wait between hellos"))
    restart_backoff_s: float = field(default=1.0, metadata=_h("first wait before restarting a failed engine"))
    restart_backoff_max_s: float = field(default=30.0, metadata=_h("longest wait between engine restarts"))
    max_restarts: int = field(default=10, metadata=_h("engine restarts in a row (an engine up restart_backoff_max_s ends a row) before the worker gives up"))
    send_timeout_s: float = field(default=5.0, metadata=_h("most seconds one send to the broker may wait"))
    apply_grant_timeout_s: float = field(default=30.0, metadata=_h("re-ask for an apply slot after this long (doubling, up to 4x)"))
    apply_timeout_s: float = field(
        default=90.0,
        metadata=_h("most seconds one weight apply (pause, update, resume) may take before the engine is restarted "
                    "(keep it below the broker's apply_slot_deadline_s)"),
    )
    weight_retries: int = field(default=5, metadata=_h("fetches or apply-grant asks of one weight version before it is skipped"))
    fetch_timeout_s: float = field(default=60.0, metadata=_h("weight fetch timeout"))
    window_chunks: int = field(default=4, metadata=_h("weight chunks in flight per fetch"))
    max_refetch: int = field(default=3, metadata=_h("re-fetches of a bucket that fails verification"))
    engine_options: str = field(default="", metadata=_h("engine keyword options: key=value,key=value"))
    tp_size: int = field(default=1, metadata=_h("sglang: tensor-parallel GPUs of each engine replica (the worker owns tp_size x dp_size GPUs)"))
    dp_size: int = field(default=1, metadata=_h("sglang: data-parallel replicas of the worker's one engine, capacity split over them"))
    count: int = field(default=1, metadata=_h("sim only: independent workers hosted by this process"))
    pool: str = field(default="default", metadata=_h("pool name (monitoring keys)"))
    curve_dir: str | None = field(default=None, metadata=_h("CURVE key directory from `rollpool keys gen` (None: plaintext)"))
    weight_endpoint: str | None = field(default=None, metadata=_h("fetch weights here (a relay on this node) instead of where the broker says"))
    weight_announce_endpoint: str | None = field(default=None, metadata=_h("announcements from here (with --weight-endpoint)"))
    weights: WeightPathConfig = field(default_factory=WeightPathConfig.from_env,
                                      metadata=_h("every weight-path knob (flat flags --weight-path, --weight-streams, ...; [worker.weights] in TOML)"))
    weight_reserve_versions: int = field(
        default=2,
        metadata=_h("weight versions an engine on a GPU has its fetch buffers reserved for at its start, sized by its own "
                    "parameters: page-locked host buffers, and device buffers when it stages to CUDA (0: at the first fetch)"),
    )

    def image_policy(self) -> ImagePolicy:
        """What this worker accepts as prompt images (`rollpool.workers.images`)."""
        return ImagePolicy(max_images=self.max_images_per_prompt, max_image_bytes=self.max_image_bytes, max_pixels=self.max_image_pixels,
                           fetch=self.image_fetch, fetch_timeout_s=self.image_fetch_timeout_s)

    def __post_init__(self) -> None:  # noqa: C901 - grandfathered: one check per field
        if not self.worker_id:
            object.__setattr__(self, "worker_id", f"{socket.gethostname()}-{os.getpid()}")
        if not self.broker:
            raise ConfigError("WorkerConfig.broker must be an endpoint like tcp://127.0.0.1:5555")
        if self.capacity < 0:
            raise ConfigError(f"WorkerConfig.capacity must be >= 0 (0 = the engine's), got {self.capacity}")
        if self.apply_mode not in ApplyMode.ALL:
            raise ConfigError(f"WorkerConfig.apply_mode must be one of {ApplyMode.ALL}, got {self.apply_mode!r}")
        if self.reward is not None and ":" not in self.reward:
            raise ConfigError(f"WorkerConfig.reward must look like package.module:function, got {self.reward!r}")
        for spec in self.episode:
            path = spec.partition("=")[2] if "=" in spec else spec
            if ":" not in path:
                raise ConfigError(f"WorkerConfig.episode must look like package.module:function or name=package.module:function, got {spec!r}")
        if not 0 <= self.agent_processes <= 256:
            raise ConfigError(f"WorkerConfig.agent_processes must be in [0, 256], got {self.agent_processes}")
        if self.agent_processes and not self.episode:
            raise ConfigError("WorkerConfig.agent_processes needs --episode: the agent processes run the episode functions")
        if self.max_episodes < 1:
            raise ConfigError(f"WorkerConfig.max_episodes must be >= 1, got {self.max_episodes}")
        if self.max_context_tokens < 0:
            raise ConfigError(f"WorkerConfig.max_context_tokens must be >= 0, got {self.max_context_tokens}")
        if self.max_images_per_prompt < 0 or self.max_image_bytes < 1 or self.max_image_pixels < 1:
            raise ConfigError("WorkerConfig.max_images_per_prompt must be >= 0, max_image_bytes and max_image_pixels >= 1")
        if self.missed_heartbeats < 1:
            raise ConfigError(f"WorkerConfig.missed_heartbeats must be >= 1, got {self.missed_heartbeats}")
        if self.count < 1:
            raise ConfigError(f"WorkerConfig.count must be >= 1, got {self.count}")
        if self.count > 1 and self.engine != "sim":
            raise ConfigError(f"WorkerConfig.count > 1 needs engine sim, got {self.engine!r}")
        if self.max_restarts < 1 or self.weight_retries < 1:
            raise ConfigError(f"WorkerConfig.max_restarts and weight_retries must be >= 1, got {self.max_restarts} and {self.weight_retries}")
        if self.window_chunks < 1 or self.max_refetch < 0:
            raise ConfigError("WorkerConfig.window_chunks must be >= 1 and max_refetch >= 0")
        if not 0 <= self.weight_reserve_versions <= 4:
            raise ConfigError(f"WorkerConfig.weight_reserve_versions must be in [0, 4], got {self.weight_reserve_versions}")
        for name in (
            "reward_timeout_s",
            "episode_timeout_s",
            "heartbeat_interval_s",
            "reconnect_backoff_s",
            "reconnect_backoff_max_s",
            "restart_backoff_s",
            "restart_backoff_max_s",
            "send_timeout_s",
            "apply_grant_timeout_s",
            "apply_timeout_s",
            "fetch_timeout_s",
            "image_fetch_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"WorkerConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.tp_size < 1 or self.dp_size < 1:
            raise ConfigError(f"WorkerConfig.tp_size and dp_size must be >= 1, got {self.tp_size} and {self.dp_size}")
        if (self.tp_size > 1 or self.dp_size > 1) and self.engine != "sglang":
            raise ConfigError(f"WorkerConfig.tp_size and dp_size above 1 need engine sglang, got {self.engine!r} "
                              f"(tp_size {self.tp_size}, dp_size {self.dp_size})")
        if self.drain_timeout_s < 0:
            raise ConfigError(f"WorkerConfig.drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        self.engine_kwargs()  # validates engine_options against the engine's options dataclass

    def engine_kwargs(self) -> dict[str, Any]:
        """The engine options given (typed by the engine's options dataclass, validated), plus model and capacity."""
        kwargs: dict[str, Any] = dict(split_options(self.engine_options))
        if self.model is not None:
            kwargs.setdefault("model", self.model)
        if self.capacity:
            kwargs.setdefault("capacity", self.capacity)
        for name in ("tp_size", "dp_size"):
            if getattr(self, name) != 1:
                if name in kwargs and str(kwargs[name]).strip() != str(getattr(self, name)):
                    raise ConfigError(f"WorkerConfig.{name} is {getattr(self, name)} but engine_options says {name}={kwargs[name]}")
                kwargs[name] = getattr(self, name)
        cls = OPTIONS_BY_ENGINE.get(self.engine)
        if cls is None:  # an engine registered at run time: values typed by guess
            return parse_engine_options(self.engine_options) | {k: v for k, v in kwargs.items() if k in ("model", "capacity")}
        try:
            opts: object = parse_options(cls, kwargs)
        except ConfigError as exc:
            raise ConfigError(f"WorkerConfig.engine_options: {exc}") from None
        return {k: getattr(opts, k) for k in kwargs}


def parse_engine_options(text: str) -> dict[str, Any]:
    """``"a=1,b=0.5,c=x,d=true"`` -> ``{"a": 1, "b": 0.5, "c": "x", "d": True}``, typed by guess.

    Only for an engine registered at run time (`register_engine`), whose options
    have no dataclass here; the built-in engines are parsed by their dataclass.
    """
    out: dict[str, Any] = {}
    for key, raw in split_options(text).items():
        value: Any = raw
        low = value.lower()
        if low in ("true", "false"):
            value = low == "true"
        else:
            for conv in (int, float):
                try:
                    value = conv(value)
                    break
                except ValueError:
                    continue
        out[key] = value
    return out
