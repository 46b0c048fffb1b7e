"""Chat rendering, message matching and tool-call parsing (pure; the tiny model's real template)."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from rollpool.protocol.errors import ConfigError
from rollpool.workers.episodes import chat, toolcalls
from rollpool.workers.episodes.chat import EndpointError
from rollpool.workers.episodes.toolcalls import get_tool_call_parser, register_tool_call_parser

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tok(tiny_model_dir: pathlib.Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir)


def test_the_tiny_models_template_renders_tools_calls_and_results_with_special_call_markers(tok: Any) -> None:
    messages = [{"role": "user", "content": "add 1 and 2"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
                {"role": "tool", "tool_call_id": "c", "content": "3"}]
    text = chat.render(tok, chat.validate_messages(messages), TOOLS, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nTools:\n") and '"name": "add"' in text
    assert '<|im_start|>assistant\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call><|im_end|>\n' in text
    assert text.endswith("<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n")
    for marker in ("<tool_call>", "</tool_call>"):
        assert marker in tok.all_special_tokens and len(tok.encode(marker, add_special_tokens=False)) == 1
    assert chat.end_of_turn(tok, [{"role": "user", "content": "x"}], None) == "<|im_end|>\n"


def test_malformed_messages_are_refused_with_a_400_naming_what(tok: Any) -> None:
    cases = {
        "messages must be a non-empty list": [],
        "messages[0] must be an object": ["hi"],
        "messages[0].role must be one of": [{"role": "robot", "content": "x"}],
        "messages[1].content is required for role user": [{"role": "system", "content": "s"}, {"role": "user"}],
        "only text and image_url parts": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}],
        "image_url.url must be a data: URL": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        "this model takes no images": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,x"}}]}],
        "image parts are served in user messages only": [{"role": "system", "content": [{"type": "image_url", "image_url": "data:,"}]}],
        "tool_calls[0] needs function.name": [{"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}],
    }
    for message, raw in cases.items():
        with pytest.raises(EndpointError, match=message.replace("[", r"\[").replace("]", r"\]")) as info:
            chat.validate_messages(raw)
        assert info.value.status == 400 and info.value.body()["error"]["type"] == "invalid_request_error"
    # text parts are joined
    assert chat.validate_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])[0]["content"] == "ab"


def test_messages_equal_to_the_last_turns_keep_their_canonical_shape_and_any_other_is_checked_anew() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    first = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi", "name": "bob"},
             {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "3"},
             {"role": "tool", "tool_call_id": 1, "content": "4"},
             {"role": "user", "content": [{"type": "text", "text": "see "}, {"type": "image_url", "image_url": {"url": "data:,x"}}]}]
    shapes = chat.validate_messages(first, image_text="<img>")
    import copy

    again = [*copy.deepcopy(first), {"role": "assistant", "content": "ok"}]
    again[4]["tool_call_id"] = 1.0  # equal to 1, but its text is "1.0": checked anew
    got = chat.validate_messages(again, image_text="<img>", known=(first, shapes))
    assert got == chat.validate_messages(again, image_text="<img>")  # what a call without `known` gives
    assert [g is s for g, s in zip(got, shapes, strict=False)] == [True, True, True, True, False, False]
    assert got[4]["tool_call_id"] == "1.0" and got[5] == {"role": "user", "content": "see <img>", "image_urls": ["data:,x"]}
    changed = copy.deepcopy(again)
    changed[1]["content"] = "hello"  # a rewritten message: checked anew, and a bad one still refused
    got = chat.validate_messages(changed, image_text="<img>", known=(again, got))
    assert got[1]["content"] == "hello" and got[0] is shapes[0]
    changed[2] = {"role": "robot", "content": "x"}
    with pytest.raises(EndpointError, match=r"messages\[2\].role"):
        chat.validate_messages(changed, image_text="<img>", known=(again, got))


def test_an_image_part_stands_as_the_placeholder_text_and_its_image_is_part_of_the_message_key() -> None:
    raw = [{"role": "user", "content": [{"type": "text", "text": "see "}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                                        {"type": "text", "text": " and "}, {"type": "image_url", "image_url": "https://x/y.png"}]}]
    (msg,) = chat.validate_messages(raw, image_text="<IMG>")
    assert msg["content"] == "see <IMG> and <IMG>" and chat.image_urls([msg]) == ["data:image/png;base64,AA==", "https://x/y.png"]
    assert "image_urls" not in chat.render_message(msg)
    one, other = {**msg, "images": ["a", "b"]}, {**msg, "images": ["a", "c"]}
    assert chat.message_key(one) != chat.message_key(other) and chat.message_key(one) == chat.message_key(dict(one))


def test_a_message_sent_back_matches_whatever_null_fields_the_sdk_adds() -> None:
    ours = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    back = {"role": "assistant", "content": None, "refusal": None, "audio": None, "function_call": None, "annotations": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    (a,), (b,) = chat.validate_messages([ours]), chat.validate_messages([back])
    assert chat.message_key(a) == chat.message_key(b)
    edited = {**back, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}
    assert chat.message_key(chat.validate_messages([edited])[0]) != chat.message_key(a)
    assert chat.message_key({"role": "assistant", "content": ""}) == chat.message_key({"role": "assistant", "content": None})


def test_extension_needs_the_same_messages_tools_and_rendered_prefix(tok: Any) -> None:
    before = chat.validate_messages([{"role": "user", "content": "hi"}])
    prompt_text = chat.render(tok, before, None, add_generation_prompt=True)
    reply = {"role": "assistant", "content": "yo"}
    view = chat.after_reply(tok, before, reply, None, prompt_text, "yo<|im_end|>", True)
    assert view.owed == "\n"
    nxt = [*before, reply, {"role": "user", "content": "again"}]
    text = chat.render(tok, nxt, None, add_generation_prompt=True)
    assert chat.extension(view, tok, nxt, None, text) == "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    assert chat.extension(view, tok, nxt, TOOLS, chat.render(tok, nxt, TOOLS, add_generation_prompt=True)) is None  # other tools
    edited = [{"role": "user", "content": "hey"}, reply, nxt[2]]
    assert chat.extension(view, tok, edited, None, chat.render(tok, edited, None, add_generation_prompt=True)) is None
    # a turn cut by max_tokens owes the whole end-of-turn
    cut = chat.after_reply(tok, before, {"role": "assistant", "content": "y"}, None, prompt_text, "y", False)
    assert cut.owed == "<|im_end|>\n"


class _CountingTokenizer:
    """The tiny model's tokenizer, counting its chat-template renderings."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.renders = 0
        self.chat_template = tok.chat_template

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        self.renders += 1
        return self._tok.apply_chat_template(conversation, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


def test_a_deferred_view_extends_as_the_full_view_does_and_renders_only_when_the_fast_rule_fails(tok: Any) -> None:
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    cases = [  # (tools, reply, sampled text, finished on the end-of-turn token, next messages after the reply)
        (None, {"role": "assistant", "content": "yo"}, "yo<|im_end|>", True, [{"role": "user", "content": "again"}]),
        (None, {"role": "assistant", "content": "y"}, "y", False, [{"role": "user", "content": "again"}]),  # cut by max_tokens
        # the model sampled compact JSON; the template renders it spaced: only the full rule extends it
        (TOOLS, {"role": "assistant", "content": None, "tool_calls": [call]}, '<tool_call>{"name":"add","arguments":{"a":1}}</tool_call>',
         False, [{"role": "tool", "tool_call_id": "c", "content": "2"}]),
    ]
    before = chat.validate_messages([{"role": "user", "content": "hi"}])
    for tools, reply, sampled, on_eot, after in cases:
        prompt_text = chat.render(tok, before, tools, add_generation_prompt=True)
        eot = chat.end_of_turn(tok, before, tools)  # the episode probes it once per runner
        full = chat.after_reply(tok, before, reply, tools, prompt_text, sampled, on_eot)
        counting = _CountingTokenizer(tok)
        deferred = chat.deferred_view(before, reply, tools, prompt_text, sampled, on_eot, eot_text=eot)
        for nxt in ([*before, reply, *after], [{"role": "user", "content": "edited"}, reply, *after]):
            text = chat.render(tok, chat.validate_messages(nxt), tools, add_generation_prompt=True)
            want = chat.extension(full, tok, chat.validate_messages(nxt), tools, text)
            assert chat.extension(deferred, counting, chat.validate_messages(nxt), tools, text) == want
            assert chat.extension(deferred, counting, chat.validate_messages(nxt), None if tools else TOOLS, text) is None
        assert counting.renders == (0 if sampled.endswith("<|im_end|>") or not tools else 1)
        resolved = chat.resolve(deferred, tok)
        assert (resolved.text, resolved.owed) == (full.text, full.owed)
    assert want is None  # the edited history: a new segment


def test_the_hermes_parser_finds_calls_and_leaves_the_rest_as_content() -> None:
    p = get_tool_call_parser("hermes")
    content, calls = p.parse('Let me add. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
                             '<tool_call>{"name": "mul", "arguments": "{\\"b\\": 2}"}</tool_call>')
    assert content == "Let me add. " and [(c.name, c.arguments) for c in calls] == [("add", '{"a": 1}'), ("mul", '{"b": 2}')]
    assert calls[0].id != calls[1].id and calls[0].as_openai()["type"] == "function"
    for junk in ("<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>', "<tool_call>{\"name\": \"x\""):
        assert p.parse(junk) == (junk, [])


def test_the_compact_parser_finds_a_call_marker_and_one_argument_word() -> None:
    p = get_tool_call_parser("compact")
    content, calls = p.parse("<call> k2")
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("lookup", '{"key": "k2"}')]
    content, calls = p.parse("7 <call> k1 and <call>k3")
    assert content == "7  and " and [c.arguments for c in calls] == ['{"key": "k1"}', '{"key": "k3"}']
    # the marker alone, before another marker, or cut right after it is no call: the text stays content
    for no_call in ("<call>", "<call> <obs>", "<call>\nk2", "7 3", "k2 <call>"):
        assert p.parse(no_call) == (no_call, [])
    own = toolcalls.CompactToolCallParser("<fn>", tool_name="search", argument_name="q")
    assert [(c.name, c.arguments) for c in own.parse("<fn> cats")[1]] == [("search", '{"q": "cats"}')]
    with pytest.raises(ConfigError):
        toolcalls.CompactToolCallParser("")


def test_parsers_are_chosen_by_name() -> None:
    class Nothing:
        name = "nothing"

        def parse(self, text: str) -> tuple[str, list[Any]]:
            return text, []

    register_tool_call_parser("nothing", Nothing)
    try:
        assert get_tool_call_parser("nothing").parse("x") == ("x", [])
    finally:
        toolcalls._PARSERS.pop("nothing")
    assert {"compact", "hermes"} <= set(toolcalls.tool_call_parser_names())
    with pytest.raises(ConfigError, match="unknown tool-call parser 'nope'; known: compact, hermes"):
        get_tool_call_parser("nope")


def test_messages_compare_by_what_the_template_renders() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 19, "b": 23}'}}
    sent = {"role": "assistant", "content": None, "tool_calls": [call]}
    compact = {"role": "assistant", "content": "", "name": "math_agent", "tool_calls": [
        {"id": "other", "type": "function", "function": {"name": "add", "arguments": '{"b":23,"a":19}'}}]}
    assert chat.message_key(sent) == chat.message_key(compact)
    changed = {**sent, "tool_calls": [{**call, "function": {"name": "add", "arguments": '{"a": 19, "b": 24}'}}]}
    assert chat.message_key(sent) != chat.message_key(changed)
    assert chat.message_key({"role": "user", "content": "x"}) != chat.message_key({"role": "user", "content": "y"})


