"""Lightning behaviours of FSDP strategies (issue 15) on ours: an optimizer built before the
model was sharded is rejected at set-up (as Lightning's ``FSDPStrategy`` does), ``16-true``
precision in the Trainer and Fabric, Fabric ``save(..., filter=...)`` of full checkpoints."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from examples.gpt import GPT
from tests.lightning._lit import CONFIG, TinyGPT, dataloader, trainer

VESCALE = "vescale_fsdp_fork"


class _EarlyOptimizer(TinyGPT):
    """Creates its optimizer in ``__init__``, over the parameters before sharding."""

    def __init__(self) -> None:
        super().__init__()
        self.opt = torch.optim.AdamW(self.parameters(), lr=1e-2)

    def configure_optimizers(self) -> Any:
        return self.opt


def test_trainer_rejects_an_optimizer_built_before_sharding():
    t = trainer(VESCALE, max_steps=1)
    with pytest.raises(Exception, match="configure_optimizers") as info:
        t.fit(_EarlyOptimizer(), dataloader())
    assert "does not seem to reference the sharded parameters" in str(info.value)


def _fabric(**kwargs):
    from lightning.fabric import Fabric

    from lightning_vescale import VeScaleFabricStrategy

    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(),
                    strategy=VeScaleFabricStrategy(**kwargs), **kwargs.pop("fabric", {}))
    fabric.launch()
    return fabric


def _fabric_early_optimizer_body():
    fabric = _fabric()
    torch.manual_seed(0)
    model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model = fabric.setup_module(model)
    try:
        fabric.setup_optimizers(opt)
    except ValueError as e:
        return str(e)
    return None


def test_fabric_rejects_an_optimizer_built_before_setup_module(worlds):
    for msg in worlds(2).run(_fabric_early_optimizer_body):
        assert msg is not None and "fabric.setup_module(model)" in msg, msg
