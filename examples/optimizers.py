"""docs/guides/optimizers.md's snippets: AdamW8bit and Muon in ``configure_optimizers``, on shards.

    python examples/optimizers.py adamw8bit       # or: muon; 2 CPU processes (or every GPU)

Both optimizers step each rank's RaggedShard shard. AdamW8bit's quantization blocks line up with
the shard bounds (the strategy's ``optimizer_block_size``, 256), so it needs no communication;
Muon gathers each whole matrix on one owner rank for Newton–Schulz (same result as a single
process). To pick them from a LightningCLI config instead, see ``examples/configs/adamw8bit.yaml``
and ``muon.yaml``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples package

import lightning_vescale  # noqa: F401  (registers strategy="vescale_fsdp")
from examples.train_gpt import CharDataModule, GPTModule

from lightning_vescale.optim import AdamW8bit, Muon


class GPTAdamW8bit(GPTModule):
    def configure_optimizers(self):
        # 8-bit states, one fp32 absmax per 256-element block: ~2.03 bytes of state per parameter
        # instead of 8. Blocks never straddle ranks, so each rank quantizes its own shard locally.
        return AdamW8bit(self.parameters(), lr=1e-3, weight_decay=0.1)


class GPTMuon(GPTModule):
    def configure_optimizers(self):
        # Muon on hidden matrices, AdamW on embeddings, head and 1-D parameters (routed by name).
        # Each whole matrix is orthogonalised on one load-balanced owner rank: same result as
        # single-process torch.optim.Muon.
        return Muon(self.named_parameters(), lr=0.02, adamw_lr=1e-3)


def main(optimizer: str, max_steps: int = 10) -> None:
    # One Trainer per process: gloo's teardown at exit can abort a process that ran two.
    module = {"adamw8bit": GPTAdamW8bit, "muon": GPTMuon}[optimizer]
    devices = "auto" if torch.cuda.is_available() else 2
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(strategy="vescale_fsdp", devices=devices, max_steps=max_steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    model = module(n_embd=64)
    trainer.fit(model, CharDataModule())
    if trainer.is_global_zero:
        print(f"{module.__name__}: {trainer.world_size} ranks, {trainer.global_step} steps, "
              f"loss {float(trainer.callback_metrics['train_loss']):.4f}")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Train the example GPT with AdamW8bit or Muon.")
    parser.add_argument("optimizer", choices=["adamw8bit", "muon"])
    parser.add_argument("--max-steps", type=int, default=10)
    args = parser.parse_args()
    main(args.optimizer, args.max_steps)