def test_responses_items_become_the_chat_messages_an_agent_would_send() -> None:
    from rollpool.workers.episodes import responses

    store: responses.ResponseStore = {"resp_1": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    body, conversation = responses.to_chat_body({
        "instructions": "Be brief.", "previous_response_id": "resp_1", "max_output_tokens": 9,
        "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}}],
        "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}}},
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "add"}]},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
                  {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
                  {"type": "function_call", "call_id": "c2", "name": "add", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "3"}]}, store)
    assert body["messages"][0] == {"role": "system", "content": "Be brief."}
    assert body["messages"][1:3] == store["resp_1"] and conversation == body["messages"][1:]
    assistant = body["messages"][4]
    assert assistant["content"] == "Sure." and [c["id"] for c in assistant["tool_calls"]] == ["c1", "c2"]
    assert body["messages"][5] == {"role": "tool", "tool_call_id": "c1", "content": "3"}
    assert body["tools"] == [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    assert body["max_tokens"] == 9 and body["response_format"]["json_schema"]["schema"] == {"type": "object"}
    with pytest.raises(chat.EndpointError, match="not served"):
        responses.to_chat_body({"input": "x", "frobnicate": 1}, store)


def test_the_direct_template_rendering_is_the_text_of_apply_chat_template(tiny_model_dir: pathlib.Path) -> None:
    transformers = pytest.importorskip("transformers")
    from rollpool.workers.engines.tokenizer import template_renderer

    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": [2, null], "c": {"d": "e"}}'}}
    conversations = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
         {"role": "user", "content": "again", "name": "bob"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add"}, {"role": "assistant", "content": None,
         "tool_calls": [call, {**call, "id": "c2", "function": {"name": "add", "arguments": "not json"}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "3"}, {"role": "developer", "content": "ok"}],
    ]
    assert template_renderer(tok) is not None
    for messages in conversations:
        for tools in (None, TOOLS):
            for gen in (True, False):
                canonical = chat.validate_messages(messages)
                want = tok.apply_chat_template([chat.render_message(m) for m in canonical], tokenize=False, add_generation_prompt=gen,
                                               **({"tools": TOOLS} if tools else {}))
                assert chat.render(tok, canonical, tools, add_generation_prompt=gen) == want
    renderer = template_renderer(tok)
    assert renderer is not None and getattr(renderer, "checked", False)  # the first call compared both, and they agreed


def test_the_plain_forms_kept_between_renderings_render_the_same_text(tok: Any) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    messages = chat.validate_messages([{"role": "system", "content": "be brief"}, {"role": "user", "content": "add"},
                                       {"role": "assistant", "content": None, "tool_calls": [call]},
                                       {"role": "tool", "tool_call_id": "c1", "content": "3"}])
    cache: dict[int, Any] = {}
    for turn in range(3):
        for tools in (None, TOOLS):
            want = chat.render(tok, messages, tools, add_generation_prompt=True)
            assert chat.render(tok, messages, tools, add_generation_prompt=True, plain_cache=cache) == want
        assert len(cache) == len(messages)
        messages = [*messages, {"role": "user", "content": f"more {turn}"}]
    assert [m["function"]["arguments"] for m in cache[id(messages[2])][1]["tool_calls"]] == [{"a": 1}]
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # the canonical message left as it was


def test_where_the_direct_rendering_differs_or_is_not_known_apply_chat_template_renders(tiny_model_dir: pathlib.Path) -> None:
    transformers = pytest.importorskip("transformers")
    from rollpool.workers.engines.tokenizer import template_renderer

    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    renderer = template_renderer(tok)
    assert renderer is not None

    class Other:
        def render(self, **_: Any) -> str:
            return "something else"

    renderer._compile = lambda _template: Other()  # type: ignore[attr-defined]  # a transformers that renders otherwise
    messages = [{"role": "user", "content": "hi"}]
    want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.render(tok, messages, None, add_generation_prompt=True) == want
    assert template_renderer(tok) is None  # refused for this tokenizer from now on
    assert chat.render(tok, messages, None, add_generation_prompt=True) == want

    class Overridden(type(tok)):  # type: ignore[misc]  # a tokenizer with its own apply_chat_template: never bypassed
        def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
            return "overridden"

    own = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    own.__class__ = Overridden
    assert template_renderer(own) is None
    assert chat.render(own, messages, None, add_generation_prompt=True) == "overridden"


# a Qwen-like template: a namespace set in a loop, method calls in loops and blocks (which the compiled template hands
# `_loop_vars`), loop attributes, filters, a macro, a global and a test
_BUSY_TEMPLATE = (
    "{%- macro show(m) -%}{{ m.get('content', '') | trim }}{%- endmacro -%}"
    "{%- set ns = namespace(last_user=-1, seen=[]) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set text = m['content'] or '' -%}"
    "<|im_start|>{{ m.get('role') }}{{ ' #' ~ loop.index if loop.last else '' }}\n"
    "{%- if m.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in text -%}"
    "{{ text.split('</think>')[-1].lstrip('\n') }}"
    "{%- else -%}{{ show(m) }}{%- endif -%}"
    "{%- for c in m.get('tool_calls') or [] -%}{{ c.function.name | upper }}{{ c.function.arguments | tojson }}{%- endfor -%}"
    "{%- if text.startswith('!') -%}{{ text[1:].replace('x', 'y') }}{%- endif -%}"
    "{%- if text is string and text | length > 3 -%}({{ text | length }}){{ '<{}:{}>'.format(m.role, text.upper()[:2]) }}{%- endif -%}"
    "<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if tools -%}{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}{%- endif -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)


def test_the_lean_template_renders_what_the_compiled_one_renders_and_refuses_what_it_refuses() -> None:
    pytest.importorskip("transformers")
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from rollpool.workers.engines.tokenizer import _lean_template

    compiled = _compile_jinja_template(_BUSY_TEMPLATE)
    lean = _lean_template(compiled, _BUSY_TEMPLATE)
    assert lean is not compiled and lean.environment is not compiled.environment
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    conversations = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": " be brief "}, {"role": "user", "content": "!xox"},
         {"role": "assistant", "content": "<think>a</think>\n\nyo", "tool_calls": [call]}, {"role": "user", "content": "again"},
         {"role": "assistant", "content": "<think>b</think>kept"}],
    ]
    for messages in conversations:
        for tools in (None, TOOLS):
            for gen in (True, False):
                kwargs = {"messages": messages, "tools": tools, "documents": None, "add_generation_prompt": gen, "eos_token": "<e>"}
                assert lean.render(**kwargs) == compiled.render(**kwargs)
    # what the sandbox refuses, it still refuses (the answer remembered, not skipped)
    for unsafe in ("{{ messages.append(1) }}", "{{ messages[0].update({}) }}", "{{ ''.__class__ }}", "{{ messages.pop() }}",
                   "{{ ''.format.__globals__ }}", "{{ '{0.__class__}'.format(1) }}", "{{ '{x.__class__}'.format_map({'x': 1}) }}",
                   "{{ 'a'.strip.__self__ }}", "{{ 'x'.mro }}"):
        got = []
        for template in (_compile_jinja_template(unsafe), _lean_template(_compile_jinja_template(unsafe), unsafe)):
            for _ in range(2):  # the second time from what the lean one remembered
                try:
                    got.append(("ok", template.render(messages=[{"role": "user", "content": "x"}])))
                except jinja2.exceptions.SecurityError as exc:
                    got.append(("refused", str(exc)))
                except jinja2.exceptions.UndefinedError as exc:
                    got.append(("undefined", str(exc)))
        assert len(set(got)) == 1, (unsafe, got)
    # a callable raising StopIteration is the same undefined value
    stop = "[{{ step(it) }}]"
    for template in (_compile_jinja_template(stop), _lean_template(_compile_jinja_template(stop), stop)):
        assert template.render(step=next, it=iter([])) == "[]"
    # anything but the stock sandboxed template is rendered as it is
    plain = jinja2.Environment().from_string("{{ x }}")
    assert _lean_template(plain, "{{ x }}") is plain


