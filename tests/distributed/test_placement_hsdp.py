"""RaggedShard DTensors on a 2-D (replicate, shard) mesh: HSDP's ``(Replicate(), RaggedShard)``.

Design note [ragged-nd]: the local tensor depends only on the rank's coordinate on the ragged
mesh dim, so everything (redistribution and its autograd, element-wise ops, reductions, random
fills, ``distribute_tensor``, DCP) must give (a) the values the same op gives on the full tensor
in one process and (b) the local tensors a 1-D mesh of the shard size gives (each replica's
``mesh["dp_shard"]`` sub-mesh). World 4 = a 2 x 2 mesh; rank ``(i, j)`` = global ``2 i + j``.
The references are built with plain torch indexing from seeded dense tensors, never with the
code under test.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
import torch.distributed.tensor as dtensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from lightning_vescale.placement import (
    RaggedShard,
    flat_range_to_boxes,
    ragged_from_local,
    ragged_ranges,
)
from tests.distributed._ragged_helpers import count_collectives, expected_local

SHAPE = (6, 5, 3)
R = Replicate()
#: Ragged layouts of SHAPE on a shard dim of 2 ranks: uneven, units inside rows, elements,
#: one-hot (both owners), a zero-unit rank.
LAYOUTS = [RaggedShard((0,), (1, 5)), RaggedShard((0, 1), (2, 3)),
           RaggedShard((0, 1, 2), (4, 5)), RaggedShard((), (1, 0)), RaggedShard((), (0, 1)),
           RaggedShard((0,), (0, 2))]
SHARDS = [Shard(0), Shard(1), Shard(2)]


def _dense(seed: int = 0, shape=SHAPE) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _mesh2d():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))


def _expect(full: torch.Tensor, pl, j: int, n: int = 2) -> torch.Tensor:
    """Shard-rank ``j``'s local tensor of ``full`` under ``pl`` (plain slicing / chunking)."""
    return expected_local(full, pl, j, n)


def _rs(full: torch.Tensor, mesh, pl: RaggedShard, requires_grad: bool = False) -> DTensor:
    """``(Replicate(), pl)`` (2-D) or ``(pl,)`` (1-D) DTensor of ``full``."""
    dim = mesh.ndim - 1
    local = _expect(full, pl, mesh.get_local_rank(dim)).clone().requires_grad_(requires_grad)
    placements = (R,) * dim + (pl,)
    return ragged_from_local(local, mesh, placements, full.shape)


# -- bodies (run on every rank of the 2 x 2 world) -------------------------------------------------
def _body_redistribute():
    mesh = _mesh2d()
    sub = mesh["dp_shard"]  # this replica's 1-D mesh of the shard dim: the 1-D reference
    j = mesh.get_local_rank(1)
    full = _dense()
    for src in LAYOUTS:
        dt = _rs(full, mesh, src)
        assert dt.placements == (R, src)
        torch.testing.assert_close(dt.full_tensor(), full, rtol=0, atol=0)
        rep = dt.redistribute(mesh, [R, R])
        assert rep.placements == (R, R)
        torch.testing.assert_close(rep.to_local(), full, rtol=0, atol=0)
        one_d = _rs(full, sub, src)
        for dst in LAYOUTS + SHARDS:
            out = dt.redistribute(mesh, [R, dst])
            assert out.placements == (R, dst), (src, dst)
            torch.testing.assert_close(out.to_local(), _expect(full, dst, j), rtol=0, atol=0,
                                       msg=f"{src} -> {dst}")
            # the same local tensors as the 1-D redistribution on the shard dim
            torch.testing.assert_close(out.to_local(), one_d.redistribute(sub, [dst]).to_local(),
                                       rtol=0, atol=0)
            torch.testing.assert_close(out.full_tensor(), full, rtol=0, atol=0)
            back = out.redistribute(mesh, [R, src])
            torch.testing.assert_close(back.to_local(), dt.to_local(), rtol=0, atol=0,
                                       msg=f"{dst} -> {src}")
    for dst in LAYOUTS:  # (R, R) -> (R, RS) and (R, Shard(d)) -> (R, RS)
        rep = DTensor.from_local(full, mesh, [R, R], run_check=False)
        torch.testing.assert_close(rep.redistribute(mesh, [R, dst]).to_local(),
                                   _expect(full, dst, j), rtol=0, atol=0)
        for sh in SHARDS:
            sdt = rep.redistribute(mesh, [R, sh])
            torch.testing.assert_close(sdt.redistribute(mesh, [R, dst]).to_local(),
                                       _expect(full, dst, j), rtol=0, atol=0)
    return True


