"""Lightning Fabric with ``strategy="vescale_fsdp"``: your own loop, sharded.

    python examples/fabric_gpt.py                    # 2 CPU processes (or every GPU)
    python examples/fabric_gpt.py --steps 100 --save /tmp/fabric_ckpt

``fabric.setup`` shards the model (each block of every ``nn.ModuleList``, then the root) and
re-points the optimizer at the shards; ``fabric.save``/``fabric.load`` write and read the same
sharded checkpoints as the Trainer (``python -m lightning_vescale.consolidate`` turns them into
one file).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples package

from examples.gpt import GPT, CharDataset, GPTConfig


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--save", default=None, help="write a sharded checkpoint here at the end")
    args = p.parse_args(argv)

    import lightning as L
    import lightning_vescale  # noqa: F401  (registers strategy="vescale_fsdp" for Fabric too)

    fabric = L.Fabric(strategy="vescale_fsdp", devices=2)  # 2 GPUs, or 2 CPU processes
    fabric.launch()
    fabric.seed_everything(0)
    model = GPT(GPTConfig(n_embd=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)  # shards; the optimizer follows
    data = torch.utils.data.DataLoader(CharDataset(length=4096), batch_size=16, shuffle=True)
    data = fabric.setup_dataloaders(data)              # each rank its part of every batch

    for step, (x, y) in zip(range(args.steps), data):
        loss = model(x, y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step % 5 == 0 or step == args.steps - 1:
            fabric.print(f"step {step}: loss {fabric.all_reduce(loss.detach()).item():.4f}")

    if args.save:
        fabric.save(args.save, {"model": model, "optimizer": optimizer, "step": args.steps})


if __name__ == "__main__":
    main()
