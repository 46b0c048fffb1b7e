"""The dashboard in headless Chromium (Debian's chromium) against an exporter fed by a real Redis.

The page's own scripts fetch /api/state, fill the tables and draw the charts; the
test reads the rendered DOM (each chart canvas records how many points it drew)
and a screenshot: each of the four chart canvases, found by its #ddd border, must
hold coloured line pixels above its legend (an empty chart holds none: checked
by hand against a pool with one sample per series, 0 in each empty chart).
Skipped without chromium on PATH.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from rollpool.monitor.exporter import ExporterServer
from rollpool.monitor.sink import RedisMetricsSink
from tests.integration.monitor.conftest import populate

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.redis, pytest.mark.skipif(CHROMIUM is None, reason="needs chromium")]

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         "--virtual-time-budget=5000", "--window-size=1400,1100"]
CHARTS = ("chart-queue", "chart-tokens", "chart-lag", "chart-requeues")
CANVAS_BORDER = 0xDD  # the page's 1 px #ddd border round each chart canvas (crisp; lines are drawn well inside)
LEGEND_PX = 16  # the legend strip at a canvas's foot (coloured swatches, drawn even for an empty series)


def _chromium(*args: str) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory() as profile:
        out = subprocess.run([str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", *args],
                             capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    return out


@pytest.fixture
def exporter_with_series(make_sink: Callable[..., RedisMetricsSink], redis_server: str,
                         pool: str) -> Iterator[ExporterServer]:
    sink = make_sink(series_interval_s=0.0)
    populate(sink)
    for step in range(1, 9):
        time.sleep(0.2)  # samples spread over more than 1 s: the charts' x axis spans them (shorter spans: 60 s)
        sink.publish_state("broker", "broker", {"version": 4 + step, "queued": 17 - 2 * (step % 4), "leased": 6 + step,
                                                "held": 2, "requeued": 3 + step, "failed": 1, "dropped_stale": 2})
        for w, scale in (("w1", 100.0), ("w2", 60.0)):
            sink.publish_state("worker", w, {"weight_version": 3 + step, "tokens_per_s": scale * (1 + step % 3)},
                               ttl_s=30)
        sink.observe("staleness", step % 3)
    assert sink.flush()
    time.sleep(1.1)  # one observation window, so the staleness series has a sample
    sink.observe("staleness", 1)
    assert sink.flush()
    server = ExporterServer(redis_server, pool, port=0, cache_s=0.0).start()
    yield server
    server.close()


def _chart_boxes(pixels: np.ndarray) -> list[tuple[int, int, int, int]]:
    """The chart canvases (x0, y0, x1, y1): long #ddd border runs, paired top and bottom per x span."""
    border = (pixels == CANVAS_BORDER).all(axis=2)
    edges: dict[tuple[int, int], list[int]] = {}
    for y in range(border.shape[0]):
        row = np.concatenate(([0], border[y].astype(np.int8), [0]))
        starts, ends = np.nonzero(np.diff(row) == 1)[0], np.nonzero(np.diff(row) == -1)[0]
        for x0, x1 in zip(starts, ends, strict=True):
            if x1 - x0 >= 300:  # the broker's stat boxes share the colour but are narrow
                edges.setdefault((int(x0), int(x1)), []).append(y)
    boxes = [(x0, ys[i], x1, ys[i + 1]) for (x0, x1), ys in edges.items() for i in range(0, len(ys) - 1, 2)]
    return sorted(boxes, key=lambda b: (b[1], b[0]))


def _series_pixels(pixels: np.ndarray, box: tuple[int, int, int, int]) -> int:
    """Saturated pixels in a canvas above its legend: the series' lines (title, axes, grid and labels are grey)."""
    x0, y0, x1, y1 = box
    inner = pixels[y0 + 1:y1 - LEGEND_PX, x0:x1]
    return int((inner.max(axis=2) - inner.min(axis=2) > 60).sum())


def test_the_dashboard_renders_its_charts_in_headless_chromium(exporter_with_series: ExporterServer,
                                                               tmp_path: pathlib.Path) -> None:
    url = exporter_with_series.url + "/"
    dom = _chromium("--dump-dom", url).stdout
    assert 'data-loaded="1"' in dom, dom[:2000]
    for chart in CHARTS:
        m = re.search(rf'<canvas id="{chart}"[^>]*data-points="(\d+)"', dom)
        assert m and int(m.group(1)) >= 2, (chart, m and m.group(0))
    workers = re.search(r'<table id="workers">.*?</table>', dom, re.S)
    assert workers and ">w1<" in workers.group(0) and ">w2<" in workers.group(0)

    shot = tmp_path / "dashboard.png"
    _chromium(f"--screenshot={shot}", url)
    assert shot.stat().st_size > 10_000
    image_mod = pytest.importorskip("PIL.Image")
    with image_mod.open(shot) as img:
        pixels = np.asarray(img.convert("RGB"), dtype=np.int16)
    assert pixels.shape == (1100, 1400, 3)
    boxes = _chart_boxes(pixels)
    assert len(boxes) == len(CHARTS), boxes
    for box in boxes:
        # a series drawn across the plot (2 px wide) covers hundreds of pixels; an empty chart none
        assert _series_pixels(pixels, box) >= 200, (box, _series_pixels(pixels, box))
