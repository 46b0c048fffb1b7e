"""Chat rendering with token in, token out (pure: a tokenizer object in, token ids out, no I/O).

The endpoint keeps, per segment, a `ChatView`: the messages whose tokens are in the segment (the
assistant ones exactly as the endpoint returned them), the chat template's text for them, and the
template text still owed after the last sampled turn (its end-of-turn tokens, which the model may
not have sampled: a turn cut by ``max_tokens`` or ended by a stop string). A new request

- whose messages start with the view's messages (compared by `message_key`: an assistant message
  sent back unchanged, ``content: null`` with ``tool_calls`` included, matches; so does one whose call
  arguments were re-serialised, or that gained a field the template does not render), with the same
  tools, and whose rendering starts with the view's text, *extends* the segment: only the owed text and the
  new messages (plus the generation prompt) are tokenized and inserted, loss mask 0; the sampled
  tokens are reused exactly;
- otherwise (a message edited or dropped, other tools, a template that re-renders history) starts a
  new segment whose prompt is the whole rendered conversation.

One rendering a turn: after a reply the view is *deferred* (`deferred_view`): it holds the turn's
prompt text and sampled text, and a next rendering that starts with both extends the segment by
the rest, which is what the full view would insert whenever both apply. Only when it does not (a
template that renders the reply otherwise than sampled, e.g. re-formatted tool-call JSON) is the
conversation with the reply rendered (`resolve`) and the full rule above applied.

Images: a user message's ``image_url`` parts are kept as the message's ``image_urls`` (in order) and
stand in its content as the model's image placeholder text (for a Qwen2-VL-style model
``<|vision_start|><|image_pad|><|vision_end|>``, what its own chat template writes for an image part),
so every chat template renders them where they were, as a string; the endpoint resolves the URLs to
images and replaces ``image_urls`` by ``images`` (their sha256), which `message_key` compares: a
conversation whose earlier image changed is a rewritten history.

`ChatTokenizer` is the part of a Hugging Face tokenizer this module uses; it is never imported here. A Hugging
Face tokenizer's template is rendered directly (`rollpool.workers.engines.tokenizer.template_renderer`: the text
``apply_chat_template`` gives, checked against it on first use), the messages being plain JSON already.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rollpool.workers.engines.tokenizer import template_renderer

__all__ = [
    "ChatTokenizer",
    "ChatView",
    "EndpointError",
    "deferred_view",
    "end_of_turn",
    "image_urls",
    "message_key",
    "render",
    "render_message",
    "resolve",
    "validate_messages",
]

_ROLES = ("system", "developer", "user", "assistant", "tool")
_SENTINEL = "\x00rollpool-sentinel\x00"


class ChatTokenizer(Protocol):
    chat_template: Any

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class EndpointError(Exception):
    """A request the endpoint refuses, answered as an OpenAI-style error body with `status`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None = None) -> EndpointError:
    return EndpointError(400, message, param=param)


def _image_url(part: Mapping[str, Any], where: str) -> str:
    raw = part.get("image_url")
    url = raw.get("url") if isinstance(raw, Mapping) else raw  # the SDK sends {"url": ...}; some clients the string
    if not isinstance(url, str) or not url:
        raise _bad(f"{where}: an image_url part needs image_url.url (a data: URL)", where)
    if not url.startswith(("data:", "http://", "https://")):
        raise _bad(f"{where}: image_url.url must be a data: URL (data:image/png;base64,...) or an http(s) URL, "
                   f"got {url[:40]!r}", where)
    return url


def _content_text(content: Any, where: str, role: Any, image_text: str | None) -> tuple[str | None, list[str]]:
    """(the content as text, each image part standing as `image_text`; the image parts' URLs in order)."""
    if content is None or isinstance(content, str):
        return content, []
    if isinstance(content, list):
        parts, urls = [], []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif kind == "image_url":
                at = f"{where}.content[{i}]"
                if role != "user":
                    raise _bad(f"{at}: image parts are served in user messages only, not {role}", f"{where}.content")
                urls.append(_image_url(part, at))
                if image_text is None:
                    raise _bad(f"{at}: this model takes no images (not a vision-language model)", f"{where}.content")
                parts.append(image_text)
            else:
                raise _bad(f"{where}.content[{i}]: only text and image_url parts are supported", f"{where}.content")
        return "".join(parts), urls
    raise _bad(f"{where}.content must be a string, a list of text and image_url parts or null", f"{where}.content")


