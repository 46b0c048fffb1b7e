"""``model`` for a documented block that publishes one (see prelude.py)."""

import torch

model = torch.nn.Linear(8, 8)
