"""Pure decisions of the launchers: when to restart a process, how many workers to run.

No I/O and no clock of their own (callers pass ``now``), so the tests need no
sleeping. `RestartPolicy` is the bounded exponential backoff every launcher
(local supervisor, Ray) applies to a process that died; `Autoscaler` turns the
broker's queue depth into a worker replica count with bounds and a cooldown,
the same rule the KEDA ScaledObject of ``ops/k8s`` applies on a cluster.

When a restart cannot help, `RestartTracker` gives up at once instead of
backing off until ``max_restarts``: a process that exits with status 2 (a
usage error: the same command line fails the same way), and a quick failure
that repeats the previous one identically (the same exit status and the same
last lines of output, numbers aside: `failure_signature`). A death by a
signal (a negative status) is never "identical": something outside killed it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from rollpool.protocol.errors import ConfigError

__all__ = ["RestartPolicy", "RestartTracker", "Autoscaler", "desired_replicas", "failure_signature", "USAGE_ERROR_EXIT"]

USAGE_ERROR_EXIT = 2
"""The exit status of a usage error (argparse, and `rollpool` on a bad configuration): never worth a restart."""

_SIGNATURE_LINES = 5
_NUMBER = re.compile(r"\d+")


def failure_signature(exit_code: int, last_lines: Sequence[str]) -> tuple[str, ...]:
    """What identifies a failure: its exit status and its last non-empty output lines with every number masked
    (timestamps, pids, durations and ports differ between two runs of the same failure)."""
    lines = [ln.strip() for ln in last_lines if ln.strip()][-_SIGNATURE_LINES:]
    return (str(exit_code), *(_NUMBER.sub("#", ln) for ln in lines))


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """Bounded exponential backoff: ``backoff_s * 2**(k-1)``, capped, for the k-th quick failure in a row.

    A run that lasted ``stable_after_s`` or longer resets the count; after
    ``max_restarts`` quick failures in a row the process is given up.
    """

    # "flag": the command-line name (rollpool.protocol.config) when nested in a launch config (``[launch.restart]``)
    backoff_s: float = field(default=1.0, metadata={"help": "first wait before restarting a dead process",
                                                     "flag": "restart_backoff_s"})
    backoff_max_s: float = field(default=30.0, metadata={"help": "longest wait between restarts", "flag": "restart_backoff_max_s"})
    max_restarts: int = field(default=10, metadata={"help": "quick failures in a row before a process is given up",
                                                     "flag": "max_restarts"})
    stable_after_s: float = field(default=60.0, metadata={"help": "a run this long resets the failure count",
                                                           "flag": "stable_after_s"})

    def __post_init__(self) -> None:
        if self.backoff_s <= 0 or self.backoff_max_s < self.backoff_s:
            raise ConfigError(f"RestartPolicy needs 0 < backoff_s <= backoff_max_s, got {self.backoff_s}, {self.backoff_max_s}")
        if self.max_restarts < 0:
            raise ConfigError(f"RestartPolicy.max_restarts must be >= 0, got {self.max_restarts}")
        if self.stable_after_s <= 0:
            raise ConfigError(f"RestartPolicy.stable_after_s must be > 0, got {self.stable_after_s}")

    def delay_s(self, failures: int) -> float:
        """Wait before the restart that follows the ``failures``-th quick failure in a row (>= 1)."""
        return min(self.backoff_max_s, self.backoff_s * 2.0 ** max(0, failures - 1))


@dataclass(slots=True)
class RestartTracker:
    """One process's restart state under a `RestartPolicy`."""

    policy: RestartPolicy
    failures: int = 0
    restarts: int = 0
    gave_up_because: str = ""
    """Why `on_exit` gave up ("" while it has not)."""
    _last: tuple[str, ...] | None = None  # the signature of the previous quick failure in a row

    def on_exit(self, ran_for_s: float, exit_code: int | None = None, last_lines: Sequence[str] = ()) -> float | None:
        """The process died after ``ran_for_s``: the wait before restarting it, or None to give up.

        With ``exit_code`` (and the process's last output lines), also gives up at once on a usage error
        (status 2) and on a quick failure identical to the previous one (see the module docstring).
        """
        quick = ran_for_s < self.policy.stable_after_s
        self.failures = self.failures + 1 if quick else 1
        signature = failure_signature(exit_code, last_lines) if exit_code is not None and exit_code > 0 else None
        if exit_code == USAGE_ERROR_EXIT:
            self.gave_up_because = f"exit status {USAGE_ERROR_EXIT} is a usage error: the same command fails the same way"
            return None
        if quick and signature is not None and signature == self._last:
            self.gave_up_because = "it failed twice in a row the same way (same exit status and last lines)"
            return None
        self._last = signature if quick else None
        if self.failures > self.policy.max_restarts:
            self.gave_up_because = f"{self.failures} quick failures in a row (max_restarts {self.policy.max_restarts})"
            return None
        self.restarts += 1
        return self.policy.delay_s(self.failures)


