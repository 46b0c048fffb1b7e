"""Pure parts of monitoring: the key layout, value encoding, Prometheus text and the top frame."""

from __future__ import annotations

import math
import re

import pytest

from rollpool.monitor.keys import PoolKeys, bucket_for, decode_hash, encode_value
from rollpool.monitor.prometheus import render_down, render_prometheus
from rollpool.monitor.reader import EventRecord, HistogramState, PoolState
from rollpool.monitor.terminal import render_frame
from rollpool.protocol.errors import ConfigError
from tests.unit.monitor.promtext import parse_prometheus, sample_value


def _state() -> PoolState:
    return PoolState(
        pool="p1",
        time=1_700_000_000.0,
        broker={"epoch": "00ff12", "version": 7, "queued": 12, "leased": 4, "held": 1, "requeued": 3,
                "completed": 99, "workers_alive": 2, "custom_gauge": 1.5, "age_s": 0.4},
        workers={
            "w-1": {"host": "h1", "engine": "sim", "model": 'm"x', "state": "generating", "weight_version": 7,
                    "inflight": 8, "credits": 2, "tokens_total": 12345, "tokens_per_s": 812.5, "age_s": 0.2},
            "w-2": {"host": "h2", "engine": "sim", "state": "applying", "weight_version": 5, "tokens_per_s": 0.0},
        },
        entities={"relay": {"r1": {"subscribers": 4, "version": 7}}},
        events=[EventRecord(id="1-0", ts=1_700_000_000.0, kind="worker_lost", src="broker", fields={"worker": "w-3"})],
        histograms={"staleness": HistogramState(buckets=[(0, 5), (1, 3), (2, 0), (math.inf, 1)], count=9, sum=14.0)},
    )


def test_keys_follow_the_documented_layout() -> None:
    keys = PoolKeys("p1")
    assert keys.worker("w1") == "rollpool:p1:worker:w1"
    assert keys.state("broker", "anything") == keys.broker == "rollpool:p1:broker"
    assert keys.state("relay", "r1") == "rollpool:p1:relay:r1"
    assert keys.events == "rollpool:p1:events"
    assert keys.hist("staleness") == "rollpool:p1:hist:staleness"
    assert keys.series("broker:queued") == "rollpool:p1:series:broker:queued"
    with pytest.raises(ConfigError, match="pool"):
        PoolKeys("has space")
    assert not PoolKeys.valid_id("w*") and PoolKeys.valid_id("host-12:3")


def test_values_round_trip_and_string_fields_stay_text() -> None:
    raw = {k: encode_value(v) for k, v in {"epoch": "1234", "state": "idle", "n": 3, "x": 1.5, "ok": True, "none": None}.items()}
    assert raw["state"] == "idle" and raw["n"] == "3"
    assert decode_hash(raw) == {"epoch": "1234", "state": "idle", "n": 3, "x": 1.5, "ok": True, "none": None}


def test_bucket_for_picks_the_smallest_bound_at_or_above() -> None:
    bounds = (0, 1, 2, math.inf)
    assert [bucket_for(v, bounds) for v in (0, 0.5, 1, 2, 3, 1e9)] == ["le:0", "le:1", "le:1", "le:2", "le:+Inf", "le:+Inf"]


def test_prometheus_text_parses_and_carries_broker_and_worker_metrics() -> None:
    text = render_prometheus(_state())
    fams = parse_prometheus(text)
    assert sample_value(fams, "rollpool_queue_depth", pool="p1") == 12
    assert fams["rollpool_requeued_total"]["type"] == "counter"
    assert sample_value(fams, "rollpool_worker_tokens_per_second", worker="w-1") == 812.5
    assert sample_value(fams, "rollpool_worker_version_lag", worker="w-2") == 2
    assert sample_value(fams, "rollpool_version_lag") == 2
    assert sample_value(fams, "rollpool_workers_alive") == 2
    assert sample_value(fams, "rollpool_broker_custom_gauge") == 1.5
    assert sample_value(fams, "rollpool_relay_subscribers", relay="r1") == 4
    assert sample_value(fams, "rollpool_worker_info", worker="w-1", model='m"x') == 1
    assert sample_value(fams, "rollpool_staleness_bucket", le="1") == 8
    assert sample_value(fams, "rollpool_staleness_bucket", le="+Inf") == 9
    assert sample_value(fams, "rollpool_staleness_count") == 9
    assert sample_value(fams, "rollpool_up") == 1
    assert sample_value(parse_prometheus(render_down("p1")), "rollpool_up") == 0


