"""The model directory's tokenizer, for an engine that keeps none in this process (sglang), and its chat template.

The episode endpoint renders chat messages and decodes turns in the worker; the `hf` engine
exposes its tokenizer, the sglang engine tokenizes in its child. `load_tokenizer` gives the
worker the same tokenizer from the model directory, or None (and a warning) when it cannot.

`template_renderer(tokenizer)`: the tokenizer's compiled chat template, called as
``apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=...)`` calls it, for
messages and tools that are already plain JSON dicts (what the endpoint renders): the same text, without
transformers' per-call conversion of every message (about two thirds of a rendering's CPU for a short
template). Its first call is checked against ``apply_chat_template``; where they differ, or where the
tokenizer or transformers is not the kind this was written against, it is None and the endpoint calls
``apply_chat_template`` as before.

`encode_text(tokenizer, text)` and `decode_ids(tokenizer, ids, skip_special_tokens)`: ``tokenizer.encode(text,
add_special_tokens=False)`` and ``tokenizer.decode(ids, ...)`` of a transformers fast tokenizer, on its Rust
backend directly (``backend_tokenizer``): encoding without the offsets nobody reads (``encode_batch_fast``), and
neither call converting or checking its arguments in Python. Taken only while the backend is set as transformers
would set it for the call (no truncation, no padding, its special-token splitting) and the decode needs no
clean-up; the first of each is checked against the transformers call. Any other tokenizer: the transformers call.
Where the backend's decoder is one ``ByteLevel`` (GPT-2 style byte-level BPE: Llama 3, Qwen, ...), a decode of model
tokens (special ones skipped or not, no other added token kept) is the UTF-8 reading of their bytes from a table made
once and checked against the backend (`_Codec._table`): the same text, about a third of the backend's time.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["decode_ids", "decode_reply", "encode_text", "load_tokenizer", "template_renderer"]

Renderer = Callable[[list[dict[str, Any]], Sequence[dict[str, Any]] | None, bool], str]
"""(plain messages, plain tool dicts or None, add_generation_prompt) -> the rendered text."""

log = logging.getLogger(__name__)


def load_tokenizer(model: str) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        log.warning("no tokenizer for %s: transformers is not installed (the chat endpoint refuses, token-level episodes run)", model)
        return None
    try:
        return AutoTokenizer.from_pretrained(model)
    except Exception as exc:  # noqa: BLE001 - the endpoint then refuses text requests and says so
        log.warning("no tokenizer from %s: %s", model, exc)
        return None


_RENDERERS: weakref.WeakKeyDictionary[Any, _TemplateRenderer | None] = weakref.WeakKeyDictionary()


class _TemplateRenderer:
    """See the module docstring: `__call__` renders as ``apply_chat_template`` does, checked on the first call."""

    def __init__(self, tokenizer: Any, compile_template: Callable[[str], Any]) -> None:
        self._tokenizer = weakref.ref(tokenizer)
        self._compile = compile_template
        self._templates: dict[str, Any] = {}
        """Template source -> the template rendered (`_lean_template` of the compiled one)."""
        self.checked = False
        self.refused = False

    def __call__(self, messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, add_generation_prompt: bool) -> str:
        tok = self._tokenizer()
        if tok is None:
            raise RuntimeError("the tokenizer of this chat template renderer is gone")
        if self.refused or not self.checked:
            return self._first(tok, messages, tools, add_generation_prompt)
        return self._render(tok, messages, tools, add_generation_prompt)

    def _render(self, tok: Any, messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
                add_generation_prompt: bool) -> str:
        # what apply_chat_template -> render_jinja_template hand the compiled template: the template chosen by
        # get_chat_template, the messages, the tools, no documents, the generation prompt flag and the special tokens
        source = tok.get_chat_template(None, list(tools) if tools else None)
        template = self._templates.get(source)
        if template is None:
            template = _lean_template(self._compile(source), source)
            if len(self._templates) < 16:
                self._templates[source] = template
        return str(template.render(messages=messages, tools=list(tools) if tools else None, documents=None,
                                   add_generation_prompt=add_generation_prompt, **tok.special_tokens_map))

    def _first(self, tok: Any, messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
               add_generation_prompt: bool) -> str:
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
        if tools:
            kwargs["tools"] = list(tools)
        want = str(tok.apply_chat_template(messages, **kwargs))  # raises as it always did (the caller's 400)
        if not self.refused:
            try:
                same = self._render(tok, messages, tools, add_generation_prompt) == want
            except Exception:  # noqa: BLE001 - rendered otherwise than apply_chat_template: not used
                same = False
            self.checked, self.refused = same, not same
            if not same:
                log.info("chat template: rendered by apply_chat_template (the direct rendering differs for this tokenizer)")
        return want


_STR_FORMATS = frozenset({"format", "format_map"})
"""The str methods jinja's sandbox wraps (their fields could reach any attribute): never on the lean template's fast paths."""


def _lean_template(compiled: Any, source: str) -> Any:
    """`compiled` (transformers' template) compiled again from `source` in an overlay of its sandboxed environment that
    renders the same text with less work per rendering, or `compiled` itself where its environment is not the stock
    `ImmutableSandboxedEnvironment` this was written against.

    What the overlay changes (about a third of a rendering's CPU for a short template; measured alone, 55 -> 37 us at
    12 messages), each giving what the stock environment gives:

    - ``is_safe_attribute`` remembers its answer per (type, attribute) for the built-in types and jinja's loop and
      namespace objects: the stock check reads only the attribute's name and the object's type (``isinstance``
      against the function, method, code and frame types and the mutable ABCs), never the value, for these types;
    - ``getattr`` of an attribute already known safe on a built-in type (``content.strip``, ``message.get``) reads it
      without the stock path's checks, which would pass it unchanged: such a type's attributes are its own methods
      and descriptors, and the only ones the sandbox wraps (``str.format``, ``str.format_map``) take the stock path;
    - ``call`` of a built-in method (``message.get(...)``, ``content.strip()``) calls it as the sandbox's `call` then
      does: such a method can carry neither ``unsafe_callable`` nor ``alters_data`` nor a jinja pass argument, and a
      ``StopIteration`` it raises still becomes the same undefined value;
    - the template's globals are one plain dict (jinja keeps a ``ChainMap`` over the environment's, which it walks in
      Python twice a rendering), the same names and values: neither side's globals change after compiling.

    The renderer's first call is still checked against ``apply_chat_template``; the environment of `compiled`, which
    transformers caches and renders with, is left as it is.
    """
    try:
        import types

        from jinja2.environment import Template
        from jinja2.runtime import LoopContext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from jinja2.utils import Namespace
    except ImportError:
        return compiled
    env = getattr(compiled, "environment", None)
    stock = (isinstance(compiled, Template) and type(env) is ImmutableSandboxedEnvironment
             and "is_safe_attribute" not in vars(env) and "call" not in vars(env)
             and type(compiled).render is Template.render and type(compiled).new_context is Template.new_context)
    if not stock or not isinstance(env, ImmutableSandboxedEnvironment):
        return compiled
    overlay = env.overlay()
    stock_safe, stock_call, stock_getattr = overlay.is_safe_attribute, overlay.call, overlay.getattr
    builtin_types = frozenset({str, dict, list, tuple, int, float, bool, type(None)})
    known_types = builtin_types | {LoopContext, Namespace}
    answers: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(obj: Any, attr: str, value: Any) -> bool:
        kind = type(obj)
        if kind not in known_types:
            return bool(stock_safe(obj, attr, value))
        found = answers.get((kind, attr))
        if found is None:
            found = bool(stock_safe(obj, attr, value))
            if len(answers) < 4096:
                answers[(kind, attr)] = found
        return found

    def getattr_(obj: Any, attribute: str) -> Any:
        kind = type(obj)
        if kind in builtin_types and answers.get((kind, attribute)) and attribute not in _STR_FORMATS:
            try:
                return getattr(obj, attribute)
            except AttributeError:
                pass
        return stock_getattr(obj, attribute)

    def call(__context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # the sandbox's names: no clash with kwargs
        if type(__obj) is not types.BuiltinMethodType or (type(getattr(__obj, "__self__", None)) is str and __obj.__name__ in _STR_FORMATS):
            # (a str's format methods take the stock path: jinja before 3.1.5 sandboxes them in `call`, not `getattr`)
            return stock_call(__context, __obj, *args, **kwargs)
        kwargs.pop("_block_vars", None)  # what the compiled template hands `Context.call` inside loops and blocks
        kwargs.pop("_loop_vars", None)
        try:
            return __obj(*args, **kwargs)
        except StopIteration:  # what `Context.call` answers
            return __context.environment.undefined("value was undefined because a callable raised a StopIteration exception")

    overlay.is_safe_attribute = is_safe_attribute  # type: ignore[method-assign]
    overlay.call = call  # type: ignore[method-assign]
    overlay.getattr = getattr_  # type: ignore[method-assign]
    lean = overlay.from_string(source)
    lean.globals = dict(lean.globals)
    return lean


def template_renderer(tokenizer: Any) -> Renderer | None:
    """The direct renderer of `tokenizer`'s chat template (module docstring), or None: use ``apply_chat_template``."""
    try:
        known = tokenizer in _RENDERERS
    except TypeError:  # neither hashable nor weakly referable: not a transformers tokenizer
        return None
    if known:
        found = _RENDERERS[tokenizer]
        return None if found is None or found.refused else found
    renderer: _TemplateRenderer | None = None
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.utils.chat_template_utils import _compile_jinja_template, render_jinja_template  # noqa: F401
    except ImportError:
        pass
    else:
        stock = (isinstance(tokenizer, PreTrainedTokenizerBase)
                 and type(tokenizer).apply_chat_template is PreTrainedTokenizerBase.apply_chat_template
                 and type(tokenizer).get_chat_template is PreTrainedTokenizerBase.get_chat_template)
        if stock:
            renderer = _TemplateRenderer(tokenizer, _compile_jinja_template)
    try:
        _RENDERERS[tokenizer] = renderer
    except TypeError:
        return None
    return renderer


