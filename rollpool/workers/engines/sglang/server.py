"""The child process of the `sglang` engine: SGLang's HTTP routes on loopback, over an engine-shaped backend.

``python -m rollpool.workers.engines.sglang.server --model-path M --port P [--backend sglang|sim] --engine-kwargs JSON``,
with the per-launch token in ``ROLLPOOL_SGLANG_TOKEN`` (`http.TOKEN_ENV`).

This is the only module of rollpool that imports sglang, and only for the
``sglang`` backend. Both backends serve the same routes with SGLang 0.5.14's
names, bodies and answers (the subset rollpool uses):

- ``sglang``: an in-process ``sglang.Engine`` (its scheduler and detokenizer
  are this process's children, so a scheduler crash, which SIGKILLs the whole
  tree, takes only this child down; API notes fact 6). The routes call the
  Engine's tokenizer manager the way SGLang's own HTTP server does; a
  ``/generate`` body's ``image_data`` reaches ``async_generate`` as sent.
- ``sim``: the `sim` engine, with answers shaped like SGLang's (the keys and
  types of tests/fixtures/sglang, recorded on the H200; a test compares them).
  It takes ``image_data`` and runs no vision tower (the images change nothing it samples).
  Weights sent by value from a CPU worker are kept, so ``get_weights_by_name``
  answers with what was sent. It lets the real `SGLangEngine` code (launch,
  HTTP, interrupt-and-resubmit, per-attempt versions, death detection) run the
  engine contract on a CPU. With ``tp_size`` > 1 it pretends to be that many
  tensor-parallel ranks, as SGLang's update sees them: the update takes exactly
  one payload per rank (rank r reads entry r), every rank decodes its own, and
  the version lands on every rank or on none; each rank has a stand-in process
  (``sleep``, dying with the server), and when one exits the server kills the
  rest and exits, as a crashing SGLang scheduler takes its server down.
  ``rank_refuses: [rank, version]`` (an engine keyword) makes that rank refuse
  that version: the fault a test needs, applied before any rank changes.
  LoRA (``enable_lora`` and SGLang's other LoRA keywords): `SimLora`, a fake of SGLang's adapter serving.
  Grammars (``grammar_backend``): `SimGrammar`, a fake of SGLang's grammar backend.
  ``chat_sampling: true`` (an engine keyword; the sglang engine's ``server_args``): sample as a chat model does,
  no special token of the model's tokenizer inside a turn and a stop on the end-of-turn (`SimOptions.special_ids`).

Both report the grammar backend they run in ``/model_info`` (``grammar_backend``; ``auto`` resolves to
``xgrammar`` when the child can import it, else ``none``), and refuse an ``ebnf`` request without one with 400.

A route answers 400 only for a request body that fails an explicit check
(`BadRequest`); anything else raised is a 500 (see `http`).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollpool.protocol.messages import FinishReason, SamplingParams
from rollpool.workers.engines.sglang.hop import serve_hop
from rollpool.workers.engines.sglang.http import TOKEN_ENV, BadRequest, Route, serve_routes

log = logging.getLogger(__name__)

__all__ = ["SimGrammar", "SimLora", "SimRanks", "resolve_grammar_backend", "sglang_routes", "sim_routes", "serve_main"]

_SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "ignore_eos", "stop_token_ids", "stop", "sampling_seed",
                  "ebnf"}
_NO_GRAMMAR = ("Grammar-based generation (json_schema, regex, ebnf, structural_tag) is not supported when the server is "
               "launched with --grammar-backend none")
"""SGLang 0.5.14's refusal of a grammar without a grammar backend."""


def resolve_grammar_backend(name: str) -> str:
    """``auto``: ``xgrammar`` when this process can import it, else ``none``; any other name as given."""
    if name != "auto":
        return name
    import importlib.util

    return "xgrammar" if importlib.util.find_spec("xgrammar") is not None else "none"


def _need(body: dict[str, Any], key: str) -> Any:
    if key not in body:
        raise BadRequest(f"missing field {key!r}")
    return body[key]


# --------------------------------------------------------------------------- the real SGLang


