"""The Engine protocol: what a rollout worker needs from an inference engine.

An engine generates `n` samples of one prompt per request and reports, for
every output token, its id, its logprob (``log_softmax(logits / temperature)``
of the chosen token before top-k/top-p/min-p truncation, as SGLang reports it;
temperature 0 means greedy and logprobs at temperature 1) and the weight
version that produced it. ``output_ids`` include the stop token. A per-sample
outcome (stop, length, abort) is data on the `SampleOutput`; an exception out
of an engine method means the engine itself failed and the worker restarts
it, except `RequestRefusedError`, which only the explicit request checks
below raise (`check_request` before the prompt is tokenized, `check_prompt`
after; bad sampling parameters, a group larger than the engine, an empty or
too long prompt, ids outside the vocabulary, a request id already running):
it fails only that request. Every engine runs these same checks, so a request
is refused or accepted alike on every engine, and a `ValueError` from a bug
inside an engine restarts the engine instead of failing a prompt as invalid.

Weight updates: the worker calls ``pause(mode)``, ``update_weights(tensors,
version)``, ``resume()``. ``pause`` returns once the engine is quiescent in
that mode:

- ``interrupt``: running sequences stop at a step boundary and are
  resubmitted on resume as prompt + partial output, so every token sampled
  after the update carries the new version (and was computed by the new
  weights only);
- ``in_place``: running sequences are held with their KV cache and continue
  on resume (tokens after the update carry the new version, but attend to a
  cache computed by the old weights);
- ``drain``: no new sequence starts; ``pause`` returns once the running ones
  have finished.

`generate` calls made while paused wait and start after `resume`.
All methods are coroutines except `info`; none blocks the event loop (compute
lives in a thread, a child process or on timers). An engine that can copy a
version to its device before the pause declares `StagingEngine`; one that
knows the bytes of one weight version declares `SizedEngine` (a worker whose
engine is on a GPU then page-locks its fetch buffers at engine start); one that
can sample under a grammar (an `OutputConstraint`) declares `ConstrainedEngine`.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from rollpool.protocol.errors import RequestRefusedError
from rollpool.protocol.messages import AdapterSpec, ApplyMode, SamplingParams
from rollpool.protocol.sampling import sampling_problem

__all__ = [
    "AdapterEngine",
    "APPLY_MODES",
    "ConstrainedEngine",
    "can_constrain",
    "Engine",
    "EngineInfo",
    "GenerateOutput",
    "OutputConstraint",
    "SampleOutput",
    "SizedEngine",
    "StagingEngine",
    "TokenIds",
    "check_prompt",
    "check_request",
    "validate_sampling",
]

APPLY_MODES: tuple[str, ...] = ApplyMode.ALL


_INT64 = np.dtype(np.int64)


class TokenIds(list[int]):
    """A prompt's token ids: a list of ints like any other, which also holds them as one int64 array (`array`).

    Made once by a caller that needs the array itself (the episode's request digest), so an engine that sends ids as
    an array (the sglang engine) does not convert the list again; to every other engine it is a plain list. Its
    `array` is made at construction, or given by a caller that holds the same ids as an int64 array already (an
    episode's segment keeps its sequence so): a `TokenIds` is not to be changed afterwards. `bounds`, the least and
    the greatest id, where the caller knows them (an engine's vocabulary check then reads no array); else None.
    """

    __slots__ = ("_int32", "array", "bounds")

    def __init__(self, ids: Sequence[int], array: np.ndarray[Any, np.dtype[np.int64]] | None = None,
                 bounds: tuple[int, int] | None = None, *, more: Sequence[int] = ()) -> None:
        """`more`: ids that follow `ids` (a segment's outputs after its prompt: one copy of both, not a joined list copied)."""
        super().__init__(ids)
        if more:
            self.extend(more)
        if array is not None and (array.dtype is not _INT64 and array.dtype != _INT64 or array.shape != (len(self),)):
            raise ValueError(f"TokenIds: the given array must be {len(self)} int64 ids, got {array.dtype} {array.shape}")
        self.array: np.ndarray[Any, np.dtype[np.int64]] = np.array(self, dtype=np.int64) if array is None else array
        self.bounds = bounds
        self._int32: np.ndarray[Any, np.dtype[np.int32]] | None = None

    def int32(self) -> np.ndarray[Any, np.dtype[np.int32]]:
        """`array` as little-endian int32 (``astype("<i4")``: an id past int32 wraps, as that cast does), made once:
        what the request digest hashes and what the sglang engine sends are the same conversion."""
        if self._int32 is None:
            self._int32 = self.array.astype("<i4")
        return self._int32


@dataclass(slots=True)
class SampleOutput:
    """One generated sample."""

    index: int
    output_ids: list[int]
    """Generated ids, the stop token included."""
    logprobs: list[float]
    """One per output id."""
    token_versions: list[int]
    """The weight version that produced each output id."""
    finish_reason: str
    """`FinishReason`: stop, length, abort or error."""
    output_text: str | None = None
    """Decoded output (stop string and stop token trimmed, as SGLang does); None without a tokenizer."""
    matched_stop: int | str | None = None
    first_token_at: float = 0.0
    finished_at: float = 0.0
    """Wall-clock seconds since the epoch."""
    top_ids: list[list[int]] | None = None
    """With ``sampling.top_logprobs_num`` k (engines with `EngineInfo.top_logprobs`): per output id, the
    k most likely token ids, most likely first."""
    top_logprobs: list[list[float]] | None = None
    """Their logprobs, the same layout."""
    cached_tokens: int | None = None
    """Prompt tokens the engine served from its prefix cache (first attempt); None where the engine does not say."""


@dataclass(slots=True)
class GenerateOutput:
    """The answer to one `generate` call: `n` samples of one prompt."""

    request_id: str
    input_ids: list[int]
    """The prompt as the engine saw it (tokenized when a text prompt was given)."""
    samples: list[SampleOutput]
    started_at: float = 0.0
    simulated: bool = False
    input_logprobs: list[float] | None = None
    """With ``sampling.logprob_start_len`` s >= 0 (engines with `EngineInfo.prompt_logprobs`): the logprob of
    each prompt token from position s on, NaN for position 0."""
    image_grid_thw: list[int] | None = None
    """With images (engines with `EngineInfo.images`), where the model has one: each image's (t, h, w) patch grid,
    3 ints per image; ``input_ids`` then hold each image's placeholder tokens expanded."""


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What an engine says about itself (travels on Hello as ``engine_info``)."""

    name: str
    model: str
    capacity: int
    """Most sequences it runs at once."""
    apply_modes: tuple[str, ...]
    weight_version: int
    fingerprint: str
    """Digest of the model config and tokenizer."""
    simulated: bool = False
    device: str = "cpu"
    extra: Mapping[str, Any] = field(default_factory=dict)
    """More facts, by name; ``max_context_tokens``: the tokens one sequence may hold (prompt and output), which
    the episode endpoint checks requests against (absent or 0: not known)."""
    top_logprobs: bool = False
    """It honours `SamplingParams.top_logprobs_num` (fills `SampleOutput.top_ids` / `top_logprobs`); the
    worker refuses such a task for an engine that does not."""
    prompt_logprobs: bool = False
    """It honours `SamplingParams.logprob_start_len` (fills `GenerateOutput.input_logprobs`)."""
    images: bool = False
    """It takes images (``generate(..., images=...)``); the worker refuses an image prompt for an engine that does not."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": self.model,
            "capacity": self.capacity,
            "apply_modes": list(self.apply_modes),
            "weight_version": self.weight_version,
            "fingerprint": self.fingerprint,
            "simulated": self.simulated,
            "device": self.device,
            "top_logprobs": self.top_logprobs,
            "prompt_logprobs": self.prompt_logprobs,
            "images": self.images,
            **dict(self.extra),
        }


@runtime_checkable
class Engine(Protocol):
    """The seam between a worker and its inference engine (see the module docstring)."""

    async def start(self) -> None:
        """Load the model / start the engine; raises `EngineError` on failure."""

    async def generate(
        self,
        input_ids: Sequence[int] | None,
        n: int,
        sampling: SamplingParams,
        request_id: str,
        *,
        text: str | None = None,
        apply_chat_template: bool = False,
    ) -> GenerateOutput:
        """Generate `n` samples of one prompt (``input_ids``, or ``text`` through the tokenizer).

        An engine with `EngineInfo.images` also takes ``images=`` (a sequence of encoded image files the
        worker has read and checked, `rollpool.workers.images`); the worker passes it only to such engines
        and only when the prompt has images, so other engines need not accept the keyword."""
        ...

    async def abort(self, request_id: str) -> None:
        """Finish the request's unfinished samples with reason ``abort`` (partial output kept); no-op if unknown."""

    async def pause(self, mode: str) -> None:
        """Quiesce for a weight update in `mode` (one of ``info().apply_modes``)."""

    async def resume(self) -> None:
        """Continue after `pause`."""

    async def update_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        """Load tensors by HF parameter name and tag later tokens with `version`.

        Every name and shape is checked before anything is written: a version that
        fails the check raises `WeightsRefusedError` and leaves the engine serving
        its previous version, intact. Any other failure raises `EngineError` (the
        engine must then be restarted: it may be half-updated).
        The engine must not keep references to the tensors once it returns:
        the worker reuses their memory for a later version. (`StagingEngine`
        adds a copy to the device ahead of the pause.)
        """

    async def release_memory(self, tags: Sequence[str] = ()) -> None:
        """Free device memory (``weights``, ``kv_cache``); generation waits until `resume_memory`."""

    async def resume_memory(self, tags: Sequence[str] = ()) -> None:
        """Take back what `release_memory` freed."""

    async def flush_cache(self) -> None:
        """Drop cached prefixes (no effect on running sequences)."""

    def info(self) -> EngineInfo:
        """Name, model, capacity, apply modes, version, fingerprint."""
        ...

    async def stop(self) -> None:
        """Abort everything and release the engine; idempotent."""


@runtime_checkable
class StagingEngine(Engine, Protocol):
    """An engine that can copy a version to its device before the pause (overlapping generation).

    The worker calls `stage_weights` after the fetch and before the pause; `update_weights`
    with the same version then only swaps the staged copy in.
    """

    async def stage_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        """Copy `named_tensors` to the device for `version`; raises `EngineError` on failure."""


@runtime_checkable
class AdapterEngine(Engine, Protocol):
    """An engine that serves LoRA adapter versions (docs/lora.md) on its base model.

    An engine whose class sets ``adapters_without_pause = True`` gets adapter versions without a pause around
    `update_adapter` (its running requests keep the adapter version they started on)."""

    async def update_adapter(self, named_tensors: Mapping[str, Any], spec: AdapterSpec, version: int) -> None:
        """Serve adapter `version` (PEFT-named matrices, `spec`) from now on; `WeightsRefusedError`, nothing changed, for
        an adapter of another base or one this engine cannot serve."""


@runtime_checkable
class SizedEngine(Engine, Protocol):
    """An engine that knows how many bytes one weight version of it takes (what the trainer publishes for it)."""

    def weight_bytes(self) -> int:
        """Bytes of one version (0: not known yet, e.g. before `start`)."""
        ...


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    """What a constrained turn may sample: the text `begin`, one JSON value, the text `end`, then only a stop token.

    The JSON value matches `json_schema` (a JSON Schema, as a JSON string); without one it is any
    JSON object. An engine compiles it to a token mask (its grammar backend) and reports, as for any
    token, the model's logprob before the mask (a mask is a truncation, like top-k).
    """

    json_schema: str | None = None
    begin: str = ""
    end: str = ""


@runtime_checkable
class ConstrainedEngine(Engine, Protocol):
    """An engine that can sample under an `OutputConstraint` (structured output, forced tool calls)."""

    async def generate_constrained(self, input_ids: Sequence[int], n: int, sampling: SamplingParams, request_id: str,
                                   constraint: OutputConstraint) -> GenerateOutput:
        """`generate` on token ids, every sample held to `constraint`; `RequestRefusedError` if it does not compile."""
        ...


def can_constrain(engine: object) -> bool:
    """Whether `engine` serves `generate_constrained`, by attribute lookup: a proxy that forwards by ``__getattr__``
    (the worker's `_SupervisedEngine`) counts. ``isinstance(engine, ConstrainedEngine)`` does not see such a proxy
    from Python 3.12 on, where runtime protocol checks look attributes up statically."""
    return callable(getattr(engine, "generate_constrained", None))


_VALID_SAMPLING: dict[tuple[int, int], SamplingParams] = {}
"""Settings `validate_sampling` found valid, by (their id, the group size), each entry holding its object (so that id
is not another object's while the entry is here). An episode hands the engine the same settings object turn after
turn (`Episode._body_sampling`), and the rules are a function of a frozen record's fields: only a `SamplingParams`
whose sequence fields are tuples is kept (a list given in one could change after its check)."""


def validate_sampling(sampling: SamplingParams, n: int) -> None:
    """Raise `RequestRefusedError` naming the parameter that is out of range (the rules: `rollpool.protocol.sampling`)."""
    key = (id(sampling), n)
    exact = type(n) is int
    if exact and _VALID_SAMPLING.get(key) is sampling:
        return
    problem = sampling_problem(sampling, n)
    if problem is not None:
        raise RequestRefusedError(problem.message)
    if exact and type(sampling) is SamplingParams and type(sampling.stop_token_ids) is tuple and type(sampling.stop) is tuple:
        if len(_VALID_SAMPLING) >= 4096:
            _VALID_SAMPLING.clear()
        _VALID_SAMPLING[key] = sampling


def check_request(
    n: int,
    sampling: SamplingParams,
    request_id: str,
    *,
    capacity: int,
    running: Container[str],
    input_ids: Sequence[int] | None,
    text: str | None,
) -> None:
    """The checks every engine makes before it tokenizes or queues a request (`RequestRefusedError`)."""
    validate_sampling(sampling, n)
    if n > capacity:
        raise RequestRefusedError(f"group size {n} exceeds the engine's capacity {capacity}")
    if input_ids is None and text is None:
        raise RequestRefusedError("a prompt needs input_ids or text")
    if request_id in running:
        raise RequestRefusedError(f"request id {request_id!r} is already running")


def check_prompt(
    prompt: Sequence[int],
    sampling: SamplingParams,
    *,
    vocab: int | None = None,
    max_prompt_tokens: int | None = None,
    context_tokens: int | None = None,
) -> None:
    """The checks every engine makes on the token ids it is about to run (`RequestRefusedError`).

    `max_prompt_tokens`: the prompt must be shorter (the hf engine: its positions; a sample
    that reaches the end finishes with ``length``). `context_tokens`: prompt plus
    ``max_new_tokens`` must stay below it (SGLang refuses such a request, API notes 1.1).
    `vocab`: every id in ``[0, vocab)`` (SGLang's scheduler would crash on one outside).
    """
    if not prompt:
        raise RequestRefusedError("empty prompt")
    if max_prompt_tokens is not None and len(prompt) >= max_prompt_tokens:
        raise RequestRefusedError(f"prompt of {len(prompt)} tokens does not fit the model's {max_prompt_tokens} positions")
    if context_tokens is not None and len(prompt) + sampling.max_new_tokens >= context_tokens:
        raise RequestRefusedError(
            f"prompt of {len(prompt)} tokens plus max_new_tokens {sampling.max_new_tokens} does not fit the "
            f"context of {context_tokens} tokens")
    if vocab is not None and (min(prompt) < 0 or max(prompt) >= vocab):
        raise RequestRefusedError(f"prompt token ids must be in [0, {vocab})")
