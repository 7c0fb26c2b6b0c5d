"""SOAP and Shampoo on RaggedShard parameters equal one process (design notes
[distributed-soap], [distributed-shampoo]).

Every rank builds the same full tensors (a 2-D weight, a stacked ``(E, out, in)`` expert weight,
a vector), shards them with the planner's ``"matrix"`` layout (each matrix whole on one rank:
local step, zero collectives, counted) or element-wise cuts (matrices split: they go to their
owner ranks and back), steps the optimizer with the same gradients, and compares its local
slices with the single-process optimizer: **bitwise** in both cases (the same ops on the same
data, wherever they run). States saved at one world (full tensors from ``state_dict``) load at
another and the next steps match an uninterrupted run.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lightning_vescale.optim import SOAP, Shampoo
from lightning_vescale.placement import local_slice
from lightning_vescale.planner import plan_layout
from tests.distributed._ragged_helpers import ragged_params, set_ragged_grads, shard_rank

SHAPES = {"w": (12, 8), "experts": (5, 6, 4), "ln": (8,)}
HP = dict(lr=3e-3, weight_decay=0.01, precondition_frequency=2)
OPTIMIZERS = {"soap": lambda ps: SOAP(ps, **HP),
              "shampoo": lambda ps: Shampoo(ps, lr=1e-2, epsilon=1e-6, precondition_frequency=2,
                                            start_preconditioning_step=2),
              # w (12, 8) in 3 x 2 tiles, each expert (6, 4) in 2 x 1 (design note
              # [shampoo-blocks]): per-tile states follow the matrix to its owner
              "shampoo-blocks": lambda ps: Shampoo(ps, lr=1e-2, epsilon=1e-6,
                                                   precondition_frequency=2,
                                                   start_preconditioning_step=2,
                                                   max_preconditioner_dim=5)}


def _full():
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _reference(steps, name="soap"):
    params = {n: torch.nn.Parameter(t.clone()) for n, t in _full().items()}
    opt = OPTIMIZERS[name](list(params.values()))
    for step in range(steps):
        for n, g in _grads(step).items():
            params[n].grad = g.clone()
        opt.step()
    return {n: p.detach() for n, p in params.items()}


def _sharded(kind, replicas=1):
    """``replicas > 1``: an HSDP mesh ``(replicas, world / replicas)``, placements
    ``(Replicate(), RaggedShard)``."""
    world = dist.get_world_size()
    shard = world // replicas
    mesh = init_device_mesh("cpu", (replicas, shard)) if replicas > 1 else \
        init_device_mesh("cpu", (world,))
    plan = plan_layout(list(SHAPES.items()), shard, granularity="matrix" if kind == "matrix"
                       else 1, align=1)
    layouts = {n: plan.placement(n) for n in SHAPES}
    return ragged_params(_full(), layouts, mesh), layouts, mesh


def _steps(params, layouts, mesh, opt, steps):
    from lightning_vescale.testing import CopyCommCounter

    comms = 0
    for step in steps:
        set_ragged_grads(params, _grads(step), layouts, mesh)
        with CopyCommCounter() as counter:
            opt.step()
        comms += counter.comms
    return comms


def _compare(params, layouts, mesh, ref):
    out = {}
    for n in SHAPES:
        got, want = params[n].detach().to_local(), local_slice(ref[n], layouts[n],
                                                               shard_rank(mesh))
        out[n] = (bool(torch.equal(got, want)),
                  float((got - want).abs().max()) if want.numel() else 0.)
    return out


def _body(kind, name, steps=5, replicas=1):
    params, layouts, mesh = _sharded(kind, replicas)
    opt = OPTIMIZERS[name](list(params.values()))
    comms = _steps(params, layouts, mesh, opt, range(steps))
    return _compare(params, layouts, mesh, _reference(steps, name)), comms


@pytest.mark.parametrize("name", ["soap", "shampoo", "shampoo-blocks"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["matrix", "element"])
def test_sharded_equals_one_process(worlds, world, kind, name):
    outs = worlds(world).run(_body, kind, name)
    for rank, (result, comms) in enumerate(outs):
        for n, (equal, diff) in result.items():
            assert equal, (rank, n, diff)
        if kind == "matrix":
            assert comms == 0, (rank, comms)
    if kind == "element" and world > 1:  # split matrices went to their owners and back
        assert sum(c for _, c in outs) > 0


@pytest.mark.parametrize("name", ["soap", "shampoo", "shampoo-blocks"])
@pytest.mark.parametrize("kind", ["matrix", "element"])
def test_hsdp_2x2_equals_one_process(worlds, kind, name):
    outs = worlds(4).run(_body, kind, name, 5, 2)
    for rank, (result, comms) in enumerate(outs):
        for n, (equal, diff) in result.items():
            assert equal or (kind == "element" and diff <= 1e-6), (rank, n, diff)
        if kind == "matrix":
            assert comms == 0, (rank, comms)


def _save_body(name):
    params, layouts, mesh = _sharded("matrix")
    opt = OPTIMIZERS[name](list(params.values()))
    _steps(params, layouts, mesh, opt, range(3))
    sd = opt.state_dict()
    full = {k: {key: (v.full_tensor() if hasattr(v, "full_tensor") else v)
                for key, v in st.items()} for k, st in sd["state"].items()}
    return {"state": full, "param_groups": sd["param_groups"],
            "params": {n: p.full_tensor() for n, p in params.items()}}


def _load_body(saved, name):
    params, layouts, mesh = _sharded("matrix")
    with torch.no_grad():
        for n, p in params.items():
            p.to_local().copy_(local_slice(saved["params"][n], layouts[n], shard_rank(mesh)))
    opt = OPTIMIZERS[name](list(params.values()))
    opt.load_state_dict({"state": saved["state"], "param_groups": saved["param_groups"]})
    _steps(params, layouts, mesh, opt, range(3, 6))
    return _compare(params, layouts, mesh, _reference(6, name)), dist.get_world_size()


@pytest.mark.parametrize("name", ["soap", "shampoo", "shampoo-blocks"])
@pytest.mark.parametrize("load_world", [3, 1])
def test_resumes_at_another_world(worlds, load_world, name):
    saved = worlds(2).run(_save_body, name)[0]
    for result, _ in worlds(load_world).run(_load_body, saved, name):
        for n, (equal, diff) in result.items():
            assert diff <= 1e-6, (n, diff)
