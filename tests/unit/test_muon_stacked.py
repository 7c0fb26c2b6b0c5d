"""Muon on stacked-expert ``(E, out, in)`` weights (design note [muon-stacked-experts]): each
expert is orthogonalised on its own with its own adjusted learning rate, exactly
``torch.optim.Muon`` on ``E`` separate 2-D parameters (bitwise, single process); 4-D weights keep
the flattened view; a group's ``matrix_view`` overrides it; the owner plan keeps a matrix one
rank holds whole on that rank."""

from __future__ import annotations

import pytest
import torch

from lightning_vescale.optim import Muon
from lightning_vescale.optim._muon_groups import matrix_stack
from lightning_vescale.optim._muon_plan import assign_owners, build_plan


def _grads(shape, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(steps)]


@pytest.mark.parametrize("shape", [(6, 16, 8), (3, 8, 24), (1, 18, 30), (5, 12, 12)])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_stack_equals_torch_muon_per_expert_bitwise(shape, adjust_lr_fn):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(shape))
    experts = [torch.nn.Parameter(w.detach()[e].clone()) for e in range(shape[0])]
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn=adjust_lr_fn)
    ours = Muon([("experts.w", w)], **kw)
    ref = torch.optim.Muon(experts, **kw)
    for g in _grads(shape, 3):
        w.grad = g.clone()
        for e, p in enumerate(experts):
            p.grad = g[e].clone()
        ours.step()
        ref.step()
    assert torch.equal(w.detach(), torch.stack([p.detach() for p in experts]))


def test_flatten_differs_from_per_expert_by_a_visible_amount():
    # The measurement: the old (flattened) update is ~1e-2 away after 3 steps.
    torch.manual_seed(0)
    shape = (4, 16, 8)
    a = torch.nn.Parameter(torch.randn(shape))
    b = torch.nn.Parameter(a.detach().clone())
    oa = Muon([("w", a)], lr=0.02)
    ob = Muon([("w", b)], lr=0.02, matrix_view="flatten")
    for g in _grads(shape, 3):
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    assert (a - b).abs().max() > 1e-3


def test_group_key_overrides_the_default():
    torch.manual_seed(0)
    shape = (4, 16, 8)
    a = torch.nn.Parameter(torch.randn(shape))
    b = torch.nn.Parameter(a.detach().clone())
    flat = torch.nn.Parameter(a.detach().reshape(4, 128).clone())  # (shape[0], -1)
    oa = Muon([{"params": [("w", a)], "matrix_view": "flatten"}], lr=0.02)
    ref = torch.optim.Muon([flat], lr=0.02)
    for g in _grads(shape, 2):
        a.grad, flat.grad = g.clone(), g.reshape(4, 128).clone()
        oa.step()
        ref.step()
    assert torch.equal(a.detach(), flat.detach().reshape(shape))
    assert oa.param_groups[0]["matrix_view"] == "flatten"
    with pytest.raises(ValueError, match="matrix_view"):
        Muon([("w", b)], matrix_view="experts")
    with pytest.raises(ValueError, match="matrix_view"):
        Muon([{"params": [("w", b)], "matrix_view": "experts"}])


@pytest.mark.parametrize("shape, view, expected", [
    ((16, 8), "auto", (1, 16, 8)),
    ((4, 16, 8), "auto", (4, 16, 8)),
    ((6, 4, 3, 3), "auto", (1, 6, 36)),       # conv: flattened as before
    ((2, 3, 4, 5), "stack", (6, 4, 5)),
    ((4, 16, 8), "flatten", (1, 4, 128)),
    ((16, 8), "stack", (1, 16, 8)),
])
def test_matrix_stack(shape, view, expected):
    assert matrix_stack(shape, view) == expected


def test_whole_matrices_stay_on_their_rank_and_need_no_bucket():
    # 4 experts of 8x4, each whole on one rank (granularity "matrix") over 2 ranks.
    ranges = [((0, 32), (32, 32)), ((0, 32), (32, 32)), ((0, 0), (0, 32)), ((0, 0), (0, 32))]
    plan = build_plan("k", [(8, 4)] * 4, ranges, rank=1, world_size=2, ns_steps=5,
                      cap_numel=10**6)
    assert plan.buckets == ()
    assert plan.owners == (0, 0, 1, 1)
    assert plan.local_owned == (2, 3) and plan.whole == (0, 1, 2, 3)


def test_fixed_owners_count_in_the_balance():
    # Rank 0 already holds two matrices whole; the two split ones go to rank 1.
    owners = assign_owners([10, 10, 10, 10], 2, fixed=[0, 0, None, None])
    assert owners == [0, 0, 1, 1]