def sglang_routes(engine: Any) -> dict[str, Route]:  # noqa: C901 - grandfathered: one handler per route
    """SGLang's HTTP routes on an in-process ``sglang.Engine``."""
    from sglang.srt.managers import io_struct as io

    tm = engine.tokenizer_manager

    async def generate(b: dict[str, Any]) -> tuple[int, Any]:
        sp = b.get("sampling_params")
        try:
            out = await engine.async_generate(input_ids=_need(b, "input_ids"), sampling_params=sp,
                                              return_logprob=bool(b.get("return_logprob")), rid=b.get("rid"),
                                              lora_path=b.get("lora_path"), image_data=b.get("image_data"))
        except ValueError as exc:
            if isinstance(sp, dict) and sp.get("ebnf") is not None:  # SGLang refuses a grammar it cannot hold this way
                raise BadRequest(str(exc)) from exc
            raise
        return 200, out

    async def load_lora_adapter(b: dict[str, Any]) -> tuple[int, Any]:
        res = await tm.load_lora_adapter(io.LoadLoRAAdapterReqInput(lora_name=str(_need(b, "lora_name")), lora_path=str(_need(b, "lora_path")),
                                                                    pinned=bool(b.get("pinned", False))), None)
        return (200 if res.success else 400), {"success": bool(res.success), "error_message": res.error_message}

    async def unload_lora_adapter(b: dict[str, Any]) -> tuple[int, Any]:
        res = await tm.unload_lora_adapter(io.UnloadLoRAAdapterReqInput(lora_name=str(_need(b, "lora_name"))), None)
        return (200 if res.success else 400), {"success": bool(res.success), "error_message": res.error_message}

    async def abort_request(b: dict[str, Any]) -> tuple[int, Any]:
        tm.abort_request(rid=b.get("rid", ""), abort_all=bool(b.get("abort_all", False)))
        return 200, None

    async def pause_generation(b: dict[str, Any]) -> tuple[int, Any]:
        await tm.pause_generation(io.PauseGenerationReqInput(mode=b.get("mode", "abort")))
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    async def continue_generation(b: dict[str, Any]) -> tuple[int, Any]:
        await tm.continue_generation(io.ContinueGenerationReqInput(torch_empty_cache=bool(b.get("torch_empty_cache", False))))
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    async def update_weights_from_tensor(b: dict[str, Any]) -> tuple[int, Any]:
        obj = io.UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=_need(b, "serialized_named_tensors"), load_format=b.get("load_format"),
            flush_cache=bool(b.get("flush_cache", True)), abort_all_requests=bool(b.get("abort_all_requests", False)),
            weight_version=b.get("weight_version"))
        ok, msg = await tm.update_weights_from_tensor(obj, None)
        return (200 if ok else 400), {"success": bool(ok), "message": str(msg)}

    async def get_weights_by_name(b: dict[str, Any]) -> tuple[int, Any]:
        got = await tm.get_weights_by_name(io.GetWeightsByNameReqInput(name=_need(b, "name"), truncate_size=int(b.get("truncate_size", 100))), None)
        return (200 if got is not None else 400), got

    async def update_weight_version(b: dict[str, Any]) -> tuple[int, Any]:
        if b.get("abort_all_requests", True):
            tm.abort_request(abort_all=True)
        tm.server_args.weight_version = str(_need(b, "new_version"))
        return 200, {"success": True, "message": "ok", "new_version": str(b["new_version"])}

    readable: list[bool | None] = []

    def weights_readable() -> bool | None:
        """Whether SGLang's model class for this checkpoint answers ``get_weights_by_name`` (in 0.5.14 Llama, OPT,
        Granite and Exaone4 do; Qwen-family models and most others answer None); None when it cannot be told."""
        if not readable:
            try:
                from sglang.srt.model_loader.utils import get_model_architecture

                cls, _arch = get_model_architecture(tm.model_config)
                readable.append(hasattr(cls, "get_weights_by_name"))
            except Exception as exc:  # noqa: BLE001 - another SGLang's layout: not known, the worker reads back as before
                log.warning("cannot tell whether SGLang's model class answers get_weights_by_name: %s", exc)
                readable.append(None)
        return readable[0]

    def image_size() -> dict[str, int] | None:
        """The pixel bounds SGLang's image processor resizes within (``size``: shortest_edge, longest_edge pixels), which
        may not be the checkpoint's (SGLang passes its own ``size`` for Qwen2-VL); None for a text model."""
        size: Any = getattr(getattr(getattr(tm, "processor", None), "image_processor", None), "size", None)
        lo, hi = ((size.get("shortest_edge"), size.get("longest_edge")) if isinstance(size, dict)
                  else (getattr(size, "shortest_edge", None), getattr(size, "longest_edge", None)))
        return {"shortest_edge": lo, "longest_edge": hi} if isinstance(lo, int) and isinstance(hi, int) else None

    async def model_info(b: dict[str, Any]) -> tuple[int, Any]:
        return 200, {"model_path": tm.server_args.model_path, "weight_version": tm.server_args.weight_version,
                     "context_length": getattr(tm, "context_len", None), "grammar_backend": tm.server_args.grammar_backend,
                     "weights_readable": weights_readable(), "image_size": image_size()}

    async def health(b: dict[str, Any]) -> tuple[int, Any]:
        return 200, None

    async def flush_cache(b: dict[str, Any]) -> tuple[int, Any]:
        r = await tm.flush_cache()
        return (200 if getattr(r, "success", True) else 400), {"success": bool(getattr(r, "success", True))}

    async def release(b: dict[str, Any]) -> tuple[int, Any]:
        await tm.release_memory_occupation(io.ReleaseMemoryOccupationReqInput(tags=b.get("tags")), None)
        return 200, None

    async def resume(b: dict[str, Any]) -> tuple[int, Any]:
        await tm.resume_memory_occupation(io.ResumeMemoryOccupationReqInput(tags=b.get("tags")), None)
        return 200, None

    return {"/generate": generate, "/abort_request": abort_request, "/pause_generation": pause_generation,
            "/continue_generation": continue_generation, "/update_weights_from_tensor": update_weights_from_tensor,
            "/get_weights_by_name": get_weights_by_name, "/update_weight_version": update_weight_version,
            "/model_info": model_info, "/health_generate": health, "/health": health, "/flush_cache": flush_cache,
            "/release_memory_occupation": release, "/resume_memory_occupation": resume,
            "/load_lora_adapter": load_lora_adapter, "/unload_lora_adapter": unload_lora_adapter}


