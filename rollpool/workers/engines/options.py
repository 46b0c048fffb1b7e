"""Engine options: one frozen, validated dataclass per built-in engine, and their ``key=value`` form.

`SimOptions`, `HFOptions` and `SGLangOptions` are what the engines are built
from. Each checks its ranges in ``__post_init__`` and raises `ConfigError`
naming ``Class.field``; an unknown key is refused with the known ones listed.
`parse_options` turns the CLI's ``key=value,key=value`` string into typed
values by the dataclass's field types (``"1"`` stays a string for a string
field), so the engines never re-parse or guess. This module imports neither
torch nor sglang: the worker's config validates options before any engine loads.
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from rollpool.protocol.errors import ConfigError

__all__ = [
    "SimOptions",
    "HFOptions",
    "SGLangOptions",
    "OPTIONS_BY_ENGINE",
    "SIM_LENGTHS",
    "SGLANG_BACKENDS",
    "SGLANG_GRAMMAR_BACKENDS",
    "options_from",
    "parse_options",
    "split_options",
]

SIM_LENGTHS = ("fixed", "uniform", "lognormal")
SGLANG_BACKENDS = ("sglang", "sim")
SGLANG_GRAMMAR_BACKENDS = ("auto", "xgrammar", "llguidance", "outlines", "none")
_HF_DTYPES = ("float32", "float16", "bfloat16", "float64")

OptionsT = TypeVar("OptionsT")


def _fail(cls: type, name: str, why: str, value: Any) -> ConfigError:
    return ConfigError(f"{cls.__name__}.{name} {why}, got {value!r}")


@dataclass(frozen=True, slots=True)
class SimOptions:
    """Options of the `sim` engine (see engines/sim.py for the latency model)."""

    model: str | None = None
    capacity: int = 64
    vocab: int = 32_000
    eos_id: int = 2
    prefill_s_per_token: float = 0.0
    decode_s_per_token: float = 0.002
    jitter: float = 0.0
    length: str = "lognormal"
    length_median: int = 64
    length_sigma: float = 0.8
    length_min: int = 1
    seed: int = 0
    apply_s: float = 0.0
    initial_version: int = 0
    special_ids: tuple[int, ...] = ()
    """Sample as a chat model does: none of these ids (the tokenizer's special tokens) inside a sample, and a sample
    that stops ends with the request's first stop id other than `eos_id` (a chat template's end-of-turn) where it
    has one. Empty (default): any id but a stop id inside a sample, and the request's first stop id at its end. The
    sglang engine's sim child fills it from the model directory's tokenizer with ``server_args={"chat_sampling": true}``."""

    def __post_init__(self) -> None:
        c = type(self)
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab for t in self.special_ids):
            raise _fail(c, "special_ids", f"must be token ids in [0, vocab={self.vocab})", self.special_ids)
        if self.length not in SIM_LENGTHS:
            raise _fail(c, "length", f"must be one of {SIM_LENGTHS}", self.length)
        if self.decode_s_per_token <= 0:
            raise _fail(c, "decode_s_per_token", "must be > 0", self.decode_s_per_token)
        if self.capacity < 1:
            raise _fail(c, "capacity", "must be >= 1", self.capacity)
        if self.vocab < 4:
            raise _fail(c, "vocab", "must be >= 4", self.vocab)
        if not 0 <= self.eos_id < self.vocab:
            raise _fail(c, "eos_id", f"must be in [0, vocab={self.vocab})", self.eos_id)
        for name in ("prefill_s_per_token", "jitter", "length_sigma", "apply_s"):
            if getattr(self, name) < 0:
                raise _fail(c, name, "must be >= 0", getattr(self, name))


@dataclass(frozen=True, slots=True)
class HFOptions:
    """Options of the `hf` engine (torch + transformers)."""

    model: str = ""
    capacity: int = 32
    device: str | None = None
    dtype: str = "float32"
    seed: int = 0
    initial_version: int = 0
    num_threads: int | None = None
    attn_implementation: str = "sdpa"
    lora_resident: int = 4
    """LoRA adapter versions kept resident (besides any an in-flight sequence still runs on); at least the broker's
    max_staleness + 1, so a request admitted on an older version finishes on it (docs/lora.md)."""
    max_lora_rank: int = 64
    """The largest adapter rank this engine accepts."""

    def __post_init__(self) -> None:
        c = type(self)
        if not self.model:
            raise _fail(c, "model", "is needed (a local model directory: --model)", self.model)
        if self.lora_resident < 1:
            raise _fail(c, "lora_resident", "must be >= 1", self.lora_resident)
        if self.max_lora_rank < 1:
            raise _fail(c, "max_lora_rank", "must be >= 1", self.max_lora_rank)
        if self.capacity < 1:
            raise _fail(c, "capacity", "must be >= 1", self.capacity)
        if self.dtype not in _HF_DTYPES:
            raise _fail(c, "dtype", f"must be one of {_HF_DTYPES}", self.dtype)
        if self.num_threads is not None and self.num_threads < 1:
            raise _fail(c, "num_threads", "must be >= 1 (or unset)", self.num_threads)


@dataclass(frozen=True, slots=True)
class SGLangOptions:
    """Options of the `sglang` engine (worker side; the child gets what it needs on its command line)."""

    model: str = ""
    capacity: int = 256
    """Most samples the whole engine runs at once (all its data-parallel replicas together)."""
    tp_size: int = 1
    """Tensor-parallel ranks per replica, one GPU each (SGLang's ``tp_size``)."""
    dp_size: int = 1
    """Data-parallel replicas, each a child of ``tp_size`` GPUs, behind this one engine (and one worker)."""
    per_rank_weights: bool = True
    """With ``tp_size > 1``: each version is copied onto every rank's GPU before the pause and each rank maps its own
    copy (True); False: one copy on rank 0's GPU, which every rank maps and copies to its GPU inside the update."""
    url: str | None = None
    """Attach to a server someone else started (``http://host:port``) instead of launching a child."""
    api_key: str = ""
    """Bearer token of the server at `url` (SGLang's ``--api-key``); a launched child gets a fresh one per launch."""
    port: int = 0
    device: str | None = None
    dtype: str = "bfloat16"
    mem_fraction_static: float = 0.6
    context_length: int = 0
    """0: the model's ``max_position_embeddings``."""
    seed: int = 0
    initial_version: int = 0
    cuda_graph_max_bs: int = 0
    server_args: str = ""
    """A JSON object of extra keyword arguments for the child's backend (``sglang.Engine``, or `SimOptions`)."""
    server_cmd: str = ""
    python: str = ""
    backend: str = "sglang"
    """What the child serves: ``sglang`` (real SGLang) or ``sim`` (the sim engine, SGLang-shaped answers; CPU tests)."""
    start_timeout_s: float = 600.0
    request_timeout_s: float = 3600.0
    verify_updates: bool = True
    log_dir: str = ""
    lora: bool = False
    """Serve LoRA adapter versions (docs/lora.md): SGLang starts with ``enable_lora`` and the three settings below."""
    max_lora_rank: int = 64
    """The largest adapter rank served (SGLang's ``max_lora_rank``: its GPU memory pool is sized for it)."""
    lora_target_modules: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    """Module names adapters may target (SGLang's ``lora_target_modules``), separated by ``,`` or ``+`` (``+`` inside
    ``--engine-options``, whose entries ``,`` separates), or ``all``."""
    lora_resident: int = 4
    """Adapter versions kept loaded (besides any a running sample still uses); at least the broker's max_staleness + 1."""
    max_loras_per_batch: int = 0
    """SGLang's ``max_loras_per_batch`` (adapters in its GPU pool at once, the base counts as one); 0: lora_resident + 1."""
    lora_dir: str = ""
    """Where adapter versions are written for SGLang to load (one PEFT directory each, removed once loaded); empty:
    /dev/shm (a tmpfs) when present, else the system's temporary directory."""
    grammar_backend: str = "auto"
    """SGLang's grammar backend, which constrained decoding (forced tool calls, structured output) needs: ``auto`` is
    ``xgrammar`` where the child can import it, else ``none`` (constrained requests are refused); or ``xgrammar``,
    ``llguidance``, ``outlines``, ``none``. The sim child's ``xgrammar`` is a fake: uniform among the allowed tokens."""

    def lora_targets(self) -> tuple[str, ...]:
        return tuple(t for t in re.split(r"[,+\s]+", self.lora_target_modules) if t)
    hop: str = "auto"
    """Where the per-sample calls (``/generate``, ``/abort_request``) go: over one ZeroMQ socket pair (`hop`) instead of
    one HTTP request each. ``auto``: a launched child gets a socket of its own, a server at `url` or run by
    `server_cmd` none; ``off``: HTTP only; an ``ipc://`` or ``tcp://`` endpoint: with `url`, the socket that server
    was started with (``--hop``). The other routes always go over HTTP."""

    def __post_init__(self) -> None:  # noqa: C901 - grandfathered: one check per field
        c = type(self)
        if not self.model:
            raise _fail(c, "model", "is needed (a local model directory: --model)", self.model)
        if self.capacity < 1:
            raise _fail(c, "capacity", "must be >= 1", self.capacity)
        if not 1 <= self.max_lora_rank <= 1024:
            raise _fail(c, "max_lora_rank", "must be in [1, 1024]", self.max_lora_rank)
        if self.lora_resident < 1:
            raise _fail(c, "lora_resident", "must be >= 1", self.lora_resident)
        if self.max_loras_per_batch < 0:
            raise _fail(c, "max_loras_per_batch", "must be >= 0 (0: lora_resident + 1)", self.max_loras_per_batch)
        if not self.lora_targets():
            raise _fail(c, "lora_target_modules", "must name at least one module (or all)", self.lora_target_modules)
        if "all" in self.lora_targets() and len(self.lora_targets()) > 1:
            raise _fail(c, "lora_target_modules", "all must be the only entry", self.lora_target_modules)
        for name in ("tp_size", "dp_size"):
            if not 1 <= getattr(self, name) <= 64:
                raise _fail(c, name, "must be in [1, 64]", getattr(self, name))
        if self.capacity < self.dp_size:
            raise _fail(c, "capacity", f"must be >= dp_size ({self.dp_size}): every replica takes at least one sample", self.capacity)
        if self.url is not None and self.dp_size > 1:
            raise _fail(c, "dp_size", "must be 1 with url= (an attached server is one replica; start one worker per server)", self.dp_size)
        if not 0 <= self.port < 65536:
            raise _fail(c, "port", "must be in [0, 65535]", self.port)
        if not 0 < self.mem_fraction_static < 1:
            raise _fail(c, "mem_fraction_static", "must be in (0, 1)", self.mem_fraction_static)
        for name in ("context_length", "cuda_graph_max_bs"):
            if getattr(self, name) < 0:
                raise _fail(c, name, "must be >= 0", getattr(self, name))
        for name in ("start_timeout_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise _fail(c, name, "must be > 0", getattr(self, name))
        if self.grammar_backend not in SGLANG_GRAMMAR_BACKENDS:
            raise _fail(c, "grammar_backend", f"must be one of {SGLANG_GRAMMAR_BACKENDS}", self.grammar_backend)
        if self.backend not in SGLANG_BACKENDS:
            raise _fail(c, "backend", f"must be one of {SGLANG_BACKENDS}", self.backend)
        if self.url is not None and not self.url.startswith("http://"):
            raise _fail(c, "url", "must look like http://host:port", self.url)
        if self.hop not in ("auto", "off") and not (self.url is not None and self.hop.startswith(("ipc://", "tcp://"))):
            raise _fail(c, "hop", "must be auto, off, or (with url=) the ipc:// or tcp:// endpoint of that server's --hop", self.hop)
        if self.server_args:
            try:
                parsed = json.loads(self.server_args)
            except ValueError as exc:
                raise _fail(c, "server_args", f"must be a JSON object ({exc})", self.server_args) from exc
            if not isinstance(parsed, dict):
                raise _fail(c, "server_args", "must be a JSON object", self.server_args)

    def server_kwargs(self) -> dict[str, Any]:
        return dict(json.loads(self.server_args)) if self.server_args else {}


OPTIONS_BY_ENGINE: dict[str, type] = {"sim": SimOptions, "hf": HFOptions, "sglang": SGLangOptions}


def options_from(cls: type[OptionsT], values: Mapping[str, Any]) -> OptionsT:
    """``cls(**values)``, with an unknown key refused by name (`ConfigError`) instead of a bare TypeError."""
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{cls.__name__} has no option {', '.join(map(repr, unknown))}; known: {', '.join(sorted(known))}")
    return cls(**values)


def _top_level_parts(text: str) -> list[str]:
    """`text` cut at its commas outside JSON brackets, braces and strings: a JSON value (``server_args={"a":1,"b":2}``)
    stays one part."""
    parts: list[str] = []
    depth, quoted, escaped, start = 0, False, False, 0
    for i, ch in enumerate(text):
        if quoted:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
        elif ch == '"' and depth > 0:  # a string inside a JSON value (a quote elsewhere is a plain character)
            quoted = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth = max(0, depth - 1)
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def split_options(text: str, where: str = "engine_options") -> dict[str, str]:
    """``"a=1, b=x"`` -> ``{"a": "1", "b": "x"}`` (values untyped). A comma inside a JSON value (brackets, braces,
    strings) does not cut it: ``server_args={"a":1,"b":2}`` is one option."""
    out: dict[str, str] = {}
    for part in (p.strip() for p in _top_level_parts(text)):
        if not part:
            continue
        key, sep, raw = part.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"WorkerConfig.{where}: {part!r} is not key=value")
        out[key.strip()] = raw.strip()
    return out


def _convert(cls: type, name: str, hint: Any, raw: str) -> Any:
    args = typing.get_args(hint)
    if args and type(None) in args:  # X | None
        if raw.lower() in ("", "none", "null"):
            return None
        (hint,) = [a for a in args if a is not type(None)]
    if hint is bool:
        low = raw.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise _fail(cls, name, "must be true or false", raw)
    if hint is int:
        try:
            return int(raw)
        except ValueError:
            raise _fail(cls, name, "must be an integer", raw) from None
    if hint is float:
        try:
            return float(raw)
        except ValueError:
            raise _fail(cls, name, "must be a number", raw) from None
    return raw


def parse_options(cls: type[OptionsT], text: str | Mapping[str, Any]) -> OptionsT:
    """The ``key=value,...`` form (or a mapping of strings / typed values) as a validated `cls`."""
    raw = split_options(text) if isinstance(text, str) else dict(text)
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(f"{cls.__name__} has no option {key!r}; known: {', '.join(sorted(known))}")
        values[key] = _convert(cls, key, hints[key], value) if isinstance(value, str) else value
    return options_from(cls, values)
