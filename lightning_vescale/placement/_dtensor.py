"""How torch's DTensor internals learn about ``RaggedShard``: redistribution, to_local, DCP.

Design note [ragged-dtensor]
----------------------------
On torch 2.13 a direct ``Placement`` subclass gets ``DTensor.from_local`` / ``to_local`` for free,
but DTensor's redistribution planner only knows ``Shard``/``Replicate``/``Partial`` and raises
"redistribute from X to R not supported yet", and distributed checkpoint (DCP) describes every
DTensor shard as *one* rectangle, which a flat ragged range is not. This module adds exactly
three extension points; :func:`lightning_vescale.placement.install` (run once, idempotently,
when the package is imported) registers them, this module only defines them:

E1. ``redistribute_local_tensor`` -- the function every redistribution goes through: explicit
    ``DTensor.redistribute``/``full_tensor`` (``Redistribute.forward``), its autograd backward
    (``_redistribute_backward``), ``from_local``'s backward and the op dispatcher. We wrap it so
    that a spec pair involving ``RaggedShard`` goes to :func:`redistribute_ragged_local`; every
    other spec pair goes untouched to torch's function (:func:`wrap_redistribute`). Because
    torch's own ``Redistribute`` autograd function calls it for forward *and* backward,
    gradients flow back through ``redistribute`` to the original placement with no extra
    autograd code. The wrapper is bound in each module that imported the function by name
    (``_redistribute``, ``_api``, ``_dispatch``), because rebinding one module attribute does
    not reach ``from x import f``.
E2. ``_api._ToTorchTensor`` -- the autograd function behind ``to_local()``/``full_tensor()``.
    Its backward derives the gradient's global stride from the *local* gradient through a C++
    helper that rejects unknown placements ("placement type RaggedShard not supported!").
    A subclass overrides only ``backward`` for specs that involve ``RaggedShard`` (the gradient
    has the forward tensor's global shape and stride); everything else calls torch's backward
    (:func:`make_to_torch_tensor`).
E3. ``DTensor.__create_write_items__`` / ``__create_chunk_list__`` / ``__get_tensor_shard__`` --
    DCP's ``_Checkpointable`` protocol. For a ``RaggedShard`` DTensor we report the rank's flat
    range as the at most ``2d - 1`` rectangles of :func:`flat_range_to_boxes` (each one a
    contiguous view of the flat local tensor, so loads write straight into it); DCP's own
    resharding then handles any other layout, world size, ``Replicate`` or plain tensor
    (:func:`wrap_checkpoint_hook`, one per name in :data:`CHECKPOINT_HOOKS`).

Communication per path (1-D mesh of ``P`` ranks; ``n`` = tensor numel, ``n_r`` = rank r's share):

=================================  =======================================================
``RaggedShard -> Replicate``       one ``all_gather_single`` into the output when all shares
                                   are equal; one ``broadcast`` when one rank owns everything
                                   (one-hot); otherwise one ``all_gather_single`` padded to
                                   ``max(n_r)`` (receives ``P * max(n_r)``) and a compaction.
``RaggedShard -> RaggedShard``     one ``all_to_all_single`` whose splits are the range overlaps
                                   (:func:`overlap_splits`); sends only elements that change
                                   owner, no packing copies; none at all if nothing moves.
``RaggedShard <-> Shard(d)``       one ``all_to_all_single`` (splits from :func:`slab_pieces`);
                                   zero-copy when the rows of ``d`` are contiguous in memory
                                   (e.g. ``d = 0``), else one pack (or unpack) copy.
``Replicate -> RaggedShard``       local slice (a clone, like torch's ``Replicate -> Shard``).
``Partial -> RaggedShard``         one (uneven, list) ``reduce_scatter``.
``RaggedShard -> Partial``         internal only (backward of ``Partial -> RaggedShard``):
                                   zero-padded local values, no communication.
=================================  =======================================================

Every redistribution of a ``RaggedShard`` runs under
``record_function("vescale::ragged_redistribute")``, so that a profiler trace shows it. Its one
collective runs on a device the group's backend takes: with a CPU-offloaded local tensor on a
plain NCCL mesh, its send buffer goes to the mesh's device and its receive buffer comes back
(one copy each way, ``mesh.*_anywhere``: design note [mesh-device]); otherwise no copy.

N-D meshes (design note [ragged-nd] in ``_ragged_shard``; HSDP's ``(Replicate(), RaggedShard)``):
the table above is the whole story. A ragged DTensor's local tensor depends only on the rank's
coordinate on its one ragged mesh dim, so a redistribution between two specs that differ only on
that dim (``Replicate()`` on every other dim of both) runs the 1-D path in that dim's process
group (``mesh.get_group(dim)``, ``mesh.get_local_rank(dim)``); the replicas run the same
collective in parallel groups and end with the same result. DCP boxes (E3) come from the ragged
dim's rank too: replicas report identical write items, which DCP's planner keeps once
(``dedup_save_plans``). Any other pair involving a ragged dim (a ``Shard``/``Partial`` on a
replicate dim, a ragged dim that moves) raises ``NotImplementedError`` saying how to go in steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor import _api as _dt_api
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.profiler import record_function

from lightning_vescale.mesh import (
    all_to_all_single_anywhere,
    broadcast_anywhere,
    reduce_scatter_anywhere,
)
from lightning_vescale.placement._common import all_gather_flat, has_ragged_placement
from lightning_vescale.placement._ragged_tp import is_tp_layout, redistribute_tp, tp_local_box
from lightning_vescale.placement._ragged_shard import (
    Box,
    FlatRange,
    RaggedShard,
    box_numel,
    chunk_bounds,
    flat_range_to_boxes,
    overlap_splits,
    ragged_shard_and_rank,
    ragged_ranges,
    slab_pieces,
)

__all__ = [
    "CHECKPOINT_HOOKS",
    "make_to_torch_tensor",
    "redistribute_ragged_local",
    "wrap_checkpoint_hook",
    "wrap_redistribute",
]


# ------------------------------------------------------------------------------------------------
# Redistribution (E1)
# ------------------------------------------------------------------------------------------------
def redistribute_ragged_local(
    local_tensor: torch.Tensor, current_spec: DTensorSpec, target_spec: DTensorSpec
) -> torch.Tensor:
    """Return this rank's local tensor of ``target_spec`` given its local of ``current_spec``.

    At least one of the two specs holds a ``RaggedShard``. Runs at most one collective on the
    mesh's process group (see the table in the module docstring).
    """
    mesh = current_spec.mesh
    if mesh != target_spec.mesh:
        raise NotImplementedError("Cross device mesh comm not supported yet!")
    dim = _ragged_pair_dim(current_spec.placements, target_spec.placements)
    if not mesh._is_current_rank_part_of_mesh():  # same convention as torch
        return local_tensor
    src, dst = current_spec.placements[dim], target_spec.placements[dim]
    shape = tuple(current_spec.shape)
    rank = mesh.get_local_rank(dim)
    for p in (src, dst):
        if isinstance(p, RaggedShard):
            p.validate(shape, mesh.size(dim))
    if isinstance(src, RaggedShard):
        expected = src.local_numel(shape, rank)
        if local_tensor.numel() != expected:
            raise ValueError(
                f"rank {rank}: the local tensor of a {src!r} DTensor of shape {shape} must have "
                f"{expected} elements, got {local_tensor.numel()} (shape "
                f"{tuple(local_tensor.shape)}); build it with "
                "lightning_vescale.placement.ragged_from_local, which checks this."
            )
    if src == dst:
        return local_tensor
    with record_function("vescale::ragged_redistribute"):
        return _redistribute(local_tensor, src, dst, shape, mesh.get_group(dim), rank, mesh)


def _ragged_pair_dim(src: tuple, dst: tuple) -> int:
    """The one mesh dim on which a redistribution involving ``RaggedShard`` acts.

    By design note [ragged-nd], the two specs may differ only on the ragged dim and every
    other mesh dim must be ``Replicate`` in both; the local tensors then depend only on the
    rank's coordinate on that dim, so the 1-D algorithm runs in that dim's process group.
    """
    src, dst = tuple(src), tuple(dst)
    ragged = sorted({d for pl in (src, dst) for d, p in enumerate(pl)
                     if isinstance(p, RaggedShard)})
    others_replicate = len(ragged) == 1 and all(
        src[d].is_replicate() and dst[d].is_replicate()
        for d in range(len(src)) if d != ragged[0]
    )
    if not others_replicate:
        raise NotImplementedError(
            f"RaggedShard redistribution {src} -> {dst} is not supported: on a multi-dim mesh "
            "both placements must hold Replicate() on every mesh dim but one, and that dim "
            "holds the RaggedShard (e.g. (Replicate(), RaggedShard) -> (Replicate(), "
            "Replicate() / Shard(d) / RaggedShard)). Redistribute in steps: first the ragged "
            "dim to Replicate() (or the other dims to Replicate()), then the rest.")
    return ragged[0]


def _redistribute(local_tensor, src, dst, shape, group, rank, mesh) -> torch.Tensor:
    """The path of the table in the module docstring for ``src -> dst`` (validated, distinct)."""
    if isinstance(src, RaggedShard):
        flat = local_tensor.reshape(-1)
        if isinstance(dst, RaggedShard):
            return _exchange_ranges(
                flat, ragged_ranges(shape, src), ragged_ranges(shape, dst), group, rank, mesh
            )
        if isinstance(dst, Replicate):
            return _ragged_to_replicate(flat, src, shape, group, rank, mesh).view(shape)
        if type(dst) is Shard:
            dim = _nonnegative_dim(dst.dim, shape)
            return _ragged_to_shard(flat, src, shape, dim, group, rank, mesh)
        if isinstance(dst, Partial):
            return _ragged_to_partial(flat, src, shape, dst, rank)
    elif isinstance(dst, RaggedShard):
        if isinstance(src, Replicate):
            start, end = dst.local_range(shape, rank)
            return local_tensor.reshape(-1)[start:end].clone()
        if type(src) is Shard:
            return _shard_to_ragged(
                local_tensor, _nonnegative_dim(src.dim, shape), dst, shape, group, rank, mesh
            )
        if isinstance(src, Partial):
            return _partial_to_ragged(local_tensor, src, dst, shape, group, rank, mesh)
    raise NotImplementedError(
        f"redistribute from {src} to {dst} is not supported for RaggedShard (supported: "
        "RaggedShard <-> Replicate / Shard(d) / RaggedShard, Partial -> RaggedShard)."
    )


def _nonnegative_dim(dim: int, shape: tuple[int, ...]) -> int:
    return dim + len(shape) if dim < 0 else dim


def _all_to_all(
    send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group, rank: int,
    mesh, *, nothing_moves: bool,
) -> torch.Tensor:
    """One ``all_to_all_single`` with the given split sizes (none if ``nothing_moves``).

    ``nothing_moves`` must be computed from global metadata so that every rank agrees on it.
    """
    out = send.new_empty(sum(recv_splits))
    if nothing_moves:
        assert send_splits[rank] == recv_splits[rank] == send.numel() == out.numel()
        out.copy_(send)
        return out
    all_to_all_single_anywhere(out, send.contiguous(), recv_splits, send_splits, group=group,
                               mesh=mesh)  # offloaded (CPU) tensors: design note [mesh-device]
    return out


def _exchange_ranges(flat, src_ranges, dst_ranges, group, rank, mesh) -> torch.Tensor:
    """Flat-range layout -> flat-range layout: the local buffers are the a2a buffers."""
    send_splits, recv_splits = overlap_splits(src_ranges, dst_ranges, rank)
    return _all_to_all(flat, send_splits, recv_splits, group, rank, mesh,
                       nothing_moves=list(src_ranges) == list(dst_ranges))


class _ShardLayout(NamedTuple):
    """``Shard(dim)`` on ``P`` ranks: each rank's row bounds of ``dim`` and, when every slab of
    rows is one flat range (nothing before ``dim`` but size-1 dims), those flat ranges."""

    row_bounds: list[tuple[int, int]]
    flat_ranges: list[FlatRange] | None


def _shard_layout(shape: tuple[int, ...], dim: int, num_ranks: int) -> _ShardLayout:
    if not 0 <= dim < len(shape):
        raise ValueError(f"Shard(dim={dim}) is out of range for a tensor of shape {shape}")
    bounds = chunk_bounds(shape[dim], num_ranks)
    if math.prod(shape[:dim]) == 1:  # the slab of rows [lo, hi) is one flat range
        inner = math.prod(shape[dim + 1:])
        return _ShardLayout(bounds, [FlatRange(lo * inner, hi * inner) for lo, hi in bounds])
    return _ShardLayout(bounds, None)


def _block_shape(shape, dim, lo, hi) -> tuple[int, ...]:
    return shape[:dim] + (hi - lo,) + shape[dim + 1:]


def _slab_count(shape, rng: tuple[int, int], dim: int, rows: tuple[int, int]) -> int:
    """Elements of the flat range ``rng`` in the row slab ``rows`` of ``dim``."""
    return sum(box_numel(b) for b in slab_pieces(shape, *rng, dim, *rows))


class _BoxView(NamedTuple):
    """A box of a flat range and the view of the flat local tensor that holds it."""

    box: Box
    view: torch.Tensor


def _range_box_views(flat: torch.Tensor, shape, start: int, end: int) -> list[_BoxView]:
    """A :class:`_BoxView` for each box of the flat range, each view aliasing ``flat``."""
    out, pos = [], 0
    for box in flat_range_to_boxes(shape, start, end):
        n = box_numel(box)
        out.append(_BoxView(box, flat[pos:pos + n].view(box.sizes)))
        pos += n
    return out


def _slab_views(box_views: list[_BoxView], dim: int, lo: int, hi: int) -> list[torch.Tensor]:
    """Views of the parts of ``box_views`` in rows ``[lo, hi)`` of ``dim``, in flat order.

    Mirrors :func:`slab_pieces` (same boxes, same order), so sender and receiver agree.
    """
    out = []
    for (offsets, sizes), view in box_views:
        a, b = max(offsets[dim], lo), min(offsets[dim] + sizes[dim], hi)
        if a < b:
            out.append(view.narrow(dim, a - offsets[dim], b - a))
    return out


def _ragged_to_shard(flat, src: RaggedShard, shape, dim, group, rank, mesh) -> torch.Tensor:
    num_ranks = len(src.local_units)
    ranges = ragged_ranges(shape, src)
    layout = _shard_layout(shape, dim, num_ranks)
    bounds = layout.row_bounds
    block = _block_shape(shape, dim, *bounds[rank])
    if layout.flat_ranges is not None:  # zero-copy: both layouts are flat ranges
        return _exchange_ranges(flat, ranges, layout.flat_ranges, group, rank, mesh).view(block)
    send_splits = [_slab_count(shape, ranges[rank], dim, b) for b in bounds]
    recv_splits = [_slab_count(shape, rng, dim, bounds[rank]) for rng in ranges]
    views = _range_box_views(flat, shape, *ranges[rank])
    pieces = [v.reshape(-1) for qlo, qhi in bounds for v in _slab_views(views, dim, qlo, qhi)]
    send = torch.cat(pieces) if pieces else flat.new_empty(0)
    # Received from r: r's range within my rows, in flat order; r's ranges ascend, so the
    # concatenation is my block in row-major order. (A slab of a dim with a non-trivial prefix
    # is never one flat range, so something always moves unless there is one rank.)
    out = _all_to_all(send, send_splits, recv_splits, group, rank, mesh,
                      nothing_moves=num_ranks == 1)
    return out.view(block)


def _shard_to_ragged(local, dim, dst: RaggedShard, shape, group, rank, mesh) -> torch.Tensor:
    num_ranks = len(dst.local_units)
    ranges = ragged_ranges(shape, dst)
    layout = _shard_layout(shape, dim, num_ranks)
    bounds = layout.row_bounds
    block = _block_shape(shape, dim, *bounds[rank])
    if tuple(local.shape) != block:
        raise ValueError(
            f"rank {rank}: Shard({dim}) local tensor of a {shape} DTensor must have shape "
            f"{block}, got {tuple(local.shape)}"
        )
    # My block in row-major order is ascending in global flat order, and the destination ranges
    # ascend with the rank, so the message to each rank is one contiguous run: send as is.
    send = local.contiguous().view(-1)
    if layout.flat_ranges is not None:
        return _exchange_ranges(send, layout.flat_ranges, ranges, group, rank, mesh)
    send_splits = [_slab_count(shape, rng, dim, bounds[rank]) for rng in ranges]
    recv_splits = [_slab_count(shape, ranges[rank], dim, b) for b in bounds]
    recv = _all_to_all(send, send_splits, recv_splits, group, rank, mesh,
                       nothing_moves=num_ranks == 1)
    start, end = ranges[rank]
    out = send.new_empty(end - start)
    views = _range_box_views(out, shape, start, end)
    pos = 0
    for rlo, rhi in bounds:
        for v in _slab_views(views, dim, rlo, rhi):
            n = v.numel()
            v.copy_(recv[pos:pos + n].view(v.shape))
            pos += n
    assert pos == recv.numel(), (pos, recv.numel())
    return out


def _ragged_to_replicate(flat, src: RaggedShard, shape, group, rank, mesh) -> torch.Tensor:
    sizes = [end - start for start, end in ragged_ranges(shape, src)]
    numel = math.prod(shape)
    num_ranks = len(sizes)
    if num_ranks == 1:
        return flat.clone()
    owners = [r for r, n in enumerate(sizes) if n > 0]
    if len(owners) == 1:  # one-hot: the owner broadcasts, nobody pads
        owner = owners[0]
        out = flat.clone() if rank == owner else flat.new_empty(numel)
        broadcast_anywhere(out, group_src=owner, group=group, mesh=mesh)
        return out
    width = max(sizes)
    if all(n == width for n in sizes):  # even: gather straight into the result
        out = flat.new_empty(numel)
        all_gather_flat(out, flat.contiguous(), group=group, mesh=mesh)
        return out
    padded = flat.new_zeros(width)
    padded[: sizes[rank]].copy_(flat)
    buf = flat.new_empty(num_ranks * width)
    all_gather_flat(buf, padded, group=group, mesh=mesh)
    buf = buf.view(num_ranks, width)
    return torch.cat([buf[r, :n] for r, n in enumerate(sizes)])


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
               "product": dist.ReduceOp.PRODUCT}


def _partial_to_ragged(local, src: Partial, dst: RaggedShard, shape, group, rank, mesh):
    op_name = src.reduce_op
    if op_name not in _REDUCE_OPS and op_name != "avg":
        raise NotImplementedError(
            f"Partial({op_name!r}) -> RaggedShard is not supported (sum, avg, max, min, product)"
        )
    num_ranks = len(dst.local_units)
    ranges = ragged_ranges(shape, dst)
    full = local.contiguous().view(-1)
    start, end = ranges[rank]
    if num_ranks == 1:
        out = full[start:end].clone()
    else:
        out = full.new_empty(end - start)
        # ranges are consecutive from 0: the pieces are full.split(sizes); offloaded: staged
        reduce_scatter_anywhere(out, full, [e - s for s, e in ranges],
                                op=_REDUCE_OPS.get(op_name, dist.ReduceOp.SUM), group=group,
                                mesh=mesh)
    if op_name == "avg":
        out.div_(num_ranks)
    return out


def _ragged_to_partial(flat, src: RaggedShard, shape, dst: Partial, rank):
    # Only reached internally: the backward of Partial -> RaggedShard (torch turns the
    # analogous Shard -> Partial backward into Shard -> Replicate, but it cannot rewrite an
    # unknown placement). A value is "pending sum" if each rank holds its own range and zeros
    # elsewhere: exact, and free of communication.
    if dst.reduce_op not in ("sum", "avg"):
        raise NotImplementedError(
            f"RaggedShard -> Partial({dst.reduce_op!r}) is not supported (sum and avg only)"
        )
    start, end = src.local_range(shape, rank)
    out = flat.new_zeros(math.prod(shape))
    out[start:end].copy_(flat)
    if dst.reduce_op == "avg":
        out.mul_(len(src.local_units))
    return out.view(shape)


def wrap_redistribute(original: Callable) -> Callable:
    """E1: torch's ``redistribute_local_tensor`` with RaggedShard spec pairs sent to
    :func:`redistribute_ragged_local` (``__wrapped__`` is ``original``)."""

    def redistribute_local_tensor(local_tensor, current_spec, target_spec, *args, **kwargs):
        if has_ragged_placement(current_spec.placements) or has_ragged_placement(
            target_spec.placements
        ):
            if is_tp_layout(current_spec.placements, target_spec.placements):  # [ragged-tp]
                return redistribute_tp(local_tensor, current_spec, target_spec, original,
                                       _redistribute, **kwargs)
            return redistribute_ragged_local(local_tensor, current_spec, target_spec)
        return original(local_tensor, current_spec, target_spec, *args, **kwargs)

    redistribute_local_tensor.__wrapped__ = original  # type: ignore[attr-defined]
    redistribute_local_tensor.__doc__ = original.__doc__
    return redistribute_local_tensor


# ------------------------------------------------------------------------------------------------
# to_local / full_tensor backward (E2)
# ------------------------------------------------------------------------------------------------
def make_to_torch_tensor(base: type) -> type:
    """E2: a subclass of torch's ``_ToTorchTensor`` ``base`` whose backward accepts RaggedShard."""

    class _ToTorchTensor(base):  # type: ignore[misc, valid-type]
        """torch's ``_ToTorchTensor`` with a backward that accepts ``RaggedShard`` specs."""

        @staticmethod
        def backward(ctx, grad_output):  # type: ignore[override]
            spec = ctx.dtensor_spec
            grad_placements = ctx.grad_placements
            if grad_output is None or not (
                has_ragged_placement(spec.placements) or has_ragged_placement(grad_placements)
            ):
                return base.backward(ctx, grad_output)
            if grad_placements is None:
                grad_placements = _dt_api._normalize_placements_for_grad(spec.placements)
            meta = spec.tensor_meta
            if has_ragged_placement(grad_placements):
                stride = meta.stride  # the gradient has the forward tensor's global layout
            else:
                _, stride = _dt_api.compute_global_tensor_info(
                    grad_output, spec.mesh, grad_placements
                )
            grad = DTensor.from_local(
                grad_output, spec.mesh, tuple(grad_placements), run_check=False,
                shape=meta.shape, stride=tuple(stride),
            )
            return grad, None

    return _ToTorchTensor


