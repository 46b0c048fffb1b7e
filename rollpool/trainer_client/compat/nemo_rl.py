"""NeMo-RL's (dockyard_rl) `SGLangGeneration`, served by a rollpool pool.

Port by changing the import and adding ``broker=``::

    from rollpool.trainer_client.compat.nemo_rl import SGLangGeneration
    generation = SGLangGeneration(cluster, config, broker="tcp://broker:5556")

`generate(data, greedy)` takes NeMo-RL's batched dict (a `BatchedDataDict` or any mapping):
``input_ids`` (B, L) right-padded and ``input_lengths`` (B,), optionally ``stop_strings``
(one list or None per sample); other keys are the caller's and are not read. It returns a plain
dict with NeMo-RL's `GenerationOutputSpec` keys: ``output_ids`` (B, L + longest generation: each
row its prompt, its generated tokens, then ``pad_token_id``), ``logprobs`` (same shape, 0 on prompt
and padding positions), ``generation_lengths`` and ``unpadded_sequence_lengths`` (B,). Torch
tensors in give torch tensors out; numpy or lists give numpy arrays.

Sampling comes from the config (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``,
``stop_token_ids``, ``stop_strings``); ``greedy=True`` samples at temperature 0. Ray object refs
become plain values: `init_collective`, `update_weights_via_ipc_zmq` and
`update_weights_from_collective` return plain lists. Weights travel by value: the tensors the
trainer would stream (`policy.stream_weights_via_ipc_zmq`, a collective broadcast) are handed to
`stage_weights(state_dict)` instead, and the refit call publishes them as one version; the next
`generate` is served only at that version (synchronous, as NeMo-RL's refit is).

`prepare_for_generation`/`finish_generation` resume and release the workers' memory when the
config's ``sglang_cfg.enable_memory_saver`` is true, and are no-ops otherwise (NeMo-RL's rule).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import numpy as np

from rollpool.protocol import ConfigError, WeightSyncError
from rollpool.trainer_client.client import TrainerClientConfig
from rollpool.trainer_client.compat._model import DEFAULT_BROKER_TIMEOUT_S, open_pool
from rollpool.trainer_client.pool import ALL_MEMORY_TAGS, RolloutPool, UnsupportedParameterError

__all__ = ["SGLangGeneration", "TOP_K_THRESHOLD", "TOP_P_THRESHOLD", "logger"]

log = logging.getLogger(__name__)
logger = log
"""NeMo-RL's module-level name for this module's logger, kept for code that imports it."""

TOP_K_THRESHOLD = 8000
"""NeMo-RL's constant, kept for code that imports it (top_k at or above it is treated as no top-k there)."""
TOP_P_THRESHOLD = 0.99
"""NeMo-RL's constant, kept for code that imports it."""

_SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "stop_strings")
_PLACEMENT_KEYS = ("backend", "colocated", "sglang_cfg", "sglang_kwargs", "sglang_server_args", "model_name",
                   "_pad_token_id", "pad_token_id", "vllm_cfg", "vllm_kwargs")