def _tool_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise _bad(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    out = []
    for j, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments", ""), str):
            raise _bad(f"{where}.tool_calls[{j}] needs function.name and function.arguments (a JSON string)", f"{where}.tool_calls")
        out.append({"id": str(call.get("id") or ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn.get("arguments", "")}})
    return out


def validate_messages(raw: Any, *, image_text: str | None = None,
                      known: tuple[Sequence[Any], Sequence[dict[str, Any]]] | None = None) -> list[dict[str, Any]]:
    """The request's messages in a canonical shape (role, content, tool_calls, tool_call_id, name, and ``image_urls``
    for a user message with image parts, which stand in its content as `image_text`); 400 if malformed, or if a
    message has an image part and `image_text` is None (a model without images).

    `known`: (the raw messages, their canonical shapes) of an earlier call with the same `image_text` (the episode's
    previous turn: an agent sends its whole history every turn). A raw message equal to the one at its position there
    is given that same canonical dict, not checked again: the canonical shape is a function of the message's value,
    except where ``str()`` of an id would tell ``1`` from ``1.0`` or ``True`` (reused only when every id is a string
    or absent) and for image parts (whose dict the endpoint rewrites: never reused). The dicts given are not to be
    changed by the caller (the endpoint's views of earlier turns hold them)."""
    if not isinstance(raw, list) or not raw:
        raise _bad("messages must be a non-empty list", "messages")
    before, shapes = known if known is not None else ((), ())
    out = []
    for i, msg in enumerate(raw):
        if i < len(before) and i < len(shapes) and type(msg) is dict and msg == before[i] and _reusable(msg, shapes[i]):
            out.append(shapes[i])
            continue
        out.append(_validate_message(i, msg, image_text))
    return out


def _reusable(msg: dict[str, Any], shape: dict[str, Any]) -> bool:
    if "image_urls" in shape or "images" in shape or type(msg.get("tool_call_id")) not in (str, type(None)):
        return False
    calls = msg.get("tool_calls")
    return not calls or all(type(c) is dict and type(c.get("id")) in (str, type(None)) for c in calls)


def _validate_message(i: int, msg: Any, image_text: str | None) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(msg, Mapping):
        raise _bad(f"{where} must be an object", "messages")
    role = msg.get("role")
    if role not in _ROLES:
        raise _bad(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}", "messages")
    text, urls = _content_text(msg.get("content"), where, role, image_text)
    clean: dict[str, Any] = {"role": role, "content": text}
    if urls:
        clean["image_urls"] = urls
    if role == "assistant":
        calls = _tool_calls(msg.get("tool_calls"), where)
        if calls:
            clean["tool_calls"] = calls
    elif clean["content"] is None:
        raise _bad(f"{where}.content is required for role {role}", f"{where}.content")
    if role == "tool":
        clean["tool_call_id"] = str(msg.get("tool_call_id") or "")
    if isinstance(msg.get("name"), str) and msg["name"]:
        clean["name"] = msg["name"]
    return clean


def _arguments_key(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments else {}
    except ValueError:
        return arguments


def message_key(msg: Mapping[str, Any]) -> str:
    """What two messages must share to be the same message, before the rendering decides.

    The role, the content (null and empty are the same) and the tool calls' names and arguments
    compared as parsed JSON (``{"a":1}`` is ``{"a": 1}``: an agent library that re-serialises them
    sends back the same call). Everything else (an assistant ``name``, call ids, ``tool_call_id``)
    counts only through the chat template: `extension` also requires the new rendering to start with
    the old, so a field the template renders still splits the segment when it changes, and one it
    does not render cannot.
    """
    key = {"role": msg.get("role"), "content": msg.get("content") or "",
           "calls": [[c["function"]["name"], _arguments_key(c["function"]["arguments"])] for c in msg.get("tool_calls") or []]}
    if msg.get("images"):  # the images a message shows, by sha256: the same text with another picture is another message
        key["images"] = list(msg["images"])
    return json.dumps(key, sort_keys=True, ensure_ascii=False)


def image_urls(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The image URLs of `messages` (canonical, from `validate_messages`), in the order their placeholders render."""
    return [url for m in messages for url in m.get("image_urls") or ()]


def render_message(msg: Mapping[str, Any]) -> dict[str, Any]:
    """The message as chat templates expect it: content a string, tool-call arguments a mapping when they are JSON objects."""
    out = {k: v for k, v in msg.items() if k not in ("images", "image_urls")}
    out["content"] = out.get("content") or ""
    if "tool_calls" in out:
        calls = []
        for call in out["tool_calls"]:
            fn = dict(call["function"])
            try:
                args = json.loads(fn["arguments"]) if fn["arguments"] else {}
            except ValueError:
                args = fn["arguments"]
            fn["arguments"] = args
            calls.append({**call, "function": fn})
        out["tool_calls"] = calls
    return out


def render(tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None,
           *, add_generation_prompt: bool, plain_cache: dict[int, tuple[Mapping[str, Any], dict[str, Any]]] | None = None) -> str:
    """The chat template's text for `messages` (400 when the model has no chat template).

    `plain_cache` (id of a message -> (the message, its `render_message`)): the plain form of a message rendered before
    is that same dict again, for a caller whose messages are not changed once given (the endpoint's canonical ones);
    both the direct rendering and transformers' (which converts a copy) leave the plain forms as they were."""
    if not getattr(tokenizer, "chat_template", None):
        raise _bad("this model has no chat template: use /v1/completions, or give the model a chat template", "messages")
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
    if tools:
        kwargs["tools"] = list(tools)
    if plain_cache is None:
        plain = [render_message(m) for m in messages]
    else:
        if len(plain_cache) > 4096:  # a long episode of rewritten histories: what is gone is not kept
            plain_cache.clear()
        plain = []
        for m in messages:
            hit = plain_cache.get(id(m))
            if hit is None or hit[0] is not m:
                hit = plain_cache[id(m)] = (m, render_message(m))
            plain.append(hit[1])
    direct = template_renderer(tokenizer) if plain and all(type(t) is dict for t in tools or ()) else None
    try:
        text = direct(plain, kwargs.get("tools"), add_generation_prompt) if direct is not None else (
            tokenizer.apply_chat_template(plain, **kwargs))
    except Exception as exc:  # the template refused these messages: the request's fault
        raise _bad(f"the chat template could not render these messages: {type(exc).__name__}: {exc}", "messages") from exc
    return str(text)


def end_of_turn(tokenizer: ChatTokenizer, before: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None) -> str:
    """The text the template puts after an assistant message's content (e.g. ``<|im_end|>\\n``); "" if unknown."""
    probe = [*before, {"role": "assistant", "content": _SENTINEL}]
    try:
        text = render(tokenizer, probe, tools, add_generation_prompt=False)
    except EndpointError:
        return ""
    at = text.rfind(_SENTINEL)
    return "" if at < 0 else text[at + len(_SENTINEL):]


@dataclass(slots=True)
class ChatView:
    """The endpoint's view of one segment (see the module docstring)."""

    messages: list[dict[str, Any]]
    tools_key: str
    text: str | None
    """render(messages) without a generation prompt; None when the template cannot be extended."""
    owed: str
    """Template text after the last sampled token that is not yet in the sequence."""
    key_cache: list[str] | None = None
    """`keys`, computed once (a view's messages never change: the next turn makes a new view)."""
    deferred: _Reply | None = None
    """A deferred view (`deferred_view`): the reply it stands for; `text` and `owed` are then unset."""
    resolved: ChatView | None = None
    """A deferred view's full view, once `resolve` computed it."""

    def keys(self) -> list[str]:
        if self.key_cache is None:
            self.key_cache = [message_key(m) for m in self.messages]
        return self.key_cache

    def starts(self, messages: Sequence[Mapping[str, Any]]) -> bool:
        """`messages` begin with this view's messages (by `message_key`; an unchanged dict is the same message)."""
        k = len(self.messages)
        if len(messages) < k:
            return False
        keys: list[str] | None = None
        for i, (mine, theirs) in enumerate(zip(self.messages, messages, strict=False)):
            if mine == theirs:
                continue
            keys = self.keys() if keys is None else keys
            if message_key(theirs) != keys[i]:
                return False
        return True


@dataclass(frozen=True, slots=True)
class _Reply:
    """What `after_reply` needs, kept by a deferred view until a next turn does not extend it by the fast rule."""

    before: list[dict[str, Any]]
    reply: dict[str, Any]
    tools: Sequence[Any] | None
    prompt_text: str
    sampled_text: str
    finished_on_end_of_turn: bool
    eot_text: str | None


def tools_key(tools: Sequence[Any] | None) -> str:
    if not tools:
        return "[]"  # json.dumps([]): most turns have no tools, and this is asked several times a turn
    return json.dumps(list(tools), sort_keys=True, ensure_ascii=False)


def extension(view: ChatView | None, tokenizer: ChatTokenizer, messages: list[dict[str, Any]], tools: Sequence[Any] | None,
              prompt_text: str) -> str | None:
    """The text to insert when `messages` extends `view` (rendered as `prompt_text`), else None (a new segment).

    A deferred view extends by its fast rule when `prompt_text` starts with the turn's prompt and sampled
    text, else it is resolved (one more rendering) and the full rule decides."""
    if view is None or view.tools_key != tools_key(tools) or not view.starts(messages):
        return None
    if view.deferred is not None:
        d = view.deferred
        if prompt_text.startswith(d.prompt_text) and prompt_text.startswith(d.sampled_text, len(d.prompt_text)):
            return prompt_text[len(d.prompt_text) + len(d.sampled_text):]
        view = resolve(view, tokenizer)
    if view.text is None or not prompt_text.startswith(view.text):
        return None
    return view.owed + prompt_text[len(view.text):]


def deferred_view(before: list[dict[str, Any]], reply: dict[str, Any], tools: Sequence[Any] | None, prompt_text: str,
                  sampled_text: str, finished_on_end_of_turn: bool, *, eot_text: str | None = None) -> ChatView:
    """The view after sampling `reply`, without rendering: what `after_reply` would return, computed only if needed
    (`resolve`). Same arguments as `after_reply`."""
    return ChatView([*before, reply], tools_key(tools), None, "",
                    deferred=_Reply(before, reply, tools, prompt_text, sampled_text, finished_on_end_of_turn, eot_text))


def resolve(view: ChatView, tokenizer: ChatTokenizer) -> ChatView:
    """A deferred view made whole (`after_reply`: one rendering of the conversation with the reply); others as they are."""
    d = view.deferred
    if d is None:
        return view
    if view.resolved is None:
        view.resolved = after_reply(tokenizer, d.before, d.reply, d.tools, d.prompt_text, d.sampled_text,
                                    d.finished_on_end_of_turn, eot_text=d.eot_text)
    return view.resolved


def after_reply(tokenizer: ChatTokenizer, before: list[dict[str, Any]], reply: dict[str, Any], tools: Sequence[Any] | None,
                prompt_text: str, sampled_text: str, finished_on_end_of_turn: bool, *, eot_text: str | None = None) -> ChatView:
    """The view after sampling `reply` for `before` (whose rendered prompt was `prompt_text`).

    `sampled_text` is the sampled tokens decoded with special tokens; `finished_on_end_of_turn` is
    True when the last sampled token is the template's end-of-turn token; `eot_text`, when given,
    is ``end_of_turn(tokenizer, before, tools)`` already computed for this turn (not rendered again).
    """
    messages = [*before, reply]
    tkey = tools_key(tools)
    try:
        full = render(tokenizer, messages, tools, add_generation_prompt=False)
    except EndpointError:  # the template cannot render our own reply: the next turn starts a new segment
        return ChatView(messages, tkey, None, "")
    if not full.startswith(prompt_text):
        return ChatView(messages, tkey, None, "")
    turn = full[len(prompt_text):]
    if turn.startswith(sampled_text):
        return ChatView(messages, tkey, full, turn[len(sampled_text):])
    # the template renders the turn otherwise (e.g. tool-call JSON re-formatted): the sampled tokens
    # stand for the turn up to its end-of-turn marker, and what the template puts after that is owed
    eot = end_of_turn(tokenizer, before, tools) if eot_text is None else eot_text
    marker = eot.rstrip()
    if finished_on_end_of_turn and marker and eot.startswith(marker):
        return ChatView(messages, tkey, full, eot[len(marker):])
    return ChatView(messages, tkey, full, eot)
