"""The `sglang` engine, worker side: SGLang 0.5.14 in a child process, behind the Engine protocol.

The child is ``python -m rollpool.workers.engines.sglang.server`` (an
``sglang.Engine`` behind SGLang's HTTP routes, see `server`), started in its
own session and spoken to over HTTP on loopback (`http`: aiohttp), or, with
``url=``, a server someone else started. This module never imports sglang,
and imports torch only through `tensors`, for weight updates. Why a child
rather than SGLang's own HTTP server: docs/sglang.md.

Guarantees:

- A crash inside SGLang (its scheduler SIGKILLs its whole process tree, API
  notes fact 6) kills only the child's tree: every pending call raises
  `EngineError`, so the worker hands its tasks back and restarts the engine.
- The child's port takes pickled CUDA-IPC tensors, so it is guarded by a token
  made fresh for each launch (``secrets.token_urlsafe``), handed to the child
  in its environment (never in argv) and written to ``<log_dir>/sglang-<port>.token``
  (mode 0600) for tools of the same user; a request without it gets 401.
- Requests are refused (`RequestRefusedError`) only by the explicit checks of
  engines/base.py (`check_request`, `check_prompt`: vocabulary and context
  length from the checkpoint's config.json) before anything is sent; any
  other failure, a 4xx or 5xx from the server included, is an `EngineError`.
- Each sample is its own request with a fixed-width rid (`wire`); abort hits
  exactly the samples of one request.
- Apply modes ``interrupt`` and ``drain`` (``in_place`` is refused: on 0.5.14
  pausing in place and then updating crashes the scheduler, API notes fact 7).
  ``interrupt``: stop sending, abort every running sample, wait until each has
  returned its partial output, update, continue, resubmit prompt + partial
  output. ``drain``: stop sending, wait for running samples to finish, update.
  In neither is SGLang's ``pause_generation`` called: with nothing in SGLang its
  update takes the model-update writer lock at once (the API notes' "update
  without pausing" recipe, the one an in-process ``sglang.Engine`` user relies
  on) and flushes an idle cache, while ``pause_generation(abort)`` re-checks for
  running calls only once a second.
  In both modes no sample is in SGLang while weights change, so the version of
  every token is exact: an attempt's tokens carry the ``weight_version`` SGLang
  reports for it (set to ``str(version)`` with each update), checked against
  the version current when the attempt was sent.
- Weights (`StagingEngine`): every name and shape is checked against the
  checkpoint before anything is sent (a misspelt name is only a warning in
  SGLang, a wrong shape kills its scheduler); `stage_weights` copies a version
  to the GPU while generation goes on (`tensors`), and it reaches SGLang as
  CUDA tensors (CUDA IPC handles, same host). The update is confirmed with
  ``get_weights_by_name`` and a mismatch raises `EngineError`, where SGLang's
  model class answers it (Llama, OPT, Granite, Exaone4 in 0.5.14: the child
  says so in ``/model_info``'s ``weights_readable``); for every other model
  (Qwen-family, Qwen2-VL among them) SGLang's own success answer on every
  replica confirms it, said once at start (`SGLangEngine.update_check`).
- LoRA adapter versions (`AdapterEngine`, with the ``lora`` option; docs/lora.md): each version is checked
  (`lora.check_adapter`: rank, target modules, modules and shapes against the checkpoint) before anything is sent,
  written as a PEFT directory on a tmpfs and loaded into every replica under its own name
  (``/load_lora_adapter``), without a restart and without a pause (``adapters_without_pause``: the worker does
  not stop generation for an adapter version). A sample runs on the newest adapter version loaded when its first
  attempt is sent and on that one to its end (every attempt names it, ``lora_path``), so each of its tokens
  carries that version. ``lora_resident`` versions stay loaded, plus any a running sample names; older ones are
  unloaded (``/unload_lora_adapter``) when the next version loads. A whole-model version leaves the newest adapter
  version loaded and on, on top of the new base (SGLang's update leaves loaded adapters as they were): every sample
  that began moves to it, and its later tokens carry the whole-model version (that version's policy is the new
  base plus that adapter); older adapter versions are unloaded.
- Constrained decoding (`ConstrainedEngine`: forced tool calls, structured output): ``generate_constrained`` sends
  the constraint as an xgrammar EBNF grammar (`grammar.constraint_ebnf`, built in the worker: xgrammar, extra
  ``rollpool[grammar]``) in SGLang's ``ebnf`` sampling parameter, compiled and applied by SGLang's grammar backend
  (engine option ``grammar_backend``: ``auto`` is xgrammar where the child can import it). The logprob reported is
  SGLang's, which masks the logits first: the token's log-probability in the masked, renormalised distribution it
  was drawn from (the `hf` engine reports the model's, before the mask). A child without a grammar backend: the
  request is refused (`RequestRefusedError`, naming the engine). A grammar cannot resume inside a sample's partial
  output, so an ``interrupt`` update does not abort a constrained sample: it waits for it to finish (its tokens keep
  the version they began on); a constrained sample aborted by anyone else starts over from its prompt.
- Several GPUs: ``tp_size`` ranks per SGLang server and ``dp_size`` servers
  (replicas, one child each) on the worker's GPUs (`ranks`; fewer GPUs than
  ``tp_size * dp_size`` is a `ConfigError` before any child starts). Each
  version goes to every replica as one payload per TP rank (`tensors.serialize_ranks`),
  applied on every rank or the engine fails and is restarted whole; a prompt
  group runs whole on one replica; a replica (or rank) that dies takes the
  engine down like a crash of the only one.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import pathlib
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import numpy as np

from rollpool.protocol.errors import EngineError, RequestRefusedError, WeightsRefusedError
from rollpool.protocol.fingerprint import model_fingerprint
from rollpool.protocol.messages import AdapterSpec, ApplyMode, FinishReason, SamplingParams
from rollpool.workers.engines.base import (
    EngineInfo,
    GenerateOutput,
    OutputConstraint,
    SampleOutput,
    TokenIds,
    check_prompt,
    check_request,
)
from rollpool.workers.engines.options import SGLangOptions, options_from
from rollpool.workers.engines.sglang.hop import HOP_PATHS, HopClient
from rollpool.workers.engines.sglang.http import TOKEN_ENV, HttpClient, HttpError
from rollpool.workers.engines.sglang.lora import adapter_root, check_adapter, write_adapter
from rollpool.workers.engines.sglang.ranks import GpuPlan, plan_gpus, visible_from_env
from rollpool.workers.engines.sglang.tensors import (
    BucketStager,
    RankPayloads,
    cuda_available,
    cuda_device_count,
    init_cuda,
    leading,
    nbytes,
    serialize_ranks,
    values_tensor,
)
from rollpool.workers.engines.sglang.wire import (
    ParsedSample,
    generate_body,
    parse_generate_response,
    parse_weight_version,
    pick_verify_names,
    read_safetensors_index,
    sample_rid,
    version_bytes,
)
from rollpool.workers.engines.vision import VisionSpec, load_vision_spec

__all__ = ["SGLangEngine", "SGLangOptions", "ENGINE_FACTORY", "SGLANG_APPLY_MODES", "engine_gpu_plan"]

log = logging.getLogger(__name__)

SGLANG_APPLY_MODES: tuple[str, ...] = (ApplyMode.INTERRUPT, ApplyMode.DRAIN)
_INT32_IDS = 1 << 31
"""Token ids below this fit int32, the hop's frame."""

_IN_PLACE_REFUSED = (
    "apply mode in_place is refused on SGLang 0.5.14: pause_generation(in_place) followed by a weight update "
    "with flush_cache crashes the scheduler (sglang-kit API-NOTES fact 7); use interrupt or drain"
)


# --------------------------------------------------------------------------- engine


@dataclass(eq=False)
class _Sample:
    index: int
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    finish: str | None = None
    matched: int | str | None = None
    attempt: int = 0
    rid: str | None = None
    """The rid now in SGLang (None between attempts)."""
    first_token_at: float = 0.0
    finished_at: float = 0.0
    cached_tokens: int | None = None
    """SGLang's cached_tokens of the first attempt (a resubmit's prompt includes tokens this sample made)."""
    adapter: int | None = None
    """The LoRA adapter version every attempt of this sample runs on (set at its first attempt, and again by a
    whole-model version; None: the base alone)."""
    tag: int = -1
    """The version the tokens of this sample carry while it runs on `adapter`: the engine's version when the adapter
    was set (the adapter version itself, or a later whole-model version under it)."""


