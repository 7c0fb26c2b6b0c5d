"""Activation checkpointing (forwards recomputed inside backward, reentrant or not) around
and inside sharded blocks, after a dtype move; ``unshard()``/``reshard()`` of the module API."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tests.distributed._fully_shard_helpers import (
    OPTS,
    assemble,
    assert_params_match_reference,
    batches,
    build,
    local_pieces,
    make_opt,
    micro,
    shard,
    train_step,
)


# -- activation checkpointing, dtype moves, unshard/reshard helpers -------------------------------
def _misc_body():
    import functools

    from torch.utils.checkpoint import checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build("gpt")
    ref = copy.deepcopy(model)
    for blk in model.blocks:  # recompute each block's forward in backward
        blk.forward = functools.partial(checkpoint, blk.forward, use_reentrant=False)
    shard(model)
    model.double()  # a dtype move rebuilds the DBuffers in float64
    ref.double()
    dtypes = {p.dtype for p in model.parameters()}
    opt = make_opt(model.parameters(), "sgd")
    ref_opt = OPTS["sgd"][0](ref.parameters(), **OPTS["sgd"][1])
    for x, y in batches("gpt", 2, 2 * world):
        model(micro(x, rank, world), micro(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        ref(x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    model.unshard()
    root_plain = all(not isinstance(p, DTensor) for n, p in model.named_parameters()
                     if not n.startswith("blocks"))
    blocks_sharded = all(isinstance(p, DTensor) for p in model.blocks.parameters())
    model.reshard()
    sharded_after_reshard = all(isinstance(p, DTensor) for p in model.parameters())
    return (dtypes, root_plain and blocks_sharded, sharded_after_reshard, local_pieces(model),
            {n: p.detach().clone() for n, p in ref.named_parameters()})


def test_checkpointing_dtype_move_and_unshard(worlds):
    res = worlds(2).run(_misc_body)
    dtypes, unshard_ok, reshard_ok, _, ref = res[0]
    assert dtypes == {torch.float64}
    assert unshard_ok and reshard_ok  # unshard() gathers the root's own group only
    got = assemble([r[3] for r in res])
    for n in ref:
        assert got[n].dtype == torch.float64
        torch.testing.assert_close(got[n], ref[n], rtol=1e-9, atol=1e-12, msg=n)


# -- checkpoint_wrapper-style checkpointing around whole sharded blocks ------------------------


class _Checkpointed(nn.Module):
    """Activation checkpointing around a whole sharded block (``checkpoint_wrapper`` style)."""

    def __init__(self, inner: nn.Module, use_reentrant: bool) -> None:
        super().__init__()
        self.inner = inner
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, x, use_reentrant=self.use_reentrant)


def _checkpointed_blocks_body(use_reentrant: bool):
    from lightning_vescale.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = build("gpt"), build("gpt")
    for i, blk in enumerate(model.blocks):
        fully_shard(blk)
        model.blocks[i] = _Checkpointed(blk, use_reentrant)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches("gpt", 2, 2 * world):
        train_step(model(micro(x, rank, world), micro(y, rank, world)), opt)
        train_step(ref(x, y), ref_opt)
    got = {n.replace(".inner.", "."): p for n, p in local_pieces(model).items()}
    return got, {n: p.detach().clone() for n, p in ref.named_parameters()}


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_around_sharded_blocks(worlds, use_reentrant):
    res = worlds(2).run(_checkpointed_blocks_body, use_reentrant)
    assert_params_match_reference(res, rtol=1e-4, atol=1e-5)
