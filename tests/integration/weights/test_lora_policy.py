"""Prompts name the LoRA adapter (policy) they are generated with (`Prompt.policy`, docs/lora.md "Named policies"): a
real broker, the trainer client publishing adapter versions (real ZeroMQ) and an hf worker on a real tiny Llama, on CPU.

A prompt naming the adapter the pool serves is generated with it (its logprobs are the merged model's) and its
trajectories say so; a name the pool does not serve (none published yet, another adapter, the base model's name while
an adapter is on, an adapter another one replaced) is refused at submit naming what is served, while the pool goes on
serving the other prompts."""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from rollpool.protocol import GroupState, Prompt  # noqa: E402
from rollpool.protocol.messages import SamplingParams  # noqa: E402
from rollpool.trainer_client import TrainerClient  # noqa: E402
from rollpool.trainer_client.ledger import SubmitResult  # noqa: E402
from tests.integration.reliability.conftest import Pool, pool, wait_until  # noqa: E402
from tests.integration.weights.test_lora import PROMPT, _adapter, _merged, _teacher_forced, model_dir  # noqa: E402
from tests.integration.weights.test_lora_joiner import _engine  # noqa: E402

__all__ = ["model_dir", "pool"]  # the fixtures, used here by name

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


def _prompt(pid: str, policy: str | None = None, n: int = 1) -> Prompt:
    return Prompt(prompt_id=pid, input_ids=np.asarray(PROMPT, np.int32), group_size=n, sampling=GREEDY, policy=policy)


def _refused(res: SubmitResult) -> dict[str, str]:
    assert all(reason == "policy_unavailable" for reason in res.rejected.values()), res.rejected
    return {pid: res.details[pid] for pid in res.rejected}


async def _served(client: TrainerClient, ids: set[str]) -> dict[str, object]:
    got = {}
    while not ids <= got.keys():
        batch = await client.get_batch(1, timeout=60)
        got |= {g.prompt_id: g for g in batch.groups + batch.other}
    return got


async def _hf_pool(pool: Pool, model_dir: pathlib.Path) -> tuple[Any, Any]:
    """A broker, a trainer client and one hf worker on `model_dir` whose engine is up: (the client, the worker)."""
    broker = await pool.start_broker()
    client = await pool.client(broker.client_endpoint)
    worker = await pool.worker(broker.worker_endpoint, "w0", engine_factory=lambda: _engine(model_dir))
    assert await wait_until(lambda: worker.engine is not None and worker.engine.info() is not None, 60)
    return client, worker


@pytest.mark.timeout(120)
async def test_a_prompt_names_the_adapter_it_is_generated_with_and_an_unserved_name_is_refused_at_once(
        pool: Pool, model_dir: pathlib.Path) -> None:
    client, worker = await _hf_pool(pool, model_dir)

    # no adapter published yet: a name is refused at once; the base is served to a prompt that names none
    res = await client.submit([_prompt("early", "math"), _prompt("base0")])
    why = _refused(res)
    assert res.accepted == ["base0"] and set(why) == {"early"}
    assert "policy 'math' is not served" in why["early"] and "no LoRA adapter was announced" in why["early"]

    math, math_spec = _adapter(model_dir, seed=1)
    math_spec = dataclasses.replace(math_spec, name="math")
    await client.publish_weights(math, 1, adapter=math_spec)
    # submitted at once, before the worker applied version 1: the named group waits for it, never runs on the base
    res = await client.submit([_prompt("m", "math", n=2), _prompt("plain"), _prompt("other", "code"), _prompt("base", "tiny")])
    why = _refused(res)
    assert res.accepted == ["m", "plain"] and set(why) == {"other", "base"}
    assert "policy 'code' is not served: the pool serves policy 'math' (a LoRA adapter, since version 1)" in why["other"]
    assert "policy 'tiny' is the base model that adapter 'math' applies to" in why["base"]
    got = await _served(client, {"base0", "m", "plain"})
    assert all(g.state == GroupState.DONE for g in got.values())  # type: ignore[attr-defined]
    m = got["m"].trajectories  # type: ignore[attr-defined]
    assert len(m) == 2 and all(t.policy == "math" and t.token_versions.tolist() == [1] * 6 for t in m)
    merged = _merged(model_dir, math, math_spec)
    for t in m:  # generated with the adapter: the merged model's logprobs for the same tokens
        ref = _teacher_forced(merged, PROMPT, t.output_ids.tolist())
        assert max(abs(a - b) for a, b in zip(ref, t.output_logprobs.tolist(), strict=True)) < 1e-4
    assert got["plain"].trajectories[0].policy is None  # type: ignore[attr-defined]

    # another adapter replaces it: "math" is no longer served, "code" is, and both are said in status
    code, code_spec = _adapter(model_dir, seed=2)
    await client.publish_weights(code, 2, adapter=dataclasses.replace(code_spec, name="code"))
    res = await client.submit([_prompt("m2", "math"), _prompt("c", "code")])
    why = _refused(res)
    assert res.accepted == ["c"] and "policy 'math' is not served: the pool serves policy 'code' (a LoRA adapter, since version 2)" in why["m2"]
    got = await _served(client, {"c"})
    c = got["c"].trajectories[0]  # type: ignore[attr-defined]
    assert c.policy == "code" and c.token_versions.tolist() == [2] * 6
    counters = (await client.status())["counters"]
    assert counters["policy"] == "code" and counters["policy_since"] == 2 and counters["policy_rejected"] == 4
    assert counters["policy_off"] == 0  # no named group was dispatched to a worker not yet serving its adapter


@pytest.mark.timeout(120)
async def test_prompts_naming_an_adapter_every_worker_refused_fail_at_once_and_the_pool_serves_on(
        pool: Pool, model_dir: pathlib.Path) -> None:
    client, worker = await _hf_pool(pool, model_dir)
    big, big_spec = _adapter(model_dir, seed=3, rank=16)  # the engine serves rank 8 at most (max_lora_rank)
    await client.publish_weights(big, 1, adapter=dataclasses.replace(big_spec, name="big"))
    res = await client.submit([_prompt("b1", "big"), _prompt("b2", "big"), _prompt("plain")])
    assert res.accepted == ["b1", "b2", "plain"]  # announced, so accepted: they wait for a worker serving version 1
    got: dict[str, object] = {}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while not {"b1", "b2", "plain"} <= got.keys():
        assert loop.time() < deadline, f"stuck: {sorted({'b1', 'b2', 'plain'} - got.keys())}"
        got |= {g.prompt_id: g for g in await client.take_ended(timeout=0.2)}
        try:
            batch = await client.get_batch(1, timeout=0.2)
        except TimeoutError:
            continue
        got |= {g.prompt_id: g for g in batch.groups + batch.other}
    for pid in ("b1", "b2"):
        g = got[pid]
        assert g.state == GroupState.FAILED, g  # type: ignore[attr-defined]
        reason = g.reason  # type: ignore[attr-defined]
        assert "policy 'big' (since version 1) was given up by every live worker" in reason and "w0" in reason and "rank" in reason
    assert got["plain"].state == GroupState.DONE  # type: ignore[attr-defined]