def _body_partial_to_ragged():
    mesh = _mesh2d()
    j = mesh.get_local_rank(1)
    parts = [_dense(10 + q) for q in range(2)]  # shard-rank q's pending value (same on replicas)
    refs = {"sum": parts[0] + parts[1], "avg": (parts[0] + parts[1]) / 2,
            "max": torch.maximum(*parts), "min": torch.minimum(*parts)}
    for op, ref in refs.items():
        for dst in LAYOUTS:
            pdt = DTensor.from_local(parts[j], mesh, [R, Partial(op)], run_check=False)
            with count_collectives(by_group_size=True) as counts:
                out = pdt.redistribute(mesh, [R, dst])
            assert out.placements == (R, dst)
            assert set(counts) == {("reduce_scatter", 2)}, counts  # inside the shard group
            torch.testing.assert_close(out.to_local(), _expect(ref, dst, j))
    return True


def _body_collectives_in_shard_group():
    """Each path runs one collective, in the shard dim's group (size 2), never across replicas."""
    mesh = _mesh2d()
    full = _dense()
    dt = _rs(full, mesh, LAYOUTS[1])
    expected = {
        (R, R): {("all_gather_single", 2): 1},
        (R, LAYOUTS[0]): {("all_to_all_single", 2): 1},
        (R, Shard(1)): {("all_to_all_single", 2): 1},
    }
    out = {}
    for target, want in expected.items():
        with count_collectives(by_group_size=True) as counts:
            dt.redistribute(mesh, list(target))
        out[str(target)] = dict(counts)
        assert dict(counts) == want, (target, dict(counts))
    one_hot = _rs(full, mesh, LAYOUTS[4])
    with count_collectives(by_group_size=True) as counts:
        one_hot.full_tensor()
    assert dict(counts) == {("broadcast", 2): 1}, dict(counts)
    return out


def _body_unsupported():
    mesh = _mesh2d()
    full = _dense()
    dt = _rs(full, mesh, LAYOUTS[0])
    messages = []
    for target in ([Shard(0), LAYOUTS[0]], [Shard(0), R], [LAYOUTS[0], R]):
        with pytest.raises(NotImplementedError, match="Replicate") as err:
            dt.redistribute(mesh, target)
        messages.append(str(err.value))
    # a Partial on the replicate dim beside a ragged dim (only buildable by hand)
    pdt = DTensor.from_local(dt.to_local(), mesh, [Partial(), LAYOUTS[0]], run_check=False,
                             shape=torch.Size(SHAPE), stride=full.stride())
    with pytest.raises(NotImplementedError, match="Replicate") as err:
        pdt.redistribute(mesh, [R, R])
    messages.append(str(err.value))
    # a Shard on the replicate dim as the *source* of a ragged target
    sdt = DTensor.from_local(full, mesh, [R, R], run_check=False).redistribute(mesh, [Shard(0), R])
    with pytest.raises(NotImplementedError, match="RaggedShard redistribution"):
        sdt.redistribute(mesh, [R, LAYOUTS[0]])
    # one ragged dim only; the bare-placement form is for 1-D meshes
    with pytest.raises(NotImplementedError, match="exactly one RaggedShard"):
        ragged_from_local(torch.zeros(0), mesh, [LAYOUTS[0], LAYOUTS[0]], SHAPE, check=True)
    return messages


