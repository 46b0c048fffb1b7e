"""Grammar-constrained sampling through xgrammar (the grammar library SGLang uses): the `hf` engine's masks, and
the grammar text the `sglang` engine sends to SGLang's grammar backend.

`GrammarBackend` compiles an `OutputConstraint` for one tokenizer (cached by value, so an episode's
repeated schema compiles once) and gives each constrained sample a `GrammarState`: ``mask(logits)``
returns the logits with every token the grammar forbids at ``-inf``, ``accept(token)`` advances it.
Once the grammar is complete only the request's stop tokens are allowed, so a constrained turn ends
with one. JSON is compiled without free whitespace (compact separators): a model cannot spend its
token budget on blanks.

`constraint_ebnf` writes the same grammar as EBNF text for an engine that compiles grammars itself (SGLang's
``ebnf`` sampling parameter, compiled there by the same library). Such an engine ends a finished grammar with the
model's end-of-sequence token only, so the tokens given as `end_tokens` (a chat turn's end-of-turn, e.g.
``<|im_end|>``: the request's stop tokens that are not end-of-sequence) are made the grammar's last token
(``Token(id)``): the turn ends as the chat template renders it, and the next turn extends the same sequence.

xgrammar is imported here only, lazily (extra ``rollpool[grammar]``); a constraint that does not
compile (a malformed schema) raises `RequestRefusedError`, failing that request only.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

import torch

from rollpool.protocol.errors import RequestRefusedError
from rollpool.workers.engines.base import OutputConstraint

__all__ = ["GrammarBackend", "GrammarState", "constraint_ebnf"]

_ANY_OBJECT = '{"type": "object"}'


def _xgrammar(engine: str = "hf") -> Any:
    try:
        import xgrammar
    except ImportError as exc:
        raise RequestRefusedError(f"constrained decoding on the {engine} engine needs xgrammar in the worker: "
                                  "pip install 'rollpool[grammar]'") from exc
    return xgrammar


def _grammar(xgr: Any, constraint: OutputConstraint) -> Any:
    """`constraint` as one uncompiled xgrammar ``Grammar``: `begin`, the JSON value (no free whitespace), `end`."""
    schema = constraint.json_schema or _ANY_OBJECT
    try:
        json.loads(schema)
        body = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
        parts = [xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}") for text in (constraint.begin,) if text]
        parts.append(body)
        parts += [xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}") for text in (constraint.end,) if text]
        return xgr.Grammar.concat(*parts) if len(parts) > 1 else body
    except Exception as exc:  # the request's schema, not the engine, is at fault
        raise RequestRefusedError(f"the output constraint does not compile: {type(exc).__name__}: {exc}") from exc


def constraint_ebnf(constraint: OutputConstraint, end_tokens: Sequence[int] = (), engine: str = "sglang") -> str:
    """`constraint` as xgrammar EBNF text, then one of `end_tokens` when given (see the module docstring);
    `RequestRefusedError` for a schema that does not compile or without xgrammar (naming `engine`)."""
    xgr = _xgrammar(engine)
    grammar = _grammar(xgr, constraint)
    ends = sorted({int(t) for t in end_tokens})
    if ends:
        grammar = xgr.Grammar.concat(grammar, xgr.Grammar.from_ebnf(f"root ::= {' | '.join(f'Token({t})' for t in ends)}"))
    return str(grammar)


class GrammarState:
    """One constrained sample's place in its grammar."""

    def __init__(self, xgr: Any, matcher: Any, vocab_size: int) -> None:
        self._xgr = xgr
        self._matcher = matcher
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of the 1-D `logits` with the tokens the grammar forbids next at -inf."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        out = logits.clone().unsqueeze(0)
        self._xgr.apply_token_bitmask_inplace(out, self._bitmask.to(out.device))
        return out[0]

    def accept(self, token: int) -> None:
        self._matcher.accept_token(int(token))


class GrammarBackend:
    """Compiles constraints for one tokenizer and vocabulary (see the module docstring); thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._xgr = _xgrammar()
        self.vocab_size = vocab_size
        info = self._xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = self._xgr.GrammarCompiler(info, max_threads=1)
        self._cache: dict[OutputConstraint, Any] = {}
        self._lock = threading.Lock()

    def compile(self, constraint: OutputConstraint) -> Any:
        with self._lock:
            compiled = self._cache.get(constraint)
            if compiled is None:
                compiled = self._cache[constraint] = self._compile(constraint)
                if len(self._cache) > 256:
                    self._cache.pop(next(iter(self._cache)))
            return compiled

    def _compile(self, constraint: OutputConstraint) -> Any:
        grammar = _grammar(self._xgr, constraint)
        try:
            return self._compiler.compile_grammar(grammar)
        except Exception as exc:  # the request's schema, not the engine, is at fault
            raise RequestRefusedError(f"the output constraint does not compile: {type(exc).__name__}: {exc}") from exc

    def state(self, compiled: Any, stop_token_ids: Sequence[int]) -> GrammarState:
        matcher = self._xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(set(stop_token_ids)) or None)
        return GrammarState(self._xgr, matcher, self.vocab_size)
