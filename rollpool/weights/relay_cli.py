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
import signal
from dataclasses import dataclass, field

from rollpool.protocol.config import add_config_arguments, load_config
from rollpool.protocol.errors import ConfigError
from rollpool.protocol.metrics import MetricsSink
from rollpool.protocol.sockets import SecurityConfig, SocketFactory

__all__ = ["HELP", "RelayConfig", "add_arguments", "run", "main", "default_pub_endpoint"]

HELP = "serve one node's workers weights from one upstream fetch per version"


def default_pub_endpoint(router_endpoint: str) -> str:
    """The PUB endpoint beside a ROUTER endpoint: the next tcp port, or ``<path>.pub`` for ipc."""
    if router_endpoint.startswith("ipc://"):
        return router_endpoint + ".pub"
    if router_endpoint.startswith("tcp://"):
        host, _, port = router_endpoint[len("tcp://") :].rpartition(":")
        if port == "*":
            return router_endpoint
        if port.isdigit():
            return f"tcp://{host}:{int(port) + 1}"
    raise ConfigError(f"cannot derive a PUB endpoint from {router_endpoint!r}; give --bind-pub")


@dataclass(frozen=True)
class RelayConfig:
    upstream: str = field(default="", metadata={"help": "the upstream publisher's (or relay's) ROUTER endpoint"})
    upstream_pub: str | None = field(default=None, metadata={"help": "the upstream PUB endpoint (announcements)"})
    bind: str = field(default="tcp://127.0.0.1:6100", metadata={"help": "the ROUTER endpoint local workers fetch from"})
    bind_pub: str | None = field(default=None, metadata={"help": "the PUB endpoint to announce on (default: beside --bind)"})
    keep_versions: int = field(default=2, metadata={"help": "versions kept and served"})
    window_chunks: int = field(default=16, metadata={"help": "chunk requests outstanding upstream"})
    fetch_timeout_s: float = field(default=30.0, metadata={"help": "longest wait for any upstream reply"})
    max_refetch: int = field(default=3, metadata={"help": "re-asks of a silent upstream / refetches of a bad bucket"})
    poll_interval_s: float = field(default=5.0, metadata={"help": "how often to ask upstream for its latest version"})
    pool: str = field(default="default", metadata={"help": "pool name (monitoring keys)"})
    curve_dir: str | None = field(default=None, metadata={"help": "CURVE key directory from `rollpool keys gen` (None: plaintext)"})

    def __post_init__(self) -> None:
        if not self.upstream:
            raise ConfigError("RelayConfig.upstream is required (--upstream ENDPOINT)")
        if self.keep_versions < 1:
            raise ConfigError(f"RelayConfig.keep_versions must be >= 1, got {self.keep_versions}")
        if not 1 <= self.window_chunks <= 1024:
            raise ConfigError(f"RelayConfig.window_chunks must be in [1, 1024], got {self.window_chunks}")
        if self.fetch_timeout_s <= 0 or self.poll_interval_s <= 0:
            raise ConfigError("RelayConfig.fetch_timeout_s and poll_interval_s must be > 0")
        if self.max_refetch < 0:
            raise ConfigError(f"RelayConfig.max_refetch must be >= 0, got {self.max_refetch}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="TOML file (table [relay])")
    add_config_arguments(parser, RelayConfig)


async def _serve(config: RelayConfig, metrics: MetricsSink | None = None) -> None:
    import zmq.asyncio

    from rollpool.weights.relay import Relay

    ctx = zmq.asyncio.Context()
    sockets = SocketFactory(ctx, security=SecurityConfig.from_dir(config.curve_dir, role="relay"))
    relay = Relay(
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
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, relay.stop)
    loop.add_signal_handler(signal.SIGHUP, sockets.reload_keys)  # CURVE key rotation without a restart
    try:
        await relay.run()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        sockets.close()
        ctx.destroy(linger=0)
        if metrics is not None:
            metrics.close()


def run(args: argparse.Namespace, metrics: MetricsSink | None = None) -> int:
    config = load_config(RelayConfig, args, toml_path=getattr(args, "config", None), section="relay")
    asyncio.run(_serve(config, metrics))
    return 0


def main(argv: list[str] | None = None) -> int:
    from rollpool.protocol.logs import add_logging_arguments, configure_logging_from_args

    parser = argparse.ArgumentParser(prog="python -m rollpool.weights.relay", description=HELP)
    add_logging_arguments(parser)
    add_arguments(parser)
    args = parser.parse_args(argv)
    configure_logging_from_args(args)
    return run(args)
