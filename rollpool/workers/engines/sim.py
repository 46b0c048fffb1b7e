"""The `sim` engine: no model, seeded tokens and a latency model on asyncio timers.

For scale tests and benchmarks: one process hosts hundreds of sim workers on
two cores, because a request costs one coroutine that sleeps until its next
event (a sample finishing, a pause, an abort), never a thread or a timer per
token. Behaviour matches a real engine where the worker can see it: the same
pause modes (interrupt adds a re-prefill delay, drain finishes running
requests first), abort with partial output, per-token versions (tokens
produced after an update carry the new version), output ids that end with
the stop token when a sample stops. Weight versions may be zero-byte (no
tensors): an update only changes the version. Everything it produces is
marked simulated (`EngineInfo.simulated`, `GenerateOutput.simulated`).

Tokens: seeded uniform draws over ``[0, vocab)``, never a stop id inside a sample; with `SimOptions.special_ids`
(what the sglang engine's sim child reads from a model's tokenizer on request), never one of those either, and a
stopped sample ends with the request's end-of-turn rather than the end-of-sequence: what a chat model does, so
the episode endpoint sees turns shaped like a real model's (a special token mid-turn makes the reply's text differ
from its tokens, which the endpoint then renders again).

Latency model: ``prefill_s_per_token * prompt_len`` before the first token,
then ``decode_s_per_token`` per token (all samples of a request decode in
parallel), each scaled by ``1 + jitter * N(0, 1)`` (clipped at 0.1) per
request. Output lengths: ``fixed`` (``length_median``), ``uniform`` on
``[length_min, 2 * length_median]`` or ``lognormal`` (median
``length_median``, ``length_sigma``, long tail), capped at ``max_new_tokens``
(a capped sample finishes with ``length``, others with ``stop``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import random
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rollpool.protocol.errors import EngineError
from rollpool.protocol.messages import ApplyMode, FinishReason, SamplingParams
from rollpool.workers.engines.base import (
    APPLY_MODES,
    EngineInfo,
    GenerateOutput,
    SampleOutput,
    check_prompt,
    check_request,
)
from rollpool.workers.engines.options import SIM_LENGTHS, SimOptions, options_from

__all__ = ["SimEngine", "SimOptions", "ENGINE_FACTORY"]

log = logging.getLogger(__name__)



class _SimSample:
    __slots__ = ("index", "length", "finish", "ids", "logprobs", "versions", "first_token_at", "finished_at", "rng")

    def __init__(self, index: int, length: int, finish: str, rng: random.Random) -> None:
        self.index = index
        self.length = length
        self.finish = finish
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.first_token_at = 0.0
        self.finished_at = 0.0
        self.rng = rng

    @property
    def done(self) -> bool:
        return self.finished_at > 0.0


class _SimRequest:
    """Progress of one request, advanced in virtual decode steps."""

    def __init__(self, request_id: str, samples: list[_SimSample], decode_s: float, eos_id: int, stop_ids: tuple[int, ...], vocab: int,
                 avoid: frozenset[int] = frozenset()) -> None:
        self.request_id = request_id
        self.samples = samples
        self.decode_s = decode_s
        self.eos_id = eos_id
        self.stop_ids = stop_ids
        self.vocab = vocab
        self.avoid = avoid
        """Ids never drawn inside a sample, besides the stop ids (`SimOptions.special_ids`)."""
        self.steps = 0.0
        self.mark = 0.0
        """Monotonic time from which decode progress counts (0: not started)."""
        self.aborted = False

    def advance(self, now: float, version: int) -> None:
        """Emit the tokens decoded since `mark`, tagged with `version`."""
        if self.mark <= 0.0 or now <= self.mark:
            return
        self.steps += (now - self.mark) / self.decode_s
        self.mark = now
        wall = time.time()
        for s in self.samples:
            if s.done:
                continue
            target = min(s.length, int(self.steps + 1e-9))
            while len(s.ids) < target:
                last = len(s.ids) == s.length - 1
                if last and s.finish == FinishReason.STOP:
                    tok = self.eos_id
                else:
                    tok = s.rng.randrange(self.vocab)
                    while tok in self.stop_ids or tok == self.eos_id or tok in self.avoid:
                        tok = s.rng.randrange(self.vocab)
                s.ids.append(tok)
                s.logprobs.append(-s.rng.expovariate(1.0))
                s.versions.append(version)
                if s.first_token_at == 0.0:
                    s.first_token_at = wall
            if len(s.ids) >= s.length:
                s.finished_at = wall

    def seconds_to_next_finish(self) -> float:
        left = [s.length - self.steps for s in self.samples if not s.done]
        return max(0.0, min(left) * self.decode_s) if left else 0.0

    def abort_rest(self) -> None:
        wall = time.time()
        for s in self.samples:
            if not s.done:
                s.finish = FinishReason.ABORT
                s.finished_at = wall

    def all_done(self) -> bool:
        return all(s.done for s in self.samples)


class SimEngine:
    """A simulated engine (see the module docstring). Options are keyword-only."""

    def __init__(self, options: SimOptions | None = None, /, **kwargs: Any) -> None:
        """`SimOptions` (or its fields as keywords: ``SimEngine(decode_s_per_token=0.01, ...)``)."""
        opts = options if options is not None else options_from(SimOptions, kwargs)
        assert opts.length in SIM_LENGTHS
        self.options = opts
        self.model = opts.model or "sim"
        self.capacity = opts.capacity
        self.vocab = opts.vocab
        self.eos_id = opts.eos_id
        self.prefill_s_per_token = opts.prefill_s_per_token
        self.decode_s_per_token = opts.decode_s_per_token
        self.jitter = opts.jitter
        self.length = opts.length
        self.length_median = max(1, opts.length_median)
        self.length_sigma = opts.length_sigma
        self.length_min = max(1, opts.length_min)
        self.seed = opts.seed
        self.apply_s = opts.apply_s
        self.version = opts.initial_version
        self.special_ids = frozenset(opts.special_ids)
        if len(self.special_ids) >= self.vocab - 2:
            raise EngineError(f"sim engine: special_ids leave no id to sample in a vocabulary of {self.vocab}")
        self._requests: dict[str, _SimRequest] = {}
        self._waiters: set[asyncio.Future[None]] = set()
        self._pause_mode: str | None = None
        self._released: set[str] = set()
        self._started = False
        self._dead: str | None = None
        self._fail_next_apply = False
        self.applied_bytes = 0

    # -- fault injection (tests and chaos)

    def inject_crash(self, reason: str = "injected crash") -> None:
        """Make the engine die now: every pending and later call raises `EngineError`."""
        self._dead = reason
        self._wake()

    def inject_apply_failure(self) -> None:
        """Make the next `update_weights` fail part-way."""
        self._fail_next_apply = True

    # -- Engine protocol

    async def start(self) -> None:
        self._check()
        self._started = True

    def info(self) -> EngineInfo:
        fp = hashlib.sha256(f"sim:{self.model}:{self.vocab}:{self.eos_id}".encode()).hexdigest()[:16]
        return EngineInfo(
            name="sim",
            model=self.model,
            capacity=self.capacity,
            apply_modes=APPLY_MODES,
            weight_version=self.version,
            fingerprint=fp,
            simulated=True,
            device="none",
            extra={"decode_s_per_token": self.decode_s_per_token, "length": self.length},
        )

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
        self._check()
        check_request(n, sampling, request_id, capacity=self.capacity, running=self._requests, input_ids=input_ids, text=text)
        if input_ids is None:
            assert text is not None
            input_ids = [b % self.vocab for b in text.encode()]
        prompt = [int(t) for t in input_ids]
        check_prompt(prompt, sampling, vocab=self.vocab)
        started_at = time.time()
        while self._pause_mode is not None or self._released:  # intake stopped
            await self._sleep(None)
            self._check()
        req = self._new_request(request_id, prompt, n, sampling)
        self._requests[request_id] = req
        try:
            loop = asyncio.get_running_loop()
            await self._sleep(self.prefill_s_per_token * len(prompt) * self._scale(req))
            self._check()
            req.mark = loop.time()
            while not req.all_done():
                self._check()
                if req.aborted:
                    req.advance(loop.time(), self.version)
                    req.abort_rest()
                    break
                if self._pause_mode in ("interrupt", "in_place"):
                    interrupted = self._pause_mode == ApplyMode.INTERRUPT
                    req.advance(loop.time(), self.version)
                    req.mark = 0.0
                    while self._pause_mode in ("interrupt", "in_place") and not req.aborted:
                        await self._sleep(None)
                        self._check()
                    delay = 0.0
                    if interrupted:  # resubmitted as prompt + partial output
                        done = max((len(s.ids) for s in req.samples), default=0)
                        delay = self.prefill_s_per_token * (len(prompt) + done)
                    req.mark = loop.time() + delay
                    continue
                req.advance(loop.time(), self.version)
                if req.all_done():
                    break
                await self._sleep(req.seconds_to_next_finish())
            return GenerateOutput(
                request_id=request_id,
                input_ids=prompt,
                samples=[
                    SampleOutput(
                        index=s.index,
                        output_ids=s.ids,
                        logprobs=s.logprobs,
                        token_versions=s.versions,
                        finish_reason=s.finish,
                        output_text=None,
                        matched_stop=(s.ids[-1] if s.finish == FinishReason.STOP and s.ids else None),
                        first_token_at=s.first_token_at,
                        finished_at=s.finished_at,
                    )
                    for s in req.samples
                ],
                started_at=started_at,
                simulated=True,
            )
        finally:
            self._requests.pop(request_id, None)
            if self._pause_mode == ApplyMode.DRAIN:
                self._wake()  # pause("drain") waits for the last request

    def running_request_ids(self) -> list[str]:
        """Ids of the requests now generating (the sglang engine's CPU backend aborts them all at once)."""
        return list(self._requests)

    async def abort(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None:
            req.aborted = True
            self._wake()

    async def pause(self, mode: str) -> None:
        self._check()
        if mode not in APPLY_MODES:
            raise EngineError(f"apply mode must be one of {APPLY_MODES}, got {mode!r}")
        loop = asyncio.get_running_loop()
        if mode in ("interrupt", "in_place"):
            now = loop.time()
            for req in self._requests.values():  # tokens so far carry the old version
                req.advance(now, self.version)
        self._pause_mode = mode
        self._wake()
        if mode == ApplyMode.DRAIN:
            while self._requests:
                await self._sleep(None)
                self._check()

    async def resume(self) -> None:
        self._check()
        self._pause_mode = None
        self._wake()

    async def update_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        self._check()
        nbytes = 0
        for tensor in named_tensors.values():
            nbytes += int(getattr(tensor, "nbytes", 0) or 0)
        if self.apply_s > 0:
            await asyncio.sleep(self.apply_s)
        if self._fail_next_apply:
            self._fail_next_apply = False
            self._dead = f"apply of version {version} failed part-way (injected)"
            self._wake()
            raise EngineError(self._dead)
        self.applied_bytes += nbytes
        self.version = version

    async def release_memory(self, tags: Sequence[str] = ()) -> None:
        self._check()
        self._released |= set(tags or ("weights", "kv_cache"))

    async def resume_memory(self, tags: Sequence[str] = ()) -> None:
        self._check()
        self._released -= set(tags or ("weights", "kv_cache"))
        self._wake()

    async def flush_cache(self) -> None:
        self._check()

    async def stop(self) -> None:
        for req in self._requests.values():
            req.aborted = True
        self._pause_mode = None
        self._released.clear()
        self._wake()
        self._started = False

    # -- internals

    def _check(self) -> None:
        if self._dead is not None:
            raise EngineError(f"sim engine is dead: {self._dead}")

    def _scale(self, req: _SimRequest) -> float:
        return req.decode_s / self.decode_s_per_token

    def _new_request(self, request_id: str, prompt: list[int], n: int, sampling: SamplingParams) -> _SimRequest:
        base = sampling.seed if sampling.seed is not None else int.from_bytes(hashlib.sha256(f"{self.seed}:{request_id}".encode()).digest()[:8], "little")
        rng = random.Random(base)
        scale = max(0.1, 1.0 + self.jitter * rng.gauss(0.0, 1.0)) if self.jitter > 0 else 1.0
        stop_ids = tuple(sampling.stop_token_ids)
        eos = stop_ids[0] if stop_ids else self.eos_id
        if self.special_ids:  # a chat model ends its turn with the template's end-of-turn, not the end-of-sequence
            eos = next((t for t in stop_ids if t != self.eos_id), eos)
        samples = []
        for i in range(n):
            srng = random.Random(base * 1_000_003 + i)
            length = self._draw_length(srng)
            if length >= sampling.max_new_tokens or sampling.ignore_eos and not stop_ids:
                length, finish = sampling.max_new_tokens, FinishReason.LENGTH
            else:
                finish = FinishReason.STOP
            samples.append(_SimSample(i, length, finish, srng))
        return _SimRequest(request_id, samples, self.decode_s_per_token * scale, eos, stop_ids, self.vocab, self.special_ids)

    def _draw_length(self, rng: random.Random) -> int:
        if self.length == "fixed":
            return self.length_median
        if self.length == "uniform":
            return rng.randint(self.length_min, max(self.length_min, 2 * self.length_median))
        return max(self.length_min, int(round(math.exp(math.log(self.length_median) + self.length_sigma * rng.gauss(0.0, 1.0)))))

    async def _sleep(self, seconds: float | None) -> None:
        """Sleep `seconds` (None: until woken); any state change (`_wake`) ends it early."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        handle = loop.call_later(seconds, _set_done, fut) if seconds is not None else None
        self._waiters.add(fut)
        try:
            await fut
        finally:
            self._waiters.discard(fut)
            if handle is not None:
                handle.cancel()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, set()
        for fut in waiters:
            _set_done(fut)


def _set_done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def ENGINE_FACTORY(**options: Any) -> SimEngine:  # the registry's well-known name
    return SimEngine(options_from(SimOptions, options))
