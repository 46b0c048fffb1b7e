"""``rollpool status``: one snapshot of a pool's monitoring state (``--json`` for machines).

Exit status: 0 on success, 1 when Redis cannot be read, 2 without a Redis URL.
The JSON is `PoolState.to_dict()` (see docs/monitoring.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys

from rollpool.cli._reader_args import add_reader_arguments, reader_target

HELP = "print a pool's live state from Redis (workers, broker, staleness, events)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_reader_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the state as one JSON object")
    parser.add_argument("--events", type=int, default=20, help="how many recent events to include (default 20)")
    parser.add_argument("--series", action="store_true", help="include the time series (JSON only)")


def run(args: argparse.Namespace) -> int:
    import redis

    from rollpool.monitor.reader import PoolReader
    from rollpool.monitor.terminal import render_frame

    target = reader_target(args)
    if target is None:
        return 2
    url, pool = target
    try:
        with PoolReader(url, pool) as reader:
            state = reader.snapshot(events=max(0, args.events), series=args.series)
    except (redis.RedisError, OSError) as exc:
        print(f"rollpool status: cannot read {url}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(state.to_dict(), sys.stdout, indent=2, sort_keys=True, default=str)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_frame(state, width=shutil.get_terminal_size((100, 40)).columns, events=args.events,
                                      title="status"))
    return 0
