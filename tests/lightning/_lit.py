"""Shared LightningModules and helpers for the Trainer tests (CPU, 2 processes, gloo).

Trainer runs use the fork launcher (``strategy="vescale_fsdp_fork"`` / ``"ddp_fork"``): the
workers are forks of the pytest process, so classes defined here need no pickling and a run
costs ~1-3 s. Each rank records its own per-step losses to ``out_dir`` (the main process only
gets rank 0's callback metrics back), and tests compare those files.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

import lightning_vescale  # noqa: F401  (registers strategy="vescale_fsdp" and its variants)
from examples.gpt import GPT, GPTConfig, make_batches

#: reduce-scatter launches per process (forked workers inherit the patch, count their own)
REDUCE_SCATTERS = [0]


def count_reduce_scatters() -> None:
    """Count ``ParamGroup.reduce_scatter`` calls in this process and its forks (idempotent)."""
    from lightning_vescale.fsdp import ParamGroup

    if getattr(ParamGroup.reduce_scatter, "_counted", False):
        return
    original = ParamGroup.reduce_scatter

    def counted(self, *args, **kwargs):
        REDUCE_SCATTERS[0] += 1
        return original(self, *args, **kwargs)

    counted._counted = True
    ParamGroup.reduce_scatter = counted

CONFIG = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=True)
STEPS_PER_EPOCH = 3  # per rank, with 2 ranks and batch size 4
BATCH = 4


def dataloader(world_size: int = 2, steps_per_epoch: int = STEPS_PER_EPOCH,
               batch_size: int = BATCH) -> torch.utils.data.DataLoader:
    n = world_size * steps_per_epoch
    batches = make_batches(n, batch_size, CONFIG.block_size, seed=0)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    ds = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=False)


class TinyGPT(pl.LightningModule):
    """The examples' GPT as a LightningModule, with knobs the tests need.

    Args:
        out_dir: where each rank writes ``<tag>_rank<r>.pt`` = its losses (one per optimizer
            step / micro-batch) at the end of fit.
        tag: file-name prefix.
        optimizers: 1 (automatic optimization) or 2 (manual optimization, blocks vs. rest).
        shard_in_configure_model: ``"blocks"``: build the model in ``configure_model`` and call
            ``fully_shard`` on the blocks there (the strategy must respect it and add the root);
            ``"blocks+root"``: also ``fully_shard(self)`` (the LightningModule is the root).
    """

    def __init__(self, out_dir: Optional[str] = None, tag: str = "run", lr: float = 1e-2,
                 optimizers: int = 1, shard_in_configure_model: str = "") -> None:
        super().__init__()
        self.out_dir, self.tag, self.lr = out_dir, tag, lr
        self.n_optimizers = optimizers
        self.shard_in_configure_model = shard_in_configure_model
        self.automatic_optimization = optimizers == 1
        self.losses: list[float] = []
        self.model: Optional[GPT] = None if shard_in_configure_model else GPT(CONFIG)
        # (with "blocks+root" the step calls self.model(...), never self(...): the strategy's
        # redirection must still run the LightningModule's root hooks)

    def configure_model(self) -> None:
        if not self.shard_in_configure_model or self.model is not None:
            return
        from lightning_vescale.fsdp import fully_shard

        self.model = GPT(CONFIG)
        for block in self.model.blocks:
            fully_shard(block, mesh=self.device_mesh)
        if self.shard_in_configure_model == "blocks+root":
            fully_shard(self, mesh=self.device_mesh)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = self.model(x, y)
        self.losses.append(loss.item())
        self.log("train_loss", loss, sync_dist=True)
        if self.automatic_optimization:
            return loss
        opts = self.optimizers()
        for o in opts:
            o.zero_grad()
        self.manual_backward(loss)
        for o in opts:
            o.step()
        return None

    def configure_optimizers(self) -> Any:
        if self.n_optimizers == 1:
            return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
        blocks = [p for n, p in self.named_parameters() if ".blocks." in n]
        rest = [p for n, p in self.named_parameters() if ".blocks." not in n]
        return [torch.optim.AdamW(blocks, lr=self.lr), torch.optim.AdamW(rest, lr=self.lr)]

    def on_train_end(self) -> None:
        if self.out_dir is not None:
            torch.save(self.losses, Path(self.out_dir) / f"{self.tag}_rank{self.global_rank}.pt")
            torch.save(REDUCE_SCATTERS[0],
                       Path(self.out_dir) / f"{self.tag}_rs_rank{self.global_rank}.pt")


class SaveAtEnd(Callback):
    """Save checkpoints at the end of fit, optionally in both formats (same training state)."""

    def __init__(self, paths: dict[str, str]) -> None:
        self.paths = paths  # {"sharded": path, "full": path}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        original = getattr(strategy, "_state_dict_type", None)
        for kind, path in self.paths.items():
            if original is not None:
                strategy._state_dict_type = kind
            trainer.save_checkpoint(path)
        if original is not None:
            strategy._state_dict_type = original


def trainer(strategy: Any, *, devices: int = 2, **kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = dict(accelerator="cpu", devices=devices, logger=False,
                                    enable_checkpointing=False, enable_progress_bar=False,
                                    enable_model_summary=False, num_sanity_val_steps=0)
    defaults.update(kwargs)
    return pl.Trainer(strategy=strategy, **defaults)


def losses(out_dir: Path, tag: str, world_size: int = 2) -> list[list[float]]:
    return [torch.load(Path(out_dir) / f"{tag}_rank{r}.pt") for r in range(world_size)]


def assert_close_losses(a: list[list[float]], b: list[list[float]], rtol: float = 1e-5) -> None:
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert len(ra) == len(rb), (ra, rb)
        for la, lb in zip(ra, rb):
            assert math.isfinite(la) and abs(la - lb) <= rtol * abs(lb), (ra, rb)