# --------------------------------------------------------------------------- the sim engine, answering like SGLang


def _sim_sampling(sp: dict[str, Any]) -> SamplingParams:
    unknown = set(sp) - _SAMPLING_KEYS
    if unknown:  # SGLang raises TypeError for an unknown sampling key
        raise BadRequest(f"unknown sampling_params {sorted(unknown)}")
    return SamplingParams(
        max_new_tokens=int(sp.get("max_new_tokens", 128)), temperature=float(sp.get("temperature", 1.0)),
        top_p=float(sp.get("top_p", 1.0)), top_k=int(sp.get("top_k", -1)), min_p=float(sp.get("min_p", 0.0)),
        ignore_eos=bool(sp.get("ignore_eos", False)), stop_token_ids=tuple(int(t) for t in sp.get("stop_token_ids") or ()),
        stop=tuple(sp.get("stop") or ()), seed=None if sp.get("sampling_seed") is None else int(sp["sampling_seed"]))


class _SimPrefixCache:
    """A simulated prefix cache for the sim child: the longest prefix of a prompt among the last sequences served.

    Not SGLang's radix tree (no eviction by memory, no pages): enough for CPU tests to see the
    ``cached_tokens`` SGLang reports flow through the engine and the episode endpoint.
    """

    def __init__(self, keep: int = 256) -> None:
        self._seqs: list[list[int]] = []
        self._keep = keep

    def lookup(self, ids: list[int]) -> int:
        best = 0
        for seq in self._seqs:
            n = 0
            for a, b in zip(seq, ids, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, len(ids) - 1)  # SGLang always computes the prompt's last token

    def insert(self, seq: list[int]) -> None:
        self._seqs.append(seq)
        del self._seqs[: -self._keep]

    def clear(self) -> None:
        self._seqs.clear()


class SimRanks:
    """The tensor-parallel ranks the sim backend pretends to be: per rank, its weights and weight version."""

    def __init__(self, tp_size: int, version: int, refuses: tuple[int, int] | None = None) -> None:
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        self.tp_size = tp_size
        self.weights: list[dict[str, Any]] = [{} for _ in range(tp_size)]
        self.versions: list[int] = [version] * tp_size
        self.refuses = refuses
        self.pids: list[int] = []

    def update(self, payloads: Any, version: int) -> tuple[bool, str, list[tuple[str, Any]]]:
        """Decode every rank's payload, then apply to all ranks or to none: ``(ok, message, rank 0's tensors)``."""
        from rollpool.workers.engines.sglang.tensors import load_cpu_payload

        if not isinstance(payloads, list) or len(payloads) != self.tp_size:
            got = len(payloads) if isinstance(payloads, list) else type(payloads).__name__
            raise BadRequest(f"serialized_named_tensors must hold one payload per TP rank: tp_size is {self.tp_size}, got {got}")
        decoded: list[list[tuple[str, Any]]] = []
        for rank, payload in enumerate(payloads):
            try:
                decoded.append(load_cpu_payload(payload))
            except ValueError as exc:
                return False, f"rank {rank}: {exc}", []
            if [n for n, _ in decoded[rank]] != [n for n, _ in decoded[0]]:
                return False, f"rank {rank} got other tensor names than rank 0 (each rank takes the full tensors)", []
        if self.refuses is not None and self.refuses[1] == version and 0 <= self.refuses[0] < self.tp_size:
            return False, f"rank {self.refuses[0]} refused weight_version {version}; no rank changed", []
        for rank, named in enumerate(decoded):
            self.weights[rank].update({name: t.clone() for name, t in named})
            self.versions[rank] = version
        return True, "Succeeded to update model weights.", decoded[0]


