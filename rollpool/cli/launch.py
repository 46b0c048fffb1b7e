"""``rollpool launch local|ray``: start a whole pool (local) or a fleet of workers (Ray) with one command.

    rollpool launch local --workers 4 --engine sim --log-dir logs/
    rollpool launch ray --workers 8 --gpus-per-worker 1 --broker tcp://head:5555 --model /models/qwen

Both run in the foreground until SIGTERM/SIGINT, restart what dies (bounded
backoff) and stop everything they started before they exit (0 when stopped by
a signal, 1 when a process had to be given up, 2 on a bad configuration).
Slurm and Kubernetes have their own artifacts under ``ops/`` (docs/deploy.md).
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from rollpool.launch.local import LocalLaunchConfig, run_local
from rollpool.launch.ray_launch import RayLaunchConfig, run_ray
from rollpool.monitor.sink import add_redis_arguments, redis_url_from
from rollpool.protocol.config import add_config_arguments, load_config

__all__ = ["HELP", "add_arguments", "run"]

HELP = "launch a pool: local (broker + N supervised workers) or ray (workers as Ray actors)"

log = logging.getLogger(__name__)


def _add_logging(parser: argparse.ArgumentParser) -> None:
    """The shared logging flags after the launcher too (``launch local --log-level DEBUG``); SUPPRESS keeps a value
    given before it (``launch --log-level DEBUG local``), which an ordinary default would overwrite."""
    parser.add_argument("--log-level", default=argparse.SUPPRESS, help="DEBUG, INFO, WARNING, ERROR (env ROLLPOOL_LOG_LEVEL); "
                        "the launched processes log at this level too")
    parser.add_argument("--log-json", action="store_true", default=argparse.SUPPRESS, help="one JSON object per log line")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="launcher", metavar="LAUNCHER", required=True)
    local = sub.add_parser("local", help="broker, N workers (and a relay) on this machine, supervised",
                           description="Run a broker, N workers (and a relay) on this machine under a supervisor until SIGTERM/SIGINT.")
    _add_logging(local)
    local.add_argument("--config", default=None, help="TOML file with a [launch] table (env ROLLPOOL_CONFIG)")
    add_config_arguments(local, LocalLaunchConfig)
    add_redis_arguments(local, pool=False)
    ray = sub.add_parser("ray", help="workers as Ray actors in a placement group (broker elsewhere)",
                         description="Run N workers as Ray actors, one per placement-group bundle, until SIGTERM/SIGINT.")
    _add_logging(ray)
    ray.add_argument("--config", default=None, help="TOML file with a [launch_ray] table (env ROLLPOOL_CONFIG)")
    add_config_arguments(ray, RayLaunchConfig)
    add_redis_arguments(ray, pool=False)


def run(args: argparse.Namespace) -> int:
    log_level = getattr(args, "log_level", None)
    # a ConfigError exits 2 in rollpool.cli.main
    if args.launcher == "local":
        local_cfg = load_config(LocalLaunchConfig, args, toml_path=args.config, section="launch")
        return asyncio.run(run_local(local_cfg, redis_url=redis_url_from(args), log_level=log_level))
    ray_cfg = load_config(RayLaunchConfig, args, toml_path=args.config, section="launch_ray")
    return run_ray(ray_cfg, redis_url=redis_url_from(args), log_level=log_level)
