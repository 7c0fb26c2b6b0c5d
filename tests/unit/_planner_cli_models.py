"""A tiny LightningModule for the planner CLI test (kept apart so lightning imports only there)."""

from __future__ import annotations

import lightning as L
import torch.nn as nn


class TinyLit(L.LightningModule):
    """Builds its layers in ``configure_model``, as sharded Lightning models do."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.d = d
        self.layers = None

    def configure_model(self) -> None:
        if self.layers is None:
            self.layers = nn.ModuleList(nn.Linear(self.d, self.d) for _ in range(2))
