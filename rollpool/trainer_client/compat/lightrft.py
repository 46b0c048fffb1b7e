"""LightRFT's `RLGenerationEngine`, served by a rollpool pool.

Port by changing the import and adding ``broker=``::

    from rollpool.trainer_client.compat.lightrft import RLGenerationEngine
    engine = RLGenerationEngine(tp_group_cpu=tp_group, num_gpu_per_node=8, model="/models/m", broker="tcp://broker:5556")

Every method keeps LightRFT's signature. `generate` takes SGLang's `GenerateReqInput`
arguments (`RolloutPool.generate` honours or refuses each, by name) and returns one dict for
one prompt, a list for a batch. `update_weights_from_tensor` stages; the next `generate`
publishes every staged tensor as one new version and is served at that version only
(synchronous, as SGLang's engine is). `sleep`/`wake_up` release and resume KV cache and CUDA
graphs on every worker, weights too with ``release_weights=True``.

Accepted and meaningless on a pool: `tp_group_cpu` (LightRFT broadcasts the leader rank's
results across it; here every caller generates its own), `num_gpu_per_node`, `gather_inputs`
(each caller gets the results of its own prompts) and the SGLang server arguments in
``**kwargs`` (the workers own their engines; they are kept in `engine_kwargs`). ``model`` /
``model_path`` is checked against the workers' model (see `compat._model`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from rollpool.protocol import ConfigError
from rollpool.trainer_client.client import TrainerClientConfig
from rollpool.trainer_client.compat._model import DEFAULT_BROKER_TIMEOUT_S, open_pool
from rollpool.trainer_client.pool import RolloutPool

__all__ = ["RLGenerationEngine"]

log = logging.getLogger(__name__)


class RLGenerationEngine:
    def __init__(self, tp_group_cpu: Any = None, num_gpu_per_node: int = 8, *, broker: str | None = None,
                 synchronous: bool = True, timeout_s: float | None = DEFAULT_BROKER_TIMEOUT_S,
                 weight_timeout_s: float | None = None, client_config: TrainerClientConfig | None = None, **kwargs: Any) -> None:
        model = kwargs.pop("model", None)
        model_path = kwargs.pop("model_path", None)
        if model is not None and model_path is not None and model != model_path:
            raise ConfigError(f"RLGenerationEngine: model={model!r} and model_path={model_path!r} differ; give one")
        self.tp_group_cpu = tp_group_cpu
        self.num_gpu_per_node = num_gpu_per_node
        self.engine_kwargs = dict(kwargs)
        """SGLang server arguments: meaningless here (the workers own their engines), kept for inspection."""
        if kwargs:
            log.info("RLGenerationEngine: SGLang server arguments %s are the workers' business and not used here", sorted(kwargs))
        self.pool: RolloutPool = open_pool(broker, who="RLGenerationEngine", model=model or model_path, synchronous=synchronous,
                                           timeout_s=timeout_s, weight_timeout_s=weight_timeout_s, client_config=client_config)

    def generate(self, prompt: str | list[str] | None = None, sampling_params: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, image_data: Any = None,
                 return_logprob: bool | list[bool] | None = False, logprob_start_len: int | list[int] | None = None,
                 top_logprobs_num: int | list[int] | None = None, lora_path: list[str | None] | None = None,
                 custom_logit_processor: str | list[str] | None = None, gather_inputs: bool = False) -> dict[str, Any] | list[dict[str, Any]]:
        """Generate; SGLang-shaped results (``text``, ``output_ids``, ``meta_info``): a dict for one prompt, else a list."""
        return self.pool.generate(prompt=prompt, sampling_params=sampling_params, input_ids=input_ids, image_data=image_data,
                                  return_logprob=bool(return_logprob) if not isinstance(return_logprob, list) else return_logprob,
                                  logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num, lora_path=lora_path,
                                  custom_logit_processor=custom_logit_processor)

    def update_weights_from_tensor(self, name: str, tensor: Any, flush_cache: bool = False, load_format: str | None = None) -> None:
        """Stage one tensor (checked against the model's shapes when known); the next generate publishes and waits for it."""
        self.pool.update_weights_from_tensor(name, tensor, flush_cache=flush_cache, load_format=load_format)

    def sleep(self, release_weights: bool = False) -> None:
        """Release KV cache and CUDA graphs on every worker (weights too when asked)."""
        self.pool.sleep(release_weights=release_weights)

    def wake_up(self, release_weights: bool = False) -> None:
        """Resume what `sleep` released; `release_weights` must match."""
        self.pool.wake_up(release_weights=release_weights)

    def shutdown(self) -> None:
        """Close this client; the pool keeps serving."""
        self.pool.shutdown()
