"""The demo's vision task: name the colour of the square in a small image.

A prompt is ``<s> <|vision_start|><|image_pad|><|vision_end|> <sep>`` with one 56x56 image: a square of one
of four colours (red, green, blue, yellow; its shade, size and place random) on a noisy grey background.
The answer is one token, the colour's word: a random policy is right 1 time in 4 among the colours (less
over the whole vocabulary), and the answer is only in the image. The model is a random-weight Qwen2-VL
(`build_vision_model`: a one-block vision tower, 4 image tokens per image) over a word-level vocabulary.
The reward is `rollpool.demo.task.reward` (the first output token against ``metadata["answer_id"]``), on the
workers. A fixed, seeded set of held-out images is never used in training.
"""

from __future__ import annotations

import io
import json
import pathlib
import random

from rollpool.demo.task import BOS_ID, EOS_ID, PAD_ID, SEP_ID, SPECIALS

__all__ = ["VOCAB", "COLOURS", "build_vision_model", "make_example", "held_out_set", "training_example", "prompt_ids"]

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (40, 60, 230), "yellow": (230, 220, 40)}
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
VOCAB = SPECIALS + list(COLOURS) + VISION_TOKENS
COLOUR0_ID = len(SPECIALS)
VISION_START_ID, IMAGE_ID, VISION_END_ID, VIDEO_ID = (VOCAB.index(t) for t in VISION_TOKENS)
IMAGE_PX = 56


def prompt_ids() -> list[int]:
    return [BOS_ID, VISION_START_ID, IMAGE_ID, VISION_END_ID, SEP_ID]


def make_example(rng: random.Random) -> tuple[bytes, int]:
    """(a PNG image, the answer's token id)."""
    from PIL import Image, ImageDraw

    k = rng.randrange(len(COLOURS))
    base = list(COLOURS.values())[k]
    grey = rng.randrange(60, 140)
    im = Image.frombytes("RGB", (IMAGE_PX, IMAGE_PX), bytes(max(0, min(255, grey + rng.randrange(-25, 26))) for _ in range(IMAGE_PX * IMAGE_PX * 3)))
    side = rng.randrange(22, 40)
    x, y = rng.randrange(0, IMAGE_PX - side), rng.randrange(0, IMAGE_PX - side)
    shade = tuple(max(0, min(255, c + rng.randrange(-25, 26))) for c in base)
    ImageDraw.Draw(im).rectangle((x, y, x + side, y + side), fill=shade)
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue(), COLOUR0_ID + k


def held_out_set(n: int = 200, seed: int = 12345) -> list[tuple[bytes, int]]:
    rng = random.Random(seed)
    return [make_example(rng) for _ in range(n)]


def training_example(rng: random.Random) -> tuple[bytes, int]:
    """Like `make_example`, from the training seed stream (a held-out image repeats with probability ~0)."""
    return make_example(rng)


def build_vision_model(path: str | pathlib.Path, *, hidden: int = 64, layers: int = 2, heads: int = 4, seed: int = 0) -> pathlib.Path:
    """A random-weight Qwen2-VL over `VOCAB` with its word-level tokenizer and image processor (56x56, 4 image tokens)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                                   sep_token="<sep>", additional_special_tokens=VISION_TOKENS)
    fast.save_pretrained(out)
    torch.manual_seed(seed)
    half = hidden // heads // 2
    text = dict(vocab_size=len(VOCAB), hidden_size=hidden, intermediate_size=hidden * 4, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=64,
                bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]})
    cfg = Qwen2VLConfig(text_config=text, vision_config=dict(depth=1, embed_dim=32, hidden_size=hidden, num_heads=2, mlp_ratio=2, in_chans=3),
                        image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, vision_start_token_id=VISION_START_ID,
                        vision_end_token_id=VISION_END_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                        tie_word_embeddings=False)
    Qwen2VLForConditionalGeneration(cfg).save_pretrained(out, safe_serialization=True)
    Qwen2VLImageProcessorPil(min_pixels=IMAGE_PX * IMAGE_PX, max_pixels=IMAGE_PX * IMAGE_PX).save_pretrained(out)
    (out / "rollpool_demo_vision.json").write_text(json.dumps({"vocab": len(VOCAB), "hidden": hidden, "layers": layers, "seed": seed}))
    return out


def batch_inputs(processor: object, images: list[bytes]) -> dict[str, object]:
    """The model's image inputs for rows showing `images` (one each, in order): pixel_values and image_grid_thw."""
    from PIL import Image

    pics = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    out = processor(images=pics, return_tensors="pt")  # type: ignore[operator]
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