class _Codec:
    """The direct encode and decode of one fast tokenizer (module docstring); `*_ok`: None until checked."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.encode_ok: bool | None = None if callable(getattr(backend, "encode_batch_fast", None)) else False
        self.decode_ok: bool | None = None
        self.special_ids: frozenset[int] | None = None
        """The ids the backend's decode drops with ``skip_special_tokens`` (its added tokens marked special)."""
        self.token_texts: dict[int, str] = {}
        """One token decoded alone (with its special text), for `decode_reply`."""
        self.table: tuple[dict[int, bytes], frozenset[int]] | None = None
        """`_table`: (id -> the token's bytes, the special ids in it as ``b""``); None until built or where not taken."""
        self.table_built = False

    def _table(self) -> tuple[dict[int, bytes], frozenset[int]] | None:
        """Each model token's bytes, for a backend whose decoder is one ``ByteLevel`` and whose decode is checked
        (`decode_ok`): its decode is then the UTF-8 reading (invalid bytes replaced as Python's ``replace`` does, as
        Rust's lossy reading does) of the tokens' bytes in order, which `_joined` makes from this table without
        converting each id to a Rust string and back (about a third of the backend's time). Added tokens are not in
        the table (a decode keeping one is the backend's: it decodes around them), except the special ones as nothing,
        for a decode that skips them (``skip_special_tokens``: the bytes on both sides are read together). Built once;
        checked against the backend on sampled tokens, on every byte alone and on a character split around a skipped
        special token; any difference, and there is none (the backend decodes)."""
        if not self.table_built:
            self.table_built = True
            try:
                self.table = self._build_table()
            except Exception as exc:  # noqa: BLE001 - an unexpected tokenizer: the backend decodes, as before
                log.debug("no byte table for this tokenizer: %s", exc)
        return self.table

    def _build_table(self) -> tuple[dict[int, bytes], frozenset[int]] | None:
        from tokenizers.decoders import ByteLevel

        b = self.backend
        if self.decode_ok is not True or type(b.decoder) is not ByteLevel:
            return None
        to_byte = {c: i for i, c in _byte_alphabet().items()}
        table: dict[int, bytes] = {}
        for token, i in b.get_vocab(with_added_tokens=False).items():
            try:
                table[i] = bytes([to_byte[c] for c in token])
            except KeyError:  # a character outside the byte alphabet: such a token's decode is the backend's
                continue
        added = b.get_added_tokens_decoder()
        for i in added:
            table.pop(i, None)
        specials = frozenset(i for i, t in added.items() if t.special)
        # checked: sampled tokens alone, every single byte, and a character split around a skipped special token
        step = max(1, len(table) // 256)
        sample = sorted(table)[::step]
        single = {byte: i for i, tb in table.items() if len(tb) == 1 for byte in tb}
        if len(single) < 256 or not specials:
            return None
        for i in [*sample, *single.values()]:
            if str(b.decode([i], skip_special_tokens=False)) != table[i].decode("utf-8", "replace"):
                return None
        probe = [single[0x41], single[0xC3], min(specials), single[0xA9], single[0xF0], single[0x9F], single[0x41]]
        if str(b.decode(probe, skip_special_tokens=True)) != "A\u00e9\ufffdA":
            return None
        table.update((i, b"") for i in specials)
        return table, specials

    def _joined(self, ids: Sequence[int], skip_special_tokens: bool) -> str | None:
        """The backend's decode of `ids` from the byte table (`_table`), or None where it does not hold it."""
        found = self._table()
        if found is None:
            return None
        table, specials = found
        if not skip_special_tokens and not specials.isdisjoint(ids):  # a special token kept: the backend decodes around it
            return None
        try:
            raw = b"".join(map(table.__getitem__, ids))
        except (KeyError, TypeError):  # another added token, an id outside the vocabulary: the backend decides
            return None
        return raw.decode("utf-8", "replace")

    def decode_reply(self, tok: Any, content: Sequence[int], output: Sequence[int]) -> tuple[str, str] | None:
        """(``decode(content, skip_special_tokens=True)``, ``decode(output, skip_special_tokens=False)``) by one decode,
        where `output` is `content` or `content` and one more token, and that is the same text; else None.

        The same text where: the direct decode is in use and checked; the backend's decoder is one ``ByteLevel``
        (its text is the UTF-8 reading, invalid bytes replaced, of every token's bytes in order); no id of `content` is
        special (so skipping them changes nothing); and the one more token's bytes start with an ASCII byte (so they
        cannot complete a character the content's bytes left open: the replacement is the same before it as at the end).
        """
        from tokenizers.decoders import ByteLevel

        n = len(content)
        if self.decode_ok is not True or tok.clean_up_tokenization_spaces or not isinstance(self.backend.decoder, ByteLevel):
            return None
        if len(output) not in (n, n + 1) or list(output[:n]) != list(content):
            return None
        if self.special_ids is None:
            self.special_ids = frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)
        if not self.special_ids.isdisjoint(content):
            return None
        ids = content if type(content) is list else [int(t) for t in content]
        text = self._joined(ids, False)
        if text is None:
            text = str(self.backend.decode(ids, skip_special_tokens=False))
        if len(output) == n:
            return text, text
        last = int(output[n])
        tail = self.token_texts.get(last)
        if tail is None:
            tail = str(self.backend.decode([last], skip_special_tokens=False))
            if len(self.token_texts) < 4096:
                self.token_texts[last] = tail
        if not tail or not tail[0].isascii():  # its first byte not ASCII (a character, or one replaced)
            return None
        return text, text + tail

    def encode(self, tok: Any, text: str) -> list[int]:
        b = self.backend
        if (self.encode_ok is False or b.truncation is not None or b.padding is not None
                or b.encode_special_tokens != bool(getattr(tok, "split_special_tokens", False))):
            return list(tok.encode(text, add_special_tokens=False))
        ids: list[int] = b.encode_batch_fast([text], add_special_tokens=False)[0].ids
        if self.encode_ok is None:
            want = list(tok.encode(text, add_special_tokens=False))
            self.encode_ok = ids == want
            return want
        return ids

    def decode(self, tok: Any, ids: Sequence[int], skip_special_tokens: bool) -> str:
        if self.decode_ok is False or tok.clean_up_tokenization_spaces:
            return _slow_decode(tok, ids, skip_special_tokens)
        if self.decode_ok is True:
            joined = self._joined(ids if type(ids) is list else [int(t) for t in ids], skip_special_tokens)
            if joined is not None:
                return joined
        text = str(self.backend.decode(ids if type(ids) is list else [int(t) for t in ids], skip_special_tokens=skip_special_tokens))
        if self.decode_ok is None:
            want = _slow_decode(tok, ids, skip_special_tokens)
            self.decode_ok = text == want
            return want
        return text


