"""``rollpool launch ray``: rollout workers as Ray actors, one per placement-group bundle.

The broker runs elsewhere (``--broker ENDPOINT``, its worker endpoint); this
launcher only places and keeps workers. Each bundle asks for
``gpus_per_worker`` GPUs (by default the engine's ``tp_size * dp_size``; a
cluster with fewer GPUs than the workers need is refused at once) and
``cpus_per_worker`` CPUs (by default 1 + the worker's ``agent_processes``: one for the worker, one for each
process it runs its agents in); the placement group's
strategy is PACK, SPREAD, STRICT_PACK or STRICT_SPREAD. Each actor runs the
same worker CLI as everywhere else (``python -m rollpool worker``) as its
child process, with the GPUs Ray assigned it (Ray sets
``CUDA_VISIBLE_DEVICES`` in the actor; the child inherits it), and a
parent-death signal, so an actor that dies takes its worker with it.

A dead actor (its process killed, its node lost) or a worker process that
exited is replaced in the same bundle after the `RestartPolicy` backoff, with
the same worker id, so the broker requeues its leases at once. `stop()`
(SIGTERM/SIGINT in the CLI) asks every worker to drain (SIGTERM) and waits up
to ``stop_timeout_s``, then kills the actors and removes the placement group.

Only this module imports ``ray`` (``pip install 'rollpool[ray]'``).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollpool.launch.config import LaunchWorker
from rollpool.launch.policy import RestartPolicy, RestartTracker
from rollpool.protocol.config import help_ as _h
from rollpool.protocol.errors import ConfigError

__all__ = ["RayLaunchConfig", "RayLauncher", "run_ray", "worker_command"]

log = logging.getLogger(__name__)

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True, slots=True)
class RayLaunchConfig:
    broker: str = field(default="", metadata=_h("the broker's worker endpoint, e.g. tcp://head:5555"))
    workers: int = field(default=1, metadata=_h("worker actors, one per placement-group bundle"))
    gpus_per_worker: float = field(default=-1.0, metadata=_h(
        "GPUs per bundle (Ray num_gpus; 0 for the sim engine); -1: the engine's tp_size x dp_size (1 for a one-GPU engine)"))
    cpus_per_worker: float = field(default=-1.0, metadata=_h(
        "CPUs per bundle (Ray num_cpus); -1: 1 + the worker's --agent-processes (the worker and each agent process)"))
    strategy: str = field(default="PACK", metadata=_h("placement strategy: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD"))
    worker: LaunchWorker = field(default_factory=lambda: LaunchWorker(engine="sglang"),
                                 metadata=_h("what every worker runs ([launch_ray.worker])"))
    pool: str = field(default="default", metadata=_h("pool name (monitoring keys, worker ids)"))
    ray_address: str | None = field(default=None, metadata=_h("Ray cluster address (default: RAY_ADDRESS, else a local one)"))
    placement_timeout_s: float = field(default=300.0, metadata=_h("longest wait for the placement group"))
    poll_interval_s: float = field(default=1.0, metadata=_h("how often actors are checked"))
    restart: RestartPolicy = field(default_factory=RestartPolicy,
                                   metadata=_h("replacement backoff of a dead worker ([launch_ray.restart])"))
    stop_timeout_s: float = field(default=30.0, metadata=_h("on stop: how long workers may drain before they are killed"))
    state_file: str | None = field(default=None, metadata=_h("write worker ids, actor and process pids here (JSON)"))

    @property
    def gpus(self) -> float:
        """GPUs per bundle, ``-1`` resolved to the engine's ``tp_size * dp_size``."""
        return float(self.worker.gpus_needed) if self.gpus_per_worker == -1 else self.gpus_per_worker

    @property
    def cpus(self) -> float:
        """CPUs per bundle, ``-1`` resolved to 1 + the worker's ``agent_processes``.

        Ray's CPUs are a reservation, not a limit: the engine's own processes (SGLang's scheduler and tokenizer)
        are not counted, as they were not before agent processes; give more with an explicit value."""
        return float(1 + self.worker.agent_processes) if self.cpus_per_worker == -1 else self.cpus_per_worker

    def bundle(self) -> dict[str, float]:
        """One placement-group bundle: the resources each worker actor holds."""
        out: dict[str, float] = {}
        if self.cpus:
            out["CPU"] = self.cpus
        if self.gpus:
            out["GPU"] = self.gpus
        return out

    def __post_init__(self) -> None:
        if "://" not in self.broker:
            raise ConfigError(f"RayLaunchConfig.broker must be the broker's worker endpoint, got {self.broker!r}")
        if not 1 <= self.workers <= 4096:
            raise ConfigError(f"RayLaunchConfig.workers must be in 1..4096, got {self.workers}")
        if (self.gpus_per_worker < 0 and self.gpus_per_worker != -1) or (self.cpus_per_worker < 0 and self.cpus_per_worker != -1) \
                or self.gpus + self.cpus == 0:
            raise ConfigError("RayLaunchConfig: gpus_per_worker and cpus_per_worker must be >= 0 (or -1), not both 0")
        if self.gpus > 1 and self.gpus != int(self.gpus):
            raise ConfigError(f"RayLaunchConfig.gpus_per_worker above 1 must be a whole number (Ray), got {self.gpus}")
        if 0 < self.gpus < self.worker.gpus_needed or (self.gpus == 0 and self.worker.gpus_needed > 1):
            raise ConfigError(f"RayLaunchConfig.gpus_per_worker is {self.gpus:g}, but each worker's engine spans "
                              f"tp_size x dp_size = {self.worker.gpus_needed} GPUs")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"RayLaunchConfig.strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.placement_timeout_s <= 0 or self.poll_interval_s <= 0 or self.stop_timeout_s <= 0:
            raise ConfigError("RayLaunchConfig: placement_timeout_s, poll_interval_s and stop_timeout_s must be > 0")


