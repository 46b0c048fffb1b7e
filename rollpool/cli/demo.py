"""`rollpool demo`: the main job (see `rollpool.demo.runner`)."""

from __future__ import annotations

import argparse
import sys

from rollpool.protocol.config import add_config_arguments, load_config

HELP = "run the whole pool on this machine: async GRPO on a tiny model with two CPU workers, then a report"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from rollpool.demo.runner import DemoConfig

    add_config_arguments(parser, DemoConfig)


def run(args: argparse.Namespace) -> int:
    import os

    from rollpool.demo.runner import DemoConfig, run_demo
    from rollpool.protocol.logs import configure_logging

    if getattr(args, "log_level", None) is None and not os.environ.get("ROLLPOOL_LOG_LEVEL"):
        # the live progress lines are the demo's output; the services' INFO logs go to their log files
        configure_logging("WARNING", getattr(args, "log_json", False))

    from rollpool.protocol import ConfigError

    try:
        cfg = load_config(DemoConfig, args, section="demo")
    except ConfigError as exc:  # a bad flag: the message, not a traceback
        print(f"rollpool demo: error: {exc}", file=sys.stderr)
        return 2
    summary = run_demo(cfg)
    return 0 if summary.get("lost", 1) == 0 and summary.get("duplicated", 1) == 0 else 1