def test_encoding_and_decoding_on_the_backend_give_what_transformers_gives(tiny_model_dir: pathlib.Path) -> None:
    transformers = pytest.importorskip("transformers")
    from rollpool.workers.engines.tokenizer import decode_ids, encode_text

    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = ["", "hi", " leading space", "<|im_start|>user\nadd 1 and 2<|im_end|>\n<|im_start|>assistant\n", "naïve café ☕ 数字",
             '<tool_call>{"name": "add"}</tool_call>', "\n\n  \t"]
    for text in texts:
        assert encode_text(tok, text) == tok.encode(text, add_special_tokens=False)
        ids = tok.encode(text, add_special_tokens=False)
        for skip in (False, True):
            assert decode_ids(tok, ids, skip) == tok.decode(ids, skip_special_tokens=skip)
    specials = tok.encode("<|im_end|><|eos|>", add_special_tokens=False)
    assert decode_ids(tok, [5, *specials, 7], True) == tok.decode([5, *specials, 7], skip_special_tokens=True)
    # a backend set otherwise than transformers would set it for the call: transformers encodes
    tok.backend_tokenizer.enable_truncation(max_length=2)
    try:
        assert encode_text(tok, "a longer text than two tokens") == tok.encode("a longer text than two tokens", add_special_tokens=False)
    finally:
        tok.backend_tokenizer.no_truncation()
    assert len(encode_text(tok, "a longer text than two tokens")) > 2


