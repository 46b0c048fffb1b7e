"""The names a documented Python block may use without defining them, as a reader's own program would have them.

Run before every ``<!-- doc-test: run -->`` Python block (tests/integration/docs/test_doc_blocks.py): the
data a trainer brings (``prompts``, ``data``), its training step and model (``train_step``, ``model``: a
small torch module, published to the pool as it is: in prelude_torch.py, added only for a block that names
``model``, since importing torch takes seconds), its step count and a stand-in logger (``wandb``).
"""

import numpy as np

_rng = np.random.default_rng(0)
prompts = [_rng.integers(4, 300, 6).tolist() for _ in range(64)]
"""64 prompts as token-id lists (the README's ``client.submit(prompts, ...)``)."""
data = [(_rng.integers(4, 300, 6).tolist(), str(i % 10)) for i in range(96)]
"""(token ids, answer) pairs: enough for three steps of 32 groups (docs/trainer_client.md)."""
steps = 3


def train_step(groups):
    """The trainer's update: here it checks what it was given (whole groups of 8, with versions per token)."""
    assert groups and all(len(g.trajectories) == 8 for g in groups)
    assert all(len(t.token_versions) == len(t.output_ids) for g in groups for t in g.trajectories)
    return 0.0


class wandb:
    logged: list = []

    @staticmethod
    def log(stats):
        wandb.logged.append(dict(stats))
