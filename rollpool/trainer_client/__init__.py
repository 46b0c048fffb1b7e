"""rollpool.trainer_client: the trainer's client library (imports `protocol` and `weights`).

`TrainerClient` (asyncio), `SyncTrainerClient` (blocking, for plain training
loops) and `RolloutPool` (the generation-engine calls RL frameworks make).
"""

from __future__ import annotations

from rollpool.trainer_client.client import (
    RolloutBatch,
    SubmitResult,
    TrainerClient,
    TrainerClientConfig,
    UnfillableBatchError,
    make_prompt,
    new_prompt_id,
)
from rollpool.trainer_client.ledger import STALE_POLICIES, PromptReport, TrainSample
from rollpool.trainer_client.pool import RolloutPool
from rollpool.trainer_client.sync import SyncTrainerClient

__all__ = [
    "TrainerClient",
    "TrainerClientConfig",
    "SyncTrainerClient",
    "RolloutPool",
    "RolloutBatch",
    "SubmitResult",
    "UnfillableBatchError",
    "PromptReport",
    "TrainSample",
    "STALE_POLICIES",
    "make_prompt",
    "new_prompt_id",
]
