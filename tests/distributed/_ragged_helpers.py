"""``RaggedShard`` DTensors cut from full tensors: what optimizer and layout tests build on ranks.

Every rank holds the same full tensors (same seed); these helpers give each rank its own slice
under a ``{name: RaggedShard}`` layout, as a DTensor on ``mesh``. On an N-D mesh the ragged dim
is the last one and the others replicate (HSDP's ``(Replicate(), RaggedShard)``); the slice is
the one of this rank's coordinate on that dim. :func:`count_collectives` counts the
``torch.distributed`` collectives a redistribution or a step calls.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_vescale.placement import RaggedShard, local_slice, ragged_from_local


def shard_rank(mesh: DeviceMesh) -> int:
    """This rank's coordinate on the ragged (last) mesh dim."""
    return mesh.get_local_rank(mesh.ndim - 1)


def ragged_tensor(full: torch.Tensor, layout: RaggedShard, mesh: DeviceMesh) -> DTensor:
    """This rank's ``RaggedShard`` DTensor of ``full`` (its slice cloned: owns its storage)."""
    placements = [Replicate()] * (mesh.ndim - 1) + [layout] if mesh.ndim > 1 else layout
    local = local_slice(full, layout, shard_rank(mesh)).clone()
    return ragged_from_local(local, mesh, placements, tuple(full.shape))


def expected_local(full: torch.Tensor, placement, rank: int, num_ranks: int) -> torch.Tensor:
    """The reference local tensor of ``full`` on ``rank`` of ``num_ranks`` under ``placement``
    (``RaggedShard``: the flat slice; ``Shard``: ``torch.chunk``'s piece, empty past the last;
    else the whole tensor), by plain torch slicing, independent of the code under test."""
    if isinstance(placement, RaggedShard):
        start, end = placement.local_range(full.shape, rank)
        return full.reshape(-1)[start:end]
    if isinstance(placement, Shard):
        chunks = full.chunk(num_ranks, dim=placement.dim)
        if rank < len(chunks):
            return chunks[rank]
        shape = list(full.shape)
        shape[placement.dim] = 0
        return full.new_empty(shape)
    return full


def ragged_params(full: dict[str, torch.Tensor], layouts: dict[str, RaggedShard],
                  mesh: DeviceMesh) -> dict[str, torch.nn.Parameter]:
    """``{name: Parameter(ragged_tensor(...))}`` for every full tensor."""
    return {n: torch.nn.Parameter(ragged_tensor(t, layouts[n], mesh)) for n, t in full.items()}


def set_ragged_grads(params: dict[str, torch.nn.Parameter], grads: dict[str, torch.Tensor],
                     layouts: dict[str, RaggedShard], mesh: DeviceMesh) -> None:
    """Give each parameter named in ``grads`` this rank's slice of its full gradient."""
    for n, g in grads.items():
        params[n].grad = ragged_tensor(g, layouts[n], mesh)


#: the ``torch.distributed`` functions :func:`count_collectives` counts
COLLECTIVES = ("all_to_all_single", "all_gather_single", "all_gather_into_tensor", "all_gather",
               "broadcast", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
               "all_reduce", "all_to_all", "send", "recv", "batch_isend_irecv")


@contextlib.contextmanager
def count_collectives(*, by_group_size: bool = False) -> Iterator[Counter]:
    """Count calls into the :data:`COLLECTIVES` inside the block, keyed by name, or with
    ``by_group_size`` by ``(name, size of the group called on)``."""
    counts: Counter = Counter()
    saved = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            key = (name, dist.get_world_size(kwargs.get("group"))) if by_group_size else name
            counts[key] += 1
            return fn(*args, **kwargs)
        return counted

    for n, fn in saved.items():
        setattr(dist, n, wrap(n, fn))
    try:
        yield counts
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)
