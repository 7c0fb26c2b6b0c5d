"""Parity of ``fully_shard`` training with single-process training (world sizes 1-4).

Each rank trains on its own micro-batch; the reference trains one model in the same process on
the concatenated global batch (mean loss). Losses must agree to 1e-5 relative and parameters
after the last step must be allclose. Also: block-aligned (row) granularity, and one sharded
block applied twice per forward.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed._fully_shard_helpers import (
    OPTS,
    assemble,
    assert_params_match_reference,
    batches,
    build,
    global_mean,
    local_pieces,
    make_opt,
    micro,
    shard,
    train_against_reference,
    train_step,
)


def train_pair(kind: str, opt_kind: str, steps: int, dtensor_opt: bool = False,
               per_rank_batch: int = 2, shard_kw: dict | None = None,
               clip: float | None = None):
    """Train fully_shard + reference; return (fsdp losses, ref losses, pieces, ref params).

    ``clip``: also clip gradients with ``torch.nn.utils.clip_grad_norm_`` on both sides
    (needs DTensor ops, i.e. ``dtensor_opt=True``).
    """
    model = build(kind)
    ref = copy.deepcopy(model)
    shard(model, **(shard_kw or {}))
    opt = make_opt(model.parameters(), opt_kind, dtensor_opt)
    ref_opt = OPTS[opt_kind][0](ref.parameters(), **OPTS[opt_kind][1])
    losses, ref_losses, _, _ = train_against_reference(model, ref, opt, ref_opt, kind, steps,
                                                       clip, per_rank_batch)
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    return losses, ref_losses, local_pieces(model), ref_params


def _parity_body(combos, dtensor_opt):
    clip = 0.5 if dtensor_opt else None
    return [train_pair(k, o, steps=4, dtensor_opt=dtensor_opt, clip=clip) for k, o in combos]


def check_parity(results_per_rank, combos, loss_rtol=1e-5, rtol=1e-4, atol=1e-4):
    """Losses within ``loss_rtol`` (relative) and final parameters allclose.

    Parameter tolerance: AdamW divides by sqrt(v), so gradients that are mathematically zero
    but carry fp32 rounding noise (the attention key bias of a GPT, whose gradient cancels in
    the softmax) move by up to ~1e-5 differently on a different reduction order. ``atol=1e-4``
    is 1% of one lr=1e-2 step; a wrong gradient moves parameters by ~lr.
    """
    for i, combo in enumerate(combos):
        per_rank = [r[i] for r in results_per_rank]
        losses, ref_losses, _, ref_params = per_rank[0]
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        assert rel <= loss_rtol, (combo, losses, ref_losses, rel)
        got = assemble([r[2] for r in per_rank])
        assert set(got) == set(ref_params), combo
        for n, p in ref_params.items():
            torch.testing.assert_close(got[n], p, rtol=rtol, atol=atol,
                                       msg=lambda m, n=n: f"{combo} {n}: {m}")


COMBOS = [("gpt", "adamw"), ("gpt", "sgd"), ("mlp", "adamw"), ("mlp", "sgd")]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_parity_fp32_local_optimizer(worlds, world_size):
    results = worlds(world_size).run(_parity_body, COMBOS, False)
    check_parity(results, COMBOS)


@pytest.mark.parametrize("world_size", [2, 3])
def test_parity_fp32_torch_optimizer_on_dtensors(worlds, world_size):
    """Real torch.optim.AdamW/SGD and clip_grad_norm_ stepping the RaggedShard DTensors."""
    results = worlds(world_size).run(_parity_body, COMBOS, True)
    check_parity(results, COMBOS)


# -- granularity / block alignment ---------------------------------------------------------------
def _gran_body():
    from lightning_vescale.fsdp import param_fqn_map

    def row(name, p):
        return p.shape[-1] if p.dim() == 2 else 1

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build("gpt")
    ref = copy.deepcopy(model)
    shard(model, granularity=row)
    ranges = {fqn: (mp.buffer.plan.local_range(mp.name, rank), mp.shape,
                    mp.buffer.plan.spec(mp.name).granularity)
              for fqn, (g, mp) in param_fqn_map(model).items()}
    x, y = batches("gpt", 1, 2 * world)[0]
    loss = model(micro(x, rank, world), micro(y, rank, world))
    loss.backward()
    return ranges, global_mean(loss), ref(x, y).item()


@pytest.mark.parametrize("world_size", [3, 4])
def test_row_granularity_alignment(worlds, world_size):
    for ranges, loss, ref_loss in worlds(world_size).run(_gran_body):
        assert abs(loss - ref_loss) / ref_loss < 1e-5
        for fqn, ((a, b), shape, g) in ranges.items():
            numel = 1
            for s in shape:
                numel *= s
            if len(shape) == 2:
                assert g == shape[1], fqn
            assert a % g == 0 or a == numel, (fqn, a, g)
            assert b % g == 0 or b == numel, (fqn, b, g)


# -- one block applied twice per forward (weight sharing) --------------------------------------


class _SharedTwice(nn.Module):
    """One sharded block applied twice per forward (weight sharing, ALBERT-style)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.shared = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(torch.tanh(self.shared(self.inp(x)))))
        return self.out(h).square().mean()


def _shared_twice_body():
    from lightning_vescale.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _SharedTwice()
    ref = copy.deepcopy(model)
    fully_shard(model.shared)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        xs = torch.randn(2 * world, 6, generator=g)
        train_step(model(xs[2 * rank:2 * rank + 2]), opt)
        train_step(ref(xs), ref_opt)
    return local_pieces(model), {n: p.detach().clone() for n, p in ref.named_parameters()}


def test_a_block_applied_twice_per_forward(worlds):
    res = worlds(2).run(_shared_twice_body)
    assert_params_match_reference(res, rtol=1e-4, atol=1e-6)
