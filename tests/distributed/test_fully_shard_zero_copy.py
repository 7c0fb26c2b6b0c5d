"""Zero-copy invariants of ``fully_shard`` (ARCHITECTURE.md, "Zero-copy").

* While a group computes, every parameter a module sees is a plain tensor whose memory lies
  inside the group's DBuffer (``full``); at rest each sharded parameter's local tensor is a view
  of the owned slice and its ``.grad``'s local tensor a view of the sharded gradient slice.
* A training step (forward + backward) through the engine adds no copy operator to what the
  plain model runs, while PyTorch FSDP2 adds per-parameter copy-in/copy-out; counted with a
  TorchDispatchMode (design note [copy-comm-counting]).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_vescale._gloo_exchange import unfused
from tests.distributed._fully_shard_helpers import batches, build, micro, shard


def _inside(t: torch.Tensor, base: torch.Tensor) -> bool:
    lo = base.untyped_storage().data_ptr()
    hi = lo + base.untyped_storage().nbytes()
    return (t.untyped_storage().data_ptr() == lo and lo <= t.data_ptr()
            and t.data_ptr() + t.numel() * t.element_size() <= hi)


def _views_body():
    from lightning_vescale.fsdp import param_fqn_map
    from lightning_vescale.placement import RaggedShard

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build("gpt")
    shard(model)
    fqn_map = param_fqn_map(model)
    seen: dict[str, bool] = {}

    def hook(mod, args, prefix=""):
        for attr, p in mod._parameters.items():
            fqn = prefix + attr
            key = fqn if fqn in fqn_map else None
            if key is None:  # tied: head.weight is tok_emb.weight
                continue
            buf = fqn_map[key][1].buffer
            seen[fqn] = (not isinstance(p, DTensor)) and _inside(p, buf.full) and \
                p.data_ptr() == buf.param_view(fqn_map[key][1].name).data_ptr()

    for name, m in model.named_modules():
        if m._parameters:
            m.register_forward_pre_hook(lambda mod, a, prefix=name + ".": hook(mod, a, prefix))
    # tied head: the module sees the very same unsharded tensor as the embedding
    tied = []
    model.head.register_forward_pre_hook(
        lambda mod, a: tied.append(mod.weight is model.tok_emb.weight))
    x, y = batches("gpt", 1, 2 * world)[0]
    for _ in range(2):  # second step runs with prefetch
        model(micro(x, rank, world), micro(y, rank, world)).backward()
    at_rest = {}
    for fqn, (g, mp) in fqn_map.items():
        p = dict(model.named_parameters())[fqn]
        buf = mp.buffer
        loc = p.to_local()
        at_rest[fqn] = (
            isinstance(p, DTensor) and isinstance(p.placements[0], RaggedShard)
            and (loc.numel() == 0 or _inside(loc, buf.shard))
            and loc.data_ptr() == buf.local_view(mp.name).data_ptr()
            and isinstance(p.grad, DTensor)
            and (p.grad.to_local().numel() == 0 or _inside(p.grad.to_local(), buf.grad_shard))
            and buf.memory_bytes()["param_unsharded"] == 0
            and buf.memory_bytes()["grad_unsharded"] == 0
        )
    return seen, at_rest, tied, sorted(fqn_map)


@pytest.mark.parametrize("world_size", [2, 3])
def test_unsharded_params_are_dbuffer_views(worlds, world_size):
    for seen, at_rest, tied, names in worlds(world_size).run(_views_body):
        assert set(seen) == set(names) and all(seen.values()), seen
        assert all(at_rest.values()), at_rest
        assert tied and all(tied)


class PlainMLP(nn.Module):
    """Linears only: its own forward/backward runs no copy operator."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in [(16, 31), (31, 29), (29, 8)])

    def forward(self, x, y):
        for layer in self.layers:
            x = F.relu(layer(x))
        return F.mse_loss(x, y)


@unfused()  # the accelerator path's copies; gloo's fused exchange copies small collectives by design (design note [gloo-fused-exchange])
def _count_body():
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    from lightning_vescale.fsdp import fully_shard
    from lightning_vescale.testing import CopyCommCounter

    torch.manual_seed(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    base = PlainMLP()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    for m in ours.layers:
        fully_shard(m)
    fully_shard(ours)
    for m in theirs.layers:
        fsdp2_fully_shard(m)
    fsdp2_fully_shard(theirs)
    x, y = torch.randn(4 * world, 16), torch.randn(4 * world, 8)
    x, y = micro(x, rank, world), micro(y, rank, world)
    out = {}
    for name, model in (("plain", base), ("vescale", ours), ("fsdp2", theirs)):
        model(x, y).backward()  # warm-up (records orders; lazy init)
        for p in model.parameters():
            p.grad = None
        with CopyCommCounter() as c:
            model(x, y).backward()
        out[name] = c.summary()
    return out


def test_step_adds_no_copies_unlike_fsdp2(worlds):
    res = worlds(2).run(_count_body)[0]
    plain, ours, fsdp2 = res["plain"], res["vescale"], res["fsdp2"]
    assert plain["comms"] == 0
    # the engine adds collectives but not a single copy operator to the model's own work
    assert ours["copies"] == plain["copies"], (ours, plain)
    assert ours["copy_bytes"] == plain["copy_bytes"]
    assert ours["comms"] > 0
    # FSDP2 copies every parameter into/out of its communication buffers
    assert fsdp2["copies"] > plain["copies"], fsdp2
    assert fsdp2["copy_bytes"] > plain["copy_bytes"]
