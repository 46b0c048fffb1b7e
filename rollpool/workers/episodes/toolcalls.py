"""Tool-call parsers, chosen by name: sampled text in, (content, tool calls) out (pure).

A parser reads the text of one sampled turn, decoded with the special tokens kept (so call markers
that are special tokens are visible) and without the stop token, and returns the text that is not a
call plus the calls it found, in order. It never raises on model output: text that does not parse
as a call stays content. Register more with `register_tool_call_parser`. A parser whose format a
grammar can hold also has ``call_constraint(tools)`` (an `OutputConstraint` for one call to one of
the tools), which a forced ``tool_choice`` needs.

Built in:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the format of the
  Hermes / Qwen chat templates and of rollpool's tiny model. Several calls may follow each other.
- ``compact``: ``<call> ARG``, one call marker and one argument word, for a tiny model that could not
  learn JSON from a random initialisation in a demo's budget (``rollpool demo --task tool``). It calls
  one tool, ``lookup``, with ``{"key": ARG}``; `CompactToolCallParser` takes another marker, tool name
  or argument name for a parser of your own.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from rollpool.protocol.errors import ConfigError
from rollpool.workers.engines.base import OutputConstraint

__all__ = [
    "CompactToolCallParser",
    "HermesToolCallParser",
    "ToolCall",
    "ToolCallParser",
    "get_tool_call_parser",
    "register_tool_call_parser",
    "tool_call_parser_names",
]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call, in the OpenAI shape (``arguments`` is a JSON string)."""

    name: str
    arguments: str
    id: str = ""

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallParser(Protocol):
    name: str

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(the text outside calls, the calls found)."""
        ...


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class HermesToolCallParser:
    """``<tool_call>{json}</tool_call>`` blocks; the JSON needs ``name`` (str) and ``arguments`` (object or string)."""

    name = "hermes"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def call_constraint(self, tools: Mapping[str, Any]) -> OutputConstraint:
        """The grammar of one call to one of `tools` (name -> JSON Schema of its arguments), for a forced tool choice."""
        options = [{"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                    "required": ["name", "arguments"], "additionalProperties": False} for name, params in tools.items()]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return OutputConstraint(json_schema=json.dumps(schema), begin="<tool_call>", end="</tool_call>")

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls: list[ToolCall] = []
        kept: list[str] = []
        pos = 0
        for match in self._BLOCK.finditer(text):
            call = self._call(match.group(1))
            if call is None:
                continue  # not a well-formed call: it stays content
            kept.append(text[pos: match.start()])
            pos = match.end()
            calls.append(call)
        kept.append(text[pos:])
        return "".join(kept), calls

    @staticmethod
    def _call(body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                json.loads(args)
            except ValueError:
                return None
            arguments = args
        elif isinstance(args, dict):
            arguments = json.dumps(args, ensure_ascii=False)
        else:
            return None
        return ToolCall(name=obj["name"], arguments=arguments, id=_call_id())


class CompactToolCallParser:
    """``<call> ARG``: the call marker, then one argument word (not a ``<...>`` marker) -> ``tool_name({argument_name: ARG})``.

    The marker alone, or followed by another marker or by nothing (a turn cut right after it), is not
    a call and stays content. Every marker-and-word pair in the turn is a call, in order.
    """

    name = "compact"

    def __init__(self, call_token: str = "<call>", tool_name: str = "lookup", argument_name: str = "key") -> None:
        if not call_token or not tool_name or not argument_name:
            raise ConfigError("CompactToolCallParser needs a call token, a tool name and an argument name")
        self.call_token = call_token
        self.tool_name = tool_name
        self.argument_name = argument_name
        self._call = re.compile(re.escape(call_token) + r"[ \t]*([^\s<>]+)")

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls: list[ToolCall] = []
        kept: list[str] = []
        pos = 0
        for match in self._call.finditer(text):
            kept.append(text[pos: match.start()])
            pos = match.end()
            calls.append(ToolCall(name=self.tool_name, arguments=json.dumps({self.argument_name: match.group(1)}),
                                  id=_call_id()))
        kept.append(text[pos:])
        return "".join(kept), calls


_PARSERS: dict[str, Callable[[], ToolCallParser]] = {"hermes": HermesToolCallParser, "compact": CompactToolCallParser}


def register_tool_call_parser(name: str, factory: Callable[[], ToolCallParser]) -> None:
    """Make `factory` available as `name` (replacing one of that name)."""
    if not name:
        raise ConfigError("a tool-call parser needs a name")
    _PARSERS[name] = factory


def tool_call_parser_names() -> tuple[str, ...]:
    return tuple(sorted(_PARSERS))


def get_tool_call_parser(name: str) -> ToolCallParser:
    """The parser registered as `name`; `ConfigError` lists the known ones."""
    try:
        factory = _PARSERS[name]
    except KeyError:
        raise ConfigError(f"unknown tool-call parser {name!r}; known: {', '.join(tool_call_parser_names())}") from None
    return factory()
