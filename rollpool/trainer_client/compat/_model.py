"""What the seed adapters check about the model a constructor names, and the pool they open.

A seed's constructor names its model (LightRFT's ``model=``/``model_path=``, NeMo-RL's
``config["model_name"]``, AReaL's ``server_args_dict["model_path"]``). On a pool the workers
already serve a model, so the name cannot choose it: it is checked instead, never ignored.

* A local HF directory gives a fingerprint, computed as the workers compute theirs
  (sha256 of ``config.json``, ``tokenizer.json`` and ``tokenizer_config.json``, 16 hex
  digits), compared with every live worker's (`status()`): a mismatch is refused with
  `ConfigError`. With no worker connected yet, the check runs again before the first
  generation.
* Its safetensors headers give every parameter's shape (no tensor is read), so a
  weight update of an unknown name or another shape is refused before it is published.
* A name that is not a local directory (a hub id) cannot be checked: a warning says so.
"""

from __future__ import annotations

import json
import logging
import pathlib
import struct
from typing import Any

from rollpool.protocol import ConfigError
from rollpool.protocol.config import load_config
from rollpool.protocol.fingerprint import model_fingerprint  # the one definition (re-exported here)
from rollpool.trainer_client.client import TrainerClientConfig
from rollpool.trainer_client.pool import RolloutPool

__all__ = ["model_fingerprint", "read_param_shapes", "open_pool", "DEFAULT_BROKER_TIMEOUT_S"]

log = logging.getLogger(__name__)

DEFAULT_BROKER_TIMEOUT_S = 600.0
_MAX_HEADER_BYTES = 100 * 1024 * 1024
def read_param_shapes(model_dir: str | pathlib.Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in the directory's safetensors files (headers only); {} when there are none."""
    path = pathlib.Path(model_dir)
    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(path.glob("*.safetensors")):
        with f.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            if size > _MAX_HEADER_BYTES:
                raise ConfigError(f"{f}: safetensors header of {size} bytes is larger than {_MAX_HEADER_BYTES}")
            header = json.loads(fh.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                shapes[name] = tuple(int(d) for d in entry["shape"])
    return shapes


class _CheckedPool(RolloutPool):
    """A `RolloutPool` that refuses workers serving another model than the one the constructor named."""

    def __init__(self, broker: str, *, model: str | None, who: str, **kwargs: Any) -> None:
        fingerprint = ""
        shapes: dict[str, tuple[int, ...]] | None = None
        if model:
            path = pathlib.Path(model)
            if path.is_dir():
                fingerprint = model_fingerprint(path)
                shapes = read_param_shapes(path) or None
            else:
                log.warning("%s: model %r is not a local directory, so the pool cannot check that its workers serve it", who, model)
        super().__init__(broker, param_shapes=shapes, **kwargs)
        self._who = who
        self._model = model
        self._expected_fingerprint = fingerprint
        self._model_checked = not fingerprint
        try:
            self._check_model()
        except BaseException:
            self.shutdown()
            raise

    def _check_model(self) -> None:
        if self._model_checked:
            return
        workers: dict[str, Any] = self.status()["workers"]
        seen = {w: s.get("fingerprint") for w, s in workers.items()}
        if not seen:
            return  # nobody to compare with yet: checked again before the first generation
        if all(fp is None for fp in seen.values()):
            log.warning("%s: the broker does not report worker fingerprints; model %r is not checked", self._who, self._model)
        else:
            wrong = {w: fp for w, fp in seen.items() if fp and fp != self._expected_fingerprint}
            if wrong:
                raise ConfigError(f"{self._who}: model {self._model!r} (fingerprint {self._expected_fingerprint}) is not the model "
                                  f"the pool's workers serve: {wrong}")
        self._model_checked = True

    def _submit(self, *args: Any, **kwargs: Any) -> Any:
        self._check_model()
        return super()._submit(*args, **kwargs)


def open_pool(broker: str | None, *, who: str, model: str | None = None, synchronous: bool = True,
              timeout_s: float | None = DEFAULT_BROKER_TIMEOUT_S, weight_timeout_s: float | None = None,
              client_config: TrainerClientConfig | None = None) -> RolloutPool:
    """The pool a seed adapter runs on; `broker` is required (``tcp://host:port``).

    The client's other settings (timeouts, the weight publisher's endpoints, CURVE keys) come from
    `client_config`, else from ``ROLLPOOL_<FIELD>`` variables and ``$ROLLPOOL_CONFIG``'s
    ``[trainer_client]`` table, as every rollpool process reads its config.
    """
    if not broker:
        raise ConfigError(f"{who} on rollpool needs broker='tcp://host:port' (the broker's client endpoint)")
    # the seeds' constructors have no room for client settings: they come from ROLLPOOL_* variables or the
    # [trainer_client] table of $ROLLPOOL_CONFIG, unless a `client_config` is given
    config = client_config or load_config(TrainerClientConfig, section="trainer_client", broker=broker)
    return _CheckedPool(broker, model=model, who=who, config=config, synchronous=synchronous, timeout_s=timeout_s,
                        weight_timeout_s=weight_timeout_s)
