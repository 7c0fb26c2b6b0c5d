"""``fully_shard`` over tensor-parallel parameters (FSDP2 + TP's contract).

Design note [fsdp-tp]
---------------------
Lightning's ``ModelParallelStrategy`` and torchtitan apply a TP plan first
(``parallelize_module`` on ``mesh["tp"]``: parameters become DTensors ``Shard(0)`` /
``Shard(1)`` / ``Replicate()`` on the tp mesh), then ``fully_shard(module, mesh=mesh["dp"])``.
As FSDP2's ``FSDPParam._init_sharded_param`` does with its ``_tp_spec``, each rank's *TP-local*
tensor is what the group plans and shards: the planner lays it out on the data-parallel dim
(units and block alignment as for any tensor of that shape), the DBuffer holds it, and
reduce-scatter runs over dp only (TP's own collectives run inside autograd). The two parameter
objects of design note [fsdp-param-objects] become:

* ``sharded``: a DTensor on the 2-D ``(dp, tp)`` mesh with placements
  ``(RaggedShard, <tp placement>)``, the strided form of design note [ragged-tp]
  (``full_tensor()`` and ``redistribute`` go through it); its local tensor is the DBuffer shard.
  With HSDP (``fully_shard(..., mesh=mesh["dp_replicate", "dp_shard"])``, torchtitan's 3-D
  mesh) it is a DTensor on the 3-D ``(dp_replicate, dp_shard, tp)`` mesh with placements
  ``(Replicate(), RaggedShard, <tp placement>)``: the group's HSDP engine (reduce-scatter over
  dp_shard, all-reduce over dp_replicate) runs on the TP-local tensors unchanged.
* ``unsharded``: a DTensor on the tp mesh with the TP placements, whose local tensor is the
  DBuffer's unsharded view: the module sees exactly what TP gave it, so TP's hooks work
  unchanged. Its ``.grad`` is pre-set to a DTensor over the grad buffer's view, so
  ``AccumulateGrad`` adds in place into the buffer (zero-copy, as for plain tensors).

Supported: a 1-D data-parallel mesh or a 2-D HSDP one (named sub-meshes of the root mesh the
tp mesh is a sub-mesh of: the composed mesh is built from the *dp* mesh's root, since DTensor's
sharding caches may hand back an equal tp mesh object that hangs under an earlier root of
another shape), 1-D tp meshes, ``Shard(k)``/``Replicate()`` TP placements (sequence-parallel
norms included), AdamW/SGD-style optimizers (element-wise on the local shards), ``AdamW8bit``
(its blocks cut from each rank's TP-local tensor: ``optim/_base.py``'s TP layout; the default
granularity of a TP parameter is decided on its global shape, :func:`tp_default_granularity`),
Muon/SOAP/Shampoo on (dp, tp) meshes (each matrix gathered whole to an owner over both dims:
design note [tp-matrix-optim]) and on HSDP + TP ones (the same within each replica's
(dp_shard, tp) ranks, replicas stepping alike), ``comm_policy`` on the dp dim (the quantized
buffers hold TP-local tensors, so blocks never cross a tp rank), mixed precision,
``lightning_vescale.precision.clip_grad_norm_``, full state dicts (with ``broadcast_from_rank0``
too), DCP checkpoints, ``save_safetensors``/``load_safetensors`` (each rank its runs of its
TP-local box: ``placement._ragged_tp.tp_flat_runs``), activation checkpointing and
``torch.compile`` per block, ``shard_placement_fn`` (units of the TP-local shape; a mesh of
its own for expert parallelism: design note [fsdp-param-mesh]), and TP parameters on the meta
device (FSDP2's meta flow and torchtitan's trainer: the TP plan and ``fully_shard`` on meta,
the DBuffer and both parameter objects on meta until ``to_empty()``/``materialize``; init ops on
the sharded DTensors write each rank's part of its TP-local box with one process's values,
design note [ragged-random]; ``materialize`` initialises full-size temporaries of the global
shape, :func:`load_full_`). torch's own FSDP2 + TP tests run on both engines in
``tests/distributed/test_fsdp2_compat_tp.py``. Refused with a message
(:func:`~lightning_vescale.fsdp._param_mesh.refuse_unsupported` and the optimizers' own
checks): CPU offload, ``dp_mesh_dims`` (a TP DTensor is not ``Replicate`` on the SPMD mesh:
:func:`~lightning_vescale.fsdp._shard_placement.local_value`), ``reshard_after_forward=<int>``,
FlatParamOptimizer, and a TP plan applied after ``fully_shard``
(:func:`check_not_ragged`; ``distribute_tensor`` of a RaggedShard DTensor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from lightning_vescale.placement import RaggedShard
from lightning_vescale.placement._ragged_tp import copy_runs_, rank_flat_runs

__all__ = ["TPSpec", "load_full_", "tp_default_granularity", "tp_param_spec", "tp_unsharded"]


@dataclass(frozen=True, kw_only=True)
class TPSpec:
    """How a parameter was tensor-parallel before ``fully_shard`` (design note [fsdp-tp])."""

    #: the ``(dp, tp)`` mesh of the sharded parameter (``(dp_replicate, dp_shard, tp)``: HSDP)
    mesh: DeviceMesh
    tp_mesh: DeviceMesh  #: the tp mesh of the unsharded parameter
    placements: tuple[Placement, ...]  #: the TP placements (one per tp mesh dim)
    shape: tuple[int, ...]  #: the global shape
    stride: tuple[int, ...]  #: the global stride


def _root(mesh: DeviceMesh) -> DeviceMesh:
    root = mesh._get_root_mesh()
    return mesh if root is None else root


def check_not_ragged(name: str, param: torch.Tensor) -> None:
    """Refuse a parameter that is already a RaggedShard DTensor (sharded by ``fully_shard``,
    then handed to a TP plan or to ``fully_shard`` again)."""
    if isinstance(param, DTensor) and any(isinstance(p, RaggedShard) for p in param.placements):
        raise ValueError(
            f"parameter {name!r} is already sharded by lightning_vescale's fully_shard "
            f"(placements {param.placements}); a tensor-parallel plan must be applied before "
            "fully_shard (parallelize_module(model, mesh['tp'], plan), then fully_shard(..., "
            "mesh=mesh['dp'])), as with FSDP2 + TP.")


def tp_param_spec(name: str, param: nn.Parameter, dp: DeviceMesh | None) -> TPSpec | None:
    """The :class:`TPSpec` of a DTensor parameter (``None`` for a plain tensor).

    Raises:
        ValueError: a RaggedShard DTensor, no ``mesh=``, a dp mesh of more than 2 dims, a tp
            mesh that is not a named 1-D sub-mesh of the dp mesh's root, or a
            ``Partial``/other placement.
    """
    if not isinstance(param, DTensor):
        return None
    check_not_ragged(name, param)
    tp_mesh = param.device_mesh
    placements = tuple(param.placements)
    if dp is None:
        raise ValueError(
            f"parameter {name!r} is a tensor-parallel DTensor on {tp_mesh}; pass fully_shard("
            "..., mesh=device_mesh['dp']) the data-parallel sub-mesh of the same (dp, tp) mesh "
            "(FSDP2 + TP's convention).")
    if dp.ndim not in (1, 2):
        raise ValueError(
            f"parameter {name!r}: the data-parallel mesh must be 1-D (dp) or 2-D (dp_replicate, "
            f"dp_shard: HSDP), got a {dp.ndim}-D mesh {dp}; pass mesh=device_mesh['dp'] or "
            "device_mesh['dp_replicate', 'dp_shard'], not the mesh with the tp dim.")
    if tp_mesh.ndim != 1 or any(not isinstance(p, (Shard, Replicate)) or
                                isinstance(p, RaggedShard) for p in placements):
        raise ValueError(
            f"parameter {name!r}: fully_shard takes tensor-parallel DTensors on a 1-D tp mesh "
            f"with Shard(k) or Replicate() placements, got {placements} on {tp_mesh}.")
    if type(placements[0]) is not Shard and not isinstance(placements[0], Replicate):
        raise ValueError(f"parameter {name!r}: unsupported TP placement {placements[0]!r} "
                         "(strided or custom shards); use Shard(k) or Replicate().")
    # dp's root, not tp_mesh's: DTensor's sharding caches may hand back an equal tp mesh
    # (same ranks and name) that hangs under an earlier root mesh of another shape
    root = _root(dp)
    names = (*(dp.mesh_dim_names or (None,) * dp.ndim), *(tp_mesh.mesh_dim_names or (None,)))
    if None in names or len(set(names)) != len(names) or not _same_root(root, tp_mesh, names[-1]):
        raise ValueError(
            f"parameter {name!r}: the tp mesh {tp_mesh} and the data-parallel mesh {dp} must be "
            "named sub-meshes of one DeviceMesh; pass mesh=device_mesh['dp'] (HSDP: "
            "device_mesh['dp_replicate', 'dp_shard']) of the mesh whose 'tp' dim the TP plan "
            "used (init_device_mesh(..., mesh_dim_names=('dp', 'tp'))).")
    mesh2d = _mesh_2d(name, root, names, dp, tp_mesh)
    return TPSpec(mesh=mesh2d, tp_mesh=tp_mesh, placements=placements,
                  shape=tuple(param.shape), stride=tuple(param.stride()))


def tp_default_granularity(granularity: Any, tp: dict[str, TPSpec]) -> Any:
    """``granularity=None`` with TP parameters ``tp``: the default granularity decided on a TP
    parameter's GLOBAL shape (as ``AdamW8bit``'s ``min_8bit_size`` is), applied to its TP-local
    tensor, so a tensor AdamW8bit quantizes is block-aligned within its TP-local shard even
    when that shard is below the size threshold. A callable, so it stays a computed default
    (rounded up to a comm policy's blocks). Any other ``granularity``: unchanged."""
    if granularity is not None or not tp:
        return granularity
    from lightning_vescale.planner._granularity import default_granularity

    def by_global_shape(name: str, param: torch.Tensor) -> int:
        return default_granularity(tp[name].shape if name in tp else tuple(param.shape))

    return by_global_shape


def tp_unsharded(view: torch.Tensor, spec: TPSpec, requires_grad: bool) -> nn.Parameter:
    """The unsharded parameter: a tp-mesh DTensor over the DBuffer's unsharded ``view``."""
    dt = DTensor.from_local(view, spec.tp_mesh, spec.placements, run_check=False,
                            shape=torch.Size(spec.shape), stride=spec.stride)
    return nn.Parameter(dt.detach(), requires_grad=requires_grad)


def load_full_(mp: Any, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` (the global tensor) into managed parameter ``mp``'s
    shard: its range, or for a TP parameter its range of its TP-local box (design note
    [ragged-tp])."""
    buf = mp.buffer
    assert buf is not None
    if mp.tp is None:
        buf.load_local_(mp.name, full)
        return
    view = buf.local_view(mp.name)
    if view.numel():
        with torch.no_grad():
            copy_runs_(view, full.detach(), rank_flat_runs(
                tuple(full.shape), mp.tp.mesh, tuple(mp.placements), "materialize"))


def tp_grad(view: torch.Tensor, spec: TPSpec) -> DTensor:
    """A tp-mesh DTensor over a grad buffer view (the unsharded parameter's ``.grad``)."""
    return DTensor.from_local(view, spec.tp_mesh, spec.placements, run_check=False,
                              shape=torch.Size(spec.shape), stride=spec.stride).detach()


def _same_root(root: DeviceMesh, tp_mesh: DeviceMesh, tp_name: str) -> bool:
    """Whether ``tp_mesh`` hangs under ``root`` (the dp mesh's root), or is an equal mesh that
    DTensor's sharding caches handed back from an earlier root of another shape."""
    if _root(tp_mesh) == root:
        return True
    try:
        return root[tp_name] == tp_mesh
    except KeyError:
        return False


def _mesh_2d(name: str, root: DeviceMesh, names: tuple, dp: DeviceMesh,
             tp_mesh: DeviceMesh) -> DeviceMesh:
    """The 2-D ``(dp, tp)`` mesh: the root's, sliced by name, or, for sub-meshes of a mesh
    unflattened from the root (torchtitan's ``("efsdp", "ep")`` sparse mesh, design note
    [fsdp-param-mesh]), the two concatenated (what FSDP2's ``_init_sharded_dtensor_param``
    does).

    Raises:
        ValueError: the two meshes share ranks (e.g. expert DTensors on ``"ep"`` sharded on the
            dense ``"fsdp"`` mesh instead of the ``"efsdp"`` one), naming the parameter.
    """
    if tuple(root.mesh_dim_names or ()) == names:
        return root
    try:
        return root[names]
    except KeyError:
        pass
    try:
        return DeviceMesh._concatenate([dp, tp_mesh])
    except RuntimeError as e:
        raise ValueError(
            f"parameter {name!r} is a DTensor on {tp_mesh}, which shares ranks with its "
            f"data-parallel mesh {dp} ({e}); shard it over the complementary dim: for expert "
            "parallelism, return ShardPlacementResult(placement, FSDPMeshInfo(mesh['efsdp'], "
            "shard_mesh_dim=0)) for it from shard_placement_fn (torchtitan's "
            "apply_fsdp_to_decoder does).") from e
