"""`rollpool demo --task tool` end to end, short: real broker, real workers running the openai SDK agent
through their episode endpoints, the real trainer. What a user relies on: nothing lost or duplicated,
the tool-call share rises from about 0, and the trajectories the trainer got carry the tool's tokens
with loss mask 0 (one segment per episode: the agent sends its history back unchanged)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.integration.demo.test_demo import _procs_with

pytest.importorskip("openai")
pytest.importorskip("aiohttp")
pytest.importorskip("transformers")


@pytest.mark.slow
def test_a_short_tool_demo_learns_to_call_and_masks_the_tool_s_tokens(tmp_path: Path) -> None:
    pool = f"demo-tool-ci-{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-m", "rollpool.demo", "--task", "tool", "--log-level", "WARNING", "--pool", pool,
           "--out", str(tmp_path / "out"), "--json", str(tmp_path / "summary.json"), "--steps", "30",
           "--prompts-per-step", "4", "--eval-prompts", "48", "--quiet"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("reward_first", "reward_final", "wall_s", "lost", "duplicated", "tool_call_share_first", "tool_call_share_final"):
        assert key in summary
    assert summary["lost"] == 0 and summary["duplicated"] == 0
    # a random model calls the tool about 1 time in 22; 30 steps of GRPO make it the usual first move
    shown = json.dumps(summary) + "\n" + out.stderr[-4000:]  # a CI run once ended with share 0.0: keep what the demo said
    assert summary["tool_call_share_first"] <= 0.2, shown
    assert summary["tool_call_share_final"] >= 0.5 and summary["tool_call_share_final"] > summary["tool_call_share_first"], shown

    report = json.loads((tmp_path / "out" / "demo-report-tool.json").read_text())  # beside the first demo's, not over it
    assert not (tmp_path / "out" / "demo-report.json").exists()
    examples = report["examples"]
    assert examples and any(e["metadata"]["called"] for e in examples)
    for e in examples:
        assert e["input"] == ["<s>", e["metadata"]["key"], "<sep>"]
        assert e["trajectory_id"].count(":") == 1  # segment 0 of its episode, and the only one
        assert len(e["loss_mask"]) == len(e["output"]) == len(e["token_versions"])
        if e["metadata"]["called"]:
            # <call> ARG | </s> <obs> SECRET (the template's end of turn and the tool's answer) | ANSWER
            assert e["output"][0] == "<call>" and e["output"][2:5] == ["</s>", "<obs>", e["metadata"]["secret"]]
            assert e["loss_mask"] == [1, 1, 0, 0, 0, 1]
            assert e["metadata"]["correct"] == (e["output"][5] == e["metadata"]["secret"])
        else:  # no call: the tool never ran, nothing was inserted (every token is the model's own; the model itself
            # may sample the token <obs>, as a CI run saw once: ['<obs>', '<call>'], so its absence proves nothing)
            pairs = list(zip(e["output"], e["output"][1:], strict=False))
            assert ("</s>", "<obs>") not in pairs and set(e["loss_mask"]) == {1}
        assert e["reward"] == (1.0 if e["metadata"]["correct"] else 0.3 if e["metadata"]["called"] else 0.0)
    assert _procs_with(pool) == []