def test_top_frame_shows_every_section_within_the_width() -> None:
    frame = render_frame(_state(), width=80)
    for text in ("pool p1", "BROKER", "queued 12", "WORKERS (2 alive)", "w-1", "812.5", "STALENESS", "worker_lost", "w-3"):
        assert text in frame, text
    assert all(len(line) <= 80 for line in frame.splitlines())
    assert "\x1b[" not in frame
    colored = render_frame(_state(), width=80, color=True)
    assert "\x1b[1m" in colored and re.sub(r"\x1b\[[0-9;]*m", "", colored) == frame


def test_top_frame_of_an_empty_pool() -> None:
    empty = PoolState(pool="p", time=0.0, broker=None, workers={}, entities={}, events=[], histograms={})
    frame = render_frame(empty)
    assert "no broker state" in frame and "(none alive)" in frame and "(no samples)" in frame


def test_top_shows_refusals_by_limit_and_by_role() -> None:
    state = _state()
    assert state.broker is not None
    state.broker.update({"refused.limit.pulls_per_peer": 2936, "refused.limit.max_header_objects": 3,
                         "refused.role.worker@broker.client": 5, "handshake_refused.broker.client": 1})
    frame = render_frame(state, width=100)
    assert "REFUSALS" in frame
    assert "pulls_per_peer 2936" in frame and "max_header_objects 3" in frame
    assert "worker@broker.client 5" in frame and "broker.client 1" in frame
    assert all(len(line) <= 100 for line in frame.splitlines())
    assert "REFUSALS" not in render_frame(_state(), width=100)  # nothing refused: no section
    fams = parse_prometheus(render_prometheus(state))  # the exporter keeps them as valid metric names
    assert any("refused_limit_pulls_per_peer" in name for name in fams)


def test_top_shows_what_workers_refused_to_send_by_limit_summed_over_workers() -> None:
    state = _state()
    state.workers["w-1"]["refused.limit.max_msg_bytes"] = 2
    state.workers["w-2"]["refused.limit.max_msg_bytes"] = 1
    state.workers["w-2"]["refused.limit.max_header_bytes"] = 4
    frame = render_frame(state, width=100)
    row = next(line for line in frame.splitlines() if "workers, by limit" in line)
    assert "max_msg_bytes 3" in row and "max_header_bytes 4" in row
    fams = parse_prometheus(render_prometheus(state))
    assert "rollpool_worker_refused_total" in fams or "rollpool_worker_refused" in fams, sorted(fams)


def test_top_shows_the_episode_stats_of_workers_that_run_episodes() -> None:
    state = _state()
    assert "EPISODES" not in render_frame(state, width=100)  # no worker runs episodes
    state.workers["w-1"].update({"episodes_in_flight": 3, "episodes_finished": 40, "episodes_failed": 1, "episodes_timed_out": 0,
                                 "episodes_turns": 120, "episodes_tool_calls": 77, "episodes_segments": 41,
                                 "episodes_reused_prefix_share": 0.9625})
    frame = render_frame(state, width=120)
    (line,) = [x for x in frame.splitlines() if x.startswith("  w-1  in flight")]
    assert "in flight 3" in line and "tool calls 77" in line and "segments 41" in line and "cached-prefix share 0.96" in line
    assert "EPISODES" in frame and not any(x.startswith("  w-2  in flight") for x in frame.splitlines())
    assert all(len(x) <= 80 for x in render_frame(state, width=80).splitlines())


