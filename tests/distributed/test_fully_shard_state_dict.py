"""``state_dict()`` / ``load_state_dict``: RaggedShard DTensors out, sharded or full state dicts
in (copied into the DBuffer shard, parameters never replaced), and nothing stale after a
forward whose output never went through backward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.distributed._fully_shard_helpers import (
    assemble,
    batches,
    build,
    local_pieces,
    make_opt,
    micro,
    shard,
)


# -- state_dict round trip ----------------------------------------------------------------------
def _state_dict_body():
    from lightning_vescale.placement import RaggedShard, ragged_from_local

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build("gpt")
    plain = build("gpt", seed=3)
    shard(model)
    sd = model.state_dict()
    kinds = {k: (isinstance(v, DTensor) and isinstance(v.placements[0], RaggedShard))
             for k, v in sd.items() if not k.endswith("attn.bias")}
    saved = {k: ragged_from_local(v.to_local().clone(), v.device_mesh, v.placements[0],
                                  tuple(v.shape), autograd=False, check=False)
             for k, v in sd.items()}
    before = local_pieces(model)
    opt = make_opt(model.parameters(), "sgd")
    x, y = batches("gpt", 1, 2 * world)[0]
    model(micro(x, rank, world), micro(y, rank, world)).backward()
    opt.step()
    changed = local_pieces(model)
    ptrs = [p.to_local().data_ptr() for p in model.parameters()]
    model.load_state_dict(saved)
    after = local_pieces(model)
    same_storage = ptrs == [p.to_local().data_ptr() for p in model.parameters()]
    model.load_state_dict(plain.state_dict())  # a full (unsharded) state dict loads too
    from_full = local_pieces(model)
    plain_params = {n: p.detach().clone() for n, p in plain.named_parameters()}
    return kinds, before, changed, after, same_storage, from_full, plain_params


def test_state_dict_round_trip(worlds):
    res = worlds(2).run(_state_dict_body)
    for kinds, before, changed, after, same_storage, _, _ in res:
        assert kinds and all(kinds.values()), kinds
        assert any(not torch.equal(before[n][0], changed[n][0]) for n in before)
        for n in before:
            assert torch.equal(before[n][0], after[n][0]), n
        assert same_storage  # loading copies into the DBuffer shard, params are not replaced
    got, want = assemble([r[5] for r in res]), res[0][6]
    for n in want:
        assert torch.equal(got[n], want[n]), n


def _forward_without_backward_body():
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build("gpt")
    other = build("gpt", seed=5)
    shard(model)
    x, y = batches("gpt", 1, 2 * world)[0]
    model(micro(x, rank, world), micro(y, rank, world))  # grad enabled, never backpropagated
    sd = model.state_dict()
    sd_sharded = all(isinstance(v, DTensor) for k, v in sd.items() if not k.endswith("attn.bias"))
    model.load_state_dict(other.state_dict())  # must land in the shards the next forward uses
    with torch.no_grad():
        got = model(x, y).item()
        want = other(x, y).item()
    return sd_sharded, got, want


def test_forward_without_backward_leaves_nothing_stale(worlds):
    for sd_sharded, got, want in worlds(2).run(_forward_without_backward_body):
        assert sd_sharded
        assert got == pytest.approx(want, rel=1e-5)
