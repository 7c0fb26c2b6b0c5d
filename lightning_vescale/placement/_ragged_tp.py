"""``RaggedShard`` beside tensor-parallel placements: ``(RaggedShard, Shard(k))`` and the like.

Design note [ragged-tp]
-----------------------
FSDP over tensor parallelism (design note [fsdp-tp] in ``fsdp/_tp.py``) lays each rank's
*TP-local* tensor out on the data-parallel mesh dim: a DTensor on a ``(dp, tp)`` mesh with
placements ``(RaggedShard, Shard(k))`` (or ``Replicate()`` on tp) whose RaggedShard ranges are
those of the TP-local shape, i.e. of the local shape under the same placements with the ragged
dim read as ``Replicate()``. With HSDP the mesh is ``(dp_replicate, dp_shard, tp)`` and the
placements ``(Replicate(), RaggedShard, Shard(k))``: the Replicate dim is one of the "other
dims" below (torch's step). This is the strided form of FSDP2's ``_StridedShard``: the TP
shard is cut first, the data-parallel split applies inside it. All ranks of one data-parallel
group share the tp coordinate, hence the TP-local shape (uneven TP shards included).

Redistribution (E1 of [ragged-dtensor]) between two specs on such a mesh runs in at most two
steps: the ragged dim to/from ``Replicate()`` over the TP-local shape in that dim's process
group (the 1-D paths of ``_dtensor``), then torch's own redistribution for the other dims, which
never sees a ``RaggedShard``. ``full_tensor()``, ``redistribute`` and their autograd backward
(torch's ``Redistribute`` calls the same function both ways) take this path; a spec pair whose
ragged dim moves, or with two ragged dims, raises ``NotImplementedError``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.profiler import record_function

from lightning_vescale.placement._ragged_shard import RaggedShard, ragged_shard_and_rank

__all__ = ["copy_runs_", "is_tp_layout", "rank_flat_runs", "redistribute_tp", "tp_flat_runs",
           "tp_local_box"]


def _ragged_dims(placements: Sequence[Placement]) -> list[int]:
    return [d for d, p in enumerate(placements) if isinstance(p, RaggedShard)]


def is_tp_layout(src: Sequence[Placement], dst: Sequence[Placement]) -> bool:
    """Whether a redistribution ``src -> dst`` involves a RaggedShard beside a non-Replicate
    placement (the TP form of [ragged-tp]) rather than HSDP's Replicate-only form."""
    if any(p.is_partial() for pl in (src, dst) for p in pl):
        return False  # Partial beside a ragged dim: the N-D path refuses it
    return any(_is_tp(pl) for pl in (src, dst))


def _is_tp(placements: Sequence[Placement]) -> bool:
    """One RaggedShard, before (on a lower mesh dim than) one or more ``Shard``s: the
    data-parallel dims come first, as in FSDP2 + TP's meshes (``(Shard(0), RaggedShard)``
    stays refused by the N-D path)."""
    dims = _ragged_dims(placements)
    shards = [d for d, p in enumerate(placements) if type(p) is Shard]
    return len(dims) == 1 and bool(shards) and min(shards) > dims[0]


def tp_local_box(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement],
                 dim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(local shape, global offset)`` of this rank's TP-local tensor: ``placements`` with the
    ragged mesh dim ``dim`` read as ``Replicate()`` (torch's own shard math)."""
    inner = tuple(Replicate() if d == dim else p for d, p in enumerate(placements))
    local, offset = compute_local_shape_and_global_offset(tuple(shape), mesh, inner)
    return tuple(int(s) for s in local), tuple(int(o) for o in offset)


def tp_flat_runs(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement],
                 dim: int) -> list[tuple[int, int, int]]:
    """This rank's local tensor (its RaggedShard range of its TP-local tensor) as runs of the
    row-major GLOBAL tensor: ``(local offset, global start, global end)`` in local order, each
    run contiguous in both. What writers and readers of full-tensor files (safetensors) need to
    touch only a rank's own bytes: one run for ``Shard(0)``/``Replicate()`` TP placements, one
    per row of the TP-local box for ``Shard(1)``."""
    shape = tuple(int(s) for s in shape)
    region, offset = tp_local_box(shape, mesh, placements, dim)
    ragged = placements[dim]
    assert isinstance(ragged, RaggedShard)
    start, end = ragged.local_range(region, mesh.get_local_rank(dim))
    partial = [i for i, (r, g) in enumerate(zip(region, shape)) if r != g]
    if not partial:  # the TP-local tensor is the whole tensor
        return [(0, start, end)] if end > start else []
    k = partial[-1]  # below it the box holds whole slabs: a run is region[k] of them
    inner = math.prod(shape[k + 1:])
    run = region[k] * inner
    out, pos = [], start
    while pos < end:
        outer, within = divmod(pos, run)
        stop = min(end, (outer + 1) * run)
        g = 0
        for i, idx in enumerate(_unravel(outer, region[:k])):
            g = g * shape[i] + idx + offset[i]
        first = (g * shape[k] + offset[k]) * inner + within
        out.append((pos - start, first, first + stop - pos))
        pos = stop
    return out


