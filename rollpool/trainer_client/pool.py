"""`RolloutPool`: the calls RL frameworks make on their generation engines, served by the pool.

It is the common core of the seed adapters in `rollpool.trainer_client.compat`
(LightRFT's `RLGenerationEngine`, NeMo-RL's `SGLangGeneration`, AReaL's SGLang
backend), and usable directly. `generate` takes SGLang's `Engine.generate`
arguments and returns SGLang-shaped dicts (``text``, ``output_ids``,
``meta_info`` with ``output_token_logprobs``, ``finish_reason``,
``weight_version``): one dict for one prompt with ``n == 1``, a list otherwise
(prompt-major for ``n > 1``). `sampling_params` and `return_logprob` may be one
value or one per prompt. docs/porting.md maps each call.

Guarantees:

* Every parameter is honoured or refused: an argument or sampling key the pool
  cannot honour raises `UnsupportedParameterError` naming it (an unknown
  LoRA adapter or several at once, custom logit processors, prompt logprobs, streaming, and any sampling key
  other than the neutral value of one SGLang knows). ``top_logprobs_num`` (0 to
  `MAX_TOP_LOGPROBS`, with ``return_logprob``) is honoured by engines that report
  top logprobs (hf) as ``meta_info["output_top_logprobs"]``; a worker whose
  engine cannot fails the group with an error naming it. ``logprob_start_len``
  s >= 0 (with ``return_logprob``) likewise gives ``meta_info["input_token_logprobs"]``
  for the prompt's tokens from position s (``None`` for position 0).
* ``image_data`` (SGLang's and LightRFT's forms): for one prompt an image or a
  list of images; for several prompts a list with one such entry (or None) per
  prompt. An image is bytes, a ``data:image/...;base64,`` URI, a plain base64
  string, an ``http(s)://`` URL (fetched by the worker only where its operator
  allows it) or a file name (read by the worker). They travel as
  `Prompt.images`; a worker that cannot read one fails that prompt naming why.
* ``lora_path``: an entry naming an adapter loaded through `load_lora_adapter` (by
  its name or path; a PEFT directory is loaded on first use) has its prompt served
  at that adapter's version or newer and, with a broker of protocol 1.25, carries the
  adapter's name as `Prompt.policy`: the broker checks every sampled token is that
  adapter's and the result's ``meta_info["policy"]`` says it (docs/lora.md).
* A mapping passed where text is expected (NeMo-RL's batched dict) is refused,
  never generated from its key names.
* Staged tensors (`update_weights_from_tensor`) are published as one new
  version by the next `generate` or by `commit_weights()`, never half a model.
  With `param_shapes` known, a tensor of an unknown name or another shape is
  refused at the call, before anything is published.
* ``synchronous=True``: after a weight update through this object, every prompt
  it submits carries ``min_weight_version`` = that version, so the broker gives
  it only to a worker that applied it; a generation not served within
  `weight_timeout_s` raises `WeightSyncError` naming the workers' versions, and
  a result below the version (a broker older than protocol 1.1) raises too. A
  version every live worker gave up on (it failed to apply, a restarted engine
  included: the broker shows it as the worker's ``skipped_version``, protocol
  1.5) fails the wait at once, within `SYNC_POLL_S`, with `WeightSyncError`
  naming the version and each worker's error text. A call that fails (a
  timeout, a version no worker can apply) cancels its prompts still live; their
  late results are dropped, not kept.
  ``synchronous=False`` (the default of this class) keeps rollpool's
  asynchronous behaviour: every token's version is on the result.
* ``generate(..., exact_weight_version=v)``: every prompt of the call is served
  only at weight version v (`Prompt.exact_weight_version`); a group the broker
  could not serve at v (no live worker holds it and none can reach it) raises
  `WeightSyncError` with the broker's reason, at once rather than at a timeout,
  and a v the pool refuses at submit raises `RejectedError`. Every result's
  ``meta_info`` says ``weight_version_start`` and ``weight_version_end`` (the
  first and last sampled token's version).

The pool owns one `SyncTrainerClient`; every group it pulls belongs to its own
requests (groups of another in-flight call are kept for it).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import math
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NoReturn

from rollpool.protocol import (
    GroupResult,
    GroupState,
    MetricsSink,
    PromptImage,
    RejectedError,
    SamplingParams,
    Trajectory,
    WeightsRefusedError,
    WeightSyncError,
)
from rollpool.trainer_client.client import TrainerClientConfig, make_prompt
from rollpool.trainer_client.sync import SyncTrainerClient

__all__ = ["RolloutPool", "UnsupportedParameterError", "sampling_from_sglang", "SLEEP_TAGS", "ALL_MEMORY_TAGS"]

log = logging.getLogger(__name__)

PromptLike = str | Sequence[int]

SLEEP_TAGS: tuple[str, ...] = ("kv_cache", "cuda_graph")
"""What `sleep()` releases by default (LightRFT's default: the weights stay)."""
ALL_MEMORY_TAGS: tuple[str, ...] = ("weights", "kv_cache", "cuda_graph")
MAX_TOP_LOGPROBS = 64
"""The most top logprobs per output token a generate call may ask for (they travel on every trajectory)."""
SYNC_POLL_S = 0.5
"""While prompts wait for a weight version, how often the pool asks the broker whether every worker gave it up."""


class UnsupportedParameterError(ValueError):
    """A parameter the pool cannot honour; `parameter` names it, the message says what the pool lacks."""

    def __init__(self, parameter: str, message: str) -> None:
        super().__init__(f"{parameter}: {message}")
        self.parameter = parameter


# SGLang sampling keys the pool accepts only at their neutral value (they change nothing there).
_NEUTRAL_SAMPLING: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
}
# SGLang sampling keys with no equivalent on the pool at any value but None.
_UNSUPPORTED_SAMPLING = ("json_schema", "regex", "ebnf", "structural_tag", "logit_bias", "custom_params", "stop_regex")
_DIRECT_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "ignore_eos")