def test_prometheus_carries_the_episode_stats() -> None:
    state = _state()
    state.workers["w-1"].update({"episodes_in_flight": 3, "episodes_tool_calls": 77, "episodes_reused_prefix_share": 0.5})
    fams = parse_prometheus(render_prometheus(state))
    assert sample_value(fams, "rollpool_worker_episodes_in_flight", worker="w-1") == 3
    assert sample_value(fams, "rollpool_worker_episode_tool_calls_total", worker="w-1") == 77
    assert fams["rollpool_worker_episode_tool_calls_total"]["type"] == "counter"
    assert sample_value(fams, "rollpool_worker_episode_reused_prefix_share", worker="w-1") == 0.5


def test_top_and_the_exporter_show_how_each_worker_s_weights_arrive() -> None:
    state = _state()
    assert "WEIGHTS" not in render_frame(state, width=100)  # no worker has fetched a version
    state.workers["w-1"].update({"weights_last_path": "network", "weights_network_bytes": 14_480_000_000,
                                 "weights_bulk_bytes": 14_480_000_000, "weights_early_bytes": 3_500_000_000, "weights_shm_bytes": 0,
                                 "weights_fallbacks": 0,
                                 "weights_refetched": 2, "held_lists_sent": 1})
    state.workers["w-2"].update({"weights_last_path": "network", "weights_network_bytes": 1_000_000, "weights_fallbacks": 1})
    frame = render_frame(state, width=120)
    (w1,) = [x for x in frame.splitlines() if x.startswith("  w-1  path")]
    assert "bulk lane 14.5 GB" in w1 and "network 14.5 GB" in w1 and "refetched 2" in w1 and "shm" not in w1
    assert "before checksum 3.5 GB" in w1  # of the bulk lane's bytes, those before their bucket's checksum (minor 30)
    (w2,) = [x for x in frame.splitlines() if x.startswith("  w-2  path")]
    assert "fallbacks 1" in w2
    colored = render_frame(state, width=120, color=True).splitlines()
    assert any(x.startswith("\x1b[31m  w-2  path") for x in colored)  # a worker that fell back is marked red
    assert not any(x.startswith("\x1b[31m  w-1  path") for x in colored)
    assert all(len(x) <= 80 for x in render_frame(state, width=80).splitlines())
    fams = parse_prometheus(render_prometheus(state))
    assert sample_value(fams, "rollpool_worker_weight_bytes_total", worker="w-1", lane="bulk") == 14_480_000_000
    assert sample_value(fams, "rollpool_worker_weight_bytes_total", worker="w-1", lane="early") == 3_500_000_000
    assert sample_value(fams, "rollpool_worker_weight_bytes_total", worker="w-2", lane="network") == 1_000_000
    assert sample_value(fams, "rollpool_worker_weight_fallbacks_total", worker="w-2") == 1
    assert sample_value(fams, "rollpool_worker_held_lists_total", worker="w-1") == 1
    assert fams["rollpool_worker_weight_bytes_total"]["type"] == "counter"


