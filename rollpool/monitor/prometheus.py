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
    "broker_stall_ms_max": ("rollpool_broker_stall_max_seconds", "Longest broker stall seen."),
    "version_epoch": ("rollpool_version_epoch", "The pool's version epoch (moves on at each rebase; 0: never rebased)."),
    "convergence_last_s": ("rollpool_version_convergence_last_seconds", "Seconds from publish until every live worker served the last converged version."),
    "convergence_p50_s": ("rollpool_version_convergence_p50_seconds", "Median version convergence time over the recent versions."),
    "convergence_p95_s": ("rollpool_version_convergence_p95_seconds", "95th percentile version convergence time over the recent versions."),
    "convergence_open": ("rollpool_versions_converging", "Published versions not yet served by every live worker."),
    "replay_bytes": ("rollpool_replay_bytes", "Bytes of finished episode turns the broker keeps to serve back to a re-run group."),
    "tokens_regenerated_per_worker_lost": ("rollpool_tokens_regenerated_per_worker_lost",
                                           "Tokens of finished episode turns sampled again, per worker declared dead."),
    "fleet_version": ("rollpool_fleet_version", "Fleet activation: the newest version every worker was told to switch to."),
    "fleet_held_out": ("rollpool_fleet_held_out_workers", "Fleet activation: workers below the fleet's version, given no work until they serve it."),
    "fleet_activation_skew_p95_ms": ("rollpool_fleet_activation_skew_p95_seconds", "Fleet activation: 95th percentile of last switch minus first."),
    "fleet_activation_skew_last_ms": ("rollpool_fleet_activation_skew_last_seconds", "Fleet activation: the last round's last switch minus first."),
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
    # reconciliation: what the broker repaired after lost messages and stalls
    "results_resent": ("rollpool_results_resent_total", "Result groups sent to a client again, unacknowledged after result_resend_s."),
    "leases_reconciled": ("rollpool_leases_reconciled_total", "Leases requeued because the worker's heartbeat did not hold them (a lost Task or Result)."),
    "credit_corrections": ("rollpool_credit_corrections_total", "Times a worker's credit was reset from the free capacity its heartbeat reported."),
    "broker_stalls": ("rollpool_broker_stalls_total", "Times the broker read nothing for longer than its tick (GC, SIGSTOP, slow disk)."),
    "broker_stall_ms_total": ("rollpool_broker_stall_seconds_total", "Seconds the broker spent stalled, summed."),
    "versions_failed": ("rollpool_versions_failed_total", "Weight versions a worker could not apply (reported and skipped)."),
    "apply_slots_expired": ("rollpool_apply_slots_expired_total", "Apply slots freed at apply_slot_deadline_s (a hung apply)."),
    "grants_resent": ("rollpool_apply_grants_resent_total", "Apply grants sent again to a worker that asked again."),
    "rebases": ("rollpool_rebases_total", "Times the trainer rebased the pool's version (a checkpoint resume)."),
    # wasted work: generated tokens that never reach training
    "generated_tokens": ("rollpool_generated_tokens_total", "Tokens generated by workers and seen by the broker (results, and aborts of cancelled tasks)."),
    "doomed_cancelled": ("rollpool_doomed_cancelled_total", "In-flight groups cancelled because they could no longer be consumed within the staleness bound."),
    "fresh_dispatched": ("rollpool_fresh_dispatched_total", "Groups dispatched from capacity held for workers on the newest version."),
    "fresh_holds_expired": ("rollpool_fresh_holds_expired_total", "Version-aware dispatch holds that ran out (the rest went to workers behind)."),
    # the replay of redelivered episodes
    "tokens_regenerated": ("rollpool_tokens_regenerated_total", "Tokens of episode turns an earlier attempt had finished, sampled again by a "
                                                               "re-run (its request differed from the record, or replay is off)."),
    "replay_turns_kept": ("rollpool_replay_turns_kept_total", "Finished episode turns the broker kept for a re-run of their group."),
    "replay_turns_sent": ("rollpool_replay_turns_sent_total", "Kept episode turns sent with a re-run of their group."),
    "replay_turns_refused": ("rollpool_replay_turns_refused_total", "Episode turns not kept (past the replay bounds, or after one not kept)."),
    # the versioned-service contract
    "versions_converged": ("rollpool_versions_converged_total", "Published versions every live worker came to serve."),
    "exact_rejected": ("rollpool_exact_version_rejected_total", "Prompts refused at submit: their exact weight version could not be served."),
    "exact_failed": ("rollpool_exact_version_failed_total", "Exact-version groups failed at once: no live worker held or could reach their version."),
    "exact_off_version": ("rollpool_exact_version_off_results_total", "Exact-version results served partly at another version (handed back)."),
    # named policies (Prompt.policy, a LoRA adapter's name)
    "policy_rejected": ("rollpool_policy_rejected_total", "Prompts refused at submit: the policy (adapter) they name is not served."),
    "policy_failed": ("rollpool_policy_failed_total", "Named-policy groups failed: their adapter stopped being served, or every worker gave it up."),
    "policy_off": ("rollpool_policy_off_results_total", "Named-policy results with a token of another policy (handed back)."),
    "fleet_activations": ("rollpool_fleet_activations_total", "Fleet activations (every staged worker told to switch together)."),
    "fleet_holdouts": ("rollpool_fleet_holdouts_total", "Workers held out at a fleet activation's deadline (not staged in time)."),
}
BROKER_SCALED: dict[str, float] = {"broker_stall_ms_total": 1e-3, "broker_stall_ms_max": 1e-3,
                                   "fleet_activation_skew_p95_ms": 1e-3, "fleet_activation_skew_last_ms": 1e-3}
