"""The one definition of valid sampling parameters, shared by every edge that takes them.

`sampling_problem(sampling, n)` returns the first problem with a group's sampling settings (the
`SamplingParams` field it concerns and a message naming the allowed range), or None. The episode
endpoint answers a problem with a 400 naming the OpenAI parameter, the trainer client rejects the
prompt before sending it, and every engine refuses the request (`RequestRefusedError`) before it
tokenizes or queues it. Because the engines check too, a task from a peer that skipped the client's
check (an older client, a hand-written one) is still refused alone, never run into an engine.

The ranges are what every engine can serve without failing in its shared compute: every float
finite (a NaN temperature passes ``0 <= t`` and makes sampling probabilities NaN, which stops a
batched engine's compute thread), every integer within the signed 64-bit range the engines hand to
torch and SGLang (a seed of 2**64 overflows a generator's seed), counts within int32 where an engine
puts them in an int32 tensor. Sample i of a group uses ``seed + i``, so the seed leaves room for the
group. Pure: no I/O, standard library only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rollpool.protocol.messages import SamplingParams

__all__ = ["MAX_INT32", "MAX_SEED", "MIN_SEED", "SamplingProblem", "sampling_problem"]

MAX_INT32 = 2**31 - 1
MIN_SEED = -(2**63)
MAX_SEED = 2**63 - 1


@dataclass(frozen=True, slots=True)
class SamplingProblem:
    """What is wrong with a group's sampling settings."""

    field: str
    """The `SamplingParams` field (or ``n``, the group size)."""
    message: str

    def __str__(self) -> str:
        return self.message


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def sampling_problem(sampling: SamplingParams, n: int = 1) -> SamplingProblem | None:
    """The first problem with `sampling` for a group of `n` samples, or None when an engine can serve it."""
    if not _int(n) or n < 1:
        return SamplingProblem("n", f"n must be >= 1, got {n!r}")
    s = sampling
    if not _int(s.max_new_tokens) or not 1 <= s.max_new_tokens <= MAX_INT32:
        return SamplingProblem("max_new_tokens", f"max_new_tokens must be an integer in [1, {MAX_INT32}], got {s.max_new_tokens!r}")
    if not _finite(s.temperature) or s.temperature < 0:
        return SamplingProblem("temperature", f"temperature must be a finite number >= 0, got {s.temperature!r}")
    if not _finite(s.top_p) or not 0 < s.top_p <= 1:
        return SamplingProblem("top_p", f"top_p must be in (0, 1], got {s.top_p!r}")
    if not _int(s.top_k) or not (s.top_k == -1 or 1 <= s.top_k <= MAX_INT32):
        return SamplingProblem("top_k", f"top_k must be -1 or an integer in [1, {MAX_INT32}], got {s.top_k!r}")
    if not _finite(s.min_p) or not 0 <= s.min_p <= 1:
        return SamplingProblem("min_p", f"min_p must be in [0, 1], got {s.min_p!r}")
    if s.seed is not None and (not _int(s.seed) or not MIN_SEED <= s.seed <= MAX_SEED - (n - 1)):
        return SamplingProblem("seed", f"seed must be an integer in [{MIN_SEED}, {MAX_SEED - (n - 1)}] for a group of {n} "
                                       f"(sample i uses seed + i), got {s.seed!r}")
    if any(not _int(t) or not 0 <= t <= MAX_INT32 for t in s.stop_token_ids):
        return SamplingProblem("stop_token_ids", f"stop_token_ids must be integers in [0, {MAX_INT32}]")
    if any(not isinstance(t, str) for t in s.stop):
        return SamplingProblem("stop", "stop must be strings")
    if not _int(s.top_logprobs_num) or not 0 <= s.top_logprobs_num <= MAX_INT32:
        return SamplingProblem("top_logprobs_num", f"top_logprobs_num must be an integer in [0, {MAX_INT32}], got {s.top_logprobs_num!r}")
    if not _int(s.logprob_start_len) or not -1 <= s.logprob_start_len <= MAX_INT32:
        return SamplingProblem("logprob_start_len", f"logprob_start_len must be -1 or an integer in [0, {MAX_INT32}], got {s.logprob_start_len!r}")
    return None