def test_a_reply_decoded_once_is_the_text_of_its_two_decodes_and_otherwise_not_given(tiny_model_dir: pathlib.Path) -> None:
    import random

    transformers = pytest.importorskip("transformers")
    from rollpool.workers.engines.tokenizer import decode_ids, decode_reply

    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    decode_ids(tok, [5, 6], False)  # the direct decode checked (its first call)
    specials = set(tok.all_special_ids)
    plain = [i for i in range(len(tok)) if i not in specials]
    rnd = random.Random(5)
    given = 0
    for _ in range(3000):  # random ids: many end inside a character (byte-level tokens)
        content = [rnd.choice(plain) for _ in range(rnd.randrange(0, 30))]
        if rnd.random() < 0.2:
            content.insert(rnd.randrange(len(content) + 1), rnd.choice(sorted(specials)))
        output = content + rnd.choice([[], [rnd.choice(sorted(specials))], [rnd.randrange(len(tok))]])
        got = decode_reply(tok, content, output)
        if got is not None:
            given += 1
            assert got == (tok.decode(content, skip_special_tokens=True), tok.decode(output, skip_special_tokens=False))
        elif not specials & set(content) and len(output) == len(content) + 1:
            assert not tok.decode(output[-1:], skip_special_tokens=False)[:1].isascii()  # refused only for a non-ASCII start
    assert given > 1500
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert decode_reply(tok, [5, im_end, 6], [5, im_end, 6, im_end]) is None  # a special token in the content
    assert decode_reply(tok, [5, 6], [5, 7, im_end]) is None and decode_reply(tok, [5, 6], [5, 6, 7, 8]) is None


