"""From an engine's `GenerateOutput` to the `Trajectory` records of one task (and their rewards).

`build_trajectories` fills every field: ids as int32, logprobs as float32, the
per-token versions the engine reported, ``loss_mask`` all ones (every token was sampled),
and timings. ``metadata`` echoes the prompt's, plus ``simulated: true`` from a simulated
engine. `score_trajectories` runs the reward function beside the engine. Its failure
is data: the reward stays None and ``metadata["reward_error"]`` says why.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import numpy as np

from rollpool.protocol.messages import Task, Trajectory
from rollpool.workers.engines.base import GenerateOutput
from rollpool.workers.reward import RewardFn, score

__all__ = ["build_trajectories", "score_trajectories"]

log = logging.getLogger(__name__)


def build_trajectories(task: Task, out: GenerateOutput, worker_id: str, image_sha256: tuple[str, ...] = ()) -> list[Trajectory]:
    prompt = task.prompt
    grid = None if out.image_grid_thw is None else np.asarray(out.image_grid_thw, dtype=np.int32)
    input_ids = np.asarray(out.input_ids, dtype=np.int32)
    base_meta = dict(prompt.metadata)
    if out.simulated:
        base_meta["simulated"] = True
    input_logprobs = None if out.input_logprobs is None else np.asarray(out.input_logprobs, dtype=np.float32)
    trajectories = []
    for s in out.samples:
        n_out = len(s.output_ids)
        trajectories.append(
            Trajectory(
                prompt_id=prompt.prompt_id,
                sample_index=s.index,
                input_ids=input_ids,
                output_ids=np.asarray(s.output_ids, dtype=np.int32),
                output_logprobs=np.asarray(s.logprobs, dtype=np.float32),
                token_versions=np.asarray(s.token_versions, dtype=np.int32),
                loss_mask=np.ones(n_out, dtype=np.uint8),
                finish_reason=s.finish_reason,
                worker_id=worker_id,
                attempt=task.attempt,
                output_text=s.output_text,
                queued_at=task.queued_at,
                started_at=out.started_at,
                first_token_at=s.first_token_at,
                finished_at=s.finished_at,
                reward=None,
                metadata=dict(base_meta),
                output_top_ids=None if s.top_ids is None else np.asarray(s.top_ids, dtype=np.int32).reshape(-1),
                output_top_logprobs=None if s.top_logprobs is None else np.asarray(s.top_logprobs, dtype=np.float32).reshape(-1),
                input_logprobs=input_logprobs,
                image_sha256=image_sha256,
                image_grid_thw=grid,
            )
        )
    return trajectories


async def score_trajectories(fn: RewardFn, task: Task, trajectories: list[Trajectory], timeout_s: float) -> list[Trajectory]:
    """Every trajectory with its reward (scored concurrently); a failure is recorded, never raised."""
    metadata = task.prompt.metadata
    scored = await asyncio.gather(*(score(fn, metadata, t, timeout_s) for t in trajectories))
    out = []
    for t, (value, error) in zip(trajectories, scored, strict=True):
        if error is not None:
            t.metadata["reward_error"] = error
            log.warning("reward for %s: %s", t.trajectory_id, error)
        out.append(dataclasses.replace(t, reward=value))
    return out