def _body_grads():
    """Gradients come back through redistribute / full_tensor to (R, RS) with exact values."""
    mesh = _mesh2d()
    j = mesh.get_local_rank(1)
    full, weight = _dense(), _dense(99)
    for src in LAYOUTS:
        for dst in LAYOUTS[:3] + SHARDS + [R]:
            leaf = _rs(full, mesh, src).detach().requires_grad_()
            (leaf.redistribute(mesh, [R, dst]).full_tensor() * weight).sum().backward()
            assert isinstance(leaf.grad, DTensor) and leaf.grad.placements == (R, src), dst
            torch.testing.assert_close(leaf.grad.to_local(), _expect(weight, src, j),
                                       rtol=0, atol=0)
        # through ragged_from_local: the plain local tensor gets its plain local gradient
        leaf_local = _expect(full, src, j).clone().requires_grad_()
        dt = ragged_from_local(leaf_local, mesh, (R, src), SHAPE)
        (dt.redistribute(mesh, [R, Shard(1)]).to_local() * 3).sum().backward()
        torch.testing.assert_close(leaf_local.grad, torch.full_like(leaf_local, 3.0))
        leaf_local.grad = None
        (dt.to_local() ** 2).sum().backward()  # to_local's backward (E2) on (R, RS)
        torch.testing.assert_close(leaf_local.grad, 2 * leaf_local.detach())
        leaf_local.grad = None
        (dt.full_tensor() * weight).sum().backward()
        torch.testing.assert_close(leaf_local.grad, _expect(weight, src, j))
    # (R, Partial) -> (R, RS) and its backward ((R, RS) -> (R, Partial))
    part = _dense(7).requires_grad_()
    pdt = DTensor.from_local(part, mesh, [R, Partial()], run_check=False)
    (pdt.redistribute(mesh, [R, LAYOUTS[1]]).full_tensor() * weight).sum().backward()
    torch.testing.assert_close(part.grad, weight)
    # (R, R) -> (R, RS): the replicated input's gradient is the dense gradient
    rep_in = full.clone().requires_grad_()
    rdt = DTensor.from_local(rep_in, mesh, [R, R], run_check=False)
    (rdt.redistribute(mesh, [R, LAYOUTS[0]]).full_tensor() * weight).sum().backward()
    torch.testing.assert_close(rep_in.grad, weight)
    return True


def _body_elementwise_and_foreach():
    mesh = _mesh2d()
    sub = mesh["dp_shard"]
    a_full, b_full = _dense(1), _dense(2)
    results = []
    for pl in LAYOUTS[:3]:
        a, b = _rs(a_full, mesh, pl), _rs(b_full, mesh, pl)
        out = a * b + 1
        assert out.placements == (R, pl)
        torch.testing.assert_close(out.full_tensor(), a_full * b_full + 1)
        one_d = _rs(a_full, sub, pl) * _rs(b_full, sub, pl) + 1
        torch.testing.assert_close(out.to_local(), one_d.to_local(), rtol=0, atol=0)
        scalar = DTensor.from_local(torch.tensor(2.5), mesh, [R, R], run_check=False)
        torch.testing.assert_close((a * scalar).full_tensor(), a_full * 2.5)
        xs = [_rs(a_full, mesh, pl), _rs(b_full, mesh, pl)]
        torch._foreach_mul_(xs, 3.0)
        torch._foreach_add_(xs, [_rs(b_full, mesh, pl), _rs(a_full, mesh, pl)], alpha=2.0)
        for x, ref in zip(xs, (3 * a_full + 2 * b_full, 3 * b_full + 2 * a_full)):
            assert x.placements == (R, pl)
            torch.testing.assert_close(x.full_tensor(), ref)
        results.append(True)
    with pytest.raises(ValueError, match="same global shape, stride and placement"):
        _rs(a_full, mesh, LAYOUTS[0]) + _rs(b_full, mesh, LAYOUTS[1])
    # copy_ from another layout of the same tensor: (R, R), (R, Shard), (R, RS')
    rep = DTensor.from_local(b_full, mesh, [R, R], run_check=False)
    for src in (rep, rep.redistribute(mesh, [R, Shard(1)]), _rs(b_full, mesh, LAYOUTS[2])):
        dst = _rs(a_full, mesh, LAYOUTS[1])
        local = dst._local_tensor
        dst.copy_(src)
        assert dst._local_tensor is local and dst.placements == (R, LAYOUTS[1])
        torch.testing.assert_close(dst.full_tensor(), b_full, rtol=0, atol=0)
    # an optimizer step (foreach and fused) on (R, RS) parameters = the dense step
    for kw in ({"foreach": True}, {"fused": True}, {"foreach": False}):
        dense = [a_full.clone().requires_grad_(), _dense(3, (7,)).requires_grad_()]
        layouts = [LAYOUTS[1], RaggedShard((0,), (4, 3))]
        params = [torch.nn.Parameter(_rs(p.detach(), mesh, pl)) for p, pl in zip(dense, layouts)]
        grads = [_dense(20), _dense(21, (7,))]
        for p, d, g, pl in zip(params, dense, grads, layouts):
            d.grad = g.clone()
            p.grad = _rs(g, mesh, pl)
        opt_d = torch.optim.AdamW(dense, lr=0.1, weight_decay=0.1, **kw)
        opt_s = torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, **kw)
        for _ in range(2):
            opt_d.step()
            opt_s.step()
        for p, d in zip(params, dense):
            assert p.placements == (R, p.placements[1])
            torch.testing.assert_close(p.full_tensor(), d.detach(), rtol=1e-6, atol=1e-6)
    return results


