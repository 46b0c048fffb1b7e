"""SGLang 0.5.14 HTTP wire format: request bodies and response parsing, no I/O.

Pure functions the `sglang` engine uses to talk to its child (`server`), which serves SGLang's routes;
tested on CPU against responses recorded from real SGLang (tests/fixtures/sglang).

Guarantees (the traps of ../shared/sglang-kit/API-NOTES.md):

- One HTTP request per sample, never ``n > 1`` (SGLang replaces the rids of
  parallel samples with fresh uuids). Sample rids have a fixed width
  (`sample_rid`), so SGLang's abort-by-prefix can never hit another sample.
- ``max_new_tokens`` is always sent (SGLang's default is 128); only keys
  SGLang knows are sent (an unknown key is a ``TypeError`` in the server).
- `parse_generate_response` keeps ``output_ids`` with the stop token (as SGLang
  returns them) and one logprob per output id; an abort from the waiting queue
  (no ``prompt_tokens``, maybe no logprobs) parses to what reached the client.
- Nothing here imports sglang or torch.
"""

from __future__ import annotations

import json
import operator
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np

from rollpool.protocol.messages import FinishReason, SamplingParams

__all__ = [
    "ParsedSample",
    "RID_WIDTH",
    "sample_rid",
    "generate_body",
    "LogprobTriples",
    "parse_generate_response",
    "parse_weight_version",
    "read_safetensors_index",
    "pick_verify_names",
]

RID_WIDTH = 31
"""Every sample rid is exactly this many characters."""

_ABORT_MESSAGES = ("Aborted", "Abort in waiting queue", "Abort before prefill")


def sample_rid(engine_tag: str, request_no: int, index: int, attempt: int) -> str:
    """``<tag:8>-<request:10>-<sample:5>-<attempt:5>``: fixed width, so no rid is a prefix of another."""
    if not (len(engine_tag) == 8 and engine_tag.isalnum()):
        raise ValueError(f"engine_tag must be 8 alphanumeric characters, got {engine_tag!r}")
    if not (0 <= request_no < 10**10 and 0 <= index < 10**5 and 0 <= attempt < 10**5):
        raise ValueError(f"rid fields out of range: request {request_no}, sample {index}, attempt {attempt}")
    rid = f"{engine_tag}-{request_no:010d}-{index:05d}-{attempt:05d}"
    assert len(rid) == RID_WIDTH
    return rid


def generate_body(
    input_ids: Sequence[int] | np.ndarray[Any, Any],
    sampling: SamplingParams,
    *,
    rid: str,
    index: int,
    max_new_tokens: int | None = None,
    image_data: Sequence[str] | Sequence[bytes] | None = None,
    ebnf: str | None = None,
) -> dict[str, Any]:
    """The JSON body of ``POST /generate`` for one sample (``index`` offsets the seed, as the hf engine does);
    ``image_data`` (one per image token of `input_ids`: data URIs, or the encoded files as bytes, which only the hop
    carries, in frames of their own) and ``ebnf`` (a grammar for SGLang's grammar
    backend, ``sampling_params.ebnf``) only when given. `input_ids` given as an integer
    numpy array stay one (the caller converted them once: JSON writes them as a list, the hop as its int32 frame)."""
    sp: dict[str, Any] = {
        "max_new_tokens": int(sampling.max_new_tokens if max_new_tokens is None else max_new_tokens),
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "top_k": int(sampling.top_k),
        "min_p": float(sampling.min_p),
        "ignore_eos": bool(sampling.ignore_eos),
    }
    if sampling.stop_token_ids:
        sp["stop_token_ids"] = [int(t) for t in sampling.stop_token_ids]
    if sampling.stop:
        sp["stop"] = list(sampling.stop)
    if sampling.seed is not None:
        sp["sampling_seed"] = int(sampling.seed) + index
    if ebnf is not None:
        sp["ebnf"] = ebnf
    body: dict[str, Any] = {
        "input_ids": input_ids if isinstance(input_ids, np.ndarray) and input_ids.dtype.kind in "iu" else list(map(int, input_ids)),
        "sampling_params": sp,
        "return_logprob": True,
        "rid": rid,
        "stream": False,
    }
    if image_data:
        body["image_data"] = list(image_data)
    return body


