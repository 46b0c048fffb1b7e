"""`RolloutPool`: the calls RL frameworks make on their generation engines, served by the pool.

Code written against an SGLang-style engine object (LightRFT's
`RLGenerationEngine`, NeMo-RL's `SGLangGeneration`, AReaL's SGLang backend)
ports by swapping the object: `generate` returns SGLang-shaped dicts
(``text``, ``output_ids``, ``meta_info`` with ``output_token_logprobs``,
``finish_reason``, ``weight_version``), `n > 1` in the sampling params expands
prompt-major as SGLang does, and weight updates become published versions.
docs/porting.md maps each call and lists the semantic differences.

The pool owns one `SyncTrainerClient`; every group it pulls belongs to its own
requests. Staged tensors (`update_weights_from_tensor`) are published as one
new version by the next `generate` or by `commit_weights()`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from rollpool.protocol import GroupResult, GroupState, MetricsSink, SamplingParams, Trajectory
from rollpool.trainer_client.client import TrainerClientConfig, make_prompt
from rollpool.trainer_client.sync import SyncTrainerClient

__all__ = ["RolloutPool"]

PromptLike = str | Sequence[int]


class RolloutPool:
    def __init__(self, broker: str | None = None, *, config: TrainerClientConfig | None = None,
                 metrics: MetricsSink | None = None, initial_version: int = 0, timeout_s: float | None = 600.0) -> None:
        self._client = SyncTrainerClient(broker, config=config, metrics=metrics)
        self.version = max(initial_version, self._client.version)
        self.timeout_s = timeout_s
        self._staged: dict[str, Any] = {}
        self._done: dict[str, GroupResult] = {}

    # ------------------------------------------------------------------ generation

    def _submit(self, prompt: PromptLike | Sequence[PromptLike] | None, input_ids: Sequence[int] | Sequence[Sequence[int]] | None,
                sampling_params: Mapping[str, Any] | None) -> tuple[list[str], int]:
        if self._staged:
            self.commit_weights()
        items: list[PromptLike]
        if input_ids is not None:
            first = input_ids[0] if len(input_ids) else None
            items = [list(x) for x in input_ids] if isinstance(first, Sequence) else [list(input_ids)]  # type: ignore[arg-type]
        elif isinstance(prompt, str):
            items = [prompt]
        elif prompt is not None:
            items = list(prompt)  # type: ignore[arg-type]
        else:
            raise ValueError("generate needs prompt or input_ids")
        params = dict(sampling_params or {})
        n = int(params.pop("n", 1))
        fields: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in params.items()}
        sampling = SamplingParams(**fields)
        prompts = [make_prompt(p, group_size=n, sampling=sampling) for p in items]
        result = self._client.submit(prompts)
        if result.rejected:
            from rollpool.protocol import RejectedError

            pid, reason = next(iter(result.rejected.items()))
            raise RejectedError(reason, f"{len(result.rejected)} prompts rejected (first: {pid})")
        return [p.prompt_id for p in prompts], n

    def _collect(self, wanted: set[str]) -> None:
        while not wanted <= self._done.keys():
            batch = self._client.get_batch(1, timeout=self.timeout_s)
            for g in batch.groups + batch.other:
                self._done[g.prompt_id] = g

    def generate(self, prompt: PromptLike | Sequence[PromptLike] | None = None, sampling_params: Mapping[str, Any] | None = None,
                 input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None, return_logprob: bool = False,
                 **_ignored: Any) -> list[dict[str, Any]]:
        """Generate for one prompt or a batch; a list of SGLang-shaped dicts (prompt-major for n > 1)."""
        ids, n = self._submit(prompt, input_ids, sampling_params)
        self._collect(set(ids))
        out: list[dict[str, Any]] = []
        for pid in ids:
            out.extend(self._to_sglang(self._done.pop(pid), n, return_logprob))
        return out

    async def generate_async(self, prompt: PromptLike | Sequence[PromptLike] | None = None,
                             sampling_params: Mapping[str, Any] | None = None,
                             input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                             return_logprob: bool = False, **_ignored: Any) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """Yield ``(index, result)`` as each group finishes (index in the prompt-major expanded order)."""
        ids, n = await asyncio.to_thread(self._submit, prompt, input_ids, sampling_params)
        index_of = {pid: i for i, pid in enumerate(ids)}
        left = set(ids)
        while left:
            batch = await asyncio.to_thread(self._client.get_batch, 1, None, self.timeout_s)
            for g in batch.groups + batch.other:
                if g.prompt_id not in left:
                    self._done[g.prompt_id] = g
                    continue
                left.discard(g.prompt_id)
                for j, res in enumerate(self._to_sglang(g, n, return_logprob)):
                    yield index_of[g.prompt_id] * n + j, res

    @staticmethod
    def _to_sglang(g: GroupResult, n: int, return_logprob: bool) -> list[dict[str, Any]]:
        if g.state != GroupState.DONE:
            return [{"text": "", "output_ids": [], "meta_info": {"id": f"{g.prompt_id}:{i}", "finish_reason": {"type": "abort", "message": f"{g.state}: {g.reason}"}}} for i in range(n)]
        trajs: list[Trajectory] = sorted(g.trajectories, key=lambda t: t.sample_index)
        out = []
        for t in trajs:
            meta: dict[str, Any] = {
                "id": t.trajectory_id,
                "finish_reason": {"type": t.finish_reason},
                "prompt_tokens": int(len(t.input_ids)),
                "completion_tokens": int(len(t.output_ids)),
                "weight_version": str(int(t.token_versions.min())) if len(t.token_versions) else "",
                "token_versions": t.token_versions.tolist(),
                "worker_id": t.worker_id,
                "reward": t.reward,
                "finished_at": t.finished_at,
            }
            if return_logprob:
                meta["output_token_logprobs"] = [(float(lp), int(tok), None) for lp, tok in zip(t.output_logprobs, t.output_ids, strict=True)]
            out.append({"text": t.output_text or "", "output_ids": t.output_ids.tolist(), "meta_info": meta})
        return out

    # ------------------------------------------------------------------ weights

    def update_weights_from_tensor(self, name: str, tensor: Any) -> None:
        """Stage one tensor; the next generate (or commit_weights) publishes all staged tensors as a new version."""
        self._staged[name] = tensor

    def commit_weights(self) -> int:
        """Publish the staged tensors as one new version; returns it."""
        staged, self._staged = self._staged, {}
        return self.update_weights(staged)

    def update_weights(self, named_tensors: Mapping[str, Any] | Any) -> int:
        """Publish a new weight version (a dict, a module or an iterator of (name, tensor))."""
        self.version += 1
        self._client.publish_weights(named_tensors, self.version)
        return self.version

    def update_weights_from_disk(self, path: str) -> int:
        """Workers load an HF checkpoint directory from a path they share with the trainer; a new version."""
        self.version += 1
        self._client.control("update_weights_from_disk", path=path, version=self.version)
        self._client.set_version(self.version)
        return self.version

    # ------------------------------------------------------------------ memory and lifecycle

    def sleep(self, tags: Sequence[str] = ()) -> None:
        self._client.sleep(tags)

    def wake_up(self, tags: Sequence[str] = ()) -> None:
        self._client.wake(tags)

    def prepare_for_generation(self, tags: Sequence[str] = ()) -> None:
        self.wake_up(tags)

    def finish_generation(self, tags: Sequence[str] = ()) -> None:
        self.sleep(tags)

    def invalidate_kv_cache(self) -> None:
        self._client.flush_cache()

    def worker_urls(self) -> list[str]:
        """The ids of the live workers (a worker dials out, so it has no URL of its own)."""
        return sorted(self._client.status()["workers"])

    def status(self) -> dict[str, Any]:
        return self._client.status()

    def shutdown(self) -> None:
        self._client.close()

    def __enter__(self) -> RolloutPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