def test_decoding_by_the_byte_table_gives_what_the_backend_and_transformers_give(tiny_model_dir: pathlib.Path) -> None:
    import random

    transformers = pytest.importorskip("transformers")
    from rollpool.workers.engines import tokenizer as tokenizer_mod

    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer_mod.decode_ids(tok, [5, 6], False)  # the direct decode checked (its first call)
    codec = tokenizer_mod._codec(tok)
    assert codec is not None and codec._table() is not None  # a byte-level BPE: the table is taken
    specials = sorted(tok.all_special_ids)
    rnd = random.Random(7)
    joined = 0
    for _ in range(3000):  # random ids: many split a character, some hold special tokens, a few lie outside the vocabulary
        ids = [rnd.randrange(len(tok)) for _ in range(rnd.randrange(0, 40))]
        for _ in range(rnd.choice([0, 0, 1, 3])):
            ids.insert(rnd.randrange(len(ids) + 1), rnd.choice(specials))
        if rnd.random() < 0.02:
            ids.append(rnd.choice([len(tok) + 5, -1]))
        for skip in (False, True):
            got = codec._joined(ids, skip)
            if got is not None:
                joined += 1
                assert got == tok.backend_tokenizer.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)
            if -1 not in ids and len(tok) + 5 not in ids:
                assert tokenizer_mod.decode_ids(tok, ids, skip) == tok.decode(ids, skip_special_tokens=skip)
    assert joined > 3000
    assert codec._joined([5, specials[0], 6], False) is None  # a special token kept: the backend decodes around it
    assert codec._joined([5, -1], True) is None and codec._joined([5, len(tok) + 5], False) is None