def _body_reductions():
    mesh = _mesh2d()
    sub = mesh["dp_shard"]
    full = _dense(5)
    full[0, 0, 0] = 4.0  # a unique extremum
    for pl in LAYOUTS:
        x = _rs(full, mesh, pl)
        x1 = _rs(full, sub, pl)
        cases = {
            "sum": (lambda t: t.sum(), full.sum()),
            "mean": (lambda t: t.mean(), full.mean()),
            "amax": (lambda t: t.amax(), full.amax()),
            "amin": (lambda t: t.min(), full.min()),
            "norm2": (lambda t: torch.linalg.vector_norm(t), torch.linalg.vector_norm(full)),
            "norm1": (lambda t: torch.linalg.vector_norm(t, 1), full.abs().sum()),
            "norminf": (lambda t: torch.linalg.vector_norm(t, math.inf), full.abs().amax()),
            "sum_dim1": (lambda t: t.sum(dim=1), full.sum(dim=1)),
            "norm_dim2": (lambda t: torch.linalg.vector_norm(t, dim=(0, 2)),
                          torch.linalg.vector_norm(full, dim=(0, 2))),
            "amax_dim0": (lambda t: t.amax(dim=0, keepdim=True), full.amax(dim=0, keepdim=True)),
        }
        for name, (fn, ref) in cases.items():
            with count_collectives(by_group_size=True) as counts:
                out = fn(x)
            assert out.placements == (R, R), name
            # only the shard group communicates: each element is counted once, not per replica
            assert all(size == 2 for _, size in counts), (name, counts)
            torch.testing.assert_close(out.to_local(), ref, msg=name)
            torch.testing.assert_close(out.to_local(), fn(x1).to_local(), rtol=0, atol=0)
        norms = torch._foreach_norm([x, _rs(full * 2, mesh, pl)])
        torch.testing.assert_close(torch.stack([n.to_local() for n in norms]),
                                   torch.stack([full.norm(), (2 * full).norm()]))
    return True


