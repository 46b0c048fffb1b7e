"""rollpool.weights: bucketing, publisher, subscriber and relay (imports only `rollpool.protocol`).

torch is imported when a name is first used, so ``import rollpool.weights``
stays cheap for processes that never touch weights (the broker).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollpool.weights.publisher import WeightPublisher
    from rollpool.weights.relay import Relay
    from rollpool.weights.subscriber import WeightSubscriber, WeightVersion, WeightVersionGoneError

__all__ = ["WeightPublisher", "WeightSubscriber", "WeightVersion", "WeightVersionGoneError", "Relay"]

_HOMES = {
    "WeightPublisher": "rollpool.weights.publisher",
    "WeightSubscriber": "rollpool.weights.subscriber",
    "WeightVersion": "rollpool.weights.subscriber",
    "WeightVersionGoneError": "rollpool.weights.subscriber",
    "Relay": "rollpool.weights.relay",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'rollpool.weights' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
