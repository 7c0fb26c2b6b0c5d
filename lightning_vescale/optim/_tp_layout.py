"""Layer 4: the layout of a tensor-parallel ``fully_shard`` parameter for the whole-matrix
optimizers (Muon, SOAP, Shampoo).

Design note [tp-matrix-optim]
-----------------------------
A ``fully_shard`` parameter over a TP plan (design note [fsdp-tp]) is a DTensor on the 2-D
``(dp, tp)`` mesh with placements ``(RaggedShard, Shard(k))`` or ``(RaggedShard, Replicate())``.
Muon's Newton–Schulz and SOAP/Shampoo's factors need the *whole global* matrix, as one process
steps it, not each TP shard. We keep the owner scheme of [distributed-muon] /
[distributed-soap] and widen its group from dp to **every rank of the (dp, tp) mesh**: each
matrix is gathered to one owner rank over both dims at once (one ``all_to_all_single`` on the
flattened mesh, ``DeviceMesh._flatten``), stepped there and its update sent back the same way.
The alternative, a TP-aware exchange that keeps a matrix split over tp (NS through
distributed matmuls, factors reduced over tp), moves the same bytes for the gradient but several
rounds of ``m x m`` products per NS iteration and is not exact; gathering is.

*Virtual order.* All the optimizers' range arithmetic (owner plans, buckets, split sizes) is on
flat ranges of one tensor. Rank ``(d, t)`` holds a flat range ``[s, e)`` of its *TP-local* box
(``Shard(k)``'s chunk ``t``, torch's shard math); listing the boxes one after the other in tp
order, each row-major, gives a *virtual* flat order in which every rank holds one contiguous
range ``V_t + [s, e)`` and the ranges tile ``[0, numel)``. For ``Shard(0)`` the virtual order
is the global row-major order (the boxes are consecutive row blocks); for ``Shard(1)`` of a
matrix it is column block after column block. So every rank's range is known as in 1-D, with
two differences :class:`TPOrder` handles: the flattened group's rank order (``d * tp + t``) is
not the virtual order (pieces are put in virtual order by their start before use: sorting by
range start, a no-op for a 1-D mesh), and for ``Shard(k >= 1)`` the owner turns the virtual
matrix into the global one (:meth:`TPOrder.to_global`, the boxes copied into place) before the
maths and back after (:meth:`TPOrder.from_global`). Stacks of matrices (3+-D parameters) are
supported with ``Shard(0)`` only (the virtual order is then the global one, so each matrix is a
contiguous virtual range); other TP placements of stacks raise ``NotImplementedError`` naming
the parameter.

*Every rank's range.* A rank knows its own ``RaggedShard`` only: with uneven TP shards (or a
group holding one) the planner may lay out another tp coordinate's TP-local tensor differently.
So the ranges are gathered once per parameter, one ``all_gather`` of two integers per parameter
over the flattened group, batched per optimizer at construction (:func:`register_tp_params`,
called by ``ShardedOptimizer.add_param_group``: the constructor is collective, as every
``fully_shard`` call is) and cached per parameter object; a layout asked for a parameter not
registered gathers then (every rank must ask, in the same order: the optimizers' steps do).

*Bytes* (per step, a matrix of ``m n`` elements over ``dp x tp`` ranks): the owner receives the
``m n (1 - 1/(dp tp))`` elements it does not hold and sends as many back (Muon: bf16, 2 bytes
each way; SOAP/Shampoo: fp32 gradient in, fp32 update back), plus [owner-failure]'s one marker
per destination. That is what the same matrix costs on a 1-D mesh of ``dp x tp`` ranks, and no
other collective runs. TP-``Replicate()`` parameters (norms, a replicated bias) are ordinary:
their layout is the dp dim's (group: the dp ranks of this tp coordinate); replicas step the
same data alike.

*States* stay where the step puts them: Muon's momentum and SOAP/Shampoo's moments of local
matrices are DTensors with the parameter's own ``(RaggedShard, Shard(k))`` placements; states
of owned matrices (SOAP/Shampoo factors, moments of split matrices) are ``RaggedShard`` DTensors
over the flattened mesh, in global matrix order. Distributed checkpoint saves them all as global
tensors, so it reshards them: tested loading at the same mesh, at dp 4 without TP, into one
process (``full=True``) and from one process's ``state_dict()``, bitwise each time; other
(dp, tp) shapes (e.g. (1, 2)) are untested.

*HSDP + TP* (3-D ``(dp_replicate, dp_shard, tp)`` meshes, placements ``(Replicate(),
RaggedShard, Shard(k) | Replicate())``: ``fully_shard(mesh=mesh["dp_replicate",
"dp_shard"])`` over TP DTensors) does what plain HSDP does for these optimizers (design note
[hsdp]: ranges and owners are the shard group's, replicas hold the same shards after the
gradient all-reduce and step them alike): each replica runs the scheme above over its own
``(dp_shard, tp)`` ranks. The exchange group is the flattened ``mesh["dp_shard", "tp"]``
(:func:`flat_mesh`; rank ``s * tp + t``, the same virtual order), the ranges are gathered over
it, and the owners, the all-to-all and [owner-failure]'s agreement stay inside one replica; the
replicas compute the same updates redundantly (as element-wise optimizers do under HSDP) and
nothing crosses ``dp_replicate`` in the step. ``MeshInfo`` reads the *owner mesh*
(:func:`owner_mesh`): the 2-D ``(dp_replicate, dp_shard x tp)`` mesh, concatenated from
existing sub-meshes (``DeviceMesh._concatenate``: no new process group), as an HSDP mesh, so
the shard group is the flattened one and owned states are ``(Replicate(), RaggedShard)`` on it;
states of local matrices keep the parameter's three placements; ``Replicate()`` on tp
parameters take the ``(dp_replicate, dp_shard)`` mesh's layout. Bytes per rank are those of the
2-D case over ``dp_shard x tp`` ranks. Tested at ``(2, 2, 2)`` and ``(2, 1, 2)``: bitwise one
process fed the same gradients, ``save_sharded``/``load_sharded`` at the same mesh and the full
state into one process bitwise; loading at another mesh is untested.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from lightning_vescale.mesh import MeshInfo, mesh_device
from lightning_vescale.placement import RaggedShard, ragged_ranges
from lightning_vescale.placement._common import all_gather_flat

__all__ = ["TPOrder", "is_tp", "register_tp_params", "tp_layout_parts"]


def is_tp(placements: Sequence[Placement]) -> bool:
    """A ``RaggedShard`` beside a TP placement: ``(RaggedShard, Shard(k) | Replicate())`` on a
    2-D mesh, or anything with a ``RaggedShard`` and a ``Shard`` (refused by the layouts)."""
    placements = tuple(placements)
    ragged = [d for d, p in enumerate(placements) if isinstance(p, RaggedShard)]
    if not ragged:
        return False
    return any(type(p) is Shard for p in placements) or ragged[0] != len(placements) - 1


def _slices(offsets: Sequence[int], sizes: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes))


@dataclass(frozen=True, kw_only=True, eq=False)
class TPOrder:
    """The virtual flat order of a ``(RaggedShard, Shard(k))`` parameter (design note
    [tp-matrix-optim]): the TP-local boxes in tp order, each row-major."""

    shape: tuple[int, ...]
    boxes: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # per tp coordinate
    starts: tuple[int, ...]  # each box's first virtual element
    tp_rank: int  # this rank's tp coordinate
    permutes: bool  # the virtual order differs from the global row-major one

    def local_part(self, full: Tensor, start: int, end: int) -> Tensor:
        """This rank's flat part of the full (global) tensor; ``[start, end)``: its virtual
        range."""
        offsets, sizes = self.boxes[self.tp_rank]
        box = full.reshape(self.shape)[_slices(offsets, sizes)].reshape(-1)
        base = self.starts[self.tp_rank]
        return box[start - base:end - base]

    def to_global(self, virtual: Tensor) -> Tensor:
        """The whole tensor in virtual order (flat) -> global row-major (flat); an empty span
        (a rank that owns nothing) as it is."""
        if not self.permutes or virtual.numel() == 0:
            return virtual
        out = virtual.new_empty(self.shape)
        for (offsets, sizes), at in zip(self.boxes, self.starts):
            n = math.prod(sizes)
            out[_slices(offsets, sizes)] = virtual[at:at + n].view(sizes)
        return out.reshape(-1)

    def from_global(self, flat: Tensor) -> Tensor:
        """Inverse of :meth:`to_global`."""
        if not self.permutes or flat.numel() == 0:
            return flat
        full = flat.reshape(self.shape)
        return torch.cat([full[_slices(o, s)].reshape(-1) for o, s in self.boxes])

    @staticmethod
    def by_start(ranges: Sequence[tuple[int, int]]) -> list[int]:
        """Ranks in virtual order of their ranges (empty ones anywhere: they add nothing)."""
        return sorted(range(len(ranges)), key=lambda r: tuple(ranges[r]))

    def gather(self, pieces: Sequence[Tensor], ranges: Sequence[tuple[int, int]]) -> Tensor:
        """Per source rank (in group order), its piece of a span that the pieces tile -> the
        span in virtual order, then global (a whole tensor when :attr:`permutes`)."""
        virtual = torch.cat([pieces[r] for r in self.by_start(ranges)])
        return self.to_global(virtual)

    def scatter(self, flat: Tensor, sizes: Sequence[int],
                ranges: Sequence[tuple[int, int]]) -> Tensor:
        """Inverse of :meth:`gather`: the span (global order) cut into the source ranks' pieces
        (``sizes`` in group order), concatenated in group order."""
        order = self.by_start(ranges)
        parts = torch.split(self.from_global(flat), [sizes[r] for r in order])
        back: list[Tensor] = [None] * len(sizes)  # type: ignore[list-item]
        for r, part in zip(order, parts):
            back[r] = part
        return torch.cat(back)


def _boxes(shape: tuple[int, ...], k: int, tp: int) -> tuple[tuple[tuple[int, ...],
                                                                  tuple[int, ...]], ...]:
    out = []
    for t in range(tp):
        size, offset = Shard.local_shard_size_and_offset(shape[k], tp, t)
        sizes = shape[:k] + (int(size),) + shape[k + 1:]
        offsets = tuple(int(offset) if d == k else 0 for d in range(len(shape)))
        out.append((offsets, sizes))
    return tuple(out)


# Every rank's (start, end) inside its TP-local box, per parameter object (design note
# [tp-matrix-optim]): id -> (weak reference, spec key, ranges in flattened-group order).
_RANGES: dict[int, tuple[Any, tuple, tuple[tuple[int, int], ...]]] = {}


def _key(p: DTensor) -> tuple:
    # the process too: a forked child must not trust its parent's entries
    return (os.getpid(), id(p.device_mesh), tuple(p.placements), tuple(p.shape))


def _cached(p: DTensor) -> tuple[tuple[int, int], ...] | None:
    hit = _RANGES.get(id(p))
    if hit is None or hit[0]() is not p or hit[1] != _key(p):
        return None
    return hit[2]


def tp_dims(mesh: DeviceMesh, placements: Sequence[Placement]) -> tuple[int, int] | None:
    """The (ragged, tp) mesh dims of a whole-matrix TP parameter: ``(0, 1)`` for
    ``(RaggedShard, Shard(k) | Replicate())`` on a 2-D ``(dp, tp)`` mesh, ``(1, 2)`` for
    ``(Replicate(), RaggedShard, Shard(k) | Replicate())`` on a 3-D HSDP + TP
    ``(dp_replicate, dp_shard, tp)`` mesh; ``None`` for anything else."""
    placements = tuple(placements)
    if mesh.ndim != len(placements) or mesh.ndim not in (2, 3):
        return None
    if mesh.ndim == 3 and not isinstance(placements[0], Replicate):
        return None
    d = mesh.ndim - 2
    tp = placements[d + 1]
    if not isinstance(placements[d], RaggedShard) or not (
            type(tp) is Shard or isinstance(tp, Replicate)):
        return None
    return d, d + 1


def _sharded_tp(p: Tensor) -> bool:
    if not isinstance(p, DTensor):
        return False
    dims = tp_dims(p.device_mesh, p.placements)
    return dims is not None and type(p.placements[dims[1]]) is Shard


def _own_range(p: DTensor) -> tuple[int, int]:
    mesh, placements = p.device_mesh, tuple(p.placements)
    dims = tp_dims(mesh, placements)
    assert dims is not None
    d, k = dims
    ragged, shard = placements[d], placements[k]
    assert isinstance(ragged, RaggedShard) and type(shard) is Shard
    _, sizes = _boxes(tuple(p.shape), shard.dim, mesh.size(k))[mesh.get_local_rank(k)]
    start, end = ragged.local_range(sizes, mesh.get_local_rank(d))
    return int(start), int(end)


def register_tp_params(params: Iterable[Tensor]) -> None:
    """Gather every rank's range of each ``(RaggedShard, Shard(k))`` parameter not cached yet:
    one ``all_gather`` per flattened mesh (a collective: every rank of the mesh calls, with the
    same parameters in the same order)."""
    todo: dict[int, tuple[DeviceMesh, list[DTensor]]] = {}
    for p in params:
        if _sharded_tp(p) and _cached(p) is None:
            flat = flat_mesh(p.device_mesh)
            todo.setdefault(id(flat), (flat, []))[1].append(p)
    for flat, ps in todo.values():
        device = mesh_device(flat)
        mine = torch.tensor([_own_range(p) for p in ps], dtype=torch.int64, device=device)
        out = mine.new_empty(flat.size() * mine.numel())
        all_gather_flat(out, mine.reshape(-1), flat.get_group(), flat)
        table = out.view(flat.size(), len(ps), 2).cpu().tolist()
        if len(_RANGES) > 4096:  # drop the entries of parameters that are gone
            for k in [k for k, v in _RANGES.items() if v[0]() is None]:
                del _RANGES[k]
        for j, p in enumerate(ps):
            _RANGES[id(p)] = (weakref.ref(p), _key(p), tuple(tuple(table[r][j])
                                                            for r in range(flat.size())))


def flat_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh over the ranks one matrix is exchanged among: every rank of a 2-D
    ``(dp, tp)`` ``mesh`` (rank ``d * tp + t``), or every rank of this replica's
    ``(dp_shard, tp)`` sub-mesh of a 3-D HSDP + TP one (rank ``s * tp + t``).
    ``DeviceMesh._flatten``, created on first use (collectively) and cached by torch."""
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError(f"tensor-parallel parameters need a named (dp, tp) or (dp_replicate, "
                         f"dp_shard, tp) mesh, got {mesh}")
    return (mesh if mesh.ndim == 2 else mesh[names[-2], names[-1]])._flatten()


