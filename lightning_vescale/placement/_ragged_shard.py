"""Layer 0: the ``RaggedShard`` placement and the pure range math behind it.

Design note [ragged-shard]
--------------------------
``RaggedShard(dims, local_units)`` shards a tensor over contiguous memory. The tensor is viewed
as ``(P, *rest)`` where ``P = prod(shape[d] for d in dims)`` and ``dims`` is a prefix
``(0, 1, ..., k-1)`` of the tensor's dims. ``P`` is cut into ``U = sum(local_units)`` equal
*units* of ``P // U`` rows (so ``U`` must divide ``P``); rank ``r`` holds the contiguous units
``[sum(local_units[:r]), sum(local_units[:r+1]))``. A unit is atomic: it is never split across
ranks, which is what block-wise quantization and matrix optimizers need. Ranks may hold zero
units, and one rank may hold all of them ("one-hot": the tensor lives whole on one rank, used
e.g. by distributed Muon); ``dims=()`` means ``P = 1``, so the only legal units are one-hot.

The local tensor of a ``RaggedShard`` DTensor is the rank's range *flattened to 1-D*, so that it
can be a view into a flat communication buffer (see ``dbuffer.py``). Everything in this module is
pure (no process group): the ranges, validation, the decomposition of a flat range into
rectangles for distributed-checkpoint metadata, and the split sizes of the all-to-alls that
redistribute a ragged layout (``overlap_splits``, ``chunk_bounds``, ``slab_pieces``). The one
exception is :func:`ragged_from_local`, the checked way to build a ``RaggedShard`` DTensor.

How DTensor learns to redistribute, checkpoint and compute on this placement is registered in one
place, ``lightning_vescale.placement.install`` (design notes [ragged-dtensor], [ragged-ops] and
[ragged-reductions] in the package's ``_dtensor``, ``_ops`` and ``_reductions`` modules). This
module imports none of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

__all__ = [
    "Box",
    "FlatRange",
    "RaggedShard",
    "box_numel",
    "chunk_bounds",
    "flat_range_to_boxes",
    "local_slice",
    "overlap_matrix",
    "overlap_splits",
    "ragged_from_local",
    "ragged_mesh_dim",
    "ragged_ranges",
    "ragged_shard_and_rank",
    "slab_pieces",
]


class FlatRange(NamedTuple):
    """A flat (row-major) element range ``[start, end)`` of a tensor."""

    start: int
    end: int


class Box(NamedTuple):
    """A rectangle of a tensor: per-dim ``offsets`` and ``sizes`` (DCP chunk metadata's form)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


class RaggedShard(Placement):
    """A placement over contiguous memory with an atomic unit and uneven per-rank amounts.

    Args:
        dims: a prefix ``(0, 1, ..., k-1)`` of the tensor's dims whose product ``P`` is split
            into units. ``()`` means "the tensor is one unit".
        local_units: how many of the ``sum(local_units)`` equal units each rank of the mesh
            dimension holds, in rank order. Zeros are allowed; at least one entry is positive.

    See design note [ragged-shard] in this module.
    """

    __slots__ = ("dims", "local_units")

    def __init__(self, dims: Sequence[int], local_units: Sequence[int]) -> None:
        super().__init__()
        dims_t = tuple(int(d) for d in dims)
        units_t = tuple(int(u) for u in local_units)
        if dims_t != tuple(range(len(dims_t))):
            raise ValueError(
                f"RaggedShard dims must be a prefix (0, 1, ..., k-1) of the tensor dims, got "
                f"dims={dims_t}; use dims={tuple(range(len(dims_t)))} to shard the leading "
                f"{len(dims_t)} dim(s) as one flattened dimension."
            )
        if len(units_t) == 0:
            raise ValueError("RaggedShard local_units must have one entry per rank, got ()")
        if any(u < 0 for u in units_t):
            raise ValueError(
                f"RaggedShard local_units must be >= 0, got local_units={units_t}"
            )
        if sum(units_t) == 0:
            raise ValueError(
                f"RaggedShard local_units must not all be zero, got local_units={units_t}; "
                "give at least one rank a unit (one-hot units put the whole tensor on one rank)."
            )
        object.__setattr__(self, "dims", dims_t)
        object.__setattr__(self, "local_units", units_t)

    # -- identity --------------------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, RaggedShard)
            and self.dims == other.dims
            and self.local_units == other.local_units
        )

    def __hash__(self) -> int:
        return hash(("RaggedShard", self.dims, self.local_units))

    def __repr__(self) -> str:
        return f"RaggedShard(dims={self.dims}, local_units={self.local_units})"

    def __str__(self) -> str:
        return f"RS({self.dims}, {self.local_units})"

    def __fx_repr__(self) -> tuple[str, dict[str, type]]:
        # torch's opaque-object contract (as Shard's): an evaluable string and its globals.
        return repr(self), {"RaggedShard": RaggedShard}

    def __reduce__(self):  # picklable (DeviceMesh specs and checkpoints carry placements)
        return (RaggedShard, (self.dims, self.local_units))

    # Placement's C++ predicates: a RaggedShard is neither Shard, Replicate nor Partial.
    def is_shard(self, dim: int | None = None) -> bool:  # noqa: D102
        return False

    def is_replicate(self) -> bool:  # noqa: D102
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:  # noqa: D102
        return False

    # -- range math ------------------------------------------------------------------------------
    @property
    def num_units(self) -> int:
        """``U = sum(local_units)``."""
        return sum(self.local_units)

    @property
    def is_one_hot(self) -> bool:
        """True when exactly one rank holds every unit."""
        return sum(1 for u in self.local_units if u > 0) == 1

    def validate(self, shape: Sequence[int], mesh_size: int | None = None) -> None:
        """Raise ``ValueError`` unless this placement can shard a tensor of ``shape``."""
        shape = tuple(int(s) for s in shape)
        if len(self.dims) > len(shape):
            raise ValueError(
                f"{self!r}: dims={self.dims} is longer than the tensor's {len(shape)} dims "
                f"(shape={shape})"
            )
        if mesh_size is not None and len(self.local_units) != mesh_size:
            raise ValueError(
                f"{self!r}: local_units has {len(self.local_units)} entries but the mesh "
                f"dimension has {mesh_size} ranks; give one entry per rank."
            )
        p = math.prod(shape[: len(self.dims)])
        if p % self.num_units != 0:
            raise ValueError(
                f"{self!r}: sum(local_units)={self.num_units} must divide P={p} (the product of "
                f"dims {self.dims} of shape {shape}); choose units whose total divides P."
            )

    def unit_numel(self, shape: Sequence[int]) -> int:
        """Elements in one unit of a tensor of ``shape``."""
        self.validate(shape)
        p = math.prod(shape[: len(self.dims)])
        return (p // self.num_units) * math.prod(shape[len(self.dims):])

    def local_range(self, shape: Sequence[int], rank: int) -> FlatRange:
        """The flat element range ``[start, end)`` that ``rank`` holds."""
        return ragged_ranges(shape, self)[rank]

    def local_numel(self, shape: Sequence[int], rank: int) -> int:
        """Number of elements ``rank`` holds."""
        start, end = self.local_range(shape, rank)
        return end - start


def ragged_ranges(shape: Sequence[int], placement: RaggedShard) -> list[FlatRange]:
    """Per-rank flat element ranges ``[start, end)`` of a tensor of ``shape``, in rank order.

    The ranges are contiguous, disjoint, in rank order, and cover ``[0, numel)`` exactly.
    """
    unit = placement.unit_numel(shape)
    ranges = []
    start = 0
    for units in placement.local_units:
        end = start + units * unit
        ranges.append(FlatRange(start, end))
        start = end
    return ranges


def flat_range_to_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """Decompose the row-major flat range ``[start, end)`` of ``shape`` into rectangles.

    Returns boxes in flat order whose concatenation (each box flattened row-major) is exactly
    the range. A d-dim tensor needs at most ``2d - 1`` boxes (a partial head, a block of whole
    slices, a partial tail at each level), which is within the ``2^d - 1`` bound that
    distributed-checkpoint chunk metadata allows for. An empty range gives ``[]``.
    """
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    if not 0 <= start <= end <= numel:
        raise ValueError(f"flat range [{start}, {end}) is outside a tensor of shape {shape}")
    if start == end:
        return []
    if len(shape) == 0:
        return [Box((), ())]
    return _boxes(shape, start, end)


def _boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    # Invariant: 0 <= start < end <= prod(shape), len(shape) >= 1.
    inner = math.prod(shape[1:])
    if len(shape) == 1:
        return [Box((start,), (end - start,))]
    first_row, first_col = divmod(start, inner)
    end_row, end_col = divmod(end, inner)
    out: list[Box] = []

    def in_row(row: int, boxes: list[Box]) -> list[Box]:
        return [Box((row, *b.offsets), (1, *b.sizes)) for b in boxes]

    if first_row == end_row:  # within one slice of dim 0
        return in_row(first_row, _boxes(shape[1:], first_col, end_col))
    if first_col > 0:  # partial head slice
        out += in_row(first_row, _boxes(shape[1:], first_col, inner))
        first_row += 1
    if end_row > first_row:  # whole slices
        out.append(Box((first_row,) + (0,) * (len(shape) - 1), (end_row - first_row, *shape[1:])))
    if end_col > 0:  # partial tail slice
        out += in_row(end_row, _boxes(shape[1:], 0, end_col))
    return out


# -- pure helpers for redistribution (used by ``_dtensor``) ---------------------------------------
def box_numel(box: tuple[Sequence[int], Sequence[int]]) -> int:
    """Number of elements in a :class:`Box` (or a plain ``(offsets, sizes)`` pair)."""
    _, sizes = box
    return math.prod(sizes)


def overlap_matrix(
    src_ranges: Sequence[tuple[int, int]], dst_ranges: Sequence[tuple[int, int]]
) -> list[list[int]]:
    """``m[r][q] = |src_ranges[r] & dst_ranges[q]|``: elements rank ``r`` sends to rank ``q``.

    With both layouts flat ranges in rank order (RaggedShard, or a ``Shard`` whose rows are
    contiguous in memory), rank ``r``'s local buffer *is* its all-to-all send buffer with split
    sizes ``m[r]``, and rank ``q``'s receive buffer *is* its new local buffer with split sizes
    ``[m[r][q] for r]``: one ``all_to_all_single`` and no packing copies.
    """
    return [
        [max(0, min(se, de) - max(ss, ds)) for ds, de in dst_ranges] for ss, se in src_ranges
    ]


def overlap_splits(
    src_ranges: Sequence[tuple[int, int]],
    dst_ranges: Sequence[tuple[int, int]],
    rank: int,
) -> tuple[list[int], list[int]]:
    """``rank``'s row and column of :func:`overlap_matrix` in ``O(P)``: its all-to-all
    ``(input_split_sizes, output_split_sizes)``."""
    s, e = src_ranges[rank]
    ds, de = dst_ranges[rank]
    send = [max(0, min(e, qe) - max(s, qs)) for qs, qe in dst_ranges]
    recv = [max(0, min(re, de) - max(rs, ds)) for rs, re in src_ranges]
    return send, recv


def chunk_bounds(size: int, num_chunks: int) -> list[tuple[int, int]]:
    """Per-rank ``[lo, hi)`` of ``torch.chunk`` on a dim of ``size`` (what ``Shard(d)`` uses).

    Chunks have ``ceil(size / num_chunks)`` rows except at the end; trailing ranks may be empty.
    """
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    full = -(-size // num_chunks) if size else 0
    return [(min(r * full, size), min((r + 1) * full, size)) for r in range(num_chunks)]


def slab_pieces(
    shape: Sequence[int], start: int, end: int, dim: int, lo: int, hi: int
) -> list[Box]:
    """The part of the flat range ``[start, end)`` that lies in the slab ``lo <= x[dim] < hi``.

    Returned as boxes in flat (row-major) order, so that walking them in order and each
    row-major visits exactly the range's elements of the slab in global flat order. This is the
    packing order of a ``RaggedShard <-> Shard(dim)`` all-to-all message.
    """
    out: list[Box] = []
    for offsets, sizes in flat_range_to_boxes(shape, start, end):
        a = max(offsets[dim], lo)
        b = min(offsets[dim] + sizes[dim], hi)
        if a < b:
            out.append(Box(
                offsets[:dim] + (a,) + offsets[dim + 1:],
                sizes[:dim] + (b - a,) + sizes[dim + 1:],
            ))
    return out


def ragged_mesh_dim(placements: Sequence[Placement], what: str = "RaggedShard") -> int:
    """The mesh dim of the one ``RaggedShard`` in ``placements``; every other dim must replicate.

    Design note [ragged-nd]
    -----------------------
    A ``RaggedShard`` DTensor lives on a mesh where exactly one dim shards it raggedly and
    every other dim holds a full copy of that sharding (``Replicate``):
    ``(RaggedShard,)`` on a 1-D mesh (FSDP), ``(Replicate(), RaggedShard)`` on a 2-D
    ``(replicate, shard)`` mesh (HSDP). The local tensor is then a function of the rank's
    coordinate on the ragged dim only, so all range math, redistribution and checkpoint boxes
    run on that dim's process group and ignore the others. Other combinations (two ragged dims,
    ``Shard``/``Partial`` next to a ragged dim) are not supported.

    Raises:
        NotImplementedError: no ``RaggedShard``, more than one, or a non-``Replicate`` placement
            beside it. ``what`` names the operation for the message.
    """
    placements = tuple(placements)
    dims = [d for d, p in enumerate(placements) if isinstance(p, RaggedShard)]
    others = [p for p in placements if not isinstance(p, RaggedShard) and not p.is_replicate()]
    if len(dims) != 1 or others:
        raise NotImplementedError(
            f"{what} supports placements with exactly one RaggedShard and Replicate() on every "
            f"other mesh dim (e.g. (RaggedShard,) or (Replicate(), RaggedShard)); got "
            f"{placements}.")
    return dims[0]


def ragged_shard_and_rank(mesh: DeviceMesh, placements: Sequence[Placement],
                          what: str = "RaggedShard") -> tuple[RaggedShard, int]:
    """The one ``RaggedShard`` of ``placements`` and this rank's coordinate on its mesh dim: the
    ``(placement, rank)`` that :meth:`RaggedShard.local_range` and :func:`local_slice` take
    (design note [ragged-nd]: replicas along the other dims get the same range).

    Raises:
        NotImplementedError: as :func:`ragged_mesh_dim` (``what`` names the operation).
    """
    dim = ragged_mesh_dim(placements, what)
    return placements[dim], mesh.get_local_rank(dim)


def _as_placements(placement: RaggedShard | Sequence[Placement], mesh: DeviceMesh
                   ) -> tuple[Placement, ...]:
    if isinstance(placement, RaggedShard):
        if mesh.ndim != 1:
            raise ValueError(
                f"ragged_from_local: a bare RaggedShard is a placement for a 1-D mesh; on this "
                f"{mesh.ndim}-D mesh {tuple(mesh.shape)} pass one placement per mesh dim, e.g. "
                f"(Replicate(), RaggedShard(...)) (design note [ragged-nd]).")
        return (placement,)
    if isinstance(placement, Placement) or not isinstance(placement, Sequence):
        raise TypeError(
            f"ragged_from_local: placement must be a RaggedShard or a sequence of placements "
            f"holding one, got {placement!r}")
    placements = tuple(placement)
    if len(placements) != mesh.ndim:
        raise ValueError(
            f"ragged_from_local: {len(placements)} placements {placements} for a {mesh.ndim}-D "
            f"mesh {tuple(mesh.shape)}; pass one placement per mesh dim.")
    return placements


def _ragged_leaf_cached(local: torch.Tensor, mesh: DeviceMesh,
                        placement: RaggedShard | tuple, shape: Sequence[int],
                        stride: Sequence[int] | None) -> DTensor:
    """:func:`ragged_from_local`'s per-step engine path (``autograd=False, check=False``; a
    gradient per parameter per step): a cached spec, keyed on the identity of the placement
    object (the engine keeps one per parameter)."""
    key = (id(mesh), id(placement), tuple(shape),
           None if stride is None else tuple(stride), local.dtype)
    hit = _FAST_SPECS.get(key)
    if hit is not None and hit[0] is mesh and hit[1] is placement:
        return _new_dtensor(DTensor, local, hit[2], requires_grad=False)
    shape_t = tuple(int(d) for d in shape)
    stride_t = _contiguous_stride(shape_t) if stride is None else tuple(int(d) for d in stride)
    placements_t = placement if type(placement) is tuple else (placement,)
    spec = _spec(mesh, placements_t, shape_t, stride_t, local.dtype)
    if len(_FAST_SPECS) >= 4096:
        _FAST_SPECS.clear()
    _FAST_SPECS[key] = (mesh, placement, spec)  # keeps both alive: their ids stay unique
    return _new_dtensor(DTensor, local, spec, requires_grad=False)


def ragged_from_local(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placement: RaggedShard | Sequence[Placement],
    shape: Sequence[int],
    stride: Sequence[int] | None = None,
    *,
    autograd: bool = True,
    check: bool = True,
) -> DTensor:
    """The one way to build a ``RaggedShard`` DTensor from this rank's flat slice.

    Args:
        local: this rank's flat 1-D slice (``numel == ragged.local_numel(shape, r)`` where ``r``
            is this rank's coordinate on the ragged mesh dim); it is wrapped without a copy, so
            it may be a view into a flat buffer.
        mesh: the ``DeviceMesh`` (1-D, or N-D with one ragged dim: design note [ragged-nd]).
        placement: the ``RaggedShard`` (1-D mesh), or one placement per mesh dim holding exactly
            one ``RaggedShard`` and ``Replicate()`` elsewhere (e.g. HSDP's
            ``(Replicate(), RaggedShard(...))``).
        shape: the global shape. ``stride``: the global stride (default: contiguous).
        autograd: ``True`` (default) behaves like ``DTensor.from_local``: differentiable, the
            gradient flows back to ``local``. ``False`` makes ``local`` itself the local tensor of
            a new leaf DTensor with no autograd history: what sharded parameters and gradients
            that live in a DBuffer need (their storage must stay the buffer's).
        check: validate placement, mesh and local size (cheap, but ``O(world size)``); the
            engine's per-step paths, whose inputs come from a plan, pass ``False``.

    Raises:
        ValueError: bad placement for ``shape``/mesh, or a local tensor of the wrong size/rank.
        TypeError: ``placement`` is neither a ``RaggedShard`` nor a sequence of placements.
        NotImplementedError: placements other than one ``RaggedShard`` plus ``Replicate()``s.
    """
    if not autograd and not check and (type(placement) is RaggedShard or type(placement) is tuple):
        return _ragged_leaf_cached(local, mesh, placement, shape, stride)
    placements = _as_placements(placement, mesh)
    dim = ragged_mesh_dim(placements, "ragged_from_local")
    ragged = placements[dim]
    shape = tuple(int(s) for s in shape)
    if check:
        ragged.validate(shape, mesh.size(dim))
        if not isinstance(local, torch.Tensor):
            raise TypeError(
                f"ragged_from_local: local must be a torch.Tensor, got {type(local)}")
        rank = mesh.get_local_rank(dim)
        expected = ragged.local_numel(shape, rank)
        if local.dim() != 1 or local.numel() != expected:
            raise ValueError(
                f"ragged_from_local: rank {rank} of {ragged!r} on shape {shape} expects a flat "
                f"1-D local tensor of {expected} elements, got shape {tuple(local.shape)} "
                f"({local.numel()} elements); pass this rank's flat slice "
                f"(local_slice(full, placement, rank))."
            )
    stride = _contiguous_stride(shape) if stride is None else tuple(int(s) for s in stride)
    if not autograd or len(shape) == 0:
        # The DTensor constructor: no view, no graph. torch's from_local also treats shape=()
        # as "not given" (it is falsy) and then asks a C++ helper that rejects RaggedShard, so
        # 0-d tensors take this path too, wrapped in a differentiable function when asked.
        spec = _spec(mesh, placements, shape, stride, local.dtype)
        if not autograd:
            # DTensor(local, spec, ...) is this C++ __new__ plus an empty __init__ behind a
            # dynamo wrapper (~2 us): the engine publishes every gradient through here.
            return _new_dtensor(DTensor, local, spec, requires_grad=False)
        return _FromLocal0d.apply(local, spec)
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride,
    )


_new_dtensor = DTensor.__new__
_SPECS: dict[tuple, tuple[DeviceMesh, DTensorSpec]] = {}
_FAST_SPECS: dict[tuple, tuple[DeviceMesh, object, DTensorSpec]] = {}


def _spec(mesh: DeviceMesh, placements: tuple[Placement, ...], shape: tuple[int, ...],
          stride: tuple[int, ...], dtype: torch.dtype) -> DTensorSpec:
    """The (immutable) spec of a ragged DTensor, cached: a step publishes one per gradient."""
    key = (id(mesh), placements, shape, stride, dtype)
    hit = _SPECS.get(key)
    if hit is not None and hit[0] is mesh:
        return hit[1]
    spec = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size(shape), stride,
                                                                  dtype))
    if len(_SPECS) >= 4096:
        _SPECS.clear()
    _SPECS[key] = (mesh, spec)  # the mesh is kept alive, so its id is not reused meanwhile
    return spec


