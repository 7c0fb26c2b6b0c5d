"""Redistribution of RaggedShard DTensors on gloo (world sizes 1-4), with autograd.

Every rank builds the dense reference tensor from a seed and checks its own local result
against a slice/chunk of it computed with plain torch indexing, never with the code under test.
Which collectives run is checked by counting calls into ``torch.distributed``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from lightning_vescale.placement import RaggedShard, install, ragged_from_local
from tests.distributed._ragged_helpers import count_collectives, expected_local

SHAPE = (6, 5, 3)  # P = 6 over dims (0,), 30 over (0, 1), 90 over (0, 1, 2)


def _dense(seed: int = 0, shape=SHAPE) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _layouts(world: int) -> list[RaggedShard]:
    """Even, ragged, zero-unit, one-hot and sub-row layouts for ``SHAPE`` on ``world`` ranks."""
    one_hot = [tuple(1 if r == o else 0 for r in range(world)) for o in {0, world - 1}]
    ragged = {1: [(3,)], 2: [(1, 5), (2, 3)], 3: [(2, 0, 1), (1, 3, 1)],
              4: [(1, 2, 0, 3), (2, 0, 1, 2)]}[world]
    out = [RaggedShard((0,), ragged[0]), RaggedShard((0, 1), ragged[-1]),
           RaggedShard((0, 1, 2), {1: (1,), 2: (4, 5), 3: (1, 1, 1), 4: (3, 0, 1, 5)}[world]), RaggedShard((), one_hot[0]),
           RaggedShard((0,), tuple(2 if r == world - 1 else 0 for r in range(world)))]
    if len(one_hot) > 1:
        out.append(RaggedShard((), one_hot[1]))
    for pl in out:
        pl.validate(SHAPE, world)
    return out


def _setup():
    world, rank = dist.get_world_size(), dist.get_rank()
    return init_device_mesh("cpu", (world,)), world, rank


def _ragged(full: torch.Tensor, mesh, pl: RaggedShard, requires_grad: bool = False) -> DTensor:
    start, end = pl.local_range(full.shape, mesh.get_local_rank(0))
    local = full.reshape(-1)[start:end].clone().requires_grad_(requires_grad)
    return ragged_from_local(local, mesh, pl, full.shape)


# -- bodies (run on every rank) --------------------------------------------------------------------
def _body_from_local_full_tensor():
    mesh, world, rank = _setup()
    full = _dense()
    for pl in _layouts(world):
        dt = _ragged(full, mesh, pl)
        assert dt.shape == full.shape and dt.stride() == full.stride()
        assert dt.placements == (pl,)
        torch.testing.assert_close(dt.to_local(), expected_local(full, pl, rank, world))
        torch.testing.assert_close(dt.full_tensor(), full, rtol=0, atol=0)
        rep = dt.redistribute(mesh, [Replicate()])
        assert rep.placements == (Replicate(),)
        torch.testing.assert_close(rep.to_local(), full, rtol=0, atol=0)
    # 0-d and 1-D tensors, owned by one rank / spread
    scalar = torch.tensor(3.5)
    one_hot = RaggedShard((), tuple(1 if r == world - 1 else 0 for r in range(world)))
    torch.testing.assert_close(_ragged(scalar, mesh, one_hot).full_tensor(), scalar)
    vec = _dense(1, (12,))
    units = tuple(range(world)) if world > 1 else (1,)
    pl = RaggedShard((0,), units) if 12 % sum(units) == 0 else RaggedShard((0,), (1,) * world)
    torch.testing.assert_close(_ragged(vec, mesh, pl).full_tensor(), vec)
    return True


def _body_redistribute_pairs():
    mesh, world, rank = _setup()
    full = _dense()
    layouts = _layouts(world)
    shards = [Shard(0), Shard(1), Shard(2), Shard(-1)]
    for src in layouts:
        dt = _ragged(full, mesh, src)
        for dst in layouts + shards:
            out = dt.redistribute(mesh, [dst])
            norm = Shard(dst.dim % full.dim()) if isinstance(dst, Shard) else dst
            assert out.placements == (norm,), (src, dst, out.placements)
            torch.testing.assert_close(out.to_local(), expected_local(full, norm, rank, world),
                                       rtol=0, atol=0, msg=f"{src} -> {dst}")
            torch.testing.assert_close(out.full_tensor(), full, rtol=0, atol=0)
            back = out.redistribute(mesh, [src])
            torch.testing.assert_close(back.to_local(), dt.to_local(), rtol=0, atol=0,
                                       msg=f"{dst} -> {src}")
    for dst in layouts:
        rep = DTensor.from_local(full, mesh, [Replicate()], run_check=False)
        torch.testing.assert_close(rep.redistribute(mesh, [dst]).to_local(),
                                   expected_local(full, dst, rank, world), rtol=0, atol=0)
        for sh in shards:
            sdt = rep.redistribute(mesh, [sh])
            torch.testing.assert_close(sdt.redistribute(mesh, [dst]).to_local(),
                                       expected_local(full, dst, rank, world), rtol=0, atol=0)
    return True


def _body_partial_to_ragged():
    mesh, world, rank = _setup()
    parts = [_dense(10 + r) for r in range(world)]  # rank r's pending value
    refs = {"sum": sum(parts), "avg": sum(parts) / world,
            "max": torch.stack(parts).amax(0), "min": torch.stack(parts).amin(0)}
    for op, ref in refs.items():
        for dst in _layouts(world):
            pdt = DTensor.from_local(parts[rank], mesh, [Partial(op)], run_check=False)
            out = pdt.redistribute(mesh, [dst])
            assert out.placements == (dst,)
            torch.testing.assert_close(out.to_local(), expected_local(ref, dst, rank, world))
    return True


def _body_grads():
    """Gradients come back through redistribute with the original RaggedShard placement."""
    mesh, world, rank = _setup()
    full = _dense()
    weight = _dense(99)
    layouts = _layouts(world)
    targets = layouts + [Shard(0), Shard(1), Shard(2), Replicate()]
    for src in layouts:
        for dst in targets:
            # a leaf DTensor: its .grad is a DTensor whose placement we can check
            leaf = _ragged(full, mesh, src).detach().requires_grad_()
            out = leaf.redistribute(mesh, [dst])
            (out.full_tensor() * weight).sum().backward()
            assert isinstance(leaf.grad, DTensor) and leaf.grad.placements == (src,), dst
            torch.testing.assert_close(leaf.grad.to_local(),
                                       expected_local(weight, src, rank, world), rtol=0, atol=0)
        # through from_local: the plain local tensor gets the plain local gradient
        start, end = src.local_range(full.shape, rank)
        leaf_local = full.reshape(-1)[start:end].clone().requires_grad_()
        dt = ragged_from_local(leaf_local, mesh, src, full.shape)
        (dt.redistribute(mesh, [Shard(1)]).to_local() * 3).sum().backward()
        torch.testing.assert_close(leaf_local.grad, torch.full_like(leaf_local, 3.0))
        leaf_local.grad = None
        (dt.to_local() ** 2).sum().backward()  # to_local's backward on a RaggedShard spec
        torch.testing.assert_close(leaf_local.grad, 2 * leaf_local.detach())
    # Partial -> RaggedShard: each rank's partial input receives the full gradient
    part = _dense(7).requires_grad_()
    pdt = DTensor.from_local(part, mesh, [Partial()], run_check=False)
    (pdt.redistribute(mesh, [layouts[1]]).full_tensor() * weight).sum().backward()
    torch.testing.assert_close(part.grad, weight)
    # Replicate -> RaggedShard: the replicated input's gradient is the dense gradient
    rep_in = full.clone().requires_grad_()
    rdt = DTensor.from_local(rep_in, mesh, [Replicate()], run_check=False)
    out = rdt.redistribute(mesh, [layouts[0]])
    (out.full_tensor() * weight).sum().backward()
    torch.testing.assert_close(rep_in.grad, weight)
    return True


def _body_collectives():
    """Which collective each path uses, and how many."""
    mesh, world, rank = _setup()
    full = _dense()
    ragged_a = RaggedShard((0, 1), {1: (5,), 2: (3, 2), 3: (1, 3, 1), 4: (2, 0, 1, 2)}[world])
    ragged_b = RaggedShard((0,), {1: (1,), 2: (1, 2), 3: (1, 0, 2), 4: (1, 1, 0, 1)}[world])
    one_hot = RaggedShard((), tuple(1 if r == 0 else 0 for r in range(world)))
    dt = _ragged(full, mesh, ragged_a)
    seen = {}
    cases = {
        "ragged->ragged": lambda: dt.redistribute(mesh, [ragged_b]),
        "ragged->same ranges": lambda: _ragged(full, mesh, RaggedShard((0,), (6,) + (0,) *
                                                                     (world - 1)))
        .redistribute(mesh, [RaggedShard((0, 1), (30,) + (0,) * (world - 1))]),
        "ragged->replicate": lambda: dt.redistribute(mesh, [Replicate()]),
        "one_hot->replicate": lambda: _ragged(full, mesh, one_hot).redistribute(
            mesh, [Replicate()]),
        "ragged->shard0": lambda: dt.redistribute(mesh, [Shard(0)]),
        "ragged->shard1": lambda: dt.redistribute(mesh, [Shard(1)]),
        "replicate->ragged": lambda: DTensor.from_local(
            full, mesh, [Replicate()], run_check=False).redistribute(mesh, [ragged_a]),
        "partial->ragged": lambda: DTensor.from_local(
            full, mesh, [Partial()], run_check=False).redistribute(mesh, [ragged_a]),
    }
    for name, fn in cases.items():
        with count_collectives() as counts:
            fn()
        seen[name] = dict(counts)
    return seen


def _body_errors():
    mesh, world, rank = _setup()
    full = _dense()
    pl = RaggedShard((0,), (1,) * world if 6 % world == 0 else (1,) * (world - 1) + (3,))
    pl.validate(SHAPE, world)
    start, end = pl.local_range(SHAPE, rank)
    errors = {}
    for name, fn in {
        "too_long": lambda: ragged_from_local(torch.zeros(end - start + 1), mesh, pl, SHAPE),
        "not_flat": lambda: ragged_from_local(full.reshape(-1)[start:end].view(1, -1),
                                              mesh, pl, SHAPE),
        "units_len": lambda: ragged_from_local(full.reshape(-1)[start:end], mesh,
                                               RaggedShard((0,), (1,) * (world + 1)), SHAPE),
        "not_divide": lambda: ragged_from_local(full.reshape(-1)[start:end], mesh,
                                                RaggedShard((0,), (4,) + (0,) * (world - 1)),
                                                SHAPE),
        # torch's own from_local does not check; the first redistribution does
        "torch_from_local": lambda: DTensor.from_local(
            torch.zeros(end - start + 1), mesh, [pl], shape=full.shape,
            stride=full.stride()).full_tensor(),
    }.items():
        try:
            fn()
        except ValueError as e:
            errors[name] = str(e)
        else:
            errors[name] = None
    if world == 4:
        mesh2 = init_device_mesh("cpu", (2, 2))
        try:  # a bare RaggedShard is a 1-D placement (design note [ragged-nd])
            ragged_from_local(full.reshape(-1)[:0], mesh2, RaggedShard((0,), (1, 1)), SHAPE)
        except ValueError as e:
            errors["mesh2d"] = str(e)
        try:  # one ragged dim only
            ragged_from_local(full.reshape(-1)[:0], mesh2, [RaggedShard((0,), (1, 1))] * 2,
                              SHAPE)
        except NotImplementedError as e:
            errors["mesh2d_two_ragged"] = str(e)
    return errors


# -- tests ------------------------------------------------------------------------------------------
WORLDS = [1, 2, 3, 4]


@pytest.mark.parametrize("world", WORLDS)
def test_from_local_and_full_tensor(worlds, world):
    assert all(worlds(world).run(_body_from_local_full_tensor))


@pytest.mark.parametrize("world", WORLDS)
def test_redistribute_every_pair(worlds, world):
    assert all(worlds(world).run(_body_redistribute_pairs))


@pytest.mark.parametrize("world", WORLDS)
def test_partial_to_ragged(worlds, world):
    assert all(worlds(world).run(_body_partial_to_ragged))


@pytest.mark.parametrize("world", WORLDS)
def test_gradients_flow_back_with_the_original_placement(worlds, world):
    assert all(worlds(world).run(_body_grads))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_path_uses_the_intended_collective(worlds, world):
    seen = worlds(world).run(_body_collectives)[0]
    assert seen["ragged->ragged"] == {"all_to_all_single": 1}
    assert seen["ragged->same ranges"] == {}  # nothing changes owner: no communication
    gathers = seen["ragged->replicate"]
    assert sum(gathers.values()) == 1 and set(gathers) <= {"all_gather_single",
                                                            "all_gather_into_tensor"}
    assert seen["one_hot->replicate"] == {"broadcast": 1}
    assert seen["ragged->shard0"] == {"all_to_all_single": 1}
    assert seen["ragged->shard1"] == {"all_to_all_single": 1}
    assert seen["replicate->ragged"] == {}
    assert seen["partial->ragged"] == {"reduce_scatter": 1}  # never an all-reduce


@pytest.mark.parametrize("world", [1, 3, 4])
def test_bad_input_raises_clear_errors(worlds, world):
    errors = worlds(world).run(_body_errors)[0]
    assert "expects a flat 1-D local tensor of" in errors["too_long"]
    assert "got shape" in errors["not_flat"]
    assert "entries but the mesh dimension has" in errors["units_len"]
    assert "must divide P=6" in errors["not_divide"]
    assert errors["torch_from_local"] is not None and "ragged_from_local" in \
        errors["torch_from_local"]
    if world == 4:
        assert "(Replicate(), RaggedShard(...))" in errors["mesh2d"]
        assert "exactly one RaggedShard" in errors["mesh2d_two_ragged"]


def _body_profiler_labels():
    """The names under ``vescale::`` in a profiler trace of a redistribution and a norm."""
    mesh, world, rank = _setup()
    dt = _ragged(_dense(), mesh, RaggedShard((0,), (1, 2)))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dt.redistribute(mesh, [Replicate()])
        torch.linalg.vector_norm(dt)
    return sorted({e.name for e in prof.events() if e.name.startswith("vescale::")})


def test_profiler_trace_shows_ragged_collectives(worlds):
    assert worlds(2).run(_body_profiler_labels) == [
        ["vescale::ragged_redistribute", "vescale::ragged_reduce"]] * 2


def test_install_is_idempotent_and_reaches_every_binding():
    from torch.distributed.tensor import _api, _dispatch, _redistribute

    before = (_redistribute.redistribute_local_tensor, _api._ToTorchTensor,
              DTensor.__create_chunk_list__)
    install()
    install()
    assert (_redistribute.redistribute_local_tensor, _api._ToTorchTensor,
            DTensor.__create_chunk_list__) == before
    wrapped = _redistribute.redistribute_local_tensor
    assert _api.redistribute_local_tensor is wrapped or (
        _api.redistribute_local_tensor.__wrapped__ is wrapped.__wrapped__)
    assert _dispatch.redistribute_local_tensor.__wrapped__ is wrapped.__wrapped__
    assert not hasattr(wrapped.__wrapped__, "__wrapped__")  # wrapped exactly once


def test_layouts_cover_zero_and_one_hot():
    for world in WORLDS:
        layouts = _layouts(world)
        assert any(pl.is_one_hot for pl in layouts)
        if world > 1:
            assert any(0 in pl.local_units and not pl.is_one_hot for pl in layouts) or world == 2
        assert all(math.prod(SHAPE[: len(pl.dims)]) % pl.num_units == 0 for pl in layouts)