class SimLora:
    """The sim backend's fake of SGLang's LoRA serving (``enable_lora``): adapters loaded by name from PEFT
    directories, refused as SGLang refuses them (LoRA not enabled, a rank above ``max_lora_rank``, target modules
    outside ``lora_target_modules``, a name already loaded; an answer with ``success: false``), a ``/generate``
    naming an adapter never loaded refused (400, as SGLang's ``_resolve_lora_path`` raises), and, its own
    bookkeeping for tests, the tokens served per adapter name (``/model_info``'s ``lora_tokens``; the base is
    ``""``). It does not change the tokens the sim samples. A weight update leaves loaded adapters as they are, as in
    SGLang 0.5.14: ``update_weights_from_tensor`` runs ``model.load_weights`` on the named base parameters only
    (sglang-kit API-NOTES section 3.2), which a LoRA-wrapped layer shares with its base layer
    (``sglang/srt/lora/layers.py``, ``BaseLayerWithLoRA``), and never calls the LoRA manager."""

    def __init__(self, enabled: bool, max_rank: int | None, targets: Sequence[str] | None) -> None:
        self.enabled, self.max_rank, self.targets = enabled, max_rank, set(targets or ())
        self.loaded: dict[str, dict[str, tuple[int, ...]]] = {}
        """Adapter name -> its tensors' shapes."""
        self.tokens: dict[str, int] = {}
        self.loads = 0

    def load(self, name: str, path: str) -> tuple[bool, str | None]:
        if not self.enabled:
            return False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
        if name in self.loaded:
            return False, f"The LoRA adapter with the name {name} has already been loaded."
        root = Path(path)
        try:
            config = json.loads((root / "adapter_config.json").read_text())
            from safetensors import safe_open

            # the shapes only, read without torch: the fake keeps no weights (importing torch cost the child seconds)
            with safe_open(str(root / "adapter_model.safetensors"), framework="numpy") as f:
                tensors = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except (OSError, ValueError) as exc:
            return False, f"cannot read LoRA adapter at {path}: {exc}"
        rank, targets = int(config["r"]), set(config.get("target_modules") or ())
        if self.max_rank is not None and rank > self.max_rank:
            return False, f"LoRA adapter {name} has rank {rank}, above max_lora_rank {self.max_rank}"
        if self.targets and "all" not in self.targets and not targets <= self.targets:
            return False, (f"LoRA adapter '{name}' contains target modules {sorted(targets - self.targets)} that are not included "
                           f"in the specified --lora-target-modules {sorted(self.targets)}.")
        self.loaded[name] = dict(tensors)
        self.loads += 1
        return True, None

    def unload(self, name: str) -> tuple[bool, str | None]:
        if self.loaded.pop(name, None) is None:
            return False, f"LoRA adapter {name} is not loaded"
        return True, None

    def check(self, lora_path: Any) -> str:
        """The adapter name a ``/generate`` runs on ("" for the base); `BadRequest` for one never loaded."""
        if not lora_path:
            return ""
        if not self.enabled:
            raise BadRequest(f"LoRA adapter {lora_path!r} requested but LoRA is not enabled. Please launch the server with --enable-lora")
        if str(lora_path) not in self.loaded:
            raise BadRequest(f"Got LoRA adapter that has never been loaded: {lora_path}\nAll loaded adapters: {sorted(self.loaded)}.")
        return str(lora_path)


class SimGrammar:
    """The sim backend's fake of SGLang's grammar backend. With ``xgrammar`` an ``ebnf`` request is compiled by
    xgrammar for the model directory's tokenizer (its end-of-sequence id the stop token, as SGLang's backend does) and
    each sample is drawn here, one token per decode step of the sim, uniformly among the tokens the grammar allows,
    until the grammar is complete, a stop token, or ``max_new_tokens``; an abort ends it with its partial output.
    Not a model: it checks what the engine sends and what comes back, not what a model would sample. With ``none``
    a grammar is refused as SGLang refuses it (400)."""

    def __init__(self, backend: str, model_path: str, vocab: int | None, eos_id: int | None) -> None:
        self.backend = backend
        self.model_path, self.vocab, self.eos_id = model_path, vocab, eos_id
        self._compiler: Any = None
        self._compiled: dict[str, Any] = {}
        self.running: set[str] = set()
        self.aborted: set[str] = set()
        self.served = 0
        """Grammar requests served (``/model_info``'s ``grammar_requests``)."""

    def _compile(self, ebnf: str) -> Any:
        if self.backend != "xgrammar":
            raise BadRequest(_NO_GRAMMAR)
        import xgrammar as xgr

        if self._compiler is None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.model_path)
            vocab = self.vocab or len(tok)
            info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[self.eos_id] if self.eos_id is not None else None)
            self._compiler, self.vocab = xgr.GrammarCompiler(info, max_threads=1), vocab
        if ebnf not in self._compiled:
            try:
                self._compiled[ebnf] = self._compiler.compile_grammar(ebnf)
            except RuntimeError as exc:
                raise BadRequest(f"invalid ebnf: {exc}") from exc
        return self._compiled[ebnf]

    def abort(self, rid: str, abort_all: bool) -> None:
        self.aborted |= set(self.running) if abort_all else ({rid} & self.running)

    async def generate(self, sim: Any, ids: list[int], sp: dict[str, Any], rid: str) -> tuple[list[int], list[float], dict[str, Any], int]:
        """(output ids, their logprobs, SGLang's finish_reason, the weight version of the last token)."""
        import random

        import numpy as np
        import xgrammar as xgr

        compiled = self._compile(str(sp["ebnf"]))
        assert self.vocab is not None
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab)
        seed = sp.get("sampling_seed")
        rng = random.Random(int(seed) if seed is not None else rid)
        stops = {int(t) for t in sp.get("stop_token_ids") or ()} | ({self.eos_id} if self.eos_id is not None else set())
        out: list[int] = []
        logprobs: list[float] = []
        finish: dict[str, Any] = {"type": "length", "length": int(sp.get("max_new_tokens", 128))}
        self.running.add(rid)
        self.served += 1
        try:
            while len(out) < int(sp.get("max_new_tokens", 128)):
                await asyncio.sleep(sim.decode_s_per_token)
                if rid in self.aborted:
                    finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
                    break
                matcher.fill_next_token_bitmask(bitmask)
                allowed = np.flatnonzero(np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[: self.vocab])
                tok = int(allowed[rng.randrange(len(allowed))])
                matcher.accept_token(tok)
                out.append(tok)
                logprobs.append(-rng.expovariate(1.0))
                if matcher.is_terminated() or tok in stops:
                    finish = {"type": "stop", "matched": tok}
                    break
        finally:
            self.running.discard(rid)
            self.aborted.discard(rid)
        return out, logprobs, finish, sim.version


