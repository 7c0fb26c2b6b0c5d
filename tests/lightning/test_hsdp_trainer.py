"""HSDP through the Lightning faces (issue 13): Trainer and Fabric at world 4 on a 2 x 2 mesh.

``device_mesh=(2, 2)`` must train exactly like full sharding over the 4 ranks and like DDP
(every rank its own data slice: the sampler spans the world, not a shard group), with the
parameters really on the 2-D mesh: ``(Replicate(), RaggedShard)`` DTensors whose local shards
are half of each group (shard group of 2), identical across the two replicas. Also gradient
accumulation with clipping by norm (the norm must count each element once, not once per
replica), ``configure_model`` sharding with ``self.device_mesh`` (the 2-D mesh), and Fabric
against a dense single-process reference.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor

from lightning_vescale import RaggedShard, VeScaleFabricStrategy, VeScaleFSDPStrategy
from tests.lightning._lit import TinyGPT, assert_close_losses, dataloader, losses, trainer
from tests.lightning.test_fabric import _batches, _reference, _train

WORLD = 4


class RecordLayout(Callback):
    """Each rank writes, at the end of fit, the mesh/placements/local sizes of its parameters."""

    def __init__(self, out_dir: Path, tag: str) -> None:
        self.out_dir, self.tag = out_dir, tag

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not isinstance(trainer.strategy, VeScaleFSDPStrategy):
            return
        rows = []
        for name, p in pl_module.named_parameters():
            assert isinstance(p, DTensor), name
            rows.append((name, tuple(p.device_mesh.shape), p.device_mesh.mesh_dim_names,
                         tuple(type(x).__name__ for x in p.placements),
                         p.to_local().detach().clone(), p.shape.numel()))
        torch.save(rows, self.out_dir / f"{self.tag}_layout_rank{trainer.global_rank}.pt")


def _fit(strategy, out_dir: Path, tag: str, *, model_kwargs=None, **kwargs) -> None:
    pl.seed_everything(0, verbose=False)
    model = TinyGPT(out_dir=str(out_dir), tag=tag, **(model_kwargs or {}))
    t = trainer(strategy, devices=WORLD, callbacks=[RecordLayout(out_dir, tag)], **kwargs)
    t.fit(model, dataloader(world_size=WORLD))


def _layout(out_dir: Path, tag: str) -> list[list[tuple]]:
    return [torch.load(out_dir / f"{tag}_layout_rank{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hsdp_trainer")
    _fit("ddp_fork", out, "ddp", max_epochs=1)
    _fit(VeScaleFSDPStrategy(start_method="fork"), out, "full", max_epochs=1)
    _fit(VeScaleFSDPStrategy(start_method="fork", device_mesh=(2, 2)), out, "hsdp", max_epochs=1)
    return out


def test_hsdp_matches_full_sharding_and_ddp(runs):
    ref = losses(runs, "ddp", WORLD)
    assert len(ref[0]) == 3 and len({tuple(r) for r in ref}) == WORLD  # each rank its own data
    assert_close_losses(losses(runs, "full", WORLD), ref, rtol=1e-5)
    assert_close_losses(losses(runs, "hsdp", WORLD), ref, rtol=1e-5)


def test_hsdp_parameters_live_on_the_2d_mesh(runs):
    hsdp, full = _layout(runs, "hsdp"), _layout(runs, "full")
    for rank in range(WORLD):
        for (name, shape, dims, placements, local, numel), f in zip(hsdp[rank], full[rank]):
            assert shape == (2, 2) and dims == ("dp_replicate", "dp_shard"), name
            assert placements == ("Replicate", "RaggedShard"), (name, placements)
            assert f[1] == (4,) and f[3] == ("RaggedShard",)
        # a shard group of 2 holds each group in 2 pieces: the local sizes over a shard group
        # add up to the whole model (with full sharding it takes all 4 ranks)
    for rank_pair in ((0, 1), (2, 3)):
        total = sum(row[4].numel() for r in rank_pair for row in hsdp[r])
        assert total == sum(row[5] for row in hsdp[0])
    assert sum(row[4].numel() for r in range(WORLD) for row in full[r]) == \
        sum(row[5] for row in full[0])
    # replicas (rank j and rank 2 + j) hold the same shard with the same trained values
    for j in range(2):
        for a, b in zip(hsdp[j], hsdp[2 + j]):
            assert torch.equal(a[4], b[4]), a[0]


def test_hsdp_accumulation_and_clip_norm_match_ddp(tmp_path):
    kw = dict(max_steps=2, accumulate_grad_batches=2, gradient_clip_val=0.05,
              gradient_clip_algorithm="norm")
    _fit("ddp_fork", tmp_path, "ddp", **kw)
    _fit(VeScaleFSDPStrategy(start_method="fork", device_mesh=[2, 2]), tmp_path, "hsdp", **kw)
    assert_close_losses(losses(tmp_path, "hsdp", WORLD), losses(tmp_path, "ddp", WORLD),
                        rtol=1e-5)


def test_configure_model_sees_the_2d_mesh(tmp_path):
    """``self.device_mesh`` in ``configure_model`` is the HSDP mesh; blocks the user sharded on it
    and the root the strategy adds train like DDP."""
    _fit("ddp_fork", tmp_path, "ddp", max_steps=2)
    _fit(VeScaleFSDPStrategy(start_method="fork", device_mesh=(2, 2)), tmp_path, "user",
         max_steps=2, model_kwargs=dict(shard_in_configure_model="blocks"))
    assert_close_losses(losses(tmp_path, "user", WORLD), losses(tmp_path, "ddp", WORLD),
                        rtol=1e-5)
    for rank in _layout(tmp_path, "user"):
        assert all(row[1] == (2, 2) and row[3][1] == "RaggedShard" for row in rank)


# -- Fabric ----------------------------------------------------------------------------------------
def _fabric_hsdp(device_mesh):
    from examples.gpt import GPT
    from lightning.fabric import Fabric

    from tests.lightning.test_fabric import CFG, LR

    if device_mesh == "DeviceMesh":  # the user's own mesh (the process group exists already)
        from torch.distributed.device_mesh import init_device_mesh

        device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(),
                    strategy=VeScaleFabricStrategy(device_mesh=device_mesh))
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(GPT(CFG))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1))
    p = next(iter(model.parameters()))
    layout = (tuple(p.device_mesh.shape), type(p.placements[-1]).__name__)
    xs = _batches(6, dist.get_world_size())
    got = _train(fabric, model, opt, xs, 3, accumulate=2, clip=0.05)
    return got, _reference(3, accumulate=2, clip=0.05), layout


@pytest.mark.parametrize("device_mesh", [(2, 2), "DeviceMesh"])
def test_fabric_hsdp_matches_dense(worlds, device_mesh):
    for rank, (got, ref, layout) in enumerate(worlds(WORLD).run(_fabric_hsdp, device_mesh)):
        assert layout == ((2, 2), RaggedShard.__name__)
        for s in range(3):
            for a in range(2):
                assert abs(got[s][a] - ref[s][a][rank]) <= 1e-5 * abs(ref[s][a][rank]), (got, ref)


def _fabric_wrong_world():
    try:
        _fabric_hsdp((3, 1))
    except ValueError as e:
        return str(e)
    return None


def test_fabric_shape_not_matching_the_world_fails_at_launch(worlds):
    for msg in worlds(WORLD).run(_fabric_wrong_world):
        assert msg is not None and "device_mesh=(3, 1) describes 3 ranks" in msg \
            and "4 processes (num_nodes=1 x devices=4)" in msg, msg
