"""``RaggedShard`` DTensors cut from full tensors: what optimizer and layout tests build on ranks.

Every rank holds the same full tensors (same seed); these helpers give each rank its own slice
under a ``{name: RaggedShard}`` layout, as a DTensor on ``mesh``. On an N-D mesh the ragged dim
is the last one and the others replicate (HSDP's ``(Replicate(), RaggedShard)``); the slice is
the one of this rank's coordinate on that dim.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from lightning_vescale.placement import RaggedShard, local_slice, ragged_from_local


def shard_rank(mesh: DeviceMesh) -> int:
    """This rank's coordinate on the ragged (last) mesh dim."""
    return mesh.get_local_rank(mesh.ndim - 1)


def ragged_tensor(full: torch.Tensor, layout: RaggedShard, mesh: DeviceMesh) -> DTensor:
    """This rank's ``RaggedShard`` DTensor of ``full`` (its slice cloned: owns its storage)."""
    placements = [Replicate()] * (mesh.ndim - 1) + [layout] if mesh.ndim > 1 else layout
    local = local_slice(full, layout, shard_rank(mesh)).clone()
    return ragged_from_local(local, mesh, placements, tuple(full.shape))


def ragged_params(full: dict[str, torch.Tensor], layouts: dict[str, RaggedShard],
                  mesh: DeviceMesh) -> dict[str, torch.nn.Parameter]:
    """``{name: Parameter(ragged_tensor(...))}`` for every full tensor."""
    return {n: torch.nn.Parameter(ragged_tensor(t, layouts[n], mesh)) for n, t in full.items()}


def set_ragged_grads(params: dict[str, torch.nn.Parameter], grads: dict[str, torch.Tensor],
                     layouts: dict[str, RaggedShard], mesh: DeviceMesh) -> None:
    """Give each parameter named in ``grads`` this rank's slice of its full gradient."""
    for n, g in grads.items():
        params[n].grad = ragged_tensor(g, layouts[n], mesh)