# ------------------------------------------------------------------------------------------------
# Distributed checkpoint (E3)
# ------------------------------------------------------------------------------------------------
def _ragged_local_boxes(dt: DTensor) -> list[_BoxView]:
    """A :class:`_BoxView` for each box of this rank's range of a RaggedShard DTensor.

    Beside tensor-parallel ``Shard`` dims (design note [ragged-tp]) the range is one of the
    TP-local region, whose boxes are shifted by the region's global offset."""
    placements = tuple(dt.placements)
    if is_tp_layout(placements, placements):
        mesh = dt.device_mesh
        dim = next(d for d, p in enumerate(placements) if isinstance(p, RaggedShard))
        tp_shape, offset = tp_local_box(tuple(dt.shape), mesh, placements, dim)
        start, end = placements[dim].local_range(tp_shape, mesh.get_local_rank(dim))
        return [_BoxView(Box(tuple(o + a for o, a in zip(offset, box.offsets)), box.sizes), v)
                for box, v in _range_box_views(dt._local_tensor.reshape(-1), tp_shape,
                                               start, end)]
    placement, r = ragged_shard_and_rank(dt.device_mesh, dt.placements,
                                         "checkpointing RaggedShard DTensors")
    shape = tuple(dt.shape)
    # Replicas (other mesh dims) report the same boxes; DCP's planner saves each once.
    start, end = placement.local_range(shape, r)
    return _range_box_views(dt._local_tensor.reshape(-1), shape, start, end)