class SGLangGeneration:
    def __init__(self, cluster: Any = None, config: Mapping[str, Any] | None = None, name_prefix: str = "sglang_policy",
                 workers_per_node: int | list[int] | None = None, *, broker: str | None = None, synchronous: bool = True,
                 timeout_s: float | None = DEFAULT_BROKER_TIMEOUT_S, weight_timeout_s: float | None = None,
                 client_config: TrainerClientConfig | None = None) -> None:
        cfg = dict(config or {})
        unknown = sorted(k for k in cfg if k not in _SAMPLING_KEYS + _PLACEMENT_KEYS)
        if unknown:
            raise UnsupportedParameterError(f"config[{unknown[0]!r}]", f"not a generation setting the pool knows (unknown keys: {unknown}; "
                                            f"honoured: {list(_SAMPLING_KEYS)}; accepted as server-side: {list(_PLACEMENT_KEYS)})")
        if cfg.get("backend", "sglang") != "sglang":
            raise ConfigError(f"SGLangGeneration: config['backend'] is {cfg['backend']!r}, expected 'sglang'")
        self.cluster = cluster
        self.cfg = cfg
        self.name_prefix = name_prefix
        self.workers_per_node = workers_per_node
        pad = cfg.get("_pad_token_id", cfg.get("pad_token_id"))
        self.pad_token_id = int(pad) if pad is not None else 0
        sglang_cfg = cfg.get("sglang_cfg") or {}
        self.memory_saver = bool(sglang_cfg.get("enable_memory_saver", False)) if isinstance(sglang_cfg, Mapping) else False
        self._staged: dict[str, Any] = {}
        self.pool: RolloutPool = open_pool(broker, who="SGLangGeneration", model=cfg.get("model_name"), synchronous=synchronous,
                                           timeout_s=timeout_s, weight_timeout_s=weight_timeout_s, client_config=client_config)

    # ------------------------------------------------------------------ generation

    def _sampling(self, greedy: bool, stop_strings: Any) -> dict[str, Any]:
        c = self.cfg
        sp: dict[str, Any] = {
            "max_new_tokens": c.get("max_new_tokens"),
            "temperature": 0.0 if greedy else c.get("temperature"),
            "top_p": c.get("top_p"),
            "top_k": c.get("top_k"),
            "stop_token_ids": c.get("stop_token_ids"),
        }
        stops = list(c.get("stop_strings") or []) + list(stop_strings or [])
        if stops:
            sp["stop"] = sorted(set(stops))
        return sp

    def _rows(self, data: Any) -> tuple[list[list[int]], list[int], Any, Any]:
        """-> (unpadded prompts, their lengths, padded input_ids as given, the stop strings per sample)."""
        if not isinstance(data, Mapping) and not (hasattr(data, "keys") and hasattr(data, "__getitem__")):
            raise TypeError(f"generate takes NeMo-RL's batched dict (input_ids, input_lengths), got {type(data).__name__}")
        for key in ("input_ids", "input_lengths"):
            if key not in data:
                raise ValueError(f"the batched dict has no {key!r} (keys: {sorted(map(str, data.keys()))})")
        ids = data["input_ids"]
        padded = ids.tolist() if hasattr(ids, "tolist") else [list(r) for r in ids]
        lengths_raw = data["input_lengths"]
        lengths = [int(x) for x in (lengths_raw.tolist() if hasattr(lengths_raw, "tolist") else lengths_raw)]
        if len(padded) != len(lengths) or not padded:
            raise ValueError(f"input_ids has {len(padded)} rows and input_lengths {len(lengths)} entries (need the same, >= 1)")
        rows = []
        for i, (row, n) in enumerate(zip(padded, lengths, strict=True)):
            if not 1 <= n <= len(row):
                raise ValueError(f"input_lengths[{i}] = {n} is outside [1, {len(row)}]")
            rows.append([int(t) for t in row[:n]])
        stops = data.get("stop_strings") if hasattr(data, "get") else None
        per_sample = list(stops) if stops is not None else [None] * len(rows)
        if len(per_sample) != len(rows):
            raise ValueError(f"stop_strings has {len(per_sample)} entries for {len(rows)} samples")
        return rows, lengths, ids, per_sample

    def _pack(self, results: list[dict[str, Any]], rows: list[list[int]], width: int, like: Any) -> dict[str, Any]:
        gen = [r["output_ids"] for r in results]
        total = width + max((len(g) for g in gen), default=0)
        out_ids = np.full((len(rows), total), self.pad_token_id, dtype=np.int64)
        logprobs = np.zeros((len(rows), total), dtype=np.float32)
        for i, (prompt, res) in enumerate(zip(rows, results, strict=True)):
            n = len(prompt)
            out_ids[i, :n] = prompt
            g = res["output_ids"]
            out_ids[i, n : n + len(g)] = g
            logprobs[i, n : n + len(g)] = [lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]]
        gen_len = np.array([len(g) for g in gen], dtype=np.int64)
        unpadded = np.array([len(p) for p in rows], dtype=np.int64) + gen_len
        out = {"output_ids": out_ids, "logprobs": logprobs, "generation_lengths": gen_len, "unpadded_sequence_lengths": unpadded}
        if type(like).__module__.startswith("torch"):
            import torch

            return {k: torch.from_numpy(v).to(like.dtype) if k == "output_ids" else torch.from_numpy(v) for k, v in out.items()}
        return out

    def generate(self, data: Any, greedy: bool = False) -> dict[str, Any]:
        """Generate one sample per row of the batched dict; NeMo-RL's output keys in a plain dict."""
        rows, _, ids, stops = self._rows(data)
        width = len(ids[0]) if len(ids) else 0
        res = self.pool.generate(input_ids=rows, sampling_params=[self._sampling(greedy, s) for s in stops], return_logprob=True)
        assert isinstance(res, list)
        return self._pack(res, rows, width, ids)

    async def generate_async(self, data: Any, greedy: bool = False) -> AsyncGenerator[tuple[int, dict[str, Any]], None]:
        """Yield ``(original_idx, result)`` as each sample finishes; each result is a batch of one."""
        rows, _, ids, stops = self._rows(data)
        width = len(ids[0]) if len(ids) else 0
        agen = self.pool.generate_async(input_ids=rows, sampling_params=[self._sampling(greedy, s) for s in stops], return_logprob=True)
        async for idx, res in agen:
            yield idx, self._pack([res], [rows[idx]], width, ids[idx : idx + 1])

    # ------------------------------------------------------------------ weights (refit)

    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> list[Any]:
        """No collective is needed: weights travel over the pool's weight channel. An empty list (no remote work)."""
        return []

    def prepare_refit_info(self, state_dict_info: dict[str, Any]) -> None:
        """Record each parameter's shape (name -> (shape, dtype) or shape); later refits are checked against it."""
        shapes: dict[str, tuple[int, ...]] = {}
        for name, info in state_dict_info.items():
            shapes[str(name)] = _shape_of(info)
        if self.pool.param_shapes is None:
            self.pool.param_shapes = shapes
        else:
            for name, shape in shapes.items():
                known = self.pool.param_shapes.get(name)
                if known is not None and tuple(known) != shape:
                    raise WeightSyncError(f"prepare_refit_info: {name} has shape {shape}, the pool's model has {tuple(known)}")
            self.pool.param_shapes.update(shapes)

    def stage_weights(self, named_tensors: Mapping[str, Any]) -> None:
        """The pool's addition: hand over the tensors the trainer would stream; the next refit call publishes them."""
        for name, tensor in named_tensors.items():
            self.pool.update_weights_from_tensor(str(name), tensor)
            self._staged[str(name)] = True

    def _refit(self, call: str) -> list[Any]:
        if not self._staged:
            raise WeightSyncError(f"{call}: nothing to publish; the pool takes weights by value: call stage_weights(state_dict) "
                                  "with what policy.stream_weights_via_ipc_zmq / broadcast_weights_for_collective would send")
        self._staged.clear()
        self.pool.commit_weights()
        return [True]

    def update_weights_via_ipc_zmq(self) -> list[Any]:
        """Publish the staged weights as one new version; ``[True]`` (NeMo-RL's futures resolve to per-worker success)."""
        return self._refit("update_weights_via_ipc_zmq")

    def update_weights_from_collective(self) -> list[Any]:
        """As `update_weights_via_ipc_zmq` (there is no collective on a pool)."""
        return self._refit("update_weights_from_collective")

    # ------------------------------------------------------------------ servers, memory, lifecycle

    def get_sglang_server_urls(self) -> list[str]:
        """The live workers' ids (workers dial out and have no URL)."""
        return self.pool.worker_urls()

    def get_sglang_url_to_gpu_uuids(self) -> dict[str, list[str]]:
        """Worker id -> GPU UUIDs; the pool does not report GPU UUIDs, so each list is empty."""
        return {w: [] for w in self.pool.worker_urls()}

    def _tags(self, call: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, ...]:
        if args:
            raise UnsupportedParameterError(f"{call}(*args)", f"positional arguments {args!r} mean nothing to the pool (tags= is honoured)")
        extra = sorted(k for k in kwargs if k != "tags")
        if extra:
            raise UnsupportedParameterError(f"{call}({extra[0]}=)", f"only tags= is honoured, got {extra}")
        tags = kwargs.get("tags")
        return tuple(tags) if tags else ALL_MEMORY_TAGS

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Resume the workers' memory (``tags=`` for part of it) when memory saving is on; True on success."""
        tags = self._tags("prepare_for_generation", args, kwargs)
        return self.pool.prepare_for_generation(tags) if self.memory_saver else True

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Release the workers' memory when memory saving is on (the prefix cache stays warm otherwise); True on success."""
        tags = self._tags("finish_generation", args, kwargs)
        return self.pool.finish_generation(tags) if self.memory_saver else True

    def invalidate_kv_cache(self) -> bool:
        """Flush every worker's KV cache; True if all did."""
        return self.pool.invalidate_kv_cache()

    def shutdown(self) -> bool:
        """Close this client (the pool keeps serving other trainers)."""
        return self.pool.shutdown()



def _shape_of(info: Any) -> tuple[int, ...]:
    """A shape from NeMo-RL's refit info: ``(shape, dtype)``, a tensor-like with ``.shape``, or a bare shape."""
    if isinstance(info, tuple) and len(info) == 2 and isinstance(info[0], (tuple, list)):
        return tuple(int(d) for d in info[0])
    if hasattr(info, "shape"):
        return tuple(int(d) for d in info.shape)
    return tuple(int(d) for d in info)
