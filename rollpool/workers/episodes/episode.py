"""One running episode: its recording, its turns on the engine, and the `EpisodeContext` its code sees.

Both ways in record into the same `EpisodeRecording`:

- token level: `EpisodeContext.generate` samples one turn on the current sequence (or on the
  given ``input_ids``, by the prefix rule of `recording`), `EpisodeContext.append` inserts tokens;
- OpenAI level: the endpoint calls `Episode.chat` / `Episode.completion` with the request body.

Images (a vision-language engine, `EngineInfo.images`): a chat request's ``image_url`` parts (data: URLs; an
http(s) URL only where the worker fetches images, ``--image-fetch``, else 400) are read and checked by the
worker's image rules (`rollpool.workers.images`: count, bytes, pixels, format, a full decode) before any
rendering; a bad one is a 400 naming the part, and records nothing. Each stands in the rendered prompt as the
model's placeholder (one image token); the segment keeps the images and gives all of them to the engine
every turn (`recording` says what the trajectory then holds).

An episode runs one turn at a time (a lock): requests of one episode are served in order. Once the
runner closes the episode (it returned, raised, timed out or was cancelled) its running turn is
aborted and every later call is refused (HTTP 410 at the endpoint, `EpisodeClosedError` at the
token level), so a thread that outlives its episode cannot change what was recorded.

Replay: every sampled turn is handed to ``on_turn`` as a `RecordedTurn` (the worker streams them to the
broker). An episode given the turns an earlier attempt recorded (``replay``) serves turn k from its
record, without sampling, when its request to the engine is the one recorded (`request_digest`: the
whole token sequence, the sampling and any grammar) and the record's versions are still acceptable;
the first turn whose request differs (a non-deterministic tool, a clock in the prompt, a random
choice) ends the replay, and from it on every turn is sampled as usual. A replayed turn records the
tokens, logprobs and versions of the record: the trajectory is the one the first attempt would have
delivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import hashlib
import inspect
import itertools
import json
import logging
import math
import queue
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numpy as np

from rollpool.protocol.errors import RequestRefusedError, RollpoolError
from rollpool.protocol.messages import FinishReason, Prompt, PromptImage, RecordedTurn, SamplingParams
from rollpool.protocol.sampling import sampling_problem
from rollpool.workers.engines.base import (
    ConstrainedEngine,
    Engine,
    OutputConstraint,
    SampleOutput,
    TokenIds,
    can_constrain,
)
from rollpool.workers.engines.tokenizer import decode_ids, decode_reply
from rollpool.workers.engines.tokenizer import encode_text as _encode_text
from rollpool.workers.episodes import chat
from rollpool.workers.episodes.chat import EndpointError
from rollpool.workers.episodes.recording import EpisodeRecording, RecordingMark, Segment, SegmentImage
from rollpool.workers.episodes.toolcalls import ToolCall, ToolCallParser
from rollpool.workers.images import ImagePolicy, LoadedImage, load_image

__all__ = ["ContextLengthExceededError", "Episode", "EpisodeClosedError", "EpisodeContext", "EpisodeStats", "TokenizerLane",
           "decode_tokens", "encode_text", "recorded_turn", "request_digest"]

T = TypeVar("T")


def decode_tokens(tokenizer: Any, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
    """``tokenizer.decode(token_ids)``: on a fast tokenizer's Rust backend directly where that gives the same text
    (`rollpool.workers.engines.tokenizer.decode_ids`), else the ids handed over as an int64 array (a Hugging Face
    tokenizer checks every element of a list in Python before it decodes, and converts an array in one call)."""
    return decode_ids(tokenizer, token_ids, skip_special_tokens)


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer.encode(text, add_special_tokens=False)`` as a list, on a fast tokenizer's Rust backend directly where
    that gives the same ids (`rollpool.workers.engines.tokenizer.encode_text`)."""
    return _encode_text(tokenizer, text)


_ID_PREFIX = secrets.token_hex(8)
_ids = itertools.count()


def _response_id(prefix: str) -> str:
    """``chatcmpl-`` / ``cmpl-`` and 32 hex digits, unique in this process and across processes (a random prefix and a
    counter: `uuid.uuid4` reads the OS's random source on every call, a system call on every turn)."""
    return f"{prefix}-{_ID_PREFIX}{next(_ids):016x}"


class TokenizerLane:
    """One thread for a runner's tokenizer and chat-template work, off the event loop; calls run one at a time, in order.

    ``loop.run_in_executor`` on a one-thread `ThreadPoolExecutor` costs, per call, a concurrent future (with a
    lock and a condition), a work item, a thread-count check and a second future chained to it; every turn of
    every episode makes two such calls. Here a call is a queue entry and one ``call_soon_threadsafe`` back.
    A call whose caller was cancelled still runs (as in an executor); its result is dropped. After `shutdown`
    queued calls do not run and their callers are cancelled.

    `call(..., small=True)` runs the call at once on the caller's thread (the event loop) when the lane is idle:
    nothing queued and nothing running, so the tokenizer is never used by two threads at once. A small call
    (a turn's rendering and tokenizing within `INLINE_CHARS`, well under a millisecond) costs less there than the
    two hand-offs between threads, which under a busy loop each wait for the GIL (up to its 5 ms switch
    interval); a larger one, or any call while the lane holds work, goes to the thread as before.

    A large call (`call`'s ``large``: past `LARGE_CHARS`, one agent's huge message) runs on a second thread of its
    own, in order among large calls, with a copy of the tokenizer made there on first use (given as `tokenizer`): the
    argument that is the runner's tokenizer is swapped for the copy, so each tokenizer is still used by one thread at
    a time, and the other episodes' turns do not queue behind it. Without a tokenizer, or one that cannot be copied,
    a large call takes the lane as any other.
    """

    INLINE_CHARS = 16_384
    """The most characters of text a call may render or tokenize and still count as small (`call`'s ``small``)."""
    LARGE_CHARS = 262_144
    """Past this many characters a call counts as large (`call`'s ``large``): about 64k tokens, seconds to tokenize."""

    def __init__(self, name: str = "rollpool-episode-tokenizer", tokenizer: Any = None) -> None:
        self._queue: queue.SimpleQueue[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue())
        self._closed = False
        self._submitted = 0
        """Calls given to the thread (written on the loop only)."""
        self._completed = 0
        """Calls the thread finished (written by the thread only): the lane is idle when it equals `_submitted`."""
        self.inline_calls = 0
        """Calls run at once on the caller's thread (`call`'s ``small``)."""
        self.large_calls = 0
        """Calls run on the large lane with the tokenizer's copy (`call`'s ``large``)."""
        self.name = name
        self._tokenizer = tokenizer
        self._large: TokenizerLane | None = None
        self._copy: Any = None
        self._copy_failed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @staticmethod
    def _settle(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            loop, fut, fn, args = item
            if self._closed:
                self._completed += 1
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                    loop.call_soon_threadsafe(fut.cancel)
                continue
            result: Any = None
            error: BaseException | None = None
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, as an executor does
                error = exc
            self._completed += 1  # after the work: an inline call never overlaps this one
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._settle, fut, result, error)

    def idle(self) -> bool:
        """Open, nothing queued and nothing running: a small call would run at once on the caller's thread."""
        return not self._closed and self._completed == self._submitted

    async def call(self, fn: Callable[..., T], *args: Any, small: bool = False, large: bool = False) -> T:
        if self._closed:
            raise RuntimeError("the tokenizer lane is shut down")
        if large and self._tokenizer is not None and not self._copy_failed:
            if self._large is None:
                self._large = TokenizerLane(f"{self.name}-large")
            shared = self._tokenizer

            def on_copy(*given: Any) -> T:
                if self._copy is None:
                    try:
                        self._copy = copy.deepcopy(shared)
                    except Exception as exc:  # a tokenizer that cannot be copied: the shared one, in the lane
                        self._copy_failed = True
                        _log.warning("episode tokenizer: large calls share the lane (the tokenizer cannot be copied: %s)", exc)
                        raise _NoCopy from exc
                return fn(*(self._copy if a is shared else a for a in given))

            try:
                result = await self._large.call(on_copy, *args)
            except _NoCopy:
                return await self.call(fn, *args)
            self.large_calls += 1
            return result
        if small and self._completed == self._submitted:
            self.inline_calls += 1
            return fn(*args)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._submitted += 1
        self._queue.put((loop, fut, fn, args))
        return await fut

    def shutdown(self) -> None:
        """Run nothing more (queued calls are cancelled) and let the thread end."""
        self._closed = True
        self._queue.put(None)
        if self._large is not None:
            self._large.shutdown()