@dataclass(frozen=True, eq=False)
class _Staged:
    """A version copied onto the GPU(s) ahead of its update (`stage_weights`)."""

    version: int
    names: tuple[str, ...]
    payloads: RankPayloads
    started_at: float
    h2d_s: float
    stage_s: float
    by_bucket: int = 0
    """Tensors whose copy was queued bucket by bucket during the fetch (`stage_bucket`)."""


@dataclass(eq=False)
class _Request:
    request_id: str
    number: int
    input_ids: list[int]
    sampling: SamplingParams
    samples: list[_Sample]
    replica: int = 0
    """The data-parallel replica all samples of this request run on (one prefix cache)."""
    aborted: bool = False
    ids: np.ndarray[Any, Any] | None = None
    """`input_ids` as one int64 array, converted once per request (every attempt sends it: JSON, or the hop's frame)."""
    images: tuple[bytes, ...] = ()
    """The encoded image files, sent with every attempt; `input_ids` then hold one image token per image, which
    SGLang's processor expands (the ids reported are expanded here by the same rule). Over the hop they travel as raw
    frames (SGLang's ``image_data`` takes bytes); over HTTP as base64 data URIs (`image_uris`, made once)."""
    image_uris: list[str] | None = None
    expanded_tokens: int = 0
    """With images: the length of the prompt as reported (its images expanded here), which SGLang must have run."""
    ebnf: str | None = None
    """The grammar every sample is held to (`generate_constrained`), sent with every attempt."""


@dataclass(eq=False)
class _Child:
    """One SGLang server: a launched child process (one data-parallel replica of ``tp_size`` GPUs) or one at ``url=``."""

    replica: int
    port: int
    http: HttpClient | None = None
    hop: HopClient | None = None
    """The per-sample calls' socket to a launched child (`hop`); None: every call over `http`."""
    hop_dir: pathlib.Path | None = None
    proc: asyncio.subprocess.Process | None = None
    log_path: pathlib.Path | None = None
    log_fh: Any = None
    watch: asyncio.Task[None] | None = None
    running: int = 0
    """Samples of this replica now in SGLang (requests go to the least loaded replica)."""


