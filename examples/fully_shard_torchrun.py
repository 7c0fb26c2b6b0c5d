"""``fully_shard`` without Lightning: a plain training loop under ``torchrun``.

    torchrun --nproc-per-node 2 examples/fully_shard_torchrun.py               # CPU (gloo)
    torchrun --nproc-per-node 8 examples/fully_shard_torchrun.py --steps 100   # 8 GPUs (nccl)
    torchrun --nproc-per-node 4 examples/fully_shard_torchrun.py --replicas 2  # HSDP 2 x 2
    python examples/fully_shard_torchrun.py                                    # 1 process

The calls are FSDP2's: ``fully_shard`` each block, then the root, with the *same*
``MixedPrecisionPolicy`` on every group (the root computes the embeddings and the head; with a
bf16 policy on the blocks only, bf16 activations would reach the root's fp32 weights). Parameters
become ``RaggedShard`` DTensors, so any ``torch.optim`` optimizer steps on each rank's shard.
Each rank trains on its own slice of every global batch; rank 0 prints the loss. With
``--replicas R`` the mesh is HSDP's 2-D ``(R, world // R)``: parameters are sharded inside each
group of ``world // R`` consecutive ranks (a node, when ranks are numbered node by node) and
replicated across the ``R`` groups, whose gradient shards are all-reduced.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

try:
    import lightning_vescale  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`: use the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_vescale import MixedPrecisionPolicy, fully_shard
from lightning_vescale.mesh import init_mesh

try:
    from examples.gpt import GPT, GPTConfig, make_batches
except ImportError:  # pragma: no cover - the script's own directory is on sys.path
    from gpt import GPT, GPTConfig, make_batches


def init_distributed(master_port: int = 29517) -> torch.device:
    """Join torchrun's process group (nccl on GPUs, gloo on CPU); return this rank's device."""
    # torchrun sets RANK/WORLD_SIZE/MASTER_ADDR; a plain `python` run is a world of one.
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(master_port))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, batch_size: int,
          device: torch.device) -> list[float]:
    """Each rank trains on its slice of every global batch; returns the global mean losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if batch_size % world:
        raise SystemExit(f"--batch-size {batch_size} must be a multiple of the "
                         f"{world} processes")
    per_rank = batch_size // world
    losses = []
    for x, y in make_batches(steps, batch_size, model.config.block_size, seed=0):
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        loss = model(x.to(device), y.to(device))
        loss.backward()                          # gradients are reduce-scattered to the shards
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach().float()
        dist.all_reduce(loss)                    # the global batch's mean loss, for printing
        losses.append(loss.item() / world)
    return losses


def main(argv: list[str] | None = None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8, help="global batch size")
    p.add_argument("--replicas", type=int, default=1,
                   help="HSDP: replicate over this many groups of world/replicas ranks")
    args = p.parse_args(argv)
    device = init_distributed()

    torch.manual_seed(0)  # the same initial weights on every rank (each keeps its shard)
    model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4)).to(device)

    # 1-D mesh (full sharding), or with --replicas R HSDP's 2-D (R, world // R) mesh
    mesh = init_mesh(device.type, replicas=args.replicas)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:                   # as with FSDP2: each block, then the root,
        fully_shard(block, mesh=mesh, mp_policy=mp)  # with the same mesh and policy everywhere
    fully_shard(model, mesh=mesh, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)  # RaggedShard DTensors

    losses = train(model, optimizer, args.steps, args.batch_size, device)
    if dist.get_rank() == 0:
        layout = f"HSDP {tuple(mesh.shape)}" if mesh.ndim == 2 else "full sharding"
        print(f"fully_shard: {dist.get_world_size()} process(es), {layout}, {args.steps} steps, "
              f"bf16 compute, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    # Tear down together, so no rank exits while a peer still talks to it (on gloo this also makes
    # a known abort at exit rarer: docs/troubleshooting.md, "terminate called ...").
    dist.barrier()
    dist.destroy_process_group()
    return losses[-1]


if __name__ == "__main__":
    main()
