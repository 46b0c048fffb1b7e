"""`rollpool demo`: the whole pool on one machine, training a tiny model by asynchronous GRPO.

What runs: an embedded Redis (unless ``--redis-url``), a broker process, N
worker processes with the ``hf`` engine on a tiny model built on the spot and
the task's reward (``--reward rollpool.demo.task:reward``, scored on the
workers), and the trainer in this process (`SyncTrainerClient`, torch on the
CPU). Each step the trainer takes P whole groups, does one GRPO step with
decoupled-PPO importance weights, and publishes the new weights as the next
version; the workers fetch and apply it while they keep generating (rolling,
one at a time). ``--sync`` runs the same job synchronously (eta = 0: nothing
is generated ahead of the weights that will train on it).

``--task tool`` runs the same pool on episodes (`rollpool.demo.tool_task`): the
workers run an `openai` SDK agent per sample (``--episode``) through their
episode endpoint, with the ``compact`` tool-call parser; the reward is the
episode's return value, and the trainer trains only the tokens the model
sampled (the tool's and the template's tokens have loss mask 0).
``--no-tool`` is its control: the same run with the tool answering ``<none>``.

``--lora`` trains the max task through a LoRA adapter (`rollpool.demo.lora`, rank ``--lora-rank`` on every
attention and MLP projection) on a frozen base: the workers load the base from disk and every version the trainer
publishes is the adapter's matrices only (an adapter version, docs/lora.md), served by the hf engine's resident
adapter versions. The base is the same random-init Llama with its output layer drawn at 1/sqrt(hidden)
(`task.build_demo_model`'s ``head_std`` says why the default 0.02 leaves an adapter nothing to learn with).

The broker and workers run under the launcher's `Supervisor` (through
`SupervisorThread`: the trainer loop here is synchronous): each in its own
session with a parent-death signal, logs in ``--out``, terminated (then killed)
when the demo returns, also on Ctrl-C. They are not restarted on their own:
``--kill-worker-at`` kills worker 0 and starts it again two steps later.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rollpool.launch.supervisor import ProcessSpec, Supervisor, SupervisorThread
from rollpool.protocol import ConfigError, PromptImage, SamplingParams

log = logging.getLogger(__name__)

__all__ = ["DemoConfig", "run_demo"]


TASKS = ("max", "tool", "vision")
MODEL_SHAPES: dict[str, dict[str, int]] = {
    # the CPU demo's model: learns the max task in a few dozen steps on two cores
    "tiny": {"hidden": 64, "layers": 2, "heads": 4, "max_positions": 64},
    # GPT-2 small's width and depth with a Llama (SwiGLU) MLP of 4x, 113 M parameters, head dim 64 as the SGLang kit's
    # kernels were built for, 1,024 positions for the long tail. On CPU its policy settled on the most frequent answer
    # at every learning rate tried (bench/results/cpu-demo-lr-probe.json): kept for trying, not the GPU demo's default
    "s113m": {"hidden": 768, "layers": 12, "heads": 12, "max_positions": 1024},
    # the GPU demo's: wide and shallow (hidden 1024, 2 layers, 34 M parameters), so that a decode step and a training
    # pass are real GPU work and the task is learnt in tens of steps (a deep random model's policy settles on the most
    # frequent answer first)
    "w34m": {"hidden": 1024, "layers": 2, "heads": 16, "max_positions": 1024},
}
SHAPE_LR: dict[str, float] = {"tiny": 3e-3, "s113m": 5e-6, "w34m": 2e-5}
"""--task max's learning rate per shape. Adam's first steps move every weight by about lr whatever its gradient, and
the move of a logit grows with fan-in x width x depth: on CPU, hidden 768 x 12 layers settled on one answer ("9", expected
held-out reward 0.31) within 5 steps at 3e-4 (entropy 0.002 nats) and within 2 at 3e-5, while hidden 256 x 2 layers learned at 3e-4 (held-out 0.8 in
about 15 steps of 32 x 8 samples). Scaled by the ratio of fan-in x width x depth: 2e-5 for hidden 1024 x 2 layers (1/16;
on CPU 0.80 after 10 steps) and 5e-6 for 768 x 12 (1/54; on CPU still on "9" after 7 steps)."""
# per task: what an unset flag means
_TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "max": {"steps": 150, "prompts_per_step": 32, "group_size": 8, "lr": 3e-3, "entropy_coef": 0.0, "heartbeat_interval_s": 0.5,
            "max_staleness": 2},
    # the tool task: bigger groups (the answer is random per episode: more samples per prompt steady the
    # group baseline), an entropy bonus (the answer must stay spread over the ten digits until the copy
    # is learned), and a slower heartbeat (each worker runs an HTTP endpoint and SDK clients beside its engine)
    "tool": {"steps": 200, "prompts_per_step": 8, "group_size": 16, "lr": 3e-3, "entropy_coef": 0.1, "heartbeat_interval_s": 1.0,
             "max_staleness": 2},
    # the vision task: a Qwen2-VL learns the colour of a square in its image (rollpool.demo.vision_task). Its one-token
    # policy turns deterministic within ~40 steps; without an entropy bonus it does so before it is right (every group
    # then answers alike: no advantage, no gradient), and trained two versions stale (eta 2, one optimizer step a
    # batch, so PPO's clip never binds) it learns and then falls back (docs/multimodal.md has the runs); on-policy
    # (eta 0) with the bonus and a lower rate it peaks by step ~50 and may still drift after, so the rate decays
    # from step 40 and the run ends at 80
    "vision": {"steps": 80, "prompts_per_step": 16, "group_size": 8, "lr": 2e-3, "entropy_coef": 0.05, "heartbeat_interval_s": 0.5,
               "max_staleness": 0},
}

LORA_HEAD_STD = 0.125
"""--lora: the frozen base's output layer drawn at 1/sqrt(hidden 64) (`task.build_demo_model`'s head_std says why)."""


@dataclass(frozen=True)
class DemoConfig:
    task: str = field(default="max", metadata={"help": "max: name the largest of four digits; tool: a multi-turn episode "
                                                       "that needs a tool call (openai SDK agent, --episode); vision: name the colour "
                                                       "of the square in an image (a tiny Qwen2-VL)"})
    tool_disabled: bool = field(default=False, metadata={"help": "--task tool: the control run, the tool answers <none> to every call (the answer stays at chance)"})
    call_bonus: float = field(default=0.3, metadata={"help": "--task tool: training reward of an episode that called the tool and "
                                                               "answered wrong (shaping; what is reported is unshaped)"})
    agent_processes: int = field(default=0, metadata={"help": "--task tool: each worker runs its episodes in this many child "
                                                               "processes (the worker's --agent-processes); 0: in the worker"})
    steps: int | None = field(default=None, metadata={"help": "optimizer steps (default: 150 for max, 200 for tool, 80 for vision)"})
    workers: int = field(default=2, metadata={"help": "rollout worker processes (hf engine)"})
    max_staleness: int | None = field(default=None, metadata={"help": "eta: how many versions a sample may lag (async mode; "
                                                                         "default 2, 0 for vision: on-policy)"})
    sync: bool = field(default=False, metadata={"help": "synchronous RL (eta = 0) for comparison"})
    kill_worker_at: int | None = field(default=None, metadata={"help": "SIGKILL worker 0 at this step (it is restarted two steps later)"})
    prompts_per_step: int | None = field(default=None, metadata={"help": "groups per optimizer step (default: 32 for max, 8 for tool)"})
    group_size: int | None = field(default=None, metadata={"help": "samples per prompt, GRPO group (default: 8 for max, 16 for tool)"})
    lr: float | None = field(default=None, metadata={"help": "learning rate, constant for half the steps, then decayed (default: 3e-3; "
                                                          "2e-3 for vision; 5e-6 for --model-shape s113m)"})
    entropy_coef: float | None = field(default=None, metadata={"help": "weight of the policy's entropy in the objective "
                                                                        "(default: 0 for max, 0.1 for tool, 0.05 for vision)"})
    lr_final_ratio: float = field(default=0.2, metadata={"help": "learning rate at the last step, as a fraction of --lr"})
    lr_warmup_steps: int = field(default=0, metadata={"help": "steps of linear learning-rate warm-up (Adam's first steps move every "
                                                               "weight by about lr whatever its gradient: a deep model's policy can "
                                                               "collapse in one step without it)"})
    seed: int = field(default=0, metadata={"help": "seed for the model, prompts and sampling"})
    out: str = field(default="demo-out", metadata={"help": "folder for the report: demo-report.json and .png (--task tool: "
                                                           "demo-report-tool.*, its control demo-report-tool-disabled.*)"})
    json: str | None = field(default=None, metadata={"help": "also write the summary JSON here"})
    redis_url: str | None = field(default=None, metadata={"help": "use this Redis instead of an embedded one"})
    pool: str = field(default="demo", metadata={"help": "pool name (monitoring keys)"})
    heartbeat_interval_s: float | None = field(default=None, metadata={"help": "heartbeat interval of broker and workers "
                                                                                "(default: 0.5 s for max, 1 s for tool)"})
    eval_prompts: int = field(default=200, metadata={"help": "held-out prompts scored before and after training"})
    quiet: bool = field(default=False, metadata={"help": "no per-step progress lines"})
    stale_policy: str = field(default="drop", metadata={"help": "the trainer's stale_policy above eta: drop, regenerate or keep "
                                                                 "(trained with its staleness stated, up to max_staleness_keep)"})
    max_staleness_keep: int | None = field(default=None, metadata={"help": "stale_policy keep: most staleness trained (None: 2 x eta)"})
    slow_worker_s: float = field(default=0.0, metadata={"help": "seconds worker 0 waits before scoring each group: a slow "
                                                                "worker whose groups arrive late (0: none)"})
    lora: bool = field(default=False, metadata={"help": "--task max: train a LoRA adapter on the frozen base (every attention "
                                                        "and MLP projection); each version published is the adapter only"})
    lora_rank: int = field(default=8, metadata={"help": "--lora: the adapter's rank"})
    lora_alpha: float | None = field(default=None, metadata={"help": "--lora: the adapter's alpha (default: 2 x rank)"})
    engine: str = field(default="hf", metadata={"help": "engine of the workers the demo starts: hf (CPU or CUDA) or sglang (a GPU)"})
    engine_options: str = field(default="", metadata={"help": "more --engine-options for the workers the demo starts, k=v,... "
                                                               "(e.g. mem_fraction_static=0.3 for sglang beside a trainer on the same GPU)"})
    device: str = field(default="cpu", metadata={"help": "where the trainer runs: cpu or cuda (the model in float32, the forward "
                                                        "passes in bfloat16 under autocast, micro-batches of --micro-batch-tokens)"})
    micro_batch_tokens: int = field(default=0, metadata={"help": "most padded tokens per forward/backward pass of the trainer (0: the "
                                                                 "whole batch at once)"})
    model_shape: str = field(default="tiny", metadata={"help": "the --task max model (built here, or the shape of --model: it sets the default --lr): tiny (hidden 64, 2 layers, 0.1 M "
                                                                "parameters, CPU), s113m (hidden 768, 12 layers, 113 M, a GPU) or w34m (hidden "
                                                                "1024, 2 layers, 34 M, a GPU)"})
    model: str | None = field(default=None, metadata={"help": "--task max: a model directory built before (task.build_demo_model) "
                                                              "instead of building one (workers started elsewhere serve the same)"})
    lengths: str = field(default="one", metadata={"help": "--task max output lengths: one (the answer token) or longtail (the answer, "
                                                          "then a tail of a length drawn per prompt, lognormal, ignore_eos)"})
    tail_median_tokens: int = field(default=32, metadata={"help": "--lengths longtail: median output length of a prompt (tokens)"})
    tail_sigma: float = field(default=1.0, metadata={"help": "--lengths longtail: sigma of the lognormal output length"})
    tail_max_tokens: int = field(default=512, metadata={"help": "--lengths longtail: cap on the output length (max_new_tokens)"})
    loss_tokens: str = field(default="all", metadata={"help": "tokens the trainer trains: all sampled tokens, or answer (the first "
                                                              "sampled token, the only one the reward reads)"})
    reward_threshold: float = field(default=0.8, metadata={"help": "held-out reward whose first crossing is reported "
                                                                   "(time_to_threshold_s; the trainer's expected held-out reward)"})
    stop_at_reward: float | None = field(default=None, metadata={"help": "end training once the trainer's expected held-out "
                                                                          "reward reaches this (None: run every step)"})
    max_train_s: float | None = field(default=None, metadata={"help": "end training after this many seconds of the training loop"})
    worker_endpoint: str | None = field(default=None, metadata={"help": "the broker's worker endpoint (default: ipc in a temporary "
                                                                        "folder); workers started elsewhere dial it"})
    external_workers: int = field(default=0, metadata={"help": "workers started elsewhere that dial --worker-endpoint; the demo "
                                                               "waits for them to join (--workers may then be 0)"})
    first_version: int = field(default=0, metadata={"help": "the run's first weight version; above 0 the pool is rebased to it and "
                                                            "no prompt goes out before every worker serves it (workers kept from "
                                                            "an earlier run hold that run's weights until then)"})

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ConfigError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.tool_disabled and self.task != "tool":
            raise ConfigError("tool_disabled is the control run of --task tool")
        if not 0.0 <= self.call_bonus < 1.0:
            raise ConfigError(f"call_bonus must be in [0, 1), got {self.call_bonus}")
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"steps must be >= 1, got {self.steps}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ConfigError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if (self.prompts_per_step is not None and self.prompts_per_step < 1) or (self.group_size is not None and self.group_size < 2):
            raise ConfigError("prompts_per_step must be >= 1 and group_size >= 2 (GRPO compares samples of a group)")
        if self.lr is not None and not self.lr > 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if self.entropy_coef is not None and not 0.0 <= self.entropy_coef <= 1.0:
            raise ConfigError(f"entropy_coef must be in [0, 1], got {self.entropy_coef}")
        if self.heartbeat_interval_s is not None and not self.heartbeat_interval_s > 0:
            raise ConfigError(f"heartbeat_interval_s must be > 0, got {self.heartbeat_interval_s}")
        steps = self.steps if self.steps is not None else _TASK_DEFAULTS[self.task]["steps"]
        if self.kill_worker_at is not None and not 1 <= self.kill_worker_at < steps:
            raise ConfigError(f"kill_worker_at must be in 1..{steps - 1}, got {self.kill_worker_at}")
        if not 1 <= self.eval_prompts <= 200:
            raise ConfigError(f"eval_prompts must be in 1..200, got {self.eval_prompts}")
        self._check_staleness()
        self._check_gpu_fields()

    def _check_gpu_fields(self) -> None:  # noqa: C901 - one check per field
        if not 0 <= self.workers <= 64 or not 0 <= self.external_workers <= 64 or self.workers + self.external_workers < 1:
            raise ConfigError(f"workers and external_workers must be in 0..64 with at least one worker, got {self.workers} "
                              f"and {self.external_workers}")
        if self.external_workers and not self.worker_endpoint:
            raise ConfigError("external_workers needs worker_endpoint (the endpoint those workers dial)")
        if self.engine not in ("hf", "sglang"):
            raise ConfigError(f"engine must be hf or sglang, got {self.engine!r}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be cpu or cuda, got {self.device!r}")
        if self.micro_batch_tokens < 0:
            raise ConfigError(f"micro_batch_tokens must be >= 0, got {self.micro_batch_tokens}")
        if self.model_shape not in MODEL_SHAPES:
            raise ConfigError(f"model_shape must be one of {', '.join(MODEL_SHAPES)}, got {self.model_shape!r}")
        if self.lengths not in ("one", "longtail"):
            raise ConfigError(f"lengths must be one or longtail, got {self.lengths!r}")
        if self.loss_tokens not in ("all", "answer"):
            raise ConfigError(f"loss_tokens must be all or answer, got {self.loss_tokens!r}")
        if self.task != "max" and (self.engine != "hf" or self.device != "cpu" or self.model is not None or self.lengths != "one"
                                   or self.model_shape != "tiny"):
            raise ConfigError("engine, device, model, model_shape and lengths other than the defaults are for --task max")
        if not 1 <= self.tail_median_tokens <= self.tail_max_tokens:
            raise ConfigError(f"tail_median_tokens must be in 1..tail_max_tokens ({self.tail_max_tokens}), got {self.tail_median_tokens}")
        if not 0 <= self.tail_sigma <= 3:
            raise ConfigError(f"tail_sigma must be in [0, 3], got {self.tail_sigma}")
        if not 0 < self.reward_threshold <= 1 or (self.stop_at_reward is not None and not 0 < self.stop_at_reward <= 1):
            raise ConfigError("reward_threshold and stop_at_reward must be in (0, 1]")
        if self.max_train_s is not None and not self.max_train_s > 0:
            raise ConfigError(f"max_train_s must be > 0, got {self.max_train_s}")
        if self.first_version < 0:
            raise ConfigError(f"first_version must be >= 0, got {self.first_version}")
        if self.lr_warmup_steps < 0:
            raise ConfigError(f"lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")
        positions = MODEL_SHAPES[self.model_shape]["max_positions"]
        if self.lengths == "longtail" and self.model is None and self.tail_max_tokens + task_prompt_tokens() > positions:
            raise ConfigError(f"tail_max_tokens ({self.tail_max_tokens}) and the prompt do not fit the {self.model_shape} model's "
                              f"{positions} positions (--model-shape s113m has 1024)")

    def _check_staleness(self) -> None:
        if self.stale_policy not in ("drop", "regenerate", "keep"):
            raise ConfigError(f"stale_policy must be drop, regenerate or keep, got {self.stale_policy!r}")
        if self.max_staleness_keep is not None and self.max_staleness_keep < 0:
            raise ConfigError(f"max_staleness_keep must be >= 0, got {self.max_staleness_keep}")
        if self.slow_worker_s < 0:
            raise ConfigError(f"slow_worker_s must be >= 0, got {self.slow_worker_s}")
        if self.lora and self.task != "max":
            raise ConfigError(f"lora trains an adapter for --task max only, got task {self.task!r}")
        if not 1 <= self.lora_rank <= 64:
            raise ConfigError(f"lora_rank must be in 1..64 (the hf engine's max_lora_rank), got {self.lora_rank}")
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise ConfigError(f"lora_alpha must be > 0, got {self.lora_alpha}")
        if self.agent_processes:
            from rollpool.workers.episodes.runner import MAX_AGENT_PROCESSES

            if self.task != "tool" or not 0 < self.agent_processes <= MAX_AGENT_PROCESSES:
                raise ConfigError(f"agent_processes must be in 0..{MAX_AGENT_PROCESSES} and is for --task tool, got "
                                  f"{self.agent_processes} with task {self.task!r}")

    def resolved(self) -> DemoConfig:
        """This config with every unset per-task field set to its task's default."""
        defaults = dict(_TASK_DEFAULTS[self.task])
        if self.task == "max":
            defaults["lr"] = SHAPE_LR[self.model_shape]
        return dataclasses.replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})


