"""One frame of ``rollpool top`` as text (pure, no I/O).

`render_frame` lays out a `PoolState` in at most `width` columns: a header, the
broker's counters, its reconciliation counters (results re-sent, leases
reconciled, credit corrections, broker stalls with their length, failed versions
with the last error, rebases), the refusals by limit and by role (the broker's, and what workers
refused to send; when there were any), a
table of alive workers (with each one's version lag), the staleness histogram as
bars, and the most recent events. With ``color=True`` it
adds plain ANSI SGR codes (bold headers, red for lagging or stale entries).
"""

from __future__ import annotations

import time
from typing import Any

from rollpool.monitor.keys import format_bound
from rollpool.monitor.reader import PoolState

__all__ = ["render_frame"]

_BROKER_ORDER = (
    ("version", "version"),
    ("queued", "queued"),
    ("leased", "leased"),
    ("held", "held"),
    ("dispatched", "dispatched"),
    ("completed", "completed"),
    ("requeued", "requeued"),
    ("duplicates", "dup"),
    ("failed", "failed"),
    ("dropped_stale", "stale"),
    ("workers_alive", "workers"),
)
# (header, width, drop order: columns with the highest number go first on a narrow terminal)
_WORKER_COLUMNS = (
    ("WORKER", 18, 0),
    ("HOST", 12, 4),
    ("ENGINE", 8, 3),
    ("STATE", 10, 0),
    ("VER", 5, 0),
    ("LAG", 4, 0),
    ("INFL", 5, 1),
    ("CRED", 5, 2),
    ("TOK/S", 9, 0),
    ("TOKENS", 11, 1),
    ("SEEN", 6, 0),
)


_WEIGHT_LANES = (("bulk_bytes", "bulk lane"), ("early_bytes", "before checksum"), ("network_bytes", "network"), ("shm_bytes", "shm"),
                 ("ipc_bytes", "cuda ipc"))
"""A worker's weight bytes by lane (`weights_*` in its state); ``network`` counts the bulk lane's bytes too, ``before
checksum`` those of the bulk lane's that came before their bucket's checksum (minor 30)."""


def _fmt_bytes(v: object) -> str:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if v >= size:
            return f"{v / size:.1f} {unit}"
    return f"{int(v)} B"


_WIRE_ENCODINGS = ("full", "whole", "gaps", "sparse")
"""Encodings a version's bytes travel in (`weights_wire_<encoding>_bytes`): ``full`` a version sent whole, the others a
delta's buckets (rollpool.weights.delta)."""


def _wire_parts(f: dict[str, object]) -> list[str]:
    """The last version's bytes on the wire by encoding, over its size, and the fraction of elements it carried changed."""
    version, wire, model = f.get("weights_wire_version"), f.get("weights_wire_bytes"), f.get("weights_wire_model_bytes")
    if not isinstance(version, int) or not isinstance(wire, int):
        return []
    by = [f"{enc} {_fmt_bytes(f.get(f'weights_wire_{enc}_bytes'))}" for enc in _WIRE_ENCODINGS if f.get(f"weights_wire_{enc}_bytes")]
    out = [f"v{version} wire {_fmt_bytes(wire)}" + (f" of {_fmt_bytes(model)}" if isinstance(model, int) and model != wire else "")
           + (f" ({', '.join(by)})" if by else "")]
    changed = f.get("weights_wire_changed_fraction")
    if isinstance(changed, (int, float)) and not f.get("weights_wire_full_bytes"):
        out.append(f"changed {100 * changed:.2f}%")
    if f.get("weights_delta_versions"):
        out.append(f"deltas {_fmt(f.get('weights_delta_versions'))}")
    return out


def _weight_lines(state: PoolState, width: int, bold: str, red: str, reset: str) -> list[str]:
    """WEIGHTS: how each worker's last weight version arrived, its bytes by lane since it started, its fallbacks (the
    row in red when there were any) and refetched buckets; nothing before any worker fetched a version."""
    weighted = {wid: f for wid, f in sorted(state.workers.items()) if f.get("weights_last_path")}
    if not weighted:
        return []
    lines = [bold + "WEIGHTS" + reset]
    for wid, f in weighted.items():
        parts = [f"path {f['weights_last_path']}"]
        parts += [f"{label} {_fmt_bytes(f.get('weights_' + name))}" for name, label in _WEIGHT_LANES if f.get("weights_" + name)]
        parts += [f"{name} {_fmt(f.get('weights_' + name))}" for name in ("fallbacks", "refetched") if f.get("weights_" + name)]
        parts += _wire_parts(f)
        if f.get("weights_fallbacks") and f.get("weights_last_fallback"):
            parts.append(f"why: {f['weights_last_fallback']}")  # the faster path not taken, and why
        row = _cut("  " + wid + "  " + "  ".join(parts), width)
        lines.append(red + row + reset if f.get("weights_fallbacks") else row)
    return [*lines, ""]


