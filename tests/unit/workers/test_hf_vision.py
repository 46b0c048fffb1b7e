"""The hf engine on a vision-language model: what it reports is what the model computes with the image."""

from __future__ import annotations

import asyncio
import contextlib
import io
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

from rollpool.protocol.errors import RequestRefusedError  # noqa: E402
from rollpool.protocol.messages import SamplingParams  # noqa: E402
from rollpool.workers.engines.hf import HFEngine  # noqa: E402

TOL = 1e-4


def png(colour: tuple[int, int, int], size: int = 64) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture
async def vlm(tiny_vlm_dir: pathlib.Path) -> AsyncIterator[HFEngine]:
    e = HFEngine(model=str(tiny_vlm_dir), capacity=16, num_threads=1)
    await e.start()
    yield e
    await e.stop()


def teacher_forced(engine: HFEngine, image: bytes, prompt: list[int], output: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) of each output from one plain forward over prompt + output, the model placing the image."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    model: Any = AutoModelForImageTextToText.from_pretrained(engine.model_path, dtype=torch.float32).eval()
    pix = AutoImageProcessor.from_pretrained(engine.model_path)(images=[Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt")
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pix["pixel_values"], image_grid_thw=pix["image_grid_thw"],
                       mm_token_type_ids=(ids == model.config.image_token_id).int()).logits[0].float()
    t = 1.0 if temperature < 1e-5 else temperature
    logp = torch.log_softmax(logits / t, dim=-1)
    return [float(logp[len(prompt) - 1 + i, tok]) for i, tok in enumerate(output)]


async def test_an_image_prompt_reports_the_expanded_ids_and_logprobs_the_model_computes_with_the_image(vlm: HFEngine) -> None:
    assert vlm.info().images
    red, blue = png((255, 0, 0)), png((0, 0, 255))
    sp = SamplingParams(max_new_tokens=12, temperature=0.9, seed=3, ignore_eos=True)
    # batched beside a text-only prompt and another image: each keeps its own positions
    out, other, text = await asyncio.gather(
        vlm.generate(None, 2, sp, "red", text="what colour?", images=[red]),
        vlm.generate(None, 1, sp, "blue", text="what colour?", images=[blue]),
        vlm.generate(None, 1, sp, "text", text="hello there"),
    )
    image_id = vlm._vision.image_id
    # 64x64 resizes to 56x56: a 1x4x4 patch grid, 2x2 merged -> 4 image tokens, between vision start and end
    assert out.image_grid_thw == [1, 4, 4] and out.input_ids.count(image_id) == 4
    assert vlm._vision is not None and out.input_ids[0] == vlm._vision.start_id and out.input_ids[5] == vlm._vision.end_id
    assert text.image_grid_thw is None and image_id not in text.input_ids
    for s in out.samples:
        ref = teacher_forced(vlm, red, out.input_ids, s.output_ids, sp.temperature)
        assert max(abs(a - b) for a, b in zip(ref, s.logprobs, strict=True)) < TOL
    ref_blue = teacher_forced(vlm, blue, other.input_ids, other.samples[0].output_ids, sp.temperature)
    assert max(abs(a - b) for a, b in zip(ref_blue, other.samples[0].logprobs, strict=True)) < TOL
    # the image matters: the same tokens scored against the other image differ
    wrong = teacher_forced(vlm, blue, out.input_ids, out.samples[0].output_ids, sp.temperature)
    assert max(abs(a - b) for a, b in zip(wrong, out.samples[0].logprobs, strict=True)) > 1e-3


async def test_image_tokens_in_the_prompt_place_the_images_and_a_count_mismatch_is_refused(vlm: HFEngine) -> None:
    assert vlm._vision is not None
    start, image, end = vlm._vision.start_id, vlm._vision.image_id, vlm._vision.end_id
    red = png((255, 0, 0))
    out = await vlm.generate([5, 6, start, image, end, 7], 1, SamplingParams(max_new_tokens=2), "ids", images=[red])
    assert out.input_ids[:3] == [5, 6, start] and out.input_ids[3:7] == [image] * 4 and out.input_ids[7:] == [end, 7]
    with pytest.raises(RequestRefusedError, match="2 image tokens for 1 images"):
        await vlm.generate([image, 9, image], 1, SamplingParams(max_new_tokens=2), "two", images=[red])
    video = vlm._vision.video_id
    assert video is not None  # a video token (a model's output sent back in a later turn, say) is refused by name
    with pytest.raises(RequestRefusedError, match="holds a video token"):
        await vlm.generate([5, video, 6], 1, SamplingParams(max_new_tokens=2), "video", images=[red])
    with pytest.raises(RequestRefusedError, match="image processor refused"):
        await vlm.generate(None, 1, SamplingParams(max_new_tokens=2), "bad", text="x", images=[b"not an image"])
    ok = await vlm.generate(None, 1, SamplingParams(max_new_tokens=2), "after", text="x", images=[red])
    assert len(ok.samples[0].output_ids) == 2  # the engine serves on


async def test_a_text_model_refuses_images(tiny_model_dir: pathlib.Path) -> None:
    e = HFEngine(model=str(tiny_model_dir), capacity=4, num_threads=1)
    await e.start()
    try:
        assert not e.info().images
        with pytest.raises(RequestRefusedError, match="takes no images"):
            await e.generate(None, 1, SamplingParams(max_new_tokens=2), "r", text="x", images=[png((0, 0, 0))])
    finally:
        await e.stop()


async def test_the_sglang_engine_sends_one_token_per_image_with_the_images_and_reports_the_ids_hf_runs(
        vlm: HFEngine, tiny_vlm_dir: pathlib.Path) -> None:
    from rollpool.workers.engines.sglang.engine import SGLangEngine
    from rollpool.workers.engines.sglang.wire import generate_body

    sg = SGLangEngine(model=str(tiny_vlm_dir), capacity=4)
    sg._read_limits(tiny_vlm_dir)
    assert sg.info().images and sg._vocab is not None
    red = png((255, 0, 0))
    sent, reported, grid = await sg._image_prompt([7, 8], [red, red])
    assert vlm._vision is not None
    start, image, end = vlm._vision.start_id, vlm._vision.image_id, vlm._vision.end_id
    assert sent == [start, image, end, start, image, end, 7, 8] and grid == [1, 4, 4, 1, 4, 4]
    ran = await vlm.generate([7, 8], 1, SamplingParams(max_new_tokens=1), "same", images=[red, red])
    assert reported == ran.input_ids  # the two engines report the same ids for the same prompt
    body = generate_body(sent, SamplingParams(), rid="r", index=0, image_data=["data:image/png;base64,AAAA"])
    assert body["image_data"] == ["data:image/png;base64,AAAA"] and body["input_ids"] == sent
    assert "image_data" not in generate_body(sent, SamplingParams(), rid="r", index=0)


def test_tiny_vlm_config_names_what_sglang_vision_tower_reads(tiny_vlm_dir: pathlib.Path) -> None:
    """SGLang's Qwen2-VL vision tower reads ``vision_config.in_chans`` (released checkpoints carry it; transformers 5
    names the field ``in_channels``), so a tiny VLM without it cannot start on the sglang engine."""
    import json

    vision = json.loads((tiny_vlm_dir / "config.json").read_text())["vision_config"]
    assert vision.get("in_chans") == 3
    assert {"patch_size", "temporal_patch_size", "spatial_merge_size", "embed_dim", "depth", "num_heads", "mlp_ratio"} <= set(vision)


async def test_concurrent_first_image_prompts_load_the_vision_spec_once(tiny_vlm_dir: pathlib.Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first batch of image prompts arrives at once (256 on the H100 run): each loading the image processor in its
    own thread raced transformers' lazy imports (``cannot import name 'AutoConfig'``) and restarted the engine under
    every group. One load, shared by every prompt that waits for it."""
    from rollpool.workers.engines import vision
    from rollpool.workers.engines.sglang import engine as sglang_engine

    calls = 0
    real = vision.load_vision_spec

    def counted(path: Any, config: Any = None) -> Any:
        nonlocal calls
        calls += 1
        import time

        time.sleep(0.05)  # a real load takes longer: every prompt of the batch arrives while it runs
        return real(path, config)

    monkeypatch.setattr(sglang_engine, "load_vision_spec", counted)
    sg = sglang_engine.SGLangEngine(model=str(tiny_vlm_dir), capacity=4)
    sg._read_limits(tiny_vlm_dir)
    red = png((255, 0, 0))
    results = await asyncio.gather(*[sg._image_prompt([7, 8], [red]) for _ in range(8)])
    assert calls == 1
    assert all(r == results[0] for r in results)


async def test_concurrent_first_text_prompts_load_the_tokenizer_once(tiny_vlm_dir: pathlib.Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for text prompts: the first batch loads the tokenizer once."""
    import time

    import transformers

    from rollpool.workers.engines.sglang.engine import SGLangEngine

    calls = 0
    real = transformers.AutoTokenizer.from_pretrained

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        time.sleep(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counted)
    sg = SGLangEngine(model=str(tiny_vlm_dir), capacity=4)
    results = await asyncio.gather(*[sg._tokenize(None, "the red square", False) for _ in range(8)])
    assert calls == 1
    assert all(r == results[0] and r for r in results)


@pytest.mark.parametrize("size", [(224, 224), (56, 56), (28, 300), (301, 97), (1000, 640), (13, 17), (640, 1)])
def test_the_grids_from_the_image_size_are_the_processors_grids(tiny_vlm_dir: pathlib.Path, size: tuple[int, int]) -> None:
    """The sglang engine reports the expanded ids from each image's size (SGLang preprocesses the pixels itself): the
    grids must be the ones the model's image processor makes from the decoded image, at any size and aspect."""
    import io

    from PIL import Image

    from rollpool.protocol.errors import RequestRefusedError
    from rollpool.workers.engines.vision import _size_rule, load_vision_spec

    spec = load_vision_spec(tiny_vlm_dir)
    assert spec is not None and _size_rule(spec.processor) is not None  # the size rule, not the fallback, is tested
    buf = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(buf, "PNG")
    data = buf.getvalue()

    def outcome(fn: Any) -> Any:
        try:
            return fn([data, data])
        except RequestRefusedError as exc:
            return str(exc)  # an aspect past 200: both refuse, with the processor's reason

    assert outcome(spec.grids_of) == outcome(lambda d: spec.grids(d)[1])


def test_the_grids_from_the_size_refuse_what_is_not_an_image(tiny_vlm_dir: pathlib.Path) -> None:
    from rollpool.protocol.errors import RequestRefusedError
    from rollpool.workers.engines.vision import load_vision_spec

    spec = load_vision_spec(tiny_vlm_dir)
    assert spec is not None
    with pytest.raises(RequestRefusedError, match="refused the images"):
        spec.grids_of([b"not an image"])


async def test_the_sglang_childs_generate_route_hands_the_images_to_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    """The child's ``/generate`` on the real-SGLang backend passes the body's ``image_data`` to ``Engine.async_generate``:
    without it SGLang runs the one image token per image as a text token and never sees the image. SGLang is faked
    here (a recording ``Engine`` and an empty ``io_struct``): the CPU has no SGLang."""
    import base64
    import sys
    import types

    from rollpool.workers.engines.sglang.server import sglang_routes
    from rollpool.workers.engines.sglang.wire import generate_body

    for name in ("sglang", "sglang.srt", "sglang.srt.managers", "sglang.srt.managers.io_struct"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["sglang.srt.managers"].io_struct = sys.modules["sglang.srt.managers.io_struct"]  # type: ignore[attr-defined]
    calls: list[dict[str, Any]] = []

    class FakeSGLangEngine:
        tokenizer_manager = object()

        async def async_generate(self, **kwargs: Any) -> dict[str, Any]:
            calls.append(kwargs)
            return {"output_ids": [1], "meta_info": {"id": kwargs.get("rid")}}

    generate = sglang_routes(FakeSGLangEngine())["/generate"]
    uri = "data:image/png;base64," + base64.b64encode(png((0, 0, 255))).decode()
    await generate(generate_body([5, 151655, 6], SamplingParams(max_new_tokens=1), rid="r1", index=0, image_data=[uri]))
    await generate(generate_body([5, 6], SamplingParams(max_new_tokens=1), rid="r2", index=0))
    assert calls[0]["image_data"] == [uri] and calls[0]["input_ids"] == [5, 151655, 6]
    assert calls[1].get("image_data") is None


def test_the_sglang_child_has_sglang_run_the_prompt_ids_it_was_given(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    """The child starts SGLang with ``SGLANG_MM_AVOID_RETOKENIZE=1`` whatever the environment says: off, SGLang decodes
    a token prompt with images to text and tokenizes it again, and the ids the worker reports are not the ids the model
    ran. SGLang is faked here (a module whose ``Engine`` records the variable and stops the child)."""
    import os
    import sys
    import types

    from rollpool.workers.engines.sglang.server import serve_main

    MM_AVOID_RETOKENIZE = "SGLANG_MM_AVOID_RETOKENIZE"  # SGLang's name (spelt out: the test holds the child to it)
    seen: list[str | None] = []

    class Stop(Exception):
        pass

    def engine(**_kw: Any) -> None:
        seen.append(os.environ.get(MM_AVOID_RETOKENIZE))
        raise Stop

    fake = types.ModuleType("sglang")
    fake.Engine = engine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sglang", fake)
    monkeypatch.setenv(MM_AVOID_RETOKENIZE, "0")
    with pytest.raises(Stop):
        serve_main(["--model-path", str(tmp_path), "--port", "1"])
    assert seen == ["1"]


async def test_images_cross_the_hop_as_their_own_bytes_and_strings_stay_strings(tmp_path: pathlib.Path) -> None:
    """The hop to the engine's child carries a body's ``image_data`` bytes as frames of their own, and the route gets the
    very bytes (no base64 made or parsed on either side); data URIs (strings) reach it as sent."""
    import contextlib

    from rollpool.workers.engines.sglang.hop import HopClient, serve_hop

    seen: list[dict[str, Any]] = []

    async def generate(b: dict[str, Any]) -> tuple[int, Any]:
        seen.append(b)
        return 200, {"ok": True}

    endpoint = f"ipc://{tmp_path}/hop"
    server = asyncio.create_task(serve_hop({"/generate": generate}, endpoint, "tok"))
    hop = HopClient(endpoint, token="tok")
    red, blue = png((255, 0, 0)), png((0, 0, 255), size=48)
    try:
        await hop.request("POST", "/generate", {"input_ids": [1, 2], "image_data": [red, blue]}, timeout_s=10)
        await hop.request("POST", "/generate", {"input_ids": [1, 2], "image_data": ["data:image/png;base64,AAAA"]}, timeout_s=10)
        await hop.request("POST", "/generate", {"input_ids": [3]}, timeout_s=10)
    finally:
        await hop.close()
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server
    assert seen[0]["image_data"] == [red, blue] and all(type(b) is bytes for b in seen[0]["image_data"])
    assert seen[0]["input_ids"] == [1, 2]
    assert seen[1]["image_data"] == ["data:image/png;base64,AAAA"]
    assert "image_data" not in seen[2]


async def test_over_http_the_sglang_engine_sends_each_image_as_a_data_uri_of_its_bytes(tiny_vlm_dir: pathlib.Path) -> None:
    """A server at ``url=`` (no hop) gets every image as a base64 data URI of the prompt's bytes, on every attempt."""
    import base64


    bodies: list[dict[str, Any]] = []

    async def generate(b: dict[str, Any]) -> tuple[int, Any]:
        bodies.append(b)
        n = int(b["sampling_params"]["max_new_tokens"])
        return 200, {"output_ids": [5] * n, "meta_info": {"id": b["rid"], "finish_reason": {"type": "length"}, "weight_version": "0",
                                                          "output_token_logprobs": [[-1.0, 5, None]] * n}}

    red = png((255, 0, 0))
    async with _engine_over_fake_sglang(tiny_vlm_dir, generate) as engine:
        out = await engine.generate([7, 8], 2, SamplingParams(max_new_tokens=3), "r", images=[red])
    assert len(bodies) == 2 and len(out.samples) == 2
    for b in bodies:
        (uri,) = b["image_data"]
        head, _, payload = uri.partition(",")
        assert head == "data:image/png;base64" and base64.b64decode(payload) == red


async def test_an_image_prompt_sglang_expands_otherwise_fails_instead_of_reporting_ids_the_model_did_not_run(
        tiny_vlm_dir: pathlib.Path) -> None:
    """SGLang expands a prompt's image tokens with its own image processor and says how long the prompt it ran was
    (``meta_info.prompt_tokens``). Seen on an H100 with the tiny Qwen2-VL: SGLang ran 130 tokens where the worker's
    processor expanded the prompt to 82 (its size bounds not read the same), so the ids and grids reported were not the
    model's. Such a prompt fails with the reason; one whose lengths agree completes, resubmits included. The server
    here is a fake of SGLang at the process edge, expanding each image token to `per_image` tokens."""

    from rollpool.protocol.errors import RequestRefusedError

    per_image = {"n": 0}

    async def generate(b: dict[str, Any]) -> tuple[int, Any]:
        n = int(b["sampling_params"]["max_new_tokens"])
        images = len(b.get("image_data") or [])
        return 200, {"output_ids": [5] * n, "meta_info": {
            "id": b["rid"], "finish_reason": {"type": "length"}, "weight_version": "0",
            "prompt_tokens": len(b["input_ids"]) + images * (per_image["n"] - 1), "output_token_logprobs": [[-1.0, 5, None]] * n}}

    red = png((255, 0, 0))
    async with _engine_over_fake_sglang(tiny_vlm_dir, generate) as engine:
        # the image processor is loaded at start, not under the first batch of image prompts
        assert engine._vision is not None and type(engine._vision.processor).__name__.startswith("Qwen2VLImageProcessor")
        _sent, reported, grid = await engine._image_prompt([7, 8], [red])
        per_image["n"] = grid[0] * grid[1] * grid[2] // 4  # the worker's own expansion: SGLang agrees
        out = await engine.generate([7, 8], 2, SamplingParams(max_new_tokens=3), "agree", images=[red])
        assert out.input_ids == reported and all(len(s.output_ids) == 3 for s in out.samples)
        per_image["n"] = grid[0] * grid[1] * grid[2]  # SGLang's processor did not merge (or resized otherwise)
        with pytest.raises(RequestRefusedError, match=r"SGLang ran this image prompt as \d+ tokens, the worker expands it to \d+"):
            await engine.generate([7, 8], 1, SamplingParams(max_new_tokens=3), "disagree", images=[red])
        text = await engine.generate([7, 8], 1, SamplingParams(max_new_tokens=2), "text")  # a prompt without images: no check
        assert len(text.samples[0].output_ids) == 2


async def test_an_interrupted_image_sample_whose_output_holds_a_media_token_starts_over(tiny_vlm_dir: pathlib.Path) -> None:
    """A sample interrupted by a weight update goes on from its output so far; an image prompt's output that holds an
    image or video token cannot (SGLang reads it as a media slot of the request and fails the request: seen on an H100
    with the tiny Qwen2-VL, "No data iterator found for token: <|video_pad|>", which restarted the engine). Such a
    sample starts over from its prompt; one without them goes on. The server is a fake of SGLang at the process edge:
    each prompt's first attempt is aborted after 3 tokens, and a prompt with more media tokens than images fails as
    SGLang's does."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_vlm_dir)
    media = {int(cfg.image_token_id), int(cfg.video_token_id)}
    first_out = {"video": [5, int(cfg.video_token_id), 6], "plain": [5, 6, 7]}
    mode: dict[str, Any] = {"first": "video", "interrupts": 1}

    async def generate(b: dict[str, Any]) -> tuple[int, Any]:
        ids = [int(t) for t in b["input_ids"]]
        if sum(t in media for t in ids) > len(b.get("image_data") or []):
            return 500, {"error": {"message": "ValueError: No data iterator found for token: <|video_pad|>"}}
        n = int(b["sampling_params"]["max_new_tokens"])
        if mode["interrupts"]:  # a first attempt: interrupted, as by a weight update
            mode["interrupts"] -= 1
            out = first_out[mode["first"]]
            return 200, {"output_ids": out, "meta_info": {"id": b["rid"], "finish_reason": {"type": "abort", "message": "Aborted"},
                                                          "weight_version": "0", "output_token_logprobs": [[-1.0, t, None] for t in out]}}
        return 200, {"output_ids": [9] * n, "meta_info": {"id": b["rid"], "finish_reason": {"type": "length"}, "weight_version": "1",
                                                          "output_token_logprobs": [[-1.0, 9, None]] * n}}

    red = png((255, 0, 0))
    async with _engine_over_fake_sglang(tiny_vlm_dir, generate) as engine:
        out = await engine.generate([7, 8], 1, SamplingParams(max_new_tokens=8), "r", images=[red])
        (s,) = out.samples
        assert s.output_ids == [9] * 8 and set(s.token_versions) == {1}  # started over: no media token kept, all version 1
        mode.update(first="plain", interrupts=1)
        out = await engine.generate([7, 8], 1, SamplingParams(max_new_tokens=8), "q", images=[red])
        (s,) = out.samples
        assert s.output_ids == [5, 6, 7] + [9] * 5 and s.token_versions == [0] * 3 + [1] * 5  # went on from its output


@contextlib.asynccontextmanager
async def _engine_over_fake_sglang(
model: pathlib.Path, generate: Any, model_info: dict[str, Any] | None = None) -> AsyncIterator[Any]:
    """A started sglang engine at ``url=`` over a fake of SGLang at the process edge whose ``/generate`` is `generate`
    (and whose ``/model_info`` answers `model_info`, where given)."""
    import socket

    from rollpool.workers.engines.sglang.engine import SGLangEngine
    from rollpool.workers.engines.sglang.http import serve_routes

    async def ok(b: dict[str, Any]) -> tuple[int, Any]:
        return 200, {"success": True}

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    async def info(b: dict[str, Any]) -> tuple[int, Any]:
        return 200, model_info

    routes = {"/health_generate": ok, "/update_weight_version": ok, "/generate": generate, **({"/model_info": info} if model_info else {})}
    runner = await serve_routes(routes, "127.0.0.1", port, "tok")
    engine = SGLangEngine(model=str(model), url=f"http://127.0.0.1:{port}", api_key="tok", device="cpu")
    try:
        await engine.start()
        yield engine
    finally:
        await engine.stop()
        await runner.cleanup()


async def test_images_are_expanded_within_the_pixel_bounds_sglangs_own_processor_uses(tiny_vlm_dir: pathlib.Path) -> None:
    """SGLang 0.5.14 loads a Qwen2-VL processor with its own ``size`` (3136..1003520 pixels) unless the checkpoint
    names ``min_pixels``/``max_pixels``: the worker expands each image within the bounds SGLang's processor reports
    (``/model_info``'s ``image_size``), so a 224 px image is 64 tokens on both sides where the checkpoint's own bounds
    (at most 112 x 112 pixels) would make it 16, and the prompt completes. The server is a fake of SGLang at the
    process edge, expanding each image by SGLang's bounds."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    lo, hi = 3136, 1003520
    h, w = smart_resize(224, 224, 28, min_pixels=lo, max_pixels=hi)
    per_image = (h // 14) * (w // 14) // 4
    assert per_image == 64

    async def generate(b: dict[str, Any]) -> tuple[int, Any]:
        n = int(b["sampling_params"]["max_new_tokens"])
        images = len(b.get("image_data") or [])
        return 200, {"output_ids": [5] * n, "meta_info": {
            "id": b["rid"], "finish_reason": {"type": "length"}, "weight_version": "0",
            "prompt_tokens": len(b["input_ids"]) + images * (per_image - 1), "output_token_logprobs": [[-1.0, 5, None]] * n}}

    image = png((0, 0, 255), size=224)
    info = {"weight_version": "0", "grammar_backend": "none", "image_size": {"shortest_edge": lo, "longest_edge": hi}}
    async with _engine_over_fake_sglang(tiny_vlm_dir, generate, info) as engine:
        out = await engine.generate([7, 8], 1, SamplingParams(max_new_tokens=2), "bounds", images=[image])
    assert out.image_grid_thw == [1, 16, 16] and out.input_ids.count(out.input_ids[1]) >= 64
