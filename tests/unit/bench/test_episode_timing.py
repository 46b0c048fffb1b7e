"""bench/episodes.py's ramp and tail of a phase (`turn_timing`, the keys bench/gpu_episodes.py reports) and
bench/gpu_episodes.py's count of SGLang's prefill passes from its log (`SchedulerLog`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.episodes import turn_timing
from bench.gpu_episodes import SchedulerLog


def test_ramp_tail_and_waves_from_the_agents_turns() -> None:
    t0 = 100.0
    episodes = {  # two groups; one episode's record gives its turn's length instead of its start (the GPU agent's "s")
        ("g0", 0): [{"turn": 0, "start": 100.01, "end": 100.51}, {"turn": 1, "start": 100.51, "end": 101.01}],
        ("g0", 1): [{"turn": 0, "start": 100.05, "end": 100.55}, {"turn": 1, "s": 0.5, "end": 101.05}],
        ("g1", 0): [{"turn": 0, "start": 100.30, "end": 100.80}, {"turn": 1, "start": 100.80, "end": 101.40}],
    }
    out = turn_timing(episodes, t0, wall_s=1.5, delivered={"g0": 101.10, "g1": 101.43})
    assert out["first_turn_start_s"] == {"min": 0.01, "median": 0.05, "max": 0.3}
    assert out["delivery_after_last_turn_s"] == {"median": 0.04, "max": 0.05}  # g0: 101.10 - 101.05, g1: 101.43 - 101.40
    assert out["last_turn_end_s"] == 1.4 and out["tail_s"] == 0.1
    assert out["running_per_100ms"][:4] == [2, 2, 3, 3]  # g1's episode starts at 0.3 s
    assert out["waves"] == [[0.01, 0.3, 0.51, 0.8], [0.51, 0.8, 1.01, 1.4]]
    assert out["turn_s"] == {"median": 0.5, "max": 0.6}
    assert "delivery_after_last_turn_s" not in turn_timing(episodes, t0, wall_s=1.5)  # the in-process peer delivers nothing
    assert turn_timing({}, t0, wall_s=1.0) == {}
    assert "context_tokens" not in out  # no record says its prompt's length
    for recs, sizes in zip(episodes.values(), ([100, 300], [100, 260], [120, 330]), strict=True):
        for r, n in zip(recs, sizes, strict=True):
            r["prompt_tokens"] = n
    sized = turn_timing(episodes, t0, wall_s=1.5)
    assert sized["context_tokens"] == {"sum": 1210, "last_turn_mean": 296.7}


def test_scheduler_log_counts_only_the_phase_s_prefill_passes(tmp_path: Path) -> None:
    log = tmp_path / "sglang-1.log"
    log.write_text("[t] Prefill batch, #new-seq: 8, #new-token: 80, #cached-token: 0, token usage: 0.00\n")  # before the phase
    window = SchedulerLog([log, tmp_path / "absent.log"])
    with log.open("a") as fh:
        fh.write("[t] Prefill batch, #new-seq: 3, #new-token: 30, #cached-token: 900, token usage: 0.01, #running-req: 0\n"
                 "[t] Decode batch, #running-req: 3, token usage: 0.01, gen throughput (token/s): 10\n"
                 "[t] Prefill batch [7], #new-seq: 1, #new-token: 12, #cached-token: 300, token usage: 0.01\n")
    assert window.read() == {"prefill_batches": 2, "prefill_seqs": 4, "seqs_per_prefill": 2.0, "prefill_new_tokens": 42,
                             "decode_log_lines": 1}


def test_the_token_history_peer_runs_the_ids_the_text_history_renders_when_a_reply_round_trips(tmp_path: Path) -> None:
    """`--peer-history tokens`: the last prompt's ids + the reply's ids + `rest_after_reply` are the ids the template
    renders for the whole conversation, for a reply whose text tokenizes back to its ids."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from bench.gpu_episodes import rest_after_reply
    from rollpool.workers.engines.tiny_model import build_tiny_model

    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "m", vocab=320, hidden=32, layers=2, heads=4, kv_heads=2))
    messages = [{"role": "system", "content": "You are a careful agent."}, {"role": "user", "content": "Task 1: alpha beta"}]
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    reply = tok.encode("gamma delta omega", add_special_tokens=False)
    messages += [{"role": "assistant", "content": tok.decode(reply)}, {"role": "user", "content": "observation 0: zeta"}]
    whole = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    assert ids + reply + rest_after_reply(tok, messages) == whole
