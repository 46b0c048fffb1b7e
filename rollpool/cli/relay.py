"""``rollpool relay``: run one weight relay (one per node) in the foreground.

    rollpool relay --upstream tcp://trainer:6000 --upstream-pub tcp://trainer:6001 \\
                   --bind tcp://0.0.0.0:6000

Without ``--bind-pub`` the relay announces on the port after ``--bind`` (tcp)
or on ``<path>.pub`` (ipc). Without ``--upstream-pub`` it learns of new
versions by asking upstream every ``--poll-interval-s``. SIGTERM/SIGINT stop it.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import TYPE_CHECKING

from rollpool.cli._service import run_service
from rollpool.protocol.config import add_config_arguments, load_config
from rollpool.protocol.metrics import MetricsSink
from rollpool.protocol.sockets import SocketFactory
from rollpool.weights.config import RelayConfig, default_pub_endpoint

if TYPE_CHECKING:
    from rollpool.weights.relay import Relay

__all__ = ["HELP", "add_arguments", "make_relay", "run"]

HELP = "serve one node's workers weights from one upstream fetch per version"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="TOML file (table [relay])")
    add_config_arguments(parser, RelayConfig)


def make_relay(config: RelayConfig, sockets: SocketFactory, metrics: MetricsSink | None = None) -> Relay:
    """The relay `config` describes (not started)."""
    from rollpool.weights.relay import Relay

    return Relay(
        sockets,
        upstream_router=config.upstream,
        upstream_pub=config.upstream_pub,
        router_endpoint=config.bind,
        pub_endpoint=config.bind_pub or default_pub_endpoint(config.bind),
        keep_versions=config.keep_versions,
        window_chunks=config.window_chunks,
        fetch_timeout_s=config.fetch_timeout_s,
        max_refetch=config.max_refetch,
        poll_interval_s=config.poll_interval_s,
        metrics=metrics,
        weights=config.path_config(),
    )


async def _serve(config: RelayConfig, metrics: MetricsSink | None = None) -> None:
    await run_service(lambda sockets: make_relay(config, sockets, metrics), curve_dir=config.curve_dir, role="relay",
                      metrics=metrics, io_threads=config.streams)


def run(args: argparse.Namespace, metrics: MetricsSink | None = None) -> int:
    config = load_config(RelayConfig, args, toml_path=getattr(args, "config", None), section="relay")
    asyncio.run(_serve(config, metrics))
    return 0