def sim_routes(sim: Any, model_path: str, ranks: SimRanks | None = None, lora: SimLora | None = None,  # noqa: C901 - grandfathered: one handler per route
               grammar: SimGrammar | None = None, weights_readable: bool = True) -> dict[str, Route]:
    """The same routes over a `SimEngine`, answering with SGLang's shapes (each request is one sample).
    `weights_readable` false stands in for a model class SGLang cannot read a weight back from (Qwen-family):
    ``get_weights_by_name`` answers 400 with null, as SGLang's does for those."""
    ranks = ranks or SimRanks(1, sim.version)
    lora = lora or SimLora(False, None, None)
    grammar = grammar or SimGrammar("none", model_path, None, None)
    weights = ranks.weights[0]  # get_weights_by_name answers from TP rank 0, as in SGLang
    paused = False
    cache = _SimPrefixCache()
    # the sim's own counters (/model_info): the control calls served, and the updates that found samples generating
    # (SGLang 0.5.14 makes such an update wait for them behind its model-update lock unless paused; so does the sim)
    calls = {"pause_generation": 0, "continue_generation": 0, "updates_while_generating": 0}
    vision: list[Any] = []

    def prompt_tokens(ids: list[int], image_data: Any) -> int:
        """The prompt's length as SGLang runs it: each image token expanded for its image's merged patches (the
        sim runs no vision tower, so it expands by the same rule as the worker: `rollpool.workers.engines.vision`)."""
        if not image_data:
            return len(ids)
        if not vision:
            from rollpool.workers.engines.vision import load_vision_spec

            vision.append(load_vision_spec(model_path))
        if vision[0] is None:
            raise BadRequest(f"the model at {model_path} takes no images")
        raw = [base64.b64decode(x.partition(",")[2]) if isinstance(x, str) else bytes(x) for x in image_data]
        return len(vision[0].expand(list(ids), vision[0].grids_of(raw)))

    async def generate(b: dict[str, Any]) -> tuple[int, Any]:
        ids = _need(b, "input_ids")
        if not isinstance(ids, list) or not ids:
            raise BadRequest("input_ids must be a non-empty list of ints")
        rid = str(b.get("rid") or os.urandom(8).hex())
        sp = _sim_sampling(dict(b.get("sampling_params") or {}))
        adapter = lora.check(b.get("lora_path"))
        t0 = time.time()
        cached = cache.lookup(ids)
        raw_sp = dict(b.get("sampling_params") or {})
        if raw_sp.get("ebnf") is not None:
            output_ids, logprobs, finish, version = await grammar.generate(sim, ids, raw_sp, rid)
        else:
            out = await sim.generate(ids, 1, sp, rid)
            s = out.samples[0]
            output_ids, logprobs = list(s.output_ids), list(s.logprobs)
            if s.finish_reason == FinishReason.STOP:
                finish = {"type": "stop", "matched": s.matched_stop}
            elif s.finish_reason == FinishReason.LENGTH:
                finish = {"type": "length", "length": len(s.output_ids)}
            else:
                finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
            version = s.token_versions[-1] if s.token_versions else sim.version
        lora.tokens[adapter] = lora.tokens.get(adapter, 0) + len(output_ids)
        cache.insert(list(ids) + output_ids[:-1])  # the last sampled token has no KV yet, as in SGLang
        meta = {
            "id": rid, "finish_reason": finish, "prompt_tokens": prompt_tokens(ids, b.get("image_data")), "weight_version": str(version),
            "num_retractions": 0, "input_token_logprobs": [],
            "output_token_logprobs": [[lp, tok, None] for lp, tok in zip(logprobs, output_ids, strict=True)],
            "output_token_logprobs_length": len(output_ids), "reasoning_tokens": 0,
            "completion_tokens": len(output_ids), "cached_tokens": cached, "cached_tokens_details": {"device": cached, "host": 0},
            "dp_rank": None, "e2e_latency": time.time() - t0, "response_sent_to_client_ts": time.time(),
        }
        return 200, {"text": "", "output_ids": output_ids, "meta_info": meta}

    async def abort_request(b: dict[str, Any]) -> tuple[int, Any]:
        grammar.abort(str(b.get("rid", "")), bool(b.get("abort_all")))
        rids = sim.running_request_ids() if b.get("abort_all") else [str(b.get("rid", ""))]
        for rid in rids:
            await sim.abort(rid)
        return 200, None

    async def pause_generation(b: dict[str, Any]) -> tuple[int, Any]:
        nonlocal paused
        if b.get("mode", "abort") != "abort":
            raise BadRequest("the sim backend pauses in mode abort only (what rollpool sends)")
        calls["pause_generation"] += 1
        for rid in sim.running_request_ids():
            await sim.abort(rid)
        await sim.pause("drain")  # returns once the aborted requests are out; new ones wait for continue
        paused = True
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    async def continue_generation(b: dict[str, Any]) -> tuple[int, Any]:
        nonlocal paused
        calls["continue_generation"] += 1
        if paused:
            await sim.resume()
            paused = False
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    async def update_weights_from_tensor(b: dict[str, Any]) -> tuple[int, Any]:
        raw = b.get("weight_version")
        version = int(raw) if raw is not None else sim.version
        if not paused and sim.running_request_ids():
            calls["updates_while_generating"] += 1
            while True:  # SGLang's writer lock: the update waits for the running generate calls
                await asyncio.sleep(0.005)
                if not sim.running_request_ids():
                    break
        ok, message, named = ranks.update(_need(b, "serialized_named_tensors"), version)
        if not ok:
            return 400, {"success": False, "message": message}
        await sim.update_weights(dict(named), version)
        if b.get("flush_cache", True):
            cache.clear()
        return 200, {"success": True, "message": "Succeeded to update model weights."}

    async def get_weights_by_name(b: dict[str, Any]) -> tuple[int, Any]:
        t = weights.get(str(_need(b, "name"))) if weights_readable else None
        if t is None:
            return 400, None
        n = int(b.get("truncate_size", 100))
        return 200, t.float().tolist()[:n]

    async def update_weight_version(b: dict[str, Any]) -> tuple[int, Any]:
        new = str(_need(b, "new_version"))
        if b.get("abort_all_requests", True):
            for rid in sim.running_request_ids():
                await sim.abort(rid)
        await sim.update_weights({}, int(new))
        ranks.versions = [int(new)] * ranks.tp_size
        return 200, {"success": True, "message": "ok", "new_version": new}

    async def model_info(b: dict[str, Any]) -> tuple[int, Any]:
        # tp_size, rank_versions and rank_pids are the sim's own keys (real SGLang reports no per-rank state here)
        return 200, {"model_path": model_path, "weight_version": str(sim.version), "tp_size": ranks.tp_size,
                     "rank_versions": list(ranks.versions), "rank_pids": list(ranks.pids),
                     "lora_loaded": sorted(lora.loaded), "lora_tokens": dict(lora.tokens), "lora_loads": lora.loads,
                     "grammar_backend": grammar.backend, "grammar_requests": grammar.served, "control_calls": dict(calls),
                     "weights_readable": weights_readable}

    async def load_lora_adapter(b: dict[str, Any]) -> tuple[int, Any]:
        ok, error = lora.load(str(_need(b, "lora_name")), str(_need(b, "lora_path")))
        return (200 if ok else 400), {"success": ok, "error_message": error, "loaded_adapters": None}

    async def unload_lora_adapter(b: dict[str, Any]) -> tuple[int, Any]:
        ok, error = lora.unload(str(_need(b, "lora_name")))
        return (200 if ok else 400), {"success": ok, "error_message": error, "loaded_adapters": None}

    async def health(b: dict[str, Any]) -> tuple[int, Any]:
        return 200, None

    async def flush_cache(b: dict[str, Any]) -> tuple[int, Any]:
        await sim.flush_cache()
        cache.clear()
        return 200, {"success": True}

    async def release(b: dict[str, Any]) -> tuple[int, Any]:
        await sim.release_memory(tuple(b.get("tags") or ()))
        return 200, None

    async def resume(b: dict[str, Any]) -> tuple[int, Any]:
        await sim.resume_memory(tuple(b.get("tags") or ()))
        return 200, None

    return {"/generate": generate, "/abort_request": abort_request, "/pause_generation": pause_generation,
            "/continue_generation": continue_generation, "/update_weights_from_tensor": update_weights_from_tensor,
            "/get_weights_by_name": get_weights_by_name, "/update_weight_version": update_weight_version,
            "/model_info": model_info, "/health_generate": health, "/health": health, "/flush_cache": flush_cache,
            "/release_memory_occupation": release, "/resume_memory_occupation": resume,
            "/load_lora_adapter": load_lora_adapter, "/unload_lora_adapter": unload_lora_adapter}


