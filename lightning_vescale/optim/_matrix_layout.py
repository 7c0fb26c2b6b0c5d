"""Layer 4: which whole matrices of a parameter a rank preconditions (SOAP, Shampoo), and how
their states are exported to and imported from distributed checkpoint (design note
[distributed-soap])."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from lightning_vescale.optim._base import ShardLayout, local_view, param_layout
from lightning_vescale.optim._kronecker import split_sizes
from lightning_vescale.placement import RaggedShard, ragged_from_local

__all__ = ["MatrixLayout", "matrix_layout"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MatrixLayout:
    """The matrices of one parameter that this rank steps.

    ``count`` matrices of ``unit_shape`` (``(m, n)``, ``(n,)`` for a preconditioned vector, or
    ``(local elements,)`` with nothing preconditioned: element-wise), the first being matrix
    ``first`` of ``total``; ``counts``: matrices per shard rank. ``owned``: the parameter's
    matrices are split across ranks, so this rank *owns* matrices ``[first, first + count)``
    (contiguous: owners never decrease along the tensor) and receives their gradients with one
    all-to-all (``recv_splits`` elements from each rank; it sends ``send_splits`` of its local
    shard to each), and sends the updates back the same way.
    """

    unit_shape: tuple[int, ...]
    preconditioned: tuple[bool, ...]
    count: int
    first: int
    total: int
    counts: tuple[int, ...]
    layout: ShardLayout
    owned: bool = False
    send_splits: tuple[int, ...] = ()
    recv_splits: tuple[int, ...] = ()

    @property
    def unit_numel(self) -> int:
        return math.prod(self.unit_shape)

    def export(self, key: str, value: Any) -> Any:
        """A state for ``state_dict``: DTensors of the parameter's global shape split as the
        ranks step them (moments: in the parameter's layout when its matrices are whole, by
        owner otherwise) and factors split over the matrix dimension the same way."""
        if key == "step" or not isinstance(value, Tensor):
            return value
        lay = self.layout
        if lay.mesh is None or lay.placement is None:
            return value.view(lay.shape) if key in _MOMENTS else value
        if key in _MOMENTS and not self.owned:
            return lay.to_dtensor(value)
        assert lay.mesh_info is not None
        placements = list(lay.placements)
        mesh = lay.mesh
        if lay.tp is not None:  # by owner over the owner mesh ((dp_replicate,) dp x tp):
            mesh = lay.mesh_info.mesh  # design note [tp-matrix-optim]
            placements = [Replicate()] * mesh.ndim
        if key in _MOMENTS:
            split = RaggedShard(tuple(range(len(lay.shape))),
                                [c * self.unit_numel for c in self.counts])
            shape: tuple[int, ...] = lay.shape
        else:
            split = RaggedShard((0,), list(self.counts))
            shape = (self.total, *value.shape[1:])
        placements[lay.mesh_info.shard_mesh_dim] = split
        return ragged_from_local(value.reshape(-1), mesh, placements, shape, autograd=False)

    def import_(self, key: str, value: Any, p: Tensor, name: str, who: str = "SOAP") -> Any:
        """A saved state as this rank steps it (see :meth:`export`; full single-process states
        and DTensors in another layout, which are gathered, are accepted)."""
        if key == "step":
            return value.detach().float().cpu().clone() if isinstance(value, Tensor) else \
                torch.tensor(float(value))
        if not isinstance(value, Tensor):
            return value
        device = local_view(p.detach()).device
        if key in _MOMENTS:
            if value.numel() != self.layout.numel:
                raise ValueError(f"{who}.load_state_dict: state {key!r} of parameter {name} has "
                                 f"{value.numel()} elements, the parameter {self.layout.numel}; "
                                 "was it saved for another model?")
            if self.owned:
                full = value.full_tensor() if isinstance(value, DTensor) else value
                u = self.unit_numel
                part = full.detach().reshape(-1)[self.first * u:(self.first + self.count) * u]
                return part.float().to(device).clone()
            local = self.layout.local_part(value)
            return local.detach().reshape(-1).float().to(device).clone()
        held = value.shape[0] if value.dim() else 0
        # A DTensor holds all the matrices (its global shape: the same check on every rank,
        # before its gather); a plain tensor all of them or this rank's.
        if held != self.total and (isinstance(value, DTensor) or held != self.count):
            raise ValueError(f"{who}.load_state_dict: state {key!r} of parameter {name} holds "
                             f"{held} matrices, expected {self.total}; was it saved "
                             "with another max_precond_dim or model?")
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if held == self.total and self.count != self.total:
            full = full[self.first:self.first + self.count]
        return full.detach().float().to(device).clone()


def matrix_layout(p: Tensor, *, max_precond_dim: int, precondition_1d: bool, name: str,
                  owners: tuple[int, ...] | None = None,
                  block: int | None = None) -> MatrixLayout:
    """How ``p`` is stepped on this rank (design note [distributed-soap]). ``owners``: matrices
    owned per shard rank for a parameter whose matrices are split (:func:`assign_owners`);
    required then. ``block``: the optimizer cuts large matrices into tiles of at most ``block``
    (Shampoo, design note [shampoo-blocks]), so every matrix dimension is preconditioned."""
    layout = param_layout(p, where=name)
    unit, pre = _unit(tuple(p.shape), max_precond_dim, precondition_1d, block)
    ranks = len(layout.ranges)
    if not any(pre):  # element-wise: any layout is local
        n = layout.local_numel
        return MatrixLayout(unit_shape=(n,), preconditioned=(False,), count=1, first=0, total=1,
                            counts=(1,) * ranks, layout=layout)
    unit_numel = max(math.prod(unit), 1)
    total = layout.numel // unit_numel if layout.numel else 0
    if layout.placement is None:
        return MatrixLayout(unit_shape=unit, preconditioned=pre, count=total, first=0,
                            total=total, counts=(total,), layout=layout)
    if layout.tp is not None and layout.tp.permutes and total > 1:
        raise NotImplementedError(
            f"{name} (shape {tuple(p.shape)}) is a stack of {total} matrices, tensor-parallel "
            f"with {p.placements[-1]} (design note [tp-matrix-optim]): only Shard(0) (the stack "
            "dim) is supported for stacks. Shard the stack dim, or use torch.optim.AdamW for "
            "this parameter.")
    if is_whole(layout.ranges, unit_numel):
        counts = tuple((b - a) // unit_numel for a, b in layout.ranges)
        return MatrixLayout(unit_shape=unit, preconditioned=pre, count=counts[layout.rank],
                            first=layout.start // unit_numel, total=total, counts=counts,
                            layout=layout)
    assert owners is not None and sum(owners) == total, "split matrices need an owner plan"
    starts = [sum(owners[:r]) * unit_numel for r in range(ranks + 1)]
    mine = (starts[layout.rank], starts[layout.rank + 1])
    send = tuple(_overlap(layout.ranges[layout.rank], (starts[r], starts[r + 1]))
                 for r in range(ranks))
    recv = tuple(_overlap(mine, layout.ranges[r]) for r in range(ranks))
    return MatrixLayout(unit_shape=unit, preconditioned=pre, count=owners[layout.rank],
                        first=sum(owners[:layout.rank]), total=total, counts=tuple(owners),
                        layout=layout, owned=True, send_splits=send, recv_splits=recv)


def _unit(shape: tuple[int, ...], max_precond_dim: int, precondition_1d: bool,
          block: int | None = None) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """The matrix (or vector) a tensor of ``shape`` is a stack of, and which of its dims are
    preconditioned (all of a matrix's when it is cut into ``block`` tiles)."""
    if len(shape) >= 2:
        unit = shape[-2:]
        return unit, tuple(block is not None or d <= max_precond_dim for d in unit)
    if len(shape) == 1:
        return shape, (bool(precondition_1d) and shape[0] <= max_precond_dim,)
    return (1,), (False,)


def needs_owners(p: Tensor, *, max_precond_dim: int, precondition_1d: bool, name: str,
                 block: int | None = None) -> tuple[tuple[tuple[int, int], ...], int,
                                                     float] | None:
    """For a parameter whose preconditioned matrices are split across ranks: its ranks'
    ranges, the matrix size and the cost of one matrix (``m n (m + n)``, the projections, summed
    over the tiles when cut into ``block`` tiles); ``None`` when every rank steps its own
    (whole matrices, element-wise, unsharded)."""
    layout = param_layout(p, where=name)
    unit, pre = _unit(tuple(p.shape), max_precond_dim, precondition_1d, block)
    unit_numel = max(math.prod(unit), 1)
    if not any(pre) or layout.placement is None or is_whole(layout.ranges, unit_numel):
        return None
    if block is None or len(unit) != 2:
        return layout.ranges, unit_numel, float(unit_numel * sum(unit))
    return layout.ranges, unit_numel, float(sum(r * c * (r + c)
                                                for r in split_sizes(unit[0], block)
                                                for c in split_sizes(unit[1], block)))


def is_whole(ranges: tuple[tuple[int, int], ...], unit_numel: int) -> bool:
    """Every rank's range starts and ends on a matrix boundary."""
    return all(a % unit_numel == 0 and b % unit_numel == 0 for a, b in ranges)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def assign_owners(items: list[tuple[tuple[tuple[int, int], ...], int, float]],
                  ranks: int) -> list[tuple[int, ...]]:
    """Owners of the split matrices of several parameters, balanced across ranks.

    Each matrix goes to one of the ranks holding most of it (fewest bytes moved), the least
    loaded of them so far (ties: lowest rank), never to a rank below the previous matrix's
    owner in the same parameter (so each rank owns a contiguous run). A pure function of the
    layouts: every rank computes the same plan. Returns matrices owned per rank, per item."""
    load = [0.0] * ranks
    plans = []
    for ranges, unit, cost in items:
        total = (ranges[-1][1] if ranges else 0) // unit
        counts = [0] * ranks
        floor = 0
        for j in range(total):
            span = (j * unit, (j + 1) * unit)
            held = [_overlap(span, ranges[r]) if r >= floor else -1 for r in range(ranks)]
            best = max(held)
            owner = min((r for r in range(ranks) if held[r] == best),
                        key=lambda r: (load[r], r))
            counts[owner] += 1
            load[owner] += cost
            floor = owner
        plans.append(tuple(counts))
    return plans
