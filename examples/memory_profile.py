"""Profile a real training run with ``MemoryProfiler``: the docs' memory plot and table.

Trains the embedded GPT (``examples/gpt.py``) for a few steps with any strategy, profiling every
step and saving one checkpoint, and writes per rank ``memory_timeline_rank{r}.png`` plus (rank
zero) ``memory_table_{strategy}.txt`` and the CSV metrics under ``--out`` (default:
``out/memory_profile/`` in the current directory)::

    python examples/memory_profile.py                                  # one CPU process
    python examples/memory_profile.py --strategy ddp --devices 2       # Lightning DDP
    python examples/memory_profile.py --strategy vescale_fsdp --devices 2
    python examples/memory_profile.py --accelerator cuda --snapshot   # + allocator snapshot

The figure and table of docs/guides/memory-profiling.md were made with ``--out docs/memory`` (see
``benchmarks/RESULTS_memory.md``); the default never writes into the repository.

Needs ``matplotlib`` for the plot (``pip install 'lightning-vescale[plot]'``); without it, pass
``--no-plot``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from examples.gpt import GPT, CharDataset, GPTConfig  # noqa: E402
from lightning_vescale.callbacks.memory import MemoryProfiler  # noqa: E402


class LitGPT(L.LightningModule):
    def __init__(self, config: GPTConfig, lr: float = 3e-4) -> None:
        super().__init__()
        self.model = GPT(config)
        self.lr = lr

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        x, y = batch
        loss = self.model(x, y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--strategy", default="auto")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--out", default=os.path.join("out", "memory_profile"),
                   help="output directory (default: ./out/memory_profile; /out/ is git-ignored)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--snapshot", action="store_true", help="CUDA: allocator snapshot at step 1")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.strategy.startswith("vescale_fsdp"):
        import lightning_vescale  # noqa: F401  (registers the strategy name)
    L.seed_everything(0)
    config = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=8,
                       block_size=args.block_size)
    tag = f"{args.strategy}_x{args.devices}"
    work = os.path.join(args.out, f"_run_{tag}")
    profiler = MemoryProfiler(
        every_n_steps=1,
        plot_dir=None if args.no_plot else os.path.join(args.out, tag),
        snapshot_dir=os.path.join(args.out, tag, "snapshots") if args.snapshot else None,
        snapshot_at_step=1 if args.snapshot else None,
    )
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=args.devices, strategy=args.strategy,
        max_steps=args.steps, log_every_n_steps=1,
        logger=CSVLogger(os.path.join(args.out, tag), name="csv", version=0),
        callbacks=[profiler, ModelCheckpoint(dirpath=os.path.join(work, "ckpt"),
                                             every_n_train_steps=2)],
        enable_progress_bar=False, enable_model_summary=False,
    )
    data = CharDataset(block_size=args.block_size, length=args.steps * args.batch_size * 2)
    trainer.fit(LitGPT(config), torch.utils.data.DataLoader(data, batch_size=args.batch_size))
    if trainer.is_global_zero:
        n_params = sum(p.numel() for p in GPT(config).parameters())
        header = (f"GPT {n_params / 1e6:.1f}M parameters, AdamW, strategy={args.strategy}, "
                  f"devices={args.devices}, accelerator={args.accelerator}, "
                  f"batch {args.batch_size}x{args.block_size}, {args.steps} steps, "
                  f"torch {torch.__version__}")
        path = os.path.join(args.out, f"memory_table_{tag}.txt")
        with open(path, "w") as f:
            f.write(header + "\n" + (profiler.table or "") + "\n")
        print(header)
        print(f"wrote {path}")
        shutil.rmtree(work, ignore_errors=True)
    for written in profiler.written:
        print(f"rank {trainer.global_rank}: wrote {written}")


if __name__ == "__main__":
    main()