def _ragged_write_items(self: DTensor, fqn: str, object: Any) -> list[WriteItem]:
    properties = TensorProperties.create_from_tensor(self._local_tensor)
    items = []
    for (offsets, sizes), _ in _ragged_local_boxes(self):
        offsets, sizes = torch.Size(offsets), torch.Size(sizes)
        items.append(WriteItem(
            index=MetadataIndex(fqn, offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                properties=properties,
                size=self.size(),
            ),
        ))
    return items


def _ragged_chunk_list(self: DTensor) -> list[ChunkStorageMetadata]:
    return [
        ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        for (offsets, sizes), _ in _ragged_local_boxes(self)
    ]


def _ragged_tensor_shard(self: DTensor, index: MetadataIndex) -> torch.Tensor:
    box_views = _ragged_local_boxes(self)
    if index.offset is None and len(box_views) == 1:
        return box_views[0].view
    offsets = tuple(index.offset) if index.offset is not None else None
    for bv in box_views:
        if tuple(bv.box.offsets) == offsets:
            return bv.view
    raise ValueError(
        f"{index.fqn}: no chunk at offsets {offsets} on this rank of {self.placements!r} "
        f"(shape {tuple(self.shape)})"
    )


#: E3: DCP's ``_Checkpointable`` methods of ``DTensor`` -> their RaggedShard implementation.
CHECKPOINT_HOOKS: dict[str, Callable[..., Any]] = {
    "__create_write_items__": _ragged_write_items,
    "__create_chunk_list__": _ragged_chunk_list,
    "__get_tensor_shard__": _ragged_tensor_shard,
}


def wrap_checkpoint_hook(name: str, original: Callable) -> Callable:
    """E3: ``DTensor``'s method ``name`` (``original``) with RaggedShard DTensors sent to
    ``CHECKPOINT_HOOKS[name]``; every other DTensor keeps torch's implementation."""
    ragged_impl = CHECKPOINT_HOOKS[name]

    def hook(self: DTensor, *args: Any) -> Any:
        if has_ragged_placement(self.placements):
            return ragged_impl(self, *args)
        return original(self, *args)

    hook.__name__ = hook.__qualname__ = name
    hook.__doc__ = original.__doc__
    hook.__wrapped__ = original  # type: ignore[attr-defined]
    return hook
