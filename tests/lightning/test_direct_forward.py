"""The LightningModule is the root sharding group, so it can be called directly anywhere.

Lightning runs forwards outside ``*_step``: ``ModelSummary`` on ``example_input_array`` at fit
start, and user code (sampling in an epoch-end hook). A ``training_step`` that calls
``self(x)`` re-enters the root's forward under Lightning's step redirection. A fitted module can
also be handed to a second Trainer in the same process (default launcher / torchrun). Each
of these must work, and train exactly like DDP.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from tests.lightning._lit import CONFIG, TinyGPT, dataloader, trainer

ROOT = Path(__file__).resolve().parents[2]


class SelfCallingGPT(TinyGPT):
    """``training_step`` calls ``self(x, y)``; a forward runs at fit start and at epoch end."""

    def __init__(self, out_dir: str, tag: str) -> None:
        super().__init__(out_dir=out_dir, tag=tag)
        self.example_input_array = (torch.zeros(2, CONFIG.block_size, dtype=torch.long),
                                    torch.zeros(2, CONFIG.block_size, dtype=torch.long))
        self.epoch_end: list[float] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model(x, y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self(x, y)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self(*batch)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def on_train_epoch_end(self) -> None:
        x = torch.arange(2 * CONFIG.block_size).remainder(CONFIG.vocab_size).view(2, -1)
        with torch.no_grad():  # e.g. sampling for a progress report: a direct call
            self.epoch_end.append(self(x, x).item())

    def on_train_end(self) -> None:
        super().on_train_end()
        torch.save(self.epoch_end, Path(self.out_dir) / f"{self.tag}_end_rank{self.global_rank}.pt")


def _fit(strategy: str, tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    t = trainer(strategy, max_epochs=2, enable_model_summary=True)
    t.fit(SelfCallingGPT(str(tmp_path), strategy), dataloader())


def test_direct_and_reentrant_forwards_match_ddp(tmp_path):
    _fit("vescale_fsdp_fork", tmp_path)
    _fit("ddp_fork", tmp_path)
    for r in range(2):
        for suffix in ("", "_end"):
            got = torch.load(tmp_path / f"vescale_fsdp_fork{suffix}_rank{r}.pt")
            want = torch.load(tmp_path / f"ddp_fork{suffix}_rank{r}.pt")
            assert len(got) == len(want) > 0
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)


@pytest.mark.slow
def test_a_second_trainer_reuses_the_sharded_module(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "tests/lightning/scripts/second_trainer.py", str(tmp_path)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "OK" in out.stdout, out.stdout[-2000:]