# The owner mesh of a 3-D HSDP + TP mesh, per flattened (dp_shard, tp) mesh: (pid, id) ->
# (the flattened mesh, kept alive so that its id is not reused, the owner mesh).
_OWNER_MESHES: dict[tuple[int, int], tuple[DeviceMesh, DeviceMesh]] = {}


def owner_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh of the owner exchange and of owned states (design note [tp-matrix-optim]):
    :func:`flat_mesh` for a 2-D ``(dp, tp)`` mesh; for a 3-D HSDP + TP mesh the 2-D
    ``(dp_replicate, dp_shard x tp)`` mesh (``DeviceMesh._concatenate`` of existing
    sub-meshes: no new process group), so that ``MeshInfo`` reads it as an HSDP mesh: the
    exchange runs in its shard dim (one replica), states replicate over dp_replicate."""
    flat = flat_mesh(mesh)
    if mesh.ndim == 2:
        return flat
    key = (os.getpid(), id(flat))
    hit = _OWNER_MESHES.get(key)
    if hit is None or hit[0] is not flat:
        names = mesh.mesh_dim_names
        assert names is not None
        hit = (flat, DeviceMesh._concatenate([mesh[names[0]], flat]))
        _OWNER_MESHES[key] = hit
    return hit[1]


def tp_layout_parts(p: DTensor, *, where: str) -> dict[str, Any]:
    """The :class:`~lightning_vescale.optim._base.ShardLayout` fields of a tensor-parallel
    ``fully_shard`` parameter (design note [tp-matrix-optim]).

    Raises:
        NotImplementedError: another mesh or placement than ``(RaggedShard, Shard(k) |
            Replicate())`` on a 2-D ``(dp, tp)`` mesh or ``(Replicate(), RaggedShard,
            Shard(k) | Replicate())`` on a 3-D HSDP + TP mesh.
        ValueError: a mesh without dimension names.
    """
    mesh, placements = p.device_mesh, tuple(p.placements)
    shape = tuple(p.shape)
    dims = tp_dims(mesh, placements)
    if dims is None:
        raise NotImplementedError(
            f"{where} (shape {shape}) has placements {placements} on a {mesh.ndim}-D mesh; "
            "tensor-parallel parameters are supported with (RaggedShard, Shard(k) | "
            "Replicate()) on a (dp, tp) mesh or (Replicate(), RaggedShard, Shard(k) | "
            "Replicate()) on an HSDP + TP (dp_replicate, dp_shard, tp) mesh only (design note "
            "[tp-matrix-optim]). Use torch.optim.AdamW (element-wise) for them.")
    d, k = dims
    ragged = placements[d]
    assert isinstance(ragged, RaggedShard)
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError(f"{where}: the tensor-parallel mesh {mesh} must have dimension names")
    if isinstance(placements[k], Replicate):  # a replicated norm: the dp (HSDP) mesh's layout
        info = MeshInfo.from_mesh(mesh[names[:k]])
        ranges = tuple(tuple(r) for r in _ragged_ranges(shape, ragged))
        return dict(ranges=ranges, placement=ragged, rank=info.shard_rank, mesh_info=info,
                    tp=None)
    tp = mesh.size(k)
    boxes = _boxes(shape, placements[k].dim, tp)
    starts, at = [], 0
    for _, sizes in boxes:
        starts.append(at)
        at += math.prod(sizes)
    local = _cached(p)
    if local is None:
        register_tp_params([p])
        local = _cached(p)
        assert local is not None
    ranges = tuple((starts[r % tp] + s, starts[r % tp] + e) for r, (s, e) in enumerate(local))
    info = MeshInfo.from_mesh(owner_mesh(mesh))
    shard_dim = placements[k].dim
    order = TPOrder(shape=shape, boxes=boxes, starts=tuple(starts), tp_rank=mesh.get_local_rank(k),
                    permutes=shard_dim != 0 and any(n > 1 for n in shape[:shard_dim]))
    return dict(ranges=ranges, placement=ragged, rank=info.shard_rank, mesh_info=info, tp=order)


def _ragged_ranges(shape: tuple[int, ...], ragged: RaggedShard) -> list[tuple[int, int]]:
    return [(int(s), int(e)) for s, e in ragged_ranges(shape, ragged)]
