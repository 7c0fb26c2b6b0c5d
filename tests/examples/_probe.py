"""A callback the example tests attach to Trainer runs: each rank writes what it saw to a file.

The fork launcher's workers cannot hand objects back to the test, so every rank saves
``<tag>_rank<r>.pt`` = ``{"groups": [...], "losses": [...], "metrics": {...}}`` at the end of fit:
the optimizer's param groups as plain data (names, routing, hyper-parameters), the training loss
of every step as the LightningModule computed it on that rank, and the logged metrics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback


def describe_groups(optimizer: Any) -> list[dict[str, Any]]:
    """An optimizer's param groups as comparable plain data (parameters by their shape)."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    out = []
    for g in optimizer.param_groups:
        d = {k: v for k, v in g.items() if k != "params"}
        d["shapes"] = [tuple(p.shape) for p in g["params"]]
        out.append(d)
    return out


class Probe(Callback):
    def __init__(self, out_dir: str, tag: str) -> None:
        self.out_dir, self.tag = Path(out_dir), tag
        self.losses: list[float] = []
        self.groups: list[list[dict[str, Any]]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.groups = [describe_groups(o) for o in trainer.optimizers]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        torch.save({"groups": self.groups, "losses": self.losses, "metrics": metrics},
                   self.out_dir / f"{self.tag}_rank{trainer.global_rank}.pt")


def load(out_dir: Path, tag: str, world_size: int = 2) -> list[dict[str, Any]]:
    return [torch.load(Path(out_dir) / f"{tag}_rank{r}.pt") for r in range(world_size)]
