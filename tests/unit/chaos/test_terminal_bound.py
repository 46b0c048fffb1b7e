"""The chaos run's terminal bound (every prompt terminal within a bound after a fault clears), on made-up timelines:
which (clear, prompt) pairs are checked, which a later fault supersedes, and what counts as over the bound."""

from __future__ import annotations

from rollpool.chaos.runner import ChaosConfig, _terminal_bound

CFG = ChaosConfig(heartbeat_interval_s=0.25, apply_slot_deadline_s=5.0)  # bound 6.25 s


def _faults(*spans: tuple[float, float]) -> list[dict[str, float]]:
    return [{"_t0": a, "_clear": c} for a, c in spans]


def test_a_prompt_open_at_a_clear_is_checked_against_the_formula_less_its_generation_time() -> None:
    b = _terminal_bound(CFG, _faults((10.0, 12.0)), {"p": 11.0, "late": 11.5, "after": 13.0},
                        {"p": 14.0, "late": 20.0, "after": 14.0}, {"p": 1.0, "late": 1.0})
    assert b["bound_s"] == 6.25 and b["checked"] == 2  # "after" was not open at the clear
    assert b["worst_prompt"] == "late" and b["worst_excess_s"] == 7.0  # 20 - 12 - 1
    assert b["over_bound"] == 1 and not b["within_bound"]


def test_a_later_fault_supersedes_the_clear_it_follows_and_a_prompt_never_terminal_is_over() -> None:
    b = _terminal_bound(CFG, _faults((10.0, 12.0), (13.0, 15.0)), {"p": 11.0, "gone": 11.0},
                        {"p": 17.0}, {"p": 0.5})
    # p: the second fault began before it ended, so the first clear is superseded; the second is checked (1.5 s)
    assert b["superseded"] == 2 and b["checked"] == 1 and b["worst_excess_s"] == 1.5
    assert b["over_bound"] == 0 and b["never_terminal"] == 1 and not b["within_bound"]  # "gone": its bound after 15.0 ran out


def test_no_clears_no_checks() -> None:
    b = _terminal_bound(CFG, [], {"p": 1.0}, {"p": 2.0}, {})
    assert b["checked"] == 0 and b["within_bound"]


def test_a_fault_the_run_ended_inside_still_supersedes_the_clear_before_it() -> None:
    # the run ended while a broker stop was under way (its record has a start, no clear): the prompt open across it
    # is not checked against the earlier clear (that would count the stop against a bound it has no part in)
    unfinished = {"_t0": 13.0, "unfinished": True}
    b = _terminal_bound(CFG, [*_faults((10.0, 12.0)), unfinished], {"p": 11.0}, {"p": 20.0}, {"p": 0.5})
    assert b["superseded"] == 1 and b["checked"] == 0 and b["over_bound"] == 0 and b["within_bound"]


def test_the_worst_cases_name_the_fault_whose_clear_they_are_checked_against() -> None:
    faults = [{"kind": "broker_stop", "at_s": 1.0, "_t0": 10.0, "_clear": 12.0}]
    b = _terminal_bound(CFG, faults, {"p": 11.0, "q": 11.5}, {"p": 20.0, "q": 13.0}, {"p": 1.0, "q": 0.5})
    assert [c["prompt"] for c in b["worst_cases"]] == ["p", "q"]
    assert b["worst_cases"][0] == {"prompt": "p", "after": "broker_stop (injected at 1.0 s)", "excess_s": 7.0,
                                   "generation_s": 1.0, "submitted_before_clear_s": 1.0}
