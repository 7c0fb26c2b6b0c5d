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
pure (no process group): the ranges, validation and the decomposition of a flat range into
rectangles for distributed-checkpoint metadata.

How DTensor learns to redistribute and compute on this placement lives in one place:
``lightning_vescale._ragged_dtensor`` (see design notes there).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch.distributed.tensor import Placement

__all__ = [
    "RaggedShard",
    "ragged_ranges",
    "flat_range_to_boxes",
]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) of a rectangle


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

    def __fx_repr__(self) -> str:
        return repr(self)

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

    def local_range(self, shape: Sequence[int], rank: int) -> tuple[int, int]:
        """The flat element range ``[start, end)`` that ``rank`` holds."""
        return ragged_ranges(shape, self)[rank]

    def local_numel(self, shape: Sequence[int], rank: int) -> int:
        """Number of elements ``rank`` holds."""
        start, end = self.local_range(shape, rank)
        return end - start


def ragged_ranges(shape: Sequence[int], placement: RaggedShard) -> list[tuple[int, int]]:
    """Per-rank flat element ranges ``[start, end)`` of a tensor of ``shape``, in rank order.

    The ranges are contiguous, disjoint, in rank order, and cover ``[0, numel)`` exactly.
    """
    unit = placement.unit_numel(shape)
    ranges = []
    start = 0
    for u in placement.local_units:
        end = start + u * unit
        ranges.append((start, end))
        start = end
    return ranges


def flat_range_to_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """Decompose the row-major flat range ``[start, end)`` of ``shape`` into rectangles.

    Returns ``(offsets, sizes)`` boxes in flat order whose concatenation (each box flattened
    row-major) is exactly the range. A d-dim tensor needs at most ``2d - 1`` boxes (a partial
    head, a block of whole slices, a partial tail at each level), which is within the ``2^d - 1``
    bound that distributed-checkpoint chunk metadata allows for. An empty range gives ``[]``.
    """
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    if not 0 <= start <= end <= numel:
        raise ValueError(f"flat range [{start}, {end}) is outside a tensor of shape {shape}")
    if start == end:
        return []
    if len(shape) == 0:
        return [((), ())]
    return _boxes(shape, start, end)


def _boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    # Invariant: 0 <= start < end <= prod(shape), len(shape) >= 1.
    inner = math.prod(shape[1:])
    if len(shape) == 1:
        return [((start,), (end - start,))]
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(end, inner)
    out: list[Box] = []

    def prefixed(row: int, boxes: list[Box]) -> list[Box]:
        return [((row, *off), (1, *size)) for off, size in boxes]

    if r0 == r1:  # within one slice of dim 0
        return prefixed(r0, _boxes(shape[1:], c0, c1))
    if c0 > 0:  # partial head slice
        out += prefixed(r0, _boxes(shape[1:], c0, inner))
        r0 += 1
    if r1 > r0:  # whole slices
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0, *shape[1:])))
    if c1 > 0:  # partial tail slice
        out += prefixed(r1, _boxes(shape[1:], 0, c1))
    return out
