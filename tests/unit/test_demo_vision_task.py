"""The vision demo's task: the answer is the colour drawn, and the model's processor gives 4 image tokens."""

from __future__ import annotations

import io
import random

import pytest

pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

from rollpool.demo import vision_task  # noqa: E402


def test_the_answer_is_the_colour_of_the_square() -> None:
    rng = random.Random(0)
    for _ in range(20):
        png, answer = vision_task.make_example(rng)
        im = Image.open(io.BytesIO(png)).convert("RGB")
        colours = list(vision_task.COLOURS.values())
        # the most saturated pixel belongs to the square (the background is grey)
        px = max((im.getpixel((x, y)) for x in range(im.width) for y in range(im.height)), key=lambda p: max(p) - min(p))
        nearest = min(range(len(colours)), key=lambda k: sum((a - b) ** 2 for a, b in zip(px, colours[k], strict=True)))
        assert answer == vision_task.COLOUR0_ID + nearest
    assert len({a for _, a in vision_task.held_out_set(40)}) == 4