def _body_clip_grad_norm(foreach: bool):
    """clip_grad_norm_ on (R, RS) gradients: the norm of the full gradient, clipped like dense."""
    mesh = _mesh2d()
    layouts = [LAYOUTS[0], LAYOUTS[2], RaggedShard((0,), (3, 1))]
    shapes = [SHAPE, SHAPE, (4, 2)]
    dense_grads = [_dense(40 + k, s) for k, s in enumerate(shapes)]
    dense = [torch.zeros(s, requires_grad=True) for s in shapes]
    for d, g in zip(dense, dense_grads):
        d.grad = g.clone()
    params = []
    for s, pl, g in zip(shapes, layouts, dense_grads):
        p = torch.nn.Parameter(_rs(torch.zeros(s), mesh, pl))
        p.grad = _rs(g, mesh, pl)
        params.append(p)
    ref = torch.nn.utils.clip_grad_norm_(dense, max_norm=0.5, foreach=foreach)
    total = torch.nn.utils.clip_grad_norm_(params, max_norm=0.5, foreach=foreach)
    total = total.full_tensor() if isinstance(total, DTensor) else total
    torch.testing.assert_close(total, ref)
    for p, d in zip(params, dense):
        torch.testing.assert_close(p.grad.full_tensor(), d.grad)
    return float(total)


def _body_random():
    mesh = _mesh2d()
    sub = mesh["dp_shard"]
    j = mesh.get_local_rank(1)
    for pl in LAYOUTS[:4]:
        x = _rs(torch.zeros(SHAPE), mesh, pl)
        torch.manual_seed(3)
        x.normal_(0.0, 2.0)
        after_2d = torch.rand(3)
        torch.manual_seed(3)
        ref = torch.empty(SHAPE).normal_(0.0, 2.0)
        assert torch.equal(torch.rand(3), after_2d)  # the generator advanced as single-device
        torch.testing.assert_close(x.to_local(), _expect(ref, pl, j), rtol=0, atol=0)
        x1 = _rs(torch.zeros(SHAPE), sub, pl)
        torch.manual_seed(3)
        x1.normal_(0.0, 2.0)
        torch.testing.assert_close(x.to_local(), x1.to_local(), rtol=0, atol=0)
        torch.manual_seed(4)
        y = torch.rand_like(x)
        torch.manual_seed(4)
        assert y.placements == (R, pl)
        torch.testing.assert_close(y.to_local(), _expect(torch.rand(SHAPE), pl, j))
    return True


def _body_distribute_tensor():
    # torch's function, taught in place by install() (a name imported before lightning_vescale
    # works too: test_ragged_import_order.py; design note [ragged-compat])
    mesh = _mesh2d()
    rank = dist.get_rank()
    j = mesh.get_local_rank(1)
    mine = _dense(100 + rank)  # every rank's "full" differs: shows whose data arrives
    out = []
    for pl in LAYOUTS[:3]:
        # torch's convention: src_data_rank is a rank on each mesh dim, so (s, s) is the source
        for src, source_rank in ((0, 0), (1, 3)):
            before = mine.clone()
            dt = dtensor.distribute_tensor(mine, mesh, [R, pl], src_data_rank=src)
            assert torch.equal(mine, before)  # the caller's tensor is not overwritten
            assert dt.placements == (R, pl)
            torch.testing.assert_close(dt.to_local(), _expect(_dense(100 + source_rank), pl, j),
                                       rtol=0, atol=0)
        dt = dtensor.distribute_tensor(mine, mesh, [R, pl], src_data_rank=None)
        torch.testing.assert_close(dt.to_local(), _expect(mine, pl, j), rtol=0, atol=0)
        # the same as torch's own (Replicate, Shard) placements would read: compare full values
        # (on a clone: torch's Replicate broadcasts into the caller's tensor)
        ref = dtensor.distribute_tensor(mine.clone(), mesh, [R, Shard(0)],
                                        src_data_rank=1).full_tensor()
        torch.testing.assert_close(
            dtensor.distribute_tensor(mine, mesh, [R, pl], src_data_rank=1).full_tensor(), ref)
        out.append(True)
    with pytest.raises(NotImplementedError, match="exactly one RaggedShard"):
        dtensor.distribute_tensor(mine, mesh, [Shard(0), LAYOUTS[0]])
    return out


