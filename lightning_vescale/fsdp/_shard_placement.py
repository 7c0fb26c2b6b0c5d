"""FSDP2's ``shard_placement_fn`` and ``dp_mesh_dims`` read for a RaggedShard engine.

Design note [fsdp-shard-placement]
----------------------------------
FSDP2 lets ``shard_placement_fn(param)`` choose each parameter's layout: ``None`` (the default
``Shard(0)``), a ``Shard(d)``, or a ``ShardPlacementResult(placement, mesh_info)`` that also
picks the parameter's mesh (torchtitan: ``Shard(1)`` for an ``(E, out, in)`` expert stack when
there are fewer experts than ranks, a mesh of its own for the experts under expert parallelism).
Here every parameter is a ``RaggedShard`` range of its row-major elements; what a user asks of
``Shard(d)`` that a range can keep is what ``Shard(d)`` never splits: the sub-tensors
``x[i_0, ..., i_d, :, ..., :]`` of the dims after ``d``, ``prod(shape[d+1:])`` elements each.
So ``Shard(d)`` becomes that many elements of granularity (rank ranges start and end on those
units): rows for ``d = 0`` of a matrix, each expert's whole matrix for ``d = 0`` of an
``(E, out, in)`` stack, each expert's rows for ``d = 1`` (what ``Shard(1)`` itself keeps: it
splits every expert's matrix across the ranks, so a whole matrix on one rank would keep *more*
than asked and bring back the imbalance torchtitan chose ``Shard(1)`` to avoid). It combines
with the ``granularity`` argument by least common multiple, so both promises hold (the default
granularity's 256-element alignment for ``AdamW8bit`` included); ``None`` leaves the default.
The values never depend on the layout: only where rank ranges begin and end.

A ``ShardPlacementResult`` whose mesh is the group's own is its placement. Another mesh is
that parameter's own mesh (expert parallelism): design note [fsdp-param-mesh].
A placement that is not a ``Shard`` (``Replicate``, ``RaggedShard``) or a ``Shard`` of a 0-D
parameter cannot be expressed and is refused, naming the parameter.

``dp_mesh_dims`` (torch 2.13's ``DataParallelMeshDims``) means what it means in FSDP2: ``mesh``
is the full SPMD mesh, its dims named by ``shard`` (flattened when several) are the shard dim,
those named by ``replicate`` the HSDP replicate dim; the data-parallel mesh is built by FSDP2's
own ``_get_mesh_info`` (the same flattening, the same process groups). Parameters may be plain
tensors or DTensors on ``mesh`` that are ``Replicate()`` on every dim (FSDP2's input contract on
the DP dims); the other dims must have size 1, since a DTensor sharded on them (tensor or
expert parallelism) is not composed with here: refused, naming the dim. A replicate-only
``dp_mesh_dims`` (DDP) is refused too: this engine always shards.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["dp_mesh", "local_value", "placement_results", "placement_units", "shard_units"]


def _shard_placement_result_cls() -> type | None:
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    except ImportError:  # an older torch: no per-parameter meshes at all
        return None
    return ShardPlacementResult


def placement_units(shard_placement_fn: Callable[[nn.Parameter], Any] | None,
                    named: Sequence[tuple[str, nn.Parameter]],
                    mesh: DeviceMesh) -> dict[str, int]:
    """Elements each parameter's rank ranges must keep whole because ``shard_placement_fn``
    returned ``Shard(d)`` for it (design note [fsdp-shard-placement]); parameters for which it
    returned ``None`` are absent. The meshes it returned are :func:`placement_results`'."""
    dims = placement_results(shard_placement_fn, named, mesh)[0]
    shapes = dict((n, tuple(p.shape)) for n, p in named)
    return {n: shard_units(n, shapes[n], d) for n, d in dims.items()}