# --------------------------------------------------------------------------- entry point


PARENT_POLL_S = 0.5
"""How often a server started with ``--parent-pid`` checks that the process that started it is still its parent."""


async def _parent_gone(parent_pid: int) -> None:
    """Returns once this process is no longer a child of `parent_pid` (it died, however: the orphan is re-parented)."""
    while os.getppid() == parent_pid:  # noqa: ASYNC110 - no event tells a process its parent died (a poll, as SGLang's own)
        await asyncio.sleep(PARENT_POLL_S)
    log.warning("the worker that started this server (pid %d) is gone: shutting down", parent_pid)


async def _serve_forever(routes: dict[str, Route], host: str, port: int, token: str, hop: str = "", parent_pid: int = 0) -> None:
    """HTTP on `host`:`port` and, with `hop`, the same routes on the hop's socket (`hop`); a hop that fails ends the
    server (and so the child), which the worker sees as the engine's death rather than as calls that never return.
    With `parent_pid` the server also ends when that process is no longer its parent: a worker killed outright
    (SIGKILL, the OOM killer) cannot stop the child it started in a session of its own, and a real SGLang server left
    behind holds its GPU memory from the worker that restarts in its place."""
    tasks = [asyncio.create_task(serve_hop(routes, hop, token), name="sglang-hop")] if hop else []
    if parent_pid:
        tasks.append(asyncio.create_task(_parent_gone(parent_pid), name="sglang-parent-watch"))
    runner = await serve_routes(routes, host, port, token)
    try:
        if tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # a hop that failed raises here, as before
        else:
            await asyncio.Event().wait()
    finally:
        for t in tasks:
            t.cancel()
        await runner.cleanup()


