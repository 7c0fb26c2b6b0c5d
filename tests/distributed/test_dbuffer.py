"""DBuffer (layer 2): in-place collectives on a planned flat buffer, views, memory lifecycle.

References are dense tensors built independently from the shapes; no module code involved.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist

SHAPES = [("a", (5, 3)), ("b", (7,)), ("c", (2, 2, 3)), ("d", ()), ("e", (11, 1))]


def _full_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES}


def _row(shape) -> int:
    """Elements per row: the product of all dims but the first (1 for 0-/1-D)."""
    out = 1
    for d in shape[1:]:
        out *= d
    return out


def _buffer(granularity=1, **kw):
    from lightning_vescale.dbuffer import DBuffer
    from lightning_vescale.planner import plan_layout

    gran = (lambda s: _row(s)) if granularity == "row" else (lambda s: granularity)
    plan = plan_layout([(n, s, gran(s)) for n, s in SHAPES], dist.get_world_size())
    return DBuffer(plan, dtype=torch.float32, device="cpu", **kw)


def _gather_body(async_op):
    buf = _buffer()
    ref = _full_tensors(0)
    for n, t in ref.items():
        buf.load_local_(n, t)
    mem0 = buf.memory_bytes()
    ptr_before = {n: buf.param_view(n).data_ptr() for n in ref}
    h = buf.all_gather(async_op=async_op)
    h.wait()
    h.wait()  # idempotent
    ok = {n: torch.equal(buf.param_view(n), t) for n, t in ref.items()}
    full = buf.full
    inside = all(
        buf.param_view(n).untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
        and buf.param_view(n).data_ptr() == full.data_ptr() + buf.plan.offsets[n] * 4
        for n in ref)
    local_views = all(
        buf.local_view(n).untyped_storage().data_ptr() == buf.shard.untyped_storage().data_ptr()
        for n in ref)
    mem1 = buf.memory_bytes()
    buf.free()
    mem2 = buf.memory_bytes()
    # views survive a free/re-materialise cycle and see the new data
    for n, t in ref.items():
        with torch.no_grad():
            buf.local_view(n).mul_(2)
    buf.all_gather()
    again = {n: torch.equal(buf.param_view(n), 2 * t) for n, t in ref.items()}
    return ok, inside, local_views, mem0, mem1, mem2, again, ptr_before


@pytest.mark.parametrize("world_size,async_op", [(1, False), (2, True), (3, False), (4, True)])
def test_all_gather_in_place(worlds, world_size, async_op):
    for ok, inside, local_views, mem0, mem1, mem2, again, _ in worlds(world_size).run(
            _gather_body, async_op):
        assert all(ok.values()) and all(again.values()), (ok, again)
        assert inside and local_views
        n = mem1["param_shard"] // 4  # S
        assert mem0["param_unsharded"] == 0 and mem2["param_unsharded"] == 0
        assert mem1["param_unsharded"] == 4 * n * world_size


def _reduce_body(op, accumulate, reduce_dtype):
    rank, world = dist.get_rank(), dist.get_world_size()
    buf = _buffer(reduce_dtype=reduce_dtype)
    grads = [_full_tensors(10 + r) for r in range(world)]
    buf.materialize_grad()
    zero_first = all(torch.count_nonzero(buf.grad_view(n)) == 0 for n, _ in SHAPES)
    for n, _ in SHAPES:
        buf.grad_view(n).copy_(grads[rank][n])
    if accumulate:
        buf.reduce_scatter(op=op).wait()
    h = buf.reduce_scatter(async_op=True, op=op, accumulate=accumulate)
    h.wait()
    out = {}
    for n, _ in SHAPES:
        a, b = buf.plan.local_range(n, rank)
        total = sum(g[n] for g in grads)
        want = total / world if op == "avg" else total
        if accumulate:
            want = 2 * want
        out[n] = (buf.grad_local_view(n).clone(), want.reshape(-1)[a:b])
    views = all(buf.grad_local_view(n).untyped_storage().data_ptr()
                == buf.grad_shard.untyped_storage().data_ptr() for n, _ in SHAPES)
    buf.free_grad()
    return out, views, zero_first, buf.memory_bytes()


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("op,accumulate,reduce_dtype",
                         [("avg", False, None), ("sum", True, None),
                          ("avg", False, torch.bfloat16)])
def test_reduce_scatter_in_place(worlds, world_size, op, accumulate, reduce_dtype):
    for out, views, zero_first, mem in worlds(world_size).run(_reduce_body, op, accumulate,
                                                               reduce_dtype):
        assert views and zero_first
        assert mem["grad_unsharded"] == 0 and mem["comm"] == 0
        tol = dict(rtol=2e-2, atol=2e-2) if reduce_dtype is not None else {}
        for n, (got, want) in out.items():
            torch.testing.assert_close(got, want, msg=n, **tol)


def _mixed_body():
    buf = _buffer(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ref = _full_tensors(0)
    for n, t in ref.items():
        buf.load_local_(n, t)
    buf.all_gather()
    gathered = {n: (buf.param_view(n).dtype, torch.equal(buf.param_view(n), t.bfloat16()))
                for n, t in ref.items()}
    return gathered, buf.shard.dtype


def test_low_precision_all_gather(worlds):
    for gathered, shard_dtype in worlds(2).run(_mixed_body):
        assert shard_dtype == torch.float32
        assert all(d == torch.bfloat16 and eq for d, eq in gathered.values()), gathered


def _registry_body():
    from lightning_vescale.dbuffer import DBuffer, live_dbuffers
    from lightning_vescale.planner import plan_layout

    gc.collect()
    before = len(live_dbuffers())
    buf = _buffer()
    during = len(live_dbuffers())
    del buf
    gc.collect()
    after = len(live_dbuffers())
    meta = DBuffer(plan_layout([("x", (4, 4))], dist.get_world_size()), dtype=torch.float32,
                   device="meta")
    try:
        meta.all_gather()
        meta_err = None
    except RuntimeError as e:
        meta_err = str(e)
    try:
        DBuffer(plan_layout([("x", (4,))], dist.get_world_size() + 1), dtype=torch.float32,
                device="cpu")
        size_err = None
    except ValueError as e:
        size_err = str(e)
    return before, during, after, meta_err, size_err


def test_registry_and_errors(worlds):
    before, during, after, meta_err, size_err = worlds(2).run(_registry_body)[0]
    assert during == before + 1 and after == before
    assert meta_err and "meta" in meta_err and "materialize" in meta_err
    assert size_err and "world_size" in size_err


def _granular_body():
    rank = dist.get_rank()
    buf = _buffer(granularity="row")
    out = {}
    for n, s in SHAPES:
        a, b = buf.plan.local_range(n, rank)
        row = _row(s)
        numel = row * (s[0] if s else 1)
        out[n] = (a % row == 0 or a == numel) and (b % row == 0 or b == numel)
        out[n] = out[n] and buf.local_view(n).numel() == b - a
    return out


@pytest.mark.parametrize("world_size", [3, 4])
def test_row_blocks_never_cross_ranks(worlds, world_size):
    for out in worlds(world_size).run(_granular_body):
        assert all(out.values()), out
