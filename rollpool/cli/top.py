"""``rollpool top``: a live terminal view of a pool, redrawn with plain ANSI codes (no curses).

``--once`` prints one frame without escape codes and exits (scripts, tests).
While Redis is unreachable the view says so and keeps retrying; Ctrl-C exits 0.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time

from rollpool.cli._reader_args import add_reader_arguments, reader_target

HELP = "live terminal view of a pool: workers, broker counters, lag histogram, recent events"

_HOME_CLEAR = "\x1b[H\x1b[2J"
_HIDE_CURSOR = "\x1b[?25l"
_SHOW_CURSOR = "\x1b[?25h"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_reader_arguments(parser)
    parser.add_argument("--interval-s", type=float, default=1.0, help="seconds between redraws (default 1)")
    parser.add_argument("--events", type=int, default=10, help="recent events shown (default 10)")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.add_argument("--no-color", action="store_true", help="no ANSI colors")


def run(args: argparse.Namespace) -> int:
    import redis

    from rollpool.monitor.reader import PoolReader
    from rollpool.monitor.terminal import render_frame

    target = reader_target(args)
    if target is None:
        return 2
    url, pool = target
    tty = sys.stdout.isatty()
    color = tty and not args.no_color
    interval_s = max(0.1, args.interval_s)
    with PoolReader(url, pool) as reader:
        if args.once:
            try:
                state = reader.snapshot(events=args.events)
            except (redis.RedisError, OSError) as exc:
                print(f"rollpool top: cannot read {url}: {exc}", file=sys.stderr)
                return 1
            width = shutil.get_terminal_size((100, 40)).columns
            sys.stdout.write(render_frame(state, width=width, color=color, events=args.events))
            sys.stdout.flush()
            return 0
        if tty:
            sys.stdout.write(_HIDE_CURSOR)
        try:
            while True:
                width = shutil.get_terminal_size((100, 40)).columns
                try:
                    frame = render_frame(reader.snapshot(events=args.events), width=width, color=color, events=args.events)
                except (redis.RedisError, OSError) as exc:
                    frame = f"rollpool top  pool {pool}: cannot read {url}: {exc} (retrying)\n"
                sys.stdout.write((_HOME_CLEAR if tty else "") + frame)
                sys.stdout.flush()
                time.sleep(interval_s)
        except KeyboardInterrupt:
            return 0
        finally:
            if tty:
                sys.stdout.write(_SHOW_CURSOR)
                sys.stdout.flush()