def sampling_from_sglang(params: Mapping[str, Any] | None) -> tuple[SamplingParams, int]:  # noqa: C901 - grandfathered: one check per SGLang sampling parameter
    """SGLang's sampling-params dict -> (`SamplingParams`, n); refuses what the pool cannot honour."""
    if params is None:
        return SamplingParams(), 1
    if not isinstance(params, Mapping):
        raise TypeError(f"sampling_params must be a dict (or a list of dicts, one per prompt), got {type(params).__name__}")
    fields: dict[str, Any] = {}
    n = 1
    max_new = max_tok = None
    for key, value in params.items():
        if value is None:
            continue  # SGLang reads None as "the default"
        if key == "n":
            n = int(value)
            if n < 1:
                raise ValueError(f"sampling_params['n'] must be >= 1, got {n}")
        elif key == "max_new_tokens":
            max_new = int(value)
        elif key == "max_tokens":  # the OpenAI name, used by LightRFT's own example
            max_tok = int(value)
        elif key in _DIRECT_SAMPLING:
            fields[key] = value
        elif key == "stop":
            fields["stop"] = (value,) if isinstance(value, str) else tuple(str(s) for s in value)
        elif key == "stop_token_ids":
            fields["stop_token_ids"] = (int(value),) if isinstance(value, int) else tuple(int(t) for t in value)
        elif key in ("seed", "sampling_seed"):
            fields["seed"] = int(value)
        elif key in _NEUTRAL_SAMPLING:
            if value != _NEUTRAL_SAMPLING[key]:
                raise UnsupportedParameterError(f"sampling_params[{key!r}]", f"the pool's engines do not implement it (only {_NEUTRAL_SAMPLING[key]!r} is accepted)")
        elif key in _UNSUPPORTED_SAMPLING:
            if value not in ({}, "", ()):
                raise UnsupportedParameterError(f"sampling_params[{key!r}]", "constrained decoding and logit biases are not implemented by the pool's engines")
        else:
            raise UnsupportedParameterError(f"sampling_params[{key!r}]", "not a sampling parameter the pool knows")
    if max_new is not None and max_tok is not None and max_new != max_tok:
        raise ValueError(f"sampling_params gives max_new_tokens={max_new} and max_tokens={max_tok}; give one")
    length = max_new if max_new is not None else max_tok
    if length is not None:
        fields["max_new_tokens"] = length
    try:
        return SamplingParams(**fields), n
    except TypeError as exc:  # a wrongly typed value
        raise ValueError(f"sampling_params: {exc}") from exc


def _per_prompt(name: str, value: Any, count: int) -> list[Any]:
    """One value for every prompt, or a list with one per prompt."""
    if isinstance(value, list):
        if len(value) != count:
            raise ValueError(f"{name} is a list of {len(value)} for {count} prompts; give one value or one per prompt")
        return list(value)
    return [value] * count


