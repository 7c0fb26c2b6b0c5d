"""``optimizer_block_size`` is stated once, on the strategy: ``AdamW8bit()`` inherits it.

At 3 ranks with ``optimizer_block_size=128`` some shard bounds fall on odd multiples of 128, so an
AdamW8bit that kept its own default of 256 would fail its block-alignment check at the first step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_vescale import VeScaleFabricStrategy
from lightning_vescale.optim import AdamW8bit


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64))  # 6144-element weights


def _batch() -> torch.Tensor:
    return torch.randn(8, 64, generator=torch.Generator().manual_seed(3))


def _fabric_run(block_size):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(),
                    strategy=VeScaleFabricStrategy(optimizer_block_size=128))
    fabric.launch()
    model = fabric.setup_module(_model())
    opt = fabric.setup_optimizers(AdamW8bit(model.parameters(), lr=1e-2, block_size=block_size))
    x = _batch()
    for _ in range(2):
        fabric.backward(model(x).square().mean())
        opt.step()
        opt.zero_grad()
    full = {n: p.full_tensor() for n, p in model.module.named_parameters()}
    return [g["block_size"] for g in opt.param_groups], full


def _single_process(block_size):
    model = _model()
    opt = AdamW8bit(model.parameters(), lr=1e-2, block_size=block_size)
    x = _batch()
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return dict(model.named_parameters())


def test_adamw8bit_inherits_the_strategy_block_size(worlds):
    results = worlds(3).run(_fabric_run, None)
    reference = _single_process(128)
    for block_sizes, full in results:
        assert block_sizes == [128]
        for name, value in full.items():
            # the same data on every rank: only the gradient average's rounding differs
            torch.testing.assert_close(value, reference[name].detach(), rtol=1e-4, atol=1e-6)


def test_a_stated_block_size_is_kept(worlds):
    # 64 divides the strategy's 128, so shards aligned to 128 are aligned to 64 too
    results = worlds(3).run(_fabric_run, 64)
    reference = _single_process(64)
    for block_sizes, full in results:
        assert block_sizes == [64]
        for name, value in full.items():
            torch.testing.assert_close(value, reference[name].detach(), rtol=1e-4, atol=1e-6)
