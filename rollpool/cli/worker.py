"""``rollpool worker``: run one rollout worker (or ``--count N`` sim workers in one process).

A bad configuration (a flag, an unknown engine, a model directory that does not exist, an
``--episode`` path that does not import, or a broker at ``--broker`` that refuses this worker for
good: another pool's, or one of no common protocol; or an sglang engine of ``--tp-size`` x ``--dp-size``
GPUs on a worker that sees fewer) exits 2 with the reason on stderr in one line. SIGTERM/SIGINT start the graceful drain (stop intake, finish until
``--drain-timeout-s``, hand back the rest, Goodbye); the command exits 0 once
every worker has drained. Monitoring sinks are wired by the top-level CLI;
this module uses the null sink unless given one.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses

from rollpool.cli._service import run_service
from rollpool.protocol.config import add_config_arguments, load_config
from rollpool.protocol.errors import ConfigError
from rollpool.protocol.metrics import MetricsSink, NullMetricsSink
from rollpool.protocol.sockets import SocketFactory
from rollpool.workers.config import WorkerConfig
from rollpool.workers.engines.registry import check_engine_and_model
from rollpool.workers.episodes.runner import load_episode_functions
from rollpool.workers.worker import Worker, freeze_start_up_heap

__all__ = ["HELP", "add_arguments", "run", "run_workers"]

HELP = "run a rollout worker (engines: sim, hf, sglang)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="TOML file with a [worker] table (env ROLLPOOL_CONFIG)")
    add_config_arguments(parser, WorkerConfig)


def run(args: argparse.Namespace, metrics: MetricsSink | None = None) -> int:
    # a ConfigError (a bad flag, or an --episode path that does not import) exits 2 in rollpool.cli.main
    config = load_config(WorkerConfig, args, toml_path=getattr(args, "config", None), section="worker")
    check_engine_and_model(config.engine, config.model)  # an unknown engine, a missing model directory: one line
    load_episode_functions(config.episode)  # a bad --episode path fails here, before any engine loads
    if config.engine == "sglang":
        _check_gpus(config)  # --tp-size x --dp-size beyond the worker's GPUs fails here (exit 2), not as engine restarts
    try:
        return asyncio.run(run_workers(config, metrics or NullMetricsSink()))
    except BaseExceptionGroup as group:  # the task groups wrap it: a refusal by the broker is still one line, exit 2
        refusal = group.subgroup(ConfigError)
        if refusal is None:
            raise
        first: BaseException = refusal
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None


def _check_gpus(config: WorkerConfig) -> None:
    from rollpool.workers.engines.options import SGLangOptions, options_from
    from rollpool.workers.engines.sglang.engine import engine_gpu_plan
    from rollpool.workers.engines.sglang.tensors import cuda_available

    opts = options_from(SGLangOptions, config.engine_kwargs())
    engine_gpu_plan(opts, opts.device or ("cuda" if cuda_available() else "cpu"))


class _Workers:
    """The ``--count`` workers of one process, stopped and run together (each on its own DEALER)."""

    def __init__(self, config: WorkerConfig, sockets: SocketFactory, metrics: MetricsSink) -> None:
        if config.count == 1:
            configs = [config]
        else:
            configs = [dataclasses.replace(config, worker_id=f"{config.worker_id}-{i}", count=1) for i in range(config.count)]
        self.workers = [Worker(c, sockets, metrics=metrics) for c in configs]

    def stop(self) -> None:
        for w in self.workers:
            w.stop()

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            runs = [tg.create_task(w.run(), name=f"worker-{w.worker_id}") for w in self.workers]
            tg.create_task(self._freeze_when_started(runs), name="freeze-gc")

    async def _freeze_when_started(self, runs: list[asyncio.Task[None]]) -> None:
        """This process runs workers and nothing else: once every engine is up, its start-up heap leaves the collector
        (not when a worker ended before its engine came up)."""
        for w, run in zip(self.workers, runs, strict=True):
            started = asyncio.ensure_future(w.started.wait())
            await asyncio.wait([started, run], return_when=asyncio.FIRST_COMPLETED)
            if not started.done():
                started.cancel()
                return
        freeze_start_up_heap()


async def run_workers(config: WorkerConfig, metrics: MetricsSink) -> int:
    # SIGHUP keeps its default for a worker (no key reload there)
    await run_service(lambda sockets: _Workers(config, sockets, metrics), curve_dir=config.curve_dir, role="worker",
                      metrics=metrics, reload_keys_on_hup=False, io_threads=config.weights.streams)
    return 0
