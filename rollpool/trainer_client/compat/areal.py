"""AReaL's legacy SGLang backend engine (`realhf.impl.model.backend.sglang.SGLangGenerationEngine`), on a pool.

Port by changing the import and adding ``broker=``::

    from rollpool.trainer_client.compat.areal import SGLangGenerationEngine
    engine = SGLangGenerationEngine(server_args_dict, hybrid_train=False, broker="tcp://broker:5556")

No SGLang server is started: `server_args_dict` describes a server the pool's workers already
run, so only ``model_path`` (or ``tokenizer_path``) is read, to check it is the workers' model.
`generate(input_, mb_spec, tokenizer, gconfig)` and `async_generate(...)` take AReaL's packed
`SequenceSample` (read by duck typing: ``ids``, ``seqlens["packed_input_ids"]`` and the packed
``data["packed_input_ids"]``) and return AReaL's triple: generated token ids (B*n, longest)
padded with ``tokenizer.pad_token_id``, their logprobs (float32, 0 on padding) and ``None`` for
the logits mask, as torch tensors on the CPU. Stop tokens are the tokenizer's pad and eos, as
in AReaL. `gconfig` (a `GenerationHyperparameters` or anything with its fields) gives ``n``,
``max_new_tokens``, ``greedy``, ``temperature``, ``top_p`` and ``top_k``; ``min_new_tokens`` other
than 0 is refused as AReaL refuses it; its CUDA-graph and logits-mask switches are engine-side.
`mb_spec` means nothing on a pool (the workers batch continuously). `update_weights_from_disk`
makes every worker load the checkpoint as a new version, and the next generation is served
only at it (synchronous, as AReaL's call is).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

from rollpool.protocol import ConfigError
from rollpool.trainer_client.client import TrainerClientConfig
from rollpool.trainer_client.compat._model import open_pool
from rollpool.trainer_client.pool import RolloutPool, UnsupportedParameterError

__all__ = ["SGLangGenerationEngine", "SGLANG_INIT_TIMEOUT"]

log = logging.getLogger(__name__)

SGLANG_INIT_TIMEOUT = 300
"""Seconds `wait_server` waits for the first worker (AReaL's constant)."""

_GCONFIG_DEFAULTS: dict[str, Any] = {"n": 1, "max_new_tokens": 256, "min_new_tokens": 0, "greedy": False,
                                     "top_p": 1.0, "top_k": -1, "temperature": 1.0}


def _gconfig(g: Any) -> dict[str, Any]:
    """GenerationHyperparameters (or a mapping, or AReaL's unfilled dataclasses.field default) -> its fields."""
    if g is None or isinstance(g, dataclasses.Field):
        return dict(_GCONFIG_DEFAULTS)
    if isinstance(g, Mapping):
        return {k: g.get(k, d) for k, d in _GCONFIG_DEFAULTS.items()}
    return {k: getattr(g, k, d) for k, d in _GCONFIG_DEFAULTS.items()}


class SGLangGenerationEngine:
    def __init__(self, server_args_dict: Mapping[str, Any], hybrid_train: bool, request_timeout: int = 1800, *,
                 broker: str | None = None, synchronous: bool = True, client_config: TrainerClientConfig | None = None) -> None:
        if not isinstance(server_args_dict, Mapping):
            raise ConfigError(f"SGLangGenerationEngine: server_args_dict must be a dict, got {type(server_args_dict).__name__}")
        self.server_args_dict = dict(server_args_dict)
        self.hybrid_train = hybrid_train
        self.request_timeout = request_timeout
        model = server_args_dict.get("model_path") or server_args_dict.get("tokenizer_path")
        self.pool: RolloutPool = open_pool(broker, who="SGLangGenerationEngine", model=model, synchronous=synchronous,
                                           timeout_s=float(request_timeout), client_config=client_config)
        self.base_url = broker

    def __del__(self) -> None:
        pool = getattr(self, "pool", None)
        if pool is not None:
            try:
                pool.shutdown()
            except Exception:  # best effort at garbage collection
                log.debug("closing the pool client at __del__ failed", exc_info=True)

    def train(self, mode: bool = True) -> SGLangGenerationEngine:
        """A placeholder, as in AReaL."""
        return self

    def _eval_mode(self) -> SGLangGenerationEngine:
        """A placeholder, as in AReaL: its public mode switch, bound below under AReaL's name."""
        return self

    eval = _eval_mode  # AReaL's public name; a mode switch, not Python's eval

    def wait_server(self) -> None:
        """Wait until the pool has at least one live worker (up to SGLANG_INIT_TIMEOUT s); TimeoutError if none came."""
        deadline = time.monotonic() + SGLANG_INIT_TIMEOUT
        while not self.pool.worker_urls():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no rollout worker joined the pool at {self.base_url} within {SGLANG_INIT_TIMEOUT} s")
            time.sleep(0.5)

    # ------------------------------------------------------------------ generation

    def _requests(self, input_: Any, tokenizer: Any, gconfig: Any, stream: bool) -> tuple[list[list[int]], dict[str, Any], int]:
        if stream:
            raise UnsupportedParameterError("stream", "streaming mode is not implemented (as in AReaL's backend)")
        g = _gconfig(gconfig)
        if int(g["min_new_tokens"]) != 0:
            raise RuntimeError("min_new_tokens must be 0: the SGLang backend does not support it (AReaL refuses it too)")
        pad = getattr(tokenizer, "pad_token_id", None)
        eos = getattr(tokenizer, "eos_token_id", None)
        stop_ids = [int(t) for t in (pad, eos) if t is not None]
        sampling = {"n": int(g["n"]), "max_new_tokens": int(g["max_new_tokens"]), "top_p": float(g["top_p"]),
                    "top_k": int(g["top_k"]), "temperature": 0.0 if g["greedy"] else float(g["temperature"]),
                    "stop_token_ids": stop_ids}
        seqlens = input_.seqlens["packed_input_ids"]
        packed = input_.data["packed_input_ids"]
        flat = packed.tolist() if hasattr(packed, "tolist") else list(packed)
        rows: list[list[int]] = []
        at = 0
        for i, lens in enumerate(seqlens):
            if len(lens) > 1:
                raise RuntimeError(f"sglang backend does not support grouped generation for now. Group size {len(lens)} (sample {i}).")
            n = int(lens[0])
            rows.append([int(t) for t in flat[at : at + n]])
            at += n
        if at != len(flat):
            raise ValueError(f"seqlens add up to {at} tokens, packed_input_ids holds {len(flat)}")
        if len(rows) != len(input_.ids):
            raise ValueError(f"{len(input_.ids)} ids for {len(rows)} sequences")
        return rows, sampling, int(pad) if pad is not None else 0

    def _run(self, input_: Any, tokenizer: Any, gconfig: Any, stream: bool = False) -> tuple[Any, Any, None]:
        import torch

        rows, sampling, pad = self._requests(input_, tokenizer, gconfig, stream)
        res = self.pool.generate(input_ids=rows, sampling_params=sampling, return_logprob=True)
        results = res if isinstance(res, list) else [res]
        width = max((len(r["output_ids"]) for r in results), default=0)
        ids = [r["output_ids"] + [pad] * (width - len(r["output_ids"])) for r in results]
        lps = [[lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]] for r in results]
        lps = [x + [0.0] * (width - len(x)) for x in lps]
        return torch.tensor(ids, dtype=torch.long), torch.tensor(lps, dtype=torch.float32), None

    async def async_generate(self, input_: Any, mb_spec: Any, tokenizer: Any, gconfig: Any = None, stream: bool = False,
                             disable_tqdm: bool = False) -> tuple[Any, Any, None]:
        """(token ids, logprobs, None) for every sample of every sequence, in `input_.ids` order (n per sequence)."""
        return await asyncio.to_thread(self._run, input_, tokenizer, gconfig, stream)

    def generate(self, input_: Any, mb_spec: Any, tokenizer: Any, gconfig: Any = None) -> tuple[Any, Any, None]:
        """The blocking form of `async_generate`."""
        return self._run(input_, tokenizer, gconfig)

    def update_weights_from_disk(self, path: str) -> None:
        """Every worker loads the checkpoint at `path` (a path they share) as a new version; the next generation waits for it."""
        self.pool.update_weights_from_disk(path)