_EPISODE_ORDER = (
    ("in_flight", "in flight"),
    ("finished", "done"),
    ("failed", "failed"),
    ("timed_out", "timed out"),
    ("turns", "turns"),
    ("tool_calls", "tool calls"),
    ("segments", "segments"),
    ("reused_prefix_share", "cached-prefix share"),
)

def _columns_for(width: int) -> list[int]:
    """Indexes of the worker columns that fit in `width` (dropping the least useful first)."""
    keep = list(range(len(_WORKER_COLUMNS)))
    for level in (4, 3, 2, 1):
        if 2 + sum(_WORKER_COLUMNS[i][1] + 1 for i in keep) <= width:
            break
        keep = [i for i in keep if _WORKER_COLUMNS[i][2] != level]
    return keep


def _fmt(value: Any, decimals: int = 0) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, float) and decimals:
        return f"{value:.{decimals}f}"
    if isinstance(value, float):
        return f"{value:.0f}"
    return str(value)


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 1)] + "~"


def render_frame(state: PoolState, *, width: int = 100, color: bool = False, events: int = 10, title: str = "top") -> str:
    """One frame as text; ``title`` names the command in its first line (``top``, ``status``)."""
    bold = "\x1b[1m" if color else ""
    red = "\x1b[31m" if color else ""
    reset = "\x1b[0m" if color else ""
    lines: list[str] = []
    clock = time.strftime("%H:%M:%S", time.localtime(state.time))
    broker = state.broker
    header = f"rollpool {title}  pool {state.pool}  {clock}"
    if broker:
        header += f"  broker epoch {broker.get('epoch', '?')}  updated {_fmt(broker.get('age_s'), 1)} s ago"
    else:
        header += "  (no broker state)"
    lines.append(bold + _cut(header, width) + reset)
    lines.append("")

    lines.append(bold + "BROKER" + reset)
    if broker:
        parts = [f"{label} {_fmt_version(broker.get(name)) if name == 'version' else _fmt(broker.get(name))}"
                 for name, label in _BROKER_ORDER if name in broker]
        row = "  "
        for part in parts:
            if len(row) + len(part) + 2 > width:
                lines.append(row.rstrip())
                row = "  "
            row += part + "  "
        lines.append(row.rstrip())
        lines.extend(_disconnect_line(broker, width))
    else:
        lines.append("  -")
    lines.append("")
    lines.extend(_reconcile_lines(state, width, bold, red, reset))
    lines.extend(_refusal_lines(broker or {}, state.workers, width, bold, red, reset))
    lines.extend(_wasted_lines(broker or {}, width, bold, reset))
    lines.extend(_version_lines(broker or {}, width, bold, red, reset))

    lags = state.worker_version_lag()
    lines.append(bold + f"WORKERS ({len(state.workers)} alive)" + reset)
    shown = _columns_for(width)
    lines.append(_cut("  " + " ".join(_WORKER_COLUMNS[i][0].ljust(_WORKER_COLUMNS[i][1]) for i in shown).rstrip(), width))
    for wid, f in sorted(state.workers.items()):
        lag = lags.get(wid)
        cells = (
            wid,
            _fmt(f.get("host")),
            _fmt(f.get("engine")),
            _fmt(f.get("state")),
            _fmt_version(f.get("weight_version")),
            _fmt(lag),
            _fmt(f.get("inflight")),
            _fmt(f.get("credits")),
            _fmt(f.get("tokens_per_s"), 1),
            _fmt(f.get("tokens_total")),
            _fmt(f.get("age_s"), 1),
        )
        row = "  " + " ".join(_cut(cells[i], _WORKER_COLUMNS[i][1]).ljust(_WORKER_COLUMNS[i][1]) for i in shown)
        row = _cut(row.rstrip(), width)
        lines.append(red + row + reset if lag is not None and lag > 0 else row)
    if not state.workers:
        lines.append("  (none alive)")
    lines.append("")

    episodic = {wid: f for wid, f in sorted(state.workers.items()) if "episodes_in_flight" in f}
    if episodic:  # workers that run episode functions (--episode): the runner's stats
        lines.append(bold + "EPISODES" + reset)
        for wid, f in episodic.items():
            parts = [f"{label} {_fmt(f.get('episodes_' + name), 2 if name.endswith('share') else 0)}" for name, label in _EPISODE_ORDER]
            lines.append(_cut("  " + wid + "  " + "  ".join(parts), width))
        lines.append("")

    lines.extend(_weight_lines(state, width, bold, red, reset))

    hist = state.histograms.get("staleness")
    if hist is not None and hist.count:
        lines.append(bold + f"STALENESS AT CONSUMPTION (n={hist.count}, mean {hist.sum / hist.count:.2f})" + reset)
        top = max(n for _, n in hist.buckets) or 1
        bar_width = max(10, min(50, width - 24))
        for bound, n in [(b, n) for b, n in hist.buckets if n]:
            bar = "#" * max(1, round(bar_width * n / top))
            label = "<=" + format_bound(bound) if bound != float("inf") else ">" + format_bound(_prev(hist.buckets, bound))
            lines.append(_cut(f"  {label:>6} {bar} {n}", width))
    else:
        lines.append(bold + "STALENESS AT CONSUMPTION" + reset)
        lines.append("  (no samples)")
    lines.append("")

    recent = state.events[-events:] if events > 0 else []
    lines.append(bold + f"EVENTS (last {len(recent)})" + reset)
    for ev in reversed(recent):
        when = time.strftime("%H:%M:%S", time.localtime(ev.ts))
        detail = " ".join(f"{k}={v}" for k, v in ev.fields.items())
        row = _cut(f"  {when} {ev.kind:<18} {ev.src:<14} {detail}".rstrip(), width)
        lines.append(red + row + reset if "error" in ev.kind or "lost" in ev.kind or "failed" in ev.kind else row)
    if not recent:
        lines.append("  (none)")
    return "\n".join(lines) + "\n"