def _die_with_parent() -> None:
    """In a stand-in, before exec: SIGKILL when the server dies, however it dies (Linux ``PR_SET_PDEATHSIG``)."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


async def _start_rank_stand_ins(ranks: SimRanks) -> asyncio.Task[None]:
    """One stand-in process per rank (SGLang runs a scheduler process per rank); a watch that, when any exits,
    kills the others and ends this server at once, as a crashing SGLang scheduler takes its whole server down."""
    import signal

    procs = [await asyncio.create_subprocess_exec("sleep", "infinity", stdin=asyncio.subprocess.DEVNULL,
                                                  preexec_fn=_die_with_parent) for _ in range(ranks.tp_size)]
    ranks.pids = [p.pid for p in procs]

    async def watch() -> None:
        waits = {asyncio.ensure_future(p.wait()): rank for rank, p in enumerate(procs)}
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        rank = waits[next(iter(done))]
        logging.getLogger(__name__).error("sim rank %d (pid %d) exited; the server goes down with it", rank, procs[rank].pid)
        for p in procs:
            if p.returncode is None:
                p.send_signal(signal.SIGKILL)
        os._exit(1)

    return asyncio.create_task(watch(), name="sim-rank-watch")


def _sim_model_kwargs(model_path: str) -> dict[str, Any]:
    """The sim's vocabulary and end-of-sequence id from the model directory's config, as SGLang would serve that model."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    out: dict[str, Any] = {}
    vocab, eos = cfg.get("vocab_size"), cfg.get("eos_token_id")
    if isinstance(vocab, int) and vocab >= 4:
        out["vocab"] = vocab
        if isinstance(eos, int) and 0 <= eos < vocab:
            out["eos_id"] = eos
    return out


def _sim_special_ids(model_path: str, vocab: int | None) -> tuple[int, ...]:
    """The ids of the model directory's special tokens (``tokenizer.json``'s added tokens marked special, else
    ``tokenizer_config.json``'s ``added_tokens_decoder``) within `vocab`: what a chat model does not sample mid-turn."""
    ids: set[int] = set()
    try:
        added = json.loads((Path(model_path) / "tokenizer.json").read_text()).get("added_tokens") or []
        ids = {int(t["id"]) for t in added if isinstance(t, dict) and t.get("special") and isinstance(t.get("id"), int)}
    except (OSError, ValueError, AttributeError):
        try:
            decoder = json.loads((Path(model_path) / "tokenizer_config.json").read_text()).get("added_tokens_decoder") or {}
            ids = {int(k) for k, t in decoder.items() if isinstance(t, dict) and t.get("special")}
        except (OSError, ValueError, AttributeError):
            return ()
    return tuple(sorted(t for t in ids if t >= 0 and (vocab is None or t < vocab)))


