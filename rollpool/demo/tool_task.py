"""The tool demo's task (``rollpool demo --task tool``): ask a tool for a secret, then say it.

Each episode's environment draws one secret digit (from the prompt's ``env_seed`` and the episode's
index: random per episode, reproducible per run, and a re-run of the episode after a worker death
draws the same one, so the tool tolerates re-execution). The answer is the secret: nothing in the
prompt's tokens tells it, so a policy that does not use the tool is right 1 time in 10 at best
(chance). A prompt is ``<s> KEY <sep>``, ``KEY`` one of ``k0..k3`` (the word the agent puts in the
user turn; the secret does not depend on it).

The tool is ``lookup(key)``: the episode's secret for any key, or ``<none>`` when the tool is
disabled (the control run). A call is the compact format of the ``compact`` tool-call parser
(`rollpool.workers.episodes.toolcalls`): the special token ``<call>`` and one argument word,
``<call> k2``; the parser finds no call in ``<call>`` followed by a marker or by nothing, so the
tool does not run. The agent, `solve`, is an `openai` SDK loop through the episode's endpoint with
``tools=[lookup]``: turn 1 samples at most two tokens; when the endpoint's parser finds a call in
them, the agent runs the tool and asks for turn 2 (one token, the answer); else turn 1's first
word is the answer. The chat template renders the sequence of a successful episode as::

    <s> k2 <sep> | <call> k2 | </s> <obs> 7 | 7
      prompt       sampled     inserted      sampled

so 3 sampled tokens (loss mask 1) and 3 inserted by the template and the tool (mask 0).

The episode returns the training reward: 1.0 for the right answer, else ``call_bonus`` (prompt
metadata; the demo's default 0.3) when turn 1 held a call, else 0 (a shaped reward that makes the
first call findable from a random initialisation: see ``docs/episodes.md``). What the demo reports
is unshaped: ``metadata["correct"]`` (the answer) and ``metadata["called"]`` (turn 1 held a call
the parser found), written by the episode onto its trajectory.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pathlib
import random
from typing import Any

# The agent's SDK, imported with the module: the worker imports an --episode module at start, so the
# import (about a second) never blocks its event loop mid-run (heartbeats).
import openai

from rollpool.demo.task import build_word_model

__all__ = [
    "CALL",
    "KEYS",
    "NONE",
    "OBS",
    "TOOLS",
    "VOCAB",
    "build_tool_model",
    "make_prompt",
    "secret_of",
    "solve",
]

SPECIALS = ["<pad>", "<s>", "</s>", "<sep>", "<unk>"]
CALL, OBS, NONE = "<call>", "<obs>", "<none>"
KEYS = [f"k{i}" for i in range(4)]
DIGITS = [str(d) for d in range(10)]
VOCAB = SPECIALS + DIGITS + [CALL, OBS, NONE] + KEYS
PAD_ID = 0
TOKEN_ID = {t: i for i, t in enumerate(VOCAB)}

TOOLS: list[dict[str, Any]] = [{
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "the episode's secret digit",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}]

# The user turn is `<s> KEY <sep>`, an assistant call `<call> KEY`, its end of turn `</s>`, a tool result
# `<obs> DIGIT`; the generation prompt adds nothing (a space). The tool list is not rendered: the tiny
# model learns its one tool by RL.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{{ '<s> ' + m['content'] + ' <sep>' }}"
    "{%- elif m['role'] == 'assistant' -%}{{ ' ' }}"
    "{%- if m.get('tool_calls') -%}"
    "{%- for c in m['tool_calls'] -%}"
    "{%- set a = c['function']['arguments'] -%}"
    "{{ '<call> ' + (a['key'] if a is mapping else a) | string }}"
    "{%- endfor -%}"
    "{%- else -%}{{ m['content'] or '' }}{%- endif -%}"
    "{{ ' </s>' }}"
    "{%- elif m['role'] == 'tool' -%}{{ ' <obs> ' + m['content'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ ' ' }}{%- endif -%}"
)


def build_tool_model(path: str | pathlib.Path, *, seed: int = 0, tie_embeddings: bool = False, hidden: int = 128,
                     layers: int = 1) -> pathlib.Path:
    """A random-weight Llama over the task's 22-token vocabulary, with its tokenizer and chat template.

    One layer, 128 wide: in the in-process stand-in of the task (the same GRPO step, no pool) one layer
    learned the copy of the tool's answer in all three seeds tried within 150 steps, two layers in none.
    """
    return build_word_model(path, VOCAB, special_tokens=[CALL, OBS, NONE], chat_template=CHAT_TEMPLATE, seed=seed,
                            tie_embeddings=tie_embeddings, hidden=hidden, layers=layers)


def make_prompt(rng: random.Random, *, tool: bool, call_bonus: float, evaluation: bool = False) -> dict[str, Any]:
    """One prompt (a `Prompt` mapping, without group size and sampling)."""
    key = rng.choice(KEYS)
    metadata: dict[str, Any] = {"key": key, "env_seed": rng.getrandbits(48), "tool": tool, "call_bonus": call_bonus}
    if evaluation:
        metadata["eval"] = True
    return {"input_ids": [TOKEN_ID["<s>"], TOKEN_ID[key], TOKEN_ID["<sep>"]], "metadata": metadata}


def secret_of(env_seed: int, sample_index: int) -> str:
    """The secret digit of one episode's environment."""
    return str(random.Random(f"{env_seed}:{sample_index}").randrange(10))


_CLIENTS: dict[int, Any] = {}


def _client(ctx: Any) -> Any:
    """The SDK client for this episode: one base client per event loop, bound per episode by ``with_options``.

    A new ``AsyncOpenAI`` builds its own HTTP client and TLS context (about 40 ms of CPU); the demo runs
    thousands of episodes, so it shares one and binds the episode's URL and key (the SDK's own copy).
    """
    loop_id = id(asyncio.get_running_loop())
    base = _CLIENTS.get(loop_id)
    if base is None:
        # the SDK's HTTP client logs every request at INFO: thousands of lines per second in the worker's log
        for name in ("httpx", "httpx2", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)
        base = _CLIENTS[loop_id] = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key, max_retries=0,
                                                      timeout=60.0)
    return base.with_options(base_url=ctx.openai_base_url, api_key=ctx.api_key)


def _first_word(text: str | None) -> str:
    words = (text or "").split()
    return words[0] if words else ""


async def solve(ctx: Any, prompt: Any) -> float:
    """The agent of one episode (see the module docstring); returns the training reward."""
    md = ctx.metadata
    secret = secret_of(int(md["env_seed"]), ctx.sample_index)
    tool_enabled = bool(md.get("tool", True))

    def lookup(key: str) -> str:
        return secret if tool_enabled else NONE

    client = _client(ctx)
    messages: list[Any] = [{"role": "user", "content": str(md["key"])}]
    r = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS, max_tokens=2)
    msg = r.choices[0].message
    called = bool(msg.tool_calls)  # the endpoint's parser found a call in the sampled tokens
    if called:
        messages.append(msg)  # sent back unchanged: the endpoint reuses the tokens it sampled
        for call in msg.tool_calls:
            try:
                key = str(json.loads(call.function.arguments).get("key", ""))
            except (ValueError, AttributeError):
                key = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": lookup(key)})
        r = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS, max_tokens=1)
        msg = r.choices[0].message
    answer = "" if msg.tool_calls else _first_word(msg.content)
    correct = answer == secret
    md.update(called=called, correct=correct, answer=answer, secret=secret)
    if correct:
        return 1.0
    return float(md.get("call_bonus", 0.0)) if called else 0.0
