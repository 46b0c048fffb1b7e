"""`rollpool broker` / `python -m rollpool.broker`: run the broker until SIGTERM or SIGINT (exit 0).

SIGHUP reads the CURVE allowed-keys directories again (keys added or revoked without a restart).
A bad configuration, or an endpoint something else already listens on, exits 2 with one line on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from rollpool.broker.config import BrokerConfig
from rollpool.broker.service import Broker, tune_gc
from rollpool.cli._service import run_service
from rollpool.launch.local import check_endpoint_free
from rollpool.protocol.config import add_config_arguments, load_config
from rollpool.protocol.metrics import MetricsSink

__all__ = ["HELP", "add_arguments", "run"]

HELP = "run the ZeroMQ broker (prompt queue, leases, staleness admission)"

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="TOML file with a [broker] table (env ROLLPOOL_CONFIG)")
    add_config_arguments(parser, BrokerConfig)


async def _serve(config: BrokerConfig, metrics: MetricsSink | None = None) -> None:
    await run_service(lambda sockets: Broker(config, sockets, metrics), curve_dir=config.curve_dir, metrics=metrics)


def run(args: argparse.Namespace, metrics: MetricsSink | None = None) -> int:
    config = load_config(BrokerConfig, args, toml_path=getattr(args, "config", None), section="broker")  # ConfigError: exit 2 (rollpool.cli)
    check_endpoint_free(config.worker_endpoint, "BrokerConfig.worker_endpoint")
    check_endpoint_free(config.client_endpoint, "BrokerConfig.client_endpoint")
    tune_gc()  # this process runs the broker alone
    asyncio.run(_serve(config, metrics))
    return 0