def test_top_and_the_exporter_show_a_version_s_bytes_on_the_wire_by_encoding_and_the_changed_fraction() -> None:
    state = _state()
    state.workers["w-1"].update({"weights_last_path": "network", "weights_network_bytes": 300_000_000, "weights_fallbacks": 0,
                                 "weights_wire_version": 7, "weights_wire_model_bytes": 268_435_456, "weights_wire_bytes": 11_534_336,
                                 "weights_wire_gaps_bytes": 11_000_000, "weights_wire_whole_bytes": 534_336, "weights_wire_sparse_bytes": 0,
                                 "weights_wire_unchanged_bytes": 0, "weights_wire_changed_fraction": 0.0215, "weights_delta_versions": 6,
                                 "weights_delta_fallbacks": 1})
    state.workers["w-2"].update({"weights_last_path": "network", "weights_network_bytes": 268_435_456, "weights_wire_version": 7,
                                 "weights_wire_model_bytes": 268_435_456, "weights_wire_bytes": 268_435_456,
                                 "weights_wire_full_bytes": 268_435_456, "weights_wire_changed_fraction": 1.0})
    frame = render_frame(state, width=200)
    (w1,) = [x for x in frame.splitlines() if x.startswith("  w-1  path")]
    assert "v7 wire 11.5 MB of 268.4 MB (whole 534.3 kB, gaps 11.0 MB)" in w1 and "changed 2.15%" in w1 and "deltas 6" in w1
    (w2,) = [x for x in frame.splitlines() if x.startswith("  w-2  path")]
    assert "v7 wire 268.4 MB (full 268.4 MB)" in w2 and "changed" not in w2  # a full version: no fraction to speak of
    fams = parse_prometheus(render_prometheus(state))
    assert sample_value(fams, "rollpool_worker_weight_version_wire_bytes", worker="w-1", encoding="gaps") == 11_000_000
    assert sample_value(fams, "rollpool_worker_weight_version_wire_bytes", worker="w-2", encoding="full") == 268_435_456
    assert sample_value(fams, "rollpool_worker_weight_version_changed_fraction", worker="w-1") == 0.0215
    assert sample_value(fams, "rollpool_worker_weight_delta_versions_total", worker="w-1") == 6
    assert sample_value(fams, "rollpool_worker_weight_delta_fallbacks_total", worker="w-1") == 1
    assert fams["rollpool_worker_weight_delta_versions_total"]["type"] == "counter"


def test_top_and_prometheus_show_the_reconciliation_counters_in_a_narrow_frame() -> None:
    state = _state()
    assert "RECONCILIATION" not in render_frame(state)  # a broker from before the counters: no section
    assert state.broker is not None
    state.broker.update({"results_resent": 4, "leases_reconciled": 2, "credit_corrections": 3, "broker_stalls": 1,
                         "broker_stall_ms_total": 4200, "broker_stall_ms_max": 4200, "versions_failed": 1, "rebases": 0})
    state.events.append(EventRecord(id="2-0", ts=1_700_000_001.0, kind="version_failed", src="broker",
                                    fields={"worker_id": "w-2", "version": 6, "error": "unknown parameter 'x'"}))
    frame = render_frame(state, width=60)
    for text in ("RECONCILIATION", "results re-sent 4", "leases reconciled 2", "credit corrections 3",
                 "broker stalls 1 (4.2 s, longest 4.2 s)", "versions failed 1", "last failed version 6 on w-2"):
        assert text in frame, (text, frame)
    assert all(len(line) <= 60 for line in frame.splitlines())
    fams = parse_prometheus(render_prometheus(state))
    assert sample_value(fams, "rollpool_broker_stall_seconds_total") == 4.2
    assert fams["rollpool_results_resent_total"]["type"] == "counter"
def test_top_and_the_exporter_show_the_wasted_tokens_by_reason() -> None:
    state = _state()
    assert "WASTED" not in render_frame(state, width=100)  # a broker that counts no generated tokens: no section
    assert state.broker is not None
    state.broker.update({"generated_tokens": 2000, "wasted_tokens_stale_drop": 100, "wasted_tokens_cancel": 300,
                         "wasted_tokens_failure": 0, "wasted_tokens_duplicate": 20, "wasted_share": 0.21, "wasted_share_stale_drop": 0.05,
                         "wasted_share_cancel": 0.15, "wasted_share_failure": 0.0, "wasted_share_duplicate": 0.01, "doomed_cancelled": 7})
    frame = render_frame(state, width=100)
    (line,) = [x for x in frame.splitlines() if "generated tokens" in x]
    assert "21.0% of 2000" in line and "stale drop 5.0%" in line and "cancel 15.0%" in line and "duplicate 1.0%" in line
    assert "doomed cancelled 7" in frame and all(len(x) <= 100 for x in frame.splitlines())
    fams = parse_prometheus(render_prometheus(state))
    assert sample_value(fams, "rollpool_wasted_tokens_total", reason="cancel") == 300
    assert fams["rollpool_wasted_tokens_total"]["type"] == "counter"
    assert sample_value(fams, "rollpool_wasted_share", reason="all") == 0.21
    assert sample_value(fams, "rollpool_wasted_share", reason="stale_drop") == 0.05
    assert sample_value(fams, "rollpool_generated_tokens_total") == 2000
    assert not any("broker_wasted" in name for name in fams)  # not repeated as untyped broker fields