def task_prompt_tokens() -> int:
    """Tokens of a --task max prompt: <s>, the digits, <sep>."""
    from rollpool.demo.task import NUM_DIGITS

    return NUM_DIGITS + 2


def worker_task_args(cfg: DemoConfig, index: int) -> list[str]:
    """Worker `index`'s task flags: --task tool's episode function (run in ``--agent-processes`` child processes of the
    worker when set), else the reward scored on the worker (worker 0's slowed by ``--slow-worker-s``)."""
    if cfg.task == "tool":
        episode = ["--episode", "rollpool.demo.tool_task:solve", "--tool-call-parser", "compact"]
        return episode + (["--agent-processes", str(cfg.agent_processes)] if cfg.agent_processes else [])
    slow = index == 0 and cfg.slow_worker_s > 0
    return ["--reward", "rollpool.demo.task:slow_reward" if slow else "rollpool.demo.task:reward"]


def demo_process_specs(broker_args: list[str], broker_env: dict[str, str],
                       workers: list[tuple[str, list[str], dict[str, str]]]) -> list[ProcessSpec]:
    """The demo's children: no restarts of their own, and two stop stages, as `rollpool launch` has: the workers
    first (they drain, hand back and say Goodbye while the broker still listens), the broker last. (All at once, a
    broker with nothing leased closed before the workers' Goodbyes came, and each worker's send failed after its
    5 s send timeout.)"""
    return [ProcessSpec("broker", tuple(broker_args), env=broker_env, restart=False, stop_stage=2),
            *(ProcessSpec(name, tuple(args), env=env, restart=False) for name, args, env in workers)]


