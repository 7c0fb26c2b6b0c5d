"""The smaller process groups of ``reshard_after_forward=<int>`` (FSDP2's post-forward mesh).

With ``reshard_after_forward=k`` a group keeps its parameters sharded over ``k`` ranks between
forward and backward, so that backward all-gathers among ``k`` ranks only. The ``k``-rank groups
are the rows of the shard group's ranks viewed as ``(-1, k)``: consecutive ranks, FSDP2's
``mesh.view(-1, k)``. Creating them is collective, so ``fully_shard`` does it at the call
(:func:`make_partial_group`), on every rank in the same order; they are cached per mesh and ``k``.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_vescale.mesh import MeshInfo

__all__ = ["make_partial_group", "partial_group"]

_PARTIAL_GROUPS: dict[tuple[DeviceMesh, int], tuple[dist.ProcessGroup, DeviceMesh]] = {}


def make_partial_group(mesh_info: MeshInfo, k: int) -> None:
    """Create (collectively, once per mesh and ``k``) the groups of ``k`` consecutive shard
    ranks that ``reshard_after_forward=k`` gathers in (FSDP2: ``mesh.view(-1, k)``).

    Every rank must call it at the same point (``fully_shard`` does): it creates process groups.
    """
    key = (mesh_info.mesh, k)
    if key in _PARTIAL_GROUPS:
        return
    ranks = mesh_info.mesh.mesh.reshape(-1, k)
    sub = DeviceMesh(mesh_info.device_type, ranks)
    _PARTIAL_GROUPS[key] = (sub.get_group(1), sub)


def partial_group(mesh_info: MeshInfo, k: int) -> tuple[dist.ProcessGroup, int]:
    """The group of ``k`` ranks this rank all-gathers in after ``reshard_after_forward=k``, and
    this rank's index in it."""
    make_partial_group(mesh_info, k)
    group, _ = _PARTIAL_GROUPS[(mesh_info.mesh, k)]
    return group, mesh_info.shard_rank % k
