"""Train the small GPT with ``Trainer(strategy="vescale_fsdp")`` — the README's main command.

Runs on CPU with 2 processes (gloo) in well under a minute::

    python examples/train_gpt.py
    python examples/train_gpt.py --devices 1 --max-steps 100 --precision bf16-mixed
    python examples/train_gpt.py --optimizer adamw8bit --save /tmp/gpt_ckpt   # sharded checkpoint
    python examples/train_gpt.py --resume /tmp/gpt_ckpt --max-steps 80

The only vescale-specific line is ``strategy="vescale_fsdp"`` (after ``import lightning_vescale``).
The same module and data module drive the LightningCLI example (``examples/cli.py``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Literal, Optional

import lightning.pytorch as pl
import torch

try:
    import lightning_vescale  # noqa: F401  (registers strategy="vescale_fsdp")
except ImportError:  # a checkout without `pip install -e .`: use the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import lightning_vescale  # noqa: F401

try:  # run from the repository root as `python examples/train_gpt.py` or imported as a module
    from examples.gpt import GPT, CharDataset, GPTConfig
except ImportError:  # pragma: no cover - the script's own directory is on sys.path
    from gpt import GPT, CharDataset, GPTConfig


class GPTModule(pl.LightningModule):
    """The embedded GPT as a LightningModule (plain PyTorch: nothing vescale-specific)."""

    def __init__(self, n_layer: int = 2, n_head: int = 2, n_embd: int = 32, block_size: int = 32,
                 lr: float = 3e-3, weight_decay: float = 0.1,
                 optimizer: Literal["adamw", "adamw8bit"] = "adamw") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                                   block_size=block_size))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor],
                      batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.model(x, y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        if hp.optimizer == "adamw8bit":
            from lightning_vescale.optim import AdamW8bit

            return AdamW8bit(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        return torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)


class CharDataModule(pl.LightningDataModule):
    """Random windows of the embedded text (no download)."""

    def __init__(self, block_size: int = 32, batch_size: int = 16, length: int = 4096,
                 seed: int = 0) -> None:
        super().__init__()
        self.block_size, self.batch_size = block_size, batch_size
        self.length, self.seed = length, seed

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        ds = CharDataset(self.block_size, self.length, self.seed)
        return torch.utils.data.DataLoader(ds, batch_size=self.batch_size, shuffle=True)


def main(argv: Optional[list[str]] = None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--precision", default="32-true",
                   choices=["32-true", "bf16-mixed", "bf16-true", "16-mixed"])
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adamw8bit"])
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=32)
    p.add_argument("--save", default=None, help="write a (sharded) checkpoint here at the end")
    p.add_argument("--resume", default=None, help="resume from this checkpoint")
    args = p.parse_args(argv)

    pl.seed_everything(0, verbose=False)
    model = GPTModule(n_layer=args.n_layer, n_embd=args.n_embd, optimizer=args.optimizer)
    trainer = pl.Trainer(
        strategy="vescale_fsdp", accelerator=args.accelerator, devices=args.devices,
        precision=args.precision, max_steps=args.max_steps, logger=False,
        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
    )
    start = time.perf_counter()
    trainer.fit(model, CharDataModule(), ckpt_path=args.resume)
    loss = float(trainer.callback_metrics["train_loss"])
    if args.save:
        trainer.save_checkpoint(args.save)
    if trainer.is_global_zero:
        print(f"vescale_fsdp: {trainer.world_size} ranks, {trainer.global_step} steps in "
              f"{time.perf_counter() - start:.1f}s, final loss {loss:.4f}")
    return loss


if __name__ == "__main__":
    main()