def placement_results(shard_placement_fn: Callable[[nn.Parameter], Any] | None,
                      named: Sequence[tuple[str, nn.Parameter]], mesh: DeviceMesh | None
                      ) -> tuple[dict[str, int], dict[str, DeviceMesh]]:
    """``(dims, meshes)``: the dim ``d`` of each ``Shard(d)`` returned (the units to keep whole
    are :func:`shard_units` of the shape the group plans), and the parameters for which
    ``shard_placement_fn`` returned a ``ShardPlacementResult`` on another mesh than ``mesh``
    (the group's), with that mesh (design note [fsdp-param-mesh]). ``fn`` is called once per
    parameter, with the parameter object the user registered (``param in expert_params``
    works).

    Raises:
        TypeError: ``shard_placement_fn`` is not callable.
        ValueError: a result that is not ``None``, a ``Shard`` or a ``ShardPlacementResult``; a
            ``Shard`` of a 0-D parameter or of a dim it does not have; a placement that is not
            a ``Shard``.
        NotImplementedError: a ``ShardPlacementResult`` on another mesh than the group's that
            is neither 1-D nor a 2-D ``(replicate, shard)`` one.
    """
    if shard_placement_fn is None:
        return {}, {}
    if not callable(shard_placement_fn):
        raise TypeError(f"fully_shard(shard_placement_fn=...) must be a callable "
                        f"param -> None | Shard | ShardPlacementResult, got "
                        f"{type(shard_placement_fn).__name__}")
    result_cls = _shard_placement_result_cls()
    dims, meshes = {}, {}
    for name, param in named:
        result = shard_placement_fn(param)
        if result_cls is not None and isinstance(result, result_cls):
            other = _other_mesh(name, result.mesh_info, mesh)
            if other is not None:
                meshes[name] = other
            result = result.placement
        if result is None:
            continue
        if not isinstance(result, Shard) or type(result).__name__ != "Shard":
            raise ValueError(
                f"shard_placement_fn returned {result!r} for parameter {name!r}; fully_shard "
                "takes None (the default layout), Shard(dim) or a ShardPlacementResult with "
                "one of them (FSDP2's types).")
        shard_units(name, tuple(param.shape), result.dim)  # the dim exists
        dims[name] = result.dim
    return dims, meshes


def shard_units(name: str, shape: tuple[int, ...], dim: int) -> int:
    """Elements ``Shard(dim)`` keeps whole in a tensor of ``shape`` (design note
    [fsdp-shard-placement]).

    Raises:
        ValueError: a 0-D ``shape``, or no dim ``dim``.
    """
    if not shape:
        raise ValueError(f"shard_placement_fn returned Shard({dim}) for the 0-D parameter "
                         f"{name!r}; return None for it (a scalar is never split).")
    if not -len(shape) <= dim < len(shape):
        raise ValueError(f"shard_placement_fn returned Shard({dim}) for parameter {name!r} of "
                         f"shape {shape}, which has no dim {dim}.")
    dim %= len(shape)
    return max(math.prod(shape[dim + 1:]), 1)


