"""The `hf` engine: a real causal LM through torch + transformers, with continuous batching.

Guarantees:

- Compute runs in one dedicated thread; the asyncio side only enqueues
  commands and awaits futures, so the worker's event loop (heartbeats) never
  waits on a forward pass.
- Continuous batching with a KV cache: a new request is prefilled once (its
  n samples share the prompt's KV) and joins the running batch between decode
  steps; each decode step feeds exactly one new token per running sequence.
  The batch is left-padded with an attention mask and explicit position ids.
- Sampling as SGLang does it: ``temperature`` (0 = greedy), then ``top_k``,
  ``top_p``, ``min_p`` truncation; the reported logprob is
  ``log_softmax(logits / temperature)`` of the chosen token before truncation
  (temperature 1 when greedy). ``output_ids`` include the stop token (eos or
  ``stop_token_ids``, both ignored with ``ignore_eos``) and the token that
  completed a stop string; ``output_text`` has them trimmed.
  ``seed`` makes a request reproducible (sample i uses seed + i).
  ``top_logprobs_num`` k > 0 also reports the k most likely tokens and their
  logprobs (the same log_softmax) at every output position; ``logprob_start_len``
  s >= 0 the logprob of every prompt token from position s (one full-logits
  prefill of the prompt).
- Constrained decoding (`ConstrainedEngine`): ``generate_constrained`` holds every
  sample to an `OutputConstraint` through xgrammar (`grammar`); the reported
  logprob stays the model's, before the grammar's mask.
- LoRA adapter versions (`update_adapter`, docs/lora.md): kept resident (``lora_resident`` of them, besides
  any a running sequence still uses) through `LoraBank`; a sequence runs on the newest adapter version when it is
  first prefilled and finishes on it (each of its tokens carries that version), while newer sequences run on
  newer ones in the same batch. The worker applies an adapter version without a pause (``adapters_without_pause``:
  it is added between two steps on the compute thread), so no running sequence is interrupted or re-prefilled for
  it, whatever the apply mode; a sequence re-prefilled for another reason (a whole-model update in ``interrupt``
  mode) moves to the newest. A whole-model update keeps the newest adapter version on, on top of the new base:
  every sequence that began moves to it and its later tokens carry the whole-model version (that version's
  policy is the new base plus that adapter); older adapter versions are dropped.
- Weight updates by HF parameter name happen between decode steps, every
  name and shape checked first; pause modes as in `base`. Every output token
  carries the version current when it was sampled; in ``interrupt`` mode the
  running sequences are re-prefilled (prompt + partial output) under the new
  weights, so tokens after the update depend on the new weights only.
- Which failure is whose: a request's own setup or sampling failing on logits
  that are finite (its seed, its sampling values: what `check_request` would
  have refused had a caller skipped it) fails that request alone with
  `RequestRefusedError`, and every other sequence decodes on. Any other
  exception inside the compute thread, non-finite logits included (the model
  itself is broken), kills the engine: every pending and later call raises
  `EngineError` (the worker restarts it).

- A vision-language model (a config with ``vision_config``, e.g. Qwen2-VL) loads with its image
  processor and takes ``images=`` (encoded files, checked by the worker): placeholders expanded as
  `rollpool.workers.engines.vision` says; the prefill runs the vision
  tower and the model's 3-D rotary positions, and later tokens continue at the model's position
  offset. ``GenerateOutput.input_ids`` are the expanded ids, ``image_grid_thw`` the patch grids.

`stats` counts forward calls and the tokens each processed (tests use it to
check that decoding is incremental).
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import math
import pathlib
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rollpool.protocol.errors import EngineError, RequestRefusedError, WeightsRefusedError
from rollpool.protocol.fingerprint import model_fingerprint
from rollpool.protocol.messages import AdapterSpec, ApplyMode, FinishReason, SamplingParams
from rollpool.workers.engines.base import (
    APPLY_MODES,
    EngineInfo,
    GenerateOutput,
    OutputConstraint,
    SampleOutput,
    check_prompt,
    check_request,
)
from rollpool.workers.engines.lora import LoraBank
from rollpool.workers.engines.options import HFOptions, options_from
from rollpool.workers.engines.vision import VisionSpec, load_vision_spec

__all__ = ["HFEngine", "ENGINE_FACTORY", "sample_token", "top_logprobs", "prompt_token_logprobs"]

log = logging.getLogger(__name__)

_GREEDY_EPS = 1e-5


def prompt_token_logprobs(logits: torch.Tensor, ids: list[int], sampling: SamplingParams) -> list[float]:
    """The logprob of each prompt token given the ones before it (all-position logits, (L, V)), from
    ``sampling.logprob_start_len`` on; NaN for position 0. The same log_softmax as the output logprobs."""
    temperature = 1.0 if sampling.temperature < _GREEDY_EPS else sampling.temperature
    logp = torch.log_softmax(logits[:-1] / temperature, dim=-1)
    nxt = torch.tensor(ids[1:], dtype=torch.long, device=logits.device)
    values = [math.nan] + [float(v) for v in logp.gather(1, nxt[:, None])[:, 0]]
    return values[min(sampling.logprob_start_len, len(values)) :]


def top_logprobs(logits: torch.Tensor, sampling: SamplingParams, k: int) -> tuple[list[int], list[float]]:
    """The k most likely tokens of a 1-D logits row and their logprobs, as `sample_token` reports logprobs
    (log_softmax(logits / temperature) before truncation; temperature 1 when greedy), most likely first."""
    temperature = 1.0 if sampling.temperature < _GREEDY_EPS else sampling.temperature
    logp = torch.log_softmax(logits / temperature, dim=-1)
    values, ids = torch.topk(logp, min(k, logp.numel()))
    return [int(i) for i in ids], [float(v) for v in values]


def sample_token(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> tuple[int, float]:
    """Pick one token from a 1-D float32 logits row; returns (token, logprob before truncation)."""
    greedy = sampling.temperature < _GREEDY_EPS
    temperature = 1.0 if greedy else sampling.temperature
    logp = torch.log_softmax(logits / temperature, dim=-1)
    if greedy or sampling.top_k == 1:
        tok = int(torch.argmax(logp))
        return tok, float(logp[tok])
    probs = logp.exp()
    if sampling.top_k > 0 and sampling.top_k < probs.numel():
        kth = torch.topk(probs, sampling.top_k).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1) / sorted_probs.sum()
        drop = (cum - sorted_probs / sorted_probs.sum()) > sampling.top_p
        sorted_probs = torch.where(drop, torch.zeros_like(sorted_probs), sorted_probs)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    if sampling.min_p > 0.0:
        probs = torch.where(probs < sampling.min_p * probs.max(), torch.zeros_like(probs), probs)
    tok = int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
    return tok, float(logp[tok])


@dataclass(eq=False)
class _Seq:
    group: _Group
    index: int
    generator: torch.Generator | None
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    """With ``sampling.top_logprobs_num``: per output token, the k most likely ids and their logprobs."""
    kv_len: int = 0
    """Tokens of this sequence held in the KV cache (the last sampled token is not yet)."""
    finish: str | None = None
    adapter: int | None = None
    """The LoRA adapter version this sequence runs on (set at its first prefill, and again by a whole-model version;
    None: the base model alone)."""
    tag: int = -1
    """The version this sequence's tokens carry while it runs on `adapter`: the engine's version when the adapter was
    set (the adapter version itself, or a later whole-model version under it)."""
    matched: int | str | None = None
    first_token_at: float = 0.0
    finished_at: float = 0.0
    grammar: Any = None
    """A `grammar.GrammarState` when the request is constrained."""

    def context(self) -> list[int]:
        return self.group.input_ids + self.out


@dataclass(eq=False)
class _Group:
    request_id: str
    input_ids: list[int]
    sampling: SamplingParams
    done: Callable[[GenerateOutput | BaseException], None]
    started_at: float
    stop_ids: frozenset[int] = frozenset()
    seqs: list[_Seq] = field(default_factory=list)
    input_logprobs: list[float] | None = None
    """With ``sampling.logprob_start_len`` >= 0: the prompt's logprobs from that position (first prefill)."""
    vision: _Vision | None = None