def engine_gpu_plan(options: SGLangOptions, device: str, environ: Mapping[str, str] | None = None) -> GpuPlan | None:
    """The GPUs an engine of `options` on `device` runs on (`ranks.plan_gpus`), before anything starts.

    A `ConfigError` when the worker has fewer than ``tp_size * dp_size``. A CPU engine (the sim backend) needs
    no GPU, and its ranks are pretended: it is held to the GPUs the environment names only when it names some,
    so the same check runs in CPU tests. The worker's CLI calls this too, so a bad ``--tp-size`` exits 2 at once."""
    env = os.environ if environ is None else environ
    visible = visible_from_env(env)
    where = f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '')!r}"
    on_gpu = device.startswith("cuda") or (options.backend == "sglang" and options.url is None)
    if visible is None and on_gpu:
        visible = tuple(f"cuda:{i}" for i in range(cuda_device_count()))
        where = "torch.cuda.device_count(); CUDA_VISIBLE_DEVICES unset"
    if not on_gpu and not visible:
        return None
    first = int(device.partition(":")[2] or 0) if device.startswith("cuda:") else 0
    plan = plan_gpus(options.tp_size, options.dp_size, visible or (), where=where, first=first)
    if len(plan.visible) > plan.gpus_needed:
        log.info("sglang engine: %d of the worker's %d GPUs used (tp_size %d x dp_size %d; %s)", plan.gpus_needed,
                 len(plan.visible), options.tp_size, options.dp_size, where)
    return plan


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _DeathWatch:
    """A done callback on the engine's `_died` future that cancels one `_post` call's task while the call runs."""

    __slots__ = ("armed", "fired", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.armed = True
        self.fired = False

    def __call__(self, _died: asyncio.Future[str]) -> None:
        if self.armed:  # a death reported after the call ended (its callback already scheduled) cancels nothing
            self.fired = True
            self.task.cancel()


class SGLangEngine:
    """SGLang's HTTP server in a child process (see the module docstring)."""

    adapters_without_pause = True
    """An adapter version changes nothing a running sample uses (each names its own): the worker applies one
    without pausing generation."""

    def __init__(self, options: SGLangOptions | None = None, /, **kwargs: Any) -> None:
        """`SGLangOptions` (or its fields as keywords: ``SGLangEngine(model=..., url=...)``)."""
        opts = options if options is not None else options_from(SGLangOptions, kwargs)
        self.options = opts
        self.model_path = opts.model
        self.capacity = opts.capacity
        self.url = opts.url
        self.port = opts.port
        self.device = opts.device
        self.dtype = opts.dtype
        self.version = opts.initial_version
        self.python = opts.python or sys.executable
        self.verify_updates = opts.verify_updates
        self.token = opts.api_key if opts.url else ""
        """The bearer token of the server: `api_key` for ``url=``, fresh for each launch otherwise."""
        self.token_path: pathlib.Path | None = None
        self.last_update: dict[str, Any] = {}
        """Timings of the last update (wall-clock seconds): pause_s, h2d_s, sglang_update_s, verify_s, resume_s; for a
        version rebuilt from a delta, where (``delta_rebuilt_on``: ``device`` or ``host``) and, on the device, its
        seconds (``delta_device_rebuild_s``), as the fetch reported them (`note_fetch`)."""
        self._fetch_notes: tuple[int, dict[str, Any]] | None = None
        self.stats: dict[str, int] = {"attempts": 0, "resubmits": 0, "restarts": 0, "version_mismatches": 0}
        self.tp_size = opts.tp_size
        self.dp_size = opts.dp_size
        self.gpu_plan: GpuPlan | None = None
        """Where each rank runs (set by `start`; None for a CPU engine whose environment names no GPU)."""
        self._tag = secrets.token_hex(4)
        self._children: list[_Child] = []
        self._died: asyncio.Future[str] | None = None
        self._dead: str | None = None
        self._started = False
        self._gate = asyncio.Event()
        self._gate.set()
        self._mode: str | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._in_sglang = 0
        self._requests: dict[str, _Request] = {}
        self._counter = 0
        self._params: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._fingerprint = ""
        self._vocab: int | None = None
        self._takes_images = False
        """The checkpoint has a vision tower (``vision_config``)."""
        self._vision: VisionSpec | None = None
        """Loaded at the first image prompt (the image processor computes the grids the reported ids need)."""
        self._load_lock = asyncio.Lock()
        """One load of the tokenizer or the image processor for the prompts that arrive together (loads in several
        threads at once raced transformers' lazy imports: ``cannot import name 'AutoConfig'``, and the engine restarted
        under every group)."""
        self._image_placeholder_ids: list[int] = []
        """(vision start, image, vision end) token ids from config.json, for the episode endpoint."""
        self._context_tokens: int | None = None
        self._eos_ids: set[int] = set()
        """The model's end-of-sequence ids (config.json, generation_config.json): SGLang's grammar backend stops on them."""
        self._tokenizer: Any = None
        self._released: set[str] = set()
        self._pause_started = 0.0
        self._staged: _Staged | None = None
        self._stagers: dict[str, BucketStager] = {}
        """Per device, copies of the version being fetched, queued bucket by bucket (`stage_bucket`)."""
        self._adapters: dict[int, str] = {}
        """Adapter versions loaded in every replica -> their SGLang name."""
        self._adapter_lock = asyncio.Lock()
        self.grammar_backend = "none"
        self.weights_readable: bool | None = None
        self._image_bounds: tuple[int, int] | None = None
        """The pixel bounds SGLang's image processor resizes within (its ``/model_info``), where the child says."""
        """Whether SGLang's model class answers ``get_weights_by_name`` (the child's ``/model_info``; None: not said)."""
        """The grammar backend the child's SGLang runs (its ``/model_info``; ``none``: constrained requests refused)."""

    @property
    def _proc(self) -> asyncio.subprocess.Process | None:
        """The first replica's child process (None when attached with ``url=``)."""
        return self._children[0].proc if self._children else None

    @property
    def _log_path(self) -> pathlib.Path | None:
        return self._children[0].log_path if self._children else None

    def rank_devices(self) -> list[list[str]]:
        """``[replica][rank]`` -> the device each rank's weights go to (``cpu`` for every rank of a CPU engine)."""
        if self.gpu_plan is not None and (self.device or "").startswith("cuda"):
            return [list(self.gpu_plan.devices(d)) for d in range(self.dp_size)]
        return [[self.device or "cpu"] * self.tp_size for _ in range(self.dp_size)]

    def _plan_gpus(self) -> None:
        """The GPUs of this engine (`ranks`): a `ConfigError` when the worker has fewer than ``tp_size * dp_size``."""
        self.gpu_plan = engine_gpu_plan(self.options, self.device or "cpu")

    # -- lifecycle

    async def start(self) -> None:
        if self._started:
            return
        path = pathlib.Path(self.model_path)
        try:
            self._params = read_safetensors_index(path)
        except (OSError, ValueError, KeyError) as exc:
            raise EngineError(f"sglang engine: cannot read the checkpoint of {path}: {exc}") from exc
        self._fingerprint = model_fingerprint(path)
        self._read_limits(path)
        if self.device is None:
            self.device = "cuda" if cuda_available() else "cpu"
        self._plan_gpus()  # before anything starts: too few GPUs is a configuration error, not an engine failure
        if self.device == "cuda" and self.gpu_plan is not None:
            self.device = self.gpu_plan.devices(0)[0]
        self._died = asyncio.get_running_loop().create_future()
        self._dead = None
        try:
            if self.url is None:
                await self._launch()
            else:
                host, _, port = self.url.removeprefix("http://").rstrip("/").partition(":")
                self._children = [_Child(0, int(port or 80), http=HttpClient(host, int(port or 80), token=self.token),
                                         hop=HopClient(self.options.hop, token=self.token) if "://" in self.options.hop else None)]
            await asyncio.gather(*(self._wait_ready(c) for c in self._children))
            if self.device.startswith("cuda"):
                for dev in dict.fromkeys(d for replica in self.rank_devices() for d in replica):
                    await asyncio.to_thread(init_cuda, dev)  # so the first update does not pay for CUDA init
            await self._post_all("/update_weight_version", {"new_version": str(self.version), "abort_all_requests": False})
            await self._read_model_info()
            if self._takes_images:
                await self._load_vision()
            if self.device.startswith("cuda") and self.weights_readable is not False:
                await self._warm_update()
        except BaseException:
            await self.stop()
            raise
        self._started = True

    async def _warm_update(self) -> None:
        """One `update_weights_from_tensor` of the smallest 1-D parameter with the very values SGLang holds (read
        back with ``get_weights_by_name``: nothing changes), so the first real version does not pay SGLang's first
        update (0.091 s against 0.03 s warm on the 8B-shaped model, H200, 2026-12-04). Best effort: skipped, with a
        log line, where SGLang does not answer a parameter's values (Qwen-family models) or they do not round-trip."""
        ones = [(shape[0], name) for name, (_dtype, shape) in self._params.items() if len(shape) == 1 and 0 < shape[0] <= 65536]
        if not ones:
            return
        n, name = min(ones)
        t0 = time.time()
        try:
            got = await self._post("/get_weights_by_name", {"name": name, "truncate_size": n})
            if not isinstance(got, list) or len(got) != n or not all(isinstance(x, (int, float)) for x in got):
                log.info("sglang engine: no warm-up update (%s not answered as %d numbers)", name, n)
                return
            ranks = await asyncio.to_thread(serialize_ranks, {name: values_tensor(got)}, self.rank_devices(),
                                            per_rank=self.options.per_rank_weights)
            answers = await asyncio.gather(*(self._post("/update_weights_from_tensor", {
                "serialized_named_tensors": list(ranks.payloads[c.replica]), "load_format": None, "flush_cache": False,
                "abort_all_requests": False, "weight_version": str(self.version),
            }, replica=c.replica) for c in self._children))
            del ranks
        except (HttpError, EngineError, ValueError, TypeError) as exc:
            log.info("sglang engine: no warm-up update (%s)", exc)
            return
        res = answers[0] if len(answers) == 1 else answers
        ok = all(isinstance(r, Mapping) and bool(r.get("success")) for r in answers)
        log.info("sglang engine: warm-up update of %s (%d values, the same ones) %s in %.3f s", name, n,
                 "done" if ok else f"refused: {res!r:.200}", time.time() - t0)

    async def _read_model_info(self) -> None:
        """From every replica's ``/model_info``: the grammar backend they run (``none`` where one has none or does not
        say), whether SGLang can read a weight back (``weights_readable``; false where any replica says false) and the
        pixel bounds its image processor resizes within (``image_size``)."""
        try:
            infos = await self._post_all("/model_info", method="GET")
        except HttpError:
            infos = []
        backends = {str(i.get("grammar_backend") or "none") if isinstance(i, Mapping) else "none" for i in infos}
        self.grammar_backend = backends.pop() if len(backends) == 1 else "none"
        for i in infos:
            size = i.get("image_size") if isinstance(i, Mapping) else None
            if isinstance(size, Mapping) and all(isinstance(size.get(k), int) for k in ("shortest_edge", "longest_edge")):
                self._image_bounds = (int(size["shortest_edge"]), int(size["longest_edge"]))
        said = [i.get("weights_readable") for i in infos if isinstance(i, Mapping) and isinstance(i.get("weights_readable"), bool)]
        self.weights_readable = all(said) if said else None
        if self.verify_updates and self.weights_readable is False:
            log.warning("sglang engine: SGLang's model class for %s cannot read a weight back (get_weights_by_name: only "
                        "Llama, OPT, Granite and Exaone4 in SGLang 0.5.14); each version is confirmed by SGLang's success "
                        "answer on every replica alone", self.model_path)

    @property
    def update_check(self) -> str:
        """How a version's arrival in SGLang is confirmed: ``read back`` (``get_weights_by_name`` against what was
        sent), ``sglang answer`` (the model cannot be read back: SGLang's success answer alone) or ``off``
        (``verify_updates=false``)."""
        if not self.verify_updates:
            return "off"
        return "sglang answer" if self.weights_readable is False else "read back"

    def _read_limits(self, path: pathlib.Path) -> None:
        """Vocabulary and context length for the request checks, from the checkpoint's config.json."""
        try:
            cfg = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            cfg = {}
        text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
        self._takes_images = isinstance(cfg.get("vision_config"), dict)
        marks = [cfg.get(k) for k in ("vision_start_token_id", "image_token_id", "vision_end_token_id")]
        self._image_placeholder_ids = [int(t) for t in marks] if self._takes_images and all(isinstance(t, int) for t in marks) else []
        gen_cfg: dict[str, Any] = {}
        with contextlib.suppress(OSError, ValueError):
            gen_cfg = json.loads((path / "generation_config.json").read_text())
        self._eos_ids = set()
        for where in (cfg, text_cfg, gen_cfg if isinstance(gen_cfg, dict) else {}):
            eos = where.get("eos_token_id")  # an int or a list of ints
            self._eos_ids.update(t for t in (eos if isinstance(eos, list) else [eos]) if isinstance(t, int))
        vocab = cfg.get("vocab_size") or text_cfg.get("vocab_size")
        self._vocab = int(vocab) if isinstance(vocab, int) and vocab > 0 else None
        positions = cfg.get("max_position_embeddings") or text_cfg.get("max_position_embeddings")
        ctx = self.options.context_length or (int(positions) if isinstance(positions, int) and positions > 0 else 0)
        self._context_tokens = ctx or None

    def replica_capacity(self, replica: int) -> int:
        """Samples replica `replica` runs at once: the engine's capacity split over its replicas."""
        share, extra = divmod(self.capacity, self.dp_size)
        return share + (1 if replica < extra else 0)

    def command(self, replica: int = 0, port: int | None = None, hop: str = "") -> list[str]:
        """The command line of replica `replica`'s child (the token travels in its environment, `http.TOKEN_ENV`);
        `hop`: the endpoint its per-sample socket binds (`hop`), none without.

        It keeps the worker's ``CUDA_VISIBLE_DEVICES``; its ranks start at ``base_gpu_id`` (`ranks`)."""
        o = self.options
        if o.server_cmd:
            cmd = o.server_cmd.split()
        else:
            kw: dict[str, Any]
            if o.backend == "sim":
                kw = {"capacity": self.replica_capacity(replica), "seed": o.seed, "tp_size": self.tp_size}
            else:
                kw = {"dtype": self.dtype, "mem_fraction_static": o.mem_fraction_static,
                      "max_running_requests": self.replica_capacity(replica), "random_seed": o.seed, "tp_size": self.tp_size}
                if self.gpu_plan is not None:
                    kw["base_gpu_id"] = self.gpu_plan.base_gpu_id(replica)
                if o.context_length:
                    kw["context_length"] = o.context_length
                if o.cuda_graph_max_bs:
                    kw["cuda_graph_max_bs_decode"] = o.cuda_graph_max_bs
            if o.lora:
                kw.update({"enable_lora": True, "max_lora_rank": o.max_lora_rank, "lora_target_modules": list(o.lora_targets()),
                           "max_loras_per_batch": o.max_loras_per_batch or o.lora_resident + 1})
            kw["grammar_backend"] = o.grammar_backend
            kw.update(o.server_kwargs())
            cmd = [self.python, "-m", "rollpool.workers.engines.sglang.server", "--backend", o.backend,
                   "--engine-kwargs", json.dumps(kw)]
            if hop:
                cmd += ["--hop", hop]
            cmd += ["--parent-pid", str(os.getpid())]  # the child ends when this worker is gone, however it went
        return [*cmd, "--model-path", self.model_path, "--host", "127.0.0.1", "--port", str(self.port if port is None else port)]

    def new_token(self) -> str:
        """A fresh token for the next launch, written to the token file (0600) beside the log."""
        self.token = secrets.token_urlsafe(32)
        assert self._log_path is not None
        self.token_path = self._log_path.with_suffix(".token")
        fd = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(self.token)
        return self.token

    async def _launch(self) -> None:
        """One child per data-parallel replica (ports `port`, `port` + 1, ... when `port` is set), one token for all."""
        if not self.port:
            self.port = _free_port()
        log_dir = pathlib.Path(self.options.log_dir or tempfile.mkdtemp(prefix="rollpool-sglang-"))
        log_dir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, at engine start
        ports = [self.port] + [self.port + d if self.options.port else _free_port() for d in range(1, self.dp_size)]
        self._children = [_Child(d, port, log_path=log_dir / f"sglang-{port}.log") for d, port in enumerate(ports)]
        env = {**os.environ, TOKEN_ENV: self.new_token()}
        hop_on = self.options.hop == "auto" and not self.options.server_cmd  # a server_cmd's server need not know --hop
        for c in self._children:
            assert c.log_path is not None
            c.log_fh = c.log_path.open("ab")
            hop = ""
            if hop_on:  # ipc in a directory of its own (mode 0700: only this user can connect)
                c.hop_dir = pathlib.Path(tempfile.mkdtemp(prefix="rollpool-hop-"))
                hop = f"ipc://{c.hop_dir}/sglang-{c.port}"
            cmd = self.command(c.replica, c.port, hop)
            log.info("starting SGLang replica %d: %s (log %s)", c.replica, " ".join(cmd), c.log_path)
            # own session: a scheduler crash kills this tree only, and stop() can end the whole tree
            c.proc = await asyncio.create_subprocess_exec(*cmd, stdout=c.log_fh, stderr=asyncio.subprocess.STDOUT,
                                                          stdin=asyncio.subprocess.DEVNULL, start_new_session=True, env=env)
            c.http = HttpClient("127.0.0.1", c.port, token=self.token)
            if hop:
                c.hop = HopClient(hop, token=self.token)
            c.watch = asyncio.create_task(self._watch_loop(c), name=f"sglang-watch-{c.replica}")

    async def _watch_loop(self, child: _Child) -> None:
        assert child.proc is not None
        rc = await child.proc.wait()
        # one replica (or one rank: SGLang's scheduler crash kills its server's tree) down: the engine restarts whole
        which = f"replica {child.replica} of {self.dp_size}: " if self.dp_size > 1 else ""
        self._mark_dead(f"{which}SGLang server exited with code {rc}{self._log_tail(child)}")

    def _mark_dead(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason
            if reason == "stopped":
                log.debug("sglang engine stopped")
            else:
                log.error("sglang engine dead: %s", reason)
        if self._died is not None and not self._died.done():
            self._died.set_result(reason)
        self._gate.set()  # wake waiters so they see the death

    def _log_tail(self, child: _Child | None = None, n: int = 2000) -> str:
        child = child or (self._children[0] if self._children else None)
        path = child.log_path if child is not None else None
        if path is None or not path.exists():
            return ""
        data = path.read_bytes()[-n:].decode(errors="replace")
        return f"; log tail ({path}):\n{data}"

    async def _wait_ready(self, child: _Child) -> None:
        deadline = time.monotonic() + self.options.start_timeout_s
        assert child.http is not None
        while True:
            self._check()
            try:
                await child.http.request("GET", "/health_generate", timeout_s=30)
                return
            except (TimeoutError, OSError, HttpError) as exc:
                if isinstance(exc, HttpError) and exc.status == 401:
                    raise EngineError(f"the SGLang server at {self.url or self.port} refused our token (api_key)") from exc
            if time.monotonic() > deadline:
                raise EngineError(f"SGLang did not become healthy within {self.options.start_timeout_s:.0f}s{self._log_tail(child)}")
            await asyncio.sleep(0.5)

    async def stop(self) -> None:
        self._mark_dead(self._dead or "stopped")
        children, self._children = self._children, []
        await asyncio.gather(*(self._stop_child(c) for c in children))
        if self.token_path is not None:
            with contextlib.suppress(OSError):
                self.token_path.unlink()  # one small file at stop
            self.token_path = None
        self._started = False

    @staticmethod
    async def _stop_child(c: _Child) -> None:
        proc, c.proc = c.proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 20)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        if proc is not None:
            # the scheduler(s) and detokenizer share the group; make sure none outlives the server
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        if c.watch is not None:
            c.watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await c.watch
            c.watch = None
        if c.http is not None:
            await c.http.close()
            c.http = None
        if c.hop is not None:
            await c.hop.close()
            c.hop = None
        if c.hop_dir is not None:
            shutil.rmtree(c.hop_dir, ignore_errors=True)
            c.hop_dir = None
        if c.log_fh is not None:
            c.log_fh.close()
            c.log_fh = None

    def info(self) -> EngineInfo:
        return EngineInfo(
            name="sglang",
            model=self.model_path,
            capacity=self.capacity,
            apply_modes=SGLANG_APPLY_MODES,
            weight_version=self.version,
            fingerprint=self._fingerprint,
            simulated=self.options.backend == "sim",
            device=self.device or "cuda",
            extra={"dtype": self.dtype, "backend": self.options.backend,
                   "server": self.url or (f"http://127.0.0.1:{self.port}" if self.port else ""),
                   "tp_size": self.tp_size, "dp_size": self.dp_size,
                   "gpus": list(self.gpu_plan.visible[self.gpu_plan.first : self.gpu_plan.first + self.gpu_plan.gpus_needed])
                   if self.gpu_plan is not None else [],
                   "max_context_tokens": self._context_tokens or 0,  # the episode endpoint's context_length_exceeded
                   "lora": self.options.lora, "adapter_versions": sorted(self._adapters), "grammar_backend": self.grammar_backend,
                   "update_check": self.update_check,
                   **({"image_placeholder_ids": self._image_placeholder_ids} if self._image_placeholder_ids else {})},
            images=self._takes_images,
        )

    # -- I/O helpers

    def _check(self) -> None:
        if self._dead is not None:
            raise EngineError(f"sglang engine is not running: {self._dead}")

    async def _post_all(self, path: str, body: Any = None, *, method: str = "POST", timeout_s: float | None = 120.0) -> list[Any]:
        """The same call on every replica, at once; their answers in replica order."""
        return list(await asyncio.gather(*(self._post(path, body, method=method, timeout_s=timeout_s, replica=c.replica)
                                           for c in self._children)))

    async def _post(self, path: str, body: Any = None, *, method: str = "POST", timeout_s: float | None = 120.0,
                    replica: int = 0) -> Any:
        """One HTTP call to replica `replica` that fails with `EngineError` as soon as any replica's server dies."""
        self._check()
        child = self._children[replica] if replica < len(self._children) else None
        client: HttpClient | HopClient | None = None
        if child is not None:
            client = child.hop if child.hop is not None and path in HOP_PATHS else child.http
        assert client is not None and self._died is not None
        # the call runs in this task, and the server's death cancels it (`_DeathWatch`, a callback on `_died`): a task
        # per call raced against `_died` by `asyncio.wait` cost about 11 us of CPU per call. The call still starts on
        # the loop's next pass, as that task's did (`sleep(0)`): the calls of one pass then leave together, and
        # starting each at once cost the worker 1.05x and the child 1.09x the CPU per turn (bench/episodes.py)
        task = asyncio.current_task()
        assert task is not None
        watch, died = _DeathWatch(task), self._died
        died.add_done_callback(watch)
        try:
            try:
                await asyncio.sleep(0)
                return await client.request(method, path, body, timeout_s=timeout_s)
            finally:
                watch.armed = False
                died.remove_done_callback(watch)
        except asyncio.CancelledError:
            if watch.fired and task.uncancel() == 0:  # cancelled by the death alone (not also by this call's caller)
                self._check()
            raise
        except HttpError:
            raise
        except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
            if self._proc is not None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait({self._died}, timeout=1.0)
            self._check()
            raise EngineError(f"sglang engine: {path} failed: {exc!r}") from exc

    # -- generation

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
        return await self._generate(input_ids, n, sampling, request_id, text=text, apply_chat_template=apply_chat_template,
                                    images=images)

    async def generate_constrained(self, input_ids: Sequence[int], n: int, sampling: SamplingParams, request_id: str,
                                   constraint: OutputConstraint) -> GenerateOutput:
        """`generate`, every sample held to `constraint` by SGLang's grammar backend (see the module docstring)."""
        self._check()
        if self.grammar_backend == "none":
            raise RequestRefusedError(
                "constrained decoding (response_format, a forced tool_choice) is not served by the sglang engine here: its "
                "SGLang runs without a grammar backend (grammar_backend none; install xgrammar beside SGLang, or set the "
                "engine option grammar_backend)")
        if sampling.ignore_eos:  # a finished grammar allows only a stop token: ignoring it would leave nothing to sample
            raise RequestRefusedError("ignore_eos cannot be combined with an output constraint")
        from rollpool.workers.engines.grammar import constraint_ebnf

        # SGLang ends a finished grammar only with the model's end-of-sequence: the request's other stop tokens (a chat
        # turn's end-of-turn) become the grammar's last token, so the turn ends as the template renders it
        ends = [t for t in sampling.stop_token_ids if t not in self._eos_ids]
        ebnf = await asyncio.to_thread(constraint_ebnf, constraint, ends, "sglang")
        return await self._generate(input_ids, n, sampling, request_id, ebnf=ebnf)

    async def _generate(
        self,
        input_ids: Sequence[int] | None,
        n: int,
        sampling: SamplingParams,
        request_id: str,
        *,
        text: str | None = None,
        apply_chat_template: bool = False,
        images: Sequence[bytes] = (),
        ebnf: str | None = None,
    ) -> GenerateOutput:
        self._check()
        if not self._started:
            raise EngineError("sglang engine not started")
        check_request(n, sampling, request_id, capacity=self.capacity, running=self._requests, input_ids=input_ids, text=text)
        # token ids as one int64 array (what a list of ints becomes): converted once, checked against the vocabulary
        # in C and sent as it is, where a list was converted, checked element by element and converted again to send;
        # a `TokenIds` brings its array along (the episode made it for its request digest)
        given = input_ids.array if type(input_ids) is TokenIds and not images else None
        ids = given if given is not None else np.asarray(input_ids) if input_ids is not None and not images else None
        if given is not None:  # not to be changed (`TokenIds`): held and handed back as it is, not copied
            prompt = cast(list[int], input_ids)
        elif ids is not None and ids.ndim == 1 and ids.dtype == np.int64:
            prompt = ids.tolist()
        else:
            ids = None
            prompt = await self._tokenize(input_ids, text, apply_chat_template)
        reported, grid = prompt, None
        if images:
            prompt, reported, grid = await self._image_prompt(prompt, images)
        check_prompt(reported, sampling, vocab=self._vocab if ids is None else None, context_tokens=self._context_tokens)
        # the bounds a `TokenIds` knows, else one pass (a negative id read as unsigned is past any vocabulary)
        bounds = input_ids.bounds if given is not None and type(input_ids) is TokenIds else None
        if ids is not None and self._vocab is not None and ids.size and (
                bounds[0] < 0 or bounds[1] >= self._vocab if bounds is not None else int(ids.view(np.uint64).max()) >= self._vocab):
            raise RequestRefusedError(f"prompt token ids must be in [0, {self._vocab})")  # check_prompt's own check
        if ids is not None and self._vocab is not None and self._vocab <= _INT32_IDS:
            # within the vocabulary, so int32: what the hop sends, without checking them again (a `TokenIds` has them so)
            ids = input_ids.int32() if given is not None and type(input_ids) is TokenIds else ids.astype("<i4")
        if request_id in self._requests:  # the tokenizer awaited: check again
            raise RequestRefusedError(f"request id {request_id!r} is already running")
        self._counter += 1
        # the whole group on one replica (its prefix cache serves all n), the one with the fewest samples assigned
        child = min(self._children, key=lambda c: (c.running, c.replica))
        req = _Request(request_id, self._counter, prompt, sampling, [_Sample(i) for i in range(n)], replica=child.replica,
                       images=tuple(images), expanded_tokens=len(reported) if images else 0, ebnf=ebnf, ids=ids)
        self._requests[request_id] = req
        child.running += n
        started = time.time()
        try:
            if n == 1:  # an episode's turn: no task and gathering future for one sample
                await self._run_sample(req, req.samples[0])
            else:
                await asyncio.gather(*(self._run_sample(req, s) for s in req.samples))
        except BaseException:
            req.aborted = True
            with contextlib.suppress(Exception):
                await self._abort_rids([s.rid for s in req.samples if s.rid], req.replica)
            raise
        finally:
            child.running -= n
            self._requests.pop(request_id, None)
        samples = [
            SampleOutput(index=s.index, output_ids=s.out, logprobs=s.logprobs, token_versions=s.versions,
                         finish_reason=s.finish or FinishReason.ABORT, output_text="".join(s.texts) if s.texts else None,
                         matched_stop=s.matched, first_token_at=s.first_token_at or started,
                         finished_at=max(s.finished_at, s.first_token_at or started), cached_tokens=s.cached_tokens)
            for s in req.samples
        ]
        return GenerateOutput(request_id, reported if given is not None else list(reported), samples, started, simulated=self.options.backend == "sim",
                              image_grid_thw=grid)

    def _load_vision_spec(self) -> VisionSpec | None:
        """The checkpoint's vision spec, its grids computed within SGLang's own pixel bounds where the child said them
        (SGLang 0.5.14 loads a Qwen2-VL processor with ``size`` 3136..1003520 pixels whatever the checkpoint's
        ``size`` says, unless it names ``min_pixels``/``max_pixels``; the worker must expand images as SGLang does)."""
        spec = load_vision_spec(self.model_path)
        if spec is not None and self._image_bounds is not None:
            spec = replace(spec, bounds=self._image_bounds)
        return spec

    async def _vision_spec(self) -> VisionSpec | None:
        """The vision spec, loaded once (concurrent first callers wait for the one load)."""
        async with self._load_lock:
            if self._vision is None:
                self._vision = await asyncio.to_thread(self._load_vision_spec)
        return self._vision

    async def _load_vision(self) -> None:
        """The image processor, loaded at start so the first batch of image prompts does not wait for it (transformers'
        image-processing imports take seconds on a GPU host; on an H100 the pool's cold first batch reached SGLang 7.4 s
        after submit). One that fails to load here is loaded again by the first image prompt, which then fails with
        the reason."""
        try:
            await self._vision_spec()
        except Exception as exc:  # noqa: BLE001 - not fatal at start: said, and the first image prompt says it again
            log.warning("sglang engine: the image processor of %s did not load at start: %s: %s", self.model_path,
                        type(exc).__name__, exc)

    async def _image_prompt(self, prompt: list[int], images: Sequence[bytes]) -> tuple[list[int], list[int], list[int]]:
        """(the ids sent: one image token per image; the ids the model runs: expanded; the patch grids, flat)."""
        if not self._takes_images:
            raise RequestRefusedError(f"the model at {self.model_path} takes no images (not a vision-language model)")
        spec = await self._vision_spec()
        assert spec is not None  # the config has a vision tower
        # the grids only (SGLang preprocesses the pixels itself): from each image's size, no second decode and no
        # pixel arrays made here (the processor run whole cost the pool about a quarter of direct SGLang's rate with
        # one 224 px image per prompt on an H100). A header read is cheaper than a thread hop and runs here: in the
        # thread pool it queued behind every other prompt's image checks, so a batch's first prompt reached SGLang
        # only once the last prompt's images were decoded
        grids = spec.grids_of(images) if spec.grids_from_headers else await asyncio.to_thread(spec.grids_of, images)
        return spec.placeholders(prompt, len(images)), spec.expand(prompt, grids), [x for g in grids for x in g]

    def _check_image_expansion(self, req: _Request, s: _Sample, parsed: ParsedSample) -> None:
        """`RequestRefusedError` when SGLang ran an image prompt (plus the sample's output so far) at another length
        than the worker expanded it to: the ids reported would not be the ids the model ran, so they are never
        delivered."""
        want = req.expanded_tokens + len(s.out)
        if not req.images or parsed.prompt_tokens is None or parsed.prompt_tokens == want:
            return
        processor = type(self._vision.processor).__name__ if self._vision is not None else "none loaded"
        raise RequestRefusedError(
            f"sglang engine: SGLang ran this image prompt as {parsed.prompt_tokens} tokens, the worker expands it to {want}: "
            f"SGLang's image processor and the worker's ({processor}) disagree on the images' patch grids (read from the "
            "model's preprocessor_config.json); the reported ids would not be the ids the model ran")

    def _media_in_output(self, req: _Request, s: _Sample, parsed: ParsedSample) -> bool:
        """Whether an image prompt's sample holds (so far, this attempt included) a token SGLang reads as a media slot."""
        spec = self._vision
        return bool(req.images) and spec is not None and (spec.holds_media_tokens(s.out) or spec.holds_media_tokens(parsed.output_ids))

    def _image_data(self, req: _Request) -> list[bytes] | list[str] | None:
        """The request's images as its replica's ``/generate`` takes them: the bytes themselves over the hop (its own
        frames: no base64 made here, no base64 in the JSON, none decoded by SGLang), base64 data URIs over HTTP."""
        if not req.images:
            return None
        child = self._children[req.replica] if req.replica < len(self._children) else None
        if child is not None and child.hop is not None and "/generate" in HOP_PATHS:
            return list(req.images)
        if req.image_uris is None:
            req.image_uris = [("data:image/png;base64," if b.startswith(b"\x89PNG") else "data:image/jpeg;base64,")
                              + base64.b64encode(b).decode() for b in req.images]
        return req.image_uris

    async def _run_sample(self, req: _Request, s: _Sample) -> None:
        sp = req.sampling
        while True:
            while not self._gate.is_set():
                await self._gate.wait()
            self._check()
            remaining = sp.max_new_tokens - len(s.out)
            if req.aborted or remaining <= 0:
                s.finish = s.finish or (FinishReason.ABORT if req.aborted else FinishReason.LENGTH)
                s.finished_at = time.time()
                return
            if s.attempt == 0 and self._adapters:
                # the newest adapter version, to this sample's end (or until a whole-model version moves it)
                s.adapter, s.tag = max(self._adapters), self.version
            s.rid = sample_rid(self._tag, req.number, s.index, s.attempt)
            s.attempt += 1
            if req.ids is None:
                req.ids = np.asarray(req.input_ids, dtype=np.int64)
            ids = np.concatenate([req.ids, np.asarray(s.out, dtype=np.int64)]) if s.out else req.ids
            body = generate_body(ids, sp, rid=s.rid, index=s.index, max_new_tokens=remaining, image_data=self._image_data(req),
                                 ebnf=req.ebnf)
            if s.adapter is not None:
                name = self._adapters.get(s.adapter)
                if name is None:  # eviction skips versions a sample names: reaching here is a bookkeeping bug
                    raise EngineError(f"sglang engine: adapter version {s.adapter} of a running sample is not loaded")
                body["lora_path"] = name
            version_at_send = self.version
            self._in_sglang += 1
            self._idle.clear()
            self.stats["attempts"] += 1
            sent_at = time.time()
            try:
                resp = await self._post("/generate", body, timeout_s=self.options.request_timeout_s, replica=req.replica)
            except HttpError as exc:
                if req.ebnf is not None and exc.status == 400:  # SGLang's grammar backend refused the grammar
                    raise RequestRefusedError(f"sglang engine: the grammar backend refused the output constraint: {exc}") from exc
                # the request passed rollpool's checks: a refusal now is the engine's fault, not the prompt's
                raise EngineError(f"sglang engine: /generate failed on a request that passed the checks: {exc}") from exc
            finally:
                s.rid = None
                self._in_sglang -= 1
                if self._in_sglang == 0:
                    self._idle.set()
            parsed = parse_generate_response(resp)
            self._check_image_expansion(req, s, parsed)
            resubmit = parsed.finish_reason == FinishReason.ABORT and parsed.aborted_by_request and not req.aborted
            if resubmit and (req.ebnf is not None or self._media_in_output(req, s, parsed)):
                # a grammar starts at the beginning of the output; an image prompt's output holding an image or video
                # token cannot go on (sent back, SGLang matches it to media the request lacks and fails the request:
                # "No data iterator found for token: <|video_pad|>" on an H100): the sample starts over from its prompt
                s.out, s.logprobs, s.versions, s.texts, s.first_token_at = [], [], [], [], 0.0
                self.stats["restarts"] += 1
                continue
            self._append(s, parsed, version_at_send, sent_at, adapter=None if s.adapter is None else s.tag)
            if resubmit:
                self.stats["resubmits"] += 1
                continue  # interrupted by a weight update (or by someone else's abort_all): go on from here
            s.finish, s.matched, s.finished_at = parsed.finish_reason, parsed.matched_stop, time.time()
            return

    def _append(self, s: _Sample, p: ParsedSample, version_at_send: int, sent_at: float, adapter: int | None = None) -> None:
        """`adapter`: the version the attempt's tokens carry when it ran on an adapter (SGLang's label is the base's)."""
        version = parse_weight_version(p.weight_version) if adapter is None else adapter
        if version is None:
            version = version_at_send
        elif version != version_at_send and p.output_ids:
            # an attempt sent just before a pause can wait inside SGLang and run after the update: SGLang's label wins
            self.stats["version_mismatches"] += 1
            log.debug("sample %s: sent at version %d, SGLang says %d", p.rid, version_at_send, version)
        if p.output_ids and not s.first_token_at:
            s.first_token_at = sent_at
        if s.cached_tokens is None:
            s.cached_tokens = p.cached_tokens
        s.out.extend(p.output_ids)
        s.logprobs.extend(p.logprobs)
        s.versions.extend([version] * len(p.output_ids))
        if p.text:
            s.texts.append(p.text)

    async def _tokenize(self, input_ids: Sequence[int] | None, text: str | None, chat: bool) -> list[int]:
        if input_ids is not None:
            arr = np.asarray(input_ids)
            if arr.ndim == 1 and arr.dtype.kind in "iu":  # a list of ints: one C pass each way, not int() on each
                return list(arr.tolist())
            return list(map(int, input_ids))
        assert text is not None  # check_request saw to it
        async with self._load_lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, self.model_path)
        tok = self._tokenizer
        if chat:
            if not getattr(tok, "chat_template", None):
                raise RequestRefusedError("apply_chat_template asked for, but the tokenizer has no chat template")
            rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
            return list(tok(rendered, add_special_tokens=False)["input_ids"])
        return list(tok(text)["input_ids"])

    async def abort(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is None or self._dead is not None:
            return
        req.aborted = True
        # a rid SGLang has not registered yet ignores the abort: repeat until every sample has come back
        for _ in range(100):
            rids = [s.rid for s in req.samples if s.rid]
            if not rids or self._dead is not None:
                return
            await self._abort_rids(rids, req.replica)
            await asyncio.sleep(0.05)

    async def _abort_rids(self, rids: Sequence[str], replica: int) -> None:
        await asyncio.gather(*(self._post("/abort_request", {"rid": r, "abort_all": False}, timeout_s=30, replica=replica)
                               for r in rids))

    # -- weight updates

    async def pause(self, mode: str) -> None:
        if mode == ApplyMode.IN_PLACE:
            raise EngineError(_IN_PLACE_REFUSED)
        if mode not in SGLANG_APPLY_MODES:
            raise EngineError(f"apply mode must be one of {SGLANG_APPLY_MODES}, got {mode!r}")
        self._check()
        self._pause_started = time.time()
        self._gate.clear()
        self._mode = mode
        if mode == ApplyMode.INTERRUPT:
            # our own abort_all + wait: pause_generation(abort) alone polls once a second
            deadline = time.monotonic() + 120
            while not self._idle.is_set():
                held = self._constrained_in_sglang()
                if not held:
                    await self._post_all("/abort_request", {"rid": "", "abort_all": True}, timeout_s=30)
                else:  # a constrained sample cannot resume mid-grammar: abort the others one by one, let it finish
                    for replica, rids in self._unconstrained_rids().items():
                        await self._abort_rids(rids, replica)
                    deadline = time.monotonic() + 120
                with contextlib.suppress(asyncio.TimeoutError):
                    # a request still on its way into SGLang misses an abort_all: ask again soon
                    await asyncio.wait_for(self._idle.wait(), 0.05)
                self._check()
                if time.monotonic() > deadline:
                    raise EngineError("sglang engine: running samples did not return within 120 s of abort_all")
            # SGLang holds nothing of ours now and the gate keeps it so: no pause_generation (see the module docstring)
        else:
            assert self._died is not None
            while not self._idle.is_set():
                idle: asyncio.Future[Any] = asyncio.ensure_future(self._idle.wait())
                died: asyncio.Future[Any] = self._died
                try:
                    await asyncio.wait({idle, died}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    idle.cancel()
                self._check()
        self.last_update = {"pause_s": time.time() - self._pause_started}

    def _constrained_in_sglang(self) -> bool:
        return any(s.rid for r in self._requests.values() if r.ebnf is not None for s in r.samples)

    def _unconstrained_rids(self) -> dict[int, list[str]]:
        """Per replica, the rids of the unconstrained samples now in SGLang."""
        out: dict[int, list[str]] = {}
        for r in self._requests.values():
            if r.ebnf is None:
                rids = [s.rid for s in r.samples if s.rid]
                if rids:
                    out.setdefault(r.replica, []).extend(rids)
        return out

    async def resume(self) -> None:
        t0 = time.time()
        self._mode = None
        self._gate.set()
        now = time.time()
        self.last_update["resume_s"] = now - t0
        self.last_update["applied_at"] = now
        # from the pause's start until samples may be sent again: how long this engine generated nothing
        self.last_update["stopped_s"] = now - self._pause_started if self._pause_started else 0.0
        if "update_started_at" in self.last_update:
            log.info("sglang apply %s", json.dumps({"version": self.version, **self.last_update}))

    def _check_names(self, named_tensors: Mapping[str, Any]) -> list[str]:
        names = list(named_tensors)
        for name in names:
            known = self._params.get(name)
            if known is None:
                raise WeightsRefusedError(f"update_weights: unknown parameter {name!r} (SGLang would only warn and change nothing)")
            shape = tuple(int(x) for x in named_tensors[name].shape)
            if shape != known[1]:
                raise WeightsRefusedError(f"update_weights: {name} has shape {shape}, the model has {known[1]}")
        return names

    async def _to_ranks(self, named_tensors: Mapping[str, Any], version: int | None = None) -> RankPayloads:
        """The version as one payload per rank of every replica (`tensors.serialize_ranks`), in a thread."""
        stagers, self._stagers = self._stagers, {}
        if any(st.version != version for st in stagers.values()):
            stagers = {}
        return await asyncio.to_thread(serialize_ranks, named_tensors, self.rank_devices(),
                                       per_rank=self.options.per_rank_weights, staged=stagers)

    def weight_bytes(self) -> int:
        """Bytes of one weight version for this engine: its checkpoint's parameters in its dtype, plus the embedding
        again when the checkpoint leaves out a tied ``lm_head.weight`` (a trainer's state dict carries it under both
        names); 0 before `start`."""
        params = dict(self._params)
        embed = params.get("model.embed_tokens.weight")
        if embed is not None and "lm_head.weight" not in params:
            params["lm_head.weight"] = embed
        return version_bytes(params, self.dtype)

    def note_fetch(self, version: int, details: Mapping[str, Any]) -> None:
        """How `version` was fetched (the subscriber's ``weights fetched`` details): its apply record says where a delta
        was rebuilt (``delta_rebuilt_on``) and the GPU's seconds for it (``delta_device_rebuild_s``)."""
        keep = {"delta_rebuilt_on": details.get("delta_rebuilt_on"), "delta_device_rebuild_s": details.get("device_rebuild_s"),
                "delta_base": details.get("delta_base"), "why_not_delta_on_device": details.get("why_not_delta_on_device") or None}
        self._fetch_notes = (version, {k: v for k, v in keep.items() if v is not None})

    def stage_bucket(self, version: int, named_tensors: Mapping[str, Any]) -> None:
        """One verified bucket of `version` (the fetch's ``on_bucket``, on the loop): its copy to the device is queued
        at once on a side stream, so it overlaps the fetch of the next bucket; with ``per_rank_weights`` and several
        ranks, one copy per rank GPU, each on that GPU's side stream. `stage_weights` then only copies what is missing
        and synchronises. A no-op off CUDA."""
        if not (self.device or "").startswith("cuda"):
            return
        devices = [self.rank_devices()[0][0]]
        if self.options.per_rank_weights:
            devices = list(dict.fromkeys(d for replica in self.rank_devices() for d in replica))
        for dev in devices:
            stager = self._stagers.get(dev)
            if stager is None or stager.version != version:
                stager = self._stagers[dev] = BucketStager(version, dev)
            stager.add(named_tensors)

    async def stage_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        """Copy a fetched version onto the GPU(s) while generation goes on, so the pause only swaps it in.

        Holds one extra copy of the weights in GPU memory (outside SGLang's
        `mem_fraction_static`) until `update_weights(..., version)` consumes
        it or another version is staged: on rank 0's GPU, or, with
        ``per_rank_weights`` and ``tp_size > 1``, on every rank's GPU. With
        deltas rebuilt on the GPU (`WeightPathConfig.weight_delta_on_device`)
        that copy on rank 0's GPU is the subscriber's, made as each bucket
        verified and kept after the update as the next delta's base: the
        tensors given here are already on the device and are mapped as they
        are (the same 1 x the model's bytes, kept between versions; other
        ranks' copies are made and dropped as before). Names and shapes are
        checked here too, so a bad version fails before anything pauses.
        """
        self._check()
        names = self._check_names(named_tensors)
        self._staged = None
        if not names:
            return
        t0 = time.time()
        early = sum(len(st.placed) for st in self._stagers.values() if st.version == version)
        started = min((st.started_at for st in self._stagers.values() if st.version == version), default=t0) if early else t0
        ranks = await self._to_ranks(named_tensors, version)
        self._staged = _Staged(version, tuple(names), ranks, started, ranks.h2d_s, time.time() - t0, early)

    async def update_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        """Apply `version` on every rank of every replica, or fail: one payload per TP rank through each replica's
        ``update_weights_from_tensor`` (rank r reads entry r), all tagged ``weight_version=str(version)``. Any
        refusal, or a replica that dies, raises `EngineError`; the worker then restarts the engine whole and gives
        it the whole version, so no rank ever serves a version the others do not have."""
        self._check()
        if not self._idle.is_set():
            raise EngineError("sglang engine: update_weights while samples run in SGLang; call pause() first")
        t0 = time.time()
        names = self._check_names(named_tensors)
        staged, self._staged = self._staged, None
        if not names:
            await self._post_all("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
            self.version = version
            await self._keep_adapter_on_new_base()
            return
        if staged is not None and staged.version == version and staged.names == tuple(names):
            ranks, h2d_s = staged.payloads, 0.0
            self.last_update.update({"staged": 1.0, "stage_started_at": staged.started_at, "stage_h2d_s": staged.h2d_s,
                                     "stage_s": staged.stage_s, "staged_by_bucket": float(staged.by_bucket)})
        else:
            ranks = await self._to_ranks(named_tensors)
            h2d_s = ranks.h2d_s
            self.last_update["staged"] = 0.0
        t1 = time.time()

        async def one(replica: int) -> None:
            try:
                res = await self._post("/update_weights_from_tensor", {
                    "serialized_named_tensors": list(ranks.payloads[replica]), "load_format": None, "flush_cache": True,
                    "abort_all_requests": False, "weight_version": str(version),
                }, timeout_s=600, replica=replica)
            except HttpError as exc:
                raise EngineError(f"update_weights: SGLang{self._which(replica)} refused version {version}: {exc}") from exc
            if not isinstance(res, Mapping) or not res.get("success"):
                raise EngineError(f"update_weights: SGLang{self._which(replica)} reports failure for version {version}: {res!r}")

        try:
            await asyncio.gather(*(one(c.replica) for c in self._children))
        finally:
            t2 = time.time()
        verify_s = 0.0
        if self.update_check == "read back":
            t3 = time.time()
            for c in self._children:
                await self._verify(ranks.first(), names, c.replica)
            verify_s = time.time() - t3
        self.version = version
        await self._keep_adapter_on_new_base()
        notes, self._fetch_notes = self._fetch_notes, None
        if notes is not None and notes[0] == version:
            self.last_update.update(notes[1])
        self.last_update.update({"update_started_at": t0, "h2d_s": h2d_s, "serialize_s": t1 - t0 - h2d_s,
                                 "sglang_update_s": t2 - t1, "verify_s": verify_s, "ranks": float(self.tp_size * self.dp_size),
                                 "bytes": float(sum(nbytes(t) for t in named_tensors.values()))})

    def _which(self, replica: int) -> str:
        return f" (replica {replica} of {self.dp_size})" if self.dp_size > 1 else ""

    async def _verify(self, sent: Mapping[str, Any], names: Sequence[str], replica: int = 0) -> None:
        """SGLang answers ``get_weights_by_name`` from TP rank 0 (row-parallel weights gathered): the leading row of
        each picked name is on rank 0 whatever the sharding, so one replica's answer is checked against what was sent."""
        shapes = {n: self._params[n][1] for n in names}
        picks = pick_verify_names(names, shapes)
        if not picks:
            raise EngineError("update_weights: none of the updated names can be checked with get_weights_by_name; "
                              "pass verify_updates=false to accept unconfirmed updates")
        for name in picks:
            row = await self._leading_values(name, replica)
            if row is None and len(shapes[name]) == 1:
                # a norm weight SGLang does not answer: fall back to the (slower) 2-D projections
                two_d = [n for n in names if len(shapes[n]) == 2]
                if pick_verify_names(two_d, shapes):
                    await self._verify(sent, two_d, replica)
                    return
            want = leading(sent[name])
            if row is None or len(row) != len(want):
                raise EngineError(f"update_weights: get_weights_by_name({name}){self._which(replica)} gave {row!s:.200}; "
                                  "cannot confirm the update")
            bad = sum(1 for a, b in zip(row, want, strict=True) if abs(float(a) - b) > 1e-2 * max(1.0, abs(b)))
            if bad:
                raise EngineError(f"update_weights: {name} did not land in SGLang{self._which(replica)} "
                                  f"({bad} of {len(want)} leading values differ)")

    async def _leading_values(self, name: str, replica: int = 0) -> list[Any] | None:
        """SGLang's first row (2-D) or first element (1-D) of `name`, or None when the answer is not a list of numbers."""
        try:
            got = await self._post("/get_weights_by_name", {"name": name, "truncate_size": 1}, replica=replica)
        except HttpError as exc:
            raise EngineError(f"update_weights: cannot confirm {name} landed: {exc}") from exc
        row = got[0] if isinstance(got, list) and got and isinstance(got[0], list) else got
        if not isinstance(row, list) or not all(isinstance(x, (int, float)) for x in row):
            return None
        return row

    # -- LoRA adapter versions

    def adapter_versions(self) -> list[int]:
        """The adapter versions loaded (oldest first)."""
        return sorted(self._adapters)

    async def update_adapter(self, named_tensors: Mapping[str, Any], spec: AdapterSpec, version: int) -> None:
        """Load adapter `version` into every replica, new samples run on it (module docstring); `WeightsRefusedError`,
        nothing changed, for an adapter of another base or one this engine cannot serve."""
        self._check()
        if not self.options.lora:
            raise WeightsRefusedError(f"adapter version {version}: this sglang engine was started without LoRA "
                                      "(engine option lora=true starts SGLang with enable_lora)")
        if spec.base_fingerprint and self._fingerprint and spec.base_fingerprint != self._fingerprint:
            raise WeightsRefusedError(
                f"adapter version {version} applies to base {spec.base_model or '?'} (fingerprint {spec.base_fingerprint}); "
                f"this engine serves {self.model_path} (fingerprint {self._fingerprint})")
        async with self._adapter_lock:
            if self._adapters and version <= max(self._adapters):
                raise WeightsRefusedError(f"adapter version {version} is not newer than the adapter version served, {max(self._adapters)}")
            pairs = check_adapter(named_tensors, spec, version, params=self._params, targets=self.options.lora_targets(),
                                  max_rank=self.options.max_lora_rank)
            t0 = time.time()
            name = f"rollpool-{self._tag}-{self.port}-v{version}"
            root = adapter_root(self.options.lora_dir)
            path = await asyncio.to_thread(write_adapter, root, name, pairs, spec, self.dtype)
            t1 = time.time()
            try:
                answers = await asyncio.gather(*(self._load_adapter(name, path, c.replica) for c in self._children),
                                               return_exceptions=True)
            finally:
                # SGLang holds the adapter in its own memory once loaded; the directory is not read again
                await asyncio.to_thread(_remove_tree, path)
            failed = [a for a in answers if isinstance(a, BaseException)]
            if failed:
                loaded = [c.replica for c, a in zip(self._children, answers, strict=True) if not isinstance(a, BaseException)]
                for replica in loaded:  # refused somewhere: loaded nowhere
                    with contextlib.suppress(HttpError, EngineError):
                        await self._post("/unload_lora_adapter", {"lora_name": name}, replica=replica)
                first = failed[0]
                if isinstance(first, WeightsRefusedError | EngineError):
                    raise first
                raise EngineError(f"sglang engine: loading adapter version {version} failed: {first!r}") from first
            self._adapters[version] = name
            self.version = version
            self.last_update = {"update_started_at": t0, "write_s": t1 - t0, "sglang_load_s": time.time() - t1,
                                "bytes": float(sum(nbytes(a) + nbytes(b) for a, b in pairs.values())), "applied_at": time.time()}
            await self._evict_adapters()
            log.info("sglang adapter apply %s", json.dumps({"version": version, **self.last_update}))

    async def _load_adapter(self, name: str, path: pathlib.Path, replica: int) -> None:
        try:
            res = await self._post("/load_lora_adapter", {"lora_name": name, "lora_path": str(path), "pinned": False},
                                   timeout_s=600, replica=replica)
        except HttpError as exc:
            # checked ahead, so SGLang refusing it loaded nothing; the engine serves on
            raise WeightsRefusedError(f"SGLang{self._which(replica)} refused adapter {name}: {exc}") from exc
        if not isinstance(res, Mapping) or not res.get("success"):
            raise WeightsRefusedError(f"SGLang{self._which(replica)} refused adapter {name}: {res!r:.300}")

    def _pinned_adapters(self) -> set[int]:
        return {s.adapter for req in self._requests.values() for s in req.samples if s.adapter is not None and s.finish is None}

    async def _evict_adapters(self) -> None:
        """Unload the oldest adapter versions beyond ``lora_resident``, never one a running sample names."""
        pinned = self._pinned_adapters()
        for version in sorted(self._adapters)[: -self.options.lora_resident]:
            if version in pinned:
                continue
            name = self._adapters.pop(version)
            await self._unload_everywhere(name)

    async def _keep_adapter_on_new_base(self) -> None:
        """A whole-model version was applied (no sample is in SGLang): the newest adapter version stays on, on top of
        the new base, as SGLang keeps it (its update writes the base weights in place and leaves loaded adapters as
        they were). Every unfinished sample that began moves to it, its later tokens tagged with the new version (the
        policy of that version: the new base plus that adapter); older adapter versions are unloaded, as nothing can
        name them any more."""
        latest = max(self._adapters) if self._adapters else None
        for req in self._requests.values():
            for s in req.samples:
                if s.attempt and s.finish is None:
                    s.adapter, s.tag = latest, self.version
        for version in [v for v in self._adapters if v != latest]:
            await self._unload_everywhere(self._adapters.pop(version))

    async def _unload_everywhere(self, name: str) -> None:
        for c in self._children:
            try:
                await self._post("/unload_lora_adapter", {"lora_name": name}, replica=c.replica)
            except HttpError as exc:  # not loaded there: nothing to free
                log.warning("sglang engine: unloading adapter %s%s: %s", name, self._which(c.replica), exc)

    # -- memory and cache

    async def release_memory(self, tags: Sequence[str] = ()) -> None:
        wanted = tuple(tags) or ("weights", "kv_cache", "cuda_graph")
        # SGLang asserts it is idle on release (a crash otherwise): stop intake and let running samples finish
        self._gate.clear()
        await self._idle.wait()
        await self._post_all("/release_memory_occupation", {"tags": list(wanted)})
        self._released |= set(wanted)

    async def resume_memory(self, tags: Sequence[str] = ()) -> None:
        wanted = [t for t in (tuple(tags) or ("weights", "kv_cache", "cuda_graph")) if t in self._released]
        if wanted:  # resuming a tag that was not released is a KeyError inside SGLang's scheduler
            await self._post_all("/resume_memory_occupation", {"tags": wanted})
            self._released -= set(wanted)
        if not self._released and self._mode is None:
            self._gate.set()

    async def flush_cache(self) -> None:
        with contextlib.suppress(HttpError):  # refused while busy: not an error (SGLang flushes only when idle)
            await self._post_all("/flush_cache", method="GET")


def _remove_tree(path: pathlib.Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def ENGINE_FACTORY(**options: Any) -> SGLangEngine:  # the registry's well-known name
    return SGLangEngine(options_from(SGLangOptions, options))
