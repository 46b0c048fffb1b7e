"""The exporter: Prometheus text on ``/metrics``, a live dashboard on ``/``, JSON on ``/api/state``.

A stdlib ``ThreadingHTTPServer``; each request reads one snapshot through a
shared `PoolReader` (snapshots are cached for ``cache_s`` so a dashboard and a
scraper do not multiply the Redis load). The dashboard and its chart code are
files of this package (``rollpool/monitor/static``), served from ``/static/``;
no CDN. When Redis cannot be read, ``/metrics`` still answers 200 with
``rollpool_up 0`` and ``/api/state`` answers 503 with the error. Binds to
loopback unless told otherwise: the pages carry no authentication.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

from rollpool.monitor.prometheus import CONTENT_TYPE, render_down, render_prometheus
from rollpool.monitor.reader import PoolReader, PoolState

__all__ = ["ExporterServer", "STATIC_FILES"]

log = logging.getLogger(__name__)

STATIC_FILES: dict[str, str] = {
    "index.html": "text/html; charset=utf-8",
    "chart.js": "text/javascript; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
}


def _static(name: str) -> bytes:
    return resources.files("rollpool.monitor").joinpath("static", name).read_bytes()


class _SnapshotCache:
    def __init__(self, reader: PoolReader, cache_s: float) -> None:
        self.reader = reader
        self.cache_s = cache_s
        self._lock = threading.Lock()
        self._at = 0.0
        self._state: PoolState | None = None

    def get(self) -> PoolState:
        with self._lock:
            now = time.monotonic()
            if self._state is None or now - self._at > self.cache_s:
                self._state = self.reader.snapshot(events=30, series=True, series_points=300)
                self._at = now
            return self._state


class ExporterServer:
    """``ExporterServer(url, pool, host, port)``; ``serve_forever()`` / ``start()`` in a thread; ``close()``."""

    def __init__(self, url: str, pool: str, *, host: str = "127.0.0.1", port: int = 9464, cache_s: float = 0.5) -> None:
        import redis

        self.pool = pool
        self.reader = PoolReader(url, pool)
        self.cache = _SnapshotCache(self.reader, cache_s)
        self._redis_errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._thread: threading.Thread | None = None
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "rollpool-exporter"

            def do_GET(self) -> None:  # the stdlib's name
                exporter._handle(self)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("%s " + format, self.address_string(), *args)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    @property
    def url(self) -> str:
        host = self.httpd.server_address[0]
        host = host.decode() if isinstance(host, bytes) else str(host)
        return f"http://{host}:{self.port}"

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def start(self) -> ExporterServer:
        self._thread = threading.Thread(target=self.serve_forever, name="rollpool-exporter", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(5)
        self.httpd.server_close()
        self.reader.close()

    def _handle(self, req: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(req.path)
        path = parts.path
        try:
            if path == "/metrics":
                try:
                    body = render_prometheus(self.cache.get())
                except self._redis_errors as exc:
                    log.warning("exporter: cannot read redis: %s", exc)
                    body = render_down(self.pool)
                self._send(req, HTTPStatus.OK, CONTENT_TYPE, body.encode())
            elif path in ("/", "/index.html"):
                self._send(req, HTTPStatus.OK, STATIC_FILES["index.html"], _static("index.html"))
            elif path.startswith("/static/") and path[len("/static/") :] in STATIC_FILES:
                name = path[len("/static/") :]
                self._send(req, HTTPStatus.OK, STATIC_FILES[name], _static(name))
            elif path == "/api/state":
                query = parse_qs(parts.query)
                try:
                    state = self.cache.get().to_dict()
                except self._redis_errors as exc:
                    err = json.dumps({"error": str(exc), "pool": self.pool}).encode()
                    self._send(req, HTTPStatus.SERVICE_UNAVAILABLE, "application/json", err)
                    return
                if query.get("series", ["1"])[0] in ("0", "false"):
                    state.pop("series", None)
                self._send(req, HTTPStatus.OK, "application/json", json.dumps(state, default=str).encode())
            elif path == "/healthz":
                self._send(req, HTTPStatus.OK, "text/plain; charset=utf-8", b"ok\n")
            else:
                self._send(req, HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8", b"not found\n")
        except (BrokenPipeError, ConnectionResetError):
            pass

    @staticmethod
    def _send(req: BaseHTTPRequestHandler, status: HTTPStatus, content_type: str, body: bytes) -> None:
        req.send_response(status)
        req.send_header("Content-Type", content_type)
        req.send_header("Content-Length", str(len(body)))
        req.send_header("Cache-Control", "no-store")
        req.end_headers()
        req.wfile.write(body)
