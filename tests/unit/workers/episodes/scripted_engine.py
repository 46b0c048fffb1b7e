"""`ScriptedEngine`: a FAKE engine at the process edge, for episode tests (not an inference engine).

It answers each `generate` with the next turn of a script (text or token ids), cut by the request's
``max_new_tokens`` and ``stop_token_ids`` as a real engine would, with made-up logprobs and the
current weight version. Text is encoded one character at a time, so the sampled ids are NOT the
tokenizer's canonical encoding of their text: a recorder that re-tokenized text would be caught.
Every prompt it was given is kept in `prompts`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rollpool.protocol.messages import FinishReason, SamplingParams
from rollpool.workers.engines.base import EngineInfo, GenerateOutput, SampleOutput


class ScriptedEngine:
    def __init__(self, script: Sequence[str | Sequence[int]] = (), *, tokenizer: Any = None, version: int = 0,
                 eos_id: int | None = None, delay_s: float = 0.0, model: str = "scripted") -> None:
        self.script = list(script)
        self.tokenizer = tokenizer
        self.version = version
        self.eos_id = eos_id if eos_id is not None else getattr(tokenizer, "eos_token_id", None)
        self.delay_s = delay_s
        self.model = model
        self.prompts: list[list[int]] = []
        self.aborted: list[str] = []
        self.max_concurrent = 0
        self.running = 0
        self._entered = asyncio.Event()

    async def wait_running(self, count: int) -> None:
        """Return once `count` generate calls are in progress."""
        while self.running < count:
            self._entered.clear()
            await self._entered.wait()

    def _ids(self, turn: str | Sequence[int]) -> list[int]:
        if not isinstance(turn, str):
            return [int(t) for t in turn]
        assert self.tokenizer is not None, "a text script needs a tokenizer"
        out: list[int] = []
        for special in _split_specials(turn, self.tokenizer):
            if special[1]:
                out += self.tokenizer.encode(special[0], add_special_tokens=False)
            else:
                for ch in special[0]:
                    out += self.tokenizer.encode(ch, add_special_tokens=False)
        return out

    async def start(self) -> None:
        pass

    async def generate(self, input_ids: Sequence[int] | None, n: int, sampling: SamplingParams, request_id: str, *,
                       text: str | None = None, apply_chat_template: bool = False) -> GenerateOutput:
        assert input_ids is not None and n == 1
        self.prompts.append(list(input_ids))
        self.running += 1
        self._entered.set()
        self.max_concurrent = max(self.max_concurrent, self.running)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            turn = self.script.pop(0) if self.script else "ok"
            if isinstance(turn, BaseException):  # the script makes this turn fail as the engine would
                raise turn
            ids = self._ids(turn)
            stops = set(sampling.stop_token_ids) | ({self.eos_id} if self.eos_id is not None and not sampling.ignore_eos else set())
            finish = FinishReason.LENGTH
            out: list[int] = []
            for t in ids:
                if len(out) >= sampling.max_new_tokens:
                    break
                out.append(t)
                if t in stops:
                    finish = FinishReason.STOP
                    break
            else:
                if len(out) < sampling.max_new_tokens:
                    finish = FinishReason.STOP  # the script's turn ended without a stop token
            now = time.time()
            sample = SampleOutput(index=0, output_ids=out, logprobs=[-0.5] * len(out), token_versions=[self.version] * len(out),
                                  finish_reason=finish, output_text=None,
                                  matched_stop=out[-1] if finish == FinishReason.STOP and out and out[-1] in stops else None,
                                  first_token_at=now, finished_at=now)
            return GenerateOutput(request_id, list(input_ids), [sample], started_at=now)
        finally:
            self.running -= 1

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def pause(self, mode: str) -> None:
        pass

    async def resume(self) -> None:
        pass

    async def update_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        self.version = version

    async def release_memory(self, tags: Sequence[str] = ()) -> None:
        pass

    async def resume_memory(self, tags: Sequence[str] = ()) -> None:
        pass

    async def flush_cache(self) -> None:
        pass

    def info(self) -> EngineInfo:
        return EngineInfo(name="scripted", model=self.model, capacity=64, apply_modes=("interrupt",),
                          weight_version=self.version, fingerprint="scripted", simulated=True)

    async def stop(self) -> None:
        pass


def _split_specials(text: str, tokenizer: Any) -> list[tuple[str, bool]]:
    specials = sorted((s for s in getattr(tokenizer, "all_special_tokens", []) if s), key=len, reverse=True)
    out: list[tuple[str, bool]] = []
    i = 0
    buf = ""
    while i < len(text):
        hit = next((s for s in specials if text.startswith(s, i)), None)
        if hit is None:
            buf += text[i]
            i += 1
            continue
        if buf:
            out.append((buf, False))
            buf = ""
        out.append((hit, True))
        i += len(hit)
    if buf:
        out.append((buf, False))
    return out
