"""The recording of one episode: its token sequence, split into segments (pure, no I/O).

An episode is sample ``i`` of a prompt group. Its recording holds one or more *segments*; each
segment becomes one `Trajectory`: ``input_ids`` (the first prompt of the segment), then
``output_ids`` (every token after it, sampled or inserted) with, per output token,

- ``loss_mask``: 1 for a token the engine sampled, 0 for one the episode inserted (tool output,
  observations, rendered messages, the chat template's own tokens);
- ``logprobs``: the engine's logprob for a sampled token, 0.0 for an inserted one;
- ``versions``: the weight version that sampled the token; an inserted token takes the version of
  the last sampled token before it in the segment, or the episode's start version when there is none;
- ``metadata["constrained_tokens"]`` (only when some were): ``[start, end)`` ranges of ``output_ids``
  sampled under a grammar (structured output, a forced tool call), so a trainer can tell that their
  sampling distribution was the model's masked by the grammar.

Images (a vision-language model at the chat endpoint): a segment records each image it shows as one image
token in its ids (what the engine is given, with the images, every turn) and the image itself
(`SegmentImage`: bytes, sha256, and the patch grid and token count the engine reported). Its trajectory
holds the ids as the model ran them: each such placeholder (in the prompt, or an inserted token) repeated
once per image token, mask 0, logprob 0, the inserted token's version; ``image_sha256`` and
``image_grid_thw`` in order; and ``metadata["episode_images"]`` (sha256 -> the encoded file), since the
trainer never saw images an agent made.

Token in, token out: sampled tokens are stored exactly as the engine returned them and are never
re-derived from text. A new turn whose full prompt (as token ids) extends the current segment's
sequence appends only the missing tokens (mask 0); a prompt that does not (the history was rewritten)
opens a new segment whose ``input_ids`` are that prompt. Segment 0 has the trajectory id
``f"{prompt_id}:{i}"``, segment ``s > 0`` ``f"{prompt_id}:{i}:{s}"`` (see `segment_id`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollpool.protocol.messages import FinishReason, Trajectory

__all__ = ["EpisodeRecording", "RecordingMark", "Segment", "SegmentImage", "segment_id"]


def segment_id(prompt_id: str, sample_index: int, segment_index: int) -> str:
    """The trajectory id of a segment: ``f"{prompt_id}:{i}"`` for segment 0, ``f"{prompt_id}:{i}:{s}"`` after."""
    if segment_index < 0:
        raise ValueError(f"segment_index must be >= 0, got {segment_index}")
    if segment_index == 0:
        return f"{prompt_id}:{sample_index}"
    return f"{prompt_id}:{sample_index}:{segment_index}"


@dataclass(slots=True)
class SegmentImage:
    """One image a segment shows the model (one image token stands for it in the recorded ids)."""

    data: bytes
    """The encoded image file, as checked by the worker."""
    sha256: str
    grid_thw: tuple[int, int, int] | None = None
    """Its (t, h, w) patch grid, once the engine ran it."""
    tokens: int = 0
    """The image tokens the model ran for it (its placeholder expanded); 0 until the engine ran it."""


@dataclass(slots=True)
class Segment:
    """One contiguous token sequence of an episode (one trajectory)."""

    index: int
    input_ids: list[int]
    start_version: int
    output_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = FinishReason.STOP
    """The finish reason of the last sampled turn (``stop`` until one is sampled)."""
    turns: int = 0
    """Sampled turns (engine calls) recorded in this segment."""
    started_at: float = 0.0
    first_token_at: float = 0.0
    finished_at: float = 0.0
    last_sampled_version: int | None = None
    chat: Any = None
    """The endpoint's view of this segment (messages, rendered text); opaque here."""
    constrained: list[tuple[int, int]] = field(default_factory=list)
    """[start, end) ranges of `output_ids` sampled under a grammar (structured output, a forced tool call)."""
    images: list[SegmentImage] = field(default_factory=list)
    """The images the sequence shows, in the order of their placeholders."""
    image_token_id: int = -1
    """The model's image token (its placeholders in the ids); -1 without images."""
    _array: np.ndarray[Any, np.dtype[np.int64]] | None = field(default=None, repr=False, compare=False)
    """`token_array`'s buffer: its first `_array_len` entries are the sequence's first ids (more room after them)."""
    _array_len: int = field(default=0, repr=False, compare=False)
    _array_bounds: tuple[int, int] | None = field(default=None, repr=False, compare=False)
    """The least and the greatest of the buffer's first `_array_len` ids (None: none)."""

    def token_array(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The whole sequence (`tokens`) as an int64 array, not to be changed. Each id is converted once, when first
        asked for after it was appended (a turn's prompt of a thousand ids, converted whole every turn, cost more than
        the rest of the turn's bookkeeping). It is a view of a buffer that is never written where an array given out
        lies: appends go past it, growth moves to a new buffer, and `truncate_outputs` (a rollback) drops the buffer."""
        n, k, start = len(self), self._array_len, len(self.input_ids)
        buf = self._array
        if buf is None or k > n or k < start:
            buf, k = np.empty(max(2 * n, 1024), dtype=np.int64), 0
            buf[:start] = self.input_ids
            k = start
            self._array_bounds = (min(self.input_ids), max(self.input_ids)) if self.input_ids else None
        elif n > len(buf):
            grown = np.empty(2 * n, dtype=np.int64)
            grown[:k] = buf[:k]
            buf = grown
        if n > k:
            new = self.output_ids[k - start:]
            buf[k:n] = new
            lo, hi = min(new), max(new)  # in Python over the new ids: cheaper here than a reduction over the whole array
            if self._array_bounds is not None:
                lo, hi = min(lo, self._array_bounds[0]), max(hi, self._array_bounds[1])
            self._array_bounds = (lo, hi)
        self._array, self._array_len = buf, n
        return buf[:n]

    def token_bounds(self) -> tuple[int, int] | None:
        """(least, greatest) id of the sequence `token_array` last gave (None for an empty one)."""
        return self._array_bounds

    def truncate_outputs(self, n: int) -> None:
        """Keep the first `n` outputs (ids, masks, logprobs, versions); `token_array` starts a new buffer."""
        for name in ("output_ids", "loss_mask", "logprobs", "versions"):
            del getattr(self, name)[n:]
        self._array, self._array_len, self._array_bounds = None, 0, None

    @property
    def image_extra_tokens(self) -> int:
        """How many more tokens the model runs than the recorded ids hold (each image's expansion, where known)."""
        return sum(im.tokens - 1 for im in self.images if im.tokens > 1)

    def model_len(self) -> int:
        """The sequence's length as the model runs it (placeholders expanded, where known)."""
        return len(self) + self.image_extra_tokens if self.images else len(self.input_ids) + len(self.output_ids)

    def model_tokens(self) -> list[int]:
        """The whole sequence as the model runs it (placeholders expanded, where known)."""
        run = _as_run(self)
        return run.input_ids + run.output_ids

    @property
    def tokens(self) -> list[int]:
        """The whole sequence: prompt then outputs (what the engine is given for the next turn)."""
        return self.input_ids + self.output_ids

    def __len__(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def sampled_tokens(self) -> int:
        return sum(self.loss_mask)

    def insert(self, token_ids: Sequence[int]) -> None:
        """Append tokens the model did not sample (loss mask 0, logprob 0)."""
        ids = list(map(int, token_ids))
        version = self.start_version if self.last_sampled_version is None else self.last_sampled_version
        self.output_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)

    def sample(self, token_ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int], finish_reason: str,
               *, first_token_at: float = 0.0, finished_at: float = 0.0) -> None:
        """Append one sampled turn exactly as the engine returned it (loss mask 1)."""
        if not len(token_ids) == len(logprobs) == len(versions):
            raise ValueError(f"a sampled turn needs one logprob and one version per token: {len(token_ids)} ids, "
                             f"{len(logprobs)} logprobs, {len(versions)} versions")
        self.output_ids += map(int, token_ids)
        self.loss_mask += [1] * len(token_ids)
        self.logprobs += map(float, logprobs)
        self.versions += map(int, versions)
        if len(versions):
            self.last_sampled_version = int(versions[-1])
        self.finish_reason = finish_reason
        self.turns += 1
        if first_token_at and not self.first_token_at:
            self.first_token_at = first_token_at
        if finished_at:
            self.finished_at = finished_at


@dataclass(frozen=True, slots=True)
class RecordingMark:
    """Where a recording stood before a turn (`EpisodeRecording.mark`), to undo a turn the engine refused."""

    segments: int
    outputs: int
    """The then-current segment's output length (-1 without a segment)."""
    images: int
    """The then-current segment's image count."""
    chat: Any
    finish_reason: str
    prompt_tokens: int
    reused_prefix_tokens: int


def _segment_metadata(metadata: Mapping[str, Any] | None, seg: Segment) -> dict[str, Any]:
    out = dict(metadata or {})
    if seg.constrained:
        out["constrained_tokens"] = [list(span) for span in seg.constrained]
    return out


class EpisodeRecording:
    """Every segment of one episode, in order; the current segment is the last one."""

    def __init__(self, prompt_id: str, sample_index: int, start_version: int) -> None:
        self.prompt_id = prompt_id
        self.sample_index = sample_index
        self.start_version = start_version
        self.segments: list[Segment] = []
        self.context_exceeded = False
        """Set when the episode tried to go past the engine's context (the segment that would overflow ends with
        ``length``, and so does the episode if it then fails)."""
        self.reused_prefix_tokens = 0
        """Prompt tokens of later turns that were already in the sequence (what a prefix cache can serve)."""
        self.prompt_tokens = 0
        """Prompt tokens of every sampled turn, the reused ones included."""

    @property
    def current(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    def begin(self, input_ids: Sequence[int], *, now: float = 0.0) -> Segment:
        """Open a new segment whose prompt is `input_ids`."""
        seg = Segment(index=len(self.segments), input_ids=list(map(int, input_ids)),
                      start_version=self.start_version, started_at=now)
        self.segments.append(seg)
        return seg

    def continue_with(self, prompt_ids: Sequence[int], *, now: float = 0.0) -> tuple[Segment, bool]:
        """Make the current segment's sequence equal `prompt_ids`: (segment, True if a new one was opened).

        If `prompt_ids` starts with the current sequence, only the rest is inserted (mask 0); otherwise
        (no segment yet, or the history was rewritten) a new segment begins with `prompt_ids` as its prompt.
        """
        ids = list(map(int, prompt_ids))
        seg = self.current
        if seg is not None:
            have = seg.tokens
            if len(ids) >= len(have) and ids[: len(have)] == have:
                seg.insert(ids[len(have):])
                return seg, False
        return self.begin(ids, now=now), True

    def mark(self) -> RecordingMark:
        seg = self.current
        return RecordingMark(len(self.segments), -1 if seg is None else len(seg.output_ids), 0 if seg is None else len(seg.images),
                             None if seg is None else seg.chat,
                             FinishReason.STOP if seg is None else seg.finish_reason, self.prompt_tokens, self.reused_prefix_tokens)

    def rollback(self, m: RecordingMark) -> None:
        """Undo what was recorded since `m` (a turn the engine refused: it sampled nothing, so nothing of it stays)."""
        del self.segments[m.segments:]
        seg = self.current
        if seg is not None and m.outputs >= 0:
            seg.truncate_outputs(m.outputs)
            del seg.images[m.images:]
            seg.chat, seg.finish_reason = m.chat, m.finish_reason
        self.prompt_tokens, self.reused_prefix_tokens = m.prompt_tokens, m.reused_prefix_tokens

    def count_turn(self, prompt_len: int, reused: int) -> None:
        self.prompt_tokens += prompt_len
        self.reused_prefix_tokens += reused

    @property
    def turns(self) -> int:
        return sum(s.turns for s in self.segments)

    def trajectories(self, *, finish_reason: str | None = None, worker_id: str = "", attempt: int = 0,
                     queued_at: float = 0.0, reward: float | None = None, metadata: Mapping[str, Any] | None = None,
                     output_text: Sequence[str | None] | None = None) -> list[Trajectory]:
        """One `Trajectory` per segment (an episode that recorded nothing gives one empty segment).

        `finish_reason` overrides the last segment's (an episode that raised: ``error``; one that timed
        out: ``abort``; one that failed after going past the context: ``length``); earlier segments keep their own.
        Every segment carries the episode's reward and metadata.
        """
        segments = self.segments or [Segment(index=0, input_ids=[], start_version=self.start_version)]
        out: list[Trajectory] = []
        for seg in segments:
            last = seg is segments[-1]
            reason = seg.finish_reason
            if last and finish_reason is not None:
                reason = finish_reason
            text = output_text[seg.index] if output_text is not None and seg.index < len(output_text) else None
            ran = _as_run(seg)
            meta = _segment_metadata(metadata, seg)
            if ran.constrained is not None:
                meta["constrained_tokens"] = ran.constrained
            if seg.images:
                meta["episode_images"] = {im.sha256: im.data for im in seg.images}
            input_ids, output_ids = _int32_ids(seg, ran)
            out.append(Trajectory(
                prompt_id=self.prompt_id,
                sample_index=self.sample_index,
                segment_index=seg.index,
                input_ids=input_ids,
                output_ids=output_ids,
                output_logprobs=np.asarray(ran.logprobs, dtype=np.float32),
                token_versions=np.asarray(ran.versions, dtype=np.int32),
                loss_mask=np.asarray(ran.loss_mask, dtype=np.uint8),
                finish_reason=reason,
                worker_id=worker_id,
                attempt=attempt,
                output_text=text,
                queued_at=queued_at,
                started_at=seg.started_at,
                first_token_at=seg.first_token_at,
                finished_at=seg.finished_at,
                reward=reward,
                metadata=meta,
                image_sha256=tuple(im.sha256 for im in seg.images),
                image_grid_thw=(np.asarray([x for im in seg.images for x in (im.grid_thw or (0, 0, 0))], dtype=np.int32)
                                if seg.images else None),
            ))
        return out


def _int32_ids(seg: Segment, ran: _Run) -> tuple[np.ndarray[Any, np.dtype[np.int32]], np.ndarray[Any, np.dtype[np.int32]]]:
    """The trajectory's input and output ids as int32 arrays: from the segment's `token_array` where it holds them as
    they ran (no images) and they fit int32 (a list of ids converted one by one cost more); else from the lists, as
    before (an id past int32 then raises as it did)."""
    if ran.input_ids is seg.input_ids and ran.output_ids is seg.output_ids:
        ids, bounds = seg.token_array(), seg.token_bounds()
        if bounds is None or (bounds[0] >= -(1 << 31) and bounds[1] < 1 << 31):
            start = len(seg.input_ids)
            return ids[:start].astype(np.int32), ids[start:].astype(np.int32)
    return np.asarray(ran.input_ids, dtype=np.int32), np.asarray(ran.output_ids, dtype=np.int32)


@dataclass(slots=True)
class _Run:
    """A segment's arrays as the model ran them (placeholders expanded)."""

    input_ids: list[int]
    output_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    constrained: list[list[int]] | None = None
    """The constrained spans remapped onto the expanded outputs (None: unchanged)."""


def _as_run(seg: Segment) -> _Run:
    """`seg`'s ids with each image placeholder repeated once per image token (sampled image tokens are text, kept)."""
    if not seg.images or not seg.image_extra_tokens:
        return _Run(seg.input_ids, seg.output_ids, seg.loss_mask, seg.logprobs, seg.versions)
    sizes = iter([max(1, im.tokens) for im in seg.images])
    image_id = seg.image_token_id

    def times(token: int, sampled: bool) -> int:
        return next(sizes, 1) if token == image_id and not sampled else 1

    input_ids: list[int] = []
    for t in seg.input_ids:
        input_ids += [t] * times(t, False)
    run = _Run(input_ids, [], [], [], [])
    where: list[int] = []
    for t, m, lp, v in zip(seg.output_ids, seg.loss_mask, seg.logprobs, seg.versions, strict=True):
        where.append(len(run.output_ids))
        k = times(t, m == 1)
        run.output_ids += [t] * k
        run.loss_mask += [m] * k
        run.logprobs += [lp] * k
        run.versions += [v] * k
    if seg.constrained:
        where.append(len(run.output_ids))
        run.constrained = [[where[a], where[b]] for a, b in seg.constrained]
    return run