def test_a_decoder_other_than_byte_level_takes_no_byte_table(tiny_model_dir: pathlib.Path) -> None:
    transformers = pytest.importorskip("transformers")
    decoders = pytest.importorskip("tokenizers.decoders")
    from rollpool.workers.engines import tokenizer as tokenizer_mod

    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.backend_tokenizer.decoder = decoders.Sequence([decoders.ByteLevel()])
    ids = tok.encode("naïve café", add_special_tokens=False)
    assert tokenizer_mod.decode_ids(tok, ids, True) == tok.decode(ids, skip_special_tokens=True)
    codec = tokenizer_mod._codec(tok)
    assert codec is not None and codec._table() is None and codec._joined(ids, True) is None


def test_a_tokenizer_of_its_own_is_encoded_and_decoded_by_its_own_methods(tiny_model_dir: pathlib.Path) -> None:
    transformers = pytest.importorskip("transformers")
    from rollpool.workers.engines.tokenizer import decode_ids, encode_text

    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)

    class Own(type(tok)):  # type: ignore[misc]
        def encode(self, text: Any, *args: Any, **kwargs: Any) -> Any:
            return [1, 2, 3]

        def decode(self, token_ids: Any, *args: Any, **kwargs: Any) -> str:
            return "own"

    tok.__class__ = Own
    assert encode_text(tok, "hi") == [1, 2, 3]
    assert decode_ids(tok, [5, 6], False) == "own"


