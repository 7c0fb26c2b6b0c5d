"""Quantized communication (``CommPolicy``): int8 all-gather, bf16 gradients on the wire.

    torchrun --nproc-per-node 2 examples/quantized_comm.py                  # CPU (gloo)
    torchrun --nproc-per-node 8 examples/quantized_comm.py --all-gather fp8 # 8 GPUs (nccl)
    python examples/quantized_comm.py                                       # 1 process

``fully_shard`` each block and the root with the same ``CommPolicy``: each rank quantizes its
shard of every matrix in blocks of 256 elements (absmax scale per block), all-gathers the codes
and scales and dequantizes into the parameters forward uses; the master shards, the optimizer
and checkpoints stay full precision. Gradients travel in bf16 and are summed in fp32. Rank 0
prints the sharding summary (with the bytes the policy saves) and the loss. The process group
and the training loop are ``fully_shard_torchrun.py``'s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

try:
    import lightning_vescale  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`: use the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_vescale import CommPolicy, fully_shard
from lightning_vescale.sharding_summary import sharding_summary

try:
    from examples.fully_shard_torchrun import init_distributed, train
    from examples.gpt import GPT, GPTConfig
except ImportError:  # pragma: no cover - the script's own directory is on sys.path
    from fully_shard_torchrun import init_distributed, train
    from gpt import GPT, GPTConfig


def main(argv: list[str] | None = None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8, help="global batch size")
    p.add_argument("--all-gather", default="int8", choices=["int8", "fp8"])
    args = p.parse_args(argv)
    device = init_distributed(master_port=29518)  # torchrun's group, or a world of one

    torch.manual_seed(0)  # the same initial weights on every rank (each keeps its shard)
    model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4)).to(device)

    policy = CommPolicy(all_gather=args.all_gather, reduce_scatter_dtype="bf16")
    for block in model.blocks:                   # every group with the same policy
        fully_shard(block, comm_policy=policy)
    fully_shard(model, comm_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)  # steps the fp32 shards

    summary = str(sharding_summary(model))
    losses = train(model, optimizer, args.steps, args.batch_size, device)
    if dist.get_rank() == 0:
        print(summary)
        print(f"quantized_comm: {dist.get_world_size()} process(es), {args.all_gather} "
              f"all-gather, bf16 gradients, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    dist.barrier()  # tear down together (see fully_shard_torchrun.py)
    dist.destroy_process_group()
    return losses[-1]


if __name__ == "__main__":
    main()