def _drain(client: Any, timeout_s: float = 300.0) -> None:
    """Take every group of this client still in the pool, so that the held-out evaluation sees only its own.

    No count of DONE groups can be asked for up front: a prompt cancelled a moment ago still counts as pending
    until its CANCELLED arrives, and it brings no group (a `get_batch(pending)` then waits for its timeout). So:
    pull until nothing is pending (`take_ended` keeps the DONE groups buffered and reports the other ends), then
    take the buffered groups one by one until none can come."""
    from rollpool.trainer_client import UnfillableBatchError

    deadline = time.monotonic() + timeout_s
    while client.pending() > 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{client.pending()} prompts still pending after {timeout_s} s of draining")
        client.take_ended(timeout=1.0)
    while True:
        try:
            client.get_batch(1)
        except UnfillableBatchError:
            return


def _progress(cfg: DemoConfig, msg: str) -> None:
    if not cfg.quiet:
        print(msg, flush=True)


def run_demo(cfg: DemoConfig) -> dict[str, Any]:  # noqa: C901 - grandfathered: the demo's driver loop (start, train, evaluate, report)
    """Run the demo; returns the summary (also written to ``cfg.out``)."""
    import torch
    from transformers import LlamaForCausalLM

    from rollpool.demo import task, tool_task, vision_task
    from rollpool.demo.trainer import GRPOConfig, grpo_step
    from rollpool.trainer_client import SyncTrainerClient, TrainerClientConfig
    from rollpool.trainer_client.client import make_prompt

    t_start = time.monotonic()
    cfg = cfg.resolved()
    assert (cfg.steps is not None and cfg.prompts_per_step is not None and cfg.group_size is not None and cfg.lr is not None
            and cfg.entropy_coef is not None and cfg.heartbeat_interval_s is not None)
    n_steps, prompts_per_step, group_size, lr = cfg.steps, cfg.prompts_per_step, cfg.group_size, cfg.lr
    heartbeat_s = cfg.heartbeat_interval_s
    tool = cfg.task == "tool"
    vision = cfg.task == "vision"

    def _terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)  # SIGTERM cleans up like Ctrl-C: children stopped, nothing left
    out_dir = pathlib.Path(cfg.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix="rollpool-demo-"))
    with contextlib.suppress(Exception):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the demo's own progress lines are the output
    model_dir = (tool_task.build_tool_model(work / "model", seed=cfg.seed) if tool
                 else vision_task.build_vision_model(work / "model", seed=cfg.seed) if vision
                 else pathlib.Path(cfg.model) if cfg.model is not None
                 else task.build_demo_model(work / "model", seed=cfg.seed, head_std=LORA_HEAD_STD if cfg.lora else None,
                                            **MODEL_SHAPES[cfg.model_shape]))
    assert cfg.max_staleness is not None
    eta = 0 if cfg.sync else cfg.max_staleness
    batch_samples = prompts_per_step * group_size
    children: SupervisorThread | None = None
    redis = None
    client: SyncTrainerClient | None = None
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}  # beside os.environ
    worker_ep = cfg.worker_endpoint or f"ipc://{work}/workers"
    client_ep = f"ipc://{work}/clients"
    summary: dict[str, Any] = {}
    try:
        redis_url = cfg.redis_url
        if redis_url is None:
            with contextlib.suppress(Exception):
                from rollpool.monitor.embedded import EmbeddedRedis

                redis = EmbeddedRedis().start()
                redis_url = redis.url
        common = ["--log-level", os.environ.get("ROLLPOOL_LOG_LEVEL", "INFO")]
        redis_args = ["--redis-url", redis_url] if redis_url else []
        broker_args = [sys.executable, "-m", "rollpool.broker", *common,
                       "--worker-endpoint", worker_ep, "--client-endpoint", client_ep,
                       "--batch-size", str(batch_samples), "--max-staleness", str(eta),
                       "--heartbeat-interval-s", str(heartbeat_s),
                       "--task-timeout-s", "60", "--pool", cfg.pool, *redis_args]

        def worker_args(i: int) -> list[str]:
            options = f"seed={cfg.seed + i}" + (f",{cfg.engine_options}" if cfg.engine_options else "")
            return [sys.executable, "-m", "rollpool.workers", *common, "--broker", worker_ep, "--engine", cfg.engine,
                    "--model", str(model_dir), "--worker-id", f"demo-w{i}", *worker_task_args(cfg, i),
                    "--heartbeat-interval-s", str(heartbeat_s), "--apply-mode", "interrupt",
                    "--engine-options", options, "--pool", cfg.pool, *redis_args]

        def worker_env(i: int) -> dict[str, str]:
            return {**env, task.SLOW_ENV: str(cfg.slow_worker_s)} if i == 0 and cfg.slow_worker_s > 0 else env

        specs = demo_process_specs(broker_args, env, [(f"worker-{i}", worker_args(i), worker_env(i)) for i in range(cfg.workers)])
        children = supervisor = SupervisorThread(Supervisor(specs, out_dir, stop_timeout_s=10.0, state_file=None,
                                                            label="rollpool demo"))
        supervisor.start()

        torch.manual_seed(cfg.seed)
        if cfg.device == "cpu":
            torch.set_num_threads(1)
        image_of: dict[str, bytes] = {}
        """Vision: the image of every prompt submitted, by prompt id (the trainer recomputes logprobs with it)."""
        extra_inputs = None
        if vision:
            from transformers import AutoImageProcessor, Qwen2VLForConditionalGeneration

            model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir)
            processor = AutoImageProcessor.from_pretrained(model_dir)

            def extra_inputs(groups: Any, ids: Any) -> dict[str, Any]:
                rows = [image_of[g.prompt_id] for g in groups for _ in g.trajectories]
                # placeholders are the prompt's image tokens only: one the policy sampled is run as padding (it is the
                # last token of its row here, so no scored position depends on it)
                run_ids = ids.clone()
                run_ids[:, len(vision_task.prompt_ids()) + 3:][run_ids[:, len(vision_task.prompt_ids()) + 3:] == vision_task.IMAGE_ID] = task.PAD_ID
                return {**vision_task.batch_inputs(processor, rows), "mm_token_type_ids": (run_ids == vision_task.IMAGE_ID).int(),
                        "model_input_ids": run_ids}
        else:
            model = LlamaForCausalLM.from_pretrained(model_dir).float().to(cfg.device)  # float32 master weights
        cuda = cfg.device == "cuda"

        def sync_device() -> None:
            if cuda:
                torch.cuda.synchronize()

        adapter: Any = None
        adapter_spec: Any = None
        trained: Any = model.parameters()
        if cfg.lora:
            from rollpool.demo.lora import TrainableLora
            from rollpool.protocol.fingerprint import model_fingerprint

            # the workers keep the base from disk; the trainer freezes the same base and trains only the adapter
            adapter = TrainableLora(model, rank=cfg.lora_rank, alpha=cfg.lora_alpha or 2.0 * cfg.lora_rank)
            adapter_spec = adapter.spec(base_fingerprint=model_fingerprint(model_dir), base_model="rollpool demo base")
            trained = adapter.parameters()

        def published() -> Any:
            # an sglang engine serves bfloat16: send what it keeps (half the bytes of the float32 master weights)
            if cfg.engine == "sglang":
                return {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
            return model

        optimizer = torch.optim.Adam(trained, lr=lr)
        # constant for the first half, then linear decay to lr_final_ratio: keeps the converged policy stable
        half = max(1, n_steps // 2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: (min(1.0, (s + 1) / cfg.lr_warmup_steps) if s < cfg.lr_warmup_steps else 1.0) if s < half
            else max(cfg.lr_final_ratio, 1.0 - (1.0 - cfg.lr_final_ratio) * (s - half) / half))
        from rollpool.monitor.sink import sink_from_url

        metrics = sink_from_url(redis_url, cfg.pool, source="trainer")
        client = SyncTrainerClient(client_ep, config=TrainerClientConfig(broker=client_ep, request_timeout_s=30.0),
                                   metrics=metrics)
        version = cfg.first_version
        publish_s: list[float] = []

        def publish(v: int) -> float:
            t0 = time.perf_counter()
            if adapter is not None:
                client.publish_weights(adapter.named_tensors(), v, adapter=adapter_spec)
            else:
                client.publish_weights(published(), v)
            publish_s.append(time.perf_counter() - t0)
            return publish_s[-1]

        if version > 0:
            client.rebase_version(version)  # the pool's admission account starts at this run's first version
        publish(version)
        expected_workers = cfg.workers + cfg.external_workers
        t_join = time.monotonic()
        while int(client.status()["counters"].get("workers_alive", 0)) < expected_workers:
            if time.monotonic() - t_join > 900:
                raise RuntimeError(f"fewer than {expected_workers} workers joined in 900 s (logs in {out_dir})")
            time.sleep(0.2)
        if version > 0:
            # a worker kept from an earlier run holds that run's weights: nothing is generated before it serves these
            client.wait_for_version(version, 1.0, timeout=300)
        workers_ready_s = time.monotonic() - t_start
        # the tool task's agent sets max_tokens per turn (2 for the call turn, 1 for the answer)
        sampling = SamplingParams(max_new_tokens=2 if tool else 1, temperature=1.0)
        longtail = cfg.lengths == "longtail"
        rng = random.Random(cfg.seed)
        length_rng = random.Random(f"lengths:{cfg.seed}")

        def train_sampling() -> SamplingParams:
            """Per prompt: the answer token, or (long tail) the answer and a tail of a drawn length, EOS ignored."""
            if not longtail:
                return sampling
            n_tokens = task.tail_length(length_rng, cfg.tail_median_tokens, cfg.tail_sigma, cfg.tail_max_tokens)
            return SamplingParams(max_new_tokens=n_tokens, temperature=1.0, ignore_eos=True)

        held_out_examples = task.held_out_set() if cfg.task == "max" else []
        oldest_version = [-1]
        """The oldest weight version of any sampled token this run received (held-out ones too): never below the run's
        first version (a worker kept from an earlier run must not answer with that run's weights)."""

        def saw(trajectories: Any) -> None:
            for t in trajectories:
                if len(t.token_versions):
                    v = int(t.token_versions.min())
                    oldest_version[0] = v if oldest_version[0] < 0 else min(oldest_version[0], v)

        def eval_held_out() -> tuple[float, float]:
            """(held-out reward, share of held-out episodes that called the tool); the second is 0 for the max task."""
            if tool:
                # episodes never trained on, with their own draws of the secrets (a seed apart from training's)
                eval_rng = random.Random(f"eval:{cfg.seed}")
                prompts = [{**tool_task.make_prompt(eval_rng, tool=not cfg.tool_disabled, call_bonus=cfg.call_bonus, evaluation=True),
                            "group_size": 1, "sampling": sampling, "exempt_from_staleness": True}
                           for _ in range(cfg.eval_prompts)]
            elif vision:
                prompts = [{"input_ids": vision_task.prompt_ids(), "images": (PromptImage(data=png),), "group_size": 1, "sampling": sampling,
                            "metadata": {"answer_id": ans, "eval": True}, "exempt_from_staleness": True}
                           for png, ans in vision_task.held_out_set()[: cfg.eval_prompts]]
            else:
                held = task.held_out_set()[: cfg.eval_prompts]
                # evaluation rollouts are not training samples: outside staleness admission
                prompts = [{"input_ids": ids, "group_size": 1, "sampling": sampling, "metadata": {"answer_id": ans, "eval": True},
                            "exempt_from_staleness": True} for ids, ans in held]
            client.submit(prompts)
            batch = client.get_batch(len(prompts), timeout=300)
            saw(batch.trajectories)
            if tool:
                # unshaped: the answer, and whether turn 1 held a call the parser found
                correct = [bool(t.metadata.get("correct")) for t in batch.trajectories]
                called = [bool(t.metadata.get("called")) for t in batch.trajectories]
                return float(sum(correct) / len(correct)), float(sum(called) / len(called))
            rewards = [t.reward or 0.0 for t in batch.trajectories]
            return float(sum(rewards) / len(rewards)), 0.0

        if redis_url:
            _progress(cfg, f"live view: rollpool top --redis-url {redis_url} --pool {cfg.pool}")
        task_name = (("tool disabled (control): " if cfg.tool_disabled else "") + "look a secret digit up with a tool, then say it (episodes)"
                     if tool else "the colour of the square in the image (a tiny Qwen2-VL)" if vision
                     else f"largest of four digits, LoRA rank {cfg.lora_rank} on a frozen base" if cfg.lora else "largest of four digits")
        _progress(cfg, f"rollpool demo: {expected_workers} {cfg.engine} workers, trainer on {cfg.device}, {'sync (eta=0)' if eta == 0 else f'async (eta={eta})'}, "
                       f"{n_steps} steps x {prompts_per_step} groups x {group_size} samples; task: {task_name}")
        heldout_first, calls_first = eval_held_out()
        _progress(cfg, f"held-out reward before training: {heldout_first:.3f}" + (f"  tool-call share {calls_first:.3f}" if tool else ""))

        def submit_more(count: int) -> None:
            prompts: list[Any] = []
            for _ in range(count):
                if tool:
                    prompts.append({**tool_task.make_prompt(rng, tool=not cfg.tool_disabled, call_bonus=cfg.call_bonus),
                                    "group_size": group_size, "sampling": sampling})
                    continue
                if vision:
                    png, ans = vision_task.training_example(rng)
                    p = make_prompt({"input_ids": vision_task.prompt_ids(), "images": (PromptImage(data=png),), "group_size": group_size,
                                     "sampling": sampling, "metadata": {"answer_id": ans}})
                    image_of[p.prompt_id] = png
                    prompts.append(p)
                    continue
                ids, ans = task.training_example(rng)
                prompts.append({"input_ids": ids, "group_size": group_size, "sampling": train_sampling(),
                                "metadata": {"answer_id": ans}})
            client.submit(prompts)

        submitted_groups = 0
        lookahead = prompts_per_step * (eta + 1)
        submit_more(lookahead)
        submitted_groups += lookahead
        steps: list[dict[str, float]] = []
        lag_hist: Counter[int] = Counter()
        seen_traj: set[str] = set()
        duplicated = 0
        killed_at: float | None = None
        trained_over_eta = 0
        last_trajectories: Any = ()
        grpo = GRPOConfig(lr=lr, entropy_coef=cfg.entropy_coef, micro_batch_tokens=cfg.micro_batch_tokens, autocast=cuda,
                          loss_first_tokens=1 if cfg.loss_tokens == "answer" else None)
        timing: dict[str, list[float]] = {"wait_s": [], "train_s": [], "publish_s": [], "eval_s": [], "tokens": [],
                                          "heldout_expected": []}
        group_timings: list[list[float]] = []
        """Per trained group: [step, output tokens of its longest sample, its seconds from first start to last finish,
        samples]: what the simulator's calibration reads (bench/calibrate_sim.py)."""
        threshold_at: tuple[int, float] | None = None
        steps_run = 0
        stop_reason = "steps"
        t_train = time.monotonic()
        for step in range(1, n_steps + 1):
            if cfg.kill_worker_at is not None and step == cfg.kill_worker_at:
                supervisor.kill("worker-0")
                killed_at = time.monotonic()
                _progress(cfg, f"step {step}: killed worker demo-w0 (SIGKILL)")
            if cfg.kill_worker_at is not None and step == cfg.kill_worker_at + 2:
                supervisor.start_child("worker-0")
                _progress(cfg, f"step {step}: restarted worker demo-w0")
            t_wait = time.monotonic()
            batch = client.get_batch(prompts_per_step, max_staleness=eta, timeout=300, stale_policy=cfg.stale_policy,
                                     max_staleness_keep=cfg.max_staleness_keep)
            timing["wait_s"].append(time.monotonic() - t_wait)
            last_trajectories = batch.trajectories
            saw(batch.trajectories)
            timing["tokens"].append(float(sum(len(t.output_ids) for t in batch.trajectories)))
            for g in batch.groups:
                starts = [t.started_at for t in g.trajectories if t.started_at > 0]
                ends = [t.finished_at for t in g.trajectories if t.finished_at > 0]
                group_timings.append([step, max((len(t.output_ids) for t in g.trajectories), default=0),
                                      round(max(ends) - min(starts), 4) if starts and ends else -1.0, len(g.trajectories)])
            for t in batch.trajectories:
                if t.trajectory_id in seen_traj:
                    duplicated += 1
                seen_traj.add(t.trajectory_id)
                if len(t.token_versions):
                    lag_hist[int(version - int(t.token_versions.min()))] += 1
            for g in batch.groups:  # trained staler than eta (only under keep)
                lags = [version - int(t.token_versions.min()) for t in g.trajectories if len(t.token_versions)]
                trained_over_eta += int(bool(lags) and max(lags) > eta)
            stats = dict(batch.stats)
            if tool:
                # unshaped figures of the training episodes (the reward trained on includes call_bonus)
                trajs = batch.trajectories
                stats["tool/correct"] = float(sum(bool(t.metadata.get("correct")) for t in trajs) / max(1, len(trajs)))
                stats["tool/called"] = float(sum(bool(t.metadata.get("called")) for t in trajs) / max(1, len(trajs)))
            sync_device()
            t_step = time.monotonic()
            stats.update(grpo_step(model, optimizer, batch.groups, pad_id=task.PAD_ID, config=grpo, extra_inputs=extra_inputs))
            sync_device()
            timing["train_s"].append(time.monotonic() - t_step)
            for g in batch.groups:
                image_of.pop(g.prompt_id, None)
            scheduler.step()
            version += 1
            timing["publish_s"].append(publish(version))
            steps_run = step
            if held_out_examples:
                # the trained policy's expected held-out reward (one forward pass, no sampling noise): when it crosses
                # the threshold is the run's time to threshold, whatever versions the workers serve meanwhile
                t_eval = time.monotonic()
                expected = task.expected_reward(model, held_out_examples[: cfg.eval_prompts], autocast=cuda)
                timing["eval_s"].append(time.monotonic() - t_eval)
                timing["heldout_expected"].append(expected)
                stats["heldout/expected_reward"] = expected
                if threshold_at is None and expected >= cfg.reward_threshold:
                    threshold_at = (step, time.monotonic() - t_train)
                if cfg.stop_at_reward is not None and expected >= cfg.stop_at_reward:
                    stop_reason = "stop_at_reward"
            if cfg.max_train_s is not None and time.monotonic() - t_train >= cfg.max_train_s and stop_reason == "steps":
                stop_reason = "max_train_s"
            # keep eta + 1 steps of prompts in the pool (sync: exactly the next step's)
            # (plus what the bound dropped: under drop a stale group is gone, its prompt not trained)
            want = prompts_per_step * (step + eta + 1) + int(client.counters.get("dropped_stale", 0)) - submitted_groups
            if step < n_steps and want > 0 and stop_reason == "steps":
                submit_more(want)
                submitted_groups += want
            stats["step"] = float(step)
            stats["elapsed_s"] = time.monotonic() - t_train
            steps.append(stats)
            tool_line = f"answer {stats['tool/correct']:.3f}  calls {stats['tool/called']:.3f}  " if tool else ""
            _progress(cfg, f"step {step:3d}  v{version:<3d} reward {stats['rollout/reward_mean']:.3f}  {tool_line}"
                           f"lag max {stats['rollout/staleness_max']:.0f}  tokens/s {stats['rollout/tokens_per_s']:7.1f}  "
                           f"loss {stats['train/loss']:+.4f}  {stats['elapsed_s']:6.1f} s"
                           + (f"  held-out expected {stats['heldout/expected_reward']:.3f}" if held_out_examples else ""))
            if stop_reason != "steps":
                _progress(cfg, f"step {step}: training ends ({stop_reason})")
                break
        train_wall = time.monotonic() - t_train
        if stop_reason != "steps" and client.pending():
            # ended early: the prompts submitted ahead are not needed (each still reaches a terminal state: CANCELLED)
            client.cancel(client.pending_ids())
        _drain(client)
        heldout_final, calls_final = eval_held_out()
        status = client.status()
        counters = status["counters"]
        # the max task: the reward; the tool task: the unshaped answer reward (what is trained on adds call_bonus)
        rewards = [s["tool/correct" if tool else "rollout/reward_mean"] for s in steps]
        tail = rewards[-min(5, len(rewards)):]
        summary = {
            "task": cfg.task,
            "mode": "sync" if eta == 0 else "async",
            "max_staleness": eta,
            "workers": cfg.workers,
            "steps": steps_run,
            "steps_planned": n_steps,
            "stop_reason": stop_reason,
            "samples_per_step": batch_samples,
            "prompts_per_step": prompts_per_step,
            "group_size": group_size,
            "device": cfg.device,
            "engine": cfg.engine,
            "engine_options": cfg.engine_options,
            "model_shape": cfg.model_shape,
            "model_given": cfg.model is not None,
            "model_parameters": int(sum(p.numel() for p in model.parameters())),
            "lengths": cfg.lengths,
            **({"tail_median_tokens": cfg.tail_median_tokens, "tail_sigma": cfg.tail_sigma, "tail_max_tokens": cfg.tail_max_tokens}
               if cfg.lengths == "longtail" else {}),
            "loss_tokens": cfg.loss_tokens,
            "lr": lr,
            "lr_warmup_steps": cfg.lr_warmup_steps,
            "seed": cfg.seed,
            "first_version": cfg.first_version,
            "oldest_token_version": oldest_version[0],
            "workers_ready_s": workers_ready_s,
            "reward_threshold": cfg.reward_threshold,
            "time_to_threshold_s": threshold_at[1] if threshold_at is not None else None,
            "steps_to_threshold": threshold_at[0] if threshold_at is not None else None,
            "heldout_expected_final": timing["heldout_expected"][-1] if timing["heldout_expected"] else None,
            "trainer_wait_s": float(sum(timing["wait_s"])),
            "trainer_idle_share": float(sum(timing["wait_s"]) / train_wall) if train_wall > 0 else 0.0,
            "train_s_mean": float(sum(timing["train_s"]) / max(1, len(timing["train_s"]))),
            "publish_s_mean": float(sum(timing["publish_s"]) / max(1, len(timing["publish_s"]))),
            "tokens_trained": int(sum(timing["tokens"])),
            "tokens_per_s": float(sum(timing["tokens"]) / train_wall) if train_wall > 0 else 0.0,
            "samples_per_s": float(steps_run * batch_samples / train_wall) if train_wall > 0 else 0.0,
            "reward_first": rewards[0],
            "reward_final": float(sum(tail) / len(tail)),
            "heldout_reward_first": heldout_first,
            "heldout_reward_final": heldout_final,
            "wall_s": time.monotonic() - t_start,
            "train_wall_s": train_wall,
            "lost": int(client.pending()),
            "duplicated": duplicated,
            "max_lag": max(lag_hist) if lag_hist else 0,
            "lag_histogram": {str(k): v for k, v in sorted(lag_hist.items())},
            "requeued": int(counters.get("requeued", 0)),
            "failed": int(counters.get("failed", 0)),
            "broker_duplicates": int(counters.get("duplicates", 0)),
            "client": client.counters,
            "tokens_per_s_mean": float(sum(s["rollout/tokens_per_s"] for s in steps) / len(steps)),
            "killed_worker_at_step": cfg.kill_worker_at,
            "stale_policy": cfg.stale_policy,
            "slow_worker_s": cfg.slow_worker_s,
            # groups the trainer received staler than eta: dropped (drop, regenerate) or trained (keep)
            "groups_over_eta": int(client.counters.get("dropped_stale", 0)) + trained_over_eta,
            "groups_trained_over_eta": trained_over_eta,
            "groups_received": int(client.counters.get("dropped_stale", 0)) + steps_run * prompts_per_step,
            "stale_samples_trained": int(sum(n for lag, n in lag_hist.items() if lag > eta)),
            "reward_per_step": rewards,
            "tokens_per_s_per_step": [s["rollout/tokens_per_s"] for s in steps],
            "per_step": {k: [round(x, 5) for x in v] for k, v in timing.items()},
            "group_timings": group_timings,
            "note": ("real hf engine on CPU; on two shared cores the trainer and workers contend for the CPU" if cfg.device == "cpu"
                     else f"trainer on {cfg.device}, {cfg.engine} workers; on one GPU the trainer and the engine share it"),
        }
        if tool:
            summary.update({
                "tool_disabled": cfg.tool_disabled,
                "agent_processes": cfg.agent_processes,
                "entropy_coef": cfg.entropy_coef,
                "call_bonus": cfg.call_bonus,
                "tool_call_share_first": calls_first,
                "tool_call_share_final": calls_final,
                "training_reward_per_step": [s["rollout/reward_mean"] for s in steps],
                "tool_call_share_per_step": [s["tool/called"] for s in steps],
            })
        if killed_at is not None:
            summary["recovered"] = True
        if adapter is not None:
            full_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
            summary["lora"] = {
                "rank": adapter.rank, "alpha": adapter.alpha, "targets": list(adapter.targets),
                "adapter_bytes_per_version": adapter.nbytes(), "full_bytes_per_version": full_bytes,
                "trainable_params": sum(p.numel() for p in adapter.parameters()),
                "publish_s_median": sorted(publish_s)[len(publish_s) // 2],
                "base": "the demo's random-init Llama (build_demo_model, seed), frozen: the workers load it from disk",
            }
        vocab = tool_task.VOCAB if tool else vision_task.VOCAB if vision else task.VOCAB
        examples = [_example(t, vocab) for t in list(last_trajectories)[:16]]
        stem = report_stem(cfg)
        _write_report(out_dir, stem, summary, steps, examples)
        if cfg.json:
            pathlib.Path(cfg.json).write_text(json.dumps(_headline(summary), indent=2) + "\n")
        _print_summary(summary, out_dir, stem)
        return summary
    finally:
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
            with contextlib.suppress(Exception):
                client.client.metrics.close()
        if children is not None:
            children.stop()
        if redis is not None:
            redis.stop()
        with contextlib.suppress(Exception):
            import shutil

            shutil.rmtree(work, ignore_errors=True)


def _example(t: Any, vocab: list[str]) -> dict[str, Any]:
    """One delivered trajectory, its tokens as words (the report's ``examples``: what the trainer trained on)."""
    def words(ids: Any) -> list[str]:
        return [vocab[int(i)] if 0 <= int(i) < len(vocab) else str(int(i)) for i in ids]

    return {"trajectory_id": t.trajectory_id, "input": words(t.input_ids), "output": words(t.output_ids),
            "loss_mask": [int(m) for m in t.loss_mask], "token_versions": [int(v) for v in t.token_versions],
            "reward": t.reward, "finish_reason": t.finish_reason,
            "metadata": {k: v for k, v in t.metadata.items() if isinstance(v, str | int | float | bool)}}


def _headline(summary: dict[str, Any]) -> dict[str, Any]:
    keys: tuple[str, ...] = ("reward_first", "reward_final", "heldout_reward_first", "heldout_reward_final", "steps", "wall_s",
            "lost", "duplicated", "max_lag", "requeued", "mode", "task")
    if summary["task"] == "tool":
        keys += ("tool_call_share_first", "tool_call_share_final", "tool_disabled", "call_bonus", "agent_processes")
    # what the stale policy did with late groups; the run's device, lengths and timings; the adapter's figures
    extra = ("stale_policy", "groups_over_eta", "groups_received", "stale_samples_trained", "lag_histogram", "lora", "device", "engine",
             "model_parameters", "lengths", "time_to_threshold_s", "steps_to_threshold", "trainer_idle_share", "tokens_per_s",
             "stop_reason")
    return {**{k: summary[k] for k in keys}, **{k: summary[k] for k in extra if k in summary}}


def report_stem(cfg: DemoConfig) -> str:
    """The report's file name without its suffix, one per task, so one demo's report does not overwrite another's:
    ``demo-report`` (max), ``demo-report-tool``, ``demo-report-tool-disabled`` (its control)."""
    if cfg.task == "max":
        return "demo-report-lora" if cfg.lora else "demo-report"
    return f"demo-report-{cfg.task}" + ("-disabled" if cfg.tool_disabled else "")


def _print_summary(s: dict[str, Any], out_dir: pathlib.Path, stem: str) -> None:
    rows = [
        ("mode", f"{s['mode']} (eta={s['max_staleness']})"),
        ("steps x samples", f"{s['steps']} x {s['samples_per_step']}"),
        ("reward first step -> last 5 steps", f"{s['reward_first']:.3f} -> {s['reward_final']:.3f}"),
        ("held-out reward before -> after", f"{s['heldout_reward_first']:.3f} -> {s['heldout_reward_final']:.3f}"),
        *([("held-out tool-call share before -> after", f"{s['tool_call_share_first']:.3f} -> {s['tool_call_share_final']:.3f}"
            + (" (tool disabled: control)" if s["tool_disabled"] else ""))] if s["task"] == "tool" else []),
        ("wall time", f"{s['wall_s']:.1f} s (training loop {s['train_wall_s']:.1f} s)"),
        ("tokens/s (mean per step)", f"{s['tokens_per_s_mean']:.1f}"),
        *([("time to held-out expected reward " + f"{s['reward_threshold']:g}",
            f"{s['time_to_threshold_s']:.1f} s (step {s['steps_to_threshold']})" if s.get("time_to_threshold_s") is not None
            else "not reached")] if s["task"] == "max" else []),
        ("trainer idle (waiting for rollouts)", f"{s['trainer_idle_share']:.0%}"),
        ("version lag histogram", " ".join(f"{k}:{v}" for k, v in s["lag_histogram"].items())),
        ("requeued / failed", f"{s['requeued']} / {s['failed']}"),
        ("lost / duplicated", f"{s['lost']} / {s['duplicated']}"),
        *([("LoRA adapter", f"rank {s['lora']['rank']}: {s['lora']['adapter_bytes_per_version']:,} bytes per version "
            f"(whole model {s['lora']['full_bytes_per_version']:,}), publish {s['lora']['publish_s_median'] * 1e3:.1f} ms")]
          if "lora" in s else []),
    ]
    width = max(len(r[0]) for r in rows)
    print("\nrollpool demo summary")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    print(f"  report: {out_dir / (stem + '.json')}, {out_dir / (stem + '.png')}")


def _write_report(out_dir: pathlib.Path, stem: str, summary: dict[str, Any], steps: list[dict[str, float]],
                  examples: list[dict[str, Any]]) -> None:
    report = {"summary": summary, "steps": steps, "examples": examples}
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: %s.png not written (pip install matplotlib)", stem)
        return
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    x = list(range(1, len(steps) + 1))
    axes[0].plot(x, summary["reward_per_step"], marker=".")
    axes[0].axhline(summary["heldout_reward_final"], color="green", linestyle="--", label="held-out, final")
    axes[0].axhline(summary["heldout_reward_first"], color="grey", linestyle=":", label="held-out, first")
    axes[0].set(title="reward per step", xlabel="step", ylim=(0, 1.05))
    axes[0].legend(loc="lower right")
    axes[1].plot(x, summary["tokens_per_s_per_step"], marker=".")
    axes[1].set(title="rollout tokens/s", xlabel="step")
    lags = summary["lag_histogram"]
    axes[2].bar(list(lags.keys()), list(lags.values()))
    axes[2].set(title="version lag at consumption (samples)", xlabel="versions behind")
    axes[3].bar(["requeued", "failed", "lost", "duplicated"],
                [summary["requeued"], summary["failed"], summary["lost"], summary["duplicated"]])
    axes[3].set(title="requeues and losses")
    fig.suptitle(f"rollpool demo ({summary['mode']}, eta={summary['max_staleness']}, {summary['workers']} {summary['engine']} workers, "
                 f"trainer on {summary['device']})")
    fig.tight_layout()
    fig.savefig(out_dir / f"{stem}.png", dpi=90)
    plt.close(fig)
