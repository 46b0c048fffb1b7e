"""The tool demo's task (``rollpool demo --task tool``): look a secret up with a tool, then say it.

A prompt is ``<s> KEY <sep>``, with ``KEY`` one of four slot tokens ``k0..k3``. Each episode's
environment draws four secret digits, one per slot (from the prompt's ``env_seed`` and the
episode's index: random per episode, reproducible per run, and a re-run of the episode after a
worker death draws the same ones, so the tool tolerates re-execution). The answer is the digit
of slot ``KEY``: nothing in the prompt's tokens tells it, so a policy that does not use the tool
is right 1 time in 10 at best (chance).

The tool is ``lookup(key)``: the slot's digit, or ``<none>`` for a word that is not a slot (and
for every key when the tool is disabled: the control run). A call is the compact format of the
``compact`` tool-call parser (`rollpool.workers.episodes.toolcalls`): the special token
``<call>`` and one argument token, ``<call> k2``. The agent, `solve`, is an `openai` SDK loop
through the episode's endpoint with ``tools=[lookup]``: turn 1 samples at most two tokens; when
the endpoint's parser finds a call in them, the agent runs the tool and asks for turn 2 (one
token, the answer); else turn 1's first word is the answer. The chat template renders the
sequence of a successful episode as::

    <s> k2 <sep> | <call> k2 | </s> <obs> 7 | 7
      prompt       sampled     inserted      sampled

so 3 sampled tokens (loss mask 1) and 3 inserted by the template and the tool (mask 0).

The episode returns the training reward: 1.0 for the right answer; otherwise ``call_bonus``
(prompt metadata, default 0.2) when turn 1 called the tool with the prompt's key (a shaped reward
that makes the first call findable from a random initialisation: see ``docs/episodes.md``), else 0.
What the demo reports is unshaped: ``metadata["correct"]`` (the answer) and ``metadata["called"]``
(turn 1 held a call the parser found), written by the episode on its trajectory.
"""

from __future__ import annotations

import json
import pathlib
import random
from typing import Any

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
    "secrets_of",
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
        "description": "the secret digit of a slot",
        "parameters": {"type": "object", "properties": {"key": {"type": "string", "enum": KEYS}}, "required": ["key"]},
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


def build_tool_model(path: str | pathlib.Path, *, seed: int = 0) -> pathlib.Path:
    """A random-weight Llama over the task's 22-token vocabulary, with its tokenizer and chat template."""
    return build_word_model(path, VOCAB, special_tokens=[CALL, OBS, NONE], chat_template=CHAT_TEMPLATE, seed=seed)


def make_prompt(rng: random.Random, *, tool: bool, call_bonus: float, evaluation: bool = False) -> dict[str, Any]:
    """One prompt (a `Prompt` mapping, without group size and sampling)."""
    key = rng.choice(KEYS)
    metadata: dict[str, Any] = {"key": key, "env_seed": rng.getrandbits(48), "tool": tool, "call_bonus": call_bonus}
    if evaluation:
        metadata["eval"] = True
    return {"input_ids": [TOKEN_ID["<s>"], TOKEN_ID[key], TOKEN_ID["<sep>"]], "metadata": metadata}


def secrets_of(env_seed: int, sample_index: int) -> dict[str, str]:
    """The four slot digits of one episode's environment."""
    rng = random.Random(f"{env_seed}:{sample_index}")
    return {k: str(rng.randrange(10)) for k in KEYS}


_CLIENTS: dict[int, Any] = {}


def _client(ctx: Any) -> Any:
    """The SDK client for this episode: one base client per event loop, bound per episode by ``with_options``.

    A new ``AsyncOpenAI`` builds its own HTTP client and TLS context (about 40 ms of CPU); the demo runs
    thousands of episodes, so it shares one and binds the episode's URL and key (the SDK's own copy).
    """
    import asyncio

    import openai

    loop_id = id(asyncio.get_running_loop())
    base = _CLIENTS.get(loop_id)
    if base is None:
        base = _CLIENTS[loop_id] = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key, max_retries=0,
                                                      timeout=60.0)
    return base.with_options(base_url=ctx.openai_base_url, api_key=ctx.api_key)


def _first_word(text: str | None) -> str:
    words = (text or "").split()
    return words[0] if words else ""


async def solve(ctx: Any, prompt: Any) -> float:
    """The agent of one episode (see the module docstring); returns the training reward."""
    md = ctx.metadata
    key = str(md["key"])
    slots = secrets_of(int(md["env_seed"]), ctx.sample_index)
    tool_enabled = bool(md.get("tool", True))

    def lookup(arg: str) -> str:
        if not tool_enabled:
            return NONE
        return slots.get(arg, NONE)

    client = _client(ctx)
    messages: list[Any] = [{"role": "user", "content": key}]
    r = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS, max_tokens=2)
    msg = r.choices[0].message
    called = bool(msg.tool_calls)
    right_key = False
    if called:
        messages.append(msg)  # sent back unchanged: the endpoint reuses the tokens it sampled
        for call in msg.tool_calls:
            try:
                arg = str(json.loads(call.function.arguments).get("key", ""))
            except (ValueError, AttributeError):
                arg = ""
            right_key = right_key or arg == key
            messages.append({"role": "tool", "tool_call_id": call.id, "content": lookup(arg)})
        r = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS, max_tokens=1)
        msg = r.choices[0].message
    answer = "" if msg.tool_calls else _first_word(msg.content)
    correct = answer == slots[key]
    md.update(called=called, right_key=right_key, correct=correct, answer=answer, secret=slots[key])
    if correct:
        return 1.0
    return float(md.get("call_bonus", 0.0)) if called and right_key else 0.0
