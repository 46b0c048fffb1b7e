"""``rollpool launch local``: a broker, N workers and optionally a weight relay on this machine, supervised.

`LocalLaunchConfig` is the frozen configuration (what every worker runs is its
nested ``worker``, a `LaunchWorker`; the restart backoff its ``restart``, a
`RestartPolicy`); `local_process_specs` turns
it into the command lines (the plain service CLIs, ``python -m rollpool
broker|worker|relay``, each with its monitoring flags); `run_local` runs them under a
`Supervisor` until SIGTERM/SIGINT. Worker ids are stable across restarts
(``<pool>-w<i>``), so the broker requeues a restarted worker's old leases the
moment it says hello again instead of waiting for missed heartbeats.

Before anything starts, `check_local_launch` refuses (`ConfigError`: one line,
exit 2) what no restart could fix: an endpoint the broker or relay would bind
that something already listens on (a worker would otherwise join whatever
answers there), an unknown engine, a model directory that does not exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pathlib
import shlex
import signal
import socket
import sys
from dataclasses import dataclass, field

from rollpool.launch.config import LaunchWorker, assign_gpus, host_gpus
from rollpool.launch.policy import RestartPolicy
from rollpool.launch.supervisor import ProcessSpec, Supervisor
from rollpool.protocol.config import help_ as _h
from rollpool.protocol.errors import ConfigError
from rollpool.workers.engines.registry import check_engine_and_model

__all__ = ["LocalLaunchConfig", "check_endpoint_free", "check_local_launch", "local_process_specs", "local_supervisor",
           "run_local"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LocalLaunchConfig:
    workers: int = field(default=2, metadata=_h("worker processes"))
    gpus_per_worker: int = field(default=0, metadata=_h(
        "GPUs each worker owns (its CUDA_VISIBLE_DEVICES, consecutive ones of this host's); 0: the engine's, tp_size x "
        "dp_size for sglang (none on a host without GPUs when that is 1), none for sim and hf (they see what this "
        "launcher sees)"))
    worker: LaunchWorker = field(default_factory=LaunchWorker, metadata=_h("what every worker runs ([launch.worker])"))
    worker_endpoint: str = field(default="tcp://127.0.0.1:5555", metadata=_h("the broker's worker endpoint"))
    client_endpoint: str = field(default="tcp://127.0.0.1:5556", metadata=_h("the broker's client (trainer) endpoint"))
    pool: str = field(default="default", metadata=_h("pool name (monitoring keys, worker ids)"))
    heartbeat_interval_s: float = field(default=1.0, metadata=_h("heartbeat interval of broker and workers"))
    relay: bool = field(default=False, metadata=_h("also run a weight relay for this node"))
    weights_upstream: str | None = field(default=None, metadata=_h("relay: the trainer publisher's ROUTER endpoint"))
    weights_upstream_pub: str | None = field(default=None, metadata=_h("relay: the trainer publisher's PUB endpoint"))
    relay_bind: str = field(default="tcp://127.0.0.1:6100", metadata=_h("relay: the ROUTER endpoint it serves on"))
    log_dir: str = field(default="rollpool-logs", metadata=_h("folder for one log file per process and launch.json"))
    broker_args: str = field(default="", metadata=_h("extra flags for the broker, one shell-quoted string"))
    restart: RestartPolicy = field(default_factory=RestartPolicy, metadata=_h("restart backoff of every process ([launch.restart])"))
    stop_timeout_s: float = field(default=30.0, metadata=_h("on stop: how long each stage may drain before SIGKILL"))

    def __post_init__(self) -> None:
        if not 1 <= self.workers <= 1024:
            raise ConfigError(f"LocalLaunchConfig.workers must be in 1..1024, got {self.workers}")
        if self.gpus_per_worker < 0:
            raise ConfigError(f"LocalLaunchConfig.gpus_per_worker must be >= 0, got {self.gpus_per_worker}")
        if self.gpus_per_worker and self.gpus_per_worker < self.worker.gpus_needed:
            raise ConfigError(f"LocalLaunchConfig.gpus_per_worker is {self.gpus_per_worker}, but each worker's engine spans "
                              f"tp_size x dp_size = {self.worker.gpus_needed} GPUs")
        if self.relay and not self.weights_upstream:
            raise ConfigError("LocalLaunchConfig.relay needs --weights-upstream (the trainer publisher's ROUTER endpoint)")
        for name in ("worker_endpoint", "client_endpoint", "relay_bind"):
            if "://" not in getattr(self, name):
                raise ConfigError(f"LocalLaunchConfig.{name} must be a ZeroMQ endpoint, got {getattr(self, name)!r}")
        if self.heartbeat_interval_s <= 0 or self.stop_timeout_s <= 0:
            raise ConfigError("LocalLaunchConfig.heartbeat_interval_s and stop_timeout_s must be > 0")
        try:
            shlex.split(self.broker_args)
        except ValueError as exc:
            raise ConfigError(f"LocalLaunchConfig.broker_args: {exc}") from exc


def check_endpoint_free(endpoint: str, what: str) -> None:
    """`ConfigError` when a ZeroMQ endpoint to bind (``tcp://host:port``, ``ipc://path``) is already taken.

    A tcp port is tried with SO_REUSEADDR, as libzmq binds (a port in TIME_WAIT is free, a listening one is
    not); ``*`` ports are chosen at bind time and always free. An ipc path is taken when something accepts on it.
    """
    scheme, _, rest = endpoint.partition("://")
    if scheme == "tcp":
        host, _, port = rest.rpartition(":")
        if not port.isdigit():
            return
        host = host.strip("[]")
        host = "0.0.0.0" if host in ("*", "") else host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, int(port)))
            except OSError as exc:
                raise ConfigError(f"{what} {endpoint} cannot be bound: {exc.strerror} (another broker or process listens "
                                  f"there? `ss -ltnp 'sport = :{port}'` names it; choose another port)") from None
    elif scheme == "ipc" and os.path.exists(rest):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s, contextlib.suppress(OSError):
            s.connect(rest)
            raise ConfigError(f"{what} {endpoint} is in use: something accepts connections on {rest}")


def check_local_launch(config: LocalLaunchConfig) -> None:
    """Refuse what no restart would fix, before anything starts (see the module docstring)."""
    check_engine_and_model(config.worker.engine, config.worker.model)
    check_endpoint_free(config.worker_endpoint, "the broker's worker endpoint (--worker-endpoint)")
    check_endpoint_free(config.client_endpoint, "the broker's client endpoint (--client-endpoint)")
    if config.relay:
        check_endpoint_free(config.relay_bind, "the relay's endpoint (--relay-bind)")


def local_process_specs(config: LocalLaunchConfig, *, python: str = sys.executable, redis_url: str | None = None,
                        log_level: str | None = None, gpus: tuple[tuple[str, ...], str] | None = None) -> list[ProcessSpec]:
    """The broker, workers and relay as plain service command lines (stop order: workers, relay, broker).

    With GPUs per worker (`LocalLaunchConfig.gpus_per_worker`, or an sglang engine's tp_size x dp_size), worker i
    gets its own consecutive GPUs of this host in ``CUDA_VISIBLE_DEVICES`` (`gpus`: the host's GPUs and where they
    came from; default `host_gpus`), so sglang workers never share a GPU by accident; a host with fewer GPUs than
    workers x GPUs per worker is a `ConfigError`. One-GPU sglang workers on a host without GPUs (the sim backend)
    are given none."""
    per_worker = config.gpus_per_worker or (config.worker.gpus_needed if config.worker.engine == "sglang" else 0)
    placed: list[tuple[str, ...]] = []
    if per_worker:
        host, where = gpus if gpus is not None else host_gpus()
        if host or config.gpus_per_worker or per_worker > 1:
            placed = assign_gpus(config.workers, per_worker, host, where)
    common: list[str] = []
    if log_level:
        common += ["--log-level", log_level]
    monitoring = ["--redis-url", redis_url] if redis_url else []
    hb = ["--heartbeat-interval-s", str(config.heartbeat_interval_s)]
    broker = [python, "-m", "rollpool", "broker", *common, "--worker-endpoint", config.worker_endpoint,
              "--client-endpoint", config.client_endpoint, "--pool", config.pool, *hb, *monitoring,
              *shlex.split(config.broker_args)]
    specs = [ProcessSpec("broker", tuple(broker), stop_stage=2, critical=True)]
    if config.relay:
        assert config.weights_upstream is not None
        relay = [python, "-m", "rollpool", "relay", *common, "--upstream", config.weights_upstream,
                 "--bind", config.relay_bind, "--pool", config.pool, *monitoring]
        if config.weights_upstream_pub:
            relay += ["--upstream-pub", config.weights_upstream_pub]
        specs.append(ProcessSpec("relay", tuple(relay), stop_stage=1, critical=True))
    for i in range(config.workers):
        worker = [python, "-m", "rollpool", "worker", *common, "--broker", config.worker_endpoint,
                  *config.worker.argv(), "--worker-id", f"{config.pool}-w{i}", "--pool", config.pool, *hb,
                  *monitoring, *config.worker.extra_argv()]
        env = {"CUDA_VISIBLE_DEVICES": ",".join(placed[i])} if placed else {}
        specs.append(ProcessSpec(f"worker-{i}", tuple(worker), stop_stage=0, env=env))
    return specs


def local_supervisor(config: LocalLaunchConfig, *, redis_url: str | None = None,
                     log_level: str | None = None) -> Supervisor:
    """The `Supervisor` of the local pool (not started)."""
    log_dir = pathlib.Path(config.log_dir).absolute()
    specs = local_process_specs(config, redis_url=redis_url, log_level=log_level)
    return Supervisor(specs, log_dir, policy=config.restart, stop_timeout_s=config.stop_timeout_s,
                      extra_state={"client_endpoint": config.client_endpoint, "worker_endpoint": config.worker_endpoint})


async def run_local(config: LocalLaunchConfig, *, redis_url: str | None = None, log_level: str | None = None) -> int:
    """Run the local pool until SIGTERM/SIGINT (0) or until a critical process is given up (1).

    Raises `ConfigError` before starting anything for what `check_local_launch` refuses.
    """
    check_local_launch(config)
    supervisor = local_supervisor(config, redis_url=redis_url, log_level=log_level)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, supervisor.stop)
    log.info("rollpool launch local: broker + %d %s workers%s; trainer endpoint %s; logs in %s",
             config.workers, config.worker.engine, " + relay" if config.relay else "", config.client_endpoint, supervisor.log_dir)
    try:
        return await supervisor.run()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        log.info("rollpool launch local: stopped (restarts: %s)", supervisor.restarts)