class _NoCopy(Exception):
    """The tokenizer could not be copied for the large lane."""


_log = logging.getLogger(__name__)


def request_digest(prompt_ids: Sequence[int] | np.ndarray[Any, Any], sampling: SamplingParams, constraint: OutputConstraint | None = None) -> int:
    """A 63-bit blake2b of one engine request: the token sequence, every sampling field and the grammar (if any).

    Two requests with the same digest ask the engine for the same thing; a replayed turn is served only then."""
    h = hashlib.blake2b(digest_size=8)
    # the ids as little-endian int32 (a `TokenIds` has them so once, for the engine too), hashed in place
    h.update((prompt_ids.int32() if type(prompt_ids) is TokenIds else np.ascontiguousarray(prompt_ids, dtype="<i4")).data)
    h.update(_sampling_text(sampling))
    h.update(repr(constraint).encode())
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


_SAMPLING_TEXTS: dict[int, tuple[SamplingParams, bytes]] = {}


def _sampling_text(sampling: SamplingParams) -> bytes:
    """``repr(sampling).encode()``, kept per object (an episode hands the same settings object to turn after turn, and the
    dataclass's repr formats every field): a frozen object's text does not change; bounded, and held so no id is reused."""
    found = _SAMPLING_TEXTS.get(id(sampling))
    if found is not None and found[0] is sampling:
        return found[1]
    text = repr(sampling).encode()
    if len(_SAMPLING_TEXTS) >= 4096:
        _SAMPLING_TEXTS.clear()
    _SAMPLING_TEXTS[id(sampling)] = (sampling, text)
    return text


def recorded_turn(sample_index: int, turn: int, digest: int, s: SampleOutput) -> RecordedTurn:
    """The wire record of one sampled turn (what a later attempt can be served instead of sampling it)."""
    k = len(s.top_ids[0]) if s.top_ids else 0
    return RecordedTurn(
        sample_index=sample_index, turn=turn, request_digest=digest,
        output_ids=np.asarray(s.output_ids, dtype=np.int32), logprobs=np.asarray(s.logprobs, dtype=np.float32),
        token_versions=np.asarray(s.token_versions, dtype=np.int32), finish_reason=s.finish_reason, output_text=s.output_text,
        matched_stop_id=s.matched_stop if isinstance(s.matched_stop, int) else -1,
        matched_stop_text=s.matched_stop if isinstance(s.matched_stop, str) else "",
        first_token_at=s.first_token_at, finished_at=s.finished_at,
        top_ids=np.asarray(s.top_ids, dtype=np.int32).reshape(-1) if k and s.top_ids is not None else None,
        top_logprobs=np.asarray(s.top_logprobs, dtype=np.float32).reshape(-1) if k and s.top_logprobs is not None else None)


def _replayed_sample(rec: RecordedTurn) -> SampleOutput:
    ids = [int(t) for t in rec.output_ids]
    top_ids = top_lps = None
    if rec.top_ids is not None and rec.top_logprobs is not None and ids:
        k = len(rec.top_ids) // len(ids)
        top_ids = [[int(t) for t in rec.top_ids[i * k:(i + 1) * k]] for i in range(len(ids))]
        top_lps = [[float(x) for x in rec.top_logprobs[i * k:(i + 1) * k]] for i in range(len(ids))]
    stop: int | str | None = rec.matched_stop_id if rec.matched_stop_id >= 0 else (rec.matched_stop_text or None)
    return SampleOutput(index=0, output_ids=ids, logprobs=[float(x) for x in rec.logprobs],
                        token_versions=[int(v) for v in rec.token_versions], finish_reason=rec.finish_reason,
                        output_text=rec.output_text, matched_stop=stop, first_token_at=rec.first_token_at,
                        finished_at=rec.finished_at, top_ids=top_ids, top_logprobs=top_lps)


class EpisodeClosedError(RollpoolError):
    """The episode is over (returned, failed, timed out or cancelled): nothing more is recorded."""


class ContextLengthExceededError(RollpoolError):
    """The episode's sequence would not fit the engine's context; the episode ends with ``length``."""


@dataclass(slots=True)
class EpisodeStats:
    """Counters of a runner's episodes (what monitoring reports)."""

    in_flight: int = 0
    started: int = 0
    finished: int = 0
    failed: int = 0
    timed_out: int = 0
    turns: int = 0
    turns_in_flight: int = 0
    tool_calls: int = 0
    segments: int = 0
    prompt_tokens: int = 0
    reused_prefix_tokens: int = 0
    """Prompt tokens of turns that were already in the episode's sequence (a prefix cache can serve them)."""
    engine_cached_tokens: int = 0
    """Prompt tokens the engine says its prefix cache served (SGLang's ``cached_tokens``; 0 where it does not say)."""
    turns_replayed: int = 0
    """Turns of a re-run episode served from what an earlier attempt recorded (no sampling)."""
    tokens_replayed: int = 0
    """Their tokens."""
    tokens_regenerated: int = 0
    """Tokens sampled again for turns an earlier attempt had recorded (its request differed, or replay is off)."""
    replays_diverged: int = 0
    """Re-run episodes whose request differed from the record at some turn (from there on sampled as usual)."""
    agent_process_restarts: int = 0
    """Agent processes started again after they died (``--agent-processes``)."""

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dataclasses.asdict(self)
        out["reused_prefix_share"] = self.reused_prefix_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        out["engine_cached_share"] = self.engine_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return out


@dataclass(slots=True)
class _TextView:
    """A `/v1/completions` segment: the text the agent holds (its prompts plus the completions returned)."""

    text: str


