"""The demo's GPU fields: refused with a message naming the field, and the per-shape learning rate."""

from __future__ import annotations

import random

import pytest

from rollpool.demo import task
from rollpool.demo.runner import DemoConfig
from rollpool.protocol import ConfigError


def test_workers_started_elsewhere_need_the_endpoint_they_dial() -> None:
    with pytest.raises(ConfigError, match="worker_endpoint"):
        DemoConfig(workers=0, external_workers=1)
    assert DemoConfig(workers=0, external_workers=1, worker_endpoint="tcp://127.0.0.1:5000").external_workers == 1
    with pytest.raises(ConfigError, match="at least one worker"):
        DemoConfig(workers=0)


def test_a_long_tail_that_does_not_fit_the_model_is_refused() -> None:
    with pytest.raises(ConfigError, match="tail_max_tokens"):
        DemoConfig(lengths="longtail", tail_max_tokens=512)  # the tiny model has 64 positions
    assert DemoConfig(lengths="longtail", tail_max_tokens=512, model_shape="s113m").tail_max_tokens == 512


@pytest.mark.parametrize("field, value", [("engine", "vllm"), ("device", "tpu"), ("lengths", "short"), ("loss_tokens", "some"),
                                          ("model_shape", "huge"), ("first_version", -1), ("lr_warmup_steps", -1)])
def test_bad_gpu_fields_are_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        DemoConfig(**{field: value})  # type: ignore[arg-type]


def test_the_large_shape_gets_its_own_learning_rate_unless_one_is_given() -> None:
    assert DemoConfig(model_shape="s113m").resolved().lr == 5e-6
    assert DemoConfig(model_shape="w34m").resolved().lr == 2e-5
    assert DemoConfig(model_shape="s113m", lr=1e-4).resolved().lr == 1e-4
    assert DemoConfig().resolved().lr == 3e-3


def test_long_tail_lengths_are_long_tailed_and_capped() -> None:
    rng = random.Random(0)
    lengths = sorted(task.tail_length(rng, 32, 1.0, 512) for _ in range(4000))
    median, p99 = lengths[len(lengths) // 2], lengths[int(len(lengths) * 0.99)]
    assert 28 <= median <= 36 and p99 >= 8 * median  # a few answers are many times the median one
    assert lengths[0] >= 1 and lengths[-1] == 512


def test_agent_processes_reach_the_tool_task_s_workers_and_only_theirs() -> None:
    from rollpool.demo.runner import worker_task_args

    argv = worker_task_args(DemoConfig(task="tool", agent_processes=2), 1)
    assert argv[argv.index("--episode") + 1] == "rollpool.demo.tool_task:solve" and argv[argv.index("--agent-processes") + 1] == "2"
    assert "--agent-processes" not in worker_task_args(DemoConfig(task="tool"), 0)
    assert worker_task_args(DemoConfig(slow_worker_s=1.0), 0) == ["--reward", "rollpool.demo.task:slow_reward"]
    assert worker_task_args(DemoConfig(slow_worker_s=1.0), 1) == ["--reward", "rollpool.demo.task:reward"]
    with pytest.raises(ConfigError, match="agent_processes .* is for --task tool"):
        DemoConfig(agent_processes=2)
    with pytest.raises(ConfigError, match="agent_processes must be in 0..256"):
        DemoConfig(task="tool", agent_processes=-1)
