"""`rollpool broker` / `python -m rollpool.broker`: run the broker until SIGTERM or SIGINT (exit 0).

SIGHUP reads the CURVE allowed-keys directories again (keys added or revoked without a restart).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from rollpool.broker.config import BrokerConfig
from rollpool.broker.service import Broker
from rollpool.protocol.config import add_config_arguments, load_config
from rollpool.protocol.metrics import MetricsSink
from rollpool.protocol.sockets import SecurityConfig, SocketFactory

__all__ = ["HELP", "add_arguments", "run"]

HELP = "run the ZeroMQ broker (prompt queue, leases, staleness admission)"

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="TOML file with a [broker] table (env ROLLPOOL_CONFIG)")
    add_config_arguments(parser, BrokerConfig)


async def _serve(config: BrokerConfig, metrics: MetricsSink | None = None) -> None:
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    sockets = SocketFactory(ctx, security=SecurityConfig.from_dir(config.curve_dir))
    broker = Broker(config, sockets, metrics)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, broker.stop)
    loop.add_signal_handler(signal.SIGHUP, sockets.reload_keys)  # CURVE key rotation without a restart
    try:
        await broker.run()
    finally:
        sockets.close()
        ctx.destroy(linger=0)
        if metrics is not None:
            metrics.close()


def run(args: argparse.Namespace, metrics: MetricsSink | None = None) -> int:
    config = load_config(BrokerConfig, args, toml_path=getattr(args, "config", None), section="broker")  # ConfigError: exit 2 (rollpool.cli)
    asyncio.run(_serve(config, metrics))
    return 0