@dataclass(frozen=True, slots=True)
class ParsedSample:
    """One ``/generate`` answer in rollpool's terms."""

    rid: str
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """stop, length, abort or error."""
    matched_stop: int | str | None
    text: str | None
    weight_version: str | None
    abort_message: str | None = None
    """SGLang's abort message; ``Aborted`` and ``Abort in waiting queue`` are ordinary aborts."""
    cached_tokens: int | None = None
    """``meta_info.cached_tokens``: prompt tokens SGLang's radix cache served."""
    prompt_tokens: int | None = None
    """``meta_info.prompt_tokens``: the prompt's length as SGLang ran it (its images expanded by its own processor)."""

    @property
    def aborted_by_request(self) -> bool:
        """An abort asked for by abort_request/pause, not a refusal by the server."""
        return self.finish_reason == FinishReason.ABORT and (self.abort_message or "Aborted") in _ABORT_MESSAGES


_FIRST = operator.itemgetter(0)


class LogprobTriples(Sequence[list[Any]]):
    """``meta_info.output_token_logprobs`` as the hop carries it (`hop`): the same ``[logprob, id, None]`` entries,
    held as their two columns, which is how the hop's binary frames arrive (building a list per token and reading it
    back in `parse_generate_response` was most of a turn's answer parsing). Only entries that are exactly these
    columns travel so: every logprob a finite float, every id an int32, every third element None."""

    __slots__ = ("ids", "values")

    def __init__(self, values: list[float], ids: list[int]) -> None:
        if len(values) != len(ids):
            raise ValueError(f"{len(values)} logprobs for {len(ids)} ids")
        self.values, self.ids = values, ids

    def __len__(self) -> int:
        return len(self.values)

    @overload
    def __getitem__(self, i: int) -> list[Any]: ...
    @overload
    def __getitem__(self, i: slice) -> list[list[Any]]: ...
    def __getitem__(self, i: int | slice) -> list[Any] | list[list[Any]]:
        if isinstance(i, slice):
            return [[v, t, None] for v, t in zip(self.values[i], self.ids[i], strict=True)]
        return [self.values[i], self.ids[i], None]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LogprobTriples):
            return self.values == other.values and self.ids == other.ids
        return isinstance(other, Sequence) and list(self) == [list(e) if isinstance(e, tuple) else e for e in other]

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(list(self))


def parse_generate_response(resp: Mapping[str, Any]) -> ParsedSample:
    """Parse one non-streaming ``/generate`` dict (``ValueError`` if it is not one)."""
    meta = resp.get("meta_info")
    if not isinstance(meta, Mapping):
        raise ValueError(f"not a /generate response (no meta_info): {str(resp)[:200]}")
    lp_entries = meta.get("output_token_logprobs") or []
    ids = resp.get("output_ids")
    if type(lp_entries) is LogprobTriples:  # the hop's columns: finite floats and ints already
        ids = list(map(int, lp_entries.ids if ids is None else ids))
        logprobs = list(lp_entries.values)
    else:
        if ids is None:
            ids = [int(e[1]) for e in lp_entries]
        ids = list(map(int, ids))
        firsts = list(map(_FIRST, lp_entries))  # each entry's logprob, in C (a turn's tokens each time)
        logprobs = [float(x) if x is not None else 0.0 for x in firsts] if None in firsts else list(map(float, firsts))
    if len(logprobs) != len(ids):
        if len(logprobs) > len(ids):
            logprobs = logprobs[: len(ids)]
        else:
            # an abort from the waiting queue can carry ids without their logprobs; keep what is aligned
            ids = ids[: len(logprobs)]
    fr = meta.get("finish_reason")
    matched: int | str | None = None
    abort_message: str | None = None
    if fr is None:
        reason = FinishReason.ABORT
    else:
        kind = fr.get("type") if isinstance(fr, Mapping) else str(fr)
        if kind == "stop":
            reason = FinishReason.STOP
            m = fr.get("matched") if isinstance(fr, Mapping) else None
            matched = int(m) if isinstance(m, int) and not isinstance(m, bool) else m
            if m == "NaN happened":
                reason = FinishReason.ERROR
        elif kind == "length":
            reason = FinishReason.LENGTH
        elif kind == "abort":
            abort_message = str(fr.get("message") or "Aborted") if isinstance(fr, Mapping) else "Aborted"
            status = fr.get("status_code") if isinstance(fr, Mapping) else None
            reason = FinishReason.ERROR if status not in (None, 200) else FinishReason.ABORT
        else:
            reason = FinishReason.ERROR
    version = meta.get("weight_version")
    cached = meta.get("cached_tokens")
    prompt_tokens = meta.get("prompt_tokens")
    return ParsedSample(
        rid=str(meta.get("id", "")),
        output_ids=ids,
        logprobs=logprobs,
        finish_reason=reason,
        matched_stop=matched,
        text=resp.get("text") if isinstance(resp.get("text"), str) else None,
        weight_version=None if version is None else str(version),
        abort_message=abort_message,
        cached_tokens=cached if isinstance(cached, int) and not isinstance(cached, bool) else None,
        prompt_tokens=prompt_tokens if isinstance(prompt_tokens, int) and not isinstance(prompt_tokens, bool) else None,
    )


