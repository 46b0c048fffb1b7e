"""rollpool.broker: the ZeroMQ broker (imports only `rollpool.protocol`).

`BrokerState` is the pure state machine (leases, credits, staleness admission,
apply slots) with an injected clock; `Broker` is the thin asyncio service that
puts it on two ROUTER sockets. See docs/broker.md.
"""

from __future__ import annotations

from rollpool.broker.config import BrokerConfig
from rollpool.broker.service import Broker
from rollpool.broker.state import BrokerState, Group, Phase, WorkerInfo

__all__ = ["Broker", "BrokerConfig", "BrokerState", "Group", "Phase", "WorkerInfo"]