def desired_replicas(queued_samples: int, inflight_samples: int, capacity_per_worker: int,
                     min_replicas: int, max_replicas: int, target_utilization: float = 1.0) -> int:
    """Workers needed so that queued plus in-flight samples fill ``target_utilization`` of each one's capacity.

    ``ceil((queued + inflight) / (capacity * target))`` clamped to ``[min, max]``:
    the broker's own queue depth is the signal, so an idle pool shrinks to
    ``min_replicas`` and a backlog grows it up to ``max_replicas``.
    """
    if capacity_per_worker < 1:
        raise ConfigError(f"capacity_per_worker must be >= 1, got {capacity_per_worker}")
    if not 0 <= min_replicas <= max_replicas:
        raise ConfigError(f"need 0 <= min_replicas <= max_replicas, got {min_replicas}, {max_replicas}")
    if not 0 < target_utilization <= 1:
        raise ConfigError(f"target_utilization must be in (0, 1], got {target_utilization}")
    load = max(0, queued_samples) + max(0, inflight_samples)
    want = math.ceil(load / (capacity_per_worker * target_utilization)) if load else 0
    return max(min_replicas, min(max_replicas, want))


@dataclass(slots=True)
class Autoscaler:
    """`desired_replicas` with a cooldown: scale up at once, scale down only after the load stayed low.

    Scaling up is cheap to undo and a backlog costs trainer time, so it is
    immediate; scaling down kills workers that may be loading weights, so it
    waits until every recommendation of the last ``scale_down_cooldown_s`` was
    at or below the new count (the same stabilization window as Kubernetes'
    HPA), and never removes more than ``max_scale_down_step`` at once.
    """

    capacity_per_worker: int
    min_replicas: int = 1
    max_replicas: int = 8
    target_utilization: float = 1.0
    scale_down_cooldown_s: float = 300.0
    max_scale_down_step: int = 1
    _history: list[tuple[float, int]] = field(default_factory=list)
    _quiet_since: float | None = None  # start of the window that must pass before the next scale-down

    def __post_init__(self) -> None:
        desired_replicas(0, 0, self.capacity_per_worker, self.min_replicas, self.max_replicas, self.target_utilization)
        if self.scale_down_cooldown_s < 0 or self.max_scale_down_step < 1:
            raise ConfigError("Autoscaler needs scale_down_cooldown_s >= 0 and max_scale_down_step >= 1")

    def decide(self, now: float, current: int, queued_samples: int, inflight_samples: int) -> int:
        """The replica count to run from ``now`` on, given ``current`` and the broker's counters."""
        want = desired_replicas(queued_samples, inflight_samples, self.capacity_per_worker,
                                self.min_replicas, self.max_replicas, self.target_utilization)
        if self._quiet_since is None:
            self._quiet_since = now
        self._history.append((now, want))
        horizon = now - self.scale_down_cooldown_s
        self._history = [(t, w) for t, w in self._history if t >= horizon]
        if want >= current:
            if want > current:
                self._quiet_since = now
            return want
        if now - self._quiet_since < self.scale_down_cooldown_s:
            return current  # not yet a whole window of low load since the last change
        ceiling = max(w for _, w in self._history)  # the highest recommendation of the window
        if ceiling >= current:
            return current
        self._quiet_since = now
        return max(ceiling, current - self.max_scale_down_step, self.min_replicas)
