"""``torch.save`` / ``copy.deepcopy`` of DTensors over DBuffer views (design note
[dtensor-views-pickle] in ``placement/_pickle.py``): every parameter but the first of a shard
sits at a storage offset, which torch 2.13's pickling mistook for real storage."""

from __future__ import annotations

import copy
import io

import torch
import torch.distributed as dist
from torch import nn


def _body(replicas: int):
    from torch.distributed.tensor import DTensor, Shard

    from lightning_vescale.fsdp import fully_shard
    from lightning_vescale.mesh import init_mesh

    mesh = init_mesh("cpu", replicas=replicas)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.randn(4, 5)).sum().backward()
    out = {"offsets": [p.to_local().storage_offset() for p in model.parameters()]}
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)  # failed before: "invalid python storage"
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    sd = model.state_dict()
    out["saved_equal"] = all(
        isinstance(loaded[k], DTensor) and loaded[k].placements == v.placements
        and torch.equal(loaded[k].to_local(), v.to_local()) for k, v in sd.items())
    copies = {n: copy.deepcopy(p) for n, p in model.named_parameters()}
    out["deepcopy_equal"] = all(
        torch.equal(c.to_local(), p.to_local()) and c.requires_grad == p.requires_grad
        and c.grad is not None and torch.equal(c.grad.to_local(), p.grad.to_local())
        and c.to_local().untyped_storage().data_ptr() != p.to_local().untyped_storage().data_ptr()
        for (n, p), c in zip(model.named_parameters(), copies.values()))
    base = torch.arange(8.0 * dist.get_world_size())
    plain = DTensor.from_local(base[4:8], mesh if replicas == 1 else mesh["dp_shard"],
                               [Shard(0)], run_check=False)  # torch's own DTensor at offset 4
    buf = io.BytesIO()
    torch.save(plain, buf)
    buf.seek(0)
    out["torch_dtensor"] = torch.equal(torch.load(buf, weights_only=False).to_local(), base[4:8])
    return out


def test_save_and_deepcopy_sharded_parameters(worlds):
    for out in worlds(2).run(_body, 1):
        assert any(o != 0 for o in out["offsets"]), out  # the case that failed
        assert out["saved_equal"] and out["deepcopy_equal"] and out["torch_dtensor"], out


def test_save_and_deepcopy_on_hsdp(worlds):
    for out in worlds(4).run(_body, 2):
        assert out["saved_equal"] and out["deepcopy_equal"] and out["torch_dtensor"], out