def _reconcile_lines(state: PoolState, width: int, bold: str, red: str, reset: str) -> list[str]:
    """RECONCILIATION: what the broker repaired, how long it stalled, which versions failed."""
    broker = state.broker or {}
    if "leases_reconciled" not in broker and "results_resent" not in broker:
        return []  # a broker from before these counters
    stall = f"{_fmt(broker.get('broker_stalls', 0))}"
    if broker.get("broker_stalls"):
        stall += f" ({_fmt(broker.get('broker_stall_ms_total', 0) / 1000, 1)} s, longest {_fmt(broker.get('broker_stall_ms_max', 0) / 1000, 1)} s)"
    parts = [
        f"results re-sent {_fmt(broker.get('results_resent', 0))}",
        f"leases reconciled {_fmt(broker.get('leases_reconciled', 0))}",
        f"credit corrections {_fmt(broker.get('credit_corrections', 0))}",
        f"broker stalls {stall}",
        f"versions failed {_fmt(broker.get('versions_failed', 0))}",
        f"apply slots expired {_fmt(broker.get('apply_slots_expired', 0))}",
        f"rebases {_fmt(broker.get('rebases', 0))}",
    ]
    rows: list[str] = []
    row = "  "
    for part in parts:
        if len(row) + len(part) + 2 > width and row.strip():
            rows.append(_cut(row.rstrip(), width))
            row = "  "
        row += part + "  "
    rows.append(_cut(row.rstrip(), width))
    failed = [ev for ev in state.events if ev.kind == "version_failed"]
    if failed:
        f = failed[-1].fields
        rows.append(red + _cut(f"  last failed version {f.get('version', '?')} on {f.get('worker_id', '?')}: {f.get('error', '')}", width) + reset)
    return [bold + "RECONCILIATION" + reset, *rows, ""]


def _version_lines(broker: dict[str, Any], width: int, bold: str, red: str, reset: str) -> list[str]:
    """VERSIONS: how long each published weight version took to reach every live worker (convergence), the slowest
    worker of the last one, the versions still converging, and under fleet activation the switch skew and hold-outs."""
    if "convergence_versions" not in broker:
        return []  # a broker from before the versioned-service contract
    parts = [f"converged {_fmt(broker.get('convergence_versions', 0))}"]
    if broker.get("convergence_versions"):
        parts.append(f"last v{_fmt(broker.get('convergence_last_version'))} in {_fmt(broker.get('convergence_last_s'), 3)} s "
                     f"(slowest {broker.get('convergence_slowest_worker') or '-'})")
        parts.append(f"p50 {_fmt(broker.get('convergence_p50_s'), 3)} s  p95 {_fmt(broker.get('convergence_p95_s'), 3)} s")
    parts.append(f"converging {_fmt(broker.get('convergence_open', 0))}")
    rows = [_cut("  " + "  ".join(parts), width)]
    if broker.get("activation") == "fleet":
        held = broker.get("fleet_held_out", 0)
        row = _cut(f"  fleet v{_fmt(broker.get('fleet_version'))}  activations {_fmt(broker.get('fleet_activations', 0))}  "
                   f"skew p95 {_fmt(broker.get('fleet_activation_skew_p95_ms'), 1)} ms  held out {_fmt(held)} "
                   f"(at deadlines {_fmt(broker.get('fleet_holdouts', 0))})", width)
        rows.append(red + row + reset if held else row)
    versions = broker.get("versions")
    for v in versions.get("converging", [])[-2:] if isinstance(versions, dict) else []:
        waiting = ", ".join(v.get("waiting_for", [])[:4])
        rows.append(_cut(f"  v{v.get('version')}: {v.get('workers_at')}/{v.get('workers')} workers serve it; waiting for {waiting}", width))
    return [bold + "VERSIONS" + reset, *rows, ""]


