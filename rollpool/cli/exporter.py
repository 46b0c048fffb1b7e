"""``rollpool exporter --port N``: Prometheus metrics, a live HTML dashboard and JSON state over HTTP.

Serves until SIGINT/SIGTERM; binds to 127.0.0.1 unless ``--host`` says otherwise.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from types import FrameType

from rollpool.cli._reader_args import add_reader_arguments, reader_target

HELP = "serve /metrics (Prometheus), / (live dashboard) and /api/state for a pool"

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_reader_arguments(parser)
    parser.add_argument("--port", type=int, default=9464, help="TCP port (default 9464; 0 picks a free one)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")


def run(args: argparse.Namespace) -> int:
    from rollpool.monitor.exporter import ExporterServer

    target = reader_target(args)
    if target is None:
        return 2
    url, pool = target
    server = ExporterServer(url, pool, host=args.host, port=args.port)

    def _stop(signum: int, frame: FrameType | None) -> None:
        # shutdown() waits for serve_forever, so it must not run on the serving thread.
        threading.Thread(target=server.httpd.shutdown, daemon=True).start()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
    log.info("exporter for pool %s on %s (metrics %s/metrics)", pool, server.url, server.url)
    print(f"rollpool exporter: pool {pool}: dashboard {server.url}/  metrics {server.url}/metrics", flush=True)
    try:
        server.serve_forever()
    finally:
        server.close()
    return 0
