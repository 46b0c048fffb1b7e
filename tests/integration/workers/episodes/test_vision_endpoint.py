"""Images at the episode endpoint: the real `openai` SDK, the real `hf` engine on a tiny random Qwen2-VL.

What a user relies on: an ``image_url`` part reaches the model as the image (the logprobs the trajectory
carries are what transformers computes from the trajectory's own ids, grids and images), the trajectory says
exactly what the model saw, and a bad image is a 400 that names it and records nothing (the episode goes on).
"""

from __future__ import annotations

import base64
import hashlib
import io
import pathlib
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest

from rollpool.protocol.messages import Prompt, SamplingParams
from rollpool.workers import EpisodeContext
from rollpool.workers.episodes import EpisodeConfig, EpisodeRunner
from rollpool.workers.images import ImagePolicy

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

TOL = 1e-4


def image_file(colour: tuple[int, int, int], fmt: str = "PNG", size: int = 64, noise: bool = False) -> bytes:
    im = Image.new("RGB", (size, size), colour)
    if noise:
        im = Image.frombytes("RGB", (size, size), random.Random(size).randbytes(size * size * 3))
    buf = io.BytesIO()
    im.save(buf, fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture
async def vlm(tiny_vlm_dir: pathlib.Path) -> AsyncIterator[Any]:
    from rollpool.workers.engines.hf import HFEngine

    e = HFEngine(model=str(tiny_vlm_dir), capacity=8, num_threads=1)
    await e.start()
    yield e
    await e.stop()


def recomputed_logprobs(model_dir: pathlib.Path, ids: list[int], images: list[bytes], temperature: float) -> Any:
    """log_softmax(logits / T) at every position of one plain transformers forward, from the trajectory's data alone."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    model: Any = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    pix = AutoImageProcessor.from_pretrained(model_dir)(images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images],
                                                        return_tensors="pt")
    t = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=t, pixel_values=pix["pixel_values"], image_grid_thw=pix["image_grid_thw"],
                       mm_token_type_ids=(t == model.config.image_token_id).int()).logits[0].float()
    return torch.log_softmax(logits / temperature, dim=-1), pix["image_grid_thw"].reshape(-1).tolist()


async def test_image_parts_reach_the_model_and_the_trajectory_says_what_it_saw(vlm: Any, tiny_vlm_dir: pathlib.Path) -> None:
    red, blue = image_file((230, 20, 20)), image_file((20, 20, 230), "JPEG")
    usages: list[Any] = []

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> float:
        async with openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key, max_retries=0, timeout=60) as client:
            messages: list[Any] = [{"role": "user", "content": [{"type": "text", "text": "what colour is"}, part(data_url(red))]}]
            r = await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=4, temperature=1.0, seed=1)
            usages.append(r.usage)
            # the next turn shows another image (a JPEG) after the first reply: the same segment, both images
            messages += [r.choices[0].message, {"role": "user", "content": [part(data_url(blue, "image/jpeg")),
                                                                            {"type": "text", "text": "and this one?"}]}]
            r = await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=4, temperature=1.0, seed=2)
            usages.append(r.usage)
        return 1.0

    async with EpisodeRunner(vlm, agent, EpisodeConfig(), worker_id="w") as runner:
        (t,) = await runner.run_group(Prompt(prompt_id="g", text="unused", group_size=1, sampling=SamplingParams(max_new_tokens=8)))
    assert "episode_error" not in t.metadata and t.trajectory_id == "g:0"  # one segment: the second turn extended the first
    assert t.image_sha256 == (hashlib.sha256(red).hexdigest(), hashlib.sha256(blue).hexdigest())
    assert t.metadata["episode_images"] == {hashlib.sha256(red).hexdigest(): red, hashlib.sha256(blue).hexdigest(): blue}
    image_id = vlm.info().extra["image_placeholder_ids"][1]
    ids = t.input_ids.tolist() + t.output_ids.tolist()
    # 64x64 resizes to 56x56: a 1x4x4 patch grid, 4 image tokens per image, in the prompt and in the inserted turn
    assert t.image_grid_thw.tolist() == [1, 4, 4, 1, 4, 4]
    assert t.input_ids.tolist().count(image_id) == 4 and t.output_ids[t.loss_mask == 0].tolist().count(image_id) == 4
    assert len(t.output_ids) == len(t.loss_mask) == len(t.output_logprobs) == len(t.token_versions)
    assert t.token_versions.tolist() == [0] * len(t.output_ids)
    sampled = [i for i, m in enumerate(t.loss_mask.tolist()) if m == 1]
    assert len(sampled) == sum(u.completion_tokens for u in usages)
    # usage counts the tokens the model ran: the second prompt is everything before its sampled tokens
    assert usages[0].prompt_tokens == len(t.input_ids) and usages[1].prompt_tokens == len(t.input_ids) + sampled[-usages[1].completion_tokens]
    # what a trainer recomputes from the trajectory alone (ids, the images by sha256, their order) is what was sampled
    images = [t.metadata["episode_images"][h] for h in t.image_sha256]
    logp, grids = recomputed_logprobs(tiny_vlm_dir, ids, images, 1.0)
    assert grids == t.image_grid_thw.tolist()
    p = len(t.input_ids)
    ref = [float(logp[p + i - 1, ids[p + i]]) for i in sampled]
    assert max(abs(a - float(t.output_logprobs[i])) for a, i in zip(ref, sampled, strict=True)) < TOL
    # and the images matter: the same ids with the images swapped score otherwise
    swapped, _ = recomputed_logprobs(tiny_vlm_dir, ids, images[::-1], 1.0)
    assert max(abs(float(swapped[p + i - 1, ids[p + i]]) - float(t.output_logprobs[i])) for i in sampled) > 1e-3


BAD = {
    "a data URL that is not base64": ([part("data:image/png;base64,%%%not-base64%%%")], "invalid base64"),
    "a data URL without base64": ([part("data:image/png,rawbytes")], "must be data:<type>;base64"),
    "bytes that are no image": ([part(data_url(b"hello, not an image"))], "not an image file"),
    "a truncated image": ([part(data_url(image_file((1, 2, 3), noise=True)[:300]))], "corrupt image"),
    "an unsupported format": ([part(data_url(image_file((9, 9, 9), "TIFF"), "image/tiff"))], "format TIFF is not accepted"),
    "an oversize image": ([part(data_url(image_file((0, 0, 0), noise=True, size=96)))], "limit 20000 (image max_image_bytes)"),
    "too many images": ([part(data_url(image_file((0, 0, 0))))] * 3, "3 images in this conversation, limit 2"),
    "an http URL on a worker that does not fetch": ([part("http://127.0.0.1:9/cat.png")], "does not fetch images"),
    "a file path": ([part("/etc/hostname")], "must be a data: URL"),
}


async def test_a_bad_image_is_a_400_naming_it_and_the_episode_goes_on_with_nothing_recorded(vlm: Any) -> None:
    good = image_file((20, 200, 20))
    errors: dict[str, tuple[int, str]] = {}

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> float:
        async with openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key, max_retries=0, timeout=60) as client:
            async def ask(content: list[Any], role: str = "user", **kw: Any) -> Any:
                msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}] if role == "assistant" else []
                return await client.chat.completions.create(model=ctx.model, messages=[*msgs, {"role": role, "content": content}],
                                                            max_tokens=2, **kw)

            cases: dict[str, Any] = {name: ask(content) for name, (content, _) in BAD.items()}
            cases["an image in an assistant message"] = ask([part(data_url(good))], role="assistant")
            cases["an image with a JSON response_format"] = ask([part(data_url(good))], response_format={"type": "json_object"})
            for name, call in cases.items():
                try:
                    await call
                except openai.BadRequestError as exc:
                    errors[name] = (exc.status_code, str(exc))
            r = await ask([{"type": "text", "text": "colour?"}, part(data_url(good))])
            assert r.choices[0].finish_reason in ("stop", "length")
        return 1.0

    policy = ImagePolicy(max_images=2, max_image_bytes=20_000)
    async with EpisodeRunner(vlm, agent, EpisodeConfig(image_policy=policy), worker_id="w") as runner:
        (t,) = await runner.run_group(Prompt(prompt_id="b", text="unused", group_size=1, sampling=SamplingParams(max_new_tokens=8)))
    assert "episode_error" not in t.metadata
    for name, (_, needle) in BAD.items():
        assert errors[name][0] == 400 and needle in errors[name][1], (name, errors.get(name))
    assert "user messages only" in errors["an image in an assistant message"][1]
    assert "not served with images" in errors["an image with a JSON response_format"][1]
    # nothing of the refused requests was recorded: one turn, one segment, the good image only
    assert runner.stats.turns == 1 and runner.stats.segments == 1
    assert t.image_sha256 == (hashlib.sha256(good).hexdigest(),) and int(t.loss_mask.sum()) >= 1


async def test_a_text_model_answers_an_image_part_with_a_400(tiny_model_dir: pathlib.Path) -> None:
    from rollpool.workers.engines.hf import HFEngine

    engine = HFEngine(model=str(tiny_model_dir), capacity=2, num_threads=1)
    await engine.start()
    seen: list[str] = []

    async def agent(ctx: EpisodeContext, prompt: Prompt) -> float:
        async with openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key, max_retries=0, timeout=60) as client:
            with pytest.raises(openai.BadRequestError) as exc:
                await client.chat.completions.create(model=ctx.model, max_tokens=2, messages=[
                    {"role": "user", "content": [{"type": "text", "text": "x"}, part(data_url(image_file((1, 1, 1))))]}])
            seen.append(str(exc.value))
            await client.chat.completions.create(model=ctx.model, max_tokens=2, messages=[{"role": "user", "content": "x"}])
        return 1.0

    try:
        async with EpisodeRunner(engine, agent, EpisodeConfig(), worker_id="w") as runner:
            (t,) = await runner.run_group(Prompt(prompt_id="t", text="unused", group_size=1, sampling=SamplingParams(max_new_tokens=4)))
    finally:
        await engine.stop()
    assert "episode_error" not in t.metadata and "takes no images" in seen[0]
    assert runner.stats.turns == 1 and t.image_sha256 == () and t.image_grid_thw is None
