"""The OpenAI Responses API (``POST /v1/responses``) as a translation onto chat completions (pure, no I/O).

A Responses request is turned into the chat-completions body the episode already serves
(`to_chat_body`), so both APIs record into the same token sequence by the same rule: the same
exactness (sampled tokens reused as sampled) and the same segment rule (a history sent back
unchanged extends the segment). The chat answer is turned back into a ``response`` object
(`from_chat`) and, when streamed, into the Responses event sequence (`stream_events`).

What is translated:

- ``input``: a string (one user message) or a list of items: messages (``{"role", "content"}``,
  with or without ``"type": "message"``; content a string or ``input_text`` / ``output_text``
  parts), ``function_call`` items (merged into the assistant message before them, as the chat
  shape holds them) and ``function_call_output`` items (tool messages);
- ``instructions``: a system message first (not carried over by ``previous_response_id``, as the
  OpenAI API does);
- ``previous_response_id``: one of the episode's last `MAX_STORED_RESPONSES` responses (its input
  and output come first; an older or unknown id gets a 404);
- ``tools`` (function tools only), ``tool_choice``, ``text.format`` (``json_object``,
  ``json_schema``: the chat ``response_format``), ``max_output_tokens``, ``temperature``,
  ``top_p``, ``top_logprobs`` and ``include: ["message.output_text.logprobs"]``.

Fields that change nothing here (``store``, ``metadata``, ``user``, ``parallel_tool_calls``, ...)
are accepted; a field that would change the output and is not served (``background``,
``conversation``, ``truncation: "auto"``, ``reasoning.effort``, a non-function tool, an unknown
field) gets a 400 naming it, never silent acceptance.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from rollpool.workers.episodes.chat import EndpointError

__all__ = ["ResponseStore", "from_chat", "stream_events", "to_chat_body"]

ResponseStore = dict[str, list[dict[str, Any]]]
"""Per episode: response id -> the conversation it ended with (chat messages, without its instructions)."""
MAX_STORED_RESPONSES = 64
"""An episode keeps its last 64 responses for ``previous_response_id`` (agents chain to the last one)."""

_TEXT_PARTS = ("input_text", "output_text", "text")
# accepted, and they change nothing about the tokens (bookkeeping, routing, caching hints)
_NO_EFFECT = frozenset({"model", "store", "metadata", "user", "parallel_tool_calls", "service_tier", "prompt_cache_key",
                        "prompt_cache_retention", "safety_identifier", "stream", "stream_options"})
_HANDLED = frozenset({"input", "instructions", "previous_response_id", "tools", "tool_choice", "text",
                      "max_output_tokens", "temperature", "top_p", "top_logprobs", "reasoning", "truncation",
                      "include"})
_LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _bad(message: str, param: str | None = None) -> EndpointError:
    return EndpointError(400, message, param=param)


def _text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") not in (*_TEXT_PARTS, "refusal"):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise _bad(f"{where}.content[{i}]: only text parts are served (input_text, output_text), got {kind!r}", "input")
            value = part.get("refusal") if part.get("type") == "refusal" else part.get("text")
            if not isinstance(value, str):
                raise _bad(f"{where}.content[{i}] needs a string text", "input")
            parts.append(value)
        return "".join(parts)
    raise _bad(f"{where}.content must be a string or a list of text parts", "input")


def _messages(items: Any) -> list[dict[str, Any]]:
    """Input items as chat messages: a function_call joins the assistant message before it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise _bad("input must be a string or a list of items", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise _bad(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role must be user, system, developer or assistant, got {role!r}", "input")
            out.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments", ""), item.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str) or not isinstance(call_id, str):
                raise _bad(f"{where}: a function_call needs name, arguments (a JSON string) and call_id", "input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise _bad(f"{where}: a function_call_output needs call_id", "input")
            output = _text(item.get("output"), where)
            out.append({"role": "tool", "tool_call_id": call_id, "content": output or ""})
        else:
            raise _bad(f"{where}: item type {kind!r} is not served (message, function_call, function_call_output)", "input")
    return out


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise _bad("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            kind = tool.get("type") if isinstance(tool, Mapping) else None
            raise _bad(f"tools[{i}]: only function tools (with a name) are served, got type {kind!r}", "tools")
        fn: dict[str, Any] = {"name": tool["name"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        if tool.get("parameters") is not None:
            fn["parameters"] = tool["parameters"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(raw: Any) -> Any:
    if raw is None or raw in ("auto", "none", "required"):
        return raw
    if isinstance(raw, Mapping) and raw.get("type") == "function" and isinstance(raw.get("name"), str):
        return {"type": "function", "function": {"name": raw["name"]}}
    raise _bad(f"tool_choice {json.dumps(raw)} is not served (auto, none, required or a named function)", "tool_choice")


def _response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, Mapping):
        raise _bad("text must be an object", "text")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, Mapping) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, Mapping) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, Mapping) and fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise _bad(f"text.format {json.dumps(fmt)} is not served (text, json_object, json_schema)", "text.format")


def _refuse_unserved(body: Mapping[str, Any]) -> None:
    unknown = sorted(k for k, v in body.items() if k not in _NO_EFFECT and k not in _HANDLED and v is not None)
    if unknown:
        raise _bad(f"{', '.join(unknown)}: not served by this endpoint", unknown[0])
    reasoning = body.get("reasoning")
    if isinstance(reasoning, Mapping) and any(v is not None for v in reasoning.values()):
        raise _bad("reasoning is not served: the model's turns are plain completions", "reasoning")
    if body.get("truncation") not in (None, "disabled"):
        raise _bad("truncation must be disabled: the episode never drops history by itself", "truncation")
    if body.get("input") is None:
        raise _bad("input is required", "input")


def to_chat_body(body: Mapping[str, Any], store: ResponseStore) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the chat-completions body for `body`, the conversation without its instructions); 400 if not served."""
    _refuse_unserved(body)
    conversation: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str) or previous not in store:
            raise EndpointError(404, f"no response {previous!r} in this episode", param="previous_response_id",
                                code="response_not_found")
        conversation = [dict(m) for m in store[previous]]
    conversation += _messages(body["input"])
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("instructions must be a string", "instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    chat: dict[str, Any] = {"messages": messages}
    if (tools := _tools(body.get("tools"))) is not None:
        chat["tools"] = tools
    if (choice := _tool_choice(body.get("tool_choice"))) is not None:
        chat["tool_choice"] = choice
    if (fmt := _response_format(body.get("text"))) is not None:
        chat["response_format"] = fmt
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    include = body.get("include") or []
    if not isinstance(include, list):
        raise _bad("include must be a list", "include")
    if _LOGPROBS_INCLUDE in include:
        chat["logprobs"] = True
    if body.get("top_logprobs"):
        chat["logprobs"] = True
        chat["top_logprobs"] = body["top_logprobs"]
    return chat, conversation


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _logprobs(choice: Mapping[str, Any]) -> list[dict[str, Any]]:
    content = (choice.get("logprobs") or {}).get("content") or []
    return [{"token": x["token"], "logprob": x["logprob"], "bytes": x["bytes"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": t["bytes"]} for t in x.get("top_logprobs") or []]}
            for x in content]


def from_chat(result: Mapping[str, Any], body: Mapping[str, Any], store: ResponseStore,
              conversation: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The ``response`` object for the chat answer `result` to `body`; stores its conversation under its id."""
    choice = result["choices"][0]
    msg = choice["message"]
    output: list[dict[str, Any]] = []
    calls = msg.get("tool_calls") or []
    if msg.get("content") is not None or not calls:
        output.append({"type": "message", "id": _id("msg"), "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": msg.get("content") or "", "annotations": [],
                                    "logprobs": _logprobs(choice)}]})
    for call in calls:
        output.append({"type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": call["function"]["name"],
                       "arguments": call["function"]["arguments"], "status": "completed"})
    usage = result["usage"]
    incomplete = choice["finish_reason"] == "length"
    rid = _id("resp")
    reply = {"role": "assistant", "content": msg.get("content")}
    if calls:
        reply["tool_calls"] = [dict(c) for c in calls]
    store[rid] = [*(dict(m) for m in conversation), reply]
    while len(store) > MAX_STORED_RESPONSES:
        del store[next(iter(store))]
    text = body.get("text") if isinstance(body.get("text"), Mapping) else None
    return {
        "id": rid,
        "object": "response",
        "created_at": result.get("created", int(time.time())),
        "status": "incomplete" if incomplete else "completed",
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": result["model"],
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": None,
        "store": body.get("store", True),
        "temperature": body.get("temperature"),
        "text": text or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": list(body.get("tools") or []),
        "top_p": body.get("top_p"),
        "truncation": "disabled",
        "metadata": body.get("metadata") or {},
        "user": body.get("user"),
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
    }


def stream_events(response: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """The Responses streaming events for a whole `response` (the engine returns a turn whole: one delta per item)."""
    seq = 0

    def event(kind: str, **fields: Any) -> dict[str, Any]:
        nonlocal seq
        seq += 1
        return {"type": kind, "sequence_number": seq - 1, **fields}

    start = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    yield event("response.created", response=start)
    yield event("response.in_progress", response=start)
    for index, item in enumerate(response["output"]):
        if item["type"] == "message":
            part = item["content"][0]
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "content": []})
            empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=empty)
            if part["text"]:
                yield event("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                            delta=part["text"], logprobs=part.get("logprobs") or [])
            yield event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=part["text"], logprobs=part.get("logprobs") or [])
            yield event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part)
        else:
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "arguments": ""})
            yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=item["arguments"])
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=item["arguments"], name=item["name"])
        yield event("response.output_item.done", output_index=index, item=item)
    done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    yield event(done, response=dict(response))
