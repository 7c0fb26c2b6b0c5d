"""A Lightning Trainer on several nodes (torchrun or SLURM): full sharding, HSDP or DDP.

Start the same command on every node; ``--num-nodes``/``--devices`` must match the launcher's
``--nnodes``/``--nproc-per-node`` (under SLURM: ``--nodes``/``--ntasks-per-node``)::

    # 2 nodes x 2 processes, HSDP: shard inside each node, replicate across the 2 nodes
    torchrun --nnodes 2 --nproc-per-node 2 --node-rank $NODE_RANK --master-addr $MASTER_ADDR \\
        --master-port 29500 examples/multinode_trainer.py --num-nodes 2 --devices 2 \\
        --device-mesh 2 2
    # the same job as full sharding over all 4 ranks: leave --device-mesh out
    # one node, 4 processes (the same global batch per step, so the same losses):
    torchrun --nproc-per-node 4 examples/multinode_trainer.py --devices 4 --device-mesh 2 2

Every rank trains on its own slice of each global batch (Lightning's distributed sampler spans
the whole world, whatever the mesh), so the loss of rank ``r`` at step ``s`` depends only on the
global rank, not on how ranks are spread over nodes or meshes. Rank 0 prints the losses;
``--out DIR`` also writes each rank's losses to ``DIR/<tag>_rank<r>.pt`` (the tests compare
them across layouts).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist

try:
    import lightning_vescale  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`: use the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_vescale import VeScaleFSDPStrategy

try:
    from examples.gpt import GPT, GPTConfig, make_batches
except ImportError:  # pragma: no cover - the script's own directory is on sys.path
    from gpt import GPT, GPTConfig, make_batches


class LitGPT(pl.LightningModule):
    """The examples' GPT; records this rank's loss at every step."""

    def __init__(self, config: GPTConfig, lr: float = 1e-2) -> None:
        super().__init__()
        self.model = GPT(config)
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.model(x, y)
        self.losses.append(loss.item())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)


def dataloader(world_size: int, steps: int, batch_size: int,
               block_size: int) -> torch.utils.data.DataLoader:
    """``steps`` global batches of ``world_size * batch_size`` samples, in a fixed order."""
    batches = make_batches(world_size * steps, batch_size, block_size, seed=0)
    ds = torch.utils.data.TensorDataset(torch.cat([b[0] for b in batches]),
                                        torch.cat([b[1] for b in batches]))
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=False)


def main(argv: Optional[list[str]] = None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--devices", type=int, default=1, help="processes per node")
    p.add_argument("--strategy", choices=["vescale_fsdp", "ddp"], default="vescale_fsdp")
    p.add_argument("--device-mesh", type=int, nargs=2, metavar=("REPLICAS", "SHARD_SIZE"),
                   help="HSDP mesh (vescale_fsdp only); default: full sharding")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4, help="per rank")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=32)
    p.add_argument("--out", type=Path, help="write each rank's losses here")
    p.add_argument("--tag", default="run")
    args = p.parse_args(argv)
    if args.device_mesh and args.strategy != "vescale_fsdp":
        p.error("--device-mesh needs --strategy vescale_fsdp")

    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    strategy: Any = args.strategy
    if args.strategy == "vescale_fsdp":
        strategy = VeScaleFSDPStrategy(
            device_mesh=tuple(args.device_mesh) if args.device_mesh else None)
    pl.seed_everything(0, verbose=False)  # the same initial weights on every rank
    config = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=2, block_size=16)
    model = LitGPT(config)
    trainer = pl.Trainer(accelerator="auto", num_nodes=args.num_nodes, devices=args.devices,
                         strategy=strategy, max_steps=args.steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    world = args.num_nodes * args.devices
    trainer.fit(model, dataloader(world, args.steps, args.batch_size, config.block_size))
    rank = trainer.global_rank
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(model.losses, args.out / f"{args.tag}_rank{rank}.pt")
    if rank == 0:
        mesh = getattr(trainer.strategy, "device_mesh", None) if args.strategy != "ddp" else None
        layout = f"mesh {tuple(mesh.shape)}" if mesh is not None else "ddp"
        print(f"{args.strategy} {args.num_nodes}x{args.devices} ({layout}): rank-0 losses "
              + " ".join(f"{v:.6f}" for v in model.losses), flush=True)
    # every rank leaves together: no rank exits while a peer still talks to it
    trainer.strategy.barrier()
    if dist.is_initialized():
        dist.destroy_process_group()
    return model.losses


if __name__ == "__main__":
    main()