def worker_command(config: RayLaunchConfig, index: int, *, python: str = "python",
                   redis_url: str | None = None, log_level: str | None = None) -> list[str]:
    """The worker command line of bundle ``index`` (the same CLI as every other launcher).

    The actor puts its own interpreter in place of ``python`` (nodes may differ from the driver).
    """
    argv = [python, "-m", "rollpool", "worker"]
    if log_level:
        argv += ["--log-level", log_level]
    argv += ["--broker", config.broker, *config.worker.argv(), "--worker-id", f"{config.pool}-ray{index}",
             "--pool", config.pool]
    if redis_url:
        argv += ["--redis-url", redis_url]
    return argv + config.worker.extra_argv()


def _set_parent_death_signal() -> None:
    from rollpool.launch.supervisor import set_parent_death_signal

    set_parent_death_signal()


class WorkerHost:
    """The body of one worker actor: it owns one worker process."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        argv = [sys.executable, *argv[1:]]
        self.proc = subprocess.Popen(argv, env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=_set_parent_death_signal)

    def info(self) -> dict[str, Any]:
        return {"actor_pid": os.getpid(), "worker_pid": self.proc.pid, "node": os.uname().nodename,
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def poll(self) -> int | None:
        """None while the worker runs, else its exit code."""
        return self.proc.poll()

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM (the worker drains and hands back), then SIGKILL after ``timeout_s``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


@dataclass(slots=True)
class _Slot:
    index: int
    tracker: RestartTracker
    actor: Any = None
    info: dict[str, Any] = field(default_factory=dict)
    started_at: float = 0.0
    restart_at: float | None = None
    given_up: bool = False


class RayLauncher:
    """Places, watches and stops the worker actors; `run()` blocks until `stop()` (thread-safe)."""

    def __init__(self, config: RayLaunchConfig, *, redis_url: str | None = None, log_level: str | None = None) -> None:
        self.config = config
        self.redis_url = redis_url
        self.log_level = log_level
        self._stop = threading.Event()
        self._slots = [_Slot(i, RestartTracker(config.restart)) for i in range(config.workers)]
        self._pg: Any = None
        self._actor_cls: Any = None
        self.replacements = 0

    def stop(self) -> None:
        self._stop.set()

    def run(self, on_ready: Callable[[], None] | None = None) -> int:
        """Place and keep the workers until `stop()`; ``on_ready`` runs once Ray is up (install signal handlers there)."""
        try:
            import ray
            from ray.util.placement_group import placement_group, remove_placement_group
        except ImportError as exc:
            raise ConfigError("rollpool launch ray needs Ray: pip install 'rollpool[ray]'") from exc
        cfg = self.config
        started_ray = not ray.is_initialized()
        if started_ray:
            ray.init(address=cfg.ray_address, log_to_driver=True)
        if on_ready is not None:
            on_ready()  # after ray.init, which installs signal handlers of its own
        bundle = cfg.bundle()
        if cfg.gpus:
            have = float(ray.cluster_resources().get("GPU", 0.0))  # type: ignore[no-untyped-call]
            if cfg.workers * cfg.gpus > have:
                # a placement group Ray cannot fill would only time out after placement_timeout_s
                if started_ray:
                    ray.shutdown()
                raise ConfigError(f"{cfg.workers} workers x {cfg.gpus:g} GPUs per worker (--gpus-per-worker) = "
                                  f"{cfg.workers * cfg.gpus:g} GPUs; the Ray cluster has {have:g}")
        self._pg = placement_group([dict(bundle) for _ in range(cfg.workers)], strategy=cfg.strategy,
                                   name=f"rollpool-{cfg.pool}")
        try:
            ray.get(self._pg.ready(), timeout=cfg.placement_timeout_s)
        except Exception as exc:
            remove_placement_group(self._pg)
            raise ConfigError(f"placement group of {cfg.workers} x {bundle} ({cfg.strategy}) not ready within "
                              f"{cfg.placement_timeout_s} s: {exc}") from exc
        # ray's stubs lack the actor options (max_concurrency) of ray.remote
        self._actor_cls = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)(WorkerHost)  # type: ignore[call-overload]
        log.info("rollpool launch ray: %d workers x %s, %s, broker %s", cfg.workers, bundle, cfg.strategy, cfg.broker)
        failed = False
        try:
            for slot in self._slots:
                self._start(slot)
            self._write_state()
            while not self._stop.wait(cfg.poll_interval_s):
                failed = self._check() or failed
                if all(s.given_up for s in self._slots):
                    log.error("every worker was given up; stopping")
                    failed = True
                    break
        finally:
            self._stop_all()
            remove_placement_group(self._pg)
            self._write_state()
            if started_ray:
                ray.shutdown()  # a local cluster started here goes with us; a remote one only loses this driver
        return 1 if failed else 0

    # internals

    def _start(self, slot: _Slot) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cfg = self.config
        strategy = PlacementGroupSchedulingStrategy(placement_group=self._pg, placement_group_bundle_index=slot.index,
                                                    placement_group_capture_child_tasks=True)
        # the bundle's resources go to the actor, so Ray assigns it (and its worker) the bundle's GPUs
        slot.actor = self._actor_cls.options(
            num_cpus=cfg.cpus, num_gpus=cfg.gpus, scheduling_strategy=strategy,
            name=f"rollpool-{cfg.pool}-worker-{slot.index}-{slot.tracker.restarts}",
        ).remote(worker_command(cfg, slot.index, redis_url=self.redis_url, log_level=self.log_level), {})
        slot.info = ray.get(slot.actor.info.remote(), timeout=cfg.placement_timeout_s)
        slot.started_at = time.monotonic()
        slot.restart_at = None
        log.info("worker %d: actor pid %s, worker pid %s on %s (CUDA_VISIBLE_DEVICES=%s)", slot.index,
                 slot.info["actor_pid"], slot.info["worker_pid"], slot.info["node"], slot.info["cuda_visible_devices"])

    def _check(self) -> bool:
        """Poll every actor; schedule and perform replacements. True if a slot was given up just now."""
        import ray

        now = time.monotonic()
        gave_up = False
        for slot in self._slots:
            if slot.given_up:
                continue
            if slot.restart_at is not None:
                if now >= slot.restart_at:
                    self._start(slot)
                    self.replacements += 1
                    self._write_state()
                continue
            try:
                rc = ray.get(slot.actor.poll.remote(), timeout=max(10.0, self.config.poll_interval_s * 5))
                reason = None if rc is None else f"worker exited with {rc}"
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                reason = f"actor lost ({type(exc).__name__})"
            if reason is None:
                continue
            with _suppress_all():
                ray.kill(slot.actor, no_restart=True)
            delay_s = slot.tracker.on_exit(now - slot.started_at)
            if delay_s is None:
                slot.given_up = True
                gave_up = True
                log.error("worker %d: %s %d times in a row; giving up on this bundle", slot.index, reason,
                          slot.tracker.failures)
            else:
                log.warning("worker %d: %s; replacing it in %.1f s", slot.index, reason, delay_s)
                slot.restart_at = now + delay_s
            slot.info = {}
            self._write_state()
        return gave_up

    def _stop_all(self) -> None:
        import ray

        live = [s for s in self._slots if s.actor is not None and s.info]
        refs = [s.actor.stop.remote(self.config.stop_timeout_s) for s in live]
        with _suppress_all():
            ray.get(refs, timeout=self.config.stop_timeout_s + 10.0)
        for slot in self._slots:
            if slot.actor is not None:
                with _suppress_all():
                    ray.kill(slot.actor, no_restart=True)
            slot.info = {}

    def _write_state(self) -> None:
        if not self.config.state_file:
            return
        state = {"replacements": self.replacements,
                 "workers": [{"index": s.index, "worker_id": f"{self.config.pool}-ray{s.index}", "restarts": s.tracker.restarts,
                              "given_up": s.given_up, **s.info} for s in self._slots]}
        path = pathlib.Path(self.config.state_file)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(path)


class _suppress_all:
    """Best effort on the way out: a failing kill or stop must not hide the reason we are stopping."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool:
        if exc is not None:
            log.debug("ignored during shutdown: %r", exc)
        return exc_type is not None and exc_type is not KeyboardInterrupt


def run_ray(config: RayLaunchConfig, *, redis_url: str | None = None, log_level: str | None = None) -> int:
    """Run the Ray launcher in the foreground until SIGTERM/SIGINT."""
    launcher = RayLauncher(config, redis_url=redis_url, log_level=log_level)

    def install_handlers() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: launcher.stop())

    install_handlers()
    return launcher.run(on_ready=install_handlers)