def _body_distribute_tensors():
    """set_model_state_dict's helper: full tensors cut into (R, RS) locals, in place."""
    from torch.distributed import _state_dict_utils

    mesh = _mesh2d()
    j = mesh.get_local_rank(1)
    full = _dense(8)
    dt = _rs(torch.zeros(SHAPE), mesh, LAYOUTS[1])
    local_before = dt._local_tensor
    sd = {"w": (dt, full.clone())}
    _state_dict_utils._distribute_tensors(sd, ["w"], torch.device("cpu"))
    assert sd["w"] is dt and dt._local_tensor is local_before
    torch.testing.assert_close(dt.to_local(), _expect(full, LAYOUTS[1], j), rtol=0, atol=0)
    return True


def _body_ragged_on_dim0():
    """The ragged dim need not be the last: (RaggedShard, Replicate()) on the same 2 x 2 mesh
    acts in the dim-0 groups (ranks {j, 2 + j})."""
    mesh = _mesh2d()
    i = mesh.get_local_rank(0)
    full = _dense(11)
    pl = LAYOUTS[1]
    dt = ragged_from_local(_expect(full, pl, i).clone(), mesh, (pl, R), SHAPE)
    torch.testing.assert_close(dt.full_tensor(), full, rtol=0, atol=0)
    out = dt.redistribute(mesh, [Shard(0), R])
    torch.testing.assert_close(out.to_local(), _expect(full, Shard(0), i), rtol=0, atol=0)
    back = out.redistribute(mesh, [LAYOUTS[0], R])
    torch.testing.assert_close(back.to_local(), _expect(full, LAYOUTS[0], i), rtol=0, atol=0)
    with count_collectives(by_group_size=True) as counts:
        norm = torch.linalg.vector_norm(dt)
    assert norm.placements == (R, R) and set(counts) == {("all_reduce", 2)}
    torch.testing.assert_close(norm.to_local(), full.norm())
    torch.testing.assert_close((dt * 2).full_tensor(), full * 2)
    return True


# -- distributed checkpoint ------------------------------------------------------------------------
CKPT_SHAPES = {"w": (6, 5, 3), "v": (10,), "s": (), "m": (4, 3)}


def _ckpt_dense(name: str) -> torch.Tensor:
    return torch.randn(CKPT_SHAPES[name], generator=torch.Generator().manual_seed(len(name) * 7
                                                                                + ord(name)))


def _ckpt_layouts(n: int, variant: int) -> dict[str, RaggedShard]:
    """Ragged layouts of CKPT_SHAPES on ``n`` shard ranks (two variants per size)."""
    table = {
        (2, 0): {"w": ((0,), (1, 5)), "v": ((0,), (7, 3)), "s": ((), (0, 1)),
                 "m": ((0,), (0, 1))},
        (2, 1): {"w": ((0, 1), (3, 2)), "v": ((0,), (1, 1)), "s": ((), (1, 0)),
                 "m": ((0,), (3, 1))},
        (4, 0): {"w": ((0, 1), (2, 0, 1, 2)), "v": ((0,), (1, 4, 0, 5)),
                 "s": ((), (0, 0, 1, 0)), "m": ((0,), (1, 1, 1, 1))},
    }[(n, variant)]
    return {k: RaggedShard(*v) for k, v in table.items()}


def _ckpt_state(mesh, variant: int, fill: bool) -> dict[str, DTensor]:
    n = mesh.size(mesh.ndim - 1)
    out = {}
    for name, pl in _ckpt_layouts(n, variant).items():
        full = _ckpt_dense(name) if fill else torch.zeros(CKPT_SHAPES[name])
        out[name] = _rs(full, mesh, pl)
    return out


def _mesh_of(kind: str):
    return _mesh2d() if kind == "2d" else init_device_mesh("cpu", (dist.get_world_size(),))


def _ckpt_save(path: str, kind: str, variant: int) -> None:
    dcp.save(_ckpt_state(_mesh_of(kind), variant, fill=True),
             storage_writer=dcp.FileSystemWriter(path))