def _other_mesh(name: str, mesh_info: Any, mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The mesh of a ``ShardPlacementResult`` when it is not the group's (``None`` if it is)."""
    other = getattr(mesh_info, "mesh", None)
    if not isinstance(other, DeviceMesh):
        raise ValueError(f"shard_placement_fn returned a ShardPlacementResult for parameter "
                         f"{name!r} whose mesh_info has no DeviceMesh ({mesh_info!r}); build it "
                         "with torch's FSDPMeshInfo(mesh, shard_mesh_dim=0).")
    if other is mesh or (isinstance(mesh, DeviceMesh) and _same_mesh(other, mesh)):
        return None
    replicate = getattr(mesh_info, "replicate_mesh_dim", None)
    shard = getattr(mesh_info, "shard_mesh_dim", None)
    fsdp = other.ndim == 1 and replicate is None
    hsdp = other.ndim == 2 and replicate == 0 and shard == 1
    if not (fsdp or hsdp):
        raise NotImplementedError(
            f"shard_placement_fn returned a ShardPlacementResult for parameter {name!r} on a "
            f"mesh of its own ({other}, replicate dim {replicate}, shard dim {shard}); "
            "lightning_vescale's fully_shard takes per-parameter meshes that are 1-D (FSDP over "
            "the expert-data-parallel dim, e.g. torchtitan's 'efsdp') or 2-D (replicate, shard) "
            "HSDP ones (torchtitan's ('dp_replicate', 'efsdp')), as FSDP2's FSDPMeshInfo / "
            "HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0) build them.")
    return other


def _same_mesh(a: DeviceMesh, b: DeviceMesh) -> bool:
    return (a.device_type == b.device_type and a.mesh.tolist() == b.mesh.tolist()
            and all(a.get_group(d) is b.get_group(d) for d in range(a.ndim)))


def with_units(granularities: dict[str, int], units: dict[str, int]) -> dict[str, int]:
    """``granularities`` with each ``units`` entry folded in by least common multiple."""
    return {n: math.lcm(g, units[n]) if n in units else g for n, g in granularities.items()}


def dp_mesh(mesh: DeviceMesh | None, dp_mesh_dims: Any) -> DeviceMesh | None:
    """The data-parallel mesh ``dp_mesh_dims`` names in the full SPMD ``mesh`` (FSDP2's
    meaning, built by FSDP2's own helper); ``mesh`` itself when ``dp_mesh_dims`` is ``None``.

    Raises:
        TypeError: ``dp_mesh_dims`` is not a ``DataParallelMeshDims``.
        ValueError: no ``mesh``, a name it does not have, or a non-data-parallel dim of size > 1.
        NotImplementedError: replicate-only ``dp_mesh_dims`` (DDP).
    """
    if dp_mesh_dims is None:
        return mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

    if not isinstance(dp_mesh_dims, DataParallelMeshDims):
        raise TypeError(f"fully_shard(dp_mesh_dims=...) must be a torch.distributed.fsdp."
                        f"DataParallelMeshDims or None, got {type(dp_mesh_dims).__name__}")
    if not isinstance(mesh, DeviceMesh) or not mesh.mesh_dim_names:
        raise ValueError("fully_shard(dp_mesh_dims=...) needs mesh= the full SPMD DeviceMesh "
                         f"with named dims (FSDP2's meaning), got mesh={mesh!r}")
    names = tuple(mesh.mesh_dim_names)
    dp_names = (*dp_mesh_dims.shard_names, *dp_mesh_dims.replicate_names)
    unknown = [n for n in dp_names if n not in names]
    if unknown:
        raise ValueError(f"fully_shard(dp_mesh_dims={dp_mesh_dims}): mesh dims {unknown} are "
                         f"not in the mesh's dims {names}")
    if not dp_mesh_dims.shard_names:
        raise NotImplementedError(
            f"fully_shard(dp_mesh_dims={dp_mesh_dims}) names no shard dim (replicate only: "
            "DDP); lightning_vescale's fully_shard always shards. Name the data-parallel dim "
            "as shard=..., or use DDP (torch.distributed.fsdp's replicate) for it.")
    others = [(n, mesh.size(i)) for i, n in enumerate(names) if n not in dp_names]
    wide = [(n, s) for n, s in others if s > 1]
    if wide:
        raise ValueError(
            f"fully_shard(dp_mesh_dims={dp_mesh_dims}): the mesh's non-data-parallel dims "
            f"{wide} have more than one rank (tensor/context/expert parallelism); "
            "lightning_vescale's fully_shard does not compose with parameters sharded on them. "
            "Use a mesh whose other dims have size 1.")
    return _get_mesh_info(mesh, dp_mesh_dims).mesh


def local_value(name: str, param: nn.Parameter, spmd_mesh: DeviceMesh | None) -> torch.Tensor:
    """The full value of a parameter handed to ``fully_shard(dp_mesh_dims=...)``: a plain
    tensor, or a DTensor on the SPMD mesh, ``Replicate()`` on every dim (its local tensor).

    Raises:
        ValueError: a DTensor on another mesh or with another placement.
    """
    data = param.detach()
    if not isinstance(data, DTensor):
        return data
    if spmd_mesh is None or data.device_mesh != spmd_mesh or \
            any(not isinstance(p, Replicate) for p in data.placements):
        raise ValueError(
            f"parameter {name!r} is a DTensor with placements {data.placements} on "
            f"{data.device_mesh}; with dp_mesh_dims, fully_shard takes DTensors on mesh= (the "
            "full SPMD mesh) that are Replicate() on every dim, or plain tensors.")
    return data.to_local()