def _sampling_from_body(base: SamplingParams, body: Mapping[str, Any], *, chat_request: bool) -> SamplingParams:  # noqa: C901 - grandfathered: one check per OpenAI sampling field
    def number(name: str, kind: type, lo: float | None = None, hi: float | None = None) -> Any:
        value = body.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not isinstance(value, int)):
            raise EndpointError(400, f"{name} must be {'an integer' if kind is int else 'a number'}", param=name)
        if not math.isfinite(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
            raise EndpointError(400, f"{name} must be in [{lo}, {hi}], got {value}", param=name)
        return kind(value)

    changes: dict[str, Any] = {}
    names = ("max_completion_tokens", "max_tokens") if chat_request else ("max_tokens",)
    for name in names:
        value = number(name, int, 1)
        if value is not None:
            changes["max_new_tokens"] = value
            break
    if (t := number("temperature", float, 0.0, 2.0)) is not None:
        changes["temperature"] = t
    if (p := number("top_p", float, 0.0, 1.0)) is not None:
        if p == 0:
            raise EndpointError(400, "top_p must be > 0", param="top_p")
        changes["top_p"] = p
    if (seed := number("seed", int)) is not None:
        changes["seed"] = seed
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
            raise EndpointError(400, "stop must be a non-empty string or a list of at most 4 of them", param="stop")
        changes["stop"] = tuple(stop)
    if (k := number("top_k", int)) is not None:
        if k == 0 or k < -1:
            raise EndpointError(400, f"top_k must be -1 or >= 1, got {k}", param="top_k")
        changes["top_k"] = k
    if (min_p := number("min_p", float, 0.0, 1.0)) is not None:
        changes["min_p"] = min_p
    if body.get("ignore_eos") is not None:
        changes["ignore_eos"] = bool(body["ignore_eos"])
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise EndpointError(400, f"n must be 1 here: each sample of a group is its own episode (got n={n!r})", param="n")
    _refuse_unserved_sampling(body)
    sampling = dataclasses.replace(base, **changes)
    problem = sampling_problem(sampling)  # the rules every engine checks: refused here, before any work
    if problem is not None:
        raise EndpointError(400, problem.message, param="max_tokens" if problem.field == "max_new_tokens" else problem.field)
    return sampling


_LONGEST: dict[int, tuple[Any, int]] = {}


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token of `tokenizer` stands for, bounded above by the UTF-8 bytes of its
    longest vocabulary string (a byte-level BPE token of k characters stands for k bytes, a SentencePiece ``▁`` for
    one), added tokens included; 0 when the tokenizer does not list its vocabulary. Computed once per tokenizer."""
    if tokenizer is None:
        return 0
    cached = _LONGEST.get(id(tokenizer))
    if cached is not None and cached[0] is tokenizer:
        return cached[1]
    try:
        vocab = tokenizer.get_vocab()
        longest = max((len(str(t).encode()) for t in vocab), default=0)
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary to list: no estimate
        longest = 0
    if len(_LONGEST) >= 16:  # one or two tokenizers per process in practice: bounded anyway
        _LONGEST.clear()
    _LONGEST[id(tokenizer)] = (tokenizer, longest)
    return longest


# neutral value of each sampling field the engines do not serve: any other value is refused, never ignored
_UNSERVED_SAMPLING: dict[str, Any] = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1,
                                      "logit_bias": {}, "min_tokens": 0, "best_of": 1, "use_beam_search": False,
                                      "length_penalty": 1, "prediction": None, "reasoning_effort": None, "audio": None,
                                      "functions": None, "function_call": None, "web_search_options": None,
                                      "guided_json": None, "guided_regex": None, "guided_grammar": None,
                                      "guided_choice": None}


def _refuse_unserved_sampling(body: Mapping[str, Any]) -> None:
    for name, neutral in _UNSERVED_SAMPLING.items():
        value = body.get(name)
        if value is not None and value != neutral:
            raise EndpointError(400, f"{name} is not served by this endpoint (the engines sample without it); "
                                     f"leave it out{'' if neutral is None else f' or send {json.dumps(neutral)}'}", param=name)
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise EndpointError(400, "modalities: only text is served", param="modalities")


def _response_format(raw: Any) -> OutputConstraint | None:
    """The constraint for a chat ``response_format`` (None for text)."""
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputConstraint()
    if kind == "json_schema":
        spec = raw.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise EndpointError(400, "response_format json_schema needs json_schema.schema (an object)", param="response_format")
        return OutputConstraint(json_schema=json.dumps(schema, sort_keys=True))
    raise EndpointError(400, f"response_format {json.dumps(raw)} is not served (text, json_object, json_schema)",
                        param="response_format")


def _token_ids(raw: Any) -> list[int]:
    if not isinstance(raw, list) or not raw or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in raw):
        raise EndpointError(400, "tokens must be a non-empty list of token ids (the prompt of this turn)", param="tokens")
    return list(raw)


def _usage(prompt_tokens: int, completion_tokens: int, reused: int, engine_cached: int | None = None) -> dict[str, Any]:
    """``cached_tokens`` is what the engine's prefix cache served where it says (SGLang), else the tokens reused from the record."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": reused if engine_cached is None else engine_cached}}


class Episode:
    """State and turns of one episode (see the module docstring)."""

    def __init__(self, *, engine: Engine, prompt: Prompt, sample_index: int, start_version: int, tokenizer: Any,
                 parser: ToolCallParser, model_name: str, max_context_tokens: int, request_prefix: str,
                 stats: EpisodeStats, loop: asyncio.AbstractEventLoop, tokenizer_lane: TokenizerLane | None = None,
                 end_of_turn_cache: dict[tuple[str, str, str], tuple[str, int | None]] | None = None,
                 image_policy: ImagePolicy | None = None,
                 replay: Sequence[RecordedTurn] = (), serve_replay: bool = True, min_version: int = -1,
                 on_turn: Callable[[RecordedTurn], None] | None = None) -> None:
        self.engine = engine
        self.prompt = prompt
        self.sample_index = sample_index
        self.tokenizer = tokenizer
        self.parser = parser
        self.model_name = model_name
        self.max_context_tokens = max_context_tokens
        self.request_prefix = request_prefix
        self.stats = stats
        self.loop = loop
        self.tokenizer_lane = tokenizer_lane
        self._eot_cache = {} if end_of_turn_cache is None else end_of_turn_cache
        self.image_policy = image_policy if image_policy is not None else ImagePolicy()
        self._images: dict[str, LoadedImage] = {}
        """Images this episode has checked, by sha256 (an agent sends its whole conversation every turn)."""
        self._stop_ids_cache: tuple[int, ...] | None = None
        self._image_facts_cache: tuple[tuple[int, str] | None] | None = None
        self._known_messages: tuple[list[Any], list[dict[str, Any]]] | None = None
        self._sampling_memo: tuple[bool, tuple[tuple[str, type, Any], ...], SamplingParams] | None = None
        """`_body_sampling`'s last (chat request, body fields, result)."""
        self._stops_memo: tuple[SamplingParams, tuple[int, ...], SamplingParams] | None = None
        """The last chat turn's (settings, stop ids, settings with those stops)."""
        """The last chat request's raw messages and their canonical shapes (`chat.validate_messages`'s ``known``)."""
        self._plain_messages: dict[int, tuple[Mapping[str, Any], dict[str, Any]]] = {}
        """The plain forms of the canonical messages rendered so far (`chat.render`'s ``plain_cache``)."""
        """`_image_facts` once the engine said them: the model's, fixed for the episode (an engine restart re-runs it)."""
        self.recording = EpisodeRecording(prompt.prompt_id, sample_index, start_version)
        self.closed = False
        self.tool_calls = 0
        self.responses: dict[str, list[dict[str, Any]]] = {}
        """The endpoint's Responses API answers of this episode (id -> conversation), for ``previous_response_id``."""
        self._lock = asyncio.Lock()
        self._turn = 0
        self._running_request: str | None = None
        self._sampled = 0
        """Turns recorded so far (the index of the next one, as `RecordedTurn.turn` counts)."""
        self._replay = sorted((r for r in replay if r.sample_index == sample_index), key=lambda r: r.turn)
        self._replaying = serve_replay and bool(self._replay)
        self._min_version = min_version
        self.on_turn = on_turn

    # -- lifecycle

    async def close(self) -> None:
        """Refuse every later call and abort the turn in flight (its tokens are not recorded)."""
        self.closed = True
        rid = self._running_request
        if rid is not None:
            with contextlib.suppress(Exception):
                await self.engine.abort(rid)

    def _check_open(self) -> None:
        if self.closed:
            raise EpisodeClosedError(f"episode {self.recording.prompt_id}:{self.sample_index} is over")

    # -- the sequence

    def _prompt_ids(self) -> list[int]:
        p = self.prompt
        if p.input_ids is not None:
            return [int(t) for t in p.input_ids.tolist()]
        if p.text is None:
            raise RollpoolError(f"prompt {p.prompt_id} has neither input_ids nor text")
        tok = self.tokenizer
        if tok is None:
            raise RollpoolError(f"prompt {p.prompt_id} is text, and this engine gives the episode no tokenizer")
        if p.apply_chat_template:
            text = chat.render(tok, [{"role": "user", "content": p.text}], None, add_generation_prompt=True)
            return encode_text(tok, text)
        return list(tok.encode(p.text))

    def _segment(self) -> Segment:
        seg = self.recording.current
        if seg is None:
            seg = self._begin(self._prompt_ids())
        return seg

    def _begin(self, ids: Sequence[int]) -> Segment:
        self._fits(len(ids) + 1)
        seg = self.recording.begin(ids, now=time.time())
        self.stats.segments += 1
        return seg

    def _fits_text(self, chars: int) -> None:
        """Size before work: refuse a request whose text cannot fit the context whatever it renders to, before any
        rendering or tokenizing (`ContextLengthExceededError`). No token stands for more characters than the
        tokenizer's longest token string (`longest_token_chars`), so ``chars / longest`` tokens at least."""
        longest = longest_token_chars(self.tokenizer) if self.max_context_tokens else 0
        if longest and chars // longest + 1 > self.max_context_tokens:
            self.recording.context_exceeded = True
            raise ContextLengthExceededError(
                f"the request's {chars} characters of text are at least {chars // longest} tokens, past the context of "
                f"{self.max_context_tokens}")

    def _image_facts(self) -> tuple[int, str] | None:
        """(the model's image token, the text one image's placeholder renders as), or None for an engine without images.

        Asked once an episode (every turn asked it: the sglang engine's `info` builds its whole answer each call)."""
        if self._image_facts_cache is not None:
            return self._image_facts_cache[0]
        try:
            info = self.engine.info()
        except Exception:  # noqa: BLE001 - an engine that cannot say takes no images here (and is asked again next turn)
            return None
        ids = info.extra.get("image_placeholder_ids") if info.images else None
        facts: tuple[int, str] | None = None
        if self.tokenizer is not None and isinstance(ids, list | tuple) and len(ids) == 3 and all(isinstance(t, int) for t in ids):
            facts = int(ids[1]), decode_tokens(self.tokenizer, list(ids), skip_special_tokens=False)
        self._image_facts_cache = (facts,)
        return facts

    def _load_images(self, urls: Sequence[str]) -> list[LoadedImage]:
        """Each image_url read and checked by the worker's image rules; 400 naming the first bad one (in a thread)."""
        policy = self.image_policy
        if len(urls) > policy.max_images:
            raise EndpointError(400, f"{len(urls)} images in this conversation, limit {policy.max_images} (the worker's "
                                     "--max-images-per-prompt)", param="messages", code="too_many_images")
        out = []
        for i, url in enumerate(urls):
            try:
                image = PromptImage.of(url)
                data = bytes(image.data) if image.data is not None else None
                known = self._images.get(hashlib.sha256(data).hexdigest()) if data is not None else None
                loaded = known if known is not None else load_image(i, image, policy)
            except (ValueError, RequestRefusedError) as exc:
                raise EndpointError(400, f"image_url {i} of the conversation: {exc}", param="messages",
                                    code="invalid_image") from None
            if len(self._images) < 4 * policy.max_images:
                self._images[loaded.sha256] = loaded
            out.append(loaded)
        return out

    def _fits(self, length: int, seg: Segment | None = None) -> None:
        """Raise `ContextLengthExceededError` past the context; `seg`, the segment that would overflow, then ends with ``length``."""
        if self.max_context_tokens and length > self.max_context_tokens:
            self.recording.context_exceeded = True
            if seg is not None:
                seg.finish_reason = FinishReason.LENGTH
            raise ContextLengthExceededError(
                f"the episode's sequence would be {length} tokens, past the context of {self.max_context_tokens}")

    def append(self, token_ids: Sequence[int]) -> None:
        self._check_open()
        if self._running_request is not None:
            raise RuntimeError("append while a turn of this episode is being sampled: await the turn first")
        ids = [int(t) for t in token_ids]
        seg = self._segment()
        self._fits(len(seg) + len(ids), seg)
        seg.insert(ids)
        seg.chat = None  # the token sequence moved past what the endpoint rendered

    def _undo(self, mark: RecordingMark) -> None:
        rec = self.recording
        self.stats.segments -= len(rec.segments) - mark.segments
        self.stats.prompt_tokens -= rec.prompt_tokens - mark.prompt_tokens
        self.stats.reused_prefix_tokens -= rec.reused_prefix_tokens - mark.reused_prefix_tokens
        rec.rollback(mark)

    async def _sample(self, seg: Segment, sampling: SamplingParams, mark: RecordingMark,
                      constraint: OutputConstraint | None = None) -> SampleOutput:
        """One engine turn on the segment's whole sequence; records the sampled tokens (and marks them when constrained)."""
        # its int64 array the digest's and the engine's (the sglang engine sends it), kept by the segment as it grows
        arr = seg.token_array()
        prompt = TokenIds(seg.input_ids, arr, seg.token_bounds(), more=seg.output_ids)
        extra: dict[str, Any] = {}
        if seg.images:
            if constraint is not None:
                raise RequestRefusedError("an output constraint (response_format, a forced tool_choice) is not served "
                                          "with images")
            extra["images"] = [im.data for im in seg.images]
        if self.max_context_tokens:
            room = self.max_context_tokens - seg.model_len()
            if room < 1:
                self._undo_unrun_images(seg, mark)
                self.recording.context_exceeded = True
                seg.finish_reason = FinishReason.LENGTH
                raise ContextLengthExceededError(f"no room left in the context of {self.max_context_tokens} tokens")
            if sampling.max_new_tokens > room:
                sampling = dataclasses.replace(sampling, max_new_tokens=room)
        turn = self._sampled
        digest = request_digest(prompt, sampling, constraint)
        if seg.images:
            self._replaying = False  # the digest does not cover images, and a replay would not expand them: sample from here
        s = self._from_record(turn, digest)
        if s is None:
            s = await self._engine_turn(seg, prompt, sampling, mark, constraint, extra)
            if turn < len(self._replay):
                self.stats.tokens_regenerated += len(s.output_ids)
            if self.on_turn is not None:
                self.on_turn(recorded_turn(self.sample_index, turn, digest, s))
        self._sampled += 1
        start = len(seg.output_ids)
        seg.sample(s.output_ids, s.logprobs, s.token_versions, s.finish_reason,
                   first_token_at=s.first_token_at, finished_at=s.finished_at or time.time())
        if constraint is not None and s.output_ids:
            seg.constrained.append((start, len(seg.output_ids)))
        self.stats.turns += 1
        if s.cached_tokens is not None:
            self.stats.engine_cached_tokens += s.cached_tokens
        return s

    async def _engine_turn(self, seg: Segment, prompt: list[int], sampling: SamplingParams, mark: RecordingMark,
                           constraint: OutputConstraint | None, extra: dict[str, Any]) -> SampleOutput:
        self._turn += 1
        rid = f"{self.request_prefix}:{self.sample_index}:t{self._turn}"
        self._running_request = rid
        self.stats.turns_in_flight += 1
        try:
            if constraint is None:
                out = await self.engine.generate(prompt, 1, sampling, rid, **extra)
            else:
                out = await cast(ConstrainedEngine, self.engine).generate_constrained(prompt, 1, sampling, rid, constraint)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.engine.abort(rid))
            self._undo_unrun_images(seg, mark)
            raise
        except (RequestRefusedError, ValueError):
            self._undo(mark)  # refused: nothing was sampled, so the turn leaves nothing (a retry continues the segment)
            raise
        except Exception:
            self._undo_unrun_images(seg, mark)
            raise
        finally:
            self.stats.turns_in_flight -= 1
            self._running_request = None
        self._check_open()  # closed while sampling: the turn is not recorded
        if seg.images:
            self._note_images(seg, prompt, out.input_ids, out.image_grid_thw)
        return out.samples[0]

    def _from_record(self, turn: int, digest: int) -> SampleOutput | None:
        """Turn `turn` as an earlier attempt recorded it, when its request was this one (else None: the replay ends)."""
        if not self._replaying:
            return None
        rec = self._replay[turn] if turn < len(self._replay) else None
        if rec is None:
            self._replaying = False  # past the record: the turn the earlier attempt did not finish
            return None
        versions = rec.token_versions
        exact = self.prompt.exact_weight_version
        if (rec.turn != turn or rec.request_digest != digest or (versions.size and int(versions.min()) < self._min_version)
                or (exact >= 0 and versions.size and (int(versions.min()) != exact or int(versions.max()) != exact))):
            self._replaying = False
            self.stats.replays_diverged += 1
            return None
        self.stats.turns_replayed += 1
        self.stats.tokens_replayed += len(rec.output_ids)
        return _replayed_sample(rec)

    def _undo_unrun_images(self, seg: Segment, mark: RecordingMark) -> None:
        """A turn that failed or was cancelled after its images were added: no image stays that the model never ran
        (its token count is unknown, so the trajectory could not say what the model would have seen)."""
        if any(im.tokens == 0 for im in seg.images):
            self._undo(mark)

    @staticmethod
    def _note_images(seg: Segment, sent: Sequence[int], ran: Sequence[int], grid: Sequence[int] | None) -> None:
        """Each image's grid and token count from what the engine ran (`ran`: `sent` with its placeholders expanded).

        Every image's token count is its patch count over one factor (the merge of 2x2 patches on Qwen2-VL), which
        the lengths give; the expansion is then checked against `ran` token by token."""
        n = len(seg.images)
        if grid is None or len(grid) != 3 * n:
            raise RollpoolError(f"the engine ran {n} images but reported {0 if grid is None else len(grid) // 3} patch grids")
        grids = [(int(grid[3 * i]), int(grid[3 * i + 1]), int(grid[3 * i + 2])) for i in range(n)]
        patches = [t * h * w for t, h, w in grids]
        tokens = len(ran) - len(sent) + n
        if tokens < n or any(p * tokens % sum(patches) for p in patches):
            raise RollpoolError(f"the engine ran {len(ran)} ids for {len(sent)} sent with {n} images of {patches} patches")
        counts = iter([p * tokens // sum(patches) for p in patches])
        expanded: list[int] = []
        for t in sent:
            expanded += [t] * (next(counts, 1) if t == seg.image_token_id else 1)
        if expanded != list(ran):
            raise RollpoolError("the engine expanded the image placeholders otherwise than one run per image")
        for im, g, p in zip(seg.images, grids, patches, strict=True):
            im.grid_thw, im.tokens = g, p * tokens // sum(patches)

    async def generate(self, input_ids: Sequence[int] | None, sampling: SamplingParams) -> SampleOutput:
        async with self._lock:
            self._check_open()
            mark = self.recording.mark()
            reused = 0
            if input_ids is None:
                had = self.recording.current
                seg = self._segment()
                reused = len(seg) if had is not None else 0
            else:
                before = len(self.recording.segments)
                had_len = len(self.recording.current) if self.recording.current is not None else 0
                self._fits(len(input_ids) + 1)
                seg, new = self.recording.continue_with(input_ids, now=time.time())
                self.stats.segments += len(self.recording.segments) - before
                reused = 0 if new else had_len
            seg.chat = None
            self.recording.count_turn(len(seg), reused)
            self.stats.prompt_tokens += len(seg)
            self.stats.reused_prefix_tokens += reused
            return await self._sample(seg, sampling, mark)

    # -- the OpenAI endpoint

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise EndpointError(400, "this engine gives the episode no tokenizer: text requests cannot be served")
        return self.tokenizer

    def _body_sampling(self, body: Mapping[str, Any], *, chat_request: bool) -> SamplingParams:
        """`_sampling_from_body` of the episode's base; the last turn's result again for a body whose fields (but its
        messages and tools, which it does not read) are the same values of the same types, in the same order (an agent
        sends the same settings every turn). A float 0 is never matched (-0.0 equals 0.0, but its text, which the
        request digest reads, differs)."""
        items = tuple([(k, type(v), v) for k, v in body.items() if k != "messages" and k != "tools"])
        memo = self._sampling_memo
        if memo is not None and memo[0] == chat_request and memo[1] == items:
            return memo[2]
        sampling = _sampling_from_body(self.prompt.sampling, body, chat_request=chat_request)
        if not any(t is float and v == 0 for _, t, v in items):
            self._sampling_memo = (chat_request, items, sampling)
        return sampling

    def _stop_ids(self) -> tuple[int, ...]:
        if self._stop_ids_cache is None:  # a tokenizer's eos_token_id is a property that converts on every read
            ids = set()
            for name in ("eos_token_id",):
                v = getattr(self.tokenizer, name, None)
                if isinstance(v, int):
                    ids.add(v)
            self._stop_ids_cache = tuple(sorted(ids))
        return self._stop_ids_cache

    def _end_of_turn(self, tok: Any, messages: list[dict[str, Any]], tools: Sequence[Any] | None) -> tuple[str, int | None]:
        """The template's end-of-turn text after `messages`, and its token (e.g. ``<|im_end|>``) when it is one special token.

        Probed once per (tools, first and last role of the history) for the runner's tokenizer (`tok`: it, or the
        large lane's copy of it): a chat template closes an assistant turn by where the turn stands, not by the words
        of earlier messages, and the probe is a whole rendering of the conversation (a third of a turn's template work).
        """
        key = (chat.tools_key(tools), str(messages[0].get("role")), str(messages[-1].get("role")))
        found = self._eot_cache.get(key)
        if found is not None:
            return found
        text = chat.end_of_turn(tok, messages, tools)
        eot = text.strip()
        ids = encode_text(tok, eot) if eot else []
        found = text, (int(ids[0]) if len(ids) == 1 else None)
        if len(self._eot_cache) < 1024:
            self._eot_cache[key] = found
        return found

    def _strip_specials(self, text: str) -> str:
        for special in getattr(self.tokenizer, "all_special_tokens", ()) or ():
            if special:
                text = text.replace(special, "")
        return text

    def _content_ids(self, s: SampleOutput, stop_ids: set[int]) -> list[int]:
        ids = list(s.output_ids)
        if ids and s.finish_reason == FinishReason.STOP and (s.matched_stop == ids[-1] or ids[-1] in stop_ids):
            ids = ids[:-1]
        return ids

    async def _off_loop(self, fn: Callable[..., T], *args: Any, chars: int | None = None) -> T:
        """Tokenizer and template work: in the runner's tokenizer thread (one, so calls never overlap), off the loop;
        `chars` (the text it renders or tokenizes) within `TokenizerLane.INLINE_CHARS`: on the loop when that thread is idle;
        past `TokenizerLane.LARGE_CHARS`: on the large lane, with its copy of the tokenizer where `fn` is given `tok`."""
        lane = self.tokenizer_lane
        if lane is None:
            return fn(*args)
        small = chars is not None and chars <= TokenizerLane.INLINE_CHARS
        large = chars is not None and chars > TokenizerLane.LARGE_CHARS
        if small and not large and lane.idle():  # what `call` does for it, without a coroutine of its own
            lane.inline_calls += 1
            return fn(*args)
        return await lane.call(fn, *args, small=small, large=large)

    def _chat_prepare(self, tok: Any, messages: list[dict[str, Any]], tools: Sequence[Any] | None,
                      view: chat.ChatView | None) -> tuple[str, list[int] | None, list[int] | None, str, int | None]:
        """(rendered prompt, ids to insert when it extends `view` else None, the whole prompt's ids else None,
        end-of-turn text, end-of-turn id)."""
        prompt_text = chat.render(tok, messages, tools, add_generation_prompt=True, plain_cache=self._plain_messages)
        delta = chat.extension(view, tok, messages, tools, prompt_text)
        eot_text, eot_id = self._end_of_turn(tok, messages, tools)
        if delta is not None:
            return prompt_text, encode_text(tok, delta), None, eot_text, eot_id
        return prompt_text, None, encode_text(tok, prompt_text), eot_text, eot_id

    def _chat_reply(self, tok: Any, s: SampleOutput, messages: list[dict[str, Any]], tools: Sequence[Any] | None,
                    prompt_text: str, eot_text: str, eot_id: int | None, stop_ids: set[int], parse: bool,
                    want_token_texts: bool) -> tuple[dict[str, Any], list[ToolCall], chat.ChatView, list[str]]:
        """The assistant message for sample `s`, its tool calls, the segment's next view, each token's text (when wanted)."""
        content_ids = self._content_ids(s, stop_ids)
        calls: list[ToolCall] = []
        raw = ""
        if parse:
            raw, calls = self.parser.parse(decode_tokens(tok, content_ids, skip_special_tokens=False))
        # the reply's text and the sampled text by one decode where that is the same text as two (most turns)
        both = decode_reply(tok, content_ids, s.output_ids) if not calls and s.output_text is None else None
        if calls:
            content: str | None = self._strip_specials(raw).strip() or None
        elif both is not None:
            content = both[0]
        else:
            content = s.output_text if s.output_text is not None else decode_tokens(tok, content_ids, skip_special_tokens=True)
        reply: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            reply["tool_calls"] = [c.as_openai() for c in calls]
        sampled_text = both[1] if both is not None else decode_tokens(tok, s.output_ids, skip_special_tokens=False)
        view = chat.deferred_view(messages, reply, tools, prompt_text, sampled_text,
                                  bool(s.output_ids) and eot_id is not None and s.output_ids[-1] == eot_id, eot_text=eot_text)
        texts = [tok.decode([t], skip_special_tokens=False) for t in s.output_ids] if want_token_texts else []
        return reply, calls, view, texts

    def _engine_name(self) -> str:
        try:
            return str(self.engine.info().name)
        except Exception:  # noqa: BLE001 - a name for an error message only
            return type(self.engine).__name__

    def _constraint(self, tools: Sequence[Any] | None, tool_choice: Any, response_format: Any) -> OutputConstraint | None:
        """The grammar a forced tool call (``tool_choice`` required or named) or a ``response_format`` asks for; 400 if not served."""
        fmt = _response_format(response_format)
        forced: OutputConstraint | None = None
        if tool_choice not in (None, "auto", "none"):
            forced = self._forced_tool(tools, tool_choice)
            if fmt is not None:
                raise EndpointError(400, "a forced tool_choice and a JSON response_format cannot be held at once", param="response_format")
        constraint = forced or fmt
        if constraint is not None and not can_constrain(self.engine):
            param = "tool_choice" if forced is not None else "response_format"
            raise EndpointError(400, f"{param} needs constrained decoding, which the {self._engine_name()} engine does not serve "
                                     "(the hf and sglang engines do)", param=param)
        return constraint

    def _forced_tool(self, tools: Sequence[Any] | None, tool_choice: Any) -> OutputConstraint:
        specs = {}
        for tool in tools or []:
            fn = tool.get("function") if tool.get("type", "function") == "function" else None
            if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
                specs[fn["name"]] = fn.get("parameters") or {"type": "object"}
        if tool_choice == "required":
            names = list(specs)
        elif isinstance(tool_choice, Mapping) and isinstance(fn := tool_choice.get("function"), Mapping) and isinstance(fn.get("name"), str):
            names = [fn["name"]]
            if fn["name"] not in specs:
                raise EndpointError(400, f"tool_choice names {fn['name']!r}, which is not among the tools", param="tool_choice")
        else:
            raise EndpointError(400, f"tool_choice {json.dumps(tool_choice)} is not served (auto, none, required or "
                                     '{"type": "function", "function": {"name": ...}})', param="tool_choice")
        if not names:
            raise EndpointError(400, f"tool_choice {json.dumps(tool_choice)} needs function tools", param="tool_choice")
        build = getattr(self.parser, "call_constraint", None)
        constraint = build({name: specs[name] for name in names}) if build is not None else None
        if constraint is None:
            raise EndpointError(400, f"tool_choice {json.dumps(tool_choice)} needs a tool-call format a grammar can hold; the "
                                     f"{self.parser.name!r} tool-call parser has none (hermes has)", param="tool_choice")
        assert isinstance(constraint, OutputConstraint)
        return constraint

    def _top_logprobs(self, raw: Any) -> int:
        if raw is None or raw == 0:
            return 0
        if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw <= 20:
            raise EndpointError(400, "top_logprobs must be an integer in [0, 20]", param="top_logprobs")
        try:
            able = bool(self.engine.info().top_logprobs)
        except Exception:  # noqa: BLE001 - an engine that cannot say cannot serve them
            able = False
        if not able:
            raise EndpointError(400, f"top_logprobs is not served by the {self._engine_name()} engine (the hf engine "
                                     "reports them)", param="top_logprobs")
        return raw

    def _top_entries(self, tok: Any, s: SampleOutput) -> list[list[dict[str, Any]]]:
        out = []
        for ids, lps in zip(s.top_ids or [], s.top_logprobs or [], strict=True):
            row = []
            for t, lp in zip(ids, lps, strict=True):
                text = tok.decode([t], skip_special_tokens=False)
                row.append({"token": text, "logprob": float(lp), "bytes": list(text.encode())})
            out.append(row)
        return out if len(out) == len(s.output_ids) else [[] for _ in s.output_ids]

    async def chat(self, body: Mapping[str, Any], *, token_prompt: bool = False) -> dict[str, Any]:
        """Serve one ``/v1/chat/completions`` body (not streamed); the response as a dict.

        `token_prompt` (``/v1/chat/completions/tokens``, prime-rl's route): the body's ``tokens`` are the
        prompt as token ids, recorded by the token-level rule (they extend the segment when they start
        with its sequence); the messages only say how to read the reply. ``return_token_ids`` adds
        ``prompt_token_ids`` (the whole sequence the engine was given) and the choice's ``token_ids``.
        """
        tok = self._require_tokenizer()
        given = _token_ids(body.get("tokens")) if token_prompt else None
        vision = self._image_facts()
        raw_messages = body.get("messages")
        messages = chat.validate_messages(raw_messages, image_text=None if vision is None else vision[1], known=self._known_messages)
        if type(raw_messages) is list:
            self._known_messages = (raw_messages, messages)
        tools = body.get("tools") or None
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools)):
            raise EndpointError(400, "tools must be a list of objects", param="tools")
        tool_choice = body.get("tool_choice", "auto")
        constraint = self._constraint(tools, tool_choice, body.get("response_format"))
        loaded = await self._request_images(messages, body, token_prompt=given is not None, constrained=constraint is not None)
        want_logprobs = bool(body.get("logprobs"))
        sampling = self._body_sampling(body, chat_request=True)
        top = self._top_logprobs(body.get("top_logprobs"))
        if top:
            sampling = dataclasses.replace(sampling, top_logprobs_num=top)
        parse = bool(tools) and tool_choice != "none"
        chars = sum(len(m.get("content") or "") for m in messages)
        self._fits_text(chars)
        chars += len(str(tools)) if tools else 0  # rendered too
        async with self._lock:
            self._check_open()
            mark = self.recording.mark()
            seg = self.recording.current
            view = seg.chat if seg is not None and isinstance(seg.chat, chat.ChatView) else None
            prompt_text, delta_ids, prompt_ids, eot_text, eot_id = await self._off_loop(self._chat_prepare, tok, messages, tools, view,
                                                                                        chars=chars)
            self._check_open()
            if given is not None:
                before, had = len(self.recording.segments), 0 if seg is None else len(seg)
                self._fits(len(given) + 1)
                seg, new = self.recording.continue_with(given, now=time.time())
                self.stats.segments += len(self.recording.segments) - before
                reused = 0 if new else had
            elif seg is not None and delta_ids is not None:
                self._fits(seg.model_len() + len(delta_ids) + 1, seg)
                reused = seg.model_len()
                seg.insert(delta_ids)
            else:
                assert prompt_ids is not None
                seg = self._begin(prompt_ids)
                reused = 0
            if loaded or seg.images:
                self._add_images(seg, loaded, vision, mark)
            stop_ids = set(self._stop_ids()) | ({eot_id} if eot_id is not None else set())
            stops = tuple(sorted(set(sampling.stop_token_ids) | stop_ids))
            memo = self._stops_memo
            if memo is not None and memo[0] is sampling and memo[1] == stops:
                sampling = memo[2]  # the same settings and stops as the last turn: its object (and its digest's text)
            else:
                with_stops = dataclasses.replace(sampling, stop_token_ids=stops)
                self._stops_memo = (sampling, stops, with_stops)
                sampling = with_stops
            prompt_len = seg.model_len()
            self.recording.count_turn(prompt_len, reused)
            self.stats.prompt_tokens += prompt_len
            self.stats.reused_prefix_tokens += reused
            s = await self._sample(seg, sampling, mark, constraint)
            if seg.model_len() - len(s.output_ids) > prompt_len:  # the engine expanded this turn's new images
                grown = seg.model_len() - len(s.output_ids) - prompt_len
                self.recording.count_turn(grown, 0)
                self.stats.prompt_tokens += grown
                prompt_len += grown
            # the ids the model ran (placeholders expanded): what a client that tokenizes for itself must hold
            engine_prompt = seg.model_tokens()[:prompt_len] if body.get("return_token_ids") else None
            reply, calls, seg_view, token_texts = await self._off_loop(
                self._chat_reply, tok, s, messages, tools, prompt_text, eot_text, eot_id, stop_ids, parse, want_logprobs,
                chars=chars + 8 * len(s.output_ids))  # decodes the output; may render the conversation with the reply
            self._check_open()
            seg.chat = seg_view if given is None else None  # given ids need not be the template's: no view to extend
            if calls:
                self.tool_calls += len(calls)
                self.stats.tool_calls += len(calls)
        finish = "tool_calls" if calls else s.finish_reason
        choice: dict[str, Any] = {"index": 0, "message": {**reply, "refusal": None}, "finish_reason": finish,
                                  "logprobs": None}
        if engine_prompt is not None:
            choice["token_ids"] = list(s.output_ids)
        if want_logprobs:
            tops = self._top_entries(tok, s) if top else [[] for _ in s.output_ids]
            choice["logprobs"] = {"content": [
                {"token": text, "logprob": float(lp), "bytes": list(text.encode()), "top_logprobs": alts}
                for text, lp, alts in zip(token_texts, s.logprobs, tops, strict=True)]}
        return {
            "id": _response_id("chatcmpl"),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": _usage(prompt_len, len(s.output_ids), reused, s.cached_tokens),
            **({"prompt_token_ids": engine_prompt} if engine_prompt is not None else {}),
        }

    async def _request_images(self, messages: list[dict[str, Any]], body: Mapping[str, Any], *, token_prompt: bool,
                              constrained: bool) -> list[LoadedImage]:
        """The request's images read and checked (400 for a bad one, before any rendering), their messages' ``image_urls``
        replaced by ``images`` (sha256s, what `chat.message_key` compares); [] without image parts."""
        urls = chat.image_urls(messages)
        if not urls:
            return []
        if token_prompt:
            raise EndpointError(400, "image parts are served on /v1/chat/completions, not with the prompt's tokens given",
                                param="messages")
        if constrained:
            raise EndpointError(400, "response_format and a forced tool_choice are not served with images",
                                param="response_format" if body.get("response_format") else "tool_choice")
        self._fits_text(sum(len(m.get("content") or "") for m in messages))  # before any image is decoded
        loaded = await asyncio.to_thread(self._load_images, urls)  # a path or a fetch may block: not on the loop
        shas = iter([im.sha256 for im in loaded])
        for m in messages:
            if m.get("image_urls"):
                m["images"] = [next(shas) for _ in m.pop("image_urls")]
        return loaded

    def _add_images(self, seg: Segment, loaded: Sequence[LoadedImage], vision: tuple[int, str] | None,
                    mark: RecordingMark) -> None:
        """Give `seg` this request's images (those past the ones it holds: the earlier messages matched, images
        included), and check that its ids hold one image token per image (else 400, nothing recorded)."""
        have = [im.sha256 for im in seg.images]
        if [im.sha256 for im in loaded[: len(have)]] != have:
            self._undo(mark)
            raise RollpoolError("a continued conversation shows other images than its segment holds")
        if vision is None:  # images recorded earlier, and the engine no longer says how it takes them
            self._undo(mark)
            raise EndpointError(400, "this engine takes no images now", param="messages")
        seg.image_token_id = vision[0]
        seg.images += [SegmentImage(im.data, im.sha256) for im in loaded[len(have):]]
        slots = seg.tokens.count(seg.image_token_id)
        if slots != len(seg.images):
            self._undo(mark)
            raise EndpointError(400, f"the rendered conversation holds {slots} image tokens for {len(seg.images)} images "
                                     "(one per image: a message's text holds the image token itself, or the model sampled one)",
                                param="messages")

    async def tokenize(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Serve ``/tokenize`` (vLLM's shape, what prime-rl's verifiers client calls): ``prompt`` or ``messages``
        (with ``tools`` and ``add_generation_prompt``, default true) to token ids. Records nothing."""
        tok = self._require_tokenizer()
        special = body.get("add_special_tokens")
        if isinstance(body.get("prompt"), str):
            text = body["prompt"]
            add_special = True if special is None else bool(special)
        else:
            vision = self._image_facts()
            messages = chat.validate_messages(body.get("messages"), image_text=None if vision is None else vision[1])
            if chat.image_urls(messages):
                raise EndpointError(400, "image parts are not served on /tokenize (the ids depend on each image's size)",
                                    param="messages")
            tools = body.get("tools") or None
            text = await self._off_loop(lambda: chat.render(tok, messages, tools,
                                                            add_generation_prompt=bool(body.get("add_generation_prompt", True))))
            add_special = bool(special)
        ids = await self._off_loop(lambda: [int(t) for t in tok.encode(text, add_special_tokens=add_special)])
        limit = self.max_context_tokens or getattr(tok, "model_max_length", 0)
        limit = int(limit) if isinstance(limit, int | float) and 0 < limit < 1 << 31 else 0  # HF's "unknown" is 1e30
        return {"count": len(ids), "max_model_len": limit, "tokens": ids}

    async def completion(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Serve one ``/v1/completions`` body (not streamed); the response as a dict."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        token_prompt = isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        if not token_prompt and not (isinstance(prompt, str) and prompt):
            raise EndpointError(400, "prompt must be a non-empty string or a list of token ids (one prompt: batches are not served)", param="prompt")
        if body.get("echo"):
            raise EndpointError(400, "echo is not supported", param="echo")
        if body.get("best_of") not in (None, 1):
            raise EndpointError(400, "best_of must be 1", param="best_of")
        want = body.get("logprobs")
        if want is not None and (isinstance(want, bool) or not isinstance(want, int) or not 0 <= want <= 5):
            raise EndpointError(400, "logprobs must be an integer in [0, 5]", param="logprobs")
        sampling = self._body_sampling(body, chat_request=False)
        tok = self.tokenizer
        if not token_prompt:
            tok = self._require_tokenizer()
            assert isinstance(prompt, str)
            self._fits_text(len(prompt))
        async with self._lock:
            self._check_open()
            mark = self.recording.mark()
            seg = self.recording.current
            reused = 0
            if token_prompt:
                assert isinstance(prompt, list)
                before = len(self.recording.segments)
                had = 0 if seg is None else len(seg)
                self._fits(len(prompt) + 1)
                seg, new = self.recording.continue_with(prompt, now=time.time())
                self.stats.segments += len(self.recording.segments) - before
                reused = 0 if new else had
                text_before = None
            else:
                assert isinstance(prompt, str)
                view = seg.chat if seg is not None and isinstance(seg.chat, _TextView) else None
                if seg is not None and view is not None and prompt.startswith(view.text):
                    rest = prompt[len(view.text):]
                    ids = await self._off_loop(lambda t: encode_text(t, rest), tok, chars=len(rest))
                    self._check_open()
                    self._fits(len(seg) + len(ids) + 1, seg)
                    reused = len(seg)
                    seg.insert(ids)
                else:
                    text_prompt = prompt
                    ids = await self._off_loop(lambda t: list(t.encode(text_prompt)), tok, chars=len(text_prompt))
                    self._check_open()
                    seg = self._begin(ids)
                text_before = prompt
            prompt_len = len(seg)
            self.recording.count_turn(prompt_len, reused)
            self.stats.prompt_tokens += prompt_len
            self.stats.reused_prefix_tokens += reused
            s = await self._sample(seg, sampling, mark)
            if s.output_text is not None:
                text = s.output_text
            elif tok is not None:
                content_ids = self._content_ids(s, set(self._stop_ids()))
                text = await self._off_loop(lambda: decode_tokens(tok, content_ids, skip_special_tokens=True))
            else:
                text = ""
            seg.chat = _TextView(text_before + text) if text_before is not None else None
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": s.finish_reason, "logprobs": None}
        if want is not None:
            pieces = [tok.decode([t], skip_special_tokens=False) if tok is not None else str(t) for t in s.output_ids]
            offsets, at = [], 0
            for piece in pieces:
                offsets.append(at)
                at += len(piece)
            choice["logprobs"] = {"tokens": pieces, "token_logprobs": [float(x) for x in s.logprobs],
                                  "top_logprobs": None, "text_offset": offsets}
        return {
            "id": _response_id("cmpl"),
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": _usage(prompt_len, len(s.output_ids), reused, s.cached_tokens),
        }


class EpisodeContext:
    """What an episode function is given (public as ``rollpool.workers.EpisodeContext``).

    - `openai_base_url`, `api_key`, `model`: an OpenAI-compatible endpoint bound to this episode
      (``openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key)``, or ``ctx.openai_client()``:
      the same over the process's one HTTP client); every request records into this episode;
    - `metadata`: a dict, the prompt's metadata to start with, echoed on the trajectories;
    - ``await generate(...)``: sample one turn at the token level, returns the `SampleOutput`;
    - ``append(token_ids)``: insert tokens the model did not sample (loss mask 0);
    - `segment_index`: the segment the next turn records into (0 until the history is rewritten);
    - ``await tool(fn, *args)``: run a (sync) tool in a thread and count it as a tool call.

    From a synchronous episode function (which runs in a thread), `generate` is ``generate_sync``;
    `append` and `tool` work from either side.
    """

    def __init__(self, episode: Episode, *, openai_base_url: str, api_key: str, executor: Executor | None = None) -> None:
        self._episode = episode
        self.openai_base_url = openai_base_url
        self.api_key = api_key
        self.model = episode.model_name
        self.prompt = episode.prompt
        self.sample_index = episode.sample_index
        self.metadata: dict[str, Any] = dict(episode.prompt.metadata)
        self._executor = executor

    def openai_client(self, **options: Any) -> Any:
        """An ``openai.AsyncOpenAI`` bound to this episode, over the process's one HTTP client (no TLS context and no
        connection pool per episode; closing it is harmless): `rollpool.workers.episodes.sdk`. `options` go to
        ``AsyncOpenAI`` (``max_retries``, ``timeout``, ...)."""
        from rollpool.workers.episodes.sdk import episode_client

        return episode_client(self.openai_base_url, self.api_key, **options)

    @property
    def segment_index(self) -> int:
        seg = self._episode.recording.current
        return 0 if seg is None else seg.index

    @property
    def token_ids(self) -> list[int]:
        """The current segment's whole sequence (prompt and outputs); empty before the first turn."""
        seg = self._episode.recording.current
        return [] if seg is None else seg.tokens

    def _on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._episode.loop
        except RuntimeError:
            return False

    def _from_thread(self, coro: Awaitable[T]) -> T:
        if self._on_loop():
            raise RuntimeError("called on the event loop: use the async form")
        return asyncio.run_coroutine_threadsafe(coro, self._episode.loop).result()  # type: ignore[arg-type]

    async def generate(self, input_ids: Sequence[int] | None = None, *, max_new_tokens: int | None = None,
                       temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                       stop: Sequence[str] | None = None, stop_token_ids: Sequence[int] | None = None,
                       seed: int | None = None) -> SampleOutput:
        """Sample one turn: on the current sequence (the prompt's tokens to start with), or on `input_ids`.

        `input_ids` that extend the current sequence insert the rest (mask 0); any other `input_ids`
        start a new segment. Unset parameters come from the prompt's `sampling`. Raises
        `ContextLengthExceededError` when no token fits (the episode then ends with ``length``).
        """
        changes: dict[str, Any] = {}
        for name, value in (("max_new_tokens", max_new_tokens), ("temperature", temperature), ("top_p", top_p),
                            ("top_k", top_k), ("seed", seed)):
            if value is not None:
                changes[name] = value
        if stop is not None:
            changes["stop"] = tuple(stop)
        if stop_token_ids is not None:
            changes["stop_token_ids"] = tuple(int(t) for t in stop_token_ids)
        sampling = dataclasses.replace(self._episode.prompt.sampling, **changes)
        return await self._episode.generate(None if input_ids is None else list(input_ids), sampling)

    def generate_sync(self, input_ids: Sequence[int] | None = None, **sampling: Any) -> SampleOutput:
        """`generate` for a synchronous episode function (call it from its thread, not from the loop)."""
        if self._on_loop():
            raise RuntimeError("generate_sync called on the event loop: await ctx.generate(...) instead")
        return self._from_thread(self.generate(input_ids, **sampling))

    def append(self, token_ids: Sequence[int]) -> None:
        """Insert tokens the model did not sample (tool output, observations): loss mask 0."""
        if self._on_loop():
            self._episode.append(token_ids)
            return

        async def _append() -> None:
            self._episode.append(token_ids)

        self._from_thread(_append())

    async def tool(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a tool: a coroutine function is awaited, a plain function runs in a thread; counted as a tool call."""
        self._episode.tool_calls += 1
        self._episode.stats.tool_calls += 1
        if inspect.iscoroutinefunction(fn):
            result: T = await fn(*args, **kwargs)
            return result
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))