MM_AVOID_RETOKENIZE = "SGLANG_MM_AVOID_RETOKENIZE"
"""SGLang's switch between running a token prompt's own ids (on) and retokenizing its decoded text (off)."""


def serve_main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rollpool.workers.engines.sglang.server")
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--backend", choices=("sglang", "sim"), default="sglang")
    ap.add_argument("--engine-kwargs", default="{}", help="JSON: keyword arguments of sglang.Engine, or SimOptions")
    ap.add_argument("--hop", default="", help="also serve the routes on a ZeroMQ ROUTER bound here (the worker's per-sample hop)")
    ap.add_argument("--parent-pid", type=int, default=0,
                    help="end when this process is no longer the parent (the worker that launched it; 0: never)")
    a = ap.parse_args(argv)
    token = os.environ.pop(TOKEN_ENV, "")  # out of the environment, so SGLang's own children do not inherit it
    kwargs = json.loads(a.engine_kwargs)
    if a.backend == "sim":
        from rollpool.workers.engines.options import SimOptions, parse_options
        from rollpool.workers.engines.sim import SimEngine

        tp_size = int(kwargs.pop("tp_size", 1))
        refuses = kwargs.pop("rank_refuses", None)
        kwargs.pop("base_gpu_id", None)
        lora = SimLora(bool(kwargs.pop("enable_lora", False)), kwargs.pop("max_lora_rank", None), kwargs.pop("lora_target_modules", None))
        kwargs.pop("max_loras_per_batch", None)
        readable = bool(kwargs.pop("weights_readable", True))  # the sim's stand-in of a model SGLang cannot read back
        model_kwargs = _sim_model_kwargs(a.model_path)
        if kwargs.pop("chat_sampling", False):  # sample as a chat model does (SimOptions.special_ids)
            model_kwargs["special_ids"] = _sim_special_ids(a.model_path, model_kwargs.get("vocab"))
        grammar = SimGrammar(resolve_grammar_backend(str(kwargs.pop("grammar_backend", "none"))), a.model_path,
                             model_kwargs.get("vocab"), model_kwargs.get("eos_id"))
        sim = SimEngine(parse_options(SimOptions, {**model_kwargs, **kwargs}))
        ranks = SimRanks(tp_size, sim.version, (int(refuses[0]), int(refuses[1])) if refuses else None)

        async def run_sim() -> None:
            await sim.start()
            watch = await _start_rank_stand_ins(ranks) if tp_size > 1 else None
            try:
                await _serve_forever(sim_routes(sim, a.model_path, ranks, lora, grammar, readable), a.host, a.port, token, a.hop, a.parent_pid)
            finally:
                if watch is not None:
                    watch.cancel()

        asyncio.run(run_sim())
        return 0
    # SGLang keeps a token prompt's own ids and expands its image tokens only with this on (0.5.14's default); off, it
    # decodes the ids to text and tokenizes them again, and the ids the worker reports are not the ids the model ran
    if os.environ.get(MM_AVOID_RETOKENIZE, "1") != "1":
        log.warning("%s=%s in the environment: set to 1 for this engine (the reported ids must be the ids SGLang runs)",
                    MM_AVOID_RETOKENIZE, os.environ[MM_AVOID_RETOKENIZE])
    os.environ[MM_AVOID_RETOKENIZE] = "1"
    import sglang

    # triton attention and torch sampling: the kit has no fa3/flashinfer sampling; the grammar backend only where
    # xgrammar imports (the kit has none: tests/gpu/xgrammar_kit.sh adds it); prefill CUDA graphs compile for ~2 min
    # at start and are skipped (decode graphs stay); a vision tower's attention defaults to fa3 on Hopper too, so it
    # is triton as well (the setting is read only by multimodal models)
    kwargs["grammar_backend"] = resolve_grammar_backend(str(kwargs.get("grammar_backend", "auto")))
    kwargs = {"attention_backend": "triton", "sampling_backend": "pytorch", "log_level": "warning",
              "cuda_graph_backend_prefill": "disabled", "mm_attention_backend": "triton_attn", **kwargs}
    engine = sglang.Engine(model_path=a.model_path, **kwargs)
    try:
        engine.loop.run_until_complete(_serve_forever(sglang_routes(engine), a.host, a.port, token, a.hop, a.parent_pid))
    finally:
        engine.shutdown()  # its scheduler processes with it
    return 0


if __name__ == "__main__":
    sys.exit(serve_main())