def _byte_alphabet() -> dict[int, str]:
    """The ``ByteLevel`` alphabet: the character each byte is written as in a byte-level vocabulary (GPT-2's)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), ord("\u00ff") + 1)]
    out = {byte: chr(byte) for byte in printable}
    n = 0
    for byte in range(256):
        if byte not in out:
            out[byte] = chr(256 + n)
            n += 1
    return out


def _slow_decode(tok: Any, ids: Sequence[int], skip_special_tokens: bool) -> str:
    # an int64 array: transformers converts an array in one call, a list element by element
    import numpy as np

    return str(tok.decode(np.asarray(ids, dtype=np.int64), skip_special_tokens=skip_special_tokens))


_CODECS: weakref.WeakKeyDictionary[Any, _Codec | None] = weakref.WeakKeyDictionary()


def _codec(tokenizer: Any) -> _Codec | None:
    try:
        known = tokenizer in _CODECS
    except TypeError:
        return None
    if known:
        return _CODECS[tokenizer]
    codec: _Codec | None = None
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        pass
    else:
        cls = type(tokenizer)
        stock = (isinstance(tokenizer, TokenizersBackend) and cls.encode is PreTrainedTokenizerBase.encode
                 and cls.decode is PreTrainedTokenizerBase.decode and cls._encode_plus is TokenizersBackend._encode_plus
                 and cls._decode is TokenizersBackend._decode)
        backend = getattr(tokenizer, "backend_tokenizer", None) if stock else None
        if backend is not None:
            codec = _Codec(backend)
    try:
        _CODECS[tokenizer] = codec
    except TypeError:
        return None
    return codec


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer.encode(text, add_special_tokens=False)`` as a list (see the module docstring)."""
    codec = _codec(tokenizer)
    return codec.encode(tokenizer, text) if codec is not None else list(tokenizer.encode(text, add_special_tokens=False))


def decode_reply(tokenizer: Any, content: Sequence[int], output: Sequence[int]) -> tuple[str, str] | None:
    """(`content` decoded without special tokens, `output` decoded with them) by one decode where that is the same text
    as two (`_Codec.decode_reply`), else None (the caller decodes each)."""
    codec = _codec(tokenizer)
    return codec.decode_reply(tokenizer, content, output) if codec is not None else None


def decode_ids(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool) -> str:
    """``tokenizer.decode(ids, skip_special_tokens=...)`` (see the module docstring)."""
    codec = _codec(tokenizer)
    return codec.decode(tokenizer, ids, skip_special_tokens) if codec is not None else _slow_decode(tokenizer, ids, skip_special_tokens)
