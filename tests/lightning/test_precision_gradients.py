"""Sharding-aware gradient clipping and the sharded grad scaler, against dense references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from examples.gpt import GPT, GPTConfig
from lightning_vescale._lightning.sharding import shard_model
from lightning_vescale.mesh import init_mesh
from lightning_vescale.precision import ShardedGradScaler, clip_grad_norm_, clip_grad_value_

CFG = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=True)


def _models(rank_batches: bool):
    torch.manual_seed(0)
    dense = GPT(CFG)
    sharded = GPT(CFG)
    sharded.load_state_dict(dense.state_dict())
    shard_model(sharded, units=None, mesh=init_mesh("cpu", dist.get_world_size()),
                device=torch.device("cpu"), mp_policy=None, granularity=None,
                reshard_after_forward=True)
    ws, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(7)
    xs = torch.randint(0, CFG.vocab_size, (ws, 2, CFG.block_size), generator=g)
    sharded(xs[rank], xs[rank]).backward()
    # dense reference: the average of the per-rank losses = what reduce-scatter (avg) computes
    sum(dense(xs[r], xs[r]) for r in range(ws)).div(ws).backward()
    return dense, sharded


def _full_grads(model):
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for n, p in model.named_parameters()}


def _clip_norm(norm_type, max_norm):
    dense, sharded = _models(True)
    ref_total = torch.nn.utils.clip_grad_norm_(dense.parameters(), max_norm, norm_type)
    total = clip_grad_norm_(list(sharded.parameters()), max_norm, norm_type)
    return ref_total, total, _full_grads(dense), _full_grads(sharded)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_grad_norm_matches_dense(worlds, norm_type):
    for ref_total, total, ref, got in worlds(2).run(_clip_norm, norm_type, 0.05):
        torch.testing.assert_close(total, ref_total, rtol=1e-5, atol=0)
        assert ref.keys() == got.keys()
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-8)


def _clip_value():
    dense, sharded = _models(True)
    torch.nn.utils.clip_grad_value_(dense.parameters(), 1e-3)
    clip_grad_value_(list(sharded.parameters()), 1e-3)
    return _full_grads(dense), _full_grads(sharded)


def test_clip_grad_value_matches_dense(worlds):
    for ref, got in worlds(2).run(_clip_value):
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-8)


def _scaler(inf_on_rank):
    _, sharded = _models(True)
    params = list(sharded.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    before = {n: p.to_local().clone() for n, p in sharded.named_parameters()}
    if dist.get_rank() == inf_on_rank:
        local = next(p.grad.to_local() for p in params if p.grad.to_local().numel())
        local[0] = float("inf")
    scaler = ShardedGradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))  # (the loss would be scaled here) initialises the scale
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    changed = any(not torch.equal(before[n], p.to_local()) for n, p in sharded.named_parameters())
    return scaler.get_scale(), changed


@pytest.mark.parametrize("inf_on_rank", [None, 1])
def test_sharded_grad_scaler_agrees_across_ranks(worlds, inf_on_rank):
    results = worlds(2).run(_scaler, inf_on_rank)
    if inf_on_rank is None:
        assert all(scale == 4.0 and changed for scale, changed in results)
    else:  # one rank saw inf: every rank skips the step and backs off the scale
        assert all(scale == 2.0 and not changed for scale, changed in results)
