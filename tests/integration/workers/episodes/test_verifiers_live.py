"""verifiers' real token-in-token-out client (prime-rl's environments) against the episode endpoint.

verifiers lives in a venv of its own (its dependencies are not rollpool's test environment's); the agent runs
verifiers_rollout.py there as a subprocess, which only talks HTTP to the endpoint. The venv's python is
``ROLLPOOL_VERIFIERS_PYTHON`` (.ci/run makes it with verifiers_venv.sh); without it the test skips, saying so.
The engine is `ScriptedEngine`, a FAKE at the process edge (test_openai_endpoint.py); tokenizer, chat template,
endpoint, HTTP and the verifiers client are real.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import sys
from typing import Any

import pytest

from rollpool.protocol.messages import Prompt
from rollpool.workers import EpisodeContext
from tests.integration.workers.episodes.test_openai_endpoint import _run, _sampled

pytest.importorskip("aiohttp")

ROLLOUT = pathlib.Path(__file__).with_name("verifiers_rollout.py")
CALL = '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>'


def _verifiers_python() -> str:
    python = os.environ.get("ROLLPOOL_VERIFIERS_PYTHON", "")
    if not python or not pathlib.Path(python).exists():
        pytest.skip("no verifiers venv: set ROLLPOOL_VERIFIERS_PYTHON to the python of one made by "
                    "tests/integration/workers/episodes/verifiers_venv.sh (.ci/run makes it)")
    return python


async def test_verifiers_token_client_records_one_exact_segment(tiny_tokenizer: Any) -> None:
    """A tool call, the tool's answer, a user turn: verifiers stitches turns 2 and 3 from the token ids the endpoint
    returned (``/tokenize``, ``/chat/completions/tokens``, no fallback to messages), and the endpoint records them as
    one segment whose sampled tokens are exactly the ``completion_ids`` verifiers recorded."""
    python = _verifiers_python()
    tok = tiny_tokenizer
    got: dict[str, Any] = {}

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> None:
        proc = await asyncio.create_subprocess_exec(python, str(ROLLOUT), ctx.openai_base_url, ctx.api_key, ctx.model,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                    env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        out, err = await asyncio.wait_for(proc.communicate(), 50)
        assert proc.returncode == 0, err.decode()[-3000:]
        got.update(json.loads(out.decode().strip().splitlines()[-1]))

    (t,), engine, runner = await _run(tok, [CALL, "fine<|im_end|>", "fine<|im_end|>"], agent)
    steps = got["steps"]
    assert got["warnings"] == []  # no "TITO fell back to MITO"
    assert [s["tool_calls"] for s in steps] == [["weather"], [], []]
    for before, after in zip(steps, steps[1:], strict=False):  # each prompt is the previous turn's ids, then the bridge
        prev = before["prompt_ids"] + before["completion_ids"]
        assert after["prompt_ids"][: len(prev)] == prev
    assert engine.prompts == [s["prompt_ids"] for s in steps]  # what verifiers sent is what the engine was given
    assert _sampled(t) == [x for s in steps for x in s["completion_ids"]] and runner.stats.segments == 1
    last = steps[-1]
    assert t.input_ids.tolist() + t.output_ids.tolist() == last["prompt_ids"] + last["completion_ids"]
    assert [lp for s in steps for lp in s["logprobs"]] == pytest.approx(
        [float(x) for x, m in zip(t.output_logprobs, t.loss_mask, strict=True) if m])
    assert sys.executable != python  # the client really ran in the other venv
