"""Drop-in adapters: three seed generation-engine APIs, served by a rollpool pool.

* `rollpool.trainer_client.compat.lightrft.RLGenerationEngine` — LightRFT's
  ``lightrft.strategy.sglang_utils.sglang_engine.RLGenerationEngine``;
* `rollpool.trainer_client.compat.nemo_rl.SGLangGeneration` — NeMo-RL's
  (dockyard_rl) ``models.generation.sglang.sglang_generation.SGLangGeneration``;
* `rollpool.trainer_client.compat.areal.SGLangGenerationEngine` — AReaL's legacy
  ``realhf.impl.model.backend.sglang.SGLangGenerationEngine``.

Each takes the seed's constructor arguments plus the keyword ``broker="tcp://host:port"``
and keeps the seed's method signatures and return shapes; none imports its framework
(their data types are read by duck typing: a BatchedDataDict is a mapping, a Ray object
ref becomes a plain value). All three sit on `RolloutPool`. They are synchronous as the
seeds are: after a weight update through an adapter, its next generation is served only
at the new version (``synchronous=False`` opts out). docs/porting.md has the call tables.
"""

from __future__ import annotations

__all__: list[str] = []
