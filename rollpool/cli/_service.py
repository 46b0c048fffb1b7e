"""`run_service`: how a service subcommand runs in the foreground, written once for broker, relay and worker.

One asyncio ZeroMQ context and `SocketFactory` (CURVE from ``curve_dir`` for ``role``); SIGTERM and SIGINT
call the service's ``stop()`` (it drains and returns from ``run()``); SIGHUP reloads the CURVE keys where
``reload_keys_on_hup`` (broker, relay: key rotation without a restart). In ``finally``, whatever happened:
the handlers are removed, every socket closes with linger 0, the context is destroyed and the metrics
sink is closed.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from typing import Any, Protocol

from rollpool.protocol.metrics import MetricsSink
from rollpool.protocol.sockets import SecurityConfig, SocketFactory

__all__ = ["Service", "run_service"]


class Service(Protocol):
    async def run(self) -> Any: ...

    def stop(self) -> None: ...


async def run_service(make: Callable[[SocketFactory], Service], *, curve_dir: str | None, role: str | None = None,
                      metrics: MetricsSink | None = None, reload_keys_on_hup: bool = True, io_threads: int = 1) -> None:
    """`io_threads`: the ZeroMQ context's I/O threads (a worker or relay fetching weights over several streams wants one per stream)."""
    import zmq.asyncio

    ctx = zmq.asyncio.Context(io_threads=max(1, io_threads))
    sockets = SocketFactory(ctx, security=SecurityConfig.from_dir(curve_dir, role=role))
    loop = asyncio.get_running_loop()
    handled: list[signal.Signals] = []
    try:
        service = make(sockets)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, service.stop)
            handled.append(sig)
        if reload_keys_on_hup:
            loop.add_signal_handler(signal.SIGHUP, sockets.reload_keys)
            handled.append(signal.SIGHUP)
        await service.run()
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        sockets.close()
        ctx.destroy(linger=0)
        if metrics is not None:
            metrics.close()