def test_where_the_backend_answers_otherwise_on_first_use_transformers_encodes_and_decodes(tiny_model_dir: pathlib.Path) -> None:
    transformers = pytest.importorskip("transformers")
    from rollpool.workers.engines import tokenizer as tokenizer_mod

    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    codec = tokenizer_mod._codec(tok)
    assert codec is not None
    real = codec.backend

    class Other:  # a backend whose answers differ from transformers' (a transformers this was not written against)
        truncation = padding = None
        encode_special_tokens = real.encode_special_tokens

        def encode_batch_fast(self, texts: Any, add_special_tokens: bool) -> Any:
            return [type("E", (), {"ids": [0]})() for _ in texts]

        def decode(self, ids: Any, skip_special_tokens: bool) -> str:
            return "other"

    codec.backend = Other()
    for _ in range(2):
        assert tokenizer_mod.encode_text(tok, "hello there") == tok.encode("hello there", add_special_tokens=False)
        assert tokenizer_mod.decode_ids(tok, [40, 41], False) == tok.decode([40, 41])
    assert codec.encode_ok is False and codec.decode_ok is False


def test_the_lean_template_leaves_a_strs_format_methods_to_the_sandboxs_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """jinja before 3.1.5 sandboxes ``str.format`` and ``format_map`` in `SandboxedEnvironment.call` (from 3.1.5 in
    `getattr`): the lean template's fast call of built-in methods must hand those two to the stock call, whatever the
    jinja, or a format field could reach any attribute (``'{0.__class__}'.format``)."""
    pytest.importorskip("jinja2")
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from rollpool.workers.engines.tokenizer import _lean_template

    stock_call = ImmutableSandboxedEnvironment.call

    def old_jinja_call(__self: Any, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # as before 3.1.5
        if getattr(__obj, "__name__", "") in ("format", "format_map") and isinstance(getattr(__obj, "__self__", None), str):
            raise SecurityError("a str's format method is sandboxed in call")
        return stock_call(__self, __context, __obj, *args, **kwargs)

    monkeypatch.setattr(ImmutableSandboxedEnvironment, "call", old_jinja_call)
    for source in ("{{ f(1) }}", "{{ f({'x': 1}) }}"):
        compiled = ImmutableSandboxedEnvironment().from_string(source)
        lean = _lean_template(compiled, source)
        assert lean is not compiled
        for template in (compiled, lean):
            for f in ("{0.__class__}".format, "{x.__class__}".format_map):
                with pytest.raises(SecurityError):
                    template.render(f=f)
    source = "{{ f() }}|{{ 'a b'.split()|length }}"
    compiled = ImmutableSandboxedEnvironment().from_string(source)
    assert _lean_template(compiled, source).render(f="a".upper) == compiled.render(f="a".upper) == "A|2"  # the fast call