_WASTE_REASONS = (("stale_drop", "stale drop"), ("cancel", "cancel"), ("failure", "failure"), ("duplicate", "duplicate"))


def _wasted_lines(broker: dict[str, Any], width: int, bold: str, reset: str) -> list[str]:
    """WASTED: generated tokens never delivered to training, as a share of all generated, by reason."""
    generated = broker.get("generated_tokens")
    if not isinstance(generated, int | float) or generated <= 0:
        return []
    total = sum(broker.get(f"wasted_tokens_{r}", 0) or 0 for r, _ in _WASTE_REASONS)
    head = f"  {100 * total / generated:.1f}% of {_fmt(generated)} generated tokens"
    parts = [f"{label} {100 * (broker.get(f'wasted_tokens_{r}', 0) or 0) / generated:.1f}%" for r, label in _WASTE_REASONS]
    extra = [f"{label} {_fmt(broker.get(k))}" for k, label in (("doomed_cancelled", "doomed cancelled"),
                                                             ("fresh_dispatched", "fresh dispatches"),
                                                             ("fresh_holds_expired", "holds expired")) if k in broker]
    replay = []
    if broker.get("replay_turns_kept") or broker.get("tokens_regenerated"):
        replay = [_cut(f"  after worker loss: {_fmt(broker.get('tokens_regenerated', 0))} tokens sampled again "
                       f"({_fmt(broker.get('tokens_regenerated_per_worker_lost', 0))} per worker lost), "
                       f"{_fmt(broker.get('replay_turns_sent', 0))} turns served back", width)]
    return [bold + "WASTED (tokens never trained)" + reset, _cut(head + "  " + "  ".join(parts), width),
            *([_cut("  " + "  ".join(extra), width)] if extra else []), *replay, ""]


_REFUSAL_PREFIXES = (
    ("refused.limit.", "by limit"),
    ("refused.role.", "by role"),
    ("handshake_refused.", "handshakes refused"),
)


def _refusal_lines(broker: dict[str, Any], workers: dict[str, dict[str, Any]], width: int, bold: str, red: str,
                   reset: str) -> list[str]:
    """REFUSALS: the broker's ``refused.limit.*`` / ``refused.role.*`` / ``handshake_refused.*`` counters, and
    what the workers refused to send (``refused.limit.*`` in their states, summed over the alive workers).

    ``refused.role.worker@broker.client`` reads "a worker key refused on the client
    port". Disconnects are not refusals (a worker that stops disconnects): they are a
    line of the BROKER section (`_disconnect_line`).
    """
    rows: list[str] = []
    worker_sums: dict[str, Any] = {}
    for fields in workers.values():
        for k, v in fields.items():
            if k.startswith("refused.limit.") and isinstance(v, (int, float)) and not isinstance(v, bool):
                worker_sums[k] = worker_sums.get(k, 0) + v
    sources = [(prefix, label, broker) for prefix, label in _REFUSAL_PREFIXES]
    sources.insert(1, ("refused.limit.", "workers, by limit", worker_sums))
    for prefix, label, counters in sources:
        items = sorted((k[len(prefix):], v) for k, v in counters.items() if k.startswith(prefix))
        if not items:
            continue
        body = "  ".join(f"{name} {_fmt(v)}" for name, v in items)
        row = _cut(f"  {label:<19}{body}", width)
        rows.append(red + row + reset if prefix.startswith("refused") else row)
    if not rows:
        return []
    return [bold + "REFUSALS" + reset, *rows, ""]


def _disconnect_line(broker: dict[str, Any], width: int) -> list[str]:
    """The broker sockets' ``disconnects.SOCKET`` counters: peers that went away, and the connections libzmq
    dropped for a message over MAXMSGSIZE (it reports no reason, so the two cannot be told apart here)."""
    items = sorted((k[len("disconnects."):], v) for k, v in broker.items() if k.startswith("disconnects."))
    if not items:
        return []
    return [_cut("  disconnects  " + "  ".join(f"{name} {_fmt(v)}" for name, v in items), width)]


def _fmt_version(value: Any) -> str:
    """A weight version; -1 (nothing published or applied yet) reads "none"."""
    return "none" if isinstance(value, int) and not isinstance(value, bool) and value < 0 else _fmt(value)


def _prev(buckets: list[tuple[float, int]], bound: float) -> float:
    finite = [b for b, _ in buckets if b < bound]
    return finite[-1] if finite else 0.0
