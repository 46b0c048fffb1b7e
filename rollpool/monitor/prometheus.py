"""A pool snapshot as Prometheus text exposition format 0.0.4 (pure, no I/O).

Every sample carries a ``pool`` label. Names and meanings are listed in
docs/monitoring.md; the broker's known counters become ``rollpool_*_total``
counters, its gauges ``rollpool_*`` gauges, and any other numeric broker field
``rollpool_broker_{field}``. Worker figures carry a ``worker`` label.
"""

from __future__ import annotations

import math
import re
from typing import Any

from rollpool.monitor.keys import format_bound
from rollpool.monitor.reader import PoolState

__all__ = ["render_prometheus", "render_down", "CONTENT_TYPE", "BROKER_GAUGES", "BROKER_COUNTERS", "WORKER_GAUGES"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# broker field -> (metric name, help)
BROKER_GAUGES: dict[str, tuple[str, str]] = {
    "queued": ("rollpool_queue_depth", "Prompts queued at the broker, waiting for a worker."),
    "leased": ("rollpool_leased_tasks", "Tasks dispatched to a worker and not yet returned."),
    "held": ("rollpool_held_results", "Finished trajectories held for the trainer."),
    "version": ("rollpool_version", "Newest weight version announced to the pool."),
    "workers_alive": ("rollpool_broker_workers_alive", "Workers the broker considers alive."),
}
BROKER_COUNTERS: dict[str, tuple[str, str]] = {
    "dispatched": ("rollpool_dispatched_total", "Tasks dispatched to workers."),
    "completed": ("rollpool_completed_total", "Tasks completed by workers."),
    "requeued": ("rollpool_requeued_total", "Tasks requeued after a worker loss, timeout or abort."),
    "duplicates": ("rollpool_duplicates_total", "Duplicate results discarded."),
    "failed": ("rollpool_failed_total", "Tasks failed after their last attempt."),
    "dropped_stale": ("rollpool_dropped_stale_total", "Results dropped for exceeding the staleness bound."),
    "cancelled": ("rollpool_cancelled_total", "Tasks cancelled."),
    "protocol_errors": ("rollpool_protocol_errors_total", "Malformed frames received by the broker."),
}
WORKER_GAUGES: dict[str, tuple[str, str]] = {
    "tokens_per_s": ("rollpool_worker_tokens_per_second", "Tokens generated per second by a worker."),
    "inflight": ("rollpool_worker_inflight", "Samples in flight on a worker."),
    "credits": ("rollpool_worker_credits", "Credits a worker holds at the broker."),
    "weight_version": ("rollpool_worker_weight_version", "Weight version a worker generates with."),
    "episodes_in_flight": ("rollpool_worker_episodes_in_flight", "Episodes running on a worker (--episode)."),
    "episodes_turns_in_flight": ("rollpool_worker_episode_turns_in_flight", "Episode turns being sampled on a worker."),
    "episodes_reused_prefix_share": ("rollpool_worker_episode_reused_prefix_share",
                                     "Share of episode prompt tokens already in the episode's sequence (cacheable prefix)."),
}
WORKER_EPISODE_COUNTERS: dict[str, tuple[str, str]] = {
    "episodes_finished": ("rollpool_worker_episodes_finished_total", "Episodes ended on a worker."),
    "episodes_failed": ("rollpool_worker_episodes_failed_total", "Episodes that raised (finish_reason error)."),
    "episodes_timed_out": ("rollpool_worker_episodes_timed_out_total", "Episodes cut at episode_timeout_s."),
    "episodes_turns": ("rollpool_worker_episode_turns_total", "Model turns sampled in episodes."),
    "episodes_tool_calls": ("rollpool_worker_episode_tool_calls_total", "Tool calls parsed from episode turns."),
    "episodes_segments": ("rollpool_worker_episode_segments_total", "Episode segments (one more per history rewrite)."),
}
_SKIP_FIELDS = {"updated_at", "age_s", "ttl_s", "pid", "last_seen", "epoch"}
_NAME_RE = re.compile(r"[^a-zA-Z0-9_]")


def _metric_name(text: str) -> str:
    name = _NAME_RE.sub("_", text)
    return name if not name[:1].isdigit() else "_" + name


def _escape(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(int(value)) if float(value).is_integer() and abs(value) < 2**53 else repr(float(value))


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class _Writer:
    def __init__(self, pool: str) -> None:
        self.pool = pool
        self.lines: list[str] = []
        self._declared: set[str] = set()

    def sample(self, name: str, mtype: str, help_text: str, value: float, labels: dict[str, Any] | None = None, *, family: str | None = None) -> None:
        fam = family or name
        if fam not in self._declared:
            self._declared.add(fam)
            self.lines.append(f"# HELP {fam} {help_text}")
            self.lines.append(f"# TYPE {fam} {mtype}")
        all_labels = {"pool": self.pool, **(labels or {})}
        label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in all_labels.items())
        self.lines.append(f"{name}{{{label_text}}} {_number(float(value))}")


def render_prometheus(state: PoolState) -> str:  # noqa: C901 - grandfathered: one block per metric family
    """The exposition text for one snapshot (families grouped, HELP and TYPE once each)."""
    w = _Writer(state.pool)
    w.sample("rollpool_up", "gauge", "1 when the exporter could read the pool's Redis keys.", 1)
    w.sample("rollpool_workers_alive", "gauge", "Workers whose liveness hash exists (TTL three heartbeats).", len(state.workers))
    broker = state.broker or {}
    if broker:
        w.sample("rollpool_broker_info", "gauge", "Broker identity (epoch changes on restart).", 1, {"epoch": broker.get("epoch", "")})
        if _is_number(broker.get("age_s")):
            w.sample("rollpool_broker_age_seconds", "gauge", "Seconds since the broker last published its state.", broker["age_s"])
    for fname, value in sorted(broker.items()):
        if not _is_number(value) or fname in _SKIP_FIELDS:
            continue
        if fname in BROKER_GAUGES:
            name, help_text = BROKER_GAUGES[fname]
            w.sample(name, "gauge", help_text, value)
        elif fname in BROKER_COUNTERS:
            name, help_text = BROKER_COUNTERS[fname]
            w.sample(name, "counter", help_text, value)
        else:
            w.sample(_metric_name(f"rollpool_broker_{fname}"), "gauge", f"Broker field {fname}.", value)

    lags = state.worker_version_lag()
    if lags:
        w.sample("rollpool_version_lag", "gauge", "Largest lag, in versions, of any alive worker behind the broker's version.", max(lags.values()))
    # One family at a time: the exposition format wants a family's samples together.
    families: dict[str, list[tuple[str, str, str, float, dict[str, Any]]]] = {}

    def add(name: str, mtype: str, help_text: str, value: float, labels: dict[str, Any]) -> None:
        families.setdefault(name, []).append((name, mtype, help_text, value, labels))

    for wid, fields in sorted(state.workers.items()):
        labels = {"worker": wid}
        for fname, (name, help_text) in WORKER_GAUGES.items():
            if _is_number(fields.get(fname)):
                add(name, "gauge", help_text, fields[fname], labels)
        for fname, (name, help_text) in WORKER_EPISODE_COUNTERS.items():
            if _is_number(fields.get(fname)):
                add(name, "counter", help_text, fields[fname], labels)
        if _is_number(fields.get("tokens_total")):
            add("rollpool_worker_tokens_total", "counter", "Tokens generated by a worker since it started.", fields["tokens_total"], labels)
        if wid in lags:
            add("rollpool_worker_version_lag", "gauge", "Versions a worker is behind the broker's version.", lags[wid], labels)
        if _is_number(fields.get("age_s")):
            add("rollpool_worker_age_seconds", "gauge", "Seconds since a worker last published its state.", fields["age_s"], labels)
        info = {k: fields.get(k, "") for k in ("host", "engine", "model", "state")}
        add("rollpool_worker_info", "gauge", "Worker identity and state (value 1).", 1, {**labels, **info})
    for kind, members in sorted(state.entities.items()):
        for eid, fields in sorted(members.items()):
            for fname, value in sorted(fields.items()):
                if _is_number(value) and fname not in _SKIP_FIELDS:
                    add(_metric_name(f"rollpool_{kind}_{fname}"), "gauge", f"{kind} field {fname}.", value, {kind: eid})
    for samples in families.values():
        for name, mtype, help_text, value, labels in samples:
            w.sample(name, mtype, help_text, value, labels)

    for hname, hist in sorted(state.histograms.items()):
        fam = _metric_name(f"rollpool_{hname}")
        help_text = f"Histogram of {hname} (staleness: versions between generation and consumption)."
        for bound, cumulative in hist.cumulative():
            w.sample(fam + "_bucket", "histogram", help_text, cumulative, {"le": format_bound(bound)}, family=fam)
        if not hist.buckets or not math.isinf(hist.buckets[-1][0]):
            w.sample(fam + "_bucket", "histogram", help_text, hist.count, {"le": "+Inf"}, family=fam)
        w.sample(fam + "_sum", "histogram", help_text, hist.sum, family=fam)
        w.sample(fam + "_count", "histogram", help_text, hist.count, family=fam)
    return "\n".join(w.lines) + "\n"


def render_down(pool: str) -> str:
    """The exposition text when Redis cannot be read."""
    w = _Writer(pool)
    w.sample("rollpool_up", "gauge", "1 when the exporter could read the pool's Redis keys.", 0)
    return "\n".join(w.lines) + "\n"
