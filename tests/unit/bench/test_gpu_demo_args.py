"""bench/gpu_demo.py's plan: run names, order, file names and the versions that keep a reused worker sound."""

from __future__ import annotations

import pytest

from bench import gpu_demo as gd


def test_runs_are_parsed_and_unknown_ones_refused() -> None:
    assert gd.parse_runs("sync, async1,async4") == ["sync", "async1", "async4"]
    with pytest.raises(ValueError, match="async3"):
        gd.parse_runs("sync,async3")


def test_runs_go_seed_by_seed_so_a_cut_short_call_keeps_whole_pairs() -> None:
    assert gd.run_order(["sync", "async2"], [0, 1]) == [("sync", 0), ("async2", 0), ("sync", 1), ("async2", 1)]


def test_each_run_starts_above_every_version_the_one_before_could_publish() -> None:
    first = 1
    for _ in range(3):
        nxt = gd.next_first_version(first, 300)
        assert nxt > first + 300  # a run publishes first .. first + steps
        first = nxt


def test_file_names_carry_the_card_mode_and_seed() -> None:
    assert gd.card_name("NVIDIA H100 80GB HBM3") == "h100"
    assert gd.card_name("NVIDIA H200") == "h200"
    assert gd.card_name("") == "cpu"
    assert gd.result_name("h100", "async2", 1) == "h100-demo-async2-s1.json"


def test_the_smoke_mode_is_a_cpu_run_of_the_hf_engine() -> None:
    args = gd.parse_args(["--smoke"])
    assert (args.engine, args.device, args.model_shape, args.run_list) == ("hf", "cpu", "tiny", ["sync", "async2"])
    cmd = gd.demo_command(args, "async2", 0, gd.Path("/m"), gd.Path("/o"), "tcp://127.0.0.1:1", 7)
    assert cmd[cmd.index("--max-staleness") + 1] == "2" and cmd[cmd.index("--first-version") + 1] == "7"
    assert "--sync" in gd.demo_command(args, "sync", 0, gd.Path("/m"), gd.Path("/o"), "tcp://127.0.0.1:1", 1)
