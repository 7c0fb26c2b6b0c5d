"""Layer 5: ``sync_module_states`` — every rank starts from global rank 0's initial weights.

Design note [sync-module-states]
--------------------------------
DDP broadcasts rank 0's parameters and buffers when it wraps a model, so an unseeded run (each
rank drew different random weights) still trains one model. Sharding keeps each rank's own slice
of its own initialisation, so without a broadcast an unseeded sharded run starts from a model
that no rank ever built: rows from rank 0's draw next to rows from rank 1's. With
``sync_module_states=True`` (the strategies' default) :func:`broadcast_module_states` runs just
before sharding and copies rank 0's values to every rank:

* plain tensors (the usual case: the module is built whole, then sharded): broadcast along each
  dimension of the strategy's mesh in turn, from coordinate 0 of that dimension, over the mesh's
  own groups. After dim ``d`` every rank holds the value of the rank with coordinates
  ``(0, ..., 0, c_{d+1}, ...)``; after the last dim, global mesh rank 0's. A 1-D mesh is one
  broadcast over the world; an HSDP ``(replicate, shard)`` mesh two.
* tensors already sharded by the user's ``fully_shard`` in ``configure_model`` (``DTensor``):
  each local piece is broadcast along the mesh dims it is replicated on only (ranks that hold
  different pieces keep them).
* tensor-parallel parameters (DTensors on ``mesh["tensor_parallel"]`` of the strategy's
  ``(data_parallel, tensor_parallel)`` mesh, design note [strategy-tp-mesh]): each local TP
  piece along the data-parallel dim (the ranks of one TP coordinate hold the same piece; on the
  HSDP + TP mesh ``(dp_replicate, dp_shard, tensor_parallel)`` along both data-parallel dims),
  then along the tp dim only where it is ``Replicate()`` (sequence-parallel norms, biases).
* meta tensors (``init_module(empty_init=True)``, meta-device ``configure_model``) hold no values:
  they are materialised shard by shard after sharding, each rank initialising its own shard, so
  they are not synchronised; seed the run (``seed_everything``) for a reproducible start. An
  empty-init model is initialised shard-wise, so its initial weights differ from a model built
  with ``empty_init=False`` under the same seed (the random draws are consumed in another order).

Cost: one broadcast per tensor of the whole model, once, before training (the volume of one
all-gather): 13 ms for the README demo model (106k parameters, 28 tensors, 2 ranks, gloo, CPU;
median of 5), against ~10 s for the demo's fit, so it is on by default.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.nn import Module

from lightning_vescale._lightning.sharding import validate_bool
from lightning_vescale.mesh import broadcast_anywhere

__all__ = ["broadcast_module_states", "validate_sync_module_states"]


def validate_sync_module_states(value: Any) -> bool:
    """The ``sync_module_states`` argument: a ``bool`` (YAML ``true``/``false``/``yes``/``no``)."""
    return validate_bool(
        "sync_module_states", value, "True (default) broadcasts global rank 0's parameters and "
        "buffers before sharding, as DDP does; False keeps each rank's own initialisation (seed "
        "the run so that they agree).")


def _unique_states(module: Module) -> list[Tensor]:
    seen: set[int] = set()
    out: list[Tensor] = []
    for t in (*module.parameters(), *module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


@torch.no_grad()
def broadcast_module_states(module: Module, mesh: DeviceMesh) -> int:
    """Copy mesh rank 0's parameters and buffers of ``module`` to every rank, in place.

    Collective over ``mesh`` (every rank must call it with the same module structure). Returns
    the number of tensors broadcast (meta tensors are skipped; see [sync-module-states]).
    """
    if mesh.size() == 1:
        return 0
    dims = list(range(mesh.ndim))
    count = 0
    for t in _unique_states(module):
        if t.is_meta:
            continue
        if isinstance(t, DTensor):
            local = t.to_local()
            if local.is_meta:
                continue
            groups = _dtensor_groups(t, mesh)
        else:
            local = t.data
            groups = [mesh.get_group(d) for d in dims if mesh.size(d) > 1]
        for group in groups:
            _broadcast(local, group, mesh)
        count += 1
    return count


def _dtensor_groups(t: DTensor, mesh: DeviceMesh) -> list[Any]:
    """The groups a DTensor's local piece is broadcast over, in order: on ``mesh`` itself its
    replicated dims; on a named sub-mesh of ``mesh`` (a TP parameter on ``mesh["tensor_parallel"]``
    of the ``(data_parallel, tensor_parallel)`` mesh) first every dim of ``mesh`` it does not
    live on (the ranks there hold the same piece), then its own replicated dims."""
    own = t.device_mesh
    replicated = [own.get_group(d) for d, p in enumerate(t.placements)
                  if isinstance(p, Replicate) and own.size(d) > 1]
    names, own_names = mesh.mesh_dim_names or (), own.mesh_dim_names or ()
    if own == mesh or not own_names or not set(own_names) < set(names):
        return replicated
    others = [mesh.get_group(d) for d, n in enumerate(names)
              if n not in own_names and mesh.size(d) > 1]
    return others + replicated


def _broadcast(tensor: Tensor, group: Any, mesh: DeviceMesh) -> None:
    """Broadcast from the group's first rank (mesh coordinate 0 of that dimension); a
    CPU-offloaded shard on a plain NCCL mesh goes through the mesh's device ([mesh-device])."""
    if tensor.is_contiguous():
        broadcast_anywhere(tensor, group_src=0, group=group, mesh=mesh)
    else:
        buf = tensor.contiguous()
        broadcast_anywhere(buf, group_src=0, group=group, mesh=mesh)
        tensor.copy_(buf)