def _ckpt_load(path: str, kind: str, variant: int) -> dict[str, torch.Tensor]:
    mesh = _mesh_of(kind)
    state = _ckpt_state(mesh, variant, fill=False)
    locals_before = {k: v._local_tensor for k, v in state.items()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    out = {}
    for name, value in state.items():
        assert value._local_tensor is locals_before[name]  # loaded in place
        n = mesh.size(mesh.ndim - 1)
        j = mesh.get_local_rank(mesh.ndim - 1)
        torch.testing.assert_close(value.to_local(),
                                   _expect(_ckpt_dense(name), value.placements[-1], j, n),
                                   rtol=0, atol=0)
        out[name] = value.full_tensor()
    return out


def _assert_ckpt(results) -> None:
    for per_rank in results:
        for name, value in per_rank.items():
            torch.testing.assert_close(value, _ckpt_dense(name), rtol=0, atol=0)


def _chunks(path: str) -> dict[str, list]:
    md = dcp.FileSystemReader(path).read_metadata()
    return {name: sorted((tuple(c.offsets), tuple(c.sizes))
                         for c in md.state_dict_metadata[name].chunks) for name in CKPT_SHAPES}


# -- tests -----------------------------------------------------------------------------------------
def test_redistribute_2d(worlds):
    assert worlds(4).run(_body_redistribute) == [True] * 4


def test_partial_to_ragged_2d(worlds):
    assert worlds(4).run(_body_partial_to_ragged) == [True] * 4


def test_collectives_stay_in_the_shard_group(worlds):
    worlds(4).run(_body_collectives_in_shard_group)


def test_ragged_dim_0_of_a_2d_mesh(worlds):
    assert worlds(4).run(_body_ragged_on_dim0) == [True] * 4


def test_unsupported_pairs_raise(worlds):
    messages = worlds(4).run(_body_unsupported)[0]
    assert all("Redistribute in steps" in m for m in messages), messages


def test_autograd_2d(worlds):
    assert worlds(4).run(_body_grads) == [True] * 4


def test_elementwise_foreach_and_optimizer_2d(worlds):
    worlds(4).run(_body_elementwise_and_foreach)


def test_reductions_2d(worlds):
    assert worlds(4).run(_body_reductions) == [True] * 4


@pytest.mark.parametrize("foreach", [False, True])
def test_clip_grad_norm_counts_each_element_once(worlds, foreach):
    totals = worlds(4).run(_body_clip_grad_norm, foreach)
    assert len(set(totals)) == 1


def test_random_fills_2d(worlds):
    assert worlds(4).run(_body_random) == [True] * 4


def test_distribute_tensor_2d(worlds):
    worlds(4).run(_body_distribute_tensor)
    assert worlds(4).run(_body_distribute_tensors) == [True] * 4


def test_dcp_round_trip_2d_and_dedup(worlds, tmp_path):
    path = str(tmp_path / "ckpt2d")
    worlds(4).run(_ckpt_save, path, "2d", 0)
    # replicas wrote identical items: each box is stored once (the shard layout's boxes)
    expected = {
        name: sorted((tuple(o), tuple(s)) for a, b in ragged_ranges(CKPT_SHAPES[name], pl)
                     for o, s in flat_range_to_boxes(CKPT_SHAPES[name], a, b))
        for name, pl in _ckpt_layouts(2, 0).items()
    }
    assert _chunks(path) == expected
    _assert_ckpt(worlds(4).run(_ckpt_load, path, "2d", 0))
    _assert_ckpt(worlds(4).run(_ckpt_load, path, "2d", 1))   # another ragged layout


def test_dcp_2d_save_loads_on_1d_meshes_and_back(worlds, tmp_path):
    path = str(tmp_path / "ckpt2d")
    worlds(4).run(_ckpt_save, path, "2d", 1)
    _assert_ckpt(worlds(4).run(_ckpt_load, path, "1d", 0))   # 1-D mesh of 4
    _assert_ckpt(worlds(2).run(_ckpt_load, path, "1d", 0))   # 1-D mesh of 2
    for kind, world, variant in (("1d", 4, 0), ("1d", 2, 1)):
        path = str(tmp_path / f"ckpt_{kind}{world}")
        worlds(world).run(_ckpt_save, path, kind, variant)
        _assert_ckpt(worlds(4).run(_ckpt_load, path, "2d", 0))