def rank_flat_runs(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement],
                   what: str = "RaggedShard") -> list[tuple[int, int, int]]:
    """This rank's local tensor as runs ``(local offset, global start, global end)`` of the
    row-major GLOBAL tensor, for a ragged layout of design note [ragged-nd] (one run: its flat
    range) or of [ragged-tp] (:func:`tp_flat_runs`). What element-by-element initialisation
    of a sharded tensor needs (design note [ragged-random]).

    Raises:
        NotImplementedError: any other layout (``what`` names the operation).
    """
    placements = tuple(placements)
    if is_tp_layout(placements, placements):
        return tp_flat_runs(shape, mesh, placements, _ragged_dims(placements)[0])
    placement, rank = ragged_shard_and_rank(mesh, placements, what)
    start, end = placement.local_range(tuple(int(s) for s in shape), rank)
    return [(0, start, end)] if end > start else []


def copy_runs_(dst: torch.Tensor, full: torch.Tensor, runs: list[tuple[int, int, int]]) -> None:
    """Copy ``runs`` (:func:`rank_flat_runs`: ``(local offset, global start, global end)``)
    of the global tensor ``full``, read row-major, into this rank's 1-D local tensor ``dst``."""
    flat = full.reshape(-1)
    for at, start, end in runs:
        dst[at:at + end - start].copy_(flat[start:end])


def _unravel(index: int, shape: Sequence[int]) -> list[int]:
    out = []
    for n in reversed(shape):
        index, r = divmod(index, n)
        out.append(r)
    return out[::-1]


def _spec_like(spec: DTensorSpec, placements: tuple[Placement, ...]) -> DTensorSpec:
    return DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def redistribute_tp(local: torch.Tensor, current: DTensorSpec, target: DTensorSpec,
                    torch_redistribute: Callable[..., torch.Tensor],
                    ragged_1d: Callable[..., torch.Tensor], **kwargs: Any) -> torch.Tensor:
    """This rank's local tensor of ``target`` from its local of ``current`` (design note
    [ragged-tp]); ``torch_redistribute`` is torch's ``redistribute_local_tensor``,
    ``ragged_1d`` the 1-D paths of ``_dtensor`` (``_redistribute``)."""
    _redistribute = ragged_1d
    src, dst = tuple(current.placements), tuple(target.placements)
    dims = sorted(set(_ragged_dims(src)) | set(_ragged_dims(dst)))
    if current.mesh != target.mesh or len(dims) != 1:
        raise NotImplementedError(
            f"RaggedShard redistribution {src} -> {dst} is not supported: beside tensor-"
            "parallel placements exactly one mesh dim may hold a RaggedShard, on one mesh. "
            "Redistribute in steps (the ragged dim to Replicate() first).")
    dim = dims[0]
    mesh = current.mesh
    if not mesh._is_current_rank_part_of_mesh():
        return local
    shape = tuple(current.shape)
    group, rank = mesh.get_group(dim), mesh.get_local_rank(dim)
    meta = current.tensor_meta
    assert meta is not None
    with record_function("vescale::ragged_redistribute"):
        if isinstance(src[dim], RaggedShard):
            tp_shape, _ = tp_local_box(shape, mesh, src, dim)
            if isinstance(dst[dim], RaggedShard):
                if src[:dim] + src[dim + 1:] != dst[:dim] + dst[dim + 1:]:
                    raise NotImplementedError(
                        f"RaggedShard redistribution {src} -> {dst}: the tensor-parallel dims "
                        "must stay the same while the ragged dim changes. Redistribute in steps: "
                        "the ragged dim to Replicate() first.")
                return _redistribute(local, src[dim], dst[dim], tp_shape, group, rank, mesh)
            full = _redistribute(local, src[dim], Replicate(), tp_shape, group, rank, mesh)
            mid = src[:dim] + (Replicate(),) + src[dim + 1:]
            return torch_redistribute(full.reshape(tp_shape), _spec_like(current, mid),
                                      target, **kwargs)
        mid = dst[:dim] + (Replicate(),) + dst[dim + 1:]
        mid_spec = _spec_like(target, mid)
        if mid_spec.tensor_meta is None:
            mid_spec = DTensorSpec(mesh, mid, tensor_meta=TensorMeta(
                torch.Size(shape), _contiguous(shape), local.dtype))
        tp_local = torch_redistribute(local, current, mid_spec, **kwargs)
        tp_shape, _ = tp_local_box(shape, mesh, dst, dim)
        return _redistribute(tp_local.contiguous().view(tp_shape), Replicate(), dst[dim],
                             tp_shape, group, rank, mesh)
