"""Prompt images on the worker: every accepted form read, every bad one refused with a reason naming it."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import pathlib
import re

import pytest

from rollpool.protocol import PromptImage
from rollpool.protocol.errors import RequestRefusedError
from rollpool.workers.images import ImagePolicy, load_images

PIL = pytest.importorskip("PIL.Image")


def png(colour: tuple[int, int, int] = (255, 0, 0), size: int = 32, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    PIL.new("RGB", (size, size), colour).save(buf, fmt)
    return buf.getvalue()


def test_bytes_data_uri_and_path_are_read_with_their_sha256(tmp_path: pathlib.Path) -> None:
    data = png()
    (tmp_path / "red.png").write_bytes(data)
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    images = [PromptImage.of(data), PromptImage.of(uri), PromptImage.of(str(tmp_path / "red.png"))]
    assert images[1].data is not None and bytes(images[1].data) == data and images[2].path
    loaded = load_images(images, ImagePolicy())
    assert [im.data for im in loaded] == [data] * 3
    assert {im.sha256 for im in loaded} == {hashlib.sha256(data).hexdigest()}
    assert loaded[0].format == "PNG" and loaded[0].size == (32, 32)


def test_a_malformed_data_uri_is_the_callers_error_before_anything_is_sent() -> None:
    with pytest.raises(ValueError, match="invalid base64"):
        PromptImage.of("data:image/png;base64,@@@")
    with pytest.raises(ValueError, match="data:<type>;base64"):
        PromptImage.of("data:image/png,rawbytes")
    assert PromptImage.of("https://example.com/a.png").url


@pytest.mark.parametrize("case,reason", [
    ("corrupt", "corrupt image"),
    ("not_an_image", "not an image file"),
    ("unsupported_format", "format TIFF is not accepted"),
    ("unreadable_path", "cannot read"),
    ("url_fetch_off", "does not fetch images"),
    ("too_many", "3 images in one prompt, limit 2"),
    ("too_large", "limit 1000 (image max_image_bytes)"),
    ("too_many_pixels", "64x64 pixels, limit 1024"),
    ("none_set", "exactly one of data, path or url"),
])
def test_a_bad_image_is_refused_with_the_reason(case: str, reason: str, tmp_path: pathlib.Path) -> None:
    policy = ImagePolicy(max_images=2)
    good = PromptImage(data=png())
    images: list[PromptImage]
    if case == "corrupt":
        buf = io.BytesIO()
        PIL.frombytes("RGB", (64, 64), bytes(range(256)) * 48).save(buf, "PNG")
        images = [PromptImage(data=buf.getvalue()[: len(buf.getvalue()) // 2])]  # truncated: the header reads, the pixels do not
    elif case == "not_an_image":
        images = [PromptImage(data=b"hello, not an image")]
    elif case == "unsupported_format":
        images = [PromptImage(data=png(fmt="TIFF"))]
    elif case == "unreadable_path":
        locked = tmp_path / "locked.png"
        locked.write_bytes(png())
        os.chmod(locked, 0)
        images = [PromptImage(path=str(tmp_path / "missing.png"))] if os.access(locked, os.R_OK) else [PromptImage(path=str(locked))]
    elif case == "url_fetch_off":
        images = [PromptImage(url="http://127.0.0.1:9/cat.png")]
    elif case == "too_many":
        images = [good, good, good]
    elif case == "too_large":
        policy = ImagePolicy(max_image_bytes=1000)
        images = [PromptImage(data=png(size=64) + b"\0" * 1000)]
    elif case == "too_many_pixels":
        policy = ImagePolicy(max_pixels=1024)
        images = [PromptImage(data=png(size=64))]
    else:
        images = [PromptImage()]
    with pytest.raises(RequestRefusedError, match=re.escape(reason)):
        load_images(images, policy)


def test_a_url_is_fetched_only_when_allowed_and_then_under_its_size_limit() -> None:
    import http.server
    import threading

    body = png()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/a.png"
        assert load_images([PromptImage(url=url)], ImagePolicy(fetch=True))[0].data == body
        with pytest.raises(RequestRefusedError, match="max_image_bytes"):
            load_images([PromptImage(url=url)], ImagePolicy(fetch=True, max_image_bytes=len(body) - 1))
        with pytest.raises(RequestRefusedError, match="does not fetch"):
            load_images([PromptImage(url=url)], ImagePolicy())
    finally:
        server.shutdown()
        server.server_close()


def test_an_image_past_the_peers_message_limit_gets_the_named_limit_error_before_it_is_sent() -> None:
    from rollpool.protocol import Prompt, Submit, encode
    from rollpool.protocol.codec import check_size
    from rollpool.protocol.errors import MessageTooLargeError

    big = Prompt(prompt_id="p", text="x", images=(PromptImage(data=b"\0" * (2 << 20)),))
    frames = encode(Submit(request_id="r", prompts=(big,)))
    with pytest.raises(MessageTooLargeError) as info:
        check_size(frames, 1 << 20, "submit")
    assert info.value.limit == "max_msg_bytes"
    check_size(frames, 4 << 20, "submit")  # within the limit: sent
