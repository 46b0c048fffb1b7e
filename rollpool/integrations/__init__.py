"""rollpool.integrations: adapters that plug rollpool into other training frameworks.

Each adapter lives in its own module and imports its framework lazily, on first use, with an
error that names the extra to install: `rollpool.integrations.trl` (TRL's asynchronous GRPO
trainer, extra ``rollpool[trl]``). The package imports `trainer_client` (and the pure `protocol`
types), never the services.
"""

from __future__ import annotations

__all__: list[str] = []