def _is_token_list(x: Any) -> bool:
    return isinstance(x, Sequence) and not isinstance(x, (str, bytes)) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _normalise_inputs(prompt: Any, input_ids: Any) -> tuple[list[PromptLike], bool]:
    """-> (one text or token list per prompt, whether a single prompt was given)."""
    if prompt is not None and input_ids is not None:
        raise ValueError("generate takes prompt or input_ids, not both")
    if isinstance(prompt, Mapping) or isinstance(input_ids, Mapping):
        data = prompt if isinstance(prompt, Mapping) else input_ids
        raise TypeError(f"generate got a mapping (keys {sorted(map(str, data))[:6]}) where text or token ids are expected; "
                        "NeMo-RL's batched data goes to rollpool.trainer_client.compat.nemo_rl.SGLangGeneration.generate(data)")
    if input_ids is not None:
        ids = input_ids.tolist() if hasattr(input_ids, "tolist") else input_ids
        if _is_token_list(ids) and len(ids) > 0:
            return [list(ids)], True
        if isinstance(ids, Sequence) and len(ids) > 0 and all(_is_token_list(x) and len(x) > 0 for x in ids):
            return [list(x) for x in ids], False
        raise TypeError("input_ids must be a non-empty list of token ids or a non-empty list of such lists")
    if isinstance(prompt, str):
        return [prompt], True
    if isinstance(prompt, Sequence) and len(prompt) > 0 and all(isinstance(p, str) for p in prompt):
        return list(prompt), False
    if prompt is None:
        raise ValueError("generate needs prompt or input_ids")
    raise TypeError(f"prompt must be a text or a non-empty list of texts, got {type(prompt).__name__}"
                    + (" (token ids go in input_ids=)" if _is_token_list(prompt) else ""))


_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp")
_IMAGE_MAGIC = (b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"RIFF", b"BM")


def _image(value: Any) -> PromptImage:
    """One image of `image_data` as SGLang reads it: a URL, a data URI, a file name, else base64 of the file."""
    if isinstance(value, str) and not value.startswith(("data:", "http://", "https://")):
        if not value.lower().endswith(_IMAGE_SUFFIXES):
            try:
                data = base64.b64decode(value, validate=True)
            except binascii.Error:
                data = b""
            if data.startswith(_IMAGE_MAGIC):  # base64 of an image file, not a file name
                return PromptImage(data=data)
        return PromptImage(path=value)
    try:
        return PromptImage.of(value)
    except (TypeError, ValueError) as exc:
        raise UnsupportedParameterError("image_data", str(exc)) from None


def _images_per_prompt(image_data: Any, count: int, single: bool) -> list[tuple[PromptImage, ...]]:
    """`image_data` as each prompt's images (see the module docstring)."""
    if image_data is None:
        return [()] * count

    def one(entry: Any) -> tuple[PromptImage, ...]:
        if entry is None:
            return ()
        if isinstance(entry, (list, tuple)):
            return tuple(_image(x) for x in entry if x is not None)
        return (_image(entry),)

    if single:
        return [one(image_data)]
    if not isinstance(image_data, (list, tuple)) or len(image_data) != count:
        raise UnsupportedParameterError("image_data", f"for {count} prompts give a list of {count} entries (an image, a list of images or None each)")
    return [one(entry) for entry in image_data]


def _check_unsupported(image_data: Any, lora_path: Any, custom_logit_processor: Any, logprob_start_len: Any,
                       top_logprobs_num: Any, stream: bool, count: int) -> None:
    """Arguments no pool can honour (`lora_path` is checked against the adapters loaded: `RolloutPool._lora_version`)."""
    def given(v: Any) -> bool:
        return v is not None and not (isinstance(v, list) and all(x is None for x in v))

    if given(custom_logit_processor):
        raise UnsupportedParameterError("custom_logit_processor", "the pool's engines run no custom logit processors")
    for start in _per_prompt("logprob_start_len", logprob_start_len, count):
        if start is not None and int(start) < -1:
            raise UnsupportedParameterError("logprob_start_len", f"{start}: a prompt position (>= 0) or -1 (no prompt logprobs)")
    for k in _per_prompt("top_logprobs_num", top_logprobs_num, count):
        if k is not None and not 0 <= int(k) <= MAX_TOP_LOGPROBS:
            raise UnsupportedParameterError("top_logprobs_num", f"{k}: the pool reports 0 to {MAX_TOP_LOGPROBS} top logprobs per token")
    if stream:
        raise UnsupportedParameterError("stream", "the pool returns whole samples; use generate_async for results as they finish")


@dataclass
class _Call:
    prompt_ids: list[str]
    sizes: list[int]
    logprobs: list[bool]
    min_version: int
    tops: list[int]
    """top_logprobs_num asked for, per prompt (0: none)."""
    starts: list[int]
    """logprob_start_len asked for, per prompt (-1: none)."""
    exact_version: int = -1


