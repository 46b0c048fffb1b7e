"""A prompt's images, read and checked on the worker before an engine sees them.

`load_images(images, policy)` turns each `PromptImage` into the encoded bytes of one image file
and returns them with their sha256, or raises `RequestRefusedError` naming the image and why, so a
bad image fails only its prompt (an error result; the worker serves on):

- ``data``: the bytes as sent;
- ``path``: read from the worker's file system (a missing or unreadable file is refused);
- ``url``: refused unless the operator allows fetching (`ImagePolicy.fetch`); then fetched with
  a time limit (`fetch_timeout_s`) and a size limit (`max_image_bytes`, checked while reading).

Every image is then opened with Pillow and checked: at most `max_images` per prompt, at most
`max_image_bytes` encoded, a format of `formats`, at most `max_pixels` pixels, and fully decodable
(a truncated or corrupt file is refused here, not in the engine's compute thread). Pillow is
imported lazily (the ``hf`` extra).
"""

from __future__ import annotations

import hashlib
import io
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

from rollpool.protocol.errors import RequestRefusedError
from rollpool.protocol.messages import PromptImage

__all__ = ["DEFAULT_IMAGE_FORMATS", "ImagePolicy", "LoadedImage", "load_image", "load_images"]

DEFAULT_IMAGE_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


@dataclass(frozen=True, slots=True)
class ImagePolicy:
    """What a worker accepts as a prompt image (the worker's ``image_*`` settings)."""

    max_images: int = 8
    max_image_bytes: int = 8 * 1024 * 1024
    max_pixels: int = 4096 * 4096
    formats: tuple[str, ...] = DEFAULT_IMAGE_FORMATS
    fetch: bool = False
    """Fetch ``url`` images (off by default: a trainer should not make workers reach arbitrary hosts)."""
    fetch_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_images < 0:
            raise ValueError(f"image max_images must be >= 0, got {self.max_images}")
        if self.max_image_bytes <= 0 or self.max_pixels <= 0:
            raise ValueError("image max_image_bytes and max_pixels must be > 0")
        if self.fetch_timeout_s <= 0:
            raise ValueError(f"image fetch_timeout_s must be > 0, got {self.fetch_timeout_s}")


@dataclass(frozen=True, slots=True)
class LoadedImage:
    data: bytes
    """The encoded image file."""
    sha256: str
    format: str
    size: tuple[int, int]
    """(width, height) in pixels."""


def load_images(images: Sequence[PromptImage], policy: ImagePolicy) -> list[LoadedImage]:
    """Each image's bytes, checked (see the module docstring); `RequestRefusedError` for the first bad one."""
    if len(images) > policy.max_images:
        raise RequestRefusedError(f"{len(images)} images in one prompt, limit {policy.max_images} (image max_images)")
    return [load_image(i, img, policy) for i, img in enumerate(images)]


def load_image(index: int, img: PromptImage, policy: ImagePolicy) -> LoadedImage:
    """Image `index` of a prompt read and checked (every rule but the count); `RequestRefusedError` naming why."""
    what = f"image {index}"
    given = sum(1 for x in (img.data is not None, bool(img.path), bool(img.url)) if x)
    if given != 1:
        raise RequestRefusedError(f"{what}: exactly one of data, path or url must be set")
    if img.data is not None:
        data = bytes(img.data)
    elif img.path:
        data = _read_path(what, img.path, policy)
    else:
        data = _fetch(what, img.url, policy)
    if len(data) > policy.max_image_bytes:
        raise RequestRefusedError(f"{what}: {len(data)} bytes, limit {policy.max_image_bytes} (image max_image_bytes)")
    fmt, size = _check_decodes(what, data, policy)
    return LoadedImage(data, hashlib.sha256(data).hexdigest(), fmt, size)


def _read_path(what: str, path: str, policy: ImagePolicy) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(policy.max_image_bytes + 1)
    except OSError as exc:
        raise RequestRefusedError(f"{what}: the worker cannot read {path!r}: {exc.strerror or exc}") from None
    return data


def _fetch(what: str, url: str, policy: ImagePolicy) -> bytes:
    if not policy.fetch:
        raise RequestRefusedError(f"{what}: {url[:80]!r} is a URL and this worker does not fetch images "
                                  "(send the bytes or a data URI, or start the worker with image fetching on)")
    if not url.startswith(("http://", "https://")):
        raise RequestRefusedError(f"{what}: only http(s) URLs are fetched, got {url[:80]!r}")
    try:
        with urllib.request.urlopen(url, timeout=policy.fetch_timeout_s) as resp:
            data: bytes = resp.read(policy.max_image_bytes + 1)
    except (OSError, ValueError) as exc:
        raise RequestRefusedError(f"{what}: fetching {url[:80]!r} failed: {exc}") from None
    return data


def _check_decodes(what: str, data: bytes, policy: ImagePolicy) -> tuple[str, tuple[int, int]]:
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as exc:  # pragma: no cover - the hf extra brings Pillow
        raise RequestRefusedError(f"{what}: this worker cannot decode images (install rollpool[hf] for Pillow)") from exc
    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt = str(im.format or "")
            if fmt not in policy.formats:
                raise RequestRefusedError(f"{what}: format {fmt or 'unknown'} is not accepted (accepted: {', '.join(policy.formats)})")
            w, h = im.size
            if w * h > policy.max_pixels:
                raise RequestRefusedError(f"{what}: {w}x{h} pixels, limit {policy.max_pixels} (image max_pixels)")
            im.load()  # decodes every pixel: a truncated or corrupt file fails here
    except RequestRefusedError:
        raise
    except UnidentifiedImageError:
        raise RequestRefusedError(f"{what}: not an image file Pillow can identify ({len(data)} bytes)") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise RequestRefusedError(f"{what}: corrupt image: {exc}") from None
    return fmt, (w, h)
