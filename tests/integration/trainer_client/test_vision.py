"""Images through a real pool: a broker and an hf worker serving a tiny Qwen2-VL on CPU (real processes, real sockets).

LightRFT's documented ``image_data`` forms (a file name, a base64 string, a data URI; one per prompt or a list)
run unchanged; a trajectory holds the ids the model saw (image tokens expanded) and each image's sha256; a bad
image fails its own group with the reason and nothing else, and the worker keeps serving.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import pathlib
import shutil
import tempfile
import time
from collections.abc import Iterator

import pytest

from rollpool.protocol import GroupState, Prompt, PromptImage, SamplingParams
from tests.integration.trainer_client.conftest import Pool

pytest.importorskip("torch")
pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

pytestmark = pytest.mark.timeout(180)


def png(colour: tuple[int, int, int], size: int = 64, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buf, fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Pool, pathlib.Path]]:
    from rollpool.trainer_client import SyncTrainerClient
    from rollpool.workers.engines.tiny_model import build_tiny_model

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="rp-vision-", dir="/tmp"))
    model = build_tiny_model(tmp / "m", arch="qwen2", vocab=320, hidden=32, layers=2, heads=4, kv_heads=2, vlm=True)
    pool = Pool(dir=str(tmp), worker_ep=f"ipc://{tmp}/w", client_ep=f"ipc://{tmp}/c")
    pool.start_broker()
    pool._start("hf0", ["rollpool.workers", "--broker", pool.worker_ep, "--engine", "hf", "--model", str(model), "--worker-id", "hf0",
                        "--heartbeat-interval-s", "0.2", "--max-images-per-prompt", "2", "--max-image-bytes", "40000", "--log-level", "INFO"])
    try:
        with SyncTrainerClient(pool.client_ep) as probe:
            deadline = time.monotonic() + 90
            while not probe.status()["workers"]:
                assert time.monotonic() < deadline, pool.logs()
                time.sleep(0.2)
        yield pool, tmp
    finally:
        pool.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def test_lightrft_image_data_forms_run_unchanged(served: tuple[Pool, pathlib.Path]) -> None:
    from rollpool.trainer_client.compat.lightrft import RLGenerationEngine

    pool, tmp = served
    red = png((255, 0, 0))
    (tmp / "red.png").write_bytes(red)
    b64 = base64.b64encode(red).decode()
    engine = RLGenerationEngine(broker=pool.client_ep)
    try:
        sp = {"temperature": 0.7, "max_new_tokens": 6}
        for image_data in (str(tmp / "red.png"), b64, "data:image/png;base64," + b64, [b64]):
            r = engine.generate(prompt="What colour is the square?", sampling_params=sp, image_data=image_data)
            assert isinstance(r, dict) and r["meta_info"]["finish_reason"]["type"] in ("stop", "length"), (image_data[:20], r, pool.logs())
        rs = engine.generate(prompt=["Colour?", "Colour?"], sampling_params=sp, image_data=[str(tmp / "red.png"), [b64]])
        assert isinstance(rs, list) and all(r["meta_info"]["finish_reason"]["type"] in ("stop", "length") for r in rs)
    finally:
        engine.shutdown()


def test_the_trajectory_holds_what_the_model_saw_and_a_bad_image_fails_only_its_group(served: tuple[Pool, pathlib.Path]) -> None:
    from rollpool.trainer_client import SyncTrainerClient

    pool, tmp = served
    red, blue = png((255, 0, 0)), png((0, 0, 255))
    noisy = io.BytesIO()
    Image.frombytes("RGB", (64, 64), bytes(range(256)) * 48).save(noisy, "PNG")
    sp = SamplingParams(max_new_tokens=4, temperature=1.0)
    bad = {
        "corrupt": (PromptImage(data=noisy.getvalue()[: len(noisy.getvalue()) // 2]),),
        "format": (PromptImage(data=png((0, 255, 0), fmt="TIFF")),),
        "path": (PromptImage(path=str(tmp / "no-such.png")),),
        "url": (PromptImage(url="http://127.0.0.1:9/cat.png"),),
        "many": (PromptImage(data=red),) * 3,
        "large": (PromptImage(data=red + b"\0" * 40000),),
    }
    reasons = {"corrupt": "corrupt image", "format": "format TIFF is not accepted", "path": "cannot read",
               "url": "does not fetch images", "many": "3 images in one prompt, limit 2", "large": "max_image_bytes"}
    with SyncTrainerClient(pool.client_ep) as client:
        good = Prompt(prompt_id="good", text="What colour?", group_size=2, sampling=sp, images=(PromptImage(data=red), PromptImage(data=blue)))
        prompts = [good] + [Prompt(prompt_id=name, text="What colour?", sampling=sp, images=ims) for name, ims in bad.items()]
        client.submit(prompts)
        groups = {}
        deadline = time.monotonic() + 60
        while len(groups) < len(prompts):
            assert time.monotonic() < deadline, (sorted(groups), pool.logs())
            # failed groups through take_ended: a get_batch(1) returns them only beside a DONE group, and once "good"
            # was taken none is left (the wait then ran to its timeout when a failure came after "good")
            for g in client.take_ended(timeout=1.0):
                groups[g.prompt_id] = g
            if "good" not in groups:
                with contextlib.suppress(TimeoutError):
                    batch = client.get_batch(1, timeout=1.0)
                    for g in batch.groups + batch.other:
                        groups[g.prompt_id] = g
        done = groups.pop("good")
        assert done.state == GroupState.DONE, (done.reason, pool.logs())
        for t in done.trajectories:
            assert t.image_sha256 == (hashlib.sha256(red).hexdigest(), hashlib.sha256(blue).hexdigest())
            assert t.image_grid_thw is not None and t.image_grid_thw.tolist() == [1, 4, 4, 1, 4, 4]
            ids = t.input_ids.tolist()
            assert len(ids) > 8 and ids.count(ids[1]) == 8  # two images of 4 placeholder tokens each, after vision start
        for name, g in groups.items():
            assert g.state == GroupState.FAILED and reasons[name] in g.reason, (name, g.state, g.reason)
        # the worker serves on, in the same process (no engine restart)
        client.submit([Prompt(prompt_id="after", text="Colour?", sampling=sp, images=(PromptImage(data=blue),))])
        after = client.get_batch(1, timeout=30).groups[0]
        assert after.state == GroupState.DONE
        status = client.status()["workers"]["hf0"]
        assert status["state"] == "ready", status