def parse_weight_version(value: str | None) -> int | None:
    """rollpool sets SGLang's weight_version to ``str(int)``; anything else (``default``) is None."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64", "I32": "int32",
              "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def read_safetensors_index(model_dir: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF parameter name -> (torch dtype name, shape), from the checkpoint headers only (no tensor read)."""
    d = Path(model_dir)
    files: list[Path]
    index = d / "model.safetensors.index.json"
    if index.exists():
        files = sorted({d / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(d.glob("*.safetensors"))
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for f in files:
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            out[name] = (_ST_DTYPES.get(entry["dtype"], entry["dtype"].lower()), tuple(int(x) for x in entry["shape"]))
    return out


_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
             "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}
_FLOATS = ("bfloat16", "float16", "float32", "float64")


def version_bytes(params: Mapping[str, tuple[str, Sequence[int]]], serving_dtype: str | None = None) -> int:
    """Bytes of one weight version of these parameters (`read_safetensors_index`'s answer), floating ones counted in
    the engine's `serving_dtype` (what a trainer publishing for it sends); 0 when a dtype is unknown."""
    total = 0
    for dtype, shape in params.values():
        if serving_dtype in _ITEMSIZE and dtype in _FLOATS:
            dtype = serving_dtype
        size = _ITEMSIZE.get(dtype)
        if size is None:
            return 0
        n = 1
        for d in shape:
            n *= int(d)
        total += n * size
    return total


_VERIFIABLE_SUFFIXES = ("lm_head.weight", "o_proj.weight", "down_proj.weight", "embed_tokens.weight")
_VERIFIABLE_1D_SUFFIXES = ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight")


def pick_verify_names(names: Sequence[str], shapes: Mapping[str, Sequence[int]]) -> list[str]:
    """Names whose leading values SGLang's Llama ``get_weights_by_name`` returns unsharded, cheapest first.

    SGLang 0.5.14 turns the whole parameter into a Python list before
    truncating (``tensor.float().tolist()[:truncate_size]``), so a 2048 x 2048
    projection costs about 0.25 s per call and a norm weight (one row of 2048)
    almost nothing. Picks: one norm weight from the second half of the model
    when there is one (a 1-D answer is its first element), else the smallest
    2-D projection from each half. Stacked parameters (q/k/v, gate/up) are
    fused in SGLang and answered per shard, so they are never picked; neither
    are the embedding or lm_head (seconds each at 32k x 2k).
    """
    norms = [n for n in names if n.endswith(_VERIFIABLE_1D_SUFFIXES) and len(shapes.get(n, ())) == 1]
    if norms:
        return [norms[len(norms) // 2]]
    ok = [n for n in names if n.endswith(_VERIFIABLE_SUFFIXES) and len(shapes.get(n, ())) == 2]
    if not ok:
        return []

    def numel(n: str) -> int:
        a, b = shapes[n]
        return int(a) * int(b)

    half = max(1, len(ok) // 2)
    picks = [min(ok[:half], key=numel)]
    if ok[half:]:
        picks.append(min(ok[half:], key=numel))
    return picks
