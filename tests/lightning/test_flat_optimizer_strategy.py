"""The strategies wrap torch's Adam/AdamW/SGD in ``FlatParamOptimizer`` (``flat_optimizer=True``,
the default): training is bitwise the per-tensor step's, LR schedulers still act on it, other
optimizers are left alone, and ``flat_optimizer=False`` turns it off."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_vescale import VeScaleFabricStrategy, VeScaleFSDPStrategy
from lightning_vescale.optim import FlatParamOptimizer
from tests.lightning._lit import TinyGPT, dataloader, losses, trainer


class _Scheduled(TinyGPT):
    """AdamW with decay / no-decay groups and a StepLR that halves lr every step."""

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=self.lr)
        return {"optimizer": opt,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
                                 "interval": "step"}}


class _Record(Callback):
    def __init__(self, out: Path, tag: str) -> None:
        self.out, self.tag = out, tag

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        opt = trainer.strategy.optimizers[0]
        rows = {"type": type(opt).__name__,
                "lr": [g["lr"] for g in opt.param_groups],
                "params": [p.to_local().detach().clone() for p in pl_module.parameters()]}
        torch.save(rows, self.out / f"{self.tag}_rec_rank{trainer.global_rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("flat_opt")
    for tag, flat in (("flat", True), ("per_tensor", False)):
        pl.seed_everything(0, verbose=False)
        model = _Scheduled(out_dir=str(out), tag=tag)
        t = trainer(VeScaleFSDPStrategy(start_method="fork", flat_optimizer=flat),
                    callbacks=[_Record(out, tag)], max_steps=3)
        t.fit(model, dataloader())
    return out


def _rec(out: Path, tag: str, rank: int) -> dict:
    return torch.load(out / f"{tag}_rec_rank{rank}.pt")


def test_trainer_flat_optimizer_is_bitwise_the_per_tensor_step(runs):
    assert losses(runs, "flat") == losses(runs, "per_tensor")
    for rank in range(2):
        flat, per = _rec(runs, "flat", rank), _rec(runs, "per_tensor", rank)
        assert flat["type"] == "FlatParamOptimizer" and per["type"] == "AdamW"
        assert flat["lr"] == per["lr"] == [1e-2 / 8, 1e-2 / 8]  # StepLR reached the wrapper
        assert all(torch.equal(a, b) for a, b in zip(flat["params"], per["params"]))


def test_flat_optimizer_must_be_a_bool():
    for cls in (VeScaleFSDPStrategy, VeScaleFabricStrategy):
        with pytest.raises(TypeError, match="flat_optimizer must be True or False, got 'yes'"):
            cls(flat_optimizer="yes")


def _fabric_body(flat: bool):
    from lightning.fabric import Fabric

    from lightning_vescale.optim import Muon

    fabric = Fabric(accelerator="cpu", devices=2,
                    strategy=VeScaleFabricStrategy(flat_optimizer=flat))
    fabric.launch()  # in the harness's world (as tests/lightning/test_fabric.py does)
    torch.manual_seed(0)
    model = fabric.setup_module(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)))
    sgd = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    muon = fabric.setup_optimizers(Muon(model.parameters(), lr=0.01))
    return isinstance(sgd.optimizer, FlatParamOptimizer), type(muon.optimizer).__name__


def test_fabric_wraps_torch_optimizers_only(worlds):
    assert worlds(2).run(_fabric_body, True)[0] == (True, "Muon")
    assert worlds(2).run(_fabric_body, False)[0] == (False, "Muon")