class RolloutPool:
    def __init__(self, broker: str | None = None, *, config: TrainerClientConfig | None = None,
                 metrics: MetricsSink | None = None, initial_version: int = 0, timeout_s: float | None = 600.0,
                 synchronous: bool = False, weight_timeout_s: float | None = None, fingerprint: str = "",
                 param_shapes: Mapping[str, tuple[int, ...]] | None = None) -> None:
        self._client = SyncTrainerClient(broker, config=config, metrics=metrics, fingerprint=fingerprint)
        self.version = max(initial_version, self._client.version)
        self.timeout_s = timeout_s
        self.synchronous = synchronous
        self.weight_timeout_s = weight_timeout_s if weight_timeout_s is not None else timeout_s
        self.param_shapes = dict(param_shapes) if param_shapes is not None else None
        self._required = -1
        """The version the next prompts must be served at (synchronous mode; -1: any)."""
        self._staged: dict[str, Any] = {}
        self._flush_after_commit = False
        self._done: dict[str, GroupResult] = {}
        self._abandoned: set[str] = set()
        """Prompts of a failed call: cancelled at the broker; their results are dropped when they arrive."""
        self._slept_with_weights: bool | None = None
        self._released: set[str] = set()
        """Memory tags this object released on the workers and has not resumed."""
        self._closed = False
        self._adapters: dict[str, tuple[str, int]] = {}
        """Adapter names and paths loaded through this object (`load_lora_adapter`) -> (the adapter's name, which is its
        policy; the version that published it)."""

    # ------------------------------------------------------------------ generation

    def _submit(self, prompt: Any, input_ids: Any, sampling_params: Any, return_logprob: Any,
                image_data: Any = None, lora_path: Any = None, custom_logit_processor: Any = None,
                logprob_start_len: Any = None, top_logprobs_num: Any = None, stream: bool = False,
                exact_weight_version: int | None = None) -> tuple[_Call, bool]:
        if self._released:
            raise RuntimeError(f"generate while the workers' {sorted(self._released)} are released: call wake_up() "
                               "(or prepare_for_generation()) first")
        items, single = _normalise_inputs(prompt, input_ids)
        _check_unsupported(image_data, lora_path, custom_logit_processor, logprob_start_len, top_logprobs_num, stream, len(items))
        adapter_version, policies = self._lora_version(lora_path, len(items))
        sampling = [sampling_from_sglang(sp) for sp in _per_prompt("sampling_params", sampling_params, len(items))]
        logprobs = [bool(x) for x in _per_prompt("return_logprob", return_logprob, len(items))]
        # SGLang reports top logprobs with return_logprob only; they are asked of the workers only then
        tops = [int(k or 0) if lp else 0 for k, lp in zip(_per_prompt("top_logprobs_num", top_logprobs_num, len(items)), logprobs, strict=True)]
        sampling = [(replace(sp, top_logprobs_num=k) if k else sp, n) for (sp, n), k in zip(sampling, tops, strict=True)]
        starts = [int(s) if lp and s is not None else -1 for s, lp in zip(_per_prompt("logprob_start_len", logprob_start_len, len(items)), logprobs, strict=True)]
        sampling = [(replace(sp, logprob_start_len=s) if s >= 0 else sp, n) for (sp, n), s in zip(sampling, starts, strict=True)]
        if self._staged:
            self.commit_weights()
        required = self._required if self.synchronous else -1
        # a prompt naming an adapter is served on that adapter version or a newer one (the pool's one adapter, trained on)
        required = max(required, adapter_version)
        prompts = []
        images = _images_per_prompt(image_data, len(items), single)
        for item, (sp, n), ims, policy in zip(items, sampling, images, policies, strict=True):
            p = make_prompt(item, group_size=n, sampling=sp)
            if ims:
                p = replace(p, images=ims)
            if policy is not None:
                p = replace(p, policy=policy)
            p = replace(p, min_weight_version=required) if required >= 0 else p
            prompts.append(replace(p, exact_weight_version=exact_weight_version) if exact_weight_version is not None else p)
        result = self._client.submit(prompts)
        if result.rejected:
            pid, reason = next(iter(result.rejected.items()))
            detail = f": {result.details[pid]}" if pid in result.details else ""
            raise RejectedError(reason, f"{len(result.rejected)} prompts rejected (first: {pid}{detail})")
        exact = -1 if exact_weight_version is None else exact_weight_version
        return (_Call([p.prompt_id for p in prompts], [p.group_size for p in prompts], logprobs, required, tops, starts, exact),
                single and sampling[0][1] == 1)

    def _take_batch(self, deadline: float | None, call: _Call) -> list[GroupResult]:
        poll = SYNC_POLL_S if call.min_version >= 0 or call.exact_version >= 0 else 5.0
        wait = poll if deadline is None else max(0.0, min(poll, deadline - time.monotonic()))
        try:
            batch = self._client.get_batch(1, timeout=wait)
        except TimeoutError:
            if deadline is not None and time.monotonic() >= deadline:
                self._fail(call, self._timeout_error(call))
            if call.min_version >= 0:
                self._check_version_reachable(call)
            if call.exact_version >= 0:
                # its groups may all have failed (the version gone): they come without any DONE group beside them
                return [g for g in self._client.take_ended() if not self._abandoned_now(g)]
            return []
        return [g for g in batch.groups + batch.other if not self._abandoned_now(g)]

    def _abandoned_now(self, g: GroupResult) -> bool:
        if g.prompt_id in self._abandoned:
            self._abandoned.discard(g.prompt_id)  # a failed call's prompt: its result (or its cancellation) is dropped
            return True
        return False

    def _check_version_reachable(self, call: _Call) -> None:
        """Fail the call at once when every live worker gave up the version it waits for and nothing newer is out."""
        status = self._client.status()
        workers: dict[str, Any] = status["workers"]
        if not workers:
            return  # a worker may still join and apply it
        latest = status["counters"].get("version", -1)
        latest = latest if isinstance(latest, int) else -1
        errors: dict[str, str] = {}
        for wid, s in workers.items():
            version, skipped = s.get("version"), s.get("skipped_version")
            if isinstance(version, int) and version >= call.min_version:
                return  # someone serves it: the prompts will be dispatched
            if not (isinstance(skipped, int) and skipped >= call.min_version and skipped >= latest):
                return  # still fetching or applying it (or a broker older than protocol 1.7: the timeout decides)
            errors[wid] = str(s.get("skipped_error") or "no reason given")
        missing = sum(1 for pid in call.prompt_ids if pid not in self._done)
        detail = "; ".join(f"{w} (at version {workers[w].get('version')}): {e}" for w, e in sorted(errors.items()))
        self._fail(call, WeightSyncError(f"weight version {call.min_version} cannot be applied: every worker gave it up "
                                         f"({missing} prompts waited for it): {detail}"))

    def _timeout_error(self, call: _Call) -> Exception:
        missing = [pid for pid in call.prompt_ids if pid not in self._done]
        if call.min_version >= 0:
            workers = self._client.status()["workers"]
            at = {w: (s.get("version"), s.get("state")) for w, s in workers.items()}
            if not any(isinstance(v, int) and v >= call.min_version for v, _ in at.values()):
                return WeightSyncError(f"no worker served weight version {call.min_version} within {self.weight_timeout_s} s "
                                       f"({len(missing)} prompts wait for it); workers (version, state): {at or 'none connected'}")
        return TimeoutError(f"{len(missing)} of {len(call.prompt_ids)} prompts not done within {self.timeout_s} s")

    def _fail(self, call: _Call, error: Exception) -> NoReturn:
        """Cancel the call's prompts still live, drop what was done of it, raise `error`."""
        live = [pid for pid in call.prompt_ids if pid not in self._done]
        for pid in call.prompt_ids:
            self._done.pop(pid, None)
        if live:
            self._abandoned.update(live)
            try:
                self._client.cancel(live)
            except Exception as exc:  # noqa: BLE001 - the error below is the one to report
                log.warning("cancelling %d prompts of a failed generate failed: %s", len(live), exc)
        raise error

    def _deadline(self, call: _Call) -> float | None:
        limit = self.weight_timeout_s if call.min_version >= 0 else self.timeout_s
        return None if limit is None else time.monotonic() + limit

    def _collect(self, call: _Call) -> None:
        deadline = self._deadline(call)
        wanted = set(call.prompt_ids)
        while not wanted <= self._done.keys():
            for g in self._take_batch(deadline, call):
                self._done[g.prompt_id] = g

    def generate(self, prompt: str | Sequence[str] | None = None, sampling_params: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
                 input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None, image_data: Any = None,
                 return_logprob: bool | Sequence[bool] = False, logprob_start_len: int | Sequence[int] | None = None,
                 top_logprobs_num: int | Sequence[int] | None = None, lora_path: Any = None,
                 custom_logit_processor: Any = None, stream: bool = False,
                 exact_weight_version: int | None = None) -> dict[str, Any] | list[dict[str, Any]]:
        """SGLang's `Engine.generate`: one dict for one prompt with n == 1, else a list (prompt-major for n > 1).

        ``exact_weight_version`` (not an SGLang argument): serve every prompt only at that weight version."""
        call, single = self._submit(prompt, input_ids, sampling_params, return_logprob, image_data, lora_path,
                                    custom_logit_processor, logprob_start_len, top_logprobs_num, stream, exact_weight_version)
        self._collect(call)
        out: list[dict[str, Any]] = []
        for pid, n, lp, k, s in zip(call.prompt_ids, call.sizes, call.logprobs, call.tops, call.starts, strict=True):
            out.extend(self._to_sglang(self._check_exact(call, self._done.pop(pid)), n, lp, call.min_version, k, s))
        return out[0] if single else out

    async def generate_async(self, prompt: str | Sequence[str] | None = None,
                             sampling_params: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
                             input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                             return_logprob: bool | Sequence[bool] = False, **kwargs: Any) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """Yield ``(index, result)`` as each group finishes (index in the prompt-major expanded order)."""
        call, _ = await asyncio.to_thread(self._submit, prompt, input_ids, sampling_params, return_logprob, **kwargs)
        offsets: dict[str, int] = {}
        at = 0
        for pid, n in zip(call.prompt_ids, call.sizes, strict=True):
            offsets[pid] = at
            at += n
        sizes = dict(zip(call.prompt_ids, call.sizes, strict=True))
        logprobs = dict(zip(call.prompt_ids, call.logprobs, strict=True))
        tops = dict(zip(call.prompt_ids, call.tops, strict=True))
        starts = dict(zip(call.prompt_ids, call.starts, strict=True))
        deadline = self._deadline(call)
        left = set(call.prompt_ids)
        while left:
            for pid in [p for p in left if p in self._done]:  # taken by a concurrent call's pull
                left.discard(pid)
                g = self._check_exact(call, self._done.pop(pid))
                for j, res in enumerate(self._to_sglang(g, sizes[pid], logprobs[pid], call.min_version, tops[pid], starts[pid])):
                    yield offsets[pid] + j, res
            if not left:
                break
            for g in await asyncio.to_thread(self._take_batch, deadline, call):
                self._done[g.prompt_id] = g

    def _check_exact(self, call: _Call, g: GroupResult) -> GroupResult:
        """A group of an exact-version call that the broker could not serve at that version fails the call."""
        if call.exact_version >= 0 and g.state == GroupState.FAILED and g.reason.startswith("exact_version_unavailable"):
            self._fail(call, WeightSyncError(f"prompt {g.prompt_id} could not be served at weight version {call.exact_version}: {g.reason}"))
        return g

    @staticmethod
    def _to_sglang(g: GroupResult, n: int, return_logprob: bool, min_version: int = -1, top_k: int = 0,
                   logprob_start: int = -1) -> list[dict[str, Any]]:
        if g.state != GroupState.DONE:
            return [{"text": "", "output_ids": [], "meta_info": {"id": f"{g.prompt_id}:{i}", "finish_reason": {"type": "abort", "message": f"{g.state}: {g.reason}"}}} for i in range(n)]
        trajs: list[Trajectory] = sorted(g.trajectories, key=lambda t: t.sample_index)
        out = []
        for t in trajs:
            oldest = int(t.token_versions.min()) if len(t.token_versions) else None
            if oldest is not None and oldest < min_version:
                raise WeightSyncError(f"{t.trajectory_id} was served at weight version {oldest}, below the required {min_version}: "
                                      "the broker does not dispatch by min_weight_version (protocol older than 1.1?)")
            meta: dict[str, Any] = {
                "id": t.trajectory_id,
                "finish_reason": {"type": t.finish_reason},
                "prompt_tokens": int(len(t.input_ids)),
                "completion_tokens": int(len(t.output_ids)),
                "weight_version": "" if oldest is None else str(oldest),
                "weight_version_start": t.version_start,
                "weight_version_end": t.version_end,
                "token_versions": t.token_versions.tolist(),
                "worker_id": t.worker_id,
                "reward": t.reward,
                "finished_at": t.finished_at,
            }
            if t.policy is not None:  # the adapter (by name) every sampled token was made under, checked by the broker
                meta["policy"] = t.policy
            if return_logprob:
                meta["output_token_logprobs"] = [(float(lp), int(tok), None) for lp, tok in zip(t.output_logprobs, t.output_ids, strict=True)]
            if logprob_start >= 0:
                if t.input_logprobs is None:
                    raise UnsupportedParameterError("logprob_start_len", f"{t.trajectory_id} came without prompt logprobs: worker "
                                                    f"{t.worker_id!r} ignored the request (protocol older than 1.5?)")
                first = len(t.input_ids) - len(t.input_logprobs)
                if first < 0:
                    raise ValueError(f"{t.trajectory_id}: {len(t.input_logprobs)} prompt logprobs for {len(t.input_ids)} prompt tokens "
                                     f"(worker {t.worker_id!r})")
                meta["input_token_logprobs"] = [(None if math.isnan(lp) else float(lp), int(tok), None)
                                                for lp, tok in zip(t.input_logprobs, t.input_ids[first:], strict=True)]
            if top_k > 0:
                if t.output_top_ids is None or t.output_top_logprobs is None:
                    raise UnsupportedParameterError("top_logprobs_num", f"{t.trajectory_id} came without top logprobs: worker "
                                                    f"{t.worker_id!r} ignored the request (protocol older than 1.5?)")
                want = len(t.output_ids) * top_k
                if len(t.output_top_ids) != want or len(t.output_top_logprobs) != want:
                    raise ValueError(f"{t.trajectory_id}: {len(t.output_top_ids)} top ids and {len(t.output_top_logprobs)} top logprobs "
                                     f"for {len(t.output_ids)} tokens x {top_k} (worker {t.worker_id!r})")
                ids, lps = t.output_top_ids.reshape(-1, top_k), t.output_top_logprobs.reshape(-1, top_k)
                meta["output_top_logprobs"] = [[(float(lp), int(tok), None) for lp, tok in zip(lr, ir, strict=True)]
                                               for lr, ir in zip(lps, ids, strict=True)]
            out.append({"text": t.output_text or "", "output_ids": t.output_ids.tolist(), "meta_info": meta})
        return out

    # ------------------------------------------------------------------ weights

    def _check_tensor(self, name: str, tensor: Any) -> None:
        if self.param_shapes is None:
            return
        shape = self.param_shapes.get(name)
        if shape is None:
            raise WeightSyncError(f"{name!r} is not a parameter of the pool's model ({len(self.param_shapes)} parameters); nothing was published")
        got = tuple(int(d) for d in getattr(tensor, "shape", ()))
        if got != tuple(shape):
            raise WeightSyncError(f"{name} has shape {got}, the pool's model has {tuple(shape)}; nothing was published")

    def update_weights_from_tensor(self, name: str, tensor: Any, flush_cache: bool = False, load_format: str | None = None) -> None:
        """Stage one tensor; the next generate (or commit_weights) publishes all staged tensors as a new version."""
        if load_format not in (None, "direct"):
            raise UnsupportedParameterError("load_format", f"{load_format!r}: the pool takes plain named tensors (None or 'direct')")
        self._check_tensor(name, tensor)
        self._staged[name] = tensor
        self._flush_after_commit = self._flush_after_commit or flush_cache

    def commit_weights(self) -> int:
        """Publish the staged tensors as one new version; returns it."""
        staged, self._staged = self._staged, {}
        flush, self._flush_after_commit = self._flush_after_commit, False
        version = self.update_weights(staged)
        if flush:
            self._client.flush_cache()
        return version

    def update_weights(self, named_tensors: Mapping[str, Any] | Any) -> int:
        """Publish a new weight version (a dict, a module or an iterator of (name, tensor))."""
        if isinstance(named_tensors, Mapping):
            for name, tensor in named_tensors.items():
                self._check_tensor(str(name), tensor)
        version = self._next_version()
        self._client.publish_weights(named_tensors, version)
        self.version = version
        self._required = version
        return version

    def load_lora_adapter(self, lora_name: str, lora_path: str | None = None, *, tensors: Mapping[str, Any] | None = None,
                          spec: Any = None) -> int:
        """Publish a LoRA adapter as a new version (SGLang's ``load_lora_adapter(lora_name, lora_path)``): from a PEFT
        directory (`lora_path`, default `lora_name`) or from its matrices and `AdapterSpec` (`tensors`, `spec`). The pool
        serves one adapter at a time, the latest; prompts may name it (``lora_path=[name]``, or by its path). `lora_name`
        is the adapter's policy name (`AdapterSpec.name`, whatever `spec` said): loading the same name again publishes a
        new version of that policy. Returns the version."""
        from rollpool.weights.adapters import read_peft_adapter

        if tensors is None:
            tensors, spec = read_peft_adapter(lora_path or lora_name, base_fingerprint=self._client.client.fingerprint)
        elif spec is None:
            raise ValueError("load_lora_adapter with tensors needs their spec (rollpool.weights.adapters.adapter_spec)")
        spec = replace(spec, name=str(lora_name))
        if spec.base_fingerprint:  # refused here, before anything is published, when a worker serves another base
            workers = self._client.status()["workers"]
            other = {w: st.get("fingerprint") for w, st in workers.items() if st.get("fingerprint") not in (None, "", spec.base_fingerprint)}
            if other:
                raise WeightsRefusedError(
                    f"adapter {lora_name!r} applies to base {spec.base_model or '?'} (fingerprint {spec.base_fingerprint}), "
                    f"the pool's workers serve fingerprint {sorted(other.items())}; nothing was published")
        version = self._next_version()
        self._client.publish_weights(tensors, version, adapter=spec)
        self.version = version
        self._required = version
        self._adapters = {lora_name: (str(lora_name), version)} | ({lora_path: (str(lora_name), version)} if lora_path else {})
        return version

    def _lora_version(self, lora_path: Any, count: int) -> tuple[int, list[str | None]]:
        """The adapter version prompts naming `lora_path` need (-1: none named), and each prompt's policy: the name of
        the adapter its entry names (None for a None entry, or when the broker is older than `POLICY_MINOR`: there the
        version alone says it). An entry that is a PEFT directory not loaded yet is loaded (published) first; any other
        unknown name, or one of an adapter no longer served, is refused by name before anything is submitted."""
        from rollpool.protocol import POLICY_MINOR

        entries = [None if p is None else str(p) for p in _per_prompt("lora_path", lora_path, count)]
        names = {p for p in entries if p is not None}
        if not names:
            return -1, [None] * count
        for name in sorted(names - set(self._adapters)):
            import pathlib

            if (pathlib.Path(name) / "adapter_config.json").is_file() and len(names) == 1:
                self.load_lora_adapter(name, name)
            else:
                raise UnsupportedParameterError(
                    "lora_path", f"unknown adapter {name!r}: load it first (load_lora_adapter); the pool serves "
                    f"{sorted(self._adapters) or 'no adapter'}, one at a time")
        versions = {self._adapters[n][1] for n in names}
        if len(versions) > 1:
            raise UnsupportedParameterError("lora_path", f"{sorted(names)}: the pool serves one adapter at a time")
        named = self._client.client.broker_minor >= POLICY_MINOR
        return versions.pop(), [self._adapters[e][0] if e is not None and named else None for e in entries]

    def update_weights_from_disk(self, path: str) -> int:
        """Workers load an HF checkpoint directory from a path they share with the trainer; a new version."""
        version = self._next_version()
        self._client.control("update_weights_from_disk", path=path, version=version)
        self._client.set_version(version)
        self.version = version
        self._required = version
        return version

    def _next_version(self) -> int:
        """One above every version this client, and the broker (another trainer may have published), has seen."""
        announced = self._client.status()["counters"].get("version", -1)
        return max(self.version, self._client.version, int(announced) if isinstance(announced, int) else -1) + 1

    def require_version(self, version: int) -> None:
        """Serve the next prompts only at `version` or newer (e.g. weights another process published); synchronous mode."""
        if not self.synchronous:
            raise ValueError("require_version needs RolloutPool(synchronous=True)")
        self._required = max(self._required, version)

    # ------------------------------------------------------------------ memory and lifecycle

    def sleep(self, tags: Sequence[str] | None = None, release_weights: bool = False) -> None:
        """Release memory on every worker: KV cache and CUDA graphs (LightRFT's default), weights too when asked."""
        chosen = tuple(tags) if tags is not None else SLEEP_TAGS
        if release_weights and "weights" not in chosen:
            chosen += ("weights",)
        self._client.sleep(chosen)
        self._slept_with_weights = "weights" in chosen
        self._released |= set(chosen)

    def wake_up(self, tags: Sequence[str] | None = None, release_weights: bool = False) -> None:
        """Resume what `sleep` released; `release_weights` must match the value given to `sleep`."""
        if tags is None and self._slept_with_weights is not None and release_weights != self._slept_with_weights:
            raise ValueError(f"wake_up(release_weights={release_weights}) after sleep(release_weights={self._slept_with_weights}): they must match")
        chosen = tuple(tags) if tags is not None else SLEEP_TAGS
        if release_weights and "weights" not in chosen:
            chosen += ("weights",)
        self._client.wake(chosen)
        self._slept_with_weights = None
        self._released -= set(chosen)

    def prepare_for_generation(self, tags: Sequence[str] | None = None) -> bool:
        """Resume the workers' memory (all of it, or the given tags); True when every worker did.

        Resuming ``kv_cache`` resumes ``cuda_graph`` with it (graphs are captured over the cache), so
        NeMo-RL's two-step resume (``["weights"]``, then ``["kv_cache"]``) leaves nothing released.
        """
        chosen = tuple(tags) if tags else ALL_MEMORY_TAGS
        if "kv_cache" in chosen and "cuda_graph" not in chosen:
            chosen += ("cuda_graph",)
        ok = self._fan_out("wake", chosen)
        if ok:
            self._released -= set(chosen)
        return ok

    def finish_generation(self, tags: Sequence[str] | None = None) -> bool:
        """Release the workers' memory (all of it, or the given tags); True when every worker did."""
        chosen = tuple(tags) if tags else ALL_MEMORY_TAGS
        ok = self._fan_out("sleep", chosen)
        if ok:
            self._released |= set(chosen)
        return ok

    def invalidate_kv_cache(self) -> bool:
        """Flush the KV (prefix) cache on every worker; True when every worker did."""
        return self._fan_out("flush_cache", ())

    def _fan_out(self, op: str, tags: tuple[str, ...]) -> bool:
        try:
            self._client.control(op, tags)
        except RejectedError as exc:
            log.warning("%s failed on some workers: %s", op, exc)
            return False
        return True

    def worker_urls(self) -> list[str]:
        """The ids of the live workers (a worker dials out, so it has no URL of its own)."""
        return sorted(self._client.status()["workers"])

    def status(self) -> dict[str, Any]:
        return self._client.status()

    def shutdown(self) -> bool:
        """Close this client (the pool keeps serving other trainers); True once closed."""
        if not self._closed:
            self._closed = True
            if self._staged:
                log.warning("shutdown with %d staged tensors never published (no generate or commit_weights after them)", len(self._staged))
            self._client.close()
        return True

    def __enter__(self) -> RolloutPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