def test_top_and_the_exporter_show_version_convergence_and_the_fleet_activation() -> None:
    state = _state()
    assert "VERSIONS" not in render_frame(state, width=100)  # a broker from before the contract: no section
    assert state.broker is not None
    state.broker.update({"convergence_versions": 4, "convergence_last_version": 7, "convergence_last_s": 0.25,
                         "convergence_slowest_worker": "w-2", "convergence_p50_s": 0.2, "convergence_p95_s": 0.3,
                         "convergence_open": 1, "activation": "fleet", "fleet_version": 7, "fleet_activations": 3,
                         "fleet_activation_skew_p95_ms": 12.5, "fleet_held_out": 1, "fleet_holdouts": 1,
                         "versions": {"converging": [{"version": 8, "workers_at": 1, "workers": 2, "waiting_for": ["w-2"]}]}})
    frame = render_frame(state, width=100)
    assert "last v7 in 0.250 s (slowest w-2)" in frame and "p95 0.300 s" in frame
    assert "skew p95 12.5 ms" in frame and "held out 1" in frame and "v8: 1/2 workers serve it; waiting for w-2" in frame
    assert all(len(x) <= 100 for x in frame.splitlines())
    fams = parse_prometheus(render_prometheus(state))
    assert sample_value(fams, "rollpool_version_convergence_p95_seconds") == 0.3
    assert sample_value(fams, "rollpool_fleet_activation_skew_p95_seconds") == 0.0125
    assert sample_value(fams, "rollpool_fleet_held_out_workers") == 1


def test_before_the_first_publish_versions_read_none_and_no_lag_is_shown() -> None:
    state = _state()
    assert state.broker is not None
    state.broker["version"] = -1  # nothing published yet
    for w in state.workers.values():
        w["weight_version"] = -1
    assert state.worker_version_lag() == {} and state.to_dict()["version_lag"] == {}
    frame = render_frame(state, width=100)
    assert "version none" in frame and not re.search(r"\s-1\b", frame)
    w1 = next(line for line in frame.splitlines() if line.startswith("  w-1"))
    assert " none " in w1
    state.broker["version"] = 3  # published; the workers have applied nothing yet: their lag is unknown, not 4
    assert state.worker_version_lag() == {}
    state.workers["w-1"]["weight_version"] = 2
    assert state.worker_version_lag() == {"w-1": 1}


def test_an_ordinary_disconnect_is_a_broker_line_not_a_refusal() -> None:
    state = _state()
    assert state.broker is not None
    state.broker["disconnects.broker.worker"] = 2  # two workers stopped
    frame = render_frame(state, width=100)
    assert "REFUSALS" not in frame
    assert "  disconnects  broker.worker 2" in frame.split("WORKERS")[0]


def test_the_frame_names_the_command_that_printed_it() -> None:
    assert render_frame(_state()).startswith("rollpool top  pool p1")
    assert render_frame(_state(), title="status").startswith("rollpool status  pool p1")


def test_top_and_the_exporter_show_the_tokens_sampled_again_after_a_worker_loss() -> None:
    state = _state()
    assert state.broker is not None
    state.broker.update({"generated_tokens": 2000, "tokens_regenerated": 96, "workers_lost": 2, "tokens_regenerated_per_worker_lost": 48.0,
                         "replay_turns_kept": 40, "replay_turns_sent": 30, "replay_bytes": 4096})
    frame = render_frame(state, width=100)
    assert "after worker loss: 96 tokens sampled again (48 per worker lost), 30 turns served back" in frame, frame
    fams = parse_prometheus(render_prometheus(state))
    assert sample_value(fams, "rollpool_tokens_regenerated_total") == 96
    assert fams["rollpool_tokens_regenerated_total"]["type"] == "counter"
    assert sample_value(fams, "rollpool_tokens_regenerated_per_worker_lost") == 48.0
    assert sample_value(fams, "rollpool_replay_bytes") == 4096
