"""What a vision-language prompt looks like to the model: image placeholders and their expansion.

Shared by the engines that take images (hf, sglang). A Qwen2-VL-style model marks each image of a prompt with
one image token (``<|image_pad|>``, usually between ``<|vision_start|>`` and ``<|vision_end|>``), which its
processor repeats once per merged patch of that image: ``t * h * w // merge**2`` times for a (t, h, w) patch
grid. `VisionSpec.expand` applies that rule, so the ids an engine reports are the ids the model ran; a prompt
with no image token gets ``<vision_start><image><vision_end>`` per image in front.
"""

from __future__ import annotations

import io
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollpool.protocol.errors import RequestRefusedError

__all__ = ["VisionSpec", "load_vision_spec"]


@dataclass(frozen=True, slots=True)
class VisionSpec:
    start_id: int
    image_id: int
    end_id: int
    merge: int
    """The vision tower's spatial merge size (2x2 patches per image token for Qwen2-VL)."""
    processor: Any
    """The model's image processor (transformers), for the patch grids."""
    bounds: tuple[int, int] | None = None
    """The pixel bounds (shortest_edge, longest_edge) the engine's own processor resizes within, where they differ
    from the checkpoint's (SGLang 0.5.14 loads a Qwen2-VL processor with its own ``size``); None: the processor's."""
    video_id: int | None = None
    """The model's video token (``<|video_pad|>``), where its config names one."""

    def holds_media_tokens(self, ids: Sequence[int]) -> bool:
        """Whether `ids` (a sample's output) hold a token the engine's processor reads as an image or video slot (the
        image, video, vision start and end tokens). A model can sample them; sent back as a prompt with the request's
        images, SGLang matches them to media data it does not have and fails the whole request."""
        marks = {self.start_id, self.image_id, self.end_id}
        if self.video_id is not None:
            marks.add(self.video_id)
        return any(int(t) in marks for t in ids)

    def grids(self, images: Sequence[bytes]) -> tuple[Any, list[list[int]]]:
        """The processor's output (``pixel_values``, ``image_grid_thw``, torch tensors) and the grids as ints.

        Any failure to read or preprocess an image refuses the prompt (`RequestRefusedError`), not the engine."""
        from PIL import Image

        try:
            pics = []
            for data in images:
                with Image.open(io.BytesIO(data)) as im:
                    pics.append(im.convert("RGB"))
            out = self.processor(images=pics, return_tensors="pt")
        except Exception as exc:  # noqa: BLE001 - any failure to read one image refuses its prompt only
            raise RequestRefusedError(f"the model's image processor refused the images: {type(exc).__name__}: {exc}") from None
        return out, [[int(x) for x in row] for row in out["image_grid_thw"].tolist()]

    def grids_of(self, images: Sequence[bytes]) -> list[list[int]]:
        """The patch grids alone, for an engine that preprocesses the images itself (SGLang): from each image's size
        as the processor resizes it (transformers' Qwen2-VL ``smart_resize`` with the processor's size bounds, patch
        and merge sizes), the file's header read, no pixel decoded; the processor run whole (`grids`) where it is not
        one whose grid follows from the size. The worker has already decoded every image (its image rules)."""
        sized = _size_rule(self.processor, self.bounds)
        if sized is None:
            return self.grids(images)[1]
        from PIL import Image

        out: list[list[int]] = []
        try:
            for data in images:
                with Image.open(io.BytesIO(data)) as im:
                    w, h = im.size
                out.append(sized(h, w))
        except Exception as exc:  # noqa: BLE001 - any failure to read one image refuses its prompt only
            raise RequestRefusedError(f"the model's image processor refused the images: {type(exc).__name__}: {exc}") from None
        return out

    @property
    def grids_from_headers(self) -> bool:
        """`grids_of` reads only each file's header (tens of microseconds an image), not the processor run whole."""
        return _size_rule(self.processor, self.bounds) is not None

    def placeholders(self, prompt: list[int], count: int) -> list[int]:
        """`prompt` with one image token per image: as given, or ``<start><image><end>`` per image put in front."""
        if self.image_id not in prompt:
            prompt = [self.start_id, self.image_id, self.end_id] * count + prompt
        slots = sum(1 for t in prompt if t == self.image_id)
        if slots != count:
            raise RequestRefusedError(f"the prompt has {slots} image tokens for {count} images (one token per image)")
        if self.video_id is not None and self.video_id in prompt:
            raise RequestRefusedError("the prompt holds a video token; the pool's engines take images, not videos")
        return prompt

    def expand(self, prompt: list[int], grids: Sequence[Sequence[int]]) -> list[int]:
        """Each image token of `prompt` (one per image, see `placeholders`) repeated for its image's merged patches."""
        prompt = self.placeholders(prompt, len(grids))
        sizes = iter([g[0] * g[1] * g[2] // (self.merge * self.merge) for g in grids])
        out: list[int] = []
        for t in prompt:
            if t == self.image_id:
                out.extend([t] * next(sizes))
            else:
                out.append(t)
        return out


def _size_rule(processor: Any, bounds: tuple[int, int] | None = None) -> Any:
    """``(height, width) -> [1, grid_h, grid_w]`` for a Qwen2-VL-style processor (it resizes by ``smart_resize``
    within its size bounds, or `bounds` where given, then cuts patches of ``patch_size``), else None."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    except ImportError:
        return None
    if type(processor).__name__ not in ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil"):
        return None
    if not getattr(processor, "do_resize", True):
        return None
    size = getattr(processor, "size", None)
    get = size.get if isinstance(size, dict) else (lambda k, d=None: getattr(size, k, d))
    lo, hi = bounds if bounds is not None else (get("shortest_edge"), get("longest_edge"))
    patch, merge = getattr(processor, "patch_size", None), getattr(processor, "merge_size", None)
    if not (isinstance(patch, int) and isinstance(merge, int) and all(isinstance(x, int) and x > 0 for x in (lo, hi, patch, merge))):
        return None
    p, factor = patch, patch * merge

    def rule(height: int, width: int) -> list[int]:
        h, w = smart_resize(height, width, factor, min_pixels=lo, max_pixels=hi)
        return [1, h // p, w // p]

    return rule


def load_vision_spec(path: str | pathlib.Path, config: Any | None = None) -> VisionSpec | None:
    """The spec of the model at `path`, or None for a model without a vision tower (``vision_config``)."""
    from transformers import AutoConfig, AutoImageProcessor

    cfg = config if config is not None else AutoConfig.from_pretrained(path)
    if getattr(cfg, "vision_config", None) is None:
        return None
    try:
        processor = AutoImageProcessor.from_pretrained(path)
    except ImportError:
        # transformers 5.8 (SGLang's kit) asks torchvision for AutoImageProcessor; its Pillow twin computes the same
        # pixels and grids without it
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    video = getattr(cfg, "video_token_id", None)
    return VisionSpec(int(cfg.vision_start_token_id), int(cfg.image_token_id), int(cfg.vision_end_token_id),
                      int(getattr(cfg.vision_config, "spatial_merge_size", 1)), processor,
                      video_id=None if video is None else int(video))