class _FromLocal0d(torch.autograd.Function):
    """``DTensor.from_local`` for a 0-d global shape (1 element on its owner, 0 elsewhere)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: DTensorSpec):  # type: ignore[override]
        ctx.spec = spec
        return DTensor(local.view_as(local), spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if grad.placements != ctx.spec.placements:
            grad = grad.redistribute(ctx.spec.mesh, ctx.spec.placements)
        return grad.to_local(), None


def local_slice(full: torch.Tensor, placement: RaggedShard, rank: int) -> torch.Tensor:
    """``rank``'s part of the full tensor ``full`` under ``placement``, flattened to 1-D.

    The one way to cut a full (unsharded) value down to a ``RaggedShard`` target: loading a full
    state dict into a DBuffer shard, a checkpoint into a sharded parameter, an optimizer state
    into its parameter's layout. A view of ``full`` when ``full`` is contiguous (copy it into the
    target, or ``.clone()`` it to own it).
    """
    start, end = placement.local_range(tuple(full.shape), rank)
    return full.reshape(-1)[start:end]


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride = []
    acc = 1
    for s in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))


# The public classes are pickled (placements in specs and checkpoints, ranges in plans) under
# the package's public path, so saved objects do not depend on this private module's name.
for _public in (Box, FlatRange, RaggedShard):
    _public.__module__ = "lightning_vescale.placement"
del _public
