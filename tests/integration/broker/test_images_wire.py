"""Protocol minor `IMAGES_MINOR` on real sockets: a prompt's images travel once per group to a worker that reads
them; a worker of the previous minor (which lists no `Feature.IMAGES` and would drop them) keeps getting plain
prompts and never an image prompt."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from rollpool import protocol as p
from tests.integration.broker.conftest import Harness
from tests.integration.broker.peers import make_group, make_prompt
from tests.integration.broker.test_broker_wire import RawWorker

IMAGE = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 12  # opaque to the broker: bytes it relays, never decodes


async def test_an_image_prompt_goes_whole_to_a_worker_that_reads_images_and_never_to_a_previous_minor_one(start_broker) -> None:  # type: ignore[no-untyped-def]
    h: Harness = await start_broker(heartbeat_interval_s=1.0)
    c = await h.client()
    old_features = tuple(f for f in p.FEATURES if f != p.Feature.IMAGES)
    old = RawWorker(h, "old", minor=p.IMAGES_MINOR - 1, capacity=4, features=old_features)
    new: RawWorker | None = None
    try:
        await old.hello()
        seen = dataclasses.replace(make_prompt("seen", group_size=4), images=(p.PromptImage(data=IMAGE), p.PromptImage(path="/data/b.png")))
        await c.submit([seen, make_prompt("plain")])
        plain = await old.recv(p.Task)
        assert plain.prompt.prompt_id == "plain"  # the image prompt waits, it is not dropped to text
        await old.send(p.Result(task_id=plain.task_id, prompt_id="plain", trajectories=make_group(plain, "old")))
        with pytest.raises(TimeoutError):  # its credit is back, and still no image prompt for it
            await old.recv(p.Task, timeout_s=0.5)
        new = RawWorker(h, "new", minor=p.PROTOCOL_MINOR, capacity=4, features=p.FEATURES)
        await new.hello()
        task = await new.recv(p.Task)
        assert task.prompt.prompt_id == "seen" and task.prompt.group_size == 4
        got = task.prompt.images
        assert len(got) == 2 and bytes(got[0].data) == IMAGE and got[1].path == "/data/b.png" and got[1].data is None
        await new.send(p.Result(task_id=task.task_id, prompt_id="seen", trajectories=make_group(task, "new", n_out=2)))
        results = await c.collect(2)
        assert sorted(g.prompt_id for g in results) == ["plain", "seen"] and all(g.state == p.GroupState.DONE for g in results)
        assert h.broker.protocol_errors == 0
    finally:
        old.close()
        if new is not None:
            new.close()
        await asyncio.sleep(0)