@dataclass(eq=False)
class _Vision:
    """A group's images as the model takes them."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    """(images, 3) long."""
    rope_delta: int = 0
    """Position of a text token after the prompt minus its index (set by the first prefill)."""


class HFEngine:
    """A transformers causal LM served with continuous batching (see the module docstring)."""

    adapters_without_pause = True
    """An adapter version is added between two steps on the engine's thread, and every sequence keeps the version it
    began on: the worker does not pause (nor, in ``interrupt`` mode, re-prefill) running sequences for it."""

    def __init__(self, options: HFOptions | None = None, /, **kwargs: Any) -> None:
        """`HFOptions` (or its fields as keywords: ``HFEngine(model=..., capacity=...)``)."""
        opts = options if options is not None else options_from(HFOptions, kwargs)
        self.options = opts
        self.model_path = str(opts.model)
        self.capacity = opts.capacity
        self.device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = getattr(torch, opts.dtype)
        self.seed = opts.seed
        self.version = opts.initial_version
        self._base_version = opts.initial_version
        """The version of the base weights (the last whole-model version): what a token sampled on no adapter carries."""
        self.num_threads = opts.num_threads
        self.attn_implementation = opts.attn_implementation
        self.stats: dict[str, int] = {"forward_calls": 0, "prefill_tokens": 0, "decode_tokens": 0, "decode_steps": 0}
        self.forward_log: collections.deque[tuple[str, int, int]] = collections.deque(maxlen=10_000)
        """(kind, batch rows, new tokens per row) of recent forward calls."""
        self._model: Any = None
        self._tokenizer: Any = None
        self._eos_ids: frozenset[int] = frozenset()
        self._fingerprint = ""
        self._max_positions = 1 << 30
        self._vocab = 0
        self._vision: VisionSpec | None = None
        """Set for a vision-language model (`_load`)."""
        self._cache_kw = "cache"
        self._cmds: queue.SimpleQueue[tuple[str, Any, Callable[[Any], None]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._dead: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._request_counter = 0
        # compute-thread state
        self._waiting: collections.deque[list[_Seq]] = collections.deque()
        self._running: list[_Seq] = []
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._mask: torch.Tensor | None = None
        self._groups: dict[str, _Group] = {}
        self._pause_mode: str | None = None
        self._drain_waiters: list[Callable[[Any], None]] = []
        self._released: set[str] = set()
        self._grammar: Any = None
        self._lora: LoraBank | None = None

    # -- Engine protocol

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        try:
            await asyncio.to_thread(self._load)
        except Exception as exc:
            raise EngineError(f"hf engine could not load {self.model_path}: {exc}") from exc
        self._thread = threading.Thread(target=self._compute_loop, name=f"hf-engine-{id(self):x}", daemon=True)
        self._thread.start()

    def weight_bytes(self) -> int:
        """Bytes of one weight version for this engine: its state dict as loaded, as a trainer's publish of the same
        model counts it (tied weights under each name); 0 before `start`."""
        model = self._model
        if model is None:
            return 0
        return sum(int(t.numel()) * int(t.element_size()) for t in model.state_dict().values())

    def info(self) -> EngineInfo:
        return EngineInfo(
            name="hf",
            model=self.model_path,
            capacity=self.capacity,
            apply_modes=APPLY_MODES,
            weight_version=self.version,
            fingerprint=self._fingerprint,
            simulated=False,
            device=self.device,
            # the context it serves (its positions; 0 until loaded): the episode endpoint's context_length_exceeded
            extra={"dtype": str(self.dtype).removeprefix("torch."),
                   "max_context_tokens": self._max_positions if self._max_positions < 1 << 30 else 0,
                   **self._image_extra()},
            top_logprobs=True,
            prompt_logprobs=True,
            images=self._vision is not None,
        )

    def _image_extra(self) -> dict[str, Any]:
        """A vision-language model's ``image_placeholder_ids``: the ids one image stands as before expansion
        (start, image token, end), what the episode endpoint renders an image part as."""
        spec = self._vision
        return {} if spec is None else {"image_placeholder_ids": [spec.start_id, spec.image_id, spec.end_id]}

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    async def generate(
        self,
        input_ids: Sequence[int] | None,
        n: int,
        sampling: SamplingParams,
        request_id: str,
        *,
        text: str | None = None,
        apply_chat_template: bool = False,
        images: Sequence[bytes] = (),
    ) -> GenerateOutput:
        self._check()
        check_request(n, sampling, request_id, capacity=self.capacity, running=self._groups, input_ids=input_ids, text=text)
        vision: _Vision | None = None
        prompt = self._tokenize(input_ids, text, apply_chat_template)
        if images:
            spec = self._vision
            if spec is None:
                raise RequestRefusedError(f"the model at {self.model_path} takes no images (not a vision-language model)")
            pixels, grids = await asyncio.to_thread(spec.grids, images)
            prompt = spec.expand(prompt, grids)
            vision = _Vision(pixels["pixel_values"].to(self.device, self.dtype), pixels["image_grid_thw"].to(torch.long))
        check_prompt(prompt, sampling, vocab=self._vocab, max_prompt_tokens=self._max_positions)
        result = await self._call("generate", (request_id, prompt, n, sampling, time.time(), None, vision))
        assert isinstance(result, GenerateOutput)
        return result

    async def generate_constrained(self, input_ids: Sequence[int], n: int, sampling: SamplingParams, request_id: str,
                                   constraint: OutputConstraint) -> GenerateOutput:
        """`generate`, every sample held to `constraint` (compiled off the loop and off the compute thread)."""
        self._check()
        check_request(n, sampling, request_id, capacity=self.capacity, running=self._groups, input_ids=input_ids, text=None)
        prompt = self._tokenize(input_ids, None, False)
        check_prompt(prompt, sampling, vocab=self._vocab, max_prompt_tokens=self._max_positions)
        if sampling.ignore_eos:  # a finished grammar allows only a stop token: ignoring it would leave nothing to sample
            raise RequestRefusedError("ignore_eos cannot be combined with an output constraint")
        states = await asyncio.to_thread(self._grammar_states, constraint, sampling, n)
        result = await self._call("generate", (request_id, prompt, n, sampling, time.time(), states, None))
        assert isinstance(result, GenerateOutput)
        return result

    def _grammar_states(self, constraint: OutputConstraint, sampling: SamplingParams, n: int) -> list[Any]:
        from rollpool.workers.engines.grammar import GrammarBackend

        if self._grammar is None:
            self._grammar = GrammarBackend(self._tokenizer, self._vocab)
        compiled = self._grammar.compile(constraint)
        stop_ids = set(sampling.stop_token_ids) | set(self._eos_ids)
        return [self._grammar.state(compiled, sorted(stop_ids)) for _ in range(n)]

    async def abort(self, request_id: str) -> None:
        if self._dead is None:
            await self._call("abort", request_id)

    async def pause(self, mode: str) -> None:
        if mode not in APPLY_MODES:
            raise EngineError(f"apply mode must be one of {APPLY_MODES}, got {mode!r}")
        await self._call("pause", mode)

    async def resume(self) -> None:
        await self._call("resume", None)

    async def update_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        await self._call("update", (dict(named_tensors), version))

    async def update_adapter(self, named_tensors: Mapping[str, Any], spec: AdapterSpec, version: int) -> None:
        """Keep LoRA adapter `version` resident and run new sequences on it (module docstring); `WeightsRefusedError`
        (nothing changed) for an adapter of another base or one this engine cannot serve."""
        self._check()
        await self._call("adapter", (named_tensors, spec, version))

    def adapter_versions(self) -> list[int]:
        """The resident adapter versions (oldest first)."""
        return sorted(self._lora.versions) if self._lora is not None else []

    async def release_memory(self, tags: Sequence[str] = ()) -> None:
        await self._call("release", tuple(tags) or ("weights", "kv_cache"))

    async def resume_memory(self, tags: Sequence[str] = ()) -> None:
        await self._call("resume_memory", tuple(tags) or ("weights", "kv_cache"))

    async def flush_cache(self) -> None:
        await self._call("flush", None)

    async def stop(self) -> None:
        thread = self._thread
        if thread is None:
            return
        if thread.is_alive():
            self._cmds.put(("stop", None, lambda _r: None))
            await asyncio.to_thread(thread.join, 30.0)
        self._thread = None
        if self._dead is None:
            self._dead = "stopped"

    # -- asyncio side

    def _check(self) -> None:
        if self._dead is not None:
            raise EngineError(f"hf engine is not running: {self._dead}")
        if self._thread is None:
            raise EngineError("hf engine not started")

    async def _call(self, kind: str, payload: Any) -> Any:
        self._check()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()

        def done(result: Any) -> None:
            loop.call_soon_threadsafe(_resolve, fut, result)

        self._cmds.put((kind, payload, done))
        try:
            while not fut.done():
                # a command queued just as the thread died would never be answered
                await asyncio.wait({fut}, timeout=1.0)
                thread = self._thread
                if not fut.done() and (thread is None or not thread.is_alive()):
                    raise EngineError(f"hf engine is not running: {self._dead or 'thread gone'}")
        except asyncio.CancelledError:
            if kind == "generate" and self._dead is None:
                self._cmds.put(("abort", payload[0], lambda _r: None))
            raise
        return await _unwrap(fut)

    def _tokenize(self, input_ids: Sequence[int] | None, text: str | None, chat: bool) -> list[int]:
        if input_ids is not None:
            return [int(t) for t in input_ids]
        if text is None:
            raise RequestRefusedError("a prompt needs input_ids or text")
        tok = self._tokenizer
        if chat:
            if not getattr(tok, "chat_template", None):
                raise RequestRefusedError("apply_chat_template asked for, but the tokenizer has no chat template")
            rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
            return list(tok(rendered, add_special_tokens=False)["input_ids"])
        return list(tok(text)["input_ids"])

    # -- compute thread

    def _load(self) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        path = pathlib.Path(self.model_path)
        self._tokenizer = AutoTokenizer.from_pretrained(path)
        config = AutoConfig.from_pretrained(path)
        self._vision = load_vision_spec(path, config)
        if self._vision is not None:
            from transformers import AutoModelForImageTextToText

            model = AutoModelForImageTextToText.from_pretrained(path, dtype=self.dtype, attn_implementation=self.attn_implementation)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype, attn_implementation=self.attn_implementation)
        self._model = model.to(self.device).train(False)  # inference mode
        # transformers 5 names the cache argument `cache`; 4.x calls it `past_key_values`
        self._cache_kw = "cache" if "cache" in inspect.signature(self._model.forward).parameters else "past_key_values"
        cfg = self._model.config.get_text_config()
        eos = getattr(cfg, "eos_token_id", None)
        eos = eos if eos is not None else self._tokenizer.eos_token_id
        self._vocab = int(cfg.vocab_size)
        self._eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self._max_positions = int(getattr(cfg, "max_position_embeddings", 1 << 30) or (1 << 30))
        self._fingerprint = model_fingerprint(path)

    def _compute_loop(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    busy = self._can_work()
                    if not self._drain_commands(block=not busy):
                        break
                    if self._pause_mode is None and not self._released:
                        self._admit()
                    if self._pause_mode in (None, "drain") and not self._released and self._running:
                        self._decode_step()
                    self._settle_drain()
        except BaseException as exc:  # the engine is dead; everyone must hear of it
            log.exception("hf engine compute thread died")
            self._die(f"compute thread died: {exc!r}")
            return
        self._die("stopped")

    def _can_work(self) -> bool:
        if self._released:
            return False
        if self._pause_mode is None:
            return bool(self._running or self._waiting)
        return self._pause_mode == ApplyMode.DRAIN and bool(self._running)

    def _drain_commands(self, *, block: bool) -> bool:
        """Run queued commands; False on stop."""
        while True:
            try:
                kind, payload, done = self._cmds.get(timeout=None) if block else self._cmds.get_nowait()
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                done(None)
                return False
            try:
                result = self._command(kind, payload, done)
            except WeightsRefusedError as exc:  # checked before anything was written: still the old version, intact
                done(exc)
                continue
            except EngineError as exc:
                if kind == "update":
                    self._dead = str(exc)  # possibly half-applied: refuse further work until restarted
                done(exc)
                if kind == "update":
                    raise
                continue
            except (ValueError, TypeError) as exc:
                done(exc)
                continue
            if result is not _DEFERRED:
                done(result)

    def _command(self, kind: str, payload: Any, done: Callable[[Any], None]) -> Any:  # noqa: C901 - grandfathered: one branch per command of the engine's thread
        if kind == "generate":
            request_id, prompt, n, sampling, started_at, states, vision = payload
            if request_id in self._groups:  # checked before the call too; two calls may race here
                raise RequestRefusedError(f"request id {request_id!r} is already running")
            stop_ids = frozenset() if sampling.ignore_eos else frozenset(sampling.stop_token_ids) | self._eos_ids
            group = _Group(request_id, prompt, sampling, done, started_at, stop_ids, vision=vision)
            for i in range(n):
                gen: torch.Generator | None = None
                if sampling.temperature >= _GREEDY_EPS:
                    gen = torch.Generator(device=self.device)
                    if sampling.seed is not None:
                        try:
                            gen.manual_seed(int(sampling.seed) + i)
                        except (RuntimeError, ValueError, OverflowError) as exc:  # the request's seed, not the engine
                            raise RequestRefusedError(f"seed {sampling.seed!r} cannot seed sample {i}: {exc}") from exc
                    else:
                        self._request_counter += 1
                        gen.manual_seed(self.seed * 1_000_003 + self._request_counter)
                group.seqs.append(_Seq(group, i, gen, grammar=None if states is None else states[i]))
            self._groups[request_id] = group
            self._waiting.append(list(group.seqs))
            return _DEFERRED
        if kind == "abort":
            self._abort(payload)
            return None
        if kind == "pause":
            self._pause(payload)
            if payload == "drain" and self._running:
                self._drain_waiters.append(done)
                return _DEFERRED
            return None
        if kind == "resume":
            self._pause_mode = None
            return None
        if kind == "update":
            named, version = payload
            self._update(named, version)
            return None
        if kind == "adapter":
            self._update_adapter(*payload)
            return None
        if kind == "flush":
            return None  # no prefix cache is kept beyond running sequences
        if kind == "release":
            self._release(payload)
            return None
        if kind == "resume_memory":
            self._resume_memory(payload)
            return None
        raise ValueError(f"unknown engine command {kind!r}")

    def _pause(self, mode: str) -> None:
        self._pause_mode = mode
        if mode == ApplyMode.INTERRUPT and self._running:
            # resubmit every running sequence as prompt + partial output, ahead of new work
            for seq in reversed(self._running):
                seq.kv_len = 0
                seq.adapter = None  # re-prefilled on the newest adapter version
                self._waiting.appendleft([seq])
            self._running = []
            self._kv = []
            self._mask = None

    def _settle_drain(self) -> None:
        if self._drain_waiters and not self._running:
            waiters, self._drain_waiters = self._drain_waiters, []
            for done in waiters:
                done(None)

    def _update(self, named: Mapping[str, Any], version: int) -> None:
        params = dict(self._model.state_dict(keep_vars=True))
        plan: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, value in named.items():
            target = params.get(name)
            if target is None:
                raise WeightsRefusedError(f"update_weights: unknown parameter {name!r}")
            tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
            if tuple(tensor.shape) != tuple(target.shape):
                raise WeightsRefusedError(f"update_weights: {name} has shape {tuple(tensor.shape)}, the model has {tuple(target.shape)}")
            plan.append((target, tensor))
        try:
            for target, tensor in plan:
                target.data.copy_(tensor.to(device=target.device, dtype=target.dtype))
        except Exception as exc:
            raise EngineError(f"update_weights failed part-way: {exc!r}") from exc
        self.version = self._base_version = version
        latest = self._lora.latest if self._lora is not None else None
        if self._lora is not None and latest is not None:
            # the newest adapter stays on, on top of the new base (as SGLang keeps it); every sequence that began moves
            # to it, its next tokens tagged with this version, whose policy is the new base plus that adapter
            for seq in [*self._running, *(s for unit in self._waiting for s in unit)]:
                if seq.adapter is not None or seq.kv_len:
                    seq.adapter, seq.tag = latest, version
            self._lora.retain({latest})

    def _update_adapter(self, named: Mapping[str, Any], spec: AdapterSpec, version: int) -> None:
        if spec.base_fingerprint and self._fingerprint and spec.base_fingerprint != self._fingerprint:
            raise WeightsRefusedError(
                f"adapter version {version} applies to base {spec.base_model or '?'} (fingerprint {spec.base_fingerprint}); "
                f"this engine serves {self.model_path} (fingerprint {self._fingerprint})")
        if version <= self.version and self._lora is not None and self._lora.versions:
            raise WeightsRefusedError(f"adapter version {version} is not newer than the version served, {self.version}")
        if self._lora is None:
            self._lora = LoraBank(self._model, resident=self.options.lora_resident, max_rank=self.options.max_lora_rank)
        self._lora.add(version, named, spec, dtype=self.dtype, device=self.device)
        self.version = version
        self._lora.evict(s.adapter for s in [*self._running, *(s for unit in self._waiting for s in unit)])

    def _release(self, tags: tuple[str, ...]) -> None:
        if "weights" in tags and self.device != "cpu":
            self._model.to("cpu")
            torch.cuda.empty_cache()
        self._released |= set(tags)

    def _resume_memory(self, tags: tuple[str, ...]) -> None:
        if "weights" in tags and self.device != "cpu":
            self._model.to(self.device)
        self._released -= set(tags)

    def _abort(self, request_id: str) -> None:
        group = self._groups.get(request_id)
        if group is None:
            return
        now = time.time()
        for seq in group.seqs:
            if seq.finish is None:
                seq.finish, seq.finished_at = FinishReason.ABORT, now
        self._waiting = collections.deque(unit for unit in self._waiting if unit[0].group is not group)
        self._drop_finished()
        self._complete(group)

    def _refuse(self, group: _Group, reason: str) -> None:
        """Fail one request alone (its sequences leave the batch at the end of this step); the rest decode on."""
        now = time.time()
        for seq in group.seqs:
            if seq.finish is None:
                seq.finish, seq.finished_at = FinishReason.ERROR, now
        self._waiting = collections.deque(unit for unit in self._waiting if unit[0].group is not group)
        if self._groups.pop(group.request_id, None) is not None:
            log.warning("hf engine refused request %s: %s", group.request_id, reason)
            group.done(RequestRefusedError(reason))

    def _admit(self) -> None:
        while self._waiting and len(self._running) + len(self._waiting[0]) <= self.capacity:
            unit = self._waiting.popleft()
            self._prefill(unit)

    def _prefill(self, unit: list[_Seq]) -> None:
        from transformers import DynamicCache

        ctx = unit[0].context()
        group = unit[0].group
        prompt_logprobs = group.sampling.logprob_start_len >= 0 and group.input_logprobs is None and not unit[0].out
        ids = torch.tensor([ctx], dtype=torch.long, device=self.device)
        if self._lora is not None:
            for seq in unit:
                if seq.adapter is None:
                    seq.adapter, seq.tag = self._lora.latest, self.version
            self._lora.select([unit[0].adapter])
        extra: dict[str, Any] = {}
        vision = group.vision
        if vision is not None:
            # the vision tower runs again on a re-prefill (interrupt mode): its output depends on the new weights too
            assert self._vision is not None
            mm_types = (ids == self._vision.image_id).to(torch.int)
            pos, delta = self._model.model.get_rope_index(ids, mm_token_type_ids=mm_types, image_grid_thw=vision.grid_thw)
            vision.rope_delta = int(delta.reshape(-1)[0])
            extra = {"pixel_values": vision.pixel_values, "image_grid_thw": vision.grid_thw, "position_ids": pos}
        out = self._model(input_ids=ids, use_cache=True, logits_to_keep=0 if prompt_logprobs else 1, **{self._cache_kw: DynamicCache()}, **extra)
        self._count("prefill", 1, len(ctx))
        logits = out.logits[0, -1].float()
        if prompt_logprobs:
            group.input_logprobs = prompt_token_logprobs(out.logits[0].float(), ctx, group.sampling)
        layers = [(layer.keys, layer.values) for layer in getattr(out, self._cache_kw).layers]
        joined: list[_Seq] = []
        for seq in unit:
            seq.kv_len = len(ctx)
            if seq.finish is None and self._emit(seq, logits):
                joined.append(seq)
        if joined:
            self._join(joined, layers, len(ctx))
        if any(s.finish is not None for s in self._running):  # a refused group's sequences that were running
            self._drop_finished()
        self._complete_finished_groups(unit)

    def _join(self, seqs: list[_Seq], layers: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        m = len(seqs)
        new_kv = [(k.expand(m, -1, -1, -1), v.expand(m, -1, -1, -1)) for k, v in layers]
        new_mask = torch.ones((m, length), dtype=torch.long, device=self.device)
        if not self._running:
            self._kv = [(k.contiguous(), v.contiguous()) for k, v in new_kv]
            self._mask = new_mask
        else:
            assert self._mask is not None
            width = max(self._mask.shape[1], length)
            self._kv = [
                (torch.cat([_left_pad(k0, width), _left_pad(k1, width)]), torch.cat([_left_pad(v0, width), _left_pad(v1, width)]))
                for (k0, v0), (k1, v1) in zip(self._kv, new_kv, strict=True)
            ]
            self._mask = torch.cat([_left_pad(self._mask, width), _left_pad(new_mask, width)])
        self._running.extend(seqs)

    def _decode_step(self) -> None:
        from transformers import DynamicCache

        assert self._mask is not None
        rows = len(self._running)
        ids = torch.tensor([[s.out[-1]] for s in self._running], dtype=torch.long, device=self.device)
        # a vision-language prompt's text positions run `rope_delta` behind (or ahead of) its token count
        pos = torch.tensor([[s.kv_len + (s.group.vision.rope_delta if s.group.vision else 0)] for s in self._running],
                           dtype=torch.long, device=self.device)
        mask = torch.cat([self._mask, torch.ones((rows, 1), dtype=torch.long, device=self.device)], dim=1)
        if self._lora is not None:
            self._lora.select([s.adapter for s in self._running])
        out = self._model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            **{self._cache_kw: DynamicCache(ddp_cache_data=self._kv)},
        )
        self._count("decode", rows, 1)
        self.stats["decode_steps"] += 1
        self._kv = [(layer.keys, layer.values) for layer in getattr(out, self._cache_kw).layers]
        self._mask = mask
        logits = out.logits[:, -1].float()
        for row, seq in enumerate(self._running):
            seq.kv_len += 1
            if seq.finish is None:  # set here only by a refusal of its group earlier in this step
                self._emit(seq, logits[row])
        finished = [s for s in self._running if s.finish is not None]
        if finished:
            self._drop_finished()
            self._complete_finished_groups(finished)

    def _emit(self, seq: _Seq, logits: torch.Tensor) -> bool:
        """Sample the next token of `seq`; True while it goes on."""
        sampling = seq.group.sampling
        try:
            if seq.grammar is None:
                tok, logprob = sample_token(logits, sampling, seq.generator)
            else:  # sampled under the grammar's mask; the logprob reported is the model's, before the mask
                tok, _ = sample_token(seq.grammar.mask(logits), sampling, seq.generator)
                temperature = 1.0 if sampling.temperature < _GREEDY_EPS else sampling.temperature
                logprob = float(torch.log_softmax(logits / temperature, dim=-1)[tok])
        except Exception as exc:
            if type(exc).__name__ == "AcceleratorError" or "CUDA" in str(exc):
                raise EngineError(f"the device failed while sampling: {exc!r}") from exc  # the engine's fault
            if not bool(torch.isfinite(logits).all()):
                raise EngineError(f"the model produced non-finite logits: {exc!r}") from exc  # the engine's fault
            self._refuse(seq.group, f"sampling failed with this request's parameters: {exc!r}")
            return False
        if seq.grammar is not None:
            seq.grammar.accept(tok)
        now = time.time()
        seq.out.append(tok)
        seq.logprobs.append(logprob)
        if sampling.top_logprobs_num > 0:
            ids, lps = top_logprobs(logits, sampling, sampling.top_logprobs_num)
            seq.top_ids.append(ids)
            seq.top_logprobs.append(lps)
        # a sequence on no adapter runs on the base weights, whatever adapter versions arrived since it began
        seq.versions.append(self._base_version if seq.adapter is None else seq.tag)
        if not seq.first_token_at:
            seq.first_token_at = now
        if tok in seq.group.stop_ids:
            seq.finish, seq.matched = FinishReason.STOP, tok
        elif sampling.stop and (hit := self._stop_string(seq)) is not None:
            seq.finish, seq.matched = FinishReason.STOP, hit
        elif len(seq.out) >= sampling.max_new_tokens or seq.kv_len + 1 >= self._max_positions:
            seq.finish = FinishReason.LENGTH
        if seq.finish is not None:
            seq.finished_at = now
            return False
        return True

    def _stop_string(self, seq: _Seq) -> str | None:
        longest = max(len(s) for s in seq.group.sampling.stop)
        tail = self._tokenizer.decode(seq.out[-(longest + 8) :], skip_special_tokens=True)
        for s in seq.group.sampling.stop:
            if s and s in tail:
                return s
        return None

    def _drop_finished(self) -> None:
        keep = [i for i, s in enumerate(self._running) if s.finish is None]
        if len(keep) == len(self._running):
            return
        if not keep:
            self._running, self._kv, self._mask = [], [], None
            return
        assert self._mask is not None
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        mask = self._mask.index_select(0, index)
        used = torch.nonzero(mask.any(dim=0))
        start = int(used[0]) if used.numel() else 0
        self._mask = mask[:, start:]
        self._kv = [(k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:]) for k, v in self._kv]
        self._running = [self._running[i] for i in keep]

    def _complete_finished_groups(self, seqs: list[_Seq]) -> None:
        for group in {id(s.group): s.group for s in seqs}.values():
            if all(s.finish is not None for s in group.seqs):
                self._complete(group)

    def _complete(self, group: _Group) -> None:
        if self._groups.pop(group.request_id, None) is None:
            return
        samples = [
            SampleOutput(
                index=s.index,
                output_ids=list(s.out),
                logprobs=list(s.logprobs),
                token_versions=list(s.versions),
                finish_reason=s.finish or FinishReason.ABORT,
                output_text=self._output_text(s),
                matched_stop=s.matched,
                first_token_at=s.first_token_at,
                finished_at=s.finished_at,
                top_ids=[list(r) for r in s.top_ids] if group.sampling.top_logprobs_num > 0 else None,
                top_logprobs=[list(r) for r in s.top_logprobs] if group.sampling.top_logprobs_num > 0 else None,
            )
            for s in group.seqs
        ]
        grid = None if group.vision is None else [int(x) for x in group.vision.grid_thw.reshape(-1).tolist()]
        group.done(GenerateOutput(group.request_id, list(group.input_ids), samples, group.started_at, simulated=False,
                                  input_logprobs=group.input_logprobs, image_grid_thw=grid))

    def _output_text(self, seq: _Seq) -> str:
        ids = seq.out[:-1] if seq.finish == FinishReason.STOP and isinstance(seq.matched, int) else seq.out
        text: str = self._tokenizer.decode(ids, skip_special_tokens=True)
        if isinstance(seq.matched, str):
            cut = text.find(seq.matched)
            if cut >= 0:
                text = text[:cut]
        return text

    def _count(self, kind: str, rows: int, tokens_per_row: int) -> None:
        self.stats["forward_calls"] += 1
        self.stats[f"{kind}_tokens"] += rows * tokens_per_row
        self.forward_log.append((kind, rows, tokens_per_row))

    def _die(self, reason: str) -> None:
        if self._dead is None or self._dead == "stopped":
            self._dead = reason
        err = EngineError(f"hf engine: {reason}")
        for group in list(self._groups.values()):
            group.done(err)
        self._groups.clear()
        for done in self._drain_waiters:
            done(err)
        self._drain_waiters = []
        while True:
            try:
                _kind, _payload, done = self._cmds.get_nowait()
            except queue.Empty:
                break
            done(err)


_DEFERRED = object()


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Pad dim 1 (mask [B, T]) or dim 2 (KV [B, H, T, D]) on the left with zeros to `width`."""
    dim = 1 if t.dim() == 2 else 2
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([torch.zeros(shape, dtype=t.dtype, device=t.device), t], dim=dim)


def _resolve(fut: asyncio.Future[Any], result: Any) -> None:
    if not fut.done():
        fut.set_result(result)


async def _unwrap(fut: Any) -> Any:
    result = await fut
    if isinstance(result, BaseException):
        raise result
    return result


def ENGINE_FACTORY(**options: Any) -> HFEngine:  # the registry's well-known name
    return HFEngine(options_from(HFOptions, options))