"""Broker fields kept in milliseconds, exported in seconds."""
WASTE_REASONS = ("stale_drop", "cancel", "failure", "duplicate")
"""`rollpool_wasted_tokens_total{reason=...}` and `rollpool_wasted_share{reason=...}`: generated tokens that never reach training, by reason."""
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
    wasted = {f"wasted_tokens_{r}" for r in WASTE_REASONS} | {f"wasted_share_{r}" for r in WASTE_REASONS} | {"wasted_share"}
    for reason in WASTE_REASONS:
        if _is_number(broker.get(f"wasted_tokens_{reason}")):
            w.sample("rollpool_wasted_tokens_total", "counter", "Generated tokens never delivered to training, by reason.",
                     broker[f"wasted_tokens_{reason}"], {"reason": reason})
    for reason in WASTE_REASONS:
        if _is_number(broker.get(f"wasted_share_{reason}")):
            w.sample("rollpool_wasted_share", "gauge", "Share of generated tokens never delivered to training, by reason (all: every reason).",
                     broker[f"wasted_share_{reason}"], {"reason": reason})
    if _is_number(broker.get("wasted_share")):
        w.sample("rollpool_wasted_share", "gauge", "Share of generated tokens never delivered to training, by reason (all: every reason).",
                 broker["wasted_share"], {"reason": "all"})
    for fname, value in sorted(broker.items()):
        if not _is_number(value) or fname in _SKIP_FIELDS or fname in wasted:
            continue
        value = value * BROKER_SCALED.get(fname, 1)
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
        for lane in ("network", "bulk", "early", "shm", "ipc"):
            if _is_number(fields.get(f"weights_{lane}_bytes")):
                add("rollpool_worker_weight_bytes_total", "counter", "Weight bytes a worker received, by lane (network: the whole network "
                    "path, the bulk lane's bytes included; early: of the bulk lane's, those before their bucket's checksum).",
                    fields[f"weights_{lane}_bytes"], {**labels, "lane": lane})
        for enc in ("full", "whole", "gaps", "sparse"):
            if _is_number(fields.get(f"weights_wire_{enc}_bytes")):
                add("rollpool_worker_weight_version_wire_bytes", "gauge", "Bytes a worker's last weight version took on the wire, by "
                    "encoding (full: the version whole; whole, gaps, sparse: a delta's buckets).", fields[f"weights_wire_{enc}_bytes"],
                    {**labels, "encoding": enc})
        for fname, name, help_text in (
            ("weights_wire_changed_fraction", "rollpool_worker_weight_version_changed_fraction", "Fraction of the elements a worker's "
             "last weight version carried as changed (1 for a full version; a delta's whole buckets count whole)."),
            ("weights_wire_version", "rollpool_worker_weight_wire_version", "The weight version the wire gauges are of."),
        ):
            if _is_number(fields.get(fname)):
                add(name, "gauge", help_text, fields[fname], labels)
        for fname, name, help_text in (
            ("weights_delta_versions", "rollpool_worker_weight_delta_versions_total", "Weight versions a worker rebuilt from a delta."),
            ("weights_delta_fallbacks", "rollpool_worker_weight_delta_fallbacks_total", "Delta weight versions a worker could not "
             "rebuild (fetched whole instead)."),
            ("weights_fallbacks", "rollpool_worker_weight_fallbacks_total", "Weight versions a worker fetched on a slower path than it asked for."),
            ("weights_refetched", "rollpool_worker_weight_buckets_refetched_total", "Weight buckets a worker fetched again (checksum failures)."),
            ("held_lists_sent", "rollpool_worker_held_lists_total", "Whole held lists a worker sent because its held digest disagreed."),
        ):
            if _is_number(fields.get(fname)):
                add(name, "counter", help_text, fields[fname], labels)
        if _is_number(fields.get("tokens_total")):
            add("rollpool_worker_tokens_total", "counter", "Tokens generated by a worker since it started.", fields["tokens_total"], labels)
        for fname, value in sorted(fields.items()):
            if fname.startswith("refused.limit.") and _is_number(value):
                add("rollpool_worker_refused_total", "counter", "Messages a worker refused to send, by the broker's limit they were over.",
                    value, {**labels, "limit": fname[len("refused.limit."):]})
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
